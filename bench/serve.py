"""Serving benchmark: single-stream decoding with vs without the drafter, tiny target, CPU.

    python bench/serve.py [--config configs/local-tiny.yaml] [--drafter DIR]

Both servers in one run, side by side, at the config's 3/1/4 chain, through the same code as the
pipeline's benchmark stage (eyas.evaluation.serve_bench). The drafter is --drafter, else
<run_dir>/drafter from an earlier `eyas run`, else the newest training checkpoint under
training.output_dir exported into a temporary folder (the shard manifest supplies the layer ids).
Goal (issue 8): single-stream speed-up above 1.0. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from eyas.net import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def find_drafter(cfg, given: str | None, tmp: Path) -> Path:
    from eyas.evaluation.export import export_drafter

    if given:  # absolute: the servers run in their own working directories
        return Path(given).resolve()
    if (Path(cfg.run_dir) / "drafter" / "config.json").exists():
        return Path(cfg.run_dir) / "drafter"
    checkpoints = sorted((Path(cfg.training.output_dir) / "checkpoints").glob("step-[0-9]*"))
    manifests = sorted(Path(cfg.extraction.output_dir).glob("shard-*.json"))
    if not checkpoints or not manifests:
        sys.exit(
            f"no drafter: run `eyas run {ROOT / 'configs' / 'local-tiny.yaml'}` first, or "
            f"pass --drafter"
        )
    print(f"exporting {checkpoints[-1]} (no {cfg.run_dir}/drafter yet)", file=sys.stderr)
    return export_drafter(
        checkpoints[-1],
        tmp / "drafter",
        target=cfg.target,
        export=cfg.export,
        shard_meta=json.loads(manifests[0].read_text()),
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(ROOT / "configs" / "local-tiny.yaml"))
    p.add_argument("--drafter", default=None)
    args = p.parse_args()
    from eyas.config import load_config
    from eyas.evaluation.serve_bench import benchmarks, heldout_prompts, run_serve_bench
    from eyas.evaluation.suites import load_suites

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # A free port and a fresh workdir: another run of the pipeline may be serving on the
        # configured one.
        cfg = load_config(
            args.config,
            {
                "server.workdir": str(tmp / "server"),
                "server.port": free_port(),
                "server.dump_dir": str(tmp / "server" / "dump"),
            },
        )
        drafter = find_drafter(cfg, args.drafter, tmp)
        os.environ.setdefault("OMP_NUM_THREADS", cfg.server.env.get("OMP_NUM_THREADS", "1"))
        sets = {
            "heldout": {"prompts": heldout_prompts(cfg), "source": {"file": str(cfg.data.path)}},
            **load_suites(cfg),
        }
        result = run_serve_bench(cfg, drafter, sets, log=lambda m: print(m, file=sys.stderr))
    plain, spec, r = result.plain, result.speculative, result.speedup
    figures = {
        "single_stream_tokens_per_s": {
            "plain": plain["single_stream_tokens_per_s"],
            "speculative": spec["single_stream_tokens_per_s"],
        },
        f"concurrency_{cfg.benchmark.concurrency}_tokens_per_s": {
            "plain": plain["concurrent_tokens_per_s"],
            "speculative": spec["concurrent_tokens_per_s"],
        },
        "ttft_s": {"plain": plain["ttft_s"], "speculative": spec["ttft_s"]},
        "speedup": r,
        "acceptance_length": result.acceptance_length,
        "break_even_acceptance_length": result.break_even_acceptance_length,
        "identical_outputs": result.identical_outputs,
        "drafter_dir": str(drafter),
        "chain": result.benchmark_chain,
        "benchmarks": {
            name: {
                chain: {k: c[k] for k in ("acceptance_length", "speedup")}
                for chain, c in s["chains"].items()
            }
            for name, s in benchmarks(result).items()
        },
        "single_stream_runs": {
            "plain": plain["single_stream_runs"],
            "speculative": spec["single_stream_runs"],
        },
        "machine": result.machine,
    }
    ratio = r["single_stream_tokens_per_s"] or 0.0
    goals = {
        "single_stream_speedup": {"value": ratio, "goal": "> 1.0", "met": ratio > 1.0},
        "identical_outputs": {
            "value": result.identical_outputs,
            "goal": "true",
            "met": result.identical_outputs is True,
        },
    }
    print(json.dumps({"bench": "serve", "figures": figures, "goals": goals}))


if __name__ == "__main__":
    main()
