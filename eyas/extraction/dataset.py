"""The extraction as a whole on disk: the disk-space estimate and dataset.json.

    need = estimate_bytes(plans, hidden, 3, "bfloat16", "plain", out_dir)
    check_disk_space(out_dir, need, keep_free_gb=1)
    write_dataset_manifest(out_dir, manifests, plan_info)   # eyas/extraction/progress.py calls it

dataset.json (eyas-dataset/1) is written when every planned shard is on disk and confirmed in
this run, and removed when a new plan starts, so it exists exactly when the dataset is complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from eyas import __version__
from eyas.errors import EyasError, InvalidInput
from eyas.extraction.data import ShardPlan
from eyas.extraction.shards import ShardError, bytes_per_token, read_manifest
from eyas.files import write_json_atomic

DATASET_FORMAT = "eyas-dataset/1"
HEADER_BYTES = 64 * 1024  # a generous bound on a shard's safetensors header


class DiskSpaceError(EyasError, RuntimeError):
    """The output disk cannot hold the extraction; says how much is needed and how much is free."""


def dataset_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / "dataset.json"


def estimate_bytes(
    plans: list[ShardPlan],
    hidden_size: int,
    num_aux: int,
    dtype: str,
    encoding: str,
    output_dir: str | Path | None = None,
) -> int:
    """Bytes the shards still to be written will take (shards already on disk for the same plan,
    dtype and encoding are not counted)."""
    per_token = bytes_per_token(hidden_size, num_aux, dtype, encoding)
    total = 0
    for p in plans:
        if output_dir is not None and _on_disk(
            Path(output_dir) / f"{p.name}.safetensors", p, dtype, encoding
        ):
            continue
        total += p.num_tokens * per_token + 8 * (p.num_sequences + 1) + HEADER_BYTES
    return total


def _on_disk(path: Path, plan: ShardPlan, dtype: str, encoding: str) -> bool:
    try:
        m = read_manifest(path)
        return (
            path.stat().st_size == m["bytes"]
            and m.get("content_hash") == plan.content_hash
            and m.get("dtype") == dtype
            and m.get("encoding", "plain") == encoding
        )
    except (ShardError, OSError, KeyError):
        return False


def check_disk_space(
    output_dir: str | Path, needed_bytes: int, *, keep_free_gb: float
) -> dict[str, int]:
    """Refuse (DiskSpaceError) when the output disk lacks needed_bytes + keep_free_gb."""
    output_dir = Path(output_dir)
    probe = output_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    reserve = int(keep_free_gb * 1e9)
    if free < needed_bytes + reserve:
        raise DiskSpaceError(
            f"{output_dir}: extraction needs {needed_bytes / 1e9:.2f} GB more and must leave "
            f"extraction.keep_free_gb={keep_free_gb} GB free, but the disk has {free / 1e9:.2f} GB "
            f"free (short by {(needed_bytes + reserve - free) / 1e9:.2f} GB); free space, point "
            f"extraction.output_dir elsewhere, or use extraction.encoding: fp8_e4m3 (about half "
            f"the bytes)"
        )
    return {"needed_bytes": needed_bytes, "free_bytes": free, "reserve_bytes": reserve}


# ---------------------------------------------------------------------------------------------
# dataset.json
# ---------------------------------------------------------------------------------------------

# Fields every shard of one dataset must agree on; dataset.json carries them once.
_SHARED = (
    "format",
    "dtype",
    "encoding",
    "hidden_size",
    "num_aux_layers",
    "layer_ids",
    "layer_convention",
    "capture_ids",
    "layer_ids_capture_before",
    "layer_ids_output_of",
    "last_hidden_norm",
    "target_checkpoint",
    "target_revision",
    "backend",
    "patch_version",
    "tokenizer_sha256",
    "chat_template_sha256",
    "eyas_version",
)


def build_dataset_manifest(
    manifests: list[dict[str, Any]], plan_info: dict[str, Any] | None = None
) -> dict[str, Any]:
    """dataset.json from the shard manifests (in shard order); refuses shards that disagree."""
    if not manifests:
        raise InvalidInput("dataset manifest: no shards")
    shared = {}
    for key in _SHARED:
        values = {json.dumps(m.get(key), sort_keys=True) for m in manifests}
        if len(values) > 1:
            raise InvalidInput(f"dataset manifest: shards disagree on {key}: {sorted(values)}")
        shared[key] = manifests[0].get(key)
    out = {
        **shared,
        "format": DATASET_FORMAT,
        "shard_format": shared["format"],
        "eyas_version": shared.get("eyas_version") or __version__,
        "num_shards": len(manifests),
        "num_samples": sum(m["num_samples"] for m in manifests),
        "num_tokens": sum(m["num_tokens"] for m in manifests),
        "bytes": sum(m["bytes"] for m in manifests),
        "shards": [
            {
                k: m.get(k)
                for k in (
                    "file",
                    "sha256",
                    "bytes",
                    "num_samples",
                    "num_tokens",
                    "content_hash",
                    "cache_key",
                )
            }
            for m in manifests
        ],
    }
    out["bytes_per_token"] = round(out["bytes"] / max(out["num_tokens"], 1), 3)
    if any("fp8_error" in m for m in manifests):
        out["fp8_error"] = _merge_fp8([m["fp8_error"] for m in manifests if "fp8_error" in m])
    if plan_info:
        out["data"] = {
            k: plan_info.get(k) for k in ("data_path", "data_sha256", "stats") if k in plan_info
        }
    return out


def _merge_fp8(errors: list[dict]) -> dict:
    """Token-weighted RMS over shards, worst case of the maxima."""
    out = {}
    for part in ("aux", "last"):
        items = [e[part] for e in errors]
        tokens = sum(i["tokens"] for i in items) or 1
        rms = [
            (sum(i["rel_rms"][g] ** 2 * i["tokens"] for i in items) / tokens) ** 0.5
            for g in range(len(items[0]["rel_rms"]))
        ]
        out[part] = {
            "rel_rms": [round(v, 6) for v in rms],
            "max_token_rel": max(i["max_token_rel"] for i in items),
            "min_cosine": min(i["min_cosine"] for i in items),
            "tokens": tokens,
        }
    return out


def write_dataset_manifest(
    output_dir: str | Path, manifests: list[dict[str, Any]], plan_info: dict[str, Any] | None = None
) -> dict[str, Any]:
    obj = build_dataset_manifest(manifests, plan_info)
    write_json_atomic(dataset_path(output_dir), obj)
    return obj
