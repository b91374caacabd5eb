"""A failed run's reason, first and once: `failed at TASK: reason` in the run's state message, one
log line, a markdown artifact; a cancel that reads as a cancel.

Prefect repeats a failure at every level: the task's error line and its traceback, the task's final
state, every enclosing flow's "Encountered exception" traceback and final state, and, under a
worker, "Engine execution exited with unexpected exception" with the traceback once more. Here:

- `ReasonFilter`, on Prefect's task-run and flow-run loggers, turns the task's error record into the
  one line `failed at TASK: reason` (without a traceback when eyas raised the error itself: its
  message is the whole story; a bug keeps its traceback), remembers which task failed with which
  exception, and shortens the later records that would repeat the reason. Shards that a stalled
  or gone server fails together say so once: the others read `TASK stopped by the same cause`.
- `checked_flow` (flows/common.py) turns whatever a flow body raises into `Failed("failed at TASK:
  reason")` carrying the exception (callers' `state.result()` still raise it) and writes the
  top-level run's artifact `failure-NAME`.
- On an operator's cancel, Prefect's "Crash detected! ... termination signal" and "Finished in state
  Running()" lines read "cancelled".
"""

from __future__ import annotations

import collections
import logging
import re
import threading

from eyas.config import ConfigError
from eyas.errors import EyasError

LOGGERS = ("prefect.task_runs", "prefect.flow_runs")
MAX_REASON = 2000  # a state message is shown whole on the run page; a preflight list can be long

_lock = threading.Lock()
_task_of: dict[
    tuple[str, str], str
] = {}  # (exception type, message) -> the task run that raised it
#: lines already printed -> the flow run whose log has them
_printed: collections.OrderedDict[str, str | None] = collections.OrderedDict()
_recent: collections.deque[str] = collections.deque(maxlen=20)  # WARNING+ lines: the artifact's log
_shared_causes: set[str] = set()  # a stalled or gone server's reasons, once a task reported one


def eyas_raised(exc: BaseException) -> bool:
    """An error eyas raised itself (config, preflight, a busy output dir, a host, a launch...): its
    message names what is wrong and what to do; a traceback would only bury it."""
    return isinstance(exc, EyasError)


def reason_of(exc: BaseException) -> str:
    """An exception as one line: eyas's own by its message, anything else with its type."""
    text = str(exc).strip()
    if isinstance(exc, ConfigError):
        from flows.common import one_line

        text = one_line(exc) + " (fix the config file or the run's overrides)"
    text = (
        "; ".join(line.strip() for line in text.splitlines() if line.strip()) or type(exc).__name__
    )
    if not eyas_raised(exc):
        text = f"{type(exc).__name__}: {text}"
    return text[:MAX_REASON]


def failure_line(exc: BaseException, where: str) -> str:
    """`failed at TASK: reason`: TASK the task run that raised it (else `where`, the flow's
    stage)."""
    text = str(exc)
    if text.startswith("failed at "):  # a subflow's own line, passed up as it is
        return text.splitlines()[0][:MAX_REASON]
    task = getattr(exc, "eyas_failed_task", None)
    with _lock:
        task = (
            task
            or _task_of.get((type(exc).__name__, text))
            or _task_of.get((type(exc).__name__, ""))
        )
    return f"failed at {task or where}: {reason_of(exc)}"


def printed(line: str) -> bool:
    with _lock:
        return line in _printed


def printed_by(line: str, flow_run_id: str | None) -> bool:
    """Whether `line` is in the log of the flow run `flow_run_id` (its own tasks' or its own)."""
    with _lock:
        return line in _printed and _printed[line] == flow_run_id


def remember(line: str, flow_run_id: str | None = None) -> None:
    with _lock:
        _printed[line] = flow_run_id
        while len(_printed) > 100:
            _printed.popitem(last=False)


def _cancelling() -> bool:
    from flows.runtime.prefect_private import cancel_requested

    return cancel_requested()


_FINISHED = re.compile(r"^Finished in state (\w+)\((.*)\)$", re.S)
_RAISED = re.compile(r"^Task run encountered an exception (\w+): (.*)$", re.S)


def _eyas_names() -> set[str]:
    """The names of the exception classes eyas defines (loaded so far)."""
    names, todo = set(), [EyasError]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            names.add(sub.__name__)
    return names


