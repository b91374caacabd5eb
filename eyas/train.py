"""EAGLE-3 drafter training on hidden-state shards.

    from eyas.config import load_config
    cfg = load_config("configs/local-tiny.yaml")
    result = train_drafter(cfg.training, cfg.target, shard_paths)

The recipe (docs: eagle3.md section 2). For a sequence tok[0..n), at TTT step k the input at
position t is (embed(tok[t+1+k]), h) where h is fc(aux[t]) at step 0 and the drafter's own output
at t from step k-1 afterwards; the label is the target's distribution at t+1+k (from the stored
last hidden state through the target's lm_head, restricted to the draft vocab), which predicts
tok[t+2+k]. A label counts only where that token is an assistant token (loss_mask) and the target's
argmax is in the draft vocab. Loss = sum_k loss_decay**k * soft-CE_k.

Checkpoints (cfg.output_dir/checkpoints/step-NNNNNN/, each written whole then renamed into place)
hold the trainable weights with d2t/t2d, drafter.json, and trainer_state.pt (optimizer, scheduler,
step, data position, RNG, loss history). A later call with the same config resumes from the latest
one and reproduces the uninterrupted run's losses exactly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from eyas.config import TargetConfig, TrainingConfig
from eyas.draft_vocab import build_draft_vocab, count_tokens
from eyas.drafter import DrafterConfig, Eagle3Drafter, causal_mask
from eyas.evaluate import simulated_acceptance_length
from eyas.shards import ShardReader
from eyas.target_head import TargetHead, load_target_tensors, read_target_config


@dataclass
class TrainResult:
    final_loss: float  # mean of the last few steps' losses
    first_loss: float
    losses: list[float]  # per optimizer step: sum_k decay**k * CE_k
    accuracies: list[list[float]]  # per step, per TTT step: drafter argmax == target argmax (assistant positions)
    steps: int
    tokens: int  # sequence tokens trained on (all steps, this run and resumed ones)
    seconds: float
    checkpoint_dir: str
    draft_vocab_size: int
    heldout_accuracies: list[float] | None = None  # per TTT step, on held-out samples
    simulated_acceptance_length: float | None = None  # 1 + sum_k prod_{i<=k} heldout acc_i
    resumed_from_step: int = 0


# ----------------------------------------------------------------------------- data

class ShardData:
    """Samples of several shards, read lazily by global index; the last few are held out."""

    def __init__(self, paths: list[Path]):
        if not paths:
            raise ValueError("train_drafter: no shard files given")
        self.readers = [ShardReader(p) for p in paths]
        self.index = [(r, i) for r in self.readers for i in range(len(r))]
        self.lengths = [int(r.offsets[i + 1] - r.offsets[i]) for r in self.readers for i in range(len(r))]
        hs = {(r.hidden_size, r.num_aux) for r in self.readers}
        if len(hs) != 1:
            raise ValueError(f"shards disagree on (hidden_size, num_aux): {sorted(hs)}")
        (self.hidden_size, self.num_aux), = hs
        n = len(self.index)
        self.num_heldout = min(64, n // 20)  # 5%, for the simulated acceptance length
        self.train_ids = list(range(n - self.num_heldout))
        self.heldout_ids = list(range(n - self.num_heldout, n))

    def sample(self, i: int):
        r, j = self.index[i]
        return r.sample(j)


def check_shard_meta(readers: list[ShardReader], target: TargetConfig) -> dict:
    """Layer ids, convention and final-norm state the shards agree on, checked against the target config."""
    keys = ("layer_ids", "layer_convention", "last_hidden_norm")
    seen = {}
    for r in readers:
        got = tuple(json.dumps(r.meta.get(k)) for k in keys)
        seen.setdefault(got, r.path)
    if len(seen) > 1:
        raise ValueError(f"shards disagree on {keys}: " + "; ".join(f"{p}: {g}" for g, p in seen.items()))
    meta = {k: readers[0].meta.get(k) for k in keys}
    if meta["last_hidden_norm"] not in ("pre", "post"):
        raise ValueError(f"{readers[0].path}: shard meta must say last_hidden_norm 'pre' or 'post', got "
                         f"{meta['last_hidden_norm']!r}; without it the labels may be computed on the wrong states")
    if meta["layer_ids"] is not None:
        shift = 1 if meta["layer_convention"] == "output-of" else 0
        capture = [i + shift for i in meta["layer_ids"]]
        if capture != target.capture_ids():
            raise ValueError(f"{readers[0].path}: shards hold capture layers {capture} ({meta['layer_ids']} "
                             f"{meta['layer_convention']}) but target.layer_ids says {target.capture_ids()} "
                             f"({target.layer_ids} {target.layer_convention})")
        meta["capture_ids"] = capture
    return meta


def epoch_batches(lengths: list[int], ids: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """A seeded shuffle of ids into batches; lengths are grouped within windows of 16 batches to cut padding."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = [ids[i] for i in torch.randperm(len(ids), generator=g).tolist()]
    window, batches = 16 * batch_size, []
    for s in range(0, len(perm), window):
        chunk = sorted(perm[s:s + window], key=lambda i: -lengths[i])
        batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def collate(samples, device) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples: ids (B, T), loss_mask (B, T), aux (B, T, K*H), last (B, T, H)."""
    B, T = len(samples), max(len(s) for s in samples)
    out = {"ids": torch.zeros(B, T, dtype=torch.long), "loss_mask": torch.zeros(B, T, dtype=torch.bool),
           "aux": torch.zeros(B, T, samples[0].aux_hidden_states.shape[1]),
           "last": torch.zeros(B, T, samples[0].last_hidden_state.shape[1])}
    for b, s in enumerate(samples):
        n = len(s)
        out["ids"][b, :n], out["loss_mask"][b, :n] = s.input_ids, s.loss_mask
        out["aux"][b, :n], out["last"][b, :n] = s.aux_hidden_states.float(), s.last_hidden_state.float()
    return {k: v.to(device) for k, v in out.items()}


def shift_left(x: torch.Tensor, s: int) -> torch.Tensor:
    """x[:, t + s] at position t, zeros past the end (B, T, ...)."""
    out = torch.zeros_like(x)
    out[:, :max(x.shape[1] - s, 0)] = x[:, s:]
    return out


# ----------------------------------------------------------------------------- the loss

@torch.no_grad()
def make_labels(head: TargetHead, batch: dict, t2d: torch.Tensor, draft_of: torch.Tensor):
    """Target distribution over the draft vocab at every position, and where it may be learned."""
    with torch.autocast(batch["last"].device.type, enabled=False):  # fp32: argmax ties are rare
        logits = head(batch["last"])  # (B, T, V) predicts the token at t+1
    top = logits.argmax(-1)  # (B, T)
    probs = F.softmax(logits[..., t2d].float(), dim=-1)  # (B, T, V_d), draft ids ascend with target ids
    scored = shift_left(batch["loss_mask"], 1)  # (B, T) token t+1 is an assistant token
    valid = scored & t2d[top]  # ... and the target's choice is one the drafter can make
    return probs, valid, draft_of[top], scored


def ttt_loss(model: Eagle3Drafter, batch: dict, labels, ttt_steps: int, decay: float):
    """Unrolled TTT loss -> (loss, correct (K,), scored (K,)) with no per-position Python loop.

    The head and the soft cross-entropy run only on positions with a label (the vocab-wide part).
    Accuracy counts every assistant position, so a target token outside the draft vocab is a miss,
    as it is when drafting.
    """
    probs, valid, target, scored = labels
    ids = batch["ids"]
    B, T = ids.shape
    mask = causal_mask(T, device=ids.device)  # (1, 1, T, T)
    pos = torch.arange(T, device=ids.device)
    h, kv, loss, correct, counted = batch["aux"], [], 0.0, [], []
    for k in range(ttt_steps):
        _, h = model(shift_left(ids, 1 + k), h, pos + k, mask, ttt=kv, with_logits=False)  # (B, T, H)
        v = valid[:, 1 + k:]  # (B, T-1-k) the label of position t is the target's at t+1+k
        logits = model.logits(h[:, :T - 1 - k][v])  # (N, V_d)
        ce = -(probs[:, 1 + k:][v] * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # (N,)
        loss = loss + decay ** k * ce.sum() / max(ce.shape[0], 1)
        correct.append((logits.argmax(-1) == target[:, 1 + k:][v]).sum())
        counted.append(scored[:, 1 + k:].sum())
    return loss, torch.stack(correct), torch.stack(counted)


# ----------------------------------------------------------------------------- setup

def drafter_config(cfg: TrainingConfig, tcfg: dict, hidden_size: int, num_aux: int) -> DrafterConfig:
    """Drafter sizes: cfg.drafter where given, else the target's config.json."""
    if tcfg["hidden_size"] != hidden_size:
        raise ValueError(f"shards hold hidden size {hidden_size} but the target config says {tcfg['hidden_size']}")
    s = cfg.drafter
    heads = s.num_attention_heads or tcfg["num_attention_heads"]
    rope = tcfg.get("rope_parameters") or {}
    return DrafterConfig(
        hidden_size=hidden_size, target_hidden_size=hidden_size, num_aux=num_aux,
        num_attention_heads=heads,
        num_key_value_heads=s.num_key_value_heads or (heads if s.num_attention_heads
                                                      else tcfg.get("num_key_value_heads", heads)),
        head_dim=s.head_dim or hidden_size // heads,
        intermediate_size=s.intermediate_size or tcfg["intermediate_size"],
        vocab_size=tcfg["vocab_size"], draft_vocab_size=cfg.draft_vocab_size,
        rms_norm_eps=tcfg.get("rms_norm_eps", 1e-6),
        rope_theta=tcfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
        max_position_embeddings=tcfg.get("max_position_embeddings", 2048))


