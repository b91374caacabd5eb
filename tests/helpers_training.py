"""Helpers for the training-side tests: shards made of a real (random) target's hidden states."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from eyas.config import TargetConfig, TrainingConfig
from eyas.extraction.shards import Sample, write_shard

CAPTURE = [2, 4, 5]  # capture-before ids for the 8-layer random target


def target_config(checkpoint: Path, layer_ids=CAPTURE, convention="capture-before") -> TargetConfig:
    return TargetConfig(checkpoint=checkpoint, layer_ids=layer_ids, layer_convention=convention)


def shard_meta(layer_ids=CAPTURE, convention="capture-before", norm="post") -> dict:
    shift = 1 if convention == "output-of" else 0
    return {
        "layer_ids": list(layer_ids),
        "layer_convention": convention,
        "capture_ids": [i + shift for i in layer_ids],
        "last_hidden_norm": norm,
    }


@torch.no_grad()
def target_samples(
    checkpoint: Path,
    num: int,
    length: int,
    *,
    capture=CAPTURE,
    seed: int = 0,
    norm: str = "post",
    dtype=torch.bfloat16,
) -> list[Sample]:
    """Sequences the target wrote itself (sampled, temperature 1) with their real hidden states.

    The first quarter of each sequence is a random "prompt" (loss_mask 0), the rest is the reply.
    """
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoint), dtype=torch.float32
    ).eval()
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    ids = torch.randint(3, V, (num, length // 4), generator=g)
    while ids.shape[1] < length:  # sample a continuation from the target itself
        probs = torch.softmax(model(ids).logits[:, -1], dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    out = model(ids, output_hidden_states=True)
    last = out.hidden_states[-1]  # post-norm (HF ties it to last_hidden_state)
    if norm == "pre":
        last = _unnorm(model, ids)
    aux = torch.cat([out.hidden_states[i] for i in capture], dim=-1)
    mask = torch.zeros(num, length, dtype=torch.bool)
    mask[:, length // 4 :] = True
    return [Sample(ids[i], mask[i], aux[i].to(dtype), last[i].to(dtype)) for i in range(num)]


def _unnorm(model, ids):
    """The final hidden state before the last RMSNorm (what a pre-norm server would store)."""
    seen = {}
    h = model.model.norm.register_forward_hook(lambda m, inp, out: seen.setdefault("x", inp[0]))
    model(ids)
    h.remove()
    return seen["x"]


def sharpen_target(src: Path, dst: Path, factor: float = 40.0) -> Path:
    """A copy of the random target whose lm_head is scaled up: peaked next-token distributions.

    A random-init target is almost uniform over its vocab, which leaves a drafter nothing to learn.
    """
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    model.save_pretrained(dst, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the same tokenizer as its source
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, Path(dst) / name)
    return Path(dst)


def write_shards(
    checkpoint: Path,
    out_dir: Path,
    *,
    num_shards=2,
    per_shard=8,
    length=32,
    seed=0,
    meta: dict | None = None,
    norm: str = "post",
) -> list[Path]:
    samples = target_samples(checkpoint, num_shards * per_shard, length, seed=seed, norm=norm)
    paths = []
    for s in range(num_shards):
        p = Path(out_dir) / f"shard-{s:05d}.safetensors"
        write_shard(p, samples[s * per_shard : (s + 1) * per_shard], meta or shard_meta(norm=norm))
        paths.append(p)
    return paths


def training_config(out_dir: Path, **kw) -> TrainingConfig:
    """A small CPU run; keyword arguments override TrainingConfig fields (nested ones as dicts)."""
    # fp32: the tests that compare two ways of computing one step (resume, accumulation, ranks) hold
    # to rounding; the CPU's bf16 GEMMs (precision "bf16") have a test of their own (test_train.py)
    base = dict(
        output_dir=out_dir,
        draft_vocab_size=256,
        ttt_steps=3,
        max_steps=12,
        batch_size=4,
        lr=3e-3,
        warmup_steps=2,
        checkpoint_every=5,
        device="cpu",
        precision="fp32",
    )
    return TrainingConfig(**{**base, **kw})


def shift_left(x: torch.Tensor, s: int) -> torch.Tensor:
    """x[:, t + s] at position t, zeros past the end (B, T, ...)."""
    out = torch.zeros_like(x)
    out[:, : max(x.shape[1] - s, 0)] = x[:, s:]
    return out
