"""The EAGLE-3 objective: teacher labels from the target's head, the TTT unroll, and a fused loss.

    labels = teacher_labels(head, batch["last"], batch["loss_mask"], num_draft)   # once per batch
    loss, correct, scored = TTTObjective(drafter)(batch["ids"], batch["aux"], labels, 7, 0.8, counts)

Never materialised: the target's logits over its whole vocabulary for all positions (the teacher runs
in chunks of positions over a head whose rows are reordered draft-vocabulary-first, so the exact
full-vocabulary argmax and the draft-vocabulary softmax come from one pass), and the drafter's
logits for all positions and TTT steps (`head_soft_ce` computes logits, loss and both gradients a
chunk of rows at a time during the forward and keeps only the gradients: no logits survive).

Loss of a batch = sum_k decay**k * (sum of soft CE over the positions labelled at step k) / counts[k],
where counts[k] is the number of assistant positions scored at step k in the *global* batch (all
micro-batches, all ranks): it is known from the loss masks alone, before any forward, so gradient
accumulation and data parallelism give exactly the loss of one big batch. A position is labelled
where the token it predicts is an assistant token and the target's argmax lies in the draft
vocabulary; positions whose argmax does not still count in counts[k] and as misses in accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from eyas import fused
from eyas.drafter import Eagle3Drafter, TTTWeights, compute_dtype
from eyas.target_head import TargetHead

HEAD_CHUNK_ROWS = 8192  # rows of the drafter's fused head per chunk: (rows, draft_vocab) fp32 transient
TEACHER_CHUNK_ROWS = 4096  # positions per chunk of the teacher: (rows, vocab) logits transient



# ----------------------------------------------------------------------------- teacher

@dataclass
class Labels:
    probs: torch.Tensor  # (B*T, V_d) the target's distribution over the draft vocab, predicting t+1
    target: torch.Tensor  # (B, T) the target's argmax as a draft id, -1 where outside the draft vocab
    valid: torch.Tensor  # (B, T) bool: token t+1 is an assistant token and target >= 0
    scored: torch.Tensor  # (B, T) bool: token t+1 is an assistant token


def draft_first_order(t2d: torch.Tensor) -> torch.Tensor:
    """Target ids with the draft vocab first (ascending, so index i = draft id i), then the rest."""
    return torch.cat([t2d.nonzero().flatten(), (~t2d).nonzero().flatten()])


@torch.no_grad()
def teacher_labels(head: TargetHead, last: torch.Tensor, loss_mask: torch.Tensor, num_draft: int,
                   probs_dtype=torch.float32, chunk: int = TEACHER_CHUNK_ROWS) -> Labels:
    """Labels from the stored last hidden states (B, T, H); head.weight must be draft-first ordered."""
    B, T, H = last.shape
    x = last.reshape(B * T, H)
    probs = torch.empty(B * T, num_draft, dtype=probs_dtype, device=last.device)
    top = torch.empty(B * T, dtype=torch.long, device=last.device)
    for s in range(0, B * T, chunk):
        z = fused.mm_f32(head.prepare(x[s:s + chunk]), head.weight.T)  # (n, V) draft ids first
        top[s:s + chunk] = z.argmax(-1)
        probs[s:s + chunk] = torch.softmax(z[:, :num_draft], dim=-1).to(probs_dtype)
    target = torch.where(top < num_draft, top, -1).view(B, T)
    scored = torch.zeros_like(loss_mask, dtype=torch.bool)
    scored[:, :-1] = loss_mask[:, 1:].bool()  # the target at t predicts token t+1
    return Labels(probs, target, scored & (target >= 0), scored)


# ----------------------------------------------------------------------------- fused head + soft CE

class _HeadSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, probs, rows, row_w, chunk, grad):
        N = h.shape[0]
        W = weight.to(h.dtype)  # (V_d, H)
        gh = torch.empty_like(h) if grad else None  # (N, H) d loss / d h, filled chunk by chunk
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if grad else None  # (V_d, H)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        pred = torch.empty(N, dtype=torch.long, device=h.device)
        for s in range(0, N, chunk):
            hc, rc, wc = h[s:s + chunk], rows[s:s + chunk], row_w[s:s + chunk]  # (n, H), (n,), (n,)
            z = fused.mm_f32(hc, W.T)  # (n, V_d) logits, fp32
            if not grad:
                part, pred[s:s + chunk] = fused.soft_ce_rows_nograd(z, probs, rc, wc)
                loss += part
                continue
            part, pred[s:s + chunk], dz = fused.soft_ce_rows(z, probs, rc, wc, h.dtype)  # dz = (q - p) * w
            loss += part
            gh[s:s + chunk] = dz @ W
            fused.addmm_f32_(gw, dz.T, hc)
        ctx.save_for_backward(gh, gw)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, gloss, _gpred):
        gh, gw = ctx.saved_tensors
        return gh * gloss.to(gh.dtype), (gw * gloss).to(ctx.weight_dtype), None, None, None, None, None


def head_soft_ce(h, weight, probs, rows, row_w, chunk: int = HEAD_CHUNK_ROWS):
    """sum_i row_w[i] * CE(probs[rows[i]], softmax(h[i] @ weight.T)) -> (loss, argmax per row).

    h (N, H) normed drafter states, weight (V_d, H) the drafter's lm_head, probs (M, V_d) teacher
    rows, rows (N,) which teacher row labels each h row, row_w (N,) fp32 weights (0 = unlabelled).
    """
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    with torch.autocast(h.device.type, enabled=False):  # the dtypes above are the ones meant
        return _HeadSoftCE.apply(h, weight, probs, rows, row_w, chunk, grad)


# ----------------------------------------------------------------------------- the TTT unroll

def label_rows(B: int, T: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row (k, b, t) is labelled by the teacher at (b, t+1+k): -> (flat teacher row (K, B, T), inside (K, 1, T))."""
    src = torch.arange(T, device=device)[None] + 1 + torch.arange(K, device=device)[:, None]  # (K, T)
    inside = (src < T)[:, None]
    rows = torch.arange(B, device=device)[None, :, None] * T + src.clamp(max=T - 1)[:, None]  # (K, B, T)
    return rows, inside


