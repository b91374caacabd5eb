"""From shards to training batches: the samples, the length-aware epoch plan, collation and aux
noise.

    # samples by global index; the last few held out
    data = ShardData(paths, num_validation, ttt_steps)
    # the shards agree with each other and the target
    meta = check_shard_meta(data.readers, target)
    plan = epoch_plan(data.lengths, data.train_ids, batch_size, num_micro, seed, epoch)
    batch = add_aux_noise(collate([data.sample(i) for i in plan[0][0]], device), 0.1)

A global batch of an optimizer step is batch_size * grad_accum * world_size sequences, drawn
length-aware (sorted within windows of `length_grouping` global batches, so a micro-batch pads
little) and cut into micro-batches; micro-batch j of a step goes to rank j % world_size
(eyas/training/train.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from safetensors import safe_open

from eyas.errors import InvalidInput
from eyas.extraction.shards import ShardReader
from eyas.layers import to_capture_before
from eyas.training.losses import scored_counts

if TYPE_CHECKING:  # eyas.config needs pydantic; the GPU benchmark imports this package without it
    from eyas.config import TargetConfig


class ShardData:
    """Samples of several shards, read lazily by global index; the last few are held out."""

    def __init__(
        self,
        paths: list[Path],
        num_validation: int | None = None,
        ttt_steps: int = 1,
        all_positions: bool = False,
    ):
        if not paths:
            raise InvalidInput("train_drafter: no shard files given")
        self.readers = [ShardReader(p) for p in paths]
        self.index = [(r, i) for r in self.readers for i in range(len(r))]
        self.lengths = [
            int(r.offsets[i + 1] - r.offsets[i]) for r in self.readers for i in range(len(r))
        ]
        hs = {(r.hidden_size, r.num_aux) for r in self.readers}
        if len(hs) != 1:
            raise InvalidInput(f"shards disagree on (hidden_size, num_aux): {sorted(hs)}")
        ((self.hidden_size, self.num_aux),) = hs
        n = len(self.index)
        self.num_validation = (
            min(64, n // 20) if num_validation is None else min(num_validation, n - 1)
        )
        self.train_ids = list(range(n - self.num_validation))
        self.validation_ids = list(range(n - self.num_validation, n))
        self.all_positions = all_positions  # every real token is a label, not only the loss mask's
        self.scored = self._scored_counts(ttt_steps)  # (n, K) positions scored per TTT step

    def _scored_counts(self, K: int) -> torch.Tensor:
        rows = []
        for r in self.readers:  # the loss-mask column only, never the states
            with safe_open(str(r.path), framework="pt") as f:
                mask = f.get_tensor("loss_mask").bool() | self.all_positions
            rows += [
                scored_counts([mask[r.offsets[i] : r.offsets[i + 1]]], K) for i in range(len(r))
            ]
        return torch.stack(rows)

    def sample(self, i: int):
        r, j = self.index[i]
        s = r.sample(j)
        if self.all_positions:
            s.loss_mask = torch.ones_like(s.loss_mask)
        return s


def check_shard_meta(readers: list[ShardReader], target: TargetConfig) -> dict:
    """Layer ids, convention and final-norm state the shards agree on, checked against the target
    config."""
    keys = ("layer_ids", "layer_convention", "last_hidden_norm")
    seen = {}
    for r in readers:
        got = tuple(json.dumps(r.meta.get(k)) for k in keys)
        seen.setdefault(got, r.path)
    if len(seen) > 1:
        raise InvalidInput(
            f"shards disagree on {keys}: " + "; ".join(f"{p}: {g}" for g, p in seen.items())
        )
    meta = {k: readers[0].meta.get(k) for k in keys}
    if meta["last_hidden_norm"] not in ("pre", "post"):
        raise InvalidInput(
            f"{readers[0].path}: shard meta must say last_hidden_norm 'pre' or 'post', got "
            f"{meta['last_hidden_norm']!r}; without it the labels may be computed on "
            f"the wrong states"
        )
    if meta["layer_ids"] is not None:
        capture = to_capture_before(meta["layer_ids"], meta["layer_convention"])
        if capture != target.capture_ids():
            raise InvalidInput(
                f"{readers[0].path}: shards hold capture layers {capture} ({meta['layer_ids']} "
                f"{meta['layer_convention']}) but target.layer_ids says {target.capture_ids()} "
                f"({target.layer_ids} {target.layer_convention})"
            )
        meta["capture_ids"] = capture
    return meta


def data_digest(readers: list[ShardReader]) -> str:
    """sha256 over what each shard holds: extraction's cache key (its sequences, the target and
    revision, layers, dtype, encoding, patch), else its planned content hash, else its ids and
    masks. Same names and sizes with other sequences (a nightly's new data) give another digest."""
    h = hashlib.sha256()
    for r in readers:
        ident = r.meta.get("cache_key") or r.meta.get("content_hash")
        if ident is None:
            with safe_open(str(r.path), framework="pt") as f:
                ident = hashlib.sha256(
                    f.get_tensor("input_ids").numpy().tobytes()
                    + f.get_tensor("loss_mask").numpy().tobytes()
                ).hexdigest()
        h.update(f"{Path(r.path).name}:{ident}\n".encode())
    return h.hexdigest()


def epoch_plan(
    lengths: list[int],
    ids: list[int],
    micro: int,
    num_micro: int,
    seed: int,
    epoch: int,
    window: int = 16,
) -> list[list[list[int]]]:
    """One epoch as steps -> micro-batches -> sample ids, length-aware, independent of world size.

    A seeded shuffle is cut into windows of `window` global batches (num_micro * micro sequences
    each); each window is sorted by length and cut into global batches, each global batch into
    num_micro micro-batches of similar lengths; the steps are shuffled again. An incomplete last
    global batch is dropped.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = [ids[i] for i in torch.randperm(len(ids), generator=g).tolist()]
    G, steps = micro * num_micro, []
    perm = perm[: len(perm) - len(perm) % G]
    for s in range(0, len(perm), window * G):
        chunk = sorted(perm[s : s + window * G], key=lambda i: (-lengths[i], i))
        for b in range(0, len(chunk), G):
            steps.append([chunk[b + m * micro : b + (m + 1) * micro] for m in range(num_micro)])
    return [steps[i] for i in torch.randperm(len(steps), generator=g).tolist()]


@dataclass(frozen=True, eq=False)  # eq: == on tensors is elementwise; compare tensors()
class Batch:
    """A micro-batch of sequences, each right-padded with zeros to the longest one (T)."""

    ids: torch.Tensor  # (B, T) long: the input token ids
    loss_mask: torch.Tensor  # (B, T) bool: the tokens to learn to predict (loss_positions)
    aux: torch.Tensor  # (B, T, K*H) the K captured layers' hidden states, side by side
    last: torch.Tensor  # (B, T, H) the target's last hidden state, which the teacher labels
    sample_ids: list[int] | None = None  # the samples' global indices: the teacher cache's key

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.ids, self.loss_mask, self.aux, self.last

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """fn on every tensor (a copy to the device, pinning); the same sample_ids."""
        return Batch(*map(fn, self.tensors()), sample_ids=self.sample_ids)


def collate(samples, device, dtype=torch.float32, ids: list[int] | None = None) -> Batch:
    """Right-pad a list of samples into a Batch; with `ids` (the samples' global indices) also its
    sample_ids, for the teacher cache."""
    B, T = len(samples), max(len(s) for s in samples)
    out = Batch(
        torch.zeros(B, T, dtype=torch.long),
        torch.zeros(B, T, dtype=torch.bool),
        torch.zeros(B, T, samples[0].aux_hidden_states.shape[1], dtype=dtype),
        torch.zeros(B, T, samples[0].last_hidden_state.shape[1], dtype=dtype),
        None if ids is None else list(ids),
    )
    for b, s in enumerate(samples):
        n = len(s)
        out.ids[b, :n], out.loss_mask[b, :n] = s.input_ids, s.loss_mask
        out.aux[b, :n], out.last[b, :n] = s.aux_hidden_states, s.last_hidden_state
    return out.apply(lambda t: t.to(device, non_blocking=True))


def add_aux_noise(batch: Batch, scale: float) -> Batch:
    """aux + scale * rms * N(0, 1), the RMS taken per token and per captured layer (B, T, K*H)."""
    if not scale:
        return batch
    aux = batch.aux
    B, T, KH = aux.shape
    K = KH // batch.last.shape[-1]
    a = aux.float().view(B, T, K, -1)
    rms = a.pow(2).mean(-1, keepdim=True).sqrt()
    return replace(batch, aux=(a + scale * rms * torch.randn_like(a)).view(B, T, KH).to(aux.dtype))
