"""EAGLE-3 drafter training on hidden-state shards (docs/training.md).

    from eyas.config import load_config
    cfg = load_config("configs/local-tiny.yaml")
    result = train_drafter(cfg.training, cfg.target, shard_paths)        # one process
    # many (eyas/training/distributed.py)
    torchrun --nproc-per-node 8 -m eyas.training.distributed JOB.json

The recipe (docs/training.md). For a sequence tok[0..n), at TTT step k the input at position t is
(embed(tok[t+1+k]), h) where h is fc(aux[t]) at step 0 and the drafter's own output at t from step
k-1 afterwards; the label is the target's distribution at t+1+k (the stored last hidden state
through the target's lm_head, restricted to the draft vocab), which predicts tok[t+2+k]. A label
counts only where that token is an assistant token and the target's argmax is in the draft vocab.
Loss = sum_k loss_decay**k * soft-CE_k (eyas/training/losses.py).

One optimizer step takes a global batch of batch_size * grad_accum * world_size sequences, drawn
length-aware (sorted within windows of `length_grouping` global batches, so a micro-batch pads
little) and cut into micro-batches (eyas/training/batches.py); micro-batch j of a step goes to rank
j % world_size. The loss is normalised by the global batch's count of scored positions, so any split
of one global batch (accumulation, ranks) gives the same loss and gradient. Each rank's
micro-batches are read, collated and copied to the GPU ahead of the step by a BatchLoader
(eyas/training/loader.py; training.loader_workers, 0 = inside the step, the same batches bit for
bit). The step's choices a user makes (torch.compile, FP8 GEMMs) are one KernelOptions made from the
config (eyas/training/kernels.py).

Checkpoints (eyas/training/checkpoints.py: cfg.output_dir/checkpoints/step-NNNNNN/, each written
whole then renamed into place) hold the trainable weights with d2t/t2d, drafter.json, and
trainer_state.pt (optimizer, scheduler, step, data position, RNG, loss history). A later call with
the same config resumes from the latest one and reproduces the uninterrupted run's losses exactly.
With training.ema_decay the final checkpoint's weights are the trained ones' moving average
(eyas/training/ema.py). A run on other data starts from an earlier drafter's weights with
training.init_from (eyas/training/warm_start.py).

Progress: `on_step(StepStats)` after every step on rank 0 (eyas/training/progress.py); the caller
throttles. The steps StepStats.in_history marks make the bounded loss table TrainResult.history.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from eyas.errors import InvalidInput
from eyas.training import gemm, warm_start
from eyas.training.batches import (
    Batch,
    ShardData,
    add_aux_noise,
    check_shard_meta,
    collate,
    data_digest,
)
from eyas.training.checkpoints import (
    TrainState,
    checkpoint_differs,
    load_checkpoint,
    resumable_checkpoint,
    save_checkpoint,
)
from eyas.training.draft_vocab import build_draft_vocab, count_tokens
from eyas.training.drafter import DrafterConfig, Eagle3Drafter
from eyas.training.ema import WeightEMA
from eyas.training.kernels import kernel_options
from eyas.training.loader import BatchLoader, plan_steps
from eyas.training.losses import (
    HEAD_CHUNK_ROWS,
    HEAD_CHUNK_ROWS_CPU,
    TTTObjective,
    draft_first_order,
    teacher_labels,
)
from eyas.training.optim import clip_and_step, lr_factor, make_optimizer, resolve_device
from eyas.training.progress import StepStats, keeps_row, simulated_acceptance_length
from eyas.training.target_head import TargetHead, load_target_tensors, read_target_config
from eyas.training.teacher_cache import ArgmaxMemo, TeacherCache

if TYPE_CHECKING:  # eyas.config needs pydantic; the GPU benchmark imports this module without it
    from eyas.config import TargetConfig, TrainingConfig


@dataclass
class TrainResult:
    final_loss: float  # mean of the last few steps' losses
    first_loss: float
    losses: list[float]  # per optimizer step: sum_k decay**k * CE_k over the global batch
    accuracies: list[
        list[float]
    ]  # per step, per TTT step: drafter argmax == target argmax (assistant positions)
    steps: int
    tokens: int  # sequence tokens trained on (all steps, all ranks, this run and resumed ones)
    seconds: float
    checkpoint_dir: str
    draft_vocab_size: int
    heldout_accuracies: list[float] | None = None  # per TTT step, on held-out samples, at the end
    simulated_acceptance_length: float | None = None  # 1 + sum_k prod_{i<=k} heldout acc_i
    heldout_history: list[list[float]] = field(
        default_factory=list
    )  # [step, simulated AL] every eval_every
    resumed_from_step: int = 0
    world_size: int = 1
    global_batch: int = 0  # sequences per optimizer step
    history: list[dict] = field(
        default_factory=list
    )  # the loss table: StepStats.row() of ~100 steps
    init_from: dict | None = None  # the warm start's source: path, kind (drafter/checkpoint)
    #: damaged checkpoints moved aside before resuming: {"checkpoint", "moved_to", "why"}
    quarantined: list[dict] = field(default_factory=list)


# ----------------------------------------------------------------------------- setup


def drafter_config(
    cfg: TrainingConfig, tcfg: dict, hidden_size: int, num_aux: int
) -> DrafterConfig:
    """Drafter sizes: cfg.drafter where given, else the target's config.json."""
    if tcfg["hidden_size"] != hidden_size:
        raise InvalidInput(
            f"shards hold hidden size {hidden_size} but the target config says "
            f"{tcfg['hidden_size']}"
        )
    s = cfg.drafter
    heads = s.num_attention_heads or tcfg["num_attention_heads"]
    rope = tcfg.get("rope_parameters") or {}
    return DrafterConfig(
        hidden_size=hidden_size,
        target_hidden_size=hidden_size,
        num_aux=num_aux,
        num_attention_heads=heads,
        num_key_value_heads=s.num_key_value_heads
        or (heads if s.num_attention_heads else tcfg.get("num_key_value_heads", heads)),
        head_dim=s.head_dim or hidden_size // heads,
        intermediate_size=s.intermediate_size or tcfg["intermediate_size"],
        vocab_size=tcfg["vocab_size"],
        draft_vocab_size=cfg.draft_vocab_size,
        rms_norm_eps=tcfg.get("rms_norm_eps", 1e-6),
        rope_theta=tcfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
        max_position_embeddings=tcfg.get("max_position_embeddings", 2048),
    )


