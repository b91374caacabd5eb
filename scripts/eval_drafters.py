"""Acceptance length of exported drafters, measured as the pipeline's evaluate stage does (CPU, the
evaluation settings of configs/local-tiny.yaml, chains 3/1/4 and 7/1/8), on a sweep data file's
prompts.

    # one JSON line each
    python scripts/eval_drafters.py sweep-data/r64.pt DRAFTER_DIR [DRAFTER_DIR ...]

For drafters trained elsewhere (scripts/quality_sweep.py on a lent GPU machine) and brought back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def main() -> None:
    from eyas.config import load_config
    from eyas.evaluation.evaluate import evaluate_acceptance

    data, dirs = sys.argv[1], sys.argv[2:]
    cfg = load_config(ROOT / "configs" / "local-tiny.yaml", {"evaluation.device": "cpu"})
    prompts = torch.load(data)["prompts"]
    for d in dirs:
        ev = evaluate_acceptance(
            d, cfg.target.checkpoint, prompts, cfg.evaluation, cfg.target.capture_ids()
        )
        print(
            json.dumps(
                {
                    "drafter": d,
                    "al_by_setting": {
                        k: round(v["acceptance_length"], 4) for k, v in ev.settings.items()
                    },
                    "identical": ev.identical_to_target,
                    "num_prompts": ev.num_prompts,
                    "seconds": ev.seconds,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
