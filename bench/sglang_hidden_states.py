"""Hidden states captured through real SGLang against eyas's server's, on the same weights and
tokens: the relative error per captured layer.

    eyas run configs/sglang-cpu.yaml        # real SGLang 0.5.18 on this CPU writes the shards
    python bench/sglang_hidden_states.py [--run runs/sglang-cpu] [--samples 2]

eyas's own server computes the target with transformers in float32 (eyas/local/engine.py), so its
states are transformers' float32 forward on the sample's tokens. SGLang's CPU kernels compute in
bf16 only (its rmsnorm kernel has no float32), so the script also gives transformers' own bf16
forward against float32: the error bf16 arithmetic alone leaves. Per layer: the worst relative error
||a - b|| / ||b|| over the first `--samples` samples of every shard.

Goal: at most 0.02 per layer (issue 35). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eyas.config import load_config  # noqa: E402
from eyas.extraction.shards import ShardReader  # noqa: E402
from tests.sglang_cpu import states_against_transformers  # noqa: E402


def relative(a, b) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "sglang-cpu.yaml"))
    p.add_argument("--samples", type=int, default=2)
    args = p.parse_args()
    cfg = load_config(args.config)
    capture = cfg.target.capture_ids()
    names = [f"layer {i}" for i in capture] + ["last"]
    worst = {n: {"sglang_vs_eyas": 0.0, "bf16_vs_float32": 0.0} for n in names}
    for path in sorted(Path(cfg.extraction.output_dir).glob("shard-*.safetensors")):
        reader = ShardReader(path)
        for i in range(min(args.samples, len(reader))):
            sample = reader.sample(i)
            for name, g, t, b in states_against_transformers(
                cfg.target.checkpoint, sample, capture
            ):
                w = worst[name]
                w["sglang_vs_eyas"] = max(w["sglang_vs_eyas"], round(relative(g, t), 4))
                w["bf16_vs_float32"] = max(w["bf16_vs_float32"], round(relative(b, t), 4))
    goals = {
        f"{name.replace(' ', '_')}_relative_error": {
            "value": w["sglang_vs_eyas"],
            "goal": "<= 0.02",
            "met": w["sglang_vs_eyas"] <= 0.02,
        }
        for name, w in worst.items()
    }
    print(json.dumps({"bench": "sglang_hidden_states", "figures": worst, "goals": goals}))


if __name__ == "__main__":
    main()