def init_from_target(
    model: Eagle3Drafter, checkpoint: Path, d2t: torch.Tensor, t2d: torch.Tensor
) -> None:
    """Frozen embedding from the target; lm_head/norm start as the target's rows for the draft
    vocab."""
    t = load_target_tensors(checkpoint, ["embed", "lm_head", "norm"])
    with torch.no_grad():
        model.embed_tokens.weight.copy_(t["embed"].float())
        model.lm_head.weight.copy_(t["lm_head"].float()[t2d])
        model.norm.weight.copy_(t["norm"].float())
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)


# ----------------------------------------------------------------------------- one optimizer step


def optimizer_step(
    objective,
    wrapped,
    opt,
    sched,
    micro_batches,
    make_labels,
    *,
    ttt_steps: int,
    decay: float,
    counts: torch.Tensor,
    grad_clip: float,
    autocast,
    world: int = 1,
) -> torch.Tensor:
    """Forward/backward every micro-batch of this rank, then clip and step -> [loss, correct..,
    scored..].

    micro_batches yields collated batches; make_labels(batch) gives the teacher's labels. Gradients
    are synchronised once, after the last micro-batch (DDP's no_sync before it).
    """
    micro_batches = list(micro_batches)
    stats = 0
    for j, batch in enumerate(micro_batches):
        sync = j == len(micro_batches) - 1 or not hasattr(wrapped, "no_sync")
        with contextlib.nullcontext() if sync else wrapped.no_sync():
            labels = make_labels(batch)
            with autocast:
                loss, correct, scored = wrapped(
                    batch.ids, batch.aux, labels, ttt_steps, decay, counts
                )
            (
                loss * world
            ).backward()  # DDP/FSDP average over ranks; the loss is a share of the global sum
        stats = stats + torch.cat([loss.detach().reshape(1), correct, scored]).double()
    params = [p for p in objective.parameters() if p.requires_grad]
    clip_and_step(params, opt, grad_clip, objective.kernels.fused_clip)
    sched.step()
    opt.zero_grad(set_to_none=True)
    return (
        stats.cpu()
    )  # on the device until now: no wait for the GPU before the optimizer is queued


