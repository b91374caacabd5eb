"""The few target tensors training needs, read without loading the model.

    head = TargetHead.from_checkpoint(ckpt, last_hidden_norm="post")   # lm_head (+ final norm)
    logits = head(last_hidden_state)                                   # (..., V)
    embed = load_target_tensors(ckpt, ["embed"])["embed"]              # (V, H)

Only `model.embed_tokens.weight`, `lm_head.weight` and `model.norm.weight` are read, by looking them
up in `model.safetensors.index.json` (or a single `model.safetensors`) and opening just the files
that hold them with `safe_open`. Names may sit under a prefix (Kimi-K2.5 keeps its language model at
`language_model.`). With tied embeddings and no `lm_head.weight`, the embedding is the head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from eyas.errors import InvalidInput
from eyas.target import read_config as read_target_config

_NAMES = {
    "embed": "model.embed_tokens.weight",
    "lm_head": "lm_head.weight",
    "norm": "model.norm.weight",
}
_PREFIXES = ["", "language_model.", "model.language_model."]


def _weight_map(checkpoint: Path) -> dict[str, str]:
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = checkpoint / "model.safetensors"
    if single.exists():
        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise InvalidInput(
        f"{checkpoint}: neither model.safetensors.index.json nor model.safetensors found"
    )


def load_target_tensors(checkpoint: str | Path, which: list[str]) -> dict[str, torch.Tensor]:
    """Read some of "embed", "lm_head", "norm" from the checkpoint; only their files are opened."""
    checkpoint = Path(checkpoint)
    wmap = _weight_map(checkpoint)
    tied = read_target_config(checkpoint).get("tie_word_embeddings", False)
    found: dict[str, str] = {}
    for key in which:
        names = [p + _NAMES[key] for p in _PREFIXES]
        if key == "lm_head" and tied:
            names += [p + _NAMES["embed"] for p in _PREFIXES]
        name = next((n for n in names if n in wmap), None)
        if name is None:
            raise InvalidInput(
                f"{checkpoint}: no tensor {_NAMES[key]} (tried {names}) in the weight map"
            )
        found[key] = name
    out = {}
    for file in sorted({wmap[n] for n in found.values()}):
        with safe_open(str(checkpoint / file), framework="pt") as f:
            for key, name in found.items():
                if wmap[name] == file:
                    out[key] = f.get_tensor(name)
    return out


class TargetHead(nn.Module):
    """The target's output head over a stored last hidden state: [final RMSNorm] -> lm_head.

    `reorder(order)` permutes the head's rows once (training puts the draft vocabulary first, so one
    GEMM gives both the exact full-vocabulary argmax and the draft-vocabulary logits); `forward`
    always returns logits in target-id order.
    """

    def __init__(
        self, lm_head: torch.Tensor, norm: torch.Tensor | None, eps: float, dtype=torch.float32
    ):
        super().__init__()
        self.register_buffer("weight", lm_head.to(dtype))  # (V, H), rows in `order`
        self.register_buffer("norm_weight", None if norm is None else norm.float())  # (H,) or None
        self.register_buffer("order", None)  # (V,) target id of each row; None = identity
        self.eps = eps

    @classmethod
    def from_checkpoint(
        cls, checkpoint: str | Path, *, last_hidden_norm: str, dtype=torch.float32
    ) -> "TargetHead":
        """last_hidden_norm: "post" (stored states are already normed) or "pre" (apply the norm)."""
        if last_hidden_norm not in ("pre", "post"):
            raise InvalidInput(
                f"last_hidden_norm must be 'pre' or 'post', got {last_hidden_norm!r}"
            )
        pre = last_hidden_norm == "pre"
        t = load_target_tensors(checkpoint, ["lm_head", "norm"] if pre else ["lm_head"])
        eps = read_target_config(checkpoint).get("rms_norm_eps", 1e-6)
        return cls(t["lm_head"], t.get("norm"), eps, dtype)

    def reorder(self, order: torch.Tensor) -> "TargetHead":
        """Permute the rows: row i becomes target id order[i]."""
        self.weight = self.weight[order.to(self.weight.device)].contiguous()
        self.order = order.to(self.weight.device)
        return self

    def prepare(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) stored states -> the head's input, in the head's dtype (final norm in fp32 if
        pre)."""
        x = last_hidden.float()
        if self.norm_weight is not None:
            x = self.norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        return x.to(self.weight.dtype)

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        z = (self.prepare(last_hidden) @ self.weight.T).float()  # (..., V) rows in `order`
        if self.order is None:
            return z
        return torch.empty_like(z).index_copy_(-1, self.order, z)
