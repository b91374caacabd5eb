"""A failed run's reason: `failed at TASK: reason` as its final state's message, read by the UI, the
failure webhook (deployments/notifications.py) and `eyas run`'s last line.

    Failed(message=failure_line(error, "extract"), data=error)   # what checked_flow returns

TASK is the task run of this flow run that raised the error, as Prefect's API records it (a failed
subflow is a task run of its parent whose state message is the subflow's own `failed at` line,
passed up as it is); the flow's stage name where no task raised it. Prefect logs the failure itself
(the task's error line, each run's "Finished in state Failed(...)"); `EyasTracebackFilter` on its
run loggers drops the traceback of an error eyas raised on purpose, whose message says what is
wrong and what to do. `failure_artifact_hook` writes the top-level run's artifact `failure-NAME`.
"""

from __future__ import annotations

import logging
import time
from uuid import UUID

from eyas.config import ConfigError
from eyas.errors import EyasError, causes

LOGGERS = ("prefect.task_runs", "prefect.flow_runs")
MAX_REASON = 2000  # a state message is shown whole on the run page; a preflight list can be long
#: how long the API may take to show a failed task run: task run states reach it as events
FIND_TASK_S = 5.0


def eyas_raised(exc: BaseException) -> bool:
    """An error eyas raised itself (config, preflight, a busy output dir, a host, a launch...): its
    message names what is wrong and what to do; a traceback would only bury it."""
    return isinstance(exc, EyasError)


def reason_of(exc: BaseException) -> str:
    """An exception as one line: eyas's own by its message, anything else with its type."""
    text = str(exc).strip()
    if isinstance(exc, ConfigError):
        from eyas_prefect.flows.common import one_line

        text = one_line(exc) + " (fix the config file or the run's overrides)"
    text = (
        "; ".join(line.strip() for line in text.splitlines() if line.strip()) or type(exc).__name__
    )
    if not eyas_raised(exc):
        text = f"{type(exc).__name__}: {text}"
    return text[:MAX_REASON]


class EyasTracebackFilter(logging.Filter):
    """Drops the traceback of a record whose exception is an EyasError. Never changes a record's
    message or level, never drops a record: a bug keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if isinstance(record.exc_info, tuple) else None
        if exc is not None and eyas_raised(exc):
            record.exc_info = record.exc_text = None
        return True


_FILTER = EyasTracebackFilter()


def install() -> None:
    """Put the filter on Prefect's run loggers (idempotent)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def failure_line(error: BaseException, where: str, flow_run_id: UUID | str | None) -> str:
    """`failed at TASK: reason`: TASK the task run of `flow_run_id` that raised `error` (see the
    module docstring), else `where`."""
    text = str(error)
    if text.startswith("failed at "):  # a subflow's state message raised as its error
        return text.splitlines()[0][:MAX_REASON]
    try:
        run = raised_by(flow_run_id, error) if flow_run_id else None
    except Exception:  # noqa: BLE001 - an API that does not answer must not hide the reason
        run = None
    if run is not None and (run.state.message or "").startswith("failed at "):
        return run.state.message[:MAX_REASON]
    return f"failed at {run.name if run else where}: {reason_of(error)}"


def raised_by(flow_run_id: UUID | str, error: BaseException, wait_s: float = FIND_TASK_S):
    """The earliest-ended failed or crashed task run of the flow run whose state message names
    `error` or an error it was raised from, or None once `wait_s` has passed without one."""
    words = [
        str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        for e in causes(error)
    ]
    deadline = time.monotonic() + wait_s
    while True:
        runs = _failed_task_runs(flow_run_id)
        named = [r for r in runs if any(w in (r.state.message or "") for w in words)]
        if named or time.monotonic() > deadline:
            return named[0] if named else None
        time.sleep(0.2)


def _failed_task_runs(flow_run_id: UUID | str) -> list:
    """The flow run's Failed and Crashed task runs (subflow runs included), earliest end first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(flow_run_id))])),
            task_run_filter=TaskRunFilter(
                state=TaskRunFilterState(
                    type=TaskRunFilterStateType(any_=[StateType.FAILED, StateType.CRASHED])
                )
            ),
        )
    return sorted((r for r in runs if r.state), key=lambda r: (r.end_time is None, r.end_time))


def failure_artifact_hook(flow, flow_run, state) -> None:
    """on_failure: the top-level run's artifact `failure-NAME`, its reason, the warning and error
    lines of the run and its subflows (from Prefect's API) and, where a server failed, the last
    lines of its log. A view only: it never raises, the state message has the reason."""
    if flow_run.parent_task_run_id is not None:
        return
    from eyas_prefect.flows.common import config_label, resolve_config
    from prefect.artifacts import create_markdown_artifact

    from eyas.report import artifact_key
    from eyas.server.readiness import ServerFailed

    params = flow_run.parameters or {}
    try:
        name = resolve_config(params.get("config"), params.get("overrides")).name
    except Exception:  # noqa: BLE001 - a config that does not load is named as checked_flow names it
        name = config_label(params.get("config"), params.get("overrides"))
    try:
        error = state.result(raise_on_failure=False)
        server_log = error.log_tail() if isinstance(error, ServerFailed) else ""
        create_markdown_artifact(
            key=artifact_key("failure", name),
            description=(state.message or "")[:500],
            markdown=failure_markdown(
                flow_run.name or name, state.message or "", logged_problems(flow_run.id), server_log
            ),
        )
    except Exception:  # noqa: BLE001 - the artifact is a view; the state message has the reason
        logging.getLogger(__name__).debug("no failure artifact", exc_info=True)


def logged_problems(flow_run_id, limit: int = 15) -> list[str]:
    """The last `limit` warning and error lines (first line of each) that Prefect's API holds for
    the flow run and its subflow runs, oldest first, once this process's log batches are sent."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=run_family(client, flow_run_id)),
                level=LogFilterLevel(ge_=logging.WARNING),
            ),
            sort=LogSort.TIMESTAMP_DESC,
            limit=limit,
        )
    return [(log.message.splitlines() or [""])[0][:300] for log in reversed(logs)]


def run_family(client, flow_run_id) -> list:
    """The flow run's id and its subflow runs' ids, level by level."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    family, todo = [flow_run_id], [flow_run_id]
    while todo:
        below = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=todo))
        todo = [r.id for r in client.read_flow_runs(flow_run_filter=below)]
        family += todo
    return family


def failure_markdown(run_name: str, line: str, lines: list[str], server_log: str = "") -> str:
    """The top-level run's artifact: the reason, the warning and error lines that led to it, and
    the last lines of a server's log where a server failed."""
    log = "\n".join(lines) or "(no warnings or errors were logged)"
    text = (
        f"# eyas run `{run_name}` failed\n\n**{line}**\n\n"
        f"Warning and error lines of this run, oldest first:\n\n```\n{log}\n```\n"
    )
    if server_log:
        text += f"\nThe server log's last lines:\n\n```\n{server_log}\n```\n"
    return text
