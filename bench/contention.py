"""CPU training beside a competing load: the embedded default's training step on an idle machine
and beside busy processes, for OpenMP's wait policies, and for eyas's own choice.

    python bench/contention.py [--steps 8] [--rounds 3] [--load 2]

Each setting runs in a fresh process, since OpenMP reads its settings once, when torch loads:
- `spin`: OMP_WAIT_POLICY=ACTIVE, threads spin while they wait for work;
- `unset`: libgomp's default, spinning for a while before sleeping;
- `passive`: OMP_WAIT_POLICY=PASSIVE, threads sleep while they wait;
- `spin_100k`: GOMP_SPINCOUNT=100000, a shorter spin;
- `one_thread`: OMP_NUM_THREADS=1;
- `eyas`: what an eyas process chooses as it starts (eyas.threads.apply_cpu_settings): measured
  twice, started on the idle machine (its idle time) and started beside the load (its loaded time),
  as an eyas run started on an idle or a busy machine would be.
Inside one process of the fixed settings, idle and loaded blocks of `--steps` steps alternate for
`--rounds` rounds (the machine's drift hits both alike); the load is `--load` processes that spin
in a Python loop. A block's time is its median step; a setting's figure the median of its blocks.
The step is bench/cpu_train.py's (fp32, the default's shapes).

Goal: eyas's loaded step at most 2.5x its idle one, at load 4 on 2 cores (2 training threads and 2
busy processes). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = {
    "spin": {"OMP_WAIT_POLICY": "ACTIVE"},
    "unset": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin_100k": {"GOMP_SPINCOUNT": "100000"},
    "one_thread": {"OMP_NUM_THREADS": "1"},
    "eyas": {},  # eyas.threads.apply_cpu_settings, in the child before torch loads
}
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
SPIN = "while True: pass"


def spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def child(setting: str, phase: str, steps: int, rounds: int, load: int) -> dict:
    """One setting's step times in this fresh process: idle and loaded blocks alternating
    (`both`), or only the blocks of one `phase` (`idle`, `loaded`: the parent runs the load)."""
    if setting == "eyas":
        from eyas.threads import apply_cpu_settings

        apply_cpu_settings()
    import torch

    from bench.cpu_train import batches, make_mode, step
    from eyas.training.target_head import TargetHead

    mode = make_mode(None)
    head = TargetHead(
        torch.randn(4096, 256, generator=torch.Generator().manual_seed(1)) / 16, None, 1e-6
    )
    stream = iter(batches(3 + 2 * steps * rounds))
    for _ in range(3):
        step(mode, next(stream), head)  # warm-up

    def block() -> float:
        return statistics.median(step(mode, next(stream), head) for _ in range(steps))

    blocks: dict[str, list[float]] = {"idle": [], "loaded": []}
    for _ in range(rounds):
        if phase == "both":
            blocks["idle"].append(block())
            procs = spinners(load)
            try:
                blocks["loaded"].append(block())
            finally:
                stop(procs)
        else:
            blocks[phase].append(block())
    return {
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        **{f"{k}_ms": round(1000 * statistics.median(v), 1) for k, v in blocks.items() if v},
    }


def run_child(setting: str, phase: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    env.update(SETTINGS[setting])
    procs = spinners(args.load) if phase == "loaded" else []  # running as the child starts
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--child", setting, "--phase", phase]
            + ["--steps", str(args.steps), "--rounds", str(args.rounds), "--load", str(args.load)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
    finally:
        stop(procs)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_setting(setting: str, args) -> dict:
    if setting == "eyas":
        idle, loaded = run_child(setting, "idle", args), run_child(setting, "loaded", args)
        found = {
            "threads": idle["threads"],
            "omp_wait_policy": {
                "idle": idle["omp_wait_policy"],
                "loaded": loaded["omp_wait_policy"],
            },
            "idle_ms": idle["idle_ms"],
            "loaded_ms": loaded["loaded_ms"],
        }
    else:
        found = run_child(setting, "both", args)
    found["loaded_over_idle"] = round(found["loaded_ms"] / found["idle_ms"], 2)
    return found


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--load", type=int, default=2)
    p.add_argument("--child", choices=sorted(SETTINGS))
    p.add_argument("--phase", choices=("both", "idle", "loaded"), default="both")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.phase, args.steps, args.rounds, args.load)))
        return
    figures = {"cores": len(os.sched_getaffinity(0)), "load_processes": args.load}
    for setting in SETTINGS:
        figures[setting] = run_setting(setting, args)
        print(setting, figures[setting], flush=True)
    ratio = figures["eyas"]["loaded_over_idle"]
    goals = {"eyas_loaded_over_idle_step": {"value": ratio, "goal": "<= 2.5", "met": ratio <= 2.5}}
    print(json.dumps({"bench": "contention", "figures": figures, "goals": goals}))


if __name__ == "__main__":
    main()
