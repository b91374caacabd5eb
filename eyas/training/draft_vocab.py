"""The draft vocabulary: the N most frequent target tokens under the loss mask.

    counts = count_tokens(readers, vocab_size)            # or any LongTensor[vocab] of counts
    d2t, t2d = build_draft_vocab(counts, vocab_size, 1024)

Draft ids are the chosen target ids in ascending order, so `d2t[i] = target_id(i) - i` is
non-negative and monotone (SpecForge / EAGLE `scandata` layout; SGLang adds `arange` back), and
`t2d` (a BoolTensor over the target vocab) marks the chosen ids. Ties in frequency go to the
smaller token id; when fewer than N distinct tokens were seen, the rest of the slots are filled
with the most frequent remaining ids (all count 0, so the smallest unseen ids): the size is always
exactly N, which the drafter's lm_head needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from eyas.errors import InvalidInput


def count_tokens(shards: Iterable, vocab_size: int) -> torch.Tensor:
    """Token counts under the loss mask over shard files (ShardReaders or paths) ->
    LongTensor[vocab]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for shard in shards:
        path = Path(getattr(shard, "path", shard))
        with safe_open(
            str(path), framework="pt"
        ) as f:  # only the two small columns, never the states
            ids = f.get_tensor("input_ids").long()
            mask = f.get_tensor("loss_mask").bool()
        ids = ids[mask]
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise InvalidInput(
                f"{path}: token ids span {int(ids.min())}..{int(ids.max())}, outside the "
                f"target vocab of {vocab_size}"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_draft_vocab(
    token_counts, target_vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the draft vocab -> (d2t LongTensor[draft_vocab_size], t2d
    BoolTensor[target_vocab_size]).

    token_counts: a LongTensor[vocab] of counts, a {token_id: count} mapping, or an iterable of
    shards (ShardReaders or shard paths) to count under their loss masks.
    """
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise InvalidInput(
            f"draft_vocab_size must be in 1..{target_vocab_size} (the target vocab), "
            f"got {draft_vocab_size}"
        )
    counts = _as_counts(token_counts, target_vocab_size)
    # stable sort on -count keeps ascending ids within a tie: deterministic on every platform
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values  # (N,) ascending target ids
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def _as_counts(token_counts, vocab_size: int) -> torch.Tensor:
    if isinstance(token_counts, torch.Tensor):
        if token_counts.shape != (vocab_size,):
            raise InvalidInput(
                f"token_counts has shape {tuple(token_counts.shape)}, expected ({vocab_size},)"
            )
        return token_counts.long()
    if isinstance(token_counts, Mapping):
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for tok, n in token_counts.items():
            if not 0 <= int(tok) < vocab_size:
                raise InvalidInput(
                    f"token_counts has token id {tok}, outside the target vocab of {vocab_size}"
                )
            counts[int(tok)] += int(n)
        return counts
    return count_tokens(token_counts, vocab_size)
