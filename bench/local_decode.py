"""The local server's decode step: MLA in SGLang's absorbed form against transformers' own, side by
side.

    python bench/local_decode.py [--model fixtures/tiny-target] [--rows 1 8 16 32] [--cached 250]

One thread (as each of the embedded default's replicas runs). For each batch size, a prefill of
`--cached` tokens per row, then timed decode forwards of one token per row over that cache, in
transformers' form (the model as from_pretrained loads it), then in the server's (load_model,
which applies eyas/local/mla.py); the greedy tokens of both are checked equal. Goal: the absorbed
form at least 1.5x transformers' at 16 rows (the regeneration's batch per replica). The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


_GEN = torch.Generator()


def _decode_ms(model, rows: int, cached: int, steps: int) -> tuple[float, torch.Tensor]:
    """Mean ms of a one-token decode forward over `cached` tokens per row -> (ms, last tokens)."""
    ids = torch.randint(10, model.config.vocab_size, (rows, cached + steps), generator=_GEN)
    with torch.no_grad():
        out = model(input_ids=ids[:, :cached], use_cache=True)
        cache, mask = out.past_key_values, torch.ones(rows, cached, dtype=torch.long)
        t0 = time.perf_counter()
        for i in range(steps):
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long)], dim=1)
            out = model(
                input_ids=ids[:, cached + i : cached + i + 1],
                attention_mask=mask,
                position_ids=torch.full((rows, 1), cached + i),
                past_key_values=cache,
                use_cache=True,
            )
        return (time.perf_counter() - t0) / steps * 1000, out.logits[:, -1].argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "fixtures" / "tiny-target"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--cached", type=int, default=250)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from eyas.local.engine import load_model

    absorbed = load_model(args.model)  # the server's model: absorb_mla applied
    plain = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    figures: dict[str, dict] = {}
    for rows in args.rows:
        _GEN.manual_seed(rows)
        plain_ms, plain_tokens = _decode_ms(plain, rows, args.cached, args.steps)
        _GEN.manual_seed(rows)
        absorbed_ms, absorbed_tokens = _decode_ms(absorbed, rows, args.cached, args.steps)
        figures[str(rows)] = {
            "transformers_ms": round(plain_ms, 2),
            "absorbed_ms": round(absorbed_ms, 2),
            "speedup": round(plain_ms / absorbed_ms, 3),
            "same_tokens": bool(torch.equal(plain_tokens, absorbed_tokens)),
        }
        print(f"{rows} rows over {args.cached} cached tokens: {figures[str(rows)]}", flush=True)
    at16 = figures.get("16", {}).get("speedup")
    same = all(f["same_tokens"] for f in figures.values())
    print(
        json.dumps(
            {
                "bench": "local_decode",
                "figures": {"cached_tokens": args.cached, "threads": 1, "rows": figures},
                "goals": {
                    "absorbed_speedup_at_16_rows": {
                        "value": at16,
                        "goal": ">= 1.5",
                        "met": at16 is not None and at16 >= 1.5,
                    },
                    "same_tokens": {"value": same, "goal": "true", "met": same},
                },
            }
        )
    )


if __name__ == "__main__":
    main()
