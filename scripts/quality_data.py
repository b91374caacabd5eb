"""Make a data variant for the quality sweep (scripts/quality_sweep.py): regenerate and extract with
the real extract subflow, then keep only what a GPU machine needs to rebuild the shards.

    python scripts/quality_data.py r64 30901 '{"data.regenerate.max_new_tokens": 64}'

Runs configs/local-tiny.yaml's extraction (with the overrides) into runs/NAME/, then writes
sweep-data/NAME.pt: each shard's token ids, loss masks and metadata, and the 32 evaluation prompts
(a few MB instead of the shards' hundreds: the sweep recomputes the hidden states on the GPU).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def main() -> None:
    name, port, extra = (
        sys.argv[1],
        int(sys.argv[2]),
        json.loads(sys.argv[3] if len(sys.argv) > 3 else "{}"),
    )
    from eyas_prefect.flows.extract import extract

    from eyas.config import load_config
    from eyas.evaluation import serve_bench
    from eyas.extraction.shards import ShardReader

    rd = ROOT / "runs" / name
    ov = {
        "name": name,
        "run_dir": str(rd),
        "server.port": port,
        "server.workdir": str(rd / "server"),
        "server.dump_dir": str(rd / "server" / "dump"),
        "extraction.output_dir": str(rd / "shards"),
        "training.output_dir": str(rd / "train"),
        **extra,
    }
    config = ROOT / "configs" / "local-tiny.yaml"
    r = extract(str(config), overrides=ov)
    print(
        "stages", r.stages, "tokens", r.num_tokens
    )  # flows.extract returns an eyas.results.Extracted
    shards = []
    for m in r.manifests:
        reader = ShardReader(rd / "shards" / m.file)
        shards.append(
            {"meta": reader.meta, "samples": [(s.input_ids.int(), s.loss_mask) for s in reader]}
        )
    out = ROOT / "sweep-data" / f"{name}.pt"
    out.parent.mkdir(exist_ok=True)
    torch.save({"shards": shards, "prompts": serve_bench.heldout_prompts(load_config(config))}, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
