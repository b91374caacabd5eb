"""GPU benchmark of one EAGLE-3 training step at Kimi-K2.5 size (docs/performance.md, ## Training).

    PYTHONUNBUFFERED=1 python3 bench/train.py --out $OUT               # one H200: the figures
    python bench/train.py                                              # no GPU: a tiny smoke run
    # optimisations side by side
    python3 bench/train.py --variants default all flash --variant-batches 4 1
    # real chat masks, packed to 4096
    python bench/masks.py --out .perf/chat_masks.npy
    python3 bench/train.py --batches --mask-batches 4 1 --mask-kinds all-scored prompt masks-from \
        # issue 18's goals: later epochs and first (nomemo)
        --masks-from .perf/chat_masks.npy --out $OUT
    # issue 30's goals
    PYTHONUNBUFFERED=1 python3 bench/train.py --from-shards --steps 5 --warmup 2 --out $OUT

--from-shards times the step fed from Kimi-size shards written on this machine's disk (bf16 and FP8,
prompt-0.3 masks) through the training loop's data path (plan_steps, BatchLoader, optimizer_step),
cold (pages dropped) and warm, beside the synthetic step of the same call: goal >= 97% of it.

Loss masks: the main rows (--batches) score every position but a leading prompt of --prompt-fraction
of each sequence (default 1/16, the figures recorded since 2026-12-02). --mask-batches measures the
same step again with chat-shaped masks: every position scored, a prompt of --shape-fraction (0.3),
and, with --masks-from, the masks of real tokenized multi-turn conversations packed to the sequence
length (bench/masks.py writes them: bool [N, T] in a .npy; rows are re-cut when T differs, so the
CPU smoke run takes the same file). Goals against SpecForge 0.2.0 on the same GPU and shapes
(docs/performance.md): >= 2.0x on chat-shaped masks at batch 1 and 4, >= 1.5x with every position
scored at batch 4; each row also reports the share of positions the TTT steps >= 1 ran on
(`rows_share`: skipping position by position). --mask-variants measures the rows again with other
variants (VARIANTS; the goals of a variant other than the default are reported with its name
appended: `fp8`, the experimental FP8 GEMMs, is not the same arithmetic), and --fp8-check reports
how far FP8 lies from fp32 per GEMM and over a whole step, beside bf16's distance.

A variant is a KernelOptions (the user's training.compile and training.fp8_gemms, and the step's
optimisations, each switched off to measure it against its absence) and the head's chunk.

The drafter is SGLang's LlamaForCausalLMEagle3 at Kimi-K2.5 size (H 7168, 64 heads of 128,
intermediate 18432, vocab 163840, draft vocab 32000), trained on synthetic target states (random
aux and last hidden states, a random draft-vocabulary map) at sequence 4096 with 7 TTT steps.
A step is exactly what `eyas.training.train` runs per optimizer step: the chunked teacher, the TTT
forward/backward with the fused head loss, gradient clipping, fused AdamW, the schedule. Step time
is the median of --steps synchronized steps after --warmup. The warm-up steps fill the teacher's
ArgmaxMemo, so the default's timed steps are a training run's later epochs (the teacher on the draft
vocabulary's rows only); the `nomemo` variant times the first epoch (the whole vocabulary), and the
goals above are judged on a run of --epochs (default 10) made of one first epoch and the rest.

Model FLOPs per token (MFU counts these only; the teacher's 2 x 163840 x 7168 per token is not):
    6 x P_step x K          P_step = q,k,v,o + gate,up,down + lm_head + norms (used every TTT step)
  + 4 x P_fc                fc runs once, and needs no input gradient (its input is data)
  + 12 x nh x hd x sum_k((T+1)/2 + k)   attention: QK and PV, forward 4, backward 8 per query-key
                                         pair (causal over step 0's keys plus k diagonal keys at
                                         step k)
MFU = FLOPs/token x tokens/s / peak, against the datasheet's dense bf16 989 TFLOP/s and against the
bf16 GEMM rate this script measures on the same GPU (8192^3, random data).

Needs torch, safetensors and numpy only (no pydantic): it imports eyas's model and loss modules.
Ends with one JSON line: {"bench": "train", "figures": {...}, "goals": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import masks  # noqa: E402  (numpy only)
from bench.disk import disk_read_rate, drop_cache  # noqa: E402
from eyas.training import attention, gemm, soft_ce  # noqa: E402
from eyas.training.attention import (  # noqa: E402
    reference_ttt_attention,
    reference_ttt_attention_rows,
    ttt_attention,
)
from eyas.training.batches import Batch, ShardData  # noqa: E402
from eyas.training.drafter import DrafterConfig, Eagle3Drafter  # noqa: E402
from eyas.training.kernels import KernelOptions  # noqa: E402
from eyas.training.loader import BatchLoader, plan_steps  # noqa: E402
from eyas.training.losses import (  # noqa: E402
    HEAD_CHUNK_ROWS,
    Labels,
    TTTObjective,
    draft_first_order,
    head_soft_ce,
    scored_counts,
    teacher_labels,
)
from eyas.training.optim import clip_and_step, lr_factor, make_optimizer  # noqa: E402
from eyas.training.step_rows import ttt_rows  # noqa: E402
from eyas.training.target_head import TargetHead  # noqa: E402
from eyas.training.teacher_cache import ArgmaxMemo  # noqa: E402
from eyas.training.train import optimizer_step  # noqa: E402

KIMI = dict(
    hidden_size=7168,
    target_hidden_size=7168,
    num_attention_heads=64,
    num_key_value_heads=64,
    head_dim=128,
    intermediate_size=18432,
    vocab_size=163840,
    draft_vocab_size=32000,
)
TINY = dict(
    hidden_size=64,
    target_hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    draft_vocab_size=128,
)
DATASHEET_BF16 = 989e12
GOALS = {"tokens_per_s_b1": 12000, "tokens_per_s_b4": 13400, "peak_gb_b1": 40, "peak_gb_b4": 109}
SPECFORGE = {
    1: 9246,
    4: 10382,
}  # SpecForge 0.2.0 tokens/s, same drafter, sequence 4096, TTT 7, one H200
# (issue 18's goals; docs/performance.md): name -> (mask row, batch, threshold)
SPECFORGE_GOALS = {
    "chat_masks_b1_2x_specforge": ("masks-from", 1, 18500),
    "chat_masks_b4_2x_specforge": ("masks-from", 4, 20800),
    "prompt30_b1_2x_specforge": ("prompt-0.3", 1, 18500),
    "prompt30_b4_2x_specforge": ("prompt-0.3", 4, 20800),
    "all_scored_b4_1.5x_specforge": ("all-scored", 4, 15600),
}
_PROMPT_FRACTION = [
    1 / 16
]  # the main rows' prompt share (--prompt-fraction); batch() uses it by default


def flops_per_token(c: DrafterConfig, T: int, K: int) -> dict:
    H, I, nh, nkv, hd = (
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
    )
    step = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I + c.draft_vocab_size * H + 4 * H
    fc = c.num_aux * c.target_hidden_size * H
    attn = 12 * nh * hd * sum((T + 1) / 2 + k for k in range(K))
    return {
        "params_per_ttt_step": step,
        "fc_params": fc,
        "linear": 6 * step * K,
        "fc": 4 * fc,
        "attention": attn,
        "total": 6 * step * K + 4 * fc + attn,
    }


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ----------------------------------------------------------------------------- checks


def _attention_error(
    ts: list[torch.Tensor], K: int, hd: int, kernels: KernelOptions, where=None
) -> float:
    """Worst relative error of ttt_attention's output and gradients against the float64 reference
    (where: queries gathered at these (b, t) positions, against the gathered reference)."""
    y = ttt_attention(ts[0], ts[1], ts[2], ts[3 : 3 + K], ts[3 + K :], hd**-0.5, kernels, where)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, ts, dy)
    ref = [t.detach().double().requires_grad_() for t in ts]
    if where is None:
        yr = reference_ttt_attention(ref[0], ref[1], ref[2], ref[3 : 3 + K], ref[3 + K :], hd**-0.5)
    else:
        yr = reference_ttt_attention_rows(
            ref[0], ref[1], ref[2], ref[3 : 3 + K], ref[3 + K :], hd**-0.5, *where
        )
    gr = torch.autograd.grad(yr, ref, dy.double())
    return max([rel(y, yr)] + [rel(a, b) for a, b in zip(grads, gr)])


def check_kernels(device, dtype, kernels: KernelOptions | None = None) -> dict:
    """Fast paths (as `kernels` picks them) against plain autograd math in float64, on fresh random
    inputs."""
    kernels = kernels or KernelOptions()
    g = torch.Generator(device="cpu").manual_seed(1)
    out = {}
    B, nh, T, hd = 2, 4, 256, 128
    for K in (1, 3, 6):
        ts = [
            torch.randn(B, nh, T, hd, generator=g).to(device, dtype).requires_grad_()
            for _ in range(3 + 2 * K)
        ]
        out[f"ttt_attention_k{K}"] = _attention_error(ts, K, hd, kernels)
    for K, L in (
        (1, 200),
        (3, 97),
    ):  # queries the last L of T positions (bottom-right causal), as with skipping
        ts = [
            torch.randn(B, nh, T if i in (1, 2) else L, hd, generator=g)
            .to(device, dtype)
            .requires_grad_()
            for i in range(3 + 2 * K)
        ]
        out[f"ttt_attention_k{K}_last{L}"] = _attention_error(ts, K, hd, kernels)
    for K in (1, 3):  # queries gathered position by position from the batch, as with chat masks
        b, t = (torch.rand(B, T, generator=g) < 0.45).nonzero(as_tuple=True)
        ts = [
            torch.randn(
                B if i in (1, 2) else 1, nh, T if i in (1, 2) else b.numel(), hd, generator=g
            )
            .to(device, dtype)
            .requires_grad_()
            for i in range(3 + 2 * K)
        ]
        out[f"ttt_attention_k{K}_rows"] = _attention_error(
            ts, K, hd, kernels, (b.to(device), t.to(device))
        )
    N, H, V, M = 3000, 256, 1000, 3000
    h = (torch.randn(N, H, generator=g) * 0.5).to(device, dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.05).to(device).requires_grad_()
    probs = torch.softmax(torch.randn(M, V, generator=g) * 3, -1).to(device)
    rows = torch.randint(0, M, (N,), generator=g).to(device)
    rw = (torch.rand(N, generator=g) * (torch.rand(N, generator=g) > 0.2)).to(device)
    loss, _ = head_soft_ce(h, w, probs, rows, rw, chunk=1024, kernels=kernels)
    dh, dw = torch.autograd.grad(loss, [h, w])
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lr = -(rw.double()[:, None] * probs.double()[rows] * torch.log_softmax(hr @ wr.T, -1)).sum()
    dhr, dwr = torch.autograd.grad(lr, [hr, wr])
    out["head_soft_ce"] = max(rel(loss, lr), rel(dh, dhr), rel(dw, dwr))
    return out


def check_compiled(device, dtype) -> dict:
    """A small drafter's loss and gradients with the fused (compiled) regions against eager: a
    prompt prefix (the span, step 0's queries on its last rows) and turns between replies (gathered
    rows)."""
    c = DrafterConfig(**TINY)
    model, head = build(c, device, dtype, seed=3)
    K, T = 4, 96
    turns = torch.ones(2, T, dtype=torch.bool)
    turns[:, 10:30], turns[1, 50:75] = False, False
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    res = {}
    for name, mask_fn in (
        ("compiled_vs_eager", None),
        ("compiled_vs_eager_turns", lambda B, seed: turns),
    ):
        d = batch(c, 2, T, device, dtype, seed=3, mask_fn=mask_fn)
        labels = teacher_labels(head, d.last, d.loss_mask, c.draft_vocab_size, dtype)
        out = []
        for on in (False, True):
            with autocast:
                loss, _, _ = TTTObjective(model, kernels=KernelOptions(compile=on))(
                    d.ids, d.aux, labels, K, 0.8
                )
            out.append([loss] + list(torch.autograd.grad(loss, params)))
        res[name] = max(rel(a, b) for a, b in zip(out[1], out[0]))
    # the teacher's compiled softmax region against eager: its probabilities, and argmaxes that
    # differ
    eager, compiled = (
        teacher_labels(
            head,
            d.last,
            d.loss_mask,
            c.draft_vocab_size,
            dtype,
            kernels=KernelOptions(compile=on),
        )
        for on in (False, True)
    )
    s = eager.scored
    res["teacher_compiled_vs_eager"] = rel(
        compiled.probs[s.view(-1)].float(), eager.probs[s.view(-1)].float()
    )
    res["teacher_compiled_argmax_differs"] = float(
        (compiled.target[s] != eager.target[s]).float().mean()
    )
    return res


def check_step(
    model, head, c, T, K, device, dtype, compile_on: bool, variants=("default", "fp8")
) -> dict:
    """One batch-1 step's loss and gradients with each variant (bf16 autocast on a GPU; `fp8`: the
    layer's GEMMs in FP8) and fp32 throughout (the reference, the default's kernels): relative error
    of the loss and of each trainable weight's gradient, each variant against the reference, and the
    second against the first."""
    d = batch(c, 1, T, device, dtype, seed=11, mask_fn=mask_source("prefix:0", T))
    labels = teacher_labels(head, d.last, d.loss_mask, c.draft_vocab_size, dtype)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for v, mixed in [(v, True) for v in variants] + [("fp32", False)]:
        autocast = torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" and mixed
        )
        aux = d.aux if mixed else d.aux.float()
        name = "default" if v == "fp32" else v
        with autocast:
            loss, _, _ = objective(model, variant(name, compile_on), name)(
                d.ids, aux, labels, K, 0.8
            )
        out[v] = [loss.detach().float()] + [g.float() for g in torch.autograd.grad(loss, params)]
    res = {}
    for a, b in [(v, "fp32") for v in variants] + [(variants[1], variants[0])] * (
        len(variants) > 1
    ):
        res[f"{a}_vs_{b}"] = {
            "loss": rel(out[a][0], out[b][0]),
            **{n: rel(x, y) for n, x, y in zip(names, out[a][1:], out[b][1:])},
        }
    return res


def fp8_gemm_errors(device, compile_on: bool, M: int = 4096) -> dict:
    """Each layer GEMM shape at Kimi size alone, on random data: the FP8 forward, input-gradient and
    weight-gradient GEMMs (quantized eagerly and compiled) against fp32 products of the same bf16
    inputs."""
    if device.type != "cuda":
        return {}
    c = DrafterConfig(**KIMI)
    H, I, nhd = c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim
    shapes = {
        "fc": (3 * H, H),
        "qkv": (2 * H, nhd),
        "o": (nhd, H),
        "gate_up": (H, I),
        "down": (I, H),
    }
    g = torch.Generator(device="cpu").manual_seed(13)
    res: dict = {}
    for name, (k, n) in shapes.items():
        x = torch.randn(M, k, generator=g).to(device, torch.bfloat16)
        w = (torch.randn(n, k, generator=g) * 0.02).to(device)
        dy = (torch.randn(M, n, generator=g) * 1e-9).to(device, torch.bfloat16)
        for comp in sorted({False, compile_on}):
            x8, sx, xc8, sxc = gemm.quant_both(x, compile=comp)
            w8, sw, wc8, swc = gemm.quant_both(w, compile=comp)
            d8, sd, dc8, sdc = gemm.quant_both(dy, compile=comp)
            res[f"{name}{'_compiled' if comp else ''}"] = {
                "y": rel(gemm.mm_fp8(x8, sx, w8, sw, torch.bfloat16), x.float() @ w.T),
                "dx": rel(gemm.mm_fp8(d8, sd, wc8, swc, torch.bfloat16), dy.float() @ w),
                "dw": rel(
                    gemm.mm_fp8(dc8, sdc, xc8, sxc, torch.bfloat16), dy.float().T @ x.float()
                ),
                "x_roundtrip": rel(x8.float() * sx, x.float()),
            }
    torch.cuda.empty_cache()
    return res


def gemm_rate(device) -> float:
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * 8192**3 / (time.perf_counter() - t0)


# ----------------------------------------------------------------------------- the model and data


def build(c: DrafterConfig, device, dtype, seed: int = 0):
    torch.manual_seed(seed)
    with torch.device(device):
        model = Eagle3Drafter(c)
        if dtype != torch.float32:
            model.embed_tokens.to(dtype)
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[torch.randperm(c.vocab_size)[: c.draft_vocab_size]] = (
            True  # a synthetic draft vocabulary
        )
        chosen = t2d.nonzero().flatten()
        model.d2t.copy_(chosen - torch.arange(c.draft_vocab_size))
        model.t2d.copy_(t2d)
        head = TargetHead(
            torch.randn(c.vocab_size, c.hidden_size, dtype=dtype) * 0.02, None, 1e-6, dtype
        )
        head.reorder(draft_first_order(t2d))
    return model, head


def mask_source(kind: str, T: int, masks_from: str | None = None):
    """(B, seed) -> bool [B, T] loss mask: "prefix:F" (a leading prompt share F of every row) or
    "file" (rows of --masks-from, batch `seed` taking the next B rows, cycling)."""
    if kind.startswith("prefix:"):
        f = float(kind.split(":", 1)[1])
        return lambda B, seed: torch.from_numpy(masks.prefix_masks(B, T, f))
    rows = masks.load_masks(masks_from, T)
    return lambda B, seed: torch.from_numpy(rows[[(seed * B + i) % len(rows) for i in range(B)]])


# sample ids a bench memo covers: batch `seed` of B holds sequences seed*B .. seed*B + B - 1
MEMO_SEQS = 256


def batch(c: DrafterConfig, B: int, T: int, device, dtype, seed: int, mask_fn=None) -> Batch:
    g = torch.Generator(device="cpu").manual_seed(seed)
    mask = (mask_fn or mask_source(f"prefix:{_PROMPT_FRACTION[0]}", T))(B, seed)
    assert (seed + 1) * B <= MEMO_SEQS, "a batch's sample ids must stay inside the bench's memo"
    return Batch(
        ids=torch.randint(0, c.vocab_size, (B, T), generator=g).to(device),
        sample_ids=list(range(seed * B, seed * B + B)),
        loss_mask=mask.to(device),
        aux=torch.randn(B, T, c.num_aux * c.target_hidden_size, generator=g).to(device, dtype),
        last=torch.randn(B, T, c.hidden_size, generator=g).to(device, dtype),
    )


def timed(fn, device, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def labeller(head, c: DrafterConfig, dtype, kernels: KernelOptions, T: int, memo: bool = True):
    """make_labels for optimizer_step: the teacher on a collated batch, as eyas.training.train runs
    it on a GPU: a sequence's full-vocabulary argmax bits are remembered the first time (the warm-up
    steps), so the timed steps are those of a training run's later epochs; memo False: a first
    epoch's."""
    teacher = lambda b, outside=None: teacher_labels(  # noqa: E731
        head,
        b.last,
        b.loss_mask,
        c.draft_vocab_size,
        dtype,
        kernels=kernels,
        outside=outside,
    )
    if not memo:
        return teacher
    memo = ArgmaxMemo([T] * MEMO_SEQS, head.weight.device)
    return lambda b: memo.labels(b, teacher)


