"""The plan's budgets: the shards against free disk, the drafter's training memory against the
GPU, the global batch against the training sequences."""

from __future__ import annotations

from pathlib import Path

from eyas.config import PipelineConfig
from eyas.plan import MEMORY_MARGIN, Plan, on_gpu, processes
from eyas.preflight.disk import existing_parent


def budget_problems(cfg: PipelineConfig, plan: Plan) -> list[str]:
    out, x, t = [], cfg.extraction, cfg.training
    if plan.total_bytes is not None and plan.free_bytes is not None:
        reserve = x.keep_free_gb * 1e9
        if plan.free_bytes < plan.total_bytes + reserve:
            out.append(
                f"extraction.output_dir={x.output_dir}: the shards need "
                f"{plan.total_bytes / 1e9:,.2f} GB and "
                f"extraction.keep_free_gb={x.keep_free_gb} must stay free, but "
                f"{existing_parent(Path(x.output_dir))} has {plan.free_bytes / 1e9:,.2f} GB "
                f"free; free space, "
                f"point it elsewhere, or set extraction.encoding=fp8_e4m3 (about half the bytes)"
            )
    used, limit = plan.train_memory_gb, plan.gpu_memory_gb
    # the estimate is within MEMORY_MARGIN of the measured peaks, either way: keep that much free
    usable = limit * (1 - MEMORY_MARGIN) if limit is not None else None
    if used is not None and usable is not None and on_gpu(cfg) and used > usable:
        per_seq = dict(plan.memory_gb)["activations"] / t.batch_size
        fits = int((usable - (used - per_seq * t.batch_size)) // per_seq) if per_seq else 0
        out.append(
            f"training.batch_size={t.batch_size}: the drafter's training needs about "
            f"{used:,.1f} GB per GPU at data.max_length={cfg.data.max_length} (estimate, within "
            f"{MEMORY_MARGIN:.0%} of measured "
            f"peaks), more than the {usable:,.1f} GB plan.gpu_memory_gb={limit:g} leaves "
            f"after that margin; about {max(fits, 0)} sequence(s) per micro-batch fit (raise "
            f"training.grad_accum instead)"
        )
    if plan.data is not None:
        n = plan.data.sequences
        kept = t.num_validation_sequences
        held = min(64, n // 20) if kept is None else min(kept, max(n - 1, 0))
        G = t.batch_size * t.grad_accum * processes(cfg)
        if G > n - held:
            out.append(
                f"training.batch_size={t.batch_size}: a global batch of {G} sequences (x "
                f"training.grad_accum="
                f"{t.grad_accum} x {processes(cfg)} process(es)) exceeds the {n - held} "
                f"training sequences ({plan.data.source})"
            )
    return out
