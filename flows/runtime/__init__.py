"""What runs the flows rather than what they do: the `eyas` command line (cli.py), `eyas run`'s
process with its temporary Prefect server and signal handling (process.py), and the lock that keeps
one server per GPU host across runs (host_lock.py)."""