def run_batch(
    model,
    head,
    opt,
    sched,
    c,
    B,
    T,
    K,
    device,
    dtype,
    args,
    kernels: KernelOptions,
    mask_fn=None,
    name: str = "default",
) -> dict:
    obj = objective(model, kernels, name)
    data = [batch(c, B, T, device, dtype, seed=s, mask_fn=mask_fn) for s in range(2)]
    counts = [scored_counts(list(d.loss_mask.cpu()), K) for d in data]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    make_labels = labeller(head, c, dtype, kernels, T, VARIANTS[name].get("memo", True))
    seen, i = [], [0]

    def step():
        j = i[0] % 2
        stats = optimizer_step(
            obj,
            obj,
            opt,
            sched,
            [data[j]],
            make_labels,
            ttt_steps=K,
            decay=0.8,
            counts=counts[j],
            grad_clip=0.5,
            autocast=autocast,
        )
        seen.append(float(stats[0]))
        i[0] += 1

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = timed(step, device, args.warmup, args.steps)
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else float("nan")
    reserved = torch.cuda.max_memory_reserved() / 1e9 if device.type == "cuda" else float("nan")
    med = statistics.median(times)
    unscored = 1.0 - float(sum(d.loss_mask.float().mean() for d in data)) / len(data)
    return {
        "batch": B,
        "step_s": med,
        "step_s_all": [round(t, 4) for t in times],
        "tokens_per_s": B * T / med,
        "unscored_share": round(unscored, 4),
        "rows_share": round(rows_share(data, K), 4),
        "peak_gb": peak,
        "peak_reserved_gb": reserved,
        "losses": [round(x, 4) for x in seen],
    }


