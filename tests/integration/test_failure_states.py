"""flows/failures.py in process against a Prefect server (prefect_harness): a failed run's final
state names the task run that raised the error, as the API records it; an error eyas raised keeps
no traceback in the run's logs, a bug keeps its own; the top-level run's artifact `failure-NAME`."""

import pytest
from eyas_prefect.flows.common import DEFAULT_CONFIG, checked_flow
from eyas_prefect.flows.failures import failure_artifact_hook
from prefect import flow, task

from eyas.errors import InvalidInput

pytestmark = pytest.mark.slow


@task(task_run_name="refuses")
def refuses():
    raise InvalidInput("data.path /nowhere: no such file; fix data.path")


@task(task_run_name="has-a-bug")
def has_a_bug():
    return {}["missing"]


@task(task_run_name="works")
def works():
    return 1


@flow(name="eyas-test-inner")
@checked_flow
def inner(config=DEFAULT_CONFIG, overrides=None, which: str = "refuses"):
    works()
    if which == "body":
        raise ValueError("the flow's own bug")
    return {"refuses": refuses, "has-a-bug": has_a_bug}[which]()


@flow(name="eyas-test-outer", on_failure=[failure_artifact_hook])
@checked_flow
def outer(config=DEFAULT_CONFIG, overrides=None, which: str = "refuses"):
    return inner(config, overrides, which)


def logs_of(flow_run_id) -> list[str]:
    """Every log message of the flow run and its subflow runs, oldest first."""
    from eyas_prefect.flows.failures import run_family
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=run_family(client, flow_run_id))
            ),
            sort=LogSort.TIMESTAMP_ASC,
        )
    return [log.message for log in logs]


def artifact(key: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            sort=ArtifactSort.CREATED_DESC,
        )
    return found[0].data if found else ""


def test_an_eyas_error_in_a_subflows_task_names_the_task_without_a_traceback(prefect_harness):
    state = outer(overrides={"name": "states-refuses"}, which="refuses", return_state=True)
    line = "failed at refuses: data.path /nowhere: no such file; fix data.path"
    assert state.is_failed() and state.message == line, state
    assert isinstance(state.result(raise_on_failure=False), InvalidInput)
    logs = logs_of(state.state_details.flow_run_id)
    assert not [m for m in logs if "Traceback" in m], logs
    assert any(m.startswith("Task run failed with exception: InvalidInput(") for m in logs), logs
    assert sum(m == f"Finished in state Failed({line!r})" for m in logs) == 2, logs  # both flows
    page = artifact("failure-states-refuses")
    assert f"**{line}**" in page and "Task run failed with exception: InvalidInput(" in page, page


def test_a_bug_in_a_task_keeps_its_traceback(prefect_harness):
    state = outer(which="has-a-bug", return_state=True)
    assert state.is_failed() and state.message == "failed at has-a-bug: KeyError: 'missing'", state
    logs = logs_of(state.state_details.flow_run_id)
    tracebacks = [m for m in logs if "Traceback (most recent call last)" in m]
    assert len(tracebacks) == 1 and "KeyError" in tracebacks[0], logs
    assert 'return {}["missing"]' in tracebacks[0], tracebacks


def test_a_bug_in_a_flow_body_is_named_by_its_flow_and_logged_with_its_traceback(prefect_harness):
    state = outer(which="body", return_state=True)
    line = "failed at eyas-test-inner: ValueError: the flow's own bug"
    assert state.is_failed() and state.message == line, state
    logs = logs_of(state.state_details.flow_run_id)
    logged = [m for m in logs if m.startswith(line)]
    assert len(logged) == 1 and "Traceback (most recent call last)" in logged[0], logs
    assert 'raise ValueError("the flow\'s own bug")' in logged[0], logged


def test_a_bad_config_fails_at_config(prefect_harness):
    state = outer(overrides={"training.max_stepz": 1}, return_state=True)
    assert state.is_failed(), state
    assert state.message.startswith("failed at config: ") and "training.max_stepz" in state.message
    assert "\n" not in state.message, state.message
