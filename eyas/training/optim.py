"""Where a training run computes, and how a step updates its weights: device, AdamW, schedule,
clipping.

    device = resolve_device(cfg.device, local_rank)          # "auto" -> cuda where there is one
    opt = make_optimizer(params, lr, weight_decay)
    sched = LambdaLR(opt, lambda s: lr_factor(s, warmup, max_steps))
    clip_and_step(params, opt, max_norm)

Shared by the drafter's training (eyas/training/train.py) and the tiny target's
(eyas/local/tiny_target.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def resolve_device(name: str | torch.device, local_rank: int = 0) -> torch.device:
    """The device `name` means: "auto" is CUDA where there is one, else the CPU; an index-less
    "cuda" is this rank's GPU (local_rank under an initialised process group, else the current
    one)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if (
        dev.type == "cuda" and dev.index is None
    ):  # torch.cuda.set_device refuses an index-less device on torch 2.11
        dev = torch.device(
            "cuda", local_rank if dist.is_initialized() else torch.cuda.current_device()
        )
    return dev


def lr_factor(step: int, warmup: int, max_steps: int, min_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to min_ratio of the peak at
    max_steps."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, max_steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(params, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (0.9, 0.95); the fused CUDA kernel where every parameter is on a GPU."""
    params = list(params)
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(
        params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=fused
    )


def clip_and_step(
    params, opt: torch.optim.Optimizer, max_norm: float, in_kernel: bool = True
) -> None:
    """clip_grad_norm_(params, max_norm), then opt.step().

    With a fused AdamW, plain (not sharded) gradients and in_kernel (KernelOptions.fused_clip) the
    clip factor is not applied in a pass of its own over every gradient: the kernel's grad_scale
    divides each gradient by 1 / clip_grad_norm_'s clamped coefficient as it reads it (the mechanism
    GradScaler uses), which saves reading and writing all fp32 gradients once. Same update, up to
    the last bit of rounding.
    """
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    fused = opt.defaults.get("fused") and grads and all(type(g) is torch.Tensor for g in grads)
    if not (in_kernel and fused):
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        return
    norm = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
    opt.grad_scale = ((norm + 1e-6) / max_norm).clamp(
        min=1.0
    )  # 1 / min(max_norm / (norm + 1e-6), 1)
    try:
        opt.step()
    finally:
        opt.grad_scale = None