def scored_counts(loss_masks, K: int) -> torch.Tensor:
    """Positions scored at each TTT step, from loss masks alone: counts[k] = sum_t mask[t+2+k]."""
    counts = torch.zeros(K, dtype=torch.float64)
    for m in loss_masks:
        m = torch.as_tensor(m).bool()
        for k in range(K):
            counts[k] += int(m[2 + k:].sum())
    return counts


class TTTObjective(nn.Module):
    """The whole training forward as one module, so DDP/FSDP see every use of every weight.

    With shared_weights (the default) the drafter's GEMM weights are cast once per unroll and their
    gradients summed inside the weight-gradient GEMMs (drafter.TTTWeights; in bf16 unless
    drafter.GRAD_ACC_FP32); off, the nn.Linear modules run.
    """

    shared_weights = True

    def __init__(self, drafter: Eagle3Drafter, head_chunk: int = HEAD_CHUNK_ROWS):
        super().__init__()
        self.drafter, self.head_chunk = drafter, head_chunk

    def forward(self, ids, aux, labels: Labels, ttt_steps: int, decay: float, counts: torch.Tensor | None = None):
        """ids (B, T), aux (B, T, 3H) -> (loss, correct (K,), scored (K,)); counts (K,) the denominators."""
        m, (B, T), K = self.drafter, ids.shape, ttt_steps
        pos = torch.arange(T, device=ids.device)
        h, kv, normed = aux, [], []
        shared = TTTWeights(m, compute_dtype(ids.device, m.fc.weight.dtype)) if self.shared_weights else None
        for k in range(K):
            nxt = torch.zeros_like(ids)
            nxt[:, :T - 1 - k] = ids[:, 1 + k:]  # step k at t reads token t+1+k
            h, hn = m.step(nxt, h, pos + k, None, ttt=kv, shared=shared)  # (B, T, H) pre-norm (next step's input), normed
            normed.append(hn)
        hn = torch.stack(normed)  # (K, B, T, H)
        rows, inside = label_rows(B, T, K, ids.device)
        valid = labels.valid.view(-1)[rows] & inside  # (K, B, T)
        scored = labels.scored.view(-1)[rows] & inside
        if counts is None:
            counts = scored.sum((1, 2))
        decay_k = decay ** torch.arange(K, device=ids.device, dtype=torch.float32)
        row_w = valid * (decay_k / counts.to(ids.device, torch.float32).clamp(min=1))[:, None, None]
        loss, pred = head_soft_ce(hn.view(K * B * T, -1), m.lm_head.weight, labels.probs, rows.view(-1),
                                  row_w.view(-1), self.head_chunk)
        correct = ((pred.view(K, B, T) == labels.target.view(-1)[rows]) & scored).sum((1, 2))
        return loss, correct, scored.sum((1, 2))
