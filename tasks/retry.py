"""The one retry condition of every eyas task that retries: a failure is tried again only when a
retry can help (eyas/errors.py retry_can_help: no full disk, no refused login or launch, no server
whose process is gone or stalled (the extract flow relaunches it instead), no bad input)."""

from eyas.errors import retry_can_help


def worth_retrying(task, task_run, state) -> bool:
    """retry_condition_fn: the task's own failure, judged by its kind and what it was raised
    from."""
    try:
        state.result()
    except Exception as e:  # noqa: BLE001 - the task's own failure, judged by its kind
        return retry_can_help(e)
    return False