# ----------------------------------------------------------------------------- training


def train_drafter(
    cfg: TrainingConfig,
    target: TargetConfig,
    shard_paths: list[Path],
    *,
    target_config_json: dict | None = None,
    log: Callable[[str], None] = print,
    warn: Callable[[str], None] | None = None,
    log_every: int | None = None,
    stop_at_step: int | None = None,
    on_step: Callable[[StepStats], None] | None = None,
) -> TrainResult:
    """Train (or resume) an EAGLE-3 drafter on shards; checkpoints land in cfg.output_dir.

    Runs on one process, or on every rank of an initialised process group (torchrun; see
    eyas/training/distributed.py), which then share each global batch. stop_at_step: checkpoint and
    return once this step is reached, as if preempted; a later call with the same arguments resumes.
    log_every defaults to about 20 lines per run. on_step gets every step's StepStats on rank 0
    (cheap; the caller decides how often to show them). The step's kernels (torch.compile per
    training.compile, training.fp8_gemms) come from kernel_options, made once here and passed down.
    warn (default: log) gets what an operator must see: damaged checkpoints set aside.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    log = log if rank == 0 else (lambda _: None)
    warn = (warn or log) if rank == 0 else (lambda _: None)
    stop = min(cfg.max_steps, stop_at_step or cfg.max_steps)
    run = set_up(cfg, target, shard_paths, target_config_json, stop, log, warn)
    loop = _Loop(
        run,
        cfg,
        stop,
        log,
        log_every or max(1, cfg.max_steps // 20),
        on_step if rank == 0 else None,
    )
    # after the clock started: its teacher work counts as training time; a finished run labels only
    # the held-out batches it evaluates
    run.labels = Labeller(run, cfg, log, training=run.state.step < stop)
    final_held = loop.train()
    # held-out accuracy per TTT step -> simulated acceptance length (a finished run resumed: again)
    if final_held is None and run.state.step >= cfg.max_steps:
        final_held = evaluate_heldout(run, cfg)
    state = run.state
    tail = state.losses[-max(1, min(10, len(state.losses) // 10)) :]
    return TrainResult(
        final_loss=sum(tail) / len(tail),
        first_loss=state.losses[0],
        losses=state.losses,
        accuracies=state.accuracies,
        steps=state.step,
        tokens=state.tokens,
        seconds=round(state.seconds + time.monotonic() - loop.t_run, 3),
        checkpoint_dir=str(run.ckpt),
        draft_vocab_size=cfg.draft_vocab_size,
        heldout_accuracies=final_held,
        simulated_acceptance_length=None
        if final_held is None
        else simulated_acceptance_length(final_held),
        heldout_history=state.heldout_history,
        resumed_from_step=loop.resumed_from,
        world_size=run.world,
        global_batch=run.global_batch,
        history=state.history,
        init_from=state.init_from,
        quarantined=run.quarantined,
    )


# ----------------------------------------------------------------------------- one run's set-up


@dataclass
class RunSetup:
    """What one call trains with, made before its first step."""

    rank: int
    world: int
    device: torch.device
    data: ShardData
    global_batch: int  # sequences per optimizer step, over every rank
    objective: TTTObjective
    wrapped: torch.nn.Module  # the objective, or its DDP / FSDP wrapper
    head: TargetHead  # the target's lm_head, rows in draft-first order: the teacher
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    ema: WeightEMA | None
    state: TrainState
    info: (
        dict  # what every checkpoint records: drafter, fingerprint, shard meta, target, warm start
    )
    bf16: bool  # a GPU in bf16 autocast
    cpu_bf16: bool  # a CPU with bf16 matrix units: the GEMMs in bf16
    kernels: object  # KernelOptions
    ckpt: Path | None  # the newest checkpoint of this run
    quarantined: list[dict]  # damaged checkpoints moved aside (resumable_checkpoint)
    labels: "Labeller | None" = None

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32


@dataclass
class _Start:
    """Where this run's weights start: its newest checkpoint when that is this run's (resume), else
    init_from's drafter (init), else the target's rows (both None)."""

    ckpt: Path | None  # the newest sound checkpoint in output_dir, whoever's run it is
    differ: list[str]  # the fingerprint fields in which ckpt is another run's ([]: ours)
    resume: Path | None
    init: warm_start.InitSource | None
    quarantined: list[dict]  # damaged newer checkpoints, moved aside

    @classmethod
    def find(cls, cfg: TrainingConfig, out_dir: Path, fingerprint: dict, warn) -> _Start:
        quarantined: list[dict] = []
        ckpt = resumable_checkpoint(out_dir, warn, quarantined)  # damaged newer ones: moved aside
        differ = (
            checkpoint_differs(ckpt, fingerprint, can_warm_start=cfg.init_from is not None)
            if ckpt
            else []
        )
        resume = ckpt if ckpt is not None and not differ else None
        init = (
            warm_start.init_source(cfg.init_from, out_dir)
            if cfg.init_from is not None and resume is None
            else None
        )
        return cls(ckpt, differ, resume, init, quarantined)

    def set_aside(self, out_dir: Path, rank: int, log) -> None:
        """Another run's checkpoints (init_from is set): set aside, never resumed nor mixed with
        ours."""
        if dist.is_initialized():
            dist.barrier()  # every rank has read what it needs from them
        if rank == 0:
            log(
                f"{self.ckpt.parent} holds another run's checkpoints ({', '.join(self.differ)} "
                f"differ): set aside to {warm_start.set_aside(out_dir)}"
            )


def set_up(
    cfg: TrainingConfig,
    target: TargetConfig,
    shard_paths: list[Path],
    target_config_json: dict | None,
    stop: int,
    log,
    warn,
) -> RunSetup:
    """The data, where the weights start (this run's newest checkpoint, else init_from's drafter,
    else the target's rows), the drafter and its objective, the teacher's head, the optimizer."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kernels = kernel_options(cfg, device)
    out_dir = Path(cfg.output_dir)
    data = _shard_data(cfg, shard_paths)
    meta = check_shard_meta(data.readers, target)
    tcfg = target_config_json or read_target_config(target.checkpoint)
    G = _global_batch(cfg, data, world)
    fingerprint = _fingerprint(cfg, target, data, meta, G)
    start = _Start.find(cfg, out_dir, fingerprint, warn)
    dcfg = drafter_config(cfg, tcfg, data.hidden_size, data.num_aux)
    if start.init is not None:
        warm_start.check_init(start.init, dcfg, target.capture_ids())
    d2t, t2d = _draft_vocab(cfg, data, tcfg, start.resume, start.init, log)
    bf16 = device.type == "cuda" and cfg.precision == "bf16"
    model = _drafter(cfg, dcfg, target, d2t, t2d, start.init, bf16, device)
    if start.differ:
        start.set_aside(out_dir, rank, log)
    # A CPU with bf16 matrix units runs the GEMMs in bf16 (the rest fp32): the step in 0.7 of the
    # fp32 step's time (docs/performance.md, "Training on a CPU")
    cpu_bf16 = device.type == "cpu" and cfg.precision == "bf16" and gemm.cpu_bf16_gemm()
    objective, wrapped = _objective(model, cfg, device, kernels, cpu_bf16, world)
    head = _teacher_head(target, meta["last_hidden_norm"], t2d, bf16, device)
    opt, sched, ema = _optimizer(cfg, objective)
    init = start.init
    run = RunSetup(
        rank,
        world,
        device,
        data,
        G,
        objective,
        wrapped,
        head,
        opt,
        sched,
        ema,
        TrainState(init_from=init and {"path": str(init.path), "kind": init.kind}),
        _checkpoint_info(dcfg, fingerprint, meta, target),
        bf16,
        cpu_bf16,
        kernels,
        start.ckpt,
        start.quarantined,
    )
    if start.resume is not None:
        _resume(run, cfg, start.resume, fingerprint, stop, log)
    run.info["init_from"] = run.state.init_from
    return run


def _shard_data(cfg: TrainingConfig, shard_paths: list[Path]) -> ShardData:
    return ShardData(
        [Path(p) for p in shard_paths],
        cfg.num_validation_sequences,
        cfg.ttt_steps,
        cfg.loss_positions == "all",
    )


def _global_batch(cfg: TrainingConfig, data: ShardData, world: int) -> int:
    """Sequences per optimizer step, over every rank; no more than the training sequences."""
    G = cfg.batch_size * cfg.grad_accum * world
    if G > len(data.train_ids):
        raise InvalidInput(
            f"global batch of {G} sequences (batch_size {cfg.batch_size} x grad_accum "
            f"{cfg.grad_accum} x {world} ranks) exceeds the {len(data.train_ids)} "
            f"training sequences"
        )
    return G


def _fingerprint(
    cfg: TrainingConfig, target: TargetConfig, data: ShardData, meta: dict, G: int
) -> dict:
    """What a checkpoint must share with this call to be resumed: the training settings that shape
    the weights (every field not marked as one that may change on resume: eyas/config/training.py),
    the global batch, the shards and the layers they hold."""
    return {
        **cfg.fingerprint_settings(),
        "global_batch": G,
        "shards": [[Path(r.path).name, r.num_tokens] for r in data.readers],
        "data_sha256": data_digest(data.readers),
        "capture_ids": target.capture_ids(),
        "last_hidden_norm": meta["last_hidden_norm"],
    }


def _drafter(
    cfg: TrainingConfig,
    dcfg: DrafterConfig,
    target: TargetConfig,
    d2t,
    t2d,
    init,
    bf16: bool,
    device,
) -> Eagle3Drafter:
    """The drafter, seeded (the same on every rank), its frozen parts from the target, its trainable
    weights from the warm start where there is one."""
    torch.manual_seed(cfg.seed)
    model = Eagle3Drafter(dcfg)
    init_from_target(model, target.checkpoint, d2t, t2d)
    if init is not None:
        warm_start.load_init(
            model, init
        )  # every trainable weight; the optimizer and schedule start fresh
    if bf16:
        model.embed_tokens.to(torch.bfloat16)  # frozen: no master copy needed
    return model.to(device)


def _objective(
    model: Eagle3Drafter,
    cfg: TrainingConfig,
    device: torch.device,
    kernels,
    cpu_bf16: bool,
    world: int,
) -> tuple[TTTObjective, torch.nn.Module]:
    """(the objective, what the step calls: it, or its DDP / FSDP wrapper over the ranks)."""
    head_chunk = HEAD_CHUNK_ROWS_CPU if device.type == "cpu" else HEAD_CHUNK_ROWS
    objective = wrapped = TTTObjective(
        model, head_chunk, gemm_dtype=torch.bfloat16 if cpu_bf16 else None, kernels=kernels
    )
    if world > 1:
        wrapped = _parallelize(objective, cfg.distributed.strategy, device)
    return objective, wrapped


def _teacher_head(
    target: TargetConfig, last_hidden_norm, t2d: torch.Tensor, bf16: bool, device
) -> TargetHead:
    """The target's lm_head on the device, its rows in draft-first order."""
    head = TargetHead.from_checkpoint(
        target.checkpoint,
        last_hidden_norm=last_hidden_norm,
        dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    head.reorder(draft_first_order(t2d)).to(device)
    return head


def _optimizer(cfg: TrainingConfig, objective: TTTObjective):
    """(optimizer, warmup-then-decay schedule, the trainable weights' EMA or None)."""
    params = [p for p in objective.parameters() if p.requires_grad]
    opt = make_optimizer(params, cfg.lr, cfg.weight_decay)
    ema = (
        WeightEMA({n: p for n, p in objective.named_parameters() if p.requires_grad}, cfg.ema_decay)
        if cfg.ema_decay
        else None
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, cfg.max_steps)
    )
    return opt, sched, ema


def _checkpoint_info(
    dcfg: DrafterConfig, fingerprint: dict, meta: dict, target: TargetConfig
) -> dict:
    """What every checkpoint records (the warm start is added once known)."""
    return {
        "drafter": asdict(dcfg),
        "fingerprint": fingerprint,
        "shard_meta": meta,
        "target": {
            "checkpoint": str(target.checkpoint),
            "revision": target.revision,
            "layer_ids": target.layer_ids,
            "layer_convention": target.layer_convention,
            "capture_ids": target.capture_ids(),
        },
    }


def _resume(
    run: RunSetup, cfg: TrainingConfig, resume: Path, fingerprint: dict, stop: int, log
) -> None:
    """Load the checkpoint's weights, optimizer and position; put the EMA's average in or out as the
    steps left ask."""
    run.state = load_checkpoint(
        resume, run.objective, run.opt, run.sched, fingerprint, log, run.ema
    )
    log(f"resumed from {resume} at step {run.state.step}")
    ema = run.ema
    if ema is None:
        return
    if ema.swapped and run.state.step < stop:
        ema.swap()  # a finished run trained on past its old max_steps: from the raw weights again
    elif not ema.swapped and run.state.step >= cfg.max_steps:
        # a mid-run checkpoint finished by a lower max_steps: its final checkpoint is the average
        ema.swap()
        run.info["init_from"] = run.state.init_from
        run.ckpt = save_checkpoint(
            Path(cfg.output_dir),
            run.objective,
            run.opt,
            run.sched,
            run.state,
            run.info,
            rank=run.rank,
            ema=ema,
        )


class Labeller:
    """The teacher's labels for a batch. A CPU run computes them once per sequence where they fit
    (eyas/training/teacher_cache.py); otherwise per batch, each position's full-vocabulary argmax
    remembered from its sequence's first epoch, so later epochs run the draft vocabulary's rows
    only."""

    def __init__(self, run: RunSetup, cfg: TrainingConfig, log, training: bool = True):
        head, vocab, dtype, kernels = run.head, cfg.draft_vocab_size, run.dtype, run.kernels
        self.teacher = lambda b, outside=None: teacher_labels(
            head, b.last, b.loss_mask, vocab, dtype, kernels=kernels, outside=outside
        )
        self.memo = None
        self.labels = self.teacher
        log(
            f"training drafter: "
            f"{sum(p.numel() for p in run.objective.parameters() if p.requires_grad) / 1e6:.2f}M "
            f"params, "
            f"{len(run.data.train_ids)} train / {run.data.num_validation} held-out sequences, "
            f"global batch "
            f"{run.global_batch} ({run.world} rank(s) x {cfg.grad_accum} x {cfg.batch_size}), "
            f"draft vocab {vocab}, device {run.device}{' (bf16 GEMMs)' * run.cpu_bf16}"
        )
        if not training:  # a finished run: the held-out batches' labels only, per batch
            return
        if run.device.type == "cpu" and cfg.teacher_cache_gb > 0:
            cache = TeacherCache.build(run.data, self.teacher, vocab, dtype, cfg.teacher_cache_gb)
            if cache is not None:
                self.labels = cache.labels
                log(
                    f"teacher labels of all {len(run.data.lengths)} sequences computed once "
                    f"({TeacherCache.nbytes(run.data, vocab, dtype) / 2**30:.2f} GB)"
                )
        if self.labels is self.teacher:
            self.memo = ArgmaxMemo(run.data.lengths, run.device)
            self.labels = lambda b: self.memo.labels(b, self.teacher)

    def __call__(self, batch: Batch) -> torch.Tensor:
        return self.labels(batch)

    def new_epoch(self, epoch: int, num_sequences: int, log) -> None:
        if self.memo is not None:
            self.memo.share()  # the next epoch deals the sequences out anew
            log(
                f"epoch {epoch + 1}: the teacher's full-vocabulary argmax remembered for "
                f"{int(self.memo.known.sum())} of {num_sequences} sequences (their teacher: the "
                f"draft vocabulary's rows only)"
            )


# ----------------------------------------------------------------------------- the loop


class _Loop:
    """This rank's micro-batches read, collated and copied ahead of the step
    (eyas/training/loader.py), stepped, logged, evaluated every eval_every steps and
    checkpointed."""

    def __init__(self, run: RunSetup, cfg: TrainingConfig, stop: int, log, log_every: int, on_step):
        self.run, self.cfg, self.stop, self.log, self.log_every, self.on_step = (
            run,
            cfg,
            stop,
            log,
            log_every,
            on_step,
        )
        self.resumed_from, self.tokens_from, self.t_run = (
            run.state.step,
            run.state.tokens,
            time.monotonic(),
        )
        self.t_log = self.t_loop = self.t_run
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=run.bf16)
        self.final_held = None  # per-TTT-step held-out accuracy at max_steps
        self.waited = 0.0  # data wait until the last log line

    def train(self) -> list[float] | None:
        """Every step up to `stop` -> the held-out accuracies at max_steps, if the loop reached
        it."""
        run, cfg, state = self.run, self.cfg, self.run.state
        data, world = run.data, run.world
        steps = itertools.islice(
            plan_steps(
                data.lengths,
                data.train_ids,
                cfg.batch_size,
                cfg.grad_accum * world,
                cfg.seed,
                state.epoch,
                state.batch_pos,
                cfg.length_grouping,
            ),
            max(0, self.stop - state.step),
        )
        workers = (
            cfg.loader_workers
            if cfg.loader_workers is not None
            else (2 if run.device.type == "cuda" else 0)
        )
        with BatchLoader(
            data, steps, run.device, run.dtype, rank=run.rank, world=world, workers=workers
        ) as loader:
            for (epoch, pos, micro), mine in loader:
                if epoch != state.epoch:
                    state.epoch = epoch
                    run.labels.new_epoch(state.epoch, len(data.lengths), self.log)
                counts = data.scored[[i for m in micro for i in m]].sum(
                    0
                )  # (K,) the global batch's scored positions
                lr = run.sched.get_last_lr()[0]
                stats = optimizer_step(
                    run.objective,
                    run.wrapped,
                    run.opt,
                    run.sched,
                    (add_aux_noise(b, cfg.aux_noise) for b in mine),
                    run.labels,
                    ttt_steps=cfg.ttt_steps,
                    decay=cfg.loss_decay,
                    counts=counts,
                    grad_clip=cfg.grad_clip,
                    autocast=self.autocast,
                    world=world,
                )
                if run.ema is not None:
                    run.ema.update(state.step)
                stats = _all_reduce(stats, run.device)
                state.batch_pos = pos + 1
                state.step += 1
                if run.ema is not None and state.step == cfg.max_steps:
                    # the average is what is evaluated, checkpointed and exported from here on
                    run.ema.swap()
                state.tokens += sum(data.lengths[i] for m in micro for i in m)
                self.after_step(stats, lr, loader.wait_s)
        return self.final_held

    def after_step(self, stats: torch.Tensor, lr: float, wait_s: float) -> None:
        """The step's losses and accuracies recorded; its log line, held-out evaluation, history
        row, StepStats and checkpoint where they are due."""
        run, cfg, state, K = self.run, self.cfg, self.run.state, self.cfg.ttt_steps
        state.losses.append(float(stats[0]))
        state.accuracies.append((stats[1 : 1 + K] / stats[1 + K :].clamp(min=1)).tolist())
        if state.step % self.log_every == 0 or state.step == self.stop:
            acc = " ".join(f"{a:.2f}" for a in state.accuracies[-1])
            self.log(
                f"step {state.step}/{cfg.max_steps} loss {state.losses[-1]:.4f} acc [{acc}] "
                f"lr {lr:.2e} {time.monotonic() - self.t_log:.1f}s "
                f"({wait_s - self.waited:.1f}s waiting for data)"
            )
            self.waited = wait_s
        simulated = (
            None  # held-out simulated acceptance length, every eval_every steps and at max_steps
        )
        if state.step == cfg.max_steps or (cfg.eval_every and state.step % cfg.eval_every == 0):
            held = evaluate_heldout(run, cfg, autocast=self.autocast)
            simulated = None if held is None else simulated_acceptance_length(held)
            if state.step == cfg.max_steps:
                self.final_held = held
            elif simulated is not None:
                state.heldout_history.append([state.step, simulated])
                self.log(f"step {state.step}: held-out simulated acceptance length {simulated:.3f}")
        report = StepStats(
            step=state.step,
            max_steps=cfg.max_steps,
            loss=state.losses[-1],
            accuracies=tuple(state.accuracies[-1]),
            lr=lr,
            tokens=state.tokens,
            seconds=time.monotonic() - self.t_loop,
            start_step=self.resumed_from,
            start_tokens=self.tokens_from,
            heldout_acceptance=simulated,
            in_history=keeps_row(
                state.step,
                cfg.max_steps,
                evaluated=simulated is not None,
                last=state.step == self.stop,
            ),
        )
        if report.in_history:
            state.history.append(report.row())
        if self.on_step is not None:
            self.on_step(report)
        if state.step % cfg.checkpoint_every == 0 or state.step == self.stop:
            state.seconds += time.monotonic() - self.t_run
            self.t_run = time.monotonic()
            run.ckpt = save_checkpoint(
                Path(cfg.output_dir),
                run.objective,
                run.opt,
                run.sched,
                state,
                run.info,
                rank=run.rank,
                ema=run.ema,
            )