def rows_share(data: list, K: int) -> float:
    """The share of positions the TTT steps >= 1 run on when skipping position by position
    (ttt_rows)."""
    n = 0.0
    for d in data:
        m = d.loss_mask.bool().cpu()
        scored = torch.zeros_like(m)
        scored[:, :-1] = m[:, 1:]
        n += ttt_rows(scored, K)[0].numel() / m.numel()
    return n / len(data)


def breakdown(model, head, opt, c, T, K, device, dtype, args, kernels: KernelOptions) -> dict:
    """Batch 1, the parts of a step timed alone: teacher, forward+backward, clip+AdamW."""
    obj = TTTObjective(model, kernels=kernels)
    d = batch(c, 1, T, device, dtype, seed=7)
    counts = scored_counts(list(d.loss_mask.cpu()), K)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    labels: list[Labels] = []
    params = [p for p in model.parameters() if p.requires_grad]
    first = labeller(head, c, dtype, kernels, T, memo=False)
    later = labeller(head, c, dtype, kernels, T, memo=True)
    teacher = lambda: labels.append(first(d))  # noqa: E731  (the whole vocabulary: a first epoch)
    teacher_later = lambda: labels.append(later(d))  # noqa: E731  (the argmax's bit remembered)

    def fwd_bwd():
        with autocast:
            loss, _, _ = obj(d.ids, d.aux, labels[-1], K, 0.8, counts)
        loss.backward()

    def fwd():
        with torch.no_grad(), autocast:
            obj(d.ids, d.aux, labels[-1], K, 0.8, counts)

    def opt_step():
        clip_and_step(params, opt, 0.5)

    out = {
        "teacher_s": statistics.median(timed(teacher, device, 1, args.steps)),
        "teacher_later_epochs_s": statistics.median(timed(teacher_later, device, 1, args.steps)),
    }
    out["forward_nograd_s"] = statistics.median(timed(fwd, device, 1, 3))
    out["forward_backward_s"] = statistics.median(timed(fwd_bwd, device, 1, args.steps))
    out["clip_adamw_s"] = statistics.median(timed(opt_step, device, 1, args.steps))
    opt.zero_grad(set_to_none=True)
    return out


