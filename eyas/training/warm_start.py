"""Warm start (training.init_from): a new run whose drafter begins as an earlier drafter.

    # an exported drafter folder, a checkpoint, or an output_dir
    source = init_source(cfg.init_from)
    # shapes and layers, each naming its config field
    problems = init_problems(source, dcfg, capture_ids)
    # weights in; optimizer, schedule and step start fresh
    load_init(model, source)

What is kept: every trainable weight and the draft vocabulary (d2t/t2d). The init's lm_head rows are
the logits of its d2t's tokens, so its vocabulary comes with it, even where the new shards would
count another one (train_drafter logs how much of their scored tokens it covers); a run that wants
the new data's vocabulary starts cold. What must match: the sizes (the target's hidden size and
vocabulary, the captured layers, the drafter's heads, head_dim, MLP width, draft_vocab_size). What
may differ: ttt_steps, the loss, the recipe, the data. docs/training.md "Warm start".
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eyas.errors import InvalidInput
from eyas.training.drafter import DrafterConfig

# DrafterConfig field -> the config field that sets it in this run (named in a refusal)
SIZE_FIELDS = MappingProxyType(
    {
        "hidden_size": "target.checkpoint (hidden_size)",
        "target_hidden_size": "target.checkpoint (hidden_size)",
        "num_aux": "target.layer_ids (layers captured)",
        "vocab_size": "target.checkpoint (vocab_size)",
        "draft_vocab_size": "training.draft_vocab_size",
        "num_attention_heads": "training.drafter.num_attention_heads",
        "num_key_value_heads": "training.drafter.num_key_value_heads",
        "head_dim": "training.drafter.head_dim",
        "intermediate_size": "training.drafter.intermediate_size",
    }
)


@dataclass(frozen=True)
class InitSource:
    path: Path  # the folder holding model.safetensors
    kind: str  # "drafter" (an export, SGLang's config.json) or "checkpoint" (drafter.json)
    drafter: DrafterConfig
    capture_ids: list[int]  # capture-before ids it was trained on


def drafter_config_from_sglang(meta: dict) -> DrafterConfig:
    """The DrafterConfig of an exported folder's config.json (LlamaForCausalLMEagle3)."""
    return DrafterConfig(
        hidden_size=meta["hidden_size"],
        target_hidden_size=meta.get("target_hidden_size", meta["hidden_size"]),
        num_attention_heads=meta["num_attention_heads"],
        num_key_value_heads=meta["num_key_value_heads"],
        head_dim=meta.get("head_dim") or meta["hidden_size"] // meta["num_attention_heads"],
        intermediate_size=meta["intermediate_size"],
        vocab_size=meta["vocab_size"],
        draft_vocab_size=meta["draft_vocab_size"],
        num_aux=len(meta["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        rms_norm_eps=meta["rms_norm_eps"],
        rope_theta=meta["rope_theta"],
        max_position_embeddings=meta["max_position_embeddings"],
    )


def init_source(path: str | Path, output_dir: str | Path | None = None) -> InitSource:
    """Read what init_from points at: an exported drafter folder, a checkpoint dir, or another run's
    training output_dir (its newest checkpoint). Raises ValueError naming training.init_from.

    Never inside this run's output_dir: checkpoints of another run there are set aside (and the
    set-aside ones replaced), so a warm start from them would vanish under a resume."""
    path = Path(path)
    if output_dir is not None and Path(output_dir).resolve() in [
        path.resolve(),
        *path.resolve().parents,
    ]:
        raise InvalidInput(
            f"training.init_from={path}: inside training.output_dir={output_dir}, "
            f"whose checkpoints "
            f"of another run are set aside when a warm start begins; point it at the exported "
            f"drafter (run_dir/drafter) or a copy outside training.output_dir"
        )
    if (path / "checkpoints").is_dir() and not (path / "model.safetensors").exists():
        found = sorted((path / "checkpoints").glob("step-[0-9]*"))
        path = found[-1] if found else path
    where = f"training.init_from={path}"
    if not (path / "model.safetensors").exists():
        raise InvalidInput(
            f"{where}: no model.safetensors there (expected an exported drafter folder, a training "
            f"checkpoint step-NNNNNN/ or a training output_dir); "
            f"{'it does not exist' if not path.exists() else 'nothing to start from'}"
        )
    if (path / "drafter.json").exists():
        info = json.loads((path / "drafter.json").read_text())
        return InitSource(
            path,
            "checkpoint",
            DrafterConfig(**info["drafter"]),
            list(info["target"]["capture_ids"]),
        )
    meta = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    if meta.get("architectures") != ["LlamaForCausalLMEagle3"]:
        raise InvalidInput(
            f"{where}: neither a training checkpoint (drafter.json) nor an exported "
            f"EAGLE-3 drafter (config.json architectures {meta.get('architectures')})"
        )
    return InitSource(
        path,
        "drafter",
        drafter_config_from_sglang(meta),
        list(meta["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
    )


def init_problems(source: InitSource, dcfg: DrafterConfig, capture_ids: list[int]) -> list[str]:
    """What keeps this run from starting as `source`: one line per differing size, naming the
    field."""
    where = f"training.init_from={source.path}"
    out = [
        f"{where}: {SIZE_FIELDS[f.name]} gives {f.name}={getattr(dcfg, f.name)} in this run, "
        f"{getattr(source.drafter, f.name)} in the {source.kind}"
        for f in fields(DrafterConfig)
        if f.name in SIZE_FIELDS and getattr(dcfg, f.name) != getattr(source.drafter, f.name)
    ]
    if list(capture_ids) != list(source.capture_ids):
        out.append(
            f"{where}: trained on capture layers {source.capture_ids}, target.layer_ids captures "
            f"{list(capture_ids)} in this run"
        )
    return out


def check_init(source: InitSource, dcfg: DrafterConfig, capture_ids: list[int]) -> None:
    problems = init_problems(source, dcfg, capture_ids)
    if problems:
        raise InvalidInput("cannot warm-start: " + "; ".join(problems))


def draft_vocab(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a drafter folder or checkpoint, without reading its other weights."""
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("d2t").long(), f.get_tensor("t2d").bool()


@torch.no_grad()
def load_init(model: torch.nn.Module, source: InitSource) -> None:
    """Copy the source's trainable weights (and d2t/t2d) into model, as float32; the embedding
    stays."""
    weights = load_file(str(source.path / "model.safetensors"))
    own = model.state_dict()
    missing = sorted(k for k in own if k != "embed_tokens.weight" and k not in weights)
    unexpected = sorted(k for k in weights if k not in own)
    if missing or unexpected:
        raise InvalidInput(
            f"training.init_from={source.path}: weights do not fit the drafter "
            f"(missing {missing}, unexpected {unexpected})"
        )
    for name, value in weights.items():
        if tuple(value.shape) != tuple(own[name].shape):
            raise InvalidInput(
                f"training.init_from={source.path}: {name} is {list(value.shape)}, this run's "
                f"drafter has {list(own[name].shape)}"
            )
        own[name].copy_(value.to(own[name].dtype))


def set_aside(output_dir: Path) -> Path:
    """Rename output_dir/checkpoints to checkpoints.previous (replacing an older one): a
    warm-started run never resumes, nor mixes its steps with, another run's checkpoints."""
    src, dst = Path(output_dir) / "checkpoints", Path(output_dir) / "checkpoints.previous"
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(src, dst)
    return dst