class ReasonFilter(logging.Filter):
    """See the module docstring. Never drops or rewrites a record it does not recognise."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return self._filter(record)
        except Exception:  # noqa: BLE001 - a log filter must never break logging
            return True

    def _filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        task = getattr(record, "task_run_name", None)
        if msg.startswith("Task run failed with ") and exc is not None and task:
            # The task's last attempt failed: the one line, and the task remembered for the flow.
            try:
                exc.eyas_failed_task = task
            except Exception:  # noqa: BLE001 - an exception type without a __dict__
                pass
            line = f"failed at {task}: {reason_of(exc)}"
            with _lock:
                _task_of[(type(exc).__name__, str(exc))] = _task_of[(type(exc).__name__, "")] = task
            if _repeats_a_shared_cause(line):
                self._set(record, f"{task} stopped by the same cause", level=logging.INFO)
                return True
            self._set(record, line, keep_traceback=not eyas_raised(exc))
            remember(line, _flow_run_of(record))
        elif (
            msg.startswith("Engine execution exited with unexpected exception") and exc is not None
        ):
            return not getattr(
                exc, "eyas_reported", False
            )  # the state message says it, in one line
        elif msg.startswith("Crash detected!") and _cancelling():
            self._set(record, "cancelled by the operator: stopping", level=logging.WARNING)
        elif m := _FINISHED.match(msg):
            state, inner = m.groups()
            if _cancelling() and state in ("Running", "Crashed", "Cancelling"):
                self._set(record, "Finished: cancelled", level=logging.WARNING)
            elif state in ("Failed", "Crashed", "TimedOut"):
                self._finished_failed(record, state, inner)
        if record.levelno >= logging.WARNING:
            _recent.append(record.getMessage().splitlines()[0][:300] if record.getMessage() else "")
        return True

    def _finished_failed(self, record: logging.LogRecord, state: str, inner: str) -> None:
        text = inner.strip("'\"")
        task = getattr(record, "task_run_name", None)
        if task and any(line.startswith(f"failed at {task}: ") for line in list(_printed)):
            self._set(record, f"Finished in state {state}")  # its error line above says why
            return
        raised = _RAISED.match(text)
        if (
            task and raised
        ):  # a failure a retry condition declined: Prefect logged no error line for it
            kind, message = raised.groups()
            with _lock:
                _task_of[(kind, message)] = _task_of[(kind, "")] = task
            line = f"failed at {task}: " + (
                message if kind in _eyas_names() else f"{kind}: {message}"
            )
            if _repeats_a_shared_cause(line):
                self._set(record, f"{task} stopped by the same cause", level=logging.INFO)
                return
            self._set(record, line[:MAX_REASON])
            remember(line[:MAX_REASON], _flow_run_of(record))
            return
        line = next((p for p in reversed(list(_printed)) if text.startswith(p[:200])), None)
        if text.startswith("failed at ") and line is not None:
            self._set(record, f"Finished in state {state}: {line.split(': ', 1)[0]}")
        elif text.startswith("failed at "):
            remember(text)

    @staticmethod
    def _set(
        record: logging.LogRecord,
        msg: str,
        *,
        keep_traceback: bool = False,
        level: int | None = None,
    ):
        record.msg, record.args = msg, ()
        if not keep_traceback:
            record.exc_info = record.exc_text = None
        if level is not None:
            record.levelno, record.levelname = level, logging.getLevelName(level)


#: a server pool's own reason, after the shard, sequence and request it met it in
_SHARED_CAUSE = re.compile(
    r"rid \S+: ((?:server stalled|every server's process is gone): .*)$", re.S
)


def _repeats_a_shared_cause(line: str) -> bool:
    """Whether the cause of this task's failure already failed another task: a stalled or gone
    server fails every shard in flight, and the first one's line says why (then remembers it)."""
    m = _SHARED_CAUSE.search(line)
    if m is None:
        return False
    with _lock:
        seen = m[1] in _shared_causes
        _shared_causes.add(m[1])
    return seen


def _flow_run_of(record: logging.LogRecord) -> str | None:
    """The flow run whose log a record of Prefect's run loggers goes to."""
    run = getattr(record, "flow_run_id", None)
    return str(run) if run else None


_FILTER = ReasonFilter()


def install() -> None:
    """Put the filter on Prefect's run loggers (idempotent)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def recent_lines() -> list[str]:
    return list(_recent)


def failure_markdown(run_name: str, line: str, lines: list[str], server_log: str = "") -> str:
    """The top-level run's artifact: the reason, the warning and error lines that led to it, and
    the last lines of a server's log where a server failed."""
    log = "\n".join(lines[-15:]) or "(no warnings or errors were logged)"
    text = (
        f"# eyas run `{run_name}` failed\n\n**{line}**\n\n"
        f"Warning and error lines of this run, oldest first:\n\n```\n{log}\n```\n"
    )
    if server_log:
        text += f"\nThe server log's last lines:\n\n```\n{server_log}\n```\n"
    return text