# The variants for side-by-side runs (--variants, --mask-variants): "kernels" the KernelOptions
# fields set (compile is the run's; the step's optimisations switched off), "memo" False for a
# run's first epoch (the teacher over the whole vocabulary; the default's timed steps are the later
# epochs', the argmax's bit remembered: ArgmaxMemo), "head_chunk" the fused head's rows per chunk.
VARIANTS = {
    "default": {},
    "nomemo": {"memo": False},
    "fp8": {"kernels": dict(fp8_gemms=True)},  # the layer's GEMMs in FP8 (training.fp8_gemms)
    "flash": {"kernels": dict(cudnn=False)},  # the TTT attention on FlashAttention-2
    "tce": {"kernels": dict(skip_span=False, gather_under=0.0)},  # every position
    "skip": {"kernels": dict(triton_ce=False)},  # the PyTorch soft CE
    # every position, the PyTorch soft CE
    "all": {"kernels": dict(skip_span=False, gather_under=0.0, triton_ce=False)},
    "span": {"kernels": dict(gather_under=0.0)},  # skipping by the batch's one scored span
    "noemb": {"kernels": dict(shared_emb=False)},  # every TTT step projects its own embedding
    "noinplace": {"kernels": dict(emb_inplace=False)},  # autograd sums the embedding's slices
    "nogroup": {"kernels": dict(grouped_gemms=False)},  # q/k/v and gate/up one node each
    "noteacherlt": {"kernels": dict(teacher_cublaslt=False)},  # the teacher's GEMMs under cuBLAS
    "nofusedclip": {"kernels": dict(fused_clip=False)},  # clip_grad_norm_, then the step
    "before": {"kernels": dict(emb_inplace=False, grouped_gemms=False, teacher_cublaslt=False)},
    "chunk4k": {"head_chunk": 4096},
    "chunk16k": {"head_chunk": 16384},
    "chunk32k": {"head_chunk": 32768},
}


def variant(name: str, compile_on: bool) -> KernelOptions:
    return KernelOptions(compile=compile_on, **VARIANTS[name].get("kernels", {}))


def objective(model, kernels: KernelOptions, name: str = "default") -> TTTObjective:
    """The training objective of a variant: its KernelOptions and its head chunk."""
    return TTTObjective(model, VARIANTS[name].get("head_chunk", HEAD_CHUNK_ROWS), kernels=kernels)


def run_variants(
    names,
    model,
    head,
    opt,
    sched,
    c,
    B,
    T,
    K,
    device,
    dtype,
    rounds: int,
    per_round: int,
    compile_on: bool,
    mask_fn=None,
) -> list:
    """The variants side by side at one batch size, interleaved (a warm-up step each, then `rounds`
    rounds of `per_round` timed steps of every variant in turn), so clock and thermal drift hit all
    alike. Each variant is its own TTTObjective over the one model, built with its KernelOptions."""
    data = batch(c, B, T, device, dtype, seed=0, mask_fn=mask_fn)
    counts = scored_counts(list(data.loss_mask.cpu()), K)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    objectives = {n: objective(model, variant(n, compile_on), n) for n in names}
    labellers = {
        n: labeller(head, c, dtype, o.kernels, T, VARIANTS[n].get("memo", True))
        for n, o in objectives.items()
    }

    def step(n):
        o = objectives[n]
        return optimizer_step(
            o,
            o,
            opt,
            sched,
            [data],
            labellers[n],
            ttt_steps=K,
            decay=0.8,
            counts=counts,
            grad_clip=0.5,
            autocast=autocast,
        )

    times: dict = {n: [] for n in names}
    peaks: dict = {}
    for n in list(names):
        try:
            if (
                not opt.state
            ):  # AdamW's moments (8 B a weight) come with the first step: in every peak
                step(n)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            step(n)
            sync(device)
        except Exception as e:  # noqa: BLE001 - drop this variant, measure the others
            log(f"variant {n} batch {B}: {type(e).__name__}: {str(e)[:1000]}")
            opt.zero_grad(set_to_none=True)
            names = [m for m in names if m != n]
            continue
        peaks[n] = (
            torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else float("nan")
        )
    for _ in range(rounds):
        for n in names:
            times[n] += timed(lambda: step(n), device, 0, per_round)
    out = []
    for n in names:
        med = statistics.median(times[n])
        out.append(
            {
                "variant": n,
                "batch": B,
                "step_s": med,
                "tokens_per_s": B * T / med,
                "peak_gb": peaks[n],
                "step_s_all": [round(t, 4) for t in times[n]],
            }
        )
        log(
            f"variant {n} batch {B}: {med * 1e3:.1f} ms/step, {B * T / med:.0f} tok/s, peak "
            f"{peaks[n]:.1f} GB, steps {out[-1]['step_s_all']}"
        )
    return out


def kernel_summary(prof, top: int = 40) -> dict:
    """GPU time by kernel class (GEMM, attention, Triton, the rest) and the top kernels, from a
    profile."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0 and e.device_type.name == "CUDA":
            rows.append((t / 1e3, e.count, e.key))
    rows.sort(reverse=True)

    def kind(name: str) -> str:
        n = name.lower()
        if (
            any(w in n for w in ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "cublas"))
            and "flash" not in n
        ):
            return "gemm"
        if any(w in n for w in ("flash", "fmha", "cudnn", "attn", "sdpa")):
            return "attention"
        if n.startswith("triton"):
            return "triton"
        if "adam" in n or "norm" in n and "foreach" in n:
            return "optimizer"
        return "other"

    by: dict = {}
    for t, _, name in rows:
        by[kind(name)] = by.get(kind(name), 0.0) + t
    return {
        "total_ms": sum(t for t, _, _ in rows),
        "by_kind_ms": {k: round(v, 2) for k, v in by.items()},
        "top": [[round(t, 2), n, name[:120]] for t, n, name in rows[:top]],
    }


def profile_batch(
    model, head, opt, sched, c, B, T, K, device, dtype, kernels: KernelOptions, mask_fn=None
) -> dict:
    from torch.profiler import ProfilerActivity, profile

    obj = TTTObjective(model, kernels=kernels)
    d = batch(c, B, T, device, dtype, seed=9, mask_fn=mask_fn)
    counts = scored_counts(list(d.loss_mask.cpu()), K)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    make_labels = labeller(head, c, dtype, kernels, T)
    step = lambda: optimizer_step(  # noqa: E731
        obj,
        obj,
        opt,
        sched,
        [d],
        make_labels,
        ttt_steps=K,
        decay=0.8,
        counts=counts,
        grad_clip=0.5,
        autocast=autocast,
    )
    step()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    return kernel_summary(prof)


def check_fused_clip(device) -> float:
    """One AdamW step with the clip inside the fused kernel against clip_grad_norm_ + step: max
    relative error."""
    if device.type != "cuda":
        return float("nan")
    g = torch.Generator(device="cpu").manual_seed(5)
    out = []
    for on in (False, True):
        ps = [torch.nn.Parameter(torch.randn(n, generator=g).to(device)) for n in (1000, 3000)]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(device) * 3
        opt = make_optimizer(ps, 1e-2, 0.01)
        clip_and_step(ps, opt, 0.5, in_kernel=on)
        out.append(torch.cat([p.detach().flatten() for p in ps]))
        g = torch.Generator(device="cpu").manual_seed(5)
    return rel(out[1], out[0])


def gemm_shapes(device, batches=(1, 4)) -> dict:
    """TFLOP/s of each GEMM of a step at Kimi size, by shape, under cuBLAS and cuBLASLt: forward,
    input gradient, and the ways a weight gradient can join its sum (accumulating GEMM into (out,
    in) or (in, out), or a plain GEMM and an add: docs/performance.md); the head's three GEMMs per
    8192-row chunk and the teacher's per 4096 positions."""
    if device.type != "cuda":
        return {}
    c = DrafterConfig(**KIMI)
    H, I, nhd, Vd = (
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads * c.head_dim,
        c.draft_vocab_size,
    )
    shapes = {
        "qkv": (nhd, 2 * H),
        "o": (H, nhd),
        "gate_up": (I, H),
        "down": (H, I),
        "fc": (H, 3 * H),
    }
    bf = dict(device=device, dtype=torch.bfloat16)
    res: dict = {}
    rate = lambda fl, fn: round(fl / statistics.median(timed(fn, device, 2, 5)) / 1e12, 1)  # noqa: E731
    for blas in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(blas)
        for B in batches:
            M = 4096 * B
            for name, (n_out, n_in) in shapes.items():
                x, dy, w = (
                    torch.randn(M, n_in, **bf),
                    torch.randn(M, n_out, **bf),
                    torch.randn(n_out, n_in, **bf),
                )
                buf, buf_t = torch.randn(n_out, n_in, **bf), torch.randn(n_in, n_out, **bf)
                fl = 2 * M * n_out * n_in
                ops = {
                    "fwd": lambda: x @ w.T,
                    "dgrad": lambda: dy @ w,
                    "wgrad": lambda: dy.T @ x,
                    "badd": lambda: buf.addmm_(dy.T, x),
                    "badd_t": lambda: buf_t.addmm_(x.T, dy),
                    "add": lambda: buf.add_(dy.T @ x),
                }
                res[f"{blas} b{B} {name}"] = {op: rate(fl, fn) for op, fn in ops.items()}
        N = 8192
        hc, W, dz = (
            torch.randn(N, H, **bf),
            torch.randn(Vd, H, **bf) * 0.05,
            torch.randn(N, Vd, **bf),
        )
        gw, gw_b = torch.zeros(Vd, H, device=device), torch.zeros(Vd, H, **bf)
        fl = 2 * N * Vd * H
        res[f"{blas} head chunk"] = {
            "z_fp32": rate(fl, lambda: gemm.mm_f32(hc, W.T)),
            "z_bf16": rate(fl, lambda: hc @ W.T),
            "gh": rate(fl, lambda: dz @ W),
            "gw_fp32acc": rate(fl, lambda: gemm.addmm_f32_(gw, dz.T, hc)),
            "gw_bf16badd": rate(fl, lambda: gw_b.addmm_(dz.T, hc)),
        }
        Wt = torch.randn(c.vocab_size, H, **bf) * 0.02
        x = torch.randn(4096, H, **bf)
        res[f"{blas} teacher"] = {
            "z_fp32": rate(2 * 4096 * c.vocab_size * H, lambda: gemm.mm_f32(x, Wt.T))
        }
        for k, v in res.items():
            if k.startswith(blas):
                log(f"GEMM TFLOP/s {k}: {v}")
    torch.backends.cuda.preferred_blas_library("cublas")
    torch.cuda.empty_cache()
    return res


