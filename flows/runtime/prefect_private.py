"""The private parts of Prefect that eyas uses, in one module, each with the public behaviour it
falls back to, and the Prefect minor versions they were read in (pyproject.toml pins that range;
tests/unit/test_prefect_private.py fails on a Prefect whose private names moved).

    drain_queues(15.0)    # send the queued log batches and events to the API now
    cancel_requested()    # this run's process was told to cancel (not crash) by its runner
"""

from __future__ import annotations

#: Prefect minor versions whose private names below were read and tested
TESTED_MINORS = ("3.9",)


def tested_version(version: str | None = None) -> bool:
    """Whether this Prefect (or `version`) is of a minor version the names here were read in.
    Prefect is imported only when asked: eyas run sets its settings before the first import."""
    if version is None:
        import prefect

        version = prefect.__version__
    return ".".join(version.split(".")[:2]) in TESTED_MINORS


def drain_queues(timeout_s: float) -> bool:
    """Drain every Prefect queue service (APILogWorker, EventsWorker) through their common private
    base -> False where that base is gone (the caller then flushes the logs through the public
    handler)."""
    try:
        from prefect._internal.concurrency.services import _QueueServiceBase
    except ImportError:
        return False
    _QueueServiceBase.drain_all(timeout=timeout_s)
    return True


def cancel_requested() -> bool:
    """Whether the runner's control listener was told to cancel this process (False where Prefect
    has no such listener)."""
    try:
        from prefect._internal.control_listener import get_intent
    except ImportError:
        return False
    intent = get_intent()
    return intent is not None and "cancel" in str(getattr(intent, "value", intent)).lower()
