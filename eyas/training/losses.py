"""The EAGLE-3 objective: teacher labels from the target's head, the TTT unroll, and a fused loss.

    # once per batch
    labels = teacher_labels(head, batch.last, batch.loss_mask, num_draft, kernels=k)
    loss, correct, scored = TTTObjective(drafter, kernels=k)(batch.ids, batch.aux, labels, 7,
    0.8, counts)

Never materialised: the target's logits over its whole vocabulary for all positions (the teacher
runs in chunks of positions over a head whose rows are reordered draft-vocabulary-first: the draft
vocabulary's rows give the softmax, the rest only whether the exact full-vocabulary argmax lies
outside, which a later epoch reads from teacher_cache.ArgmaxMemo instead), and the drafter's logits
for all positions and TTT steps (`head_soft_ce` computes logits, loss and both gradients a chunk of
rows at a time during the forward and keeps only the gradients: no logits survive).

Loss of a batch = sum_k decay**k * (sum of soft CE over the positions labelled at step k) /
counts[k], where counts[k] is the number of assistant positions scored at step k in the *global*
batch (all micro-batches, all ranks): it is known from the loss masks alone, before any forward, so
gradient accumulation and data parallelism give exactly the loss of one big batch. A position is
labelled where the token it predicts is an assistant token and the target's argmax lies in the draft
vocabulary; positions whose argmax does not still count in counts[k] and as misses in accuracy.

Work only where the loss mask can use it: the teacher runs on the scored positions only, and the TTT
steps >= 1 (and every step's head) only on the positions some step scores (step_rows.py): one
span from the batch's first to its last, or gathered position by position where that skips enough
(chat data's user turns between replies drop out, as do prompts and padding). One unroll runs on
either (TTTObjective._unroll). The loss and its gradients are the same function; a position is never
dropped for its label's content.

`reference_ttt_loss` is the objective read plainly: the drafter unrolled K times under explicit
masks, every position, all logits. TTTObjective computes the same function, as follows.

Each TTT step is the plain drafter's function through fused machinery (eyas/training/ttt_step.py):
the GEMM weights cast once per unroll with their gradients summed inside the GEMMs (ttt_weights.py),
and the embedding's share of every step's q/k/v one projection per unroll (shared_emb.py; with FP8
GEMMs, which quantize q/k/v whole, the weights concatenate each step's own input instead): step k
at position t reads the token step 0 reads at t+k, so it takes row t+k of it (TTTObjective._emb).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from eyas.training import gemm
from eyas.training import kernels as fused
from eyas.training.drafter import Eagle3Drafter, KVCache, ttt_mask
from eyas.training.kernels import DEFAULT, KernelOptions
from eyas.training.shared_emb import SharedEmb
from eyas.training.soft_ce import soft_ce_rows, soft_ce_rows_nograd
from eyas.training.step_rows import StepRows, scored_span, step_rows
from eyas.training.target_head import TargetHead
from eyas.training.ttt_step import TTTKeys, emb_proj, ttt_step
from eyas.training.ttt_weights import TTTWeights, compute_dtype

HEAD_CHUNK_ROWS = (
    8192  # rows of the drafter's fused head per chunk: (rows, draft_vocab) fp32 transient
)
HEAD_CHUNK_ROWS_CPU = (
    1024  # on a CPU: (1024, 2048) fp32 chunks stay in cache, 15% faster steps than 8192
)
TEACHER_CHUNK_ROWS = 4096  # positions per chunk of the teacher: (rows, vocab) logits transient


# ----------------------------------------------------------------------------- teacher


@dataclass
class Labels:
    probs: torch.Tensor  # (B*T, V_d) the target's distribution over the draft vocab, predicting t+1
    target: (
        torch.Tensor
    )  # (B, T) the target's argmax as a draft id, -1 where outside the draft vocab
    valid: torch.Tensor  # (B, T) bool: token t+1 is an assistant token and target >= 0
    scored: torch.Tensor  # (B, T) bool: token t+1 is an assistant token
    # [first, last + 1) of the positions scored in any sequence; probs and target hold the teacher
    # only there (zeros and -1 elsewhere). None: not known (TTTObjective reads it off `scored`).
    span: tuple[int, int] | None = None


def draft_first_order(t2d: torch.Tensor) -> torch.Tensor:
    """Target ids with the draft vocab first (ascending, so index i = draft id i), then the rest."""
    return torch.cat([t2d.nonzero().flatten(), (~t2d).nonzero().flatten()])


@torch.no_grad()
def teacher_labels(
    head: TargetHead,
    last: torch.Tensor,
    loss_mask: torch.Tensor,
    num_draft: int,
    probs_dtype=torch.float32,
    chunk: int = TEACHER_CHUNK_ROWS,
    kernels: KernelOptions = DEFAULT,
    outside: torch.Tensor | None = None,
) -> Labels:
    """Labels from the stored last hidden states (B, T, H); head.weight must be draft-first ordered.

    The head runs only on the scored positions, gathered: nothing reads the labels of a position
    that is not scored.

    outside: (B, T) bool, where the full-vocabulary argmax is known to lie outside the draft
    vocabulary (the same sequences' teacher in an earlier epoch: teacher_cache.ArgmaxMemo). The rest
    of the vocabulary's rows then do not run (at Kimi-K2.5's 32,000 of 163,840, four fifths of the
    teacher's GEMM), and every scored position's labels are the same bit for bit: the draft
    vocabulary's logits are one GEMM of their own either way, and the rest only ever gives the one
    bit."""
    B, T, H = last.shape
    scored = torch.zeros_like(loss_mask, dtype=torch.bool)
    scored[:, :-1] = loss_mask[:, 1:].bool()  # the target at t predicts token t+1
    first, end = scored_span(scored)
    probs = torch.zeros(B, T, num_draft, dtype=probs_dtype, device=last.device)
    top = torch.full(
        (B, T), num_draft, dtype=torch.long, device=last.device
    )  # outside the draft vocab
    W_draft, W_rest = head.weight[:num_draft], head.weight[num_draft:]  # (V_d, H), (V - V_d, H)

    def label(x: torch.Tensor, known: torch.Tensor | None):  # (n, H) last states, (n,) bool or None
        x = head.prepare(x)
        z = gemm.mm_f32(x, W_draft.T)  # (n, V_d) fp32
        # best: the first maximum (draft ids come first, so a tie with the rest stays inside)
        best, best_logit, p = fused.teacher_softmax(z, probs_dtype, compile=kernels.compile)
        if known is None and not len(W_rest):  # the draft vocabulary is the whole vocabulary
            known = torch.zeros_like(best, dtype=torch.bool)
        elif (
            known is None
        ):  # the full argmax lies outside where the rest holds a strictly larger logit
            known = gemm.mm_f32(x, W_rest.T).amax(-1) > best_logit
        return torch.where(known, num_draft, best), p

    with gemm.teacher_blas(last.device, kernels.teacher_cublaslt):
        at = scored.view(-1).nonzero().flatten()  # (n,) flat positions
        flat_last, flat_probs, flat_top = last.view(B * T, H), probs.view(B * T, -1), top.view(-1)
        for s in range(0, at.numel(), chunk):
            r = at[s : s + chunk]
            flat_top[r], flat_probs[r] = label(
                flat_last[r], None if outside is None else outside.view(-1)[r]
            )
    target = torch.where(top < num_draft, top, -1)
    return Labels(
        probs.view(B * T, num_draft), target, scored & (target >= 0), scored, (first, end)
    )


# ----------------------------------------------------------------------------- the plain objective


def reference_ttt_loss(
    drafter: Eagle3Drafter,
    ids,
    aux,
    labels: Labels,
    ttt_steps: int,
    decay: float,
    counts: torch.Tensor | None = None,
):
    """The objective as the plain drafter unrolled: the spec TTTObjective computes through fused
    machinery (held equal by tests/unit/training/test_losses.py; KernelOptions.reference trains on
    this). Every step runs the whole model on every position under ttt_mask and forms all logits.

    ids (B, T), aux (B, T, 3H) -> (loss, correct (K,), scored (K,)); counts (K,) the denominators
    (None: this batch's scored positions)."""
    (B, T), K = ids.shape, ttt_steps
    probs = labels.probs.view(B, T, -1)  # (B, T, V_d) the teacher at t, predicting token t+1
    pos = torch.arange(T, device=ids.device)
    h, cache, loss, correct, scored = aux, KVCache(), 0.0, [], []
    for k in range(K):
        nxt = torch.zeros_like(ids)
        nxt[:, : T - 1 - k] = ids[:, 1 + k :]  # step k at t reads token t+1+k (0 past the end)
        # causal over step 0's keys (in the cache), and t over its own position in steps 1..k
        logits, h = drafter(nxt, h, pos + k, ttt_mask(T, k, ids.device), cache)  # (B, T, V_d)
        z = logits[:, : T - 1 - k].float()  # (B, T-1-k, V_d): t labelled by the teacher at t+1+k
        valid, s = labels.valid[:, 1 + k :], labels.scored[:, 1 + k :]  # (B, T-1-k) bool each
        ce = -(probs[:, 1 + k :][valid].float() * F.log_softmax(z[valid], -1)).sum()
        n = s.sum() if counts is None else counts[k]
        loss = loss + decay**k * ce / n.to(z.device, torch.float32).clamp(min=1)
        correct.append(((z.argmax(-1) == labels.target[:, 1 + k :]) & s).sum())
        scored.append(s.sum())
    return loss, torch.stack(correct), torch.stack(scored)


# ----------------------------------------------------------------------------- fused head + soft CE


class _HeadSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, probs, rows, row_w, chunk, grad, gemm_dtype, kernels):
        N, h_dtype = h.shape[0], h.dtype
        h = gemm.gemm_operand(
            h, gemm_dtype or h_dtype
        )  # (N', H): any rows past N are zeros, of weight 0
        if h.shape[0] > N:
            rows, row_w = F.pad(rows, (0, h.shape[0] - N)), F.pad(row_w, (0, h.shape[0] - N))
        W = weight.to(h.dtype)  # (V_d, H)
        gh = torch.empty_like(h) if grad else None  # (N', H) d loss / d h, filled chunk by chunk
        gw = (
            torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if grad else None
        )  # (V_d, H)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        pred = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
        for s in range(0, h.shape[0], chunk):
            hc, rc, wc = (
                h[s : s + chunk],
                rows[s : s + chunk],
                row_w[s : s + chunk],
            )  # (n, H), (n,), (n,)
            z = gemm.mm_f32(hc, W.T)  # (n, V_d) logits, fp32
            if not grad:
                part, pred[s : s + chunk] = soft_ce_rows_nograd(z, probs, rc, wc, kernels)
                loss += part
                continue
            part, pred[s : s + chunk], dz = soft_ce_rows(
                z, probs, rc, wc, h.dtype, kernels
            )  # dz = (q - p) * w
            loss += part
            gh[s : s + chunk] = dz @ W  # in the GEMM dtype; cast to h's once, below
            gemm.addmm_f32_(gw, dz.T, hc)
        ctx.save_for_backward(gh if gh is None else gh[:N].to(h_dtype), gw)
        ctx.weight_dtype = weight.dtype
        pred = pred[:N]
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, gloss, _gpred):
        gh, gw = ctx.saved_tensors
        return (
            gh * gloss.to(gh.dtype),
            (gw * gloss).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def head_soft_ce(
    h,
    weight,
    probs,
    rows,
    row_w,
    chunk: int = HEAD_CHUNK_ROWS,
    gemm_dtype=None,
    kernels: KernelOptions = DEFAULT,
):
    """sum_i row_w[i] * CE(probs[rows[i]], softmax(h[i] @ weight.T)) -> (loss, argmax per row).

    h (N, H) normed drafter states, weight (V_d, H) the drafter's lm_head, probs (M, V_d) teacher
    rows, rows (N,) which teacher row labels each h row, row_w (N,) fp32 weights (0 = unlabelled).
    gemm_dtype: the three GEMMs in this dtype (CPU bf16 matrix units); the loss math stays fp32.
    kernels: the soft cross-entropy's kernel (Triton on CUDA, or the PyTorch math, compiled or not).
    """
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    with torch.autocast(h.device.type, enabled=False):  # the dtypes above are the ones meant
        return _HeadSoftCE.apply(h, weight, probs, rows, row_w, chunk, grad, gemm_dtype, kernels)


# ----------------------------------------------------------------------------- the TTT unroll


def scored_counts(loss_masks, K: int) -> torch.Tensor:
    """Positions scored at each TTT step, from loss masks alone: counts[k] = sum_t mask[t+2+k]."""
    counts = torch.zeros(K, dtype=torch.float64)
    for m in loss_masks:
        m = torch.as_tensor(m).bool()
        for k in range(K):
            counts[k] += int(m[2 + k :].sum())
    return counts


class TTTObjective(nn.Module):
    """The whole training forward as one module, so DDP/FSDP see every use of every weight.

    kernels: the run's KernelOptions, handed to the TTT steps, the attention and the head loss. The
    drafter's GEMM weights are cast once per unroll and their gradients summed inside the
    weight-gradient GEMMs (eyas/training/ttt_weights.py); gemm_dtype: those GEMMs and the head's in
    this dtype (a CPU's bf16 matrix units).
    """

    def __init__(
        self,
        drafter: Eagle3Drafter,
        head_chunk: int = HEAD_CHUNK_ROWS,
        gemm_dtype: torch.dtype | None = None,
        kernels: KernelOptions = DEFAULT,
    ):
        super().__init__()
        self.drafter, self.head_chunk, self.gemm_dtype, self.kernels = (
            drafter,
            head_chunk,
            gemm_dtype,
            kernels,
        )

    def _weights(self, device) -> TTTWeights:
        """This unroll's TTTWeights. halves: q/k/v's embedding and hidden-state column blocks apart,
        so the embedding's share is one projection per unroll (kernels.shared_emb); not with FP8
        GEMMs, which quantize q/k/v's weights whole (each step then projects its own
        concatenation)."""
        kn, m = self.kernels, self.drafter
        return TTTWeights(
            m,
            compute_dtype(device, m.fc.weight.dtype),
            self.gemm_dtype,
            fp8=kn.fp8_gemms,
            compile=kn.compile,
            halves=kn.shared_emb and not kn.fp8_gemms,
            grouped=kn.grouped_gemms,
        )

    def _emb(self, ids, K: int, weights: TTTWeights, q_from: int = 0) -> SharedEmb:
        """What the steps read of their tokens, at every position a step reads (ttt_step.emb_proj).
        Step k at position t reads token t+1+k (0 past the end), which is ext[t+k] below, so step
        k's share at t is row t+k of one table over the T+K-1 tokens (q's from q_from, the first
        query's position)."""
        B, T = ids.shape
        ext = ids.new_zeros(B, T + K - 1)
        ext[:, : T - 1] = ids[:, 1:]
        return emb_proj(self.drafter, ext, weights, self.kernels, q_from)

    def _head_loss(self, hn, labels: Labels, rows, valid, scored, decay: float, counts):
        """(loss, correct (K,), scored (K,)) of the steps' normed states hn (K, ..., H) through the
        head, state (k, ...) labelled by teacher row rows[k, ...] where valid; counts (K,) the
        denominators (None: this batch's scored positions)."""
        K = rows.shape[0]
        valid, scored = valid.reshape(K, -1), scored.reshape(K, -1)
        if counts is None:
            counts = scored.sum(1)
        decay_k = decay ** torch.arange(K, device=hn.device, dtype=torch.float32)
        row_w = valid * (decay_k / counts.to(hn.device, torch.float32).clamp(min=1))[:, None]
        loss, pred = head_soft_ce(
            hn.view(rows.numel(), -1),
            self.drafter.lm_head.weight,
            labels.probs,
            rows.view(-1),
            row_w.view(-1),
            self.head_chunk,
            self.gemm_dtype,
            self.kernels,
        )
        correct = ((pred.view(K, -1) == labels.target.view(-1)[rows].view(K, -1)) & scored).sum(1)
        return loss, correct, scored.sum(1)

    def forward(
        self,
        ids,
        aux,
        labels: Labels,
        ttt_steps: int,
        decay: float,
        counts: torch.Tensor | None = None,
    ):
        """ids (B, T), aux (B, T, 3H) -> (loss, correct (K,), scored (K,)); counts (K,) the
        denominators."""
        if self.kernels.reference:  # the spec, unrolled plainly
            return reference_ttt_loss(self.drafter, ids, aux, labels, ttt_steps, decay, counts)
        (B, T), K = ids.shape, ttt_steps
        at = step_rows(labels, B, T, K, self.kernels)  # a span, or the scored positions gathered
        hn = self._unroll(ids, aux, K, at)  # (K, B, L, H) | (K, N, H)
        rows, inside = at.teacher_rows(K, B, ids.device)  # (K, B, L) | (K, N)
        valid = labels.valid.view(-1)[rows] & inside
        scored = labels.scored.view(-1)[rows] & inside
        return self._head_loss(hn, labels, rows, valid, scored, decay, counts)

    def _unroll(self, ids, aux, K: int, at: StepRows) -> torch.Tensor:
        """The K TTT steps' normed states at `at`'s rows -> (K, B, L, H) | (K, N, H). Step 0's keys
        and values run on [0, at.keys_end), its queries and every later step at the rows only."""
        m, kn = self.drafter, self.kernels
        weights = self._weights(ids.device)
        emb = self._emb(ids, K, weights, at.q_from)  # what each step reads of its tokens
        kv, normed, h = TTTKeys(where=at.where), [], aux[:, : at.keys_end]
        for k in range(K):
            keys = slice(0, at.keys_end) if k == 0 else at.at(k)
            h, hn = ttt_step(
                m,
                h,
                emb.step(at.at(k), keys),
                at.positions(k, ids.device),
                kv,
                weights,
                kn,
                at.keep if k == 0 else None,
            )  # (B, L, H) | (1, N, H)
            normed.append(at.flat(hn))
        # the steps' own copies go with `normed` on return, before the head's chunks are allocated
        # (peak memory)
        return torch.stack(normed)