def _draft_vocab(cfg: TrainingConfig, data: ShardData, tcfg: dict, resume: Path | None, init, log):
    """(d2t, t2d): the resumed checkpoint's, else the warm start's, else counted on the shards."""
    if resume is not None:
        return warm_start.draft_vocab(resume)
    counts = count_tokens(data.readers, tcfg["vocab_size"])
    fresh = build_draft_vocab(counts, tcfg["vocab_size"], cfg.draft_vocab_size)
    if init is None:
        return fresh
    d2t, t2d = warm_start.draft_vocab(init.path)  # its lm_head rows are these tokens' logits: kept
    share = lambda m: float(counts[m].sum()) / max(1, int(counts.sum()))  # noqa: E731
    log(
        f"warm start from {init.kind} {init.path}: its draft vocab covers {share(t2d):.1%} of the "
        f"shards' scored tokens (one counted on them would cover {share(fresh[1]):.1%})"
    )
    return d2t, t2d


def _parallelize(objective: TTTObjective, strategy: str, device: torch.device):
    """DDP (replicas) or FSDP2 (weights, gradients and optimizer state sharded) over the process
    group."""
    if strategy == "fsdp":  # one unit, gathered once per micro-batch (ZeRO-2 / SHARD_GRAD_OP-like)
        from torch.distributed.fsdp import fully_shard

        fully_shard(objective, reshard_after_forward=False)
        return objective
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        objective,
        device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=False,
    )