def soft_ce_timing(device, kernels: KernelOptions) -> dict:
    """The soft cross-entropy of one head chunk (8192 x 32000): the Triton kernel (at a few block
    sizes) against the PyTorch math (compiled as `kernels` says), ms and relative error of loss and
    gradient against float64."""
    if device.type != "cuda":
        return {}
    g = torch.Generator(device="cpu").manual_seed(11)
    N, V = 8192, 32000
    z = (torch.randn(N, V, generator=g) * 4).to(device)
    probs = torch.softmax(torch.randn(2 * N, V, generator=g) * 3, -1).to(device, torch.bfloat16)
    rows = torch.randint(0, 2 * N, (N,), generator=g).to(device)
    w = (torch.rand(N, generator=g) * (torch.rand(N, generator=g) > 0.2)).to(device)
    p = probs[rows].double()
    logq = torch.log_softmax(z.double(), -1)
    ref_loss, ref_dz = (
        -((p * logq).sum(-1) * w.double()).sum(),
        (logq.exp() - p) * w.double()[:, None],
    )
    out = {"triton_available": soft_ce._triton_ce_ready(z)}
    if out["triton_available"]:  # the kernel's tuning: elements per loop step and warps per row
        dz = torch.empty(z.shape, dtype=torch.bfloat16, device=device)
        for block, warps in ((2048, 4), (4096, 8), (8192, 16)):
            out[f"triton_{block}_{warps}_ms"] = 1e3 * statistics.median(
                timed(
                    lambda: soft_ce._soft_ce_triton(z, probs, rows, w, dz, block, warps),
                    device,
                    2,
                    10,
                )
            )
    want = z.argmax(-1)
    for name, kn in (("triton", kernels), ("compiled", replace(kernels, triton_ce=False))):
        # a copy: the PyTorch version works in place on z (the caller's buffer), so z itself,
        # compared against afterwards, would no longer be the logits
        loss, pred, dz = soft_ce.soft_ce_rows(z.clone(), probs, rows, w, torch.bfloat16, kn)
        out[f"{name}_rel_err"] = max(rel(loss, ref_loss), rel(dz, ref_dz))
        out[f"{name}_argmax_ok"] = bool(torch.equal(pred, want))
        out[f"{name}_ms"] = 1e3 * statistics.median(
            timed(
                lambda: soft_ce.soft_ce_rows(z, probs, rows, w, torch.bfloat16, kn),  # noqa: B023
                device,
                2,
                10,
            )
        )
    return out


# A variant whose rows time the later epochs (the memo on), and the variant timing its first epoch
FIRST_EPOCH = {"default": "nomemo"}


def run_average(first: float, later: float, epochs: int) -> float:
    """Tokens/s of a run of `epochs` epochs: the first at `first`, the rest at `later` (equal tokens
    each)."""
    return epochs / (1 / first + (epochs - 1) / later)


def specforge_goals(
    mask_rows: list, tiny: bool, variant_name: str = "default", epochs: int = 10
) -> dict:
    """Issue 18's goals against SpecForge 0.2.0 from the chat-shaped rows of one variant (keys
    suffixed with it unless the default; none met on the tiny drafter).

    The default's rows time a training run's later epochs (the teacher's argmax bit remembered:
    ArgmaxMemo); its goals are judged on a whole run of `epochs` epochs, its first timed by the
    `nomemo` rows of the same mask and batch (no value, not met, without them; FIRST_EPOCH). Another
    variant's are its rows as they are."""
    by = {
        (r.get("mask"), r.get("batch")): r.get("tokens_per_s")
        for r in mask_rows
        if r.get("variant", "default") == variant_name
    }
    first = {
        (r.get("mask"), r.get("batch")): r.get("tokens_per_s")
        for r in mask_rows
        if r.get("variant") == FIRST_EPOCH.get(variant_name)
    }
    out = {}
    for key, (mask, b, need) in SPECFORGE_GOALS.items():
        if variant_name != "default":
            if not by:
                continue
            key = f"{key}_{variant_name}"
        v = None if tiny else by.get((mask, b))
        row = {}
        if variant_name in FIRST_EPOCH:
            f = first.get((mask, b))
            row = {
                "later_epochs": None if v is None else round(v, 1),
                "first_epoch": None if f is None else round(f, 1),
                "epochs": epochs,
            }
            v = None if v is None or f is None else run_average(f, v, epochs)
        out[key] = {
            "value": None if v is None else round(v, 1),
            "goal": f">= {need}",
            "met": v is not None and v >= need,
            "x_specforge": None if v is None else round(v / SPECFORGE[b], 3),
            **row,
        }
    return out


def clean(x):
    """NaN and infinities as null, so the line is strict JSON."""
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


# ----------------------------------------------------------------------------- from shards (issue 3


