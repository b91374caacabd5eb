"""Writing and reading a model folder in Hugging Face layout: sharded safetensors plus an index.

    with atomic_dir(out) as tmp: ...                 # eyas/files.py: whole or not at all
    index = write_shards(tensors, tmp, num_shards=8)   # model-0000k-of-0000N.safetensors + index

Used by the tiny-target build (eyas/local/tiny_target.py, whose save_hf_folder adds the tokenizer
and chat template); kept apart because it is about files, not the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

from eyas.errors import InvalidInput


def plan_shards(sizes: list[int], num_shards: int) -> list[int]:
    """Shard index of each tensor: contiguous runs of about equal bytes, exactly num_shards of
    them."""
    if not 1 <= num_shards <= len(sizes):
        raise InvalidInput(
            f"num_shards must be between 1 and the number of tensors ({len(sizes)}), "
            f"got {num_shards}"
        )
    target, shard, seen, plan = sum(sizes) / num_shards, 0, 0, []
    for i, size in enumerate(sizes):
        opened_all = shard == num_shards - 1
        must_open = (
            len(sizes) - i == num_shards - shard - 1
        )  # one tensor left for each unopened shard
        if i > 0 and not opened_all and (seen >= target * (shard + 1) or must_open):
            shard += 1
        plan.append(shard)
        seen += size
    return plan


def write_shards(
    tensors: dict[str, torch.Tensor], folder: Path, num_shards: int, prefix: str = "model"
) -> dict:
    """Write `tensors` as {prefix}-0000k-of-0000N.safetensors plus
    {prefix}.safetensors.index.json."""
    names = list(tensors)
    plan = plan_shards([tensors[n].numel() * tensors[n].element_size() for n in names], num_shards)
    files = [f"{prefix}-{k + 1:05d}-of-{num_shards:05d}.safetensors" for k in range(num_shards)]
    for k, file in enumerate(files):
        part = {n: tensors[n].contiguous() for n, shard in zip(names, plan) if shard == k}
        save_file(part, str(folder / file), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": {n: files[shard] for n, shard in zip(names, plan)},
    }
    (folder / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def read_shards(folder: Path, prefix: str = "model") -> dict[str, torch.Tensor]:
    index = json.loads((Path(folder) / f"{prefix}.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(Path(folder) / file)))
    if set(tensors) != set(index["weight_map"]):
        raise InvalidInput(
            f"{folder}: shards and {prefix}.safetensors.index.json disagree on tensor names"
        )
    return tensors


def checkpoint_tensors(model: DeepseekV3ForCausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's weights under DeepSeek-V3's own checkpoint names: transformers keeps each layer's
    experts stacked (experts.gate_up_proj (E, 2I, H), experts.down_proj (E, H, I)), while real
    checkpoints, and SGLang, name each expert's gate_proj, up_proj and down_proj apart."""
    tensors = {}
    for name, value in model.state_dict().items():
        # The router's bias stays fp32, as in DeepSeek-V3's release (transformers keeps it fp32
        # too).
        value = value if "e_score_correction_bias" in name else value.to(dtype)
        if name.endswith("experts.gate_up_proj"):
            stem, inner = name.removesuffix("gate_up_proj"), value.shape[1] // 2
            for e in range(value.shape[0]):
                tensors[f"{stem}{e}.gate_proj.weight"] = value[e, :inner].clone()  # (I, H)
                tensors[f"{stem}{e}.up_proj.weight"] = value[e, inner:].clone()  # (I, H)
        elif name.endswith("experts.down_proj"):
            for e in range(value.shape[0]):
                tensors[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = value[
                    e
                ].clone()  # (H, I)
        else:
            tensors[name] = value
    return tensors