def init_from_target(model: Eagle3Drafter, checkpoint: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Frozen embedding from the target; lm_head/norm start as the target's rows for the draft vocab."""
    t = load_target_tensors(checkpoint, ["embed", "lm_head", "norm"])
    with torch.no_grad():
        model.embed_tokens.weight.copy_(t["embed"].float())
        model.lm_head.weight.copy_(t["lm_head"].float()[t2d])
        model.norm.weight.copy_(t["norm"].float())
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)


def lr_factor(step: int, warmup: int, max_steps: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, max_steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ----------------------------------------------------------------------------- checkpoints

@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_pos: int = 0  # batches of this epoch already consumed
    tokens: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    accuracies: list[list[float]] = field(default_factory=list)


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = sorted((output_dir / "checkpoints").glob("step-[0-9]*"))
    return found[-1] if found else None


def save_checkpoint(output_dir: Path, model, opt, sched, state: TrainState, info: dict, keep: int = 2) -> Path:
    """Write checkpoints/step-NNNNNN whole in a temp folder, then rename it into place."""
    root = output_dir / "checkpoints"
    final = root / f"step-{state.step:06d}"
    tmp = root / f".tmp-step-{state.step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in model.trainable_state_dict().items()},
              str(tmp / "model.safetensors"))
    (tmp / "drafter.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    rng = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "state": asdict(state),
                "rng": rng, "fingerprint": info["fingerprint"]}, tmp / "trainer_state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(root.glob("step-[0-9]*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model, opt, sched, fingerprint: dict, log) -> TrainState:
    ckpt = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    old = ckpt["fingerprint"]
    differ = sorted(k for k in set(old) | set(fingerprint) if k != "max_steps" and old.get(k) != fingerprint.get(k))
    if differ:
        raise ValueError(f"{path}: checkpoint is from a different run ({', '.join(differ)} differ); "
                         f"remove {path.parent} or use another training.output_dir")
    if old.get("max_steps") != fingerprint.get("max_steps"):
        log(f"resuming with max_steps {fingerprint['max_steps']} (checkpoint ran with {old['max_steps']})")
    missing, unexpected = model.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected, (missing, unexpected)
    opt.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["scheduler"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    if ckpt["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    return TrainState(**ckpt["state"])


# ----------------------------------------------------------------------------- training

def train_drafter(cfg: TrainingConfig, target: TargetConfig, shard_paths: list[Path], *,
                  target_config_json: dict | None = None, log: Callable[[str], None] = print,
                  log_every: int | None = None, stop_at_step: int | None = None) -> TrainResult:
    """Train (or resume) an EAGLE-3 drafter on shards; checkpoints land in cfg.output_dir.

    stop_at_step: checkpoint and return once this step is reached, as if preempted; a later call
    with the same arguments resumes. log_every defaults to about 20 lines per run.
    """
    device = resolve_device(cfg.device)
    out_dir = Path(cfg.output_dir)
    # 1. data, and what the shards say about how they were made
    data = ShardData([Path(p) for p in shard_paths])
    meta = check_shard_meta(data.readers, target)
    tcfg = target_config_json or read_target_config(target.checkpoint)
    d2t, t2d = build_draft_vocab(count_tokens(data.readers, tcfg["vocab_size"]), tcfg["vocab_size"],
                                 cfg.draft_vocab_size)
    # 2. the drafter (seeded), the target's head for the labels, the optimizer
    dcfg = drafter_config(cfg, tcfg, data.hidden_size, data.num_aux)
    torch.manual_seed(cfg.seed)
    model = Eagle3Drafter(dcfg)
    init_from_target(model, target.checkpoint, d2t, t2d)
    model.to(device)
    head = TargetHead.from_checkpoint(target.checkpoint, last_hidden_norm=meta["last_hidden_norm"]).to(device)
    t2d_dev = t2d.to(device)
    draft_of = (torch.cumsum(t2d.long(), 0) - 1).to(device)  # target id -> draft id (where t2d)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.warmup_steps, cfg.max_steps))
    fingerprint = {**cfg.model_dump(mode="json", exclude={"output_dir", "checkpoint_every", "device"}),
                   "shards": [[Path(r.path).name, r.num_tokens] for r in data.readers],
                   "capture_ids": target.capture_ids(), "last_hidden_norm": meta["last_hidden_norm"]}
    info = {"drafter": asdict(dcfg), "fingerprint": fingerprint, "shard_meta": meta,
            "target": {"checkpoint": str(target.checkpoint), "revision": target.revision,
                       "layer_ids": target.layer_ids, "layer_convention": target.layer_convention,
                       "capture_ids": target.capture_ids()}}
    state, ckpt = TrainState(), latest_checkpoint(out_dir)
    if ckpt is not None:
        state = load_checkpoint(ckpt, model, opt, sched, fingerprint, log)
        log(f"resumed from {ckpt} at step {state.step}")
    resumed_from, t_run = state.step, time.monotonic()
    t_log = t_run
    log_every = log_every or max(1, cfg.max_steps // 20)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    log(f"training drafter: {sum(p.numel() for p in params) / 1e6:.2f}M params, {len(data.train_ids)} train / "
        f"{data.num_heldout} held-out sequences, draft vocab {cfg.draft_vocab_size}, device {device}")

    # 3. the loop
    batches = epoch_batches(data.lengths, data.train_ids, cfg.batch_size, cfg.seed, state.epoch)
    stop = min(cfg.max_steps, stop_at_step or cfg.max_steps)
    while state.step < stop:
        if state.batch_pos >= len(batches):
            state.epoch, state.batch_pos = state.epoch + 1, 0
            batches = epoch_batches(data.lengths, data.train_ids, cfg.batch_size, cfg.seed, state.epoch)
        idx = batches[state.batch_pos]
        batch = collate([data.sample(i) for i in idx], device)
        state.batch_pos += 1
        with autocast:
            labels = make_labels(head, batch, t2d_dev, draft_of)
            loss, correct, counted = ttt_loss(model, batch, labels, cfg.ttt_steps, cfg.loss_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        state.step += 1
        state.tokens += sum(data.lengths[i] for i in idx)
        state.losses.append(loss.item())
        state.accuracies.append((correct / counted.clamp(min=1)).tolist())
        if state.step % log_every == 0 or state.step == stop:
            acc = " ".join(f"{a:.2f}" for a in state.accuracies[-1])
            log(f"step {state.step}/{cfg.max_steps} loss {state.losses[-1]:.4f} acc [{acc}] "
                f"lr {sched.get_last_lr()[0]:.2e} {time.monotonic() - t_log:.1f}s")
        if state.step % cfg.checkpoint_every == 0 or state.step == stop:
            state.seconds += time.monotonic() - t_run
            t_run = time.monotonic()
            ckpt = save_checkpoint(out_dir, model, opt, sched, state, info)

    # 4. held-out accuracy per TTT step -> simulated acceptance length
    held = evaluate_heldout(model, head, data, t2d_dev, draft_of, cfg, device) if state.step >= cfg.max_steps else None
    tail = state.losses[-max(1, min(10, len(state.losses) // 10)):]
    return TrainResult(
        final_loss=sum(tail) / len(tail), first_loss=state.losses[0], losses=state.losses,
        accuracies=state.accuracies, steps=state.step, tokens=state.tokens,
        seconds=round(state.seconds + time.monotonic() - t_run, 3), checkpoint_dir=str(ckpt),
        draft_vocab_size=cfg.draft_vocab_size, heldout_accuracies=held,
        simulated_acceptance_length=None if held is None else simulated_acceptance_length(held),
        resumed_from_step=resumed_from)


@torch.no_grad()
def evaluate_heldout(model, head, data: ShardData, t2d, draft_of, cfg: TrainingConfig, device) -> list[float] | None:
    if not data.heldout_ids:
        return None
    correct = counted = 0
    for s in range(0, len(data.heldout_ids), cfg.batch_size):
        batch = collate([data.sample(i) for i in data.heldout_ids[s:s + cfg.batch_size]], device)
        _, c, n = ttt_loss(model, batch, make_labels(head, batch, t2d, draft_of), cfg.ttt_steps, cfg.loss_decay)
        correct, counted = correct + c, counted + n
    return (correct / counted.clamp(min=1)).tolist()

