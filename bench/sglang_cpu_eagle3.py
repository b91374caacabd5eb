"""Real SGLang's EAGLE-3 against the target's own greedy decode, on this machine's CPU.

    python bench/sglang_cpu_eagle3.py DRAFTER_DIR [--prompts 8] [--tokens 32]

DRAFTER_DIR: an eyas export for fixtures/tiny-target-cpu (tests/integration/test_sglang_cpu_dsv3.py
trains and exports one; `eyas run configs/sglang-cpu.yaml` writes runs/sglang-cpu/drafter). Needs
the SGLang 0.5.18 CPU environment (tests/sglang_cpu.py says where).

Serves the target plainly, then with the drafter at 3/1/4 and 1/1/2 (the pipeline's own launch,
readiness and stop code), greedy, over the held-out prompts of the first 72 conversations; decodes
the same prompts with transformers in float32; and evaluates the drafter in process
(`evaluate_acceptance`). Reports, per launch, where each output first leaves transformers' greedy
output, and the acceptance lengths. A faithful speculative decoder leaves it no earlier than the
plain server does (bf16 near ties); the goal row checks that of 3/1/4. The last line printed is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402

from eyas.evaluation.evaluate import evaluate_acceptance  # noqa: E402
from eyas.evaluation.serve_bench import heldout_prompts  # noqa: E402
from eyas.evaluation.serving import Chain, Meter, running, serving_launch  # noqa: E402
from eyas.server.hosts import LocalHost  # noqa: E402
from tests.sglang_cpu import cpu_server, sglang_cpu_python, subset_of_conversations  # noqa: E402
from tests.stage_config import stage_config  # noqa: E402

TARGET = ROOT / "fixtures" / "tiny-target-cpu"
VERSION = "0.5.18"


def greedy(model, prompt: list[int], tokens: int, eos: int) -> list[int]:
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(tokens):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == eos:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return out


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("drafter", type=Path)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    args.drafter = args.drafter.resolve()  # the server starts in its own workdir
    work = Path(tempfile.mkdtemp(prefix="eyas-bench-eagle3-"))
    cfg = stage_config(
        work,
        TARGET,
        **{
            **cpu_server(VERSION, sglang_cpu_python(VERSION)),
            "data.path": str(subset_of_conversations(work / "conversations.jsonl", 72)),
            "data.num_heldout": 8,
            "data.regenerate.enabled": False,
            "evaluation.max_new_tokens": args.tokens,
            "benchmark.num_warmup": 1,
            "sensor.stall_timeout_s": 300,
            "sensor.deadline_s": 900,
        },
    )
    prompts = heldout_prompts(cfg)[: args.prompts]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(TARGET), dtype=torch.float32
    ).eval()
    eos = model.config.eos_token_id
    reference = [greedy(model, p, args.tokens, eos) for p in prompts]
    figures: dict = {"prompts": len(prompts), "tokens": args.tokens}
    for label, chain in [("plain", None), ("3/1/4", Chain.of(3)), ("1/1/2", Chain.of(1))]:
        launch = serving_launch(
            cfg, label.replace("/", "-"), args.drafter if chain else None, chain=chain
        )
        with running(LocalHost(), launch, cfg.sensor, print) as (handle, _):
            meter = Meter(handle.url, cfg.benchmark)
            meter.warm_up(prompts)
            served = meter.serve_set(prompts, args.tokens)
            meter.close()
        outs, verify = served["outputs"], served["verify_steps"]
        figures[label] = {
            "first_divergence": [first_divergence(o, r) for o, r in zip(outs, reference)],
            "acceptance_length": round(sum(map(len, outs)) / sum(verify), 3)
            if sum(verify)
            else None,
        }
    for steps, label in ((3, "3/1/4"), (1, "1/1/2")):
        ev = cfg.evaluation.model_copy(update={"draft_steps": [steps]})
        figures[label]["in_process_acceptance_length"] = round(
            evaluate_acceptance(
                args.drafter, TARGET, prompts, ev, cfg.target.capture_ids()
            ).acceptance_length,
            3,
        )
    plain, spec = figures["plain"]["first_divergence"], figures["3/1/4"]["first_divergence"]
    faithful = sum(spec) >= sum(plain)
    print(
        json.dumps(
            {
                "bench": "sglang_cpu_eagle3",
                "figures": figures,
                "goals": {
                    "speculative_follows_the_target": {
                        "value": sum(spec) / len(spec),
                        "goal": f">= {sum(plain) / len(plain)}",
                        "met": faithful,
                    }
                },
            }
        )
    )


if __name__ == "__main__":
    main()
