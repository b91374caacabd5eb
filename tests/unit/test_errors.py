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
