"""The `eyas` script: `eyas run` runs the pipeline as a Prefect flow in this process, `eyas worker`
serves the deployments (flows/runtime/worker.py); every other command is the core's (eyas/cli.py).

    eyas run CONFIG [--set training.max_steps=50 ...]   run the whole pipeline
    eyas worker --pool eyas [...]                       Prefect's worker; one SIGTERM stops it
    eyas check-config | preflight | stop | serve-local | make-tiny-target ...   (eyas/cli.py)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from eyas import cli as core


def cmd_run(args) -> int:
    # No Prefect telemetry from eyas's own process (read when prefect is first imported, below)
    # unless the operator asks for it: offline it only printed tracebacks that looked like eyas
    # failing.
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    cfg = core.load(args)
    from eyas_prefect.flows.pipeline import eagle3_pipeline
    from eyas_prefect.flows.runtime.process import run_in_process

    # SIGTERM / SIGINT: the run's servers stopped, its flow runs final, exit within seconds.
    state = run_in_process(eagle3_pipeline, cfg, return_state=True)
    if not state.is_completed():  # `failed at TASK: reason`; the run's log above has the rest
        raise SystemExit(
            f"eyas: run {state.name}" + (f": {state.message}" if state.message else "")
        )
    report = state.result()
    per_set = {
        name: {chain: c["acceptance_length"] for chain, c in s["chains"].items()}
        for name, s in (report["benchmarks"] or {}).items()
    }  # acceptance per prompt set and chain
    print(
        json.dumps(
            {
                **{
                    k: report[k]
                    for k in ("acceptance_length", "speedup", "extraction", "stages_seconds")
                },
                "acceptance_per_set": per_set,
            },
            indent=2,
        )
    )
    print(f"report:  {Path(cfg.run_dir) / 'report.json'}")
    print(f"drafter: {report['drafter_dir']}")
    return 0


RUN = core.Command("run", "run the whole pipeline (a Prefect flow)", cmd_run)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":  # its options are `prefect worker start`'s
        from eyas_prefect.flows.runtime.worker import main as worker

        return worker(argv[1:])
    return core.main(argv, extra=[RUN])


if __name__ == "__main__":
    sys.exit(main())
