"""The readiness sensor's failure message: one line that leads with the cause; each replica's
load read from its lines."""

import pytest

from eyas.server.readiness import ServerFailed, cause_line, replica_load

USAGE = [
    "usage: eyas serve-local [-h] --model-path MODEL_PATH [--api-key API_KEY]",
    "                        [--port PORT] [--host HOST]",
    *[f"                        [--option-{i} OPTION_{i}]" for i in range(18)],
    "eyas serve-local: error: unrecognized arguments: --bogus-flag",
]


def test_argparse_error_line_is_the_cause_not_the_usage_text():
    assert cause_line(USAGE) == "eyas serve-local: error: unrecognized arguments: --bogus-flag"


def test_a_python_exceptions_last_line_is_the_cause_timestamps_dropped():
    lines = [
        "[2026-12-06 07:12:13] Load weight begin.",
        "Traceback (most recent call last):",
        '  File "x.py", line 3, in <module>',
        "[2026-12-06 07:12:14 TP0] torch.OutOfMemoryError: CUDA out of memory. Tried 2.00 GiB",
        "[2026-12-06 07:12:14] SIGQUIT received. signum=None, frame=None.",
    ]
    assert cause_line(lines) == "torch.OutOfMemoryError: CUDA out of memory. Tried 2.00 GiB"


def test_a_fatal_line_without_an_exception_line_is_the_cause():
    lines = ["loading", "NCCL error in: init.cc:123, unhandled system error", "bye"]
    assert cause_line(lines) == "NCCL error in: init.cc:123, unhandled system error"
    assert cause_line(["starting", "loading"]) is None


def test_a_server_that_died_at_launch_fails_in_one_short_line_cause_first():
    e = ServerFailed(
        "process died",
        USAGE,
        "server process 4242 exited before it was ready (log /runs/x/server/server.log on "
        "localhost, pid 4242)",
    )
    message = str(e)
    assert message.startswith("eyas serve-local: error: unrecognized arguments: --bogus-flag ("), (
        message
    )
    assert "\n" not in message and len(message) <= 260, message
    assert "process died: server process 4242" in message
    # the usage text stays in the log tail, whole, with argparse's metavar unmasked
    assert e.log_tail().splitlines() == USAGE


def test_a_stall_names_itself_and_never_an_old_exception_line():
    e = ServerFailed("stalled", ["ValueError: harmless", "loading 3/8"], "no progress for 61.0s")
    assert str(e) == "stalled: no progress for 61.0s"


def test_a_long_cause_and_detail_are_cut_to_fit():
    e = ServerFailed("crashed", ["RuntimeError: " + "x" * 400], "where " * 80)
    message = str(e)
    assert len(message) <= 260 and message.startswith("RuntimeError: xxx"), message
    assert "(crashed: where" in message


@pytest.mark.parametrize(
    "line, load",
    [
        ("[2026-12-06 10:00:00 DP1 TP0] Load weight begin. avail mem=70.1 GB", ("DP1", "loading")),
        (
            "[2026-12-06 10:02:31 DP12 TP3 EP3] Load weight end. elapsed=151.2 s, type=X",
            ("DP12", "loaded"),
        ),
        # another process's bar update ran into the line ahead of it
        (
            "\rMulti-thread loading shards:  50% Completed | 32/64 [01:10<01:10,  2.2s/it]"
            "[2026-12-06 10:01:00 DP3 TP0] Load weight end. elapsed=70.0 s",
            ("DP3", "loaded"),
        ),
        ("[2026-12-06 10:00:00 TP0] Load weight begin. avail mem=70.1 GB", None),  # no DP rank
        ("[2026-12-06 10:00:00] Load weight begin. avail mem=70.1 GB", None),
        ("[2026-12-06 10:00:00 DP1 TP0] Memory pool end. avail mem=10.0 GB", None),
    ],
)
def test_a_replicas_load_is_read_from_its_ranked_lines(line, load):
    assert replica_load(line) == load
