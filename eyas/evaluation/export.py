"""Export a trained drafter in the format SGLang's `LlamaForCausalLMEagle3` loads.

    export_drafter(result.checkpoint_dir, "runs/x/drafter", target=cfg.target, export=cfg.export,
                   shard_meta=manifests[0])
    drafter, d2t, meta = load_exported("runs/x/drafter")

The folder holds `config.json` (Llama format plus `draft_vocab_size`, `target_hidden_size` and
`eagle_config`) and `model.safetensors` with SGLang's names: `fc.weight`, `midlayer.*` (q/k/v and
gate/up kept separate: SGLang fuses them while loading), `norm.weight`, `lm_head.weight`, `d2t`
(int64) and `t2d` (bool). The embedding is left out: SGLang takes the target's, and so does
load_exported. SGLang silently skips weight names it does not know, so the names are checked here.

Layer ids are the silent killer (a drafter fed the wrong layers accepts almost nothing), so export
refuses when the shard manifest does not say which layers it captured, when the shards, the
training checkpoint and the target config disagree, or when the ids cannot be written so that
SGLang captures them: SGLang reads `eagle_aux_hidden_state_layer_ids` as capture-before ids, except
that a list starting with 1 is taken as output-of ids and shifted by +1.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from eyas.config import ExportConfig, TargetConfig
from eyas.draft_format import DrafterConfig, expected_weights, sglang_config
from eyas.dump import DTYPES
from eyas.errors import InvalidInput
from eyas.files import atomic_dir, sha256_file
from eyas.layers import CONVENTIONS, eagle_config_capture_ids, to_capture_before
from eyas.target import local_copy
from eyas.training.drafter import Eagle3Drafter
from eyas.training.target_head import load_target_tensors, read_target_config
from eyas.training.warm_start import drafter_config_from_sglang


def _shard_capture_ids(shard_meta: dict) -> list[int]:
    ids, conv = shard_meta.get("layer_ids"), shard_meta.get("layer_convention")
    if ids is None or conv is None:
        raise InvalidInput(
            "refusing to export: the shard manifest does not record layer_ids and "
            f"layer_convention (got layer_ids={ids!r}, layer_convention={conv!r}), so the "
            "layers the drafter was trained on cannot be checked"
        )
    if conv not in CONVENTIONS:
        raise InvalidInput(
            f"refusing to export: unknown layer_convention {conv!r} in the shard manifest"
        )
    capture = to_capture_before(ids, conv)
    if "capture_ids" in shard_meta and list(shard_meta["capture_ids"]) != capture:
        raise InvalidInput(
            f"refusing to export: the shard manifest contradicts itself: layer_ids {ids} "
            f"({conv}) but capture_ids {shard_meta['capture_ids']}"
        )
    return capture


def check_layer_ids(
    target: TargetConfig,
    shard_meta: dict,
    trained: dict | None = None,
    num_target_layers: int | None = None,
) -> list[int]:
    """The capture-before ids to write into eagle_config, after every consistency check."""
    capture = target.capture_ids()
    shards = _shard_capture_ids(shard_meta)
    if shards != capture:
        raise InvalidInput(
            f"refusing to export: the shards were captured at layers {shards} (capture-before) "
            f"but target.layer_ids {target.layer_ids} ({target.layer_convention}) means {capture}"
        )
    if trained is not None and trained.get("capture_ids") != capture:
        raise InvalidInput(
            f"refusing to export: the checkpoint was trained on capture layers "
            f"{trained.get('capture_ids')}, the config says {capture}"
        )
    if len(capture) != 3:
        raise InvalidInput(
            f"refusing to export: SGLang's EAGLE-3 drafter fuses exactly 3 layers, got {capture}"
        )
    read = eagle_config_capture_ids(capture)
    if read != capture:
        raise InvalidInput(
            f"refusing to export: capture-before ids {capture} start with 1, which SGLang "
            f"reads as output-of ids and shifts to {read}; choose layers "
            f"whose first capture id is not 1"
        )
    if num_target_layers is not None and capture[-1] >= num_target_layers:
        raise InvalidInput(
            f"refusing to export: capture id {capture[-1]} is not the input of any of the "
            f"target's {num_target_layers} layers (SGLang cannot capture the last layer's output)"
        )
    return capture


def _resolve_checkpoint(source) -> Path:
    path = Path(getattr(source, "checkpoint_dir", source))
    if not (path / "drafter.json").exists() and (path / "checkpoints").is_dir():
        found = sorted((path / "checkpoints").glob("step-[0-9]*"))
        if found:
            path = found[-1]
    if not (path / "drafter.json").exists() or not (path / "model.safetensors").exists():
        raise InvalidInput(f"{path}: not a training checkpoint (drafter.json, model.safetensors)")
    return path


def export_drafter(
    checkpoint, out_dir: str | Path, *, target: TargetConfig, export: ExportConfig, shard_meta: dict
) -> Path:
    """Write the SGLang drafter folder from a checkpoint dir (or TrainResult); returns out_dir."""
    ckpt = _resolve_checkpoint(checkpoint)
    info = json.loads((ckpt / "drafter.json").read_text())
    dcfg = DrafterConfig(**info["drafter"])
    try:
        tcfg = read_target_config(local_copy(target))  # target.local_dir: this machine's copy
    except ValueError:
        tcfg = {}  # no copy of the target's config here: skip the target-side checks
    capture = check_layer_ids(target, shard_meta, info.get("target"), tcfg.get("num_hidden_layers"))
    if tcfg and (tcfg["hidden_size"], tcfg["vocab_size"]) != (
        dcfg.target_hidden_size,
        dcfg.vocab_size,
    ):
        raise InvalidInput(
            f"refusing to export: the drafter was trained for hidden/vocab "
            f"{dcfg.target_hidden_size}/{dcfg.vocab_size}, {local_copy(target)} has "
            f"{tcfg['hidden_size']}/{tcfg['vocab_size']}"
        )
    dtype = DTYPES[export.dtype]
    weights = load_file(str(ckpt / "model.safetensors"))
    tensors = {}
    for name, (shape, fixed) in expected_weights(dcfg).items():
        if name not in weights or list(weights[name].shape) != shape:
            got = list(weights[name].shape) if name in weights else "missing"
            raise InvalidInput(f"{ckpt}: weight {name} is {got}, expected {shape}")
        tensors[name] = weights[name].to(fixed or dtype).contiguous()
    config = sglang_config(
        dcfg,
        capture,
        export.dtype,
        provenance={
            "target_checkpoint": str(target.checkpoint),
            "target_revision": target.revision,
            "layer_ids": target.layer_ids,
            "layer_convention": target.layer_convention,
            "capture_ids": capture,
            "last_hidden_norm": shard_meta.get("last_hidden_norm"),
            "trained_checkpoint": str(ckpt),
        },
    )
    return _write_dir_atomic(Path(out_dir), config, tensors)


def _write_dir_atomic(out_dir: Path, config: dict, tensors: dict) -> Path:
    """Build the folder beside out_dir, then swap it in (the old one is removed after the swap)."""
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def drafter_digest(drafter_dir: str | Path) -> str:
    """sha256 over an exported drafter's files (config.json, then model.safetensors): its
    identity."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update(name.encode() + b"\0" + bytes.fromhex(sha256_file(Path(drafter_dir) / name)))
    return h.hexdigest()