def shards_pass(
    data: ShardData,
    obj,
    opt,
    sched,
    make_labels,
    B: int,
    K: int,
    device,
    dtype,
    epoch: int,
    workers: int,
) -> dict:
    """One epoch over the shards through the training loop's data path (plan_steps, BatchLoader, the
    step as eyas.training.train runs it): per-step wall time (the loader's hand-over included) and
    the time each step waited for data."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    steps = plan_steps(data.lengths, data.train_ids, B, 1, 0, epoch, 0)
    steps = [next(steps) for _ in range(len(data.train_ids) // B)]
    times, waits, losses = [], [], []
    sync(device)
    with BatchLoader(data, steps, device, dtype, workers=workers) as loader:
        t_prev = time.perf_counter()
        for (_, _, micro), mine in loader:
            waited = loader.wait_s
            counts = data.scored[[i for m in micro for i in m]].sum(0)
            stats = optimizer_step(
                obj,
                obj,
                opt,
                sched,
                mine,
                make_labels,
                ttt_steps=K,
                decay=0.8,
                counts=counts,
                grad_clip=0.5,
                autocast=autocast,
            )  # ends on the host: synchronised
            now = time.perf_counter()
            times.append(now - t_prev)
            waits.append(loader.wait_s - waited)
            losses.append(round(float(stats[0]), 4))
            t_prev = now
    timed = times[1:] or times  # the first step also waits for the first read: reported apart
    return {
        "steps": len(times),
        "step_s_all": [round(t, 4) for t in times],
        "wait_s_all": [round(w, 4) for w in waits],
        "tokens_per_s": B * data.lengths[0] * len(timed) / sum(timed),
        "first_step_wait_s": round(waits[0], 4),
        "wait_s_per_step": sum(waits[1:]) / max(len(waits) - 1, 1),
        "read_gb": loader.read_bytes / 1e9,
        "losses": losses,
    }


def run_from_shards(
    args, model, head, opt, sched, c, T, K, device, dtype, kernels
) -> tuple[dict, dict]:
    """Synthetic batches and shards side by side, per batch size: the synthetic step (run_batch, the
    prompt-0.3 mask) and, per encoding, epochs over Kimi-size shards written here with ShardWriter
    (the same mask): one to warm up (it fills the teacher's ArgmaxMemo, as the synthetic warm-up
    does, and compiles nothing new: same shapes), one cold (every file's pages dropped first), one
    warm."""
    from bench.loader import write_shards

    root = Path(args.shard_dir or Path(__file__).resolve().parents[1] / ".perf" / "shards")
    shutil.rmtree(root, ignore_errors=True)
    figures: dict = {
        "shard_dir": str(root),
        "filesystem": filesystem(root.parent),
        "loader_workers": args.loader_workers,
        "prompt_fraction": args.shape_fraction,
        "rows": [],
    }
    paths = {}
    for enc in args.shard_encodings:
        t0 = time.perf_counter()
        paths[enc] = write_shards(
            root / enc,
            args.shard_sequences,
            hidden_size=c.target_hidden_size,
            num_aux=c.num_aux,
            seq=T,
            encoding=enc,
            prompt_fraction=args.shape_fraction,
            device=device.type,
            vocab=c.vocab_size,
        )
        size = sum(p.stat().st_size for p in paths[enc])
        rate, nread = disk_read_rate(paths[enc][0], 1 << 30)
        figures[f"written_{enc}"] = {
            "seconds": round(time.perf_counter() - t0, 1),
            "gb": round(size / 1e9, 3),
            "disk_probe_gb_s": round(rate / 1e9, 3),
            "probe_gb": round(nread / 1e9, 3),
        }
        log(f"wrote {args.shard_sequences} sequences {enc}: {figures[f'written_{enc}']}")
    figures["loader_matches_collate"] = {
        enc: loader_matches_collate(paths[enc], device, dtype, K) for enc in args.shard_encodings
    }
    log(f"loader batches bit for bit collate's on {device}: {figures['loader_matches_collate']}")
    shape = mask_source(f"prefix:{args.shape_fraction}", T)
    goals = {
        "loader_matches_collate": {
            "value": figures["loader_matches_collate"],
            "goal": "all true",
            "met": all(figures["loader_matches_collate"].values()),
        }
    }
    for B in args.shard_batches:
        syn = run_batch(
            model, head, opt, sched, c, B, T, K, device, dtype, args, kernels, mask_fn=shape
        )
        syn["tokens_per_s_mean"] = B * T * len(syn["step_s_all"]) / sum(syn["step_s_all"])
        row = {"batch": B, "synthetic": syn}
        log(
            f"batch {B} synthetic: {syn['tokens_per_s_mean']:.0f} tok/s (mean of "
            f"{len(syn['step_s_all'])} steps), peak {syn['peak_gb']:.1f} GB"
        )
        for enc in args.shard_encodings:
            data = ShardData(paths[enc], num_validation=0, ttt_steps=K)
            obj = objective(model, kernels)
            teacher = lambda b, outside=None: teacher_labels(  # noqa: E731
                head,
                b.last,
                b.loss_mask,
                c.draft_vocab_size,
                dtype,
                kernels=kernels,
                outside=outside,
            )
            memo = ArgmaxMemo(data.lengths, device)
            make_labels = lambda b: memo.labels(b, teacher)  # noqa: E731
            r = {
                "warmup": shards_pass(
                    data, obj, opt, sched, make_labels, B, K, device, dtype, 0, args.loader_workers
                )
            }
            for p in paths[enc]:
                drop_cache(p)
            r["cold"] = shards_pass(
                data, obj, opt, sched, make_labels, B, K, device, dtype, 1, args.loader_workers
            )
            r["warm"] = shards_pass(
                data, obj, opt, sched, make_labels, B, K, device, dtype, 2, args.loader_workers
            )
            for mode in ("cold", "warm"):
                v = r[mode]["tokens_per_s"] / syn["tokens_per_s_mean"]
                r[mode]["of_synthetic"] = round(v, 4)
                name = f"shards_{'bf16' if enc == 'plain' else 'fp8'}_b{B}_{mode}"
                goals[name] = {"value": round(v, 4), "goal": ">= 0.97", "met": v >= 0.97}
                log(
                    f"batch {B} {enc} {mode}: {r[mode]['tokens_per_s']:.0f} tok/s = {v:.1%} of "
                    f"synthetic; waited {r[mode]['wait_s_per_step'] * 1e3:.1f} ms/step (first step "
                    f"{r[mode]['first_step_wait_s']:.2f} s), steps {r[mode]['step_s_all']}"
                )
            row[enc] = r
        figures["rows"].append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    shutil.rmtree(root, ignore_errors=True)
    table = [
        "batch  synthetic  "
        + "  ".join(f"{e[:5]:>5} cold  {e[:5]:>5} warm" for e in args.shard_encodings)
    ]
    for row in figures["rows"]:
        cells = [
            f"{row[e][m]['tokens_per_s']:>7.0f} {row[e][m]['of_synthetic']:>6.1%}"
            for e in args.shard_encodings
            for m in ("cold", "warm")
        ]
        table.append(
            f"{row['batch']:>5}  {row['synthetic']['tokens_per_s_mean']:>9.0f}  " + "  ".join(cells)
        )
    figures["table"] = table
    for line in table:
        log(line)
    return figures, goals


def loader_matches_collate(paths: list[Path], device, dtype, K: int, steps: int = 2) -> bool:
    """The loader's batches on this device (pinned, side stream, FP8 dequantized here) against the
    synchronous collate's, bit for bit, for the first `steps` batches of 2."""
    from eyas.training.batches import collate

    data = ShardData(paths, num_validation=0, ttt_steps=K)
    plan = plan_steps(data.lengths, data.train_ids, 2, 1, 0, 0, 0)
    items = [next(plan) for _ in range(steps)]
    ok = True
    with BatchLoader(data, items, device, dtype, workers=2) as loader:
        for (_, _, micro), (b,) in loader:
            want = collate([data.sample(i) for i in micro[0]], device, dtype, ids=micro[0])
            ok &= all(
                torch.equal(x, y) and x.dtype == y.dtype
                for x, y in zip(b.tensors(), want.tensors())
            )
            ok &= b.sample_ids == want.sample_ids
    return bool(ok)


def filesystem(path: Path) -> str:
    """The filesystem type holding path (from /proc/mounts; tmpfs would make "cold" meaningless)."""
    path, best = Path(path).resolve(), ("", "unknown")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mnt, kind, *_ = line.split()
            if str(path).startswith(mnt) and len(mnt) > len(best[0]):
                best = (mnt, kind)
    except OSError:
        pass
    return f"{best[1]} at {best[0]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny drafter (the default without a GPU)"
    )
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 4096; tiny 64)")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument(
        "--compile",
        choices=["on", "off"],
        default=None,
        help="fuse the elementwise regions with torch.compile (default: on for CUDA)",
    )
    ap.add_argument(
        "--eager-batches",
        type=int,
        nargs="*",
        default=None,
        help="batches to measure again without compile (default 1 4 when compiling)",
    )
    ap.add_argument("--out", default=None, help="folder for bench_train.json")
    ap.add_argument(
        "--variants",
        nargs="*",
        default=None,
        choices=list(VARIANTS),
        help="measure these switch settings side by side first (at --variant-batches)",
    )
    ap.add_argument("--variant-batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument(
        "--variant-masks",
        choices=["main", "masks-from", "prompt", "all-scored"],
        default="main",
        help="the variants' loss masks: the main rows' (--prompt-fraction) or a chat-shaped kind",
    )
    ap.add_argument(
        "--gemm-shapes", action="store_true", help="time each GEMM shape of a step first"
    )
    ap.add_argument(
        "--prompt-fraction",
        type=float,
        default=1 / 16,
        help="the main rows' unscored leading share of each sequence (default 1/16, as recorded)",
    )
    ap.add_argument(
        "--masks-from",
        default=None,
        help="bool [N, T] .npy of real conversations' loss masks, packed (bench/masks.py)",
    )
    ap.add_argument(
        "--mask-batches",
        type=int,
        nargs="*",
        default=None,
        help="batches to measure with chat-shaped masks: every position scored, "
        "--shape-fraction, "
        "--masks-from (default 1 4; none with no value)",
    )
    ap.add_argument(
        "--mask-kinds",
        nargs="+",
        default=["masks-from", "prompt", "all-scored"],
        choices=["masks-from", "prompt", "all-scored"],
        help="which chat-shaped rows, in this order (each new span and batch size "
        "costs a recompile "
        "of the fused regions, about a minute at Kimi size: an 8-minute call fits "
        "about six rows)",
    )
    ap.add_argument(
        "--shape-fraction", type=float, default=0.3, help="the prompt share of the chat-shaped row"
    )
    ap.add_argument(
        "--mask-variants",
        nargs="+",
        default=["default", "nomemo"],
        choices=list(VARIANTS),
        help="measure each chat-shaped row with these KernelOptions variants (default: "
        "the later "
        "epochs' step and the first epoch's, `nomemo`, which the goals' run "
        "average needs)",
    )
    ap.add_argument(
        "--epochs",
        type=int,
        default=10,
        help="the run the goals average over: its first epoch's step and the later "
        "ones' "
        "(default 10, configs/kimi-k2.5-sglang.yaml's ~10 epochs)",
    )
    ap.add_argument(
        "--fp8-check",
        action="store_true",
        help="one step's loss and gradients with FP8 GEMMs against the default's (relative error)",
    )
    ap.add_argument(
        "--step-check",
        nargs="+",
        default=None,
        choices=list(VARIANTS),
        help="one step's loss and gradients with these variants against fp32 (relative error)",
    )
    ap.add_argument(
        "--profile-mask",
        choices=["main", "masks-from", "prompt", "all-scored"],
        default="main",
        help="the loss masks of the profiled step (default: the main rows')",
    )
    ap.add_argument(
        "--profile-batches",
        type=int,
        nargs="*",
        default=[1],
        help="profile one step at these batches (GPU time by kernel class)",
    )
    ap.add_argument(
        "--from-shards",
        action="store_true",
        help="only the synthetic step beside the same step fed from Kimi-size shards "
        "written here "
        "(bf16 and FP8; issue 30's goals): --shard-batches, --shape-fraction's "
        "masks",
    )
    ap.add_argument("--shard-batches", type=int, nargs="+", default=[4, 1])
    ap.add_argument(
        "--shard-encodings", nargs="+", default=["plain", "fp8_e4m3"], choices=["plain", "fp8_e4m3"]
    )
    ap.add_argument(
        "--shard-sequences",
        type=int,
        default=None,
        help="sequences per encoding (default 24: 6 steps an epoch at batch 4; tiny 8)",
    )
    ap.add_argument(
        "--shard-dir",
        default=None,
        help="where the shards are written (default .perf/shards: the machine's disk, not a tmpfs)",
    )
    ap.add_argument(
        "--loader-workers",
        type=int,
        default=2,
        help="BatchLoader threads (training.loader_workers)",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    _PROMPT_FRACTION[0] = args.prompt_fraction
    masks.prefix_masks(1, 16, args.prompt_fraction)  # refuse a bad fraction before any work
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type != "cuda" and not args.tiny:  # Kimi size needs ~40 GB and a GPU's speed
        args.tiny, args.batches, args.steps, args.warmup = True, [1, 2], 2, 1
    c = DrafterConfig(**(TINY if args.tiny else KIMI))
    T, K = args.seq or (64 if args.tiny else 4096), args.ttt
    fl = flops_per_token(c, T, K)
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    log(f"{env}; drafter {c}; T {T}, TTT {K}; {fl['total'] / 1e9:.2f} GFLOP/token model FLOPs")

    figures: dict = {
        "env": env,
        "seq": T,
        "ttt_steps": K,
        "flops_per_token": fl,
        "prompt_fraction": args.prompt_fraction,
        "masks_from": args.masks_from,
    }
    compile_on = (args.compile or ("on" if device.type == "cuda" else "off")) == "on"
    figures["compile"] = compile_on
    checks = (
        not args.from_shards
    )  # the from-shards rows time the step only (the checks cost a minute)
    figures["checks_rel_err"] = check_kernels(device, dtype) if checks else {}
    if device.type == "cuda" and checks:
        flash = check_kernels(device, dtype, KernelOptions(cudnn=False))
        figures["checks_rel_err"].update(
            {f"{k}_flash": v for k, v in flash.items() if k.startswith("ttt")}
        )
        figures["checks_rel_err"]["fused_clip_adamw"] = check_fused_clip(device)
    if compile_on and checks:
        t0 = time.perf_counter()
        try:
            figures["checks_rel_err"].update(check_compiled(device, dtype))
            # forget the small model's sizes (automatic dynamic shapes would mark them all)
            torch._dynamo.reset()
            log(
                f"compiled the fused regions in {time.perf_counter() - t0:.1f}s (with a small "
                f"check run)"
            )
        except Exception as e:  # noqa: BLE001 - report, then measure eager rather than nothing
            log(f"torch.compile failed, measuring eager: {type(e).__name__}: {str(e)[:2000]}")
            figures["compile_error"], compile_on = f"{type(e).__name__}: {str(e)[:2000]}", False
            figures["compile"] = False
    kernels = KernelOptions(
        compile=compile_on
    )  # the default's; --variants measure others beside it
    log(f"kernel checks (relative error vs float64): {figures['checks_rel_err']}")
    figures["gemm_bf16_tflops"] = gemm_rate(device) / 1e12
    log(f"bf16 GEMM 8192^3: {figures['gemm_bf16_tflops']:.0f} TFLOP/s")
    if args.gemm_shapes:
        figures["gemm_shapes_tflops"] = gemm_shapes(device)
    figures["soft_ce"] = soft_ce_timing(device, kernels) if checks else {}
    figures["cudnn_refused"] = (
        "cudnn" in attention._refused
    )  # then every "cudnn" run below ran flash
    log(
        f"soft cross-entropy of one head chunk: {figures['soft_ce']}; attention kernel "
        f"{'flash (cuDNN refused)' if figures['cudnn_refused'] else 'cudnn'}"
    )

    t0 = time.perf_counter()
    model, head = build(c, device, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, 1e-4, 0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 10, 1000))
    figures["trainable_params"] = sum(p.numel() for p in params)
    log(
        f"built in {time.perf_counter() - t0:.1f}s: {figures['trainable_params'] / 1e9:.3f}B "
        f"trainable params, optimizer fused={opt.defaults.get('fused')}"
    )

    if args.from_shards:
        args.shard_sequences = args.shard_sequences or (8 if args.tiny else 24)
        figures["from_shards"], goals = run_from_shards(
            args, model, head, opt, sched, c, T, K, device, dtype, kernels
        )
        line = clean({"bench": "train", "figures": figures, "goals": goals})
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "bench_train_shards.json").write_text(
                json.dumps(line, indent=2) + "\n"
            )
        print(json.dumps(line, separators=(",", ":")), flush=True)
        return

    if args.fp8_check:
        try:
            figures["fp8_gemm_rel_err"] = fp8_gemm_errors(device, compile_on)
            log(f"FP8 GEMMs alone (relative error against fp32): {figures['fp8_gemm_rel_err']}")
            figures["fp8_step_rel_err"] = check_step(
                model, head, c, T, K, device, dtype, compile_on
            )
        except Exception as e:  # noqa: BLE001 - report, measure the rest
            figures["fp8_step_rel_err"] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
        log(
            f"a step's loss and gradients, FP8 / default / fp32 (relative error): "
            f"{figures['fp8_step_rel_err']}"
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if args.step_check:
        try:
            figures["step_rel_err"] = check_step(
                model, head, c, T, K, device, dtype, compile_on, args.step_check
            )
        except Exception as e:  # noqa: BLE001 - report, measure the rest
            figures["step_rel_err"] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
        log(f"a step's loss and gradients against fp32 (relative error): {figures['step_rel_err']}")
        if device.type == "cuda":
            torch.cuda.empty_cache()

    figures["variants"] = []
    known = {
        "all-scored": ("all-scored", "prefix:0"),
        "prompt": (f"prompt-{args.shape_fraction:g}", f"prefix:{args.shape_fraction}"),
        "masks-from": ("masks-from", "file"),
    }
    if args.variants:
        vmask = (
            None
            if args.variant_masks == "main"
            else mask_source(known[args.variant_masks][1], T, args.masks_from)
        )
        figures["variant_masks"] = args.variant_masks
        for B in args.variant_batches:
            try:
                figures["variants"] += run_variants(
                    args.variants,
                    model,
                    head,
                    opt,
                    sched,
                    c,
                    B,
                    T,
                    K,
                    device,
                    dtype,
                    rounds=3,
                    per_round=2,
                    compile_on=compile_on,
                    mask_fn=vmask,
                )
            except Exception as e:  # noqa: BLE001
                log(f"variants at batch {B}: {type(e).__name__}: {str(e)[:1500]}")
                opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    results = []
    for B in args.batches:
        try:
            r = run_batch(model, head, opt, sched, c, B, T, K, device, dtype, args, kernels)
        except torch.cuda.OutOfMemoryError as e:
            r = {"batch": B, "oom": str(e).splitlines()[0]}
            opt.zero_grad(set_to_none=True)
        except Exception as e:  # noqa: BLE001 - keep measuring the other sizes
            r = {"batch": B, "error": f"{type(e).__name__}: {str(e)[:1500]}"}
            opt.zero_grad(set_to_none=True)
        if "tokens_per_s" in r:
            r["tflops"] = r["tokens_per_s"] * fl["total"] / 1e12
            r["mfu_datasheet"] = r["tflops"] * 1e12 / DATASHEET_BF16
            r["mfu_measured_gemm"] = r["tflops"] / figures["gemm_bf16_tflops"]
            log(
                f"batch {B}: {r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:.0f} tok/s, "
                f"{r['tflops']:.0f} TFLOP/s, "
                f"MFU {r['mfu_datasheet']:.1%} (of GEMM {r['mfu_measured_gemm']:.1%}), peak "
                f"{r['peak_gb']:.1f} GB, losses {r['losses']}"
            )
        else:
            log(f"batch {B}: {r}")
        results.append(r)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    figures["batches"] = results
    mask_batches = (
        args.mask_batches if args.mask_batches is not None else ([1, 2] if args.tiny else [1, 4])
    )
    kinds = [known[k] for k in args.mask_kinds if k != "masks-from" or args.masks_from]
    figures["mask_rows"] = []
    rows = [
        (name, kind, B, v) for name, kind in kinds for B in mask_batches for v in args.mask_variants
    ]
    for name, kind, B, v in rows:
        fn = mask_source(kind, T, args.masks_from)
        try:
            r = run_batch(
                model,
                head,
                opt,
                sched,
                c,
                B,
                T,
                K,
                device,
                dtype,
                args,
                variant(v, compile_on),
                mask_fn=fn,
                name=v,
            )
        except Exception as e:  # noqa: BLE001 - keep measuring the other masks
            r = {"batch": B, "error": f"{type(e).__name__}: {str(e)[:1500]}"}
            opt.zero_grad(set_to_none=True)
        r["mask"], r["variant"] = name, v
        log(
            f"mask {name} batch {B} {v}: "
            + (
                f"{r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:.0f} tok/s, "
                f"unscored {r['unscored_share']:.3f}, rows {r['rows_share']:.3f}, peak "
                f"{r['peak_gb']:.1f} GB"
                if "tokens_per_s" in r
                else str(r)
            )
        )
        figures["mask_rows"].append(r)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    eager = args.eager_batches if args.eager_batches is not None else ([1, 4] if compile_on else [])
    figures["eager_batches"] = []
    eager_kernels = KernelOptions(compile=False)
    for B in eager:
        r = run_batch(model, head, opt, sched, c, B, T, K, device, dtype, args, eager_kernels)
        log(
            f"eager batch {B}: {r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:.0f} tok/s, "
            f"peak {r['peak_gb']:.1f} GB"
        )
        figures["eager_batches"].append(r)
    figures["fp32_out_gemms"] = dict(gemm.FP32_OUT)
    figures["breakdown_b1"] = breakdown(model, head, opt, c, T, K, device, dtype, args, kernels)
    log(f"breakdown at batch 1: {figures['breakdown_b1']}")
    if device.type == "cuda":
        figures["profiles"] = {}
        for B in args.profile_batches:
            try:
                pmask = (
                    None
                    if args.profile_mask == "main"
                    else mask_source(known[args.profile_mask][1], T, args.masks_from)
                )
                prof = profile_batch(
                    model, head, opt, sched, c, B, T, K, device, dtype, kernels, pmask
                )
                figures["profiles"][B] = prof
                log(f"profile batch {B}: {prof['total_ms']:.1f} ms GPU, {prof['by_kind_ms']}")
                for row in prof["top"][:25]:
                    print("   ", row, flush=True)
            except Exception as e:  # noqa: BLE001 - the profile is a bonus
                log(f"profile failed: {type(e).__name__}: {e}")
            torch.cuda.empty_cache()

    by = (
        {r["batch"]: r for r in results} if not args.tiny else {}
    )  # goals are for the Kimi size on a GPU
    goals = {}
    for b, key in ((1, "tokens_per_s_b1"), (4, "tokens_per_s_b4")):
        v = by.get(b, {}).get("tokens_per_s")
        goals[key] = {
            "value": v,
            "goal": f">= {GOALS[key]}",
            "met": v is not None and v >= GOALS[key],
        }
    for b, key in ((1, "peak_gb_b1"), (4, "peak_gb_b4")):
        v = by.get(b, {}).get("peak_gb")
        goals[key] = {
            "value": v,
            "goal": f"<= {GOALS[key]}",
            "met": v is not None and v <= GOALS[key],
        }
    goals["batch8_fits"] = {
        "value": "tokens_per_s" in by.get(8, {}),
        "goal": "fits in one H200",
        "met": "tokens_per_s" in by.get(8, {}),
    }
    for v in args.mask_variants:
        goals.update(specforge_goals(figures["mask_rows"], args.tiny, v, args.epochs))
    figures["refused"] = sorted(
        attention._refused
    )  # kernels a call refused: their rows ran the fallback
    line = clean({"bench": "train", "figures": figures, "goals": goals})
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_train.json").write_text(json.dumps(line, indent=2) + "\n")
    print(json.dumps(line, separators=(",", ":")), flush=True)


if __name__ == "__main__":
    main()
