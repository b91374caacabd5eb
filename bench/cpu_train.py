"""CPU benchmark of one training step of the embedded default's drafter: fp32 against bf16 GEMMs.

    python bench/cpu_train.py [--steps 30] [--threads 2]

The drafter and the batches have the embedded default's shapes (hidden 256, 4 heads, intermediate
512, vocabulary 4096, draft vocabulary 2048, TTT 3, batch 6 of 150 to 384 tokens), with random
target states. Each step is what eyas.training.train runs: the chunked teacher, the TTT
forward/backward with the fused head loss, clipping, AdamW. The two modes run the same batches,
alternating step by step (the machine's noise hits both alike); a step's time is the median after 3
warm-up steps. bf16 GEMMs need a CPU that multiplies bf16 in hardware (AMX or AVX512-BF16); without
it the script says so and measures fp32 only.

Goal: bf16 GEMMs at most 0.75x the fp32 step time. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eyas.training.batches import Batch  # noqa: E402
from eyas.training.drafter import DrafterConfig, Eagle3Drafter  # noqa: E402
from eyas.training.gemm import cpu_bf16_gemm, cpu_flags  # noqa: E402
from eyas.training.kernels import KernelOptions  # noqa: E402
from eyas.training.losses import HEAD_CHUNK_ROWS_CPU, TTTObjective, scored_counts, teacher_labels  # noqa: E402
from eyas.training.optim import lr_factor, make_optimizer  # noqa: E402
from eyas.training.target_head import TargetHead  # noqa: E402
from eyas.training.train import optimizer_step  # noqa: E402

H, V, VD, K, B = 256, 4096, 2048, 3, 6
KERNELS = (
    KernelOptions()
)  # what kernel_options gives a CPU run by default (no torch.compile); both modes use it


def make_mode(gemm_dtype):
    torch.manual_seed(0)
    model = Eagle3Drafter(
        DrafterConfig(
            hidden_size=H,
            target_hidden_size=H,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=512,
            vocab_size=V,
            draft_vocab_size=VD,
        )
    )
    objective = TTTObjective(
        model, head_chunk=HEAD_CHUNK_ROWS_CPU, gemm_dtype=gemm_dtype, kernels=KERNELS
    )
    opt = make_optimizer([p for p in objective.parameters() if p.requires_grad], 3e-3, 0.0)
    return objective, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 3, 1000))


def batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        T = int(torch.randint(150, 385, (1,), generator=g))
        yield Batch(
            ids=torch.randint(0, V, (B, T), generator=g),
            aux=torch.randn(B, T, 3 * H, generator=g),
            last=torch.randn(B, T, H, generator=g),
            loss_mask=torch.ones(B, T, dtype=torch.bool),
        )


def step(mode, batch, head) -> float:
    """One optimizer step as eyas.training.train runs it (teacher included) -> seconds."""
    objective, opt, sched = mode
    t = time.perf_counter()
    optimizer_step(
        objective,
        objective,
        opt,
        sched,
        [batch],
        lambda b: teacher_labels(head, b.last, b.loss_mask, VD, kernels=KERNELS),
        ttt_steps=K,
        decay=0.8,
        counts=scored_counts(list(batch.loss_mask), K),
        grad_clip=0.5,
        autocast=contextlib.nullcontext(),
    )
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bf16 = cpu_bf16_gemm()
    units = [f for f in ("amx_bf16", "avx512_bf16") if f in cpu_flags()]
    modes = {"fp32": make_mode(None), **({"bf16_gemms": make_mode(torch.bfloat16)} if bf16 else {})}
    head = TargetHead(
        torch.randn(V, H, generator=torch.Generator().manual_seed(1)) / H**0.5, None, 1e-6
    )
    times, tokens = {m: [] for m in modes}, []
    for i, batch in enumerate(batches(args.steps + 3)):
        for name, mode in modes.items():
            dt = step(mode, batch, head)
            if i >= 3:
                times[name].append(dt)
        if i >= 3:
            tokens.append(batch.ids.numel())
    med = {m: statistics.median(t) for m, t in times.items()}
    figures = {
        "threads": args.threads,
        "bf16_units": units,  # amx_bf16 (tiles) and/or avx512_bf16 (dot products)
        "tokens_per_step": round(statistics.mean(tokens)),
        **{f"{m}_step_ms": round(1000 * s, 1) for m, s in med.items()},
        **{f"{m}_tokens_per_s": round(statistics.mean(tokens) / s) for m, s in med.items()},
    }
    goals = {}
    if bf16:
        ratio = med["bf16_gemms"] / med["fp32"]
        figures["bf16_over_fp32"] = round(ratio, 3)
        goals["bf16_gemm_step_over_fp32"] = {
            "value": round(ratio, 3),
            "goal": "<= 0.75",
            "met": ratio <= 0.75,
        }
    else:
        print("no bf16 GEMM hardware (AMX or AVX512-BF16) on this CPU: fp32 only")
    print(json.dumps({"bench": "cpu_train", "figures": figures, "goals": goals}))


if __name__ == "__main__":
    main()
