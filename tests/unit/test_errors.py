"""eyas/errors.py: every error eyas raises is an EyasError that says whether a retry can help, and
retry_can_help reads that through the chain of causes (what the tasks' one retry condition asks)."""

import errno

from eyas.errors import EyasError, retry_can_help
from eyas.extraction.client import RequestFailed, ServersGone, ServerStalled
from eyas.files import DiskFull
from eyas.server.hosts import HostAuthError, HostConfigError, HostUnreachable
from eyas.server.launch import LaunchError
from eyas.server.patch_sets import PatchError


def _wrapped(inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise RuntimeError("extract-shard-00001 failed") from e
    except RuntimeError as outer:
        return outer


def test_what_a_retry_cannot_help_is_refused_however_it_is_wrapped():
    never = [
        HostAuthError("gpu", "denied"),
        HostConfigError("gpu", "no known_hosts"),
        LaunchError("port taken"),
        PatchError("unknown version"),
        ServersGone("r", "gone", transient=True),
        ServerStalled("r", "stalled", transient=True),
        RequestFailed("r", "answered 400", transient=False),
        DiskFull(errno.ENOSPC, "disk full writing x"),
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
    ]
    for e in never:
        assert not retry_can_help(e), e
        assert not retry_can_help(_wrapped(e)), e
    for e in (
        HostUnreachable("gpu", "timed out"),
        RequestFailed("r", "connection reset", transient=True),
        OSError(errno.EIO, "Input/output error"),
        ConnectionResetError("reset"),
        TimeoutError(),
    ):
        assert retry_can_help(e) and retry_can_help(_wrapped(e)), e


def test_eyas_errors_keep_the_builtin_base_their_callers_catch():
    from eyas.config import ConfigError
    from eyas.extraction.data import DataError

    assert issubclass(ConfigError, ValueError) and issubclass(DataError, ValueError)
    assert issubclass(DiskFull, OSError) and issubclass(LaunchError, RuntimeError)
    for cls in (
        ConfigError,
        DataError,
        DiskFull,
        LaunchError,
        HostAuthError,
        PatchError,
        RequestFailed,
    ):
        assert issubclass(cls, EyasError), cls
    assert not retry_can_help(
        ConfigError("bad field")
    )  # an eyas error says no unless its class says yes


#: Builtin exceptions eyas raises on purpose only where a caller's contract asks for them: pydantic
#: validators (eyas/config/, wrapped into ConfigError), the dump writer that runs inside SGLang
#: without eyas (DumpError is its ValueError), and misuse of an object by code (a programming
#: error).
BUILTIN_ALLOWED = {
    "eyas/extraction/client.py": {"RuntimeError"},  # ServerPool used after close()
    "eyas/training/ema.py": {"RuntimeError"},  # update() while the average is swapped in
    "eyas/local/engine.py": {"RuntimeError"},  # the fault injection's simulated crash
    # I/O failures raised as the file system raises them, where callers handle OSError
    "eyas/server/ssh_host.py": {"OSError"},  # `cat` of a remote file failed
    "eyas/training/loader.py": {"OSError"},  # a short read of a shard
}
BUILTINS = {
    "ValueError",
    "RuntimeError",
    "TypeError",
    "KeyError",
    "OSError",
    "Exception",
    "IOError",
}


def builtin_raises(source: str) -> list[tuple[int, str]]:
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            name = getattr(node.exc.func, "id", None)
            if name in BUILTINS:
                found.append((node.lineno, name))
    return sorted(found)


def test_every_error_eyas_raises_on_purpose_is_an_eyas_error():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    bad = []
    for folder in ("eyas", "flows", "tasks"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel.startswith("eyas/config/") or rel == "eyas/dump.py":
                continue
            bad += [
                f"{rel}:{line} raises {name}"
                for line, name in builtin_raises(path.read_text())
                if name not in BUILTIN_ALLOWED.get(rel, set())
            ]
    assert not bad, (
        "raise an EyasError subclass (eyas/errors.py InvalidInput, or the module's own):\n"
        + "\n".join(bad)
    )


def test_the_raise_walk_sees_builtin_raises():
    assert builtin_raises(
        "def f():\n    raise ValueError('x')\nraise KeyError(1)\nraise Mine('y')\n"
    ) == [(2, "ValueError"), (3, "KeyError")]


def test_a_shard_stopped_with_the_pool_stays_a_follower_through_pickling():
    """Prefect hands a failed shard task's error back unpickled, without its chain: the shard error
    that only points at another one is known by its class, and the stage picks the one naming the
    cause."""
    import pickle

    from eyas.extraction.client import PoolStopped, is_follower, naming_the_cause
    from eyas.extraction.extract import ExtractionError, ShardStopped

    named = ExtractionError("shard-00001 sequence 3: rid a: server stalled: no reply for 60 s")
    try:
        raise PoolStopped("b", "given up with every request in flight", transient=False)
    except PoolStopped as e:
        follower = ShardStopped(f"shard-00002 sequence 0: {e}")
    back = pickle.loads(pickle.dumps(follower))
    assert back.__cause__ is None and is_follower(back) and not back.retryable
    assert not is_follower(pickle.loads(pickle.dumps(named)))
    assert naming_the_cause(back, [None, back, named]) is named
    assert naming_the_cause(named, [back]) is named
    assert naming_the_cause(back, [back]) is back  # no error names it: the follower's own


def test_the_error_naming_the_cause_keeps_its_kind_when_raised_while_a_follower_is_handled():
    """A shard's first failed sequence may be a follower; the shard then raises the sequence error
    that names the stall from inside that `except`. The named error keeps what it was raised from
    (not retryable) and does not take on the follower it was raised beside."""
    from eyas.errors import causes
    from eyas.extraction.client import PoolStopped, ServerStalled, is_follower, naming_the_cause
    from eyas.extraction.extract import ExtractionError

    try:
        raise ServerStalled("a", "server stalled: no reply for 60 s", transient=False)
    except ServerStalled as e:
        named = ExtractionError(f"shard-00001 sequence 0: {e}")
        named.__cause__ = e
        named.__suppress_context__ = True  # as `raise ... from e` leaves it
    try:
        try:
            raise PoolStopped("b", "given up with every request in flight", transient=False)
        except PoolStopped as follower:
            cause = naming_the_cause(follower, [named])
            raise cause from cause.__cause__  # as the shard and the stage raise it
    except ExtractionError as e:
        raised = e
    assert raised is named
    assert raised.__context__ is not None  # Python set the follower as its context ...
    assert [type(e).__name__ for e in causes(raised)] == ["ExtractionError", "ServerStalled"]
    assert not is_follower(raised) and not retry_can_help(raised)  # ... and it is not read


def test_the_chain_is_what_a_traceback_prints():
    from eyas.errors import causes

    try:
        try:
            raise KeyError("inner")
        except KeyError:
            raise ValueError("during") from None
    except ValueError as hidden:
        assert list(causes(hidden)) == [hidden]
    try:
        try:
            raise KeyError("inner")
        except KeyError:
            raise ValueError("during")  # noqa: B904 - the implicit context is part of the chain
    except ValueError as during:
        assert [type(e) for e in causes(during)] == [ValueError, KeyError]