def load_exported(drafter_dir: str | Path, *, target_checkpoint: str | Path | None = None):
    """Rebuild the drafter from an export folder -> (Eagle3Drafter float32 eval, d2t, config dict).

    The frozen embedding comes from the target checkpoint (recorded in config.json unless given).
    """
    drafter_dir = Path(drafter_dir)
    meta = json.loads((drafter_dir / "config.json").read_text())
    if meta.get("architectures") != ["LlamaForCausalLMEagle3"]:
        raise InvalidInput(
            f"{drafter_dir}: not an EAGLE-3 drafter (architectures {meta.get('architectures')})"
        )
    dcfg = drafter_config_from_sglang(meta)
    weights = load_file(str(drafter_dir / "model.safetensors"))
    expected = expected_weights(dcfg)
    if set(weights) != set(expected):
        raise InvalidInput(
            f"{drafter_dir}: weight names differ from SGLang's: missing "
            f"{sorted(set(expected) - set(weights))}, unexpected "
            f"{sorted(set(weights) - set(expected))}"
        )
    model = Eagle3Drafter(dcfg)
    state = {k: (v if k in ("d2t", "t2d") else v.float()) for k, v in weights.items()}
    ckpt = target_checkpoint or meta.get("eyas", {}).get("target_checkpoint")
    if ckpt is None:
        raise InvalidInput(f"{drafter_dir}: no target checkpoint recorded; pass target_checkpoint=")
    state["embed_tokens.weight"] = load_target_tensors(ckpt, ["embed"])["embed"].float()
    model.load_state_dict(state, strict=True)
    return model.eval(), model.d2t.clone(), meta
