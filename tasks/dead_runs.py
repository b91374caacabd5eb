"""Flow runs of a killed process, closed in the UI when a later run reclaims what it held.

A process killed with SIGKILL (or by the OOM killer) reports nothing: its flow runs stay Running in
the UI forever. When a run takes an output directory whose lock a dead process held
(eyas/extraction/stage.py take_output_dir), that process's flow run, the runs above it and the
subflows below it that are still Running are set Crashed, with a message naming the reclaim.
"""

from __future__ import annotations

import re
from uuid import UUID

from eyas_prefect.tasks.progress import logger

_FLOW_RUN = re.compile(r"flow run ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")
_MAX_RUNS = 64  # a pipeline has a handful of subflows; bound the walk all the same


def crash_dead_runs(previous_holder: str) -> list[str]:
    """Set Crashed every unfinished flow run of the dead holder's tree; returns their names."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Crashed

    found = _FLOW_RUN.search(previous_holder)
    if found is None:
        return []
    crashed = []
    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(UUID(found.group(1)))
        except Exception:  # noqa: BLE001 - another server's run, or deleted: nothing to close here
            return []
        for _ in range(_MAX_RUNS):  # up to the top-level run
            if run.parent_task_run_id is None:
                break
            run = client.read_flow_run(client.read_task_run(run.parent_task_run_id).flow_run_id)
        todo, seen = [run], set()
        while todo and len(seen) < _MAX_RUNS:
            run = todo.pop()
            seen.add(run.id)
            if run.state is not None and not run.state.is_final():
                message = (
                    f"Crashed: its process (pid {previous_holder.split(' ', 1)[0]}) died without "
                    f"reporting; found when a later run took its output directory"
                )
                client.set_flow_run_state(run.id, Crashed(message=message), force=True)
                crashed.append(run.name)
            todo += [
                r
                for r in client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(
                        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])
                    )
                )
                if r.id not in seen
            ]
    if crashed:
        logger().warning(
            "flow runs of a killed process, still shown Running, set Crashed: %s", crashed
        )
    return crashed
