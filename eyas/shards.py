"""Hidden-state shard files: the contract between extraction and training (docs/data-format.md).

One shard = one safetensors file holding its samples concatenated, plus a JSON manifest beside it:

    shard-00003.safetensors   input_ids int32 [T], loss_mask uint8 [T],
                              aux_hidden_states [T, K*H], last_hidden_state [T, H],
                              offsets int64 [N+1]  (sample i = rows offsets[i]:offsets[i+1])
    shard-00003.json          counts, bytes, sha256, layer ids and conventions, provenance

The writer knows every sample's length up front (the token ids are known before the target runs),
so it lays out the file once and streams each sample into its place as it arrives, in any order:
memory stays bounded by one sample. The file only gets its final name once complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open

FORMAT = "eyas-shard/1"

_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
              torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ShardError(ValueError):
    """A shard file that is missing, truncated, or does not match its manifest."""


@dataclass
class Sample:
    input_ids: torch.Tensor  # (n,) int
    loss_mask: torch.Tensor  # (n,) bool
    aux_hidden_states: torch.Tensor  # (n, K*H)
    last_hidden_state: torch.Tensor  # (n, H)

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def manifest_path(shard_path: str | Path) -> Path:
    return Path(shard_path).with_suffix(".json")


class ShardWriter:
    """Streams samples into a pre-laid-out safetensors file; close() publishes it atomically."""

    def __init__(self, path: str | Path, lengths: list[int], *, hidden_size: int, num_aux: int,
                 dtype: torch.dtype, meta: dict[str, Any]):
        if not lengths or min(lengths) <= 0:
            raise ValueError(f"{path}: every sample needs at least one token, got lengths {lengths[:8]}...")
        self.path, self.lengths, self.dtype, self.meta = Path(path), lengths, dtype, meta
        self.hidden_size, self.num_aux = hidden_size, num_aux
        self.offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        num_tokens = int(self.offsets[-1])
        item = torch.tensor([], dtype=dtype).element_size()
        # name -> (safetensors dtype, shape, bytes per row); the order is the order on disk.
        self._layout = [
            ("aux_hidden_states", _ST_DTYPES[dtype], [num_tokens, num_aux * hidden_size], num_aux * hidden_size * item),
            ("last_hidden_state", _ST_DTYPES[dtype], [num_tokens, hidden_size], hidden_size * item),
            ("input_ids", "I32", [num_tokens], 4),
            ("loss_mask", "U8", [num_tokens], 1),
            ("offsets", "I64", [len(lengths) + 1], None),
        ]
        header, begin = {}, 0
        self._base: dict[str, int] = {}
        for name, st_dtype, shape, _ in self._layout:
            size = (len(lengths) + 1) * 8 if name == "offsets" else shape[0] * (self._row_bytes(name))
            header[name] = {"dtype": st_dtype, "shape": shape, "data_offsets": [begin, begin + size]}
            self._base[name] = begin
            begin += size
        header["__metadata__"] = {"eyas": json.dumps({"format": FORMAT, **meta}, sort_keys=True)}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # safetensors aligns the data buffer to 8 bytes
        self._data_start = 8 + len(blob)
        self.total_bytes = self._data_start + begin
        self._tmp = self.path.with_name(f".{self.path.name}.partial")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self._tmp, "w+b")
        self._f.write(struct.pack("<Q", len(blob)) + blob)
        self._f.truncate(self.total_bytes)
        self._write("offsets", 0, self.offsets)
        self._done = [False] * len(lengths)

    def _row_bytes(self, name: str) -> int:
        return next(rb for n, _, _, rb in self._layout if n == name)

    def _write(self, name: str, row: int, t: torch.Tensor) -> None:
        rb = 8 if name == "offsets" else self._row_bytes(name)
        self._f.seek(self._data_start + self._base[name] + row * rb)
        self._f.write(t.contiguous().view(torch.uint8).numpy().tobytes())

    def put(self, i: int, s: Sample) -> None:
        """Write sample i (any order); its shapes must match the planned length."""
        n, H, K = self.lengths[i], self.hidden_size, self.num_aux
        if len(s) != n or s.aux_hidden_states.shape != (n, K * H) or s.last_hidden_state.shape != (n, H):
            raise ShardError(f"{self.path}: sample {i} has shapes ids {tuple(s.input_ids.shape)}, aux "
                             f"{tuple(s.aux_hidden_states.shape)}, last {tuple(s.last_hidden_state.shape)}; "
                             f"expected n={n}, H={H}, K={K}")
        row = int(self.offsets[i])
        self._write("aux_hidden_states", row, s.aux_hidden_states.to(self.dtype))
        self._write("last_hidden_state", row, s.last_hidden_state.to(self.dtype))
        self._write("input_ids", row, s.input_ids.to(torch.int32))
        self._write("loss_mask", row, s.loss_mask.to(torch.uint8))
        self._done[i] = True

    def close(self) -> dict[str, Any]:
        """Publish the file and its manifest; refuses if any sample is missing."""
        missing = [i for i, d in enumerate(self._done) if not d]
        if missing:
            self.abort()
            raise ShardError(f"{self.path}: {len(missing)} sample(s) never written, e.g. {missing[:5]}")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        manifest = {
            "format": FORMAT, "file": self.path.name, "num_samples": len(self.lengths),
            "num_tokens": int(self.offsets[-1]), "bytes": self.total_bytes,
            "sha256": _sha256(self._tmp), "dtype": _dtype_name(self.dtype),
            "hidden_size": self.hidden_size, "num_aux_layers": self.num_aux, **self.meta,
        }
        os.replace(self._tmp, self.path)
        write_json_atomic(manifest_path(self.path), manifest)
        return manifest

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self._tmp.unlink(missing_ok=True)


def write_shard(path: str | Path, samples: Iterable[Sample], meta: dict[str, Any]) -> dict[str, Any]:
    """Write a whole shard from in-memory samples (tests, small jobs); returns the manifest."""
    samples = list(samples)
    first = samples[0]
    H = first.last_hidden_state.shape[1]
    w = ShardWriter(path, [len(s) for s in samples], hidden_size=H,
                    num_aux=first.aux_hidden_states.shape[1] // H, dtype=first.aux_hidden_states.dtype,
                    meta=meta)
    for i, s in enumerate(samples):
        w.put(i, s)
    return w.close()


class ShardReader:
    """Reads samples of one shard by slicing the memory-mapped file (bounded memory)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise ShardError(f"{self.path}: shard file not found")
        try:
            self._f = safe_open(str(self.path), framework="pt")
        except Exception as e:  # noqa: BLE001 - any parse failure means a damaged file
            raise ShardError(f"{self.path}: not a readable safetensors file ({e})") from e
        self.meta = json.loads(self._f.metadata()["eyas"])
        self.offsets = self._f.get_tensor("offsets")
        self.num_tokens = int(self.offsets[-1])
        self.hidden_size = self._f.get_slice("last_hidden_state").get_shape()[1]
        self.num_aux = self._f.get_slice("aux_hidden_states").get_shape()[1] // self.hidden_size

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    def sample(self, i: int) -> Sample:
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: sample {i} out of range 0..{len(self) - 1}")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Sample(
            input_ids=self._f.get_slice("input_ids")[a:b].long(),
            loss_mask=self._f.get_slice("loss_mask")[a:b].bool(),
            aux_hidden_states=self._f.get_slice("aux_hidden_states")[a:b],
            last_hidden_state=self._f.get_slice("last_hidden_state")[a:b],
        )

    def __iter__(self):
        return (self.sample(i) for i in range(len(self)))


def verify_shard(path: str | Path, *, full: bool = True) -> dict[str, Any]:
    """Check a shard against its manifest (size always; sha256 when full); returns the manifest."""
    path, mpath = Path(path), manifest_path(path)
    if not path.exists() or not mpath.exists():
        raise ShardError(f"{path}: shard or manifest missing")
    manifest = json.loads(mpath.read_text())
    size = path.stat().st_size
    if size != manifest["bytes"]:
        raise ShardError(f"{path}: {size} bytes on disk, manifest says {manifest['bytes']} (truncated?)")
    if full and _sha256(path) != manifest["sha256"]:
        raise ShardError(f"{path}: sha256 differs from the manifest (corrupted)")
    return manifest


def write_json_atomic(path: str | Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)