def _all_reduce(t: torch.Tensor, device) -> torch.Tensor:
    if not dist.is_initialized():
        return t
    t = t.to(device)
    dist.all_reduce(t)
    return t.cpu()


@torch.no_grad()
def evaluate_heldout(
    run: RunSetup, cfg: TrainingConfig, *, autocast: contextlib.AbstractContextManager | None = None
) -> list[float] | None:
    """Per-TTT-step accuracy on the held-out sequences; every rank runs the same number of
    forwards. autocast: the loop's (default: bf16 autocast on a GPU in bf16)."""
    data, device, dtype, rank, world = run.data, run.device, run.dtype, run.rank, run.world
    autocast = (
        autocast
        if autocast is not None
        else torch.autocast("cuda", dtype=torch.bfloat16, enabled=run.bf16)
    )
    if not data.validation_ids:
        return None
    ids = data.validation_ids
    batches = [ids[s : s + cfg.batch_size] for s in range(0, len(ids), cfg.batch_size)]
    per_rank = -(-len(batches) // world)
    stats = torch.zeros(2 * cfg.ttt_steps, dtype=torch.float64)
    for j in range(per_rank):
        idx = rank + j * world
        batch = collate(
            [data.sample(i) for i in batches[idx % len(batches)]],
            device,
            dtype,
            ids=batches[idx % len(batches)],
        )
        with autocast:
            _, c, n = run.wrapped(
                batch.ids, batch.aux, run.labels(batch), cfg.ttt_steps, cfg.loss_decay
            )
        if idx < len(
            batches
        ):  # a rank past the end repeats a batch (FSDP needs every rank) and drops it
            stats += torch.cat([c, n]).double().cpu()
    stats = _all_reduce(stats, device)
    K = cfg.ttt_steps
    return (stats[:K] / stats[K:].clamp(min=1)).tolist()
