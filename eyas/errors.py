"""The base of every error eyas raises, and whether retrying the work that raised it can help.

    class LaunchError(EyasError, RuntimeError):
        retryable = False   # a refused launch is refused again

An eyas error names what is wrong and where; `retryable` says whether the same call may succeed
later (a dropped connection, a server still loading) or never will as things stand (bad input, a
full disk, a refused login). Subclasses keep the builtin base callers catch (ValueError, OSError,
RuntimeError) beside this one. The task layer retries a failure only when `retry_can_help` says so.
"""

from __future__ import annotations

import errno
from typing import Iterator


class EyasError(Exception):
    """An error eyas raised itself: its message is the whole story (no traceback needed)."""

    #: whether the same call may succeed if tried again; a class that can pass says True
    retryable: bool = False


class InvalidInput(EyasError, ValueError):
    """Input eyas cannot work with as given (a file, a folder, a setting, an argument), named with
    where it is wrong. Never worth a retry: it stays wrong until someone changes it."""


def causes(exc: BaseException | None) -> Iterator[BaseException]:
    """exc, then what it was raised from or during, outermost first (each once): the chain a
    traceback prints. A context hidden by `raise ... from` is not part of it: an error re-raised
    while another was being handled would otherwise take on that other error's kind."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def retry_can_help(exc: BaseException) -> bool:
    """False when anything in exc's chain says a retry cannot help: an eyas error that is not
    retryable, or a full disk (a bare ENOSPC or EDQUOT from a writer that does not name its file yet
    stays full all the same). Anything else (a dropped connection, a timeout, an I/O error) may
    pass."""
    for link in causes(exc):
        if isinstance(link, EyasError) and not link.retryable:
            return False
        if isinstance(link, OSError) and link.errno in (errno.ENOSPC, errno.EDQUOT):
            return False
    return True
