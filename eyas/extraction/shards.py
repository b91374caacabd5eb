"""Hidden-state shard files: the contract between extraction and training (docs/data-format.md).

One shard = one safetensors file holding its samples concatenated, plus a JSON manifest beside it:

    shard-00003.safetensors   aux_hidden_states [T, K*H], last_hidden_state [T, H],
                              input_ids int32 [T], loss_mask uint8 [T],
                              offsets int64 [N+1]  (sample i = rows offsets[i]:offsets[i+1])
    shard-00003.json          counts, bytes, sha256, layer ids and conventions, provenance

With `encoding="fp8_e4m3"` the hidden states are stored as e4m3 with one float32 scale per token and
layer (`aux_hidden_states_fp8` + `aux_hidden_states_scale [T, K]`, `last_hidden_state_fp8` +
`last_hidden_state_scale [T, 1]`); ShardReader returns them dequantized to bf16, so training code
never sees the difference. The names differ on purpose: a reader that does not know the encoding
fails on a missing tensor instead of reading unscaled values.

The writer knows every sample's length up front (the token ids are known before the target runs),
so it lays out the file once and writes each sample (or each chunk of one) into its place as it
arrives, in any order and from several threads (positioned writes): memory stays bounded by the
samples being written. The file only gets its final name once complete.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open

from eyas.dump import DTYPES, dtype_name, encode_header
from eyas.errors import EyasError, InvalidInput
from eyas.extraction import fp8
from eyas.files import DiskFull, disk_full, fsync_dir, is_disk_full, sha256_file, write_json_atomic

FORMAT = "eyas-shard/1"
ENCODINGS = ("plain", "fp8_e4m3")


class ShardError(EyasError, ValueError):
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


def partial_path(shard_path: str | Path) -> Path:
    """Where a shard is written before it is complete (a dot-name: never mistaken for a shard)."""
    p = Path(shard_path)
    return p.with_name(f".{p.name}.partial")


def bytes_per_token(
    hidden_size: int, num_aux: int, dtype: str = "bfloat16", encoding: str = "plain"
) -> int:
    """Bytes one token takes in a shard (without the header and the 8-byte offset per sample)."""
    if encoding == "fp8_e4m3":
        return (num_aux + 1) * (hidden_size + 4) + 4 + 1
    item = DTYPES[dtype].itemsize
    return (num_aux + 1) * hidden_size * item + 4 + 1


def _layout(
    encoding: str, dtype: torch.dtype, T: int, N: int, H: int, K: int
) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) in the order the tensors lie in the file."""
    if encoding == "fp8_e4m3":
        hidden = [
            ("aux_hidden_states_fp8", fp8.E4M3, [T, K * H]),
            ("aux_hidden_states_scale", torch.float32, [T, K]),
            ("last_hidden_state_fp8", fp8.E4M3, [T, H]),
            ("last_hidden_state_scale", torch.float32, [T, 1]),
        ]
    else:
        hidden = [
            ("aux_hidden_states", dtype, [T, K * H]),
            ("last_hidden_state", dtype, [T, H]),
        ]
    return hidden + [
        ("input_ids", torch.int32, [T]),
        ("loss_mask", torch.uint8, [T]),
        ("offsets", torch.int64, [N + 1]),
    ]


def _pwrite_all(fd: int, buf, offset: int) -> None:
    view = memoryview(buf).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _check_plan(path: str | Path, lengths: list[int], encoding: str) -> None:
    if not lengths or min(lengths) <= 0:
        raise InvalidInput(
            f"{path}: every sample needs at least one token, got lengths {lengths[:8]}..."
        )
    if encoding not in ENCODINGS:
        raise InvalidInput(f"{path}: encoding must be one of {ENCODINGS}, got {encoding!r}")


class ShardWriter:
    """Writes samples into a pre-laid-out safetensors file; close() publishes it atomically.

    `put(i, sample)` writes a whole sample, `put_rows(i, start, ...)` a chunk of one; both may be
    called from several threads at once. Every sample must be fully covered before close().
    A full disk raises DiskFull (naming the shard, its folder and the free bytes) with the partial
    file already removed; every later write raises it again.
    """

    def __init__(
        self,
        path: str | Path,
        lengths: list[int],
        *,
        hidden_size: int,
        num_aux: int,
        dtype: torch.dtype,
        meta: dict[str, Any],
        encoding: str = "plain",
    ):
        _check_plan(path, lengths, encoding)
        # FP8 shards record the dtype readers get back (bf16), whatever the dump's precision was.
        dtype = torch.bfloat16 if encoding == "fp8_e4m3" else dtype
        self.path, self.lengths, self.dtype, self.meta = Path(path), lengths, dtype, meta
        self.hidden_size, self.num_aux, self.encoding = hidden_size, num_aux, encoding
        self.offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        T, N = int(self.offsets[-1]), len(lengths)
        file_meta = {"format": FORMAT, **meta}
        if encoding != "plain":
            file_meta["encoding"] = encoding
        head, self._header = encode_header(
            _layout(encoding, dtype, T, N, hidden_size, num_aux),
            {"eyas": json.dumps(file_meta, sort_keys=True)},
        )
        self.total_bytes = self._header.file_size
        self._tmp = partial_path(self.path)
        self._failed: DiskFull | None = None
        self._create(head)
        self._lock = threading.Lock()
        self._covered = [0] * N
        self._closed = False
        self.fp8_error = (
            (fp8.Fp8Error(num_aux), fp8.Fp8Error(1)) if encoding == "fp8_e4m3" else None
        )

    def _create(self, head: bytes) -> None:
        """Open the partial file and lay it out: the header and the offsets written, the rest
        sparse (the space is taken as samples arrive). On any failure nothing is left behind."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise (disk_full(self.path, e) if is_disk_full(e) else e) from None
        try:
            _pwrite_all(self._fd, head, 0)
            os.ftruncate(self._fd, self.total_bytes)
            self._write("offsets", 0, self.offsets)
        except BaseException as e:
            os.close(self._fd)
            self._tmp.unlink(missing_ok=True)
            if is_disk_full(e) and not isinstance(e, DiskFull):
                raise disk_full(self.path, e) from e
            raise

    def _write(self, name: str, row: int, t: torch.Tensor) -> None:
        if self._failed is not None:
            raise self._failed
        entry = self._header.tensors[name]
        arr = t.contiguous().view(torch.uint8).numpy()
        try:
            _pwrite_all(self._fd, arr, entry.start + row * entry.row_bytes)
        except OSError as e:
            if not is_disk_full(e):
                raise
            self._failed = self._failed or disk_full(self.path, e)
            # Unlinked now (other threads may still write to the open file); abort() closes it
            self._tmp.unlink(missing_ok=True)
            raise self._failed from e

    def put(self, i: int, s: Sample) -> None:
        """Write sample i whole (any order); its shapes must match the planned length."""
        if len(s) != self.lengths[i]:
            raise ShardError(
                f"{self.path}: sample {i} has {len(s)} tokens, planned {self.lengths[i]}"
            )
        self.put_rows(i, 0, s.input_ids, s.loss_mask, s.aux_hidden_states, s.last_hidden_state)

    def put_rows(
        self,
        i: int,
        start: int,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        aux: torch.Tensor,
        last: torch.Tensor,
    ) -> None:
        """Write rows start..start+n-1 of sample i: ids [n], mask [n], aux [n, K*H], last [n, H]."""
        n, H, K = input_ids.shape[0], self.hidden_size, self.num_aux
        if (
            not 0 <= i < len(self.lengths)
            or start < 0
            or start + n > self.lengths[i]
            or tuple(aux.shape) != (n, K * H)
            or tuple(last.shape) != (n, H)
            or loss_mask.shape[0] != n
        ):
            raise ShardError(
                f"{self.path}: sample {i} rows {start}..{start + n - 1}: shapes ids "
                f"{tuple(input_ids.shape)}, aux {tuple(aux.shape)}, last {tuple(last.shape)}; "
                f"expected a slice of the planned "
                f"{self.lengths[i] if 0 <= i < len(self.lengths) else '?'} tokens with H={H}, K={K}"
            )
        row = int(self.offsets[i]) + start
        if self.encoding == "fp8_e4m3":
            qa, sa = fp8.quantize(aux, K)
            ql, sl = fp8.quantize(last, 1)
            self._write("aux_hidden_states_fp8", row, qa)
            self._write("aux_hidden_states_scale", row, sa)
            self._write("last_hidden_state_fp8", row, ql)
            self._write("last_hidden_state_scale", row, sl)
            err_a, err_l = fp8.Fp8Error(K), fp8.Fp8Error(1)
            err_a.add(aux, qa, sa)
            err_l.add(last, ql, sl)
        else:
            self._write("aux_hidden_states", row, aux.to(self.dtype))
            self._write("last_hidden_state", row, last.to(self.dtype))
        self._write("input_ids", row, input_ids.to(torch.int32))
        self._write("loss_mask", row, loss_mask.to(torch.uint8))
        with self._lock:
            self._covered[i] += n
            if self._covered[i] > self.lengths[i]:
                raise ShardError(
                    f"{self.path}: sample {i} written twice ({self._covered[i]} rows for "
                    f"{self.lengths[i]} tokens)"
                )
            if self.fp8_error is not None:
                self.fp8_error[0].merge(err_a)
                self.fp8_error[1].merge(err_l)

    def close(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Publish the file and its manifest (plus `extra` fields); refuses if any sample is
        incomplete."""
        missing = [i for i, (c, n) in enumerate(zip(self._covered, self.lengths)) if c != n]
        if missing:
            self.abort()
            raise ShardError(
                f"{self.path}: {len(missing)} sample(s) never written, e.g. {missing[:5]}"
            )
        try:
            os.fsync(self._fd)  # a network filesystem may report a full disk only here
        except OSError as e:
            self.abort()
            raise (disk_full(self.path, e) if is_disk_full(e) else e) from e
        os.close(self._fd)
        self._closed = True
        manifest = {
            "format": FORMAT,
            "file": self.path.name,
            "num_samples": len(self.lengths),
            "num_tokens": int(self.offsets[-1]),
            "bytes": self.total_bytes,
            "sha256": sha256_file(self._tmp),
            "dtype": dtype_name(self.dtype),
            "encoding": self.encoding,
            "hidden_size": self.hidden_size,
            "num_aux_layers": self.num_aux,
            **self.meta,
        }
        if self.fp8_error is not None:
            manifest["fp8_error"] = {
                "aux": self.fp8_error[0].summary(),
                "last": self.fp8_error[1].summary(),
            }
        manifest.update(extra or {})
        os.replace(self._tmp, self.path)
        fsync_dir(self.path.parent)
        try:
            write_json_atomic(manifest_path(self.path), manifest)
        except BaseException:
            self.path.unlink(
                missing_ok=True
            )  # a shard without its manifest would only be extracted again
            raise
        return manifest

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)
        self._tmp.unlink(missing_ok=True)


def write_shard(
    path: str | Path, samples: Iterable[Sample], meta: dict[str, Any], encoding: str = "plain"
) -> dict[str, Any]:
    """Write a whole shard from in-memory samples (tests, small jobs); returns the manifest."""
    samples = list(samples)
    first = samples[0]
    H = first.last_hidden_state.shape[1]
    dtype = first.aux_hidden_states.dtype if encoding == "plain" else torch.bfloat16
    w = ShardWriter(
        path,
        [len(s) for s in samples],
        hidden_size=H,
        num_aux=first.aux_hidden_states.shape[1] // H,
        dtype=dtype,
        meta=meta,
        encoding=encoding,
    )
    for i, s in enumerate(samples):
        w.put(i, s)
    return w.close()


class ShardReader:
    """Reads samples of one shard by slicing the memory-mapped file (bounded memory).

    FP8 shards come back dequantized to `dtype` (bf16 by default); plain shards in their stored
    dtype.
    """

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.bfloat16):
        self.path = Path(path)
        if not self.path.exists():
            raise ShardError(f"{self.path}: shard file not found")
        try:
            self._f = safe_open(str(self.path), framework="pt")
            self.meta = json.loads(self._f.metadata()["eyas"])
        except Exception as e:  # noqa: BLE001 - any parse failure means a damaged file
            raise ShardError(f"{self.path}: not a readable safetensors file ({e})") from e
        self.encoding = self.meta.get("encoding", "plain")
        if self.encoding not in ENCODINGS:
            raise ShardError(
                f"{self.path}: unknown encoding {self.encoding!r} (this eyas reads {ENCODINGS})"
            )
        self.dtype = dtype
        suffix = "_fp8" if self.encoding == "fp8_e4m3" else ""
        self._aux, self._last = f"aux_hidden_states{suffix}", f"last_hidden_state{suffix}"
        self.offsets = self._f.get_tensor("offsets")
        self.num_tokens = int(self.offsets[-1])
        self.hidden_size = self._f.get_slice(self._last).get_shape()[1]
        self.num_aux = self._f.get_slice(self._aux).get_shape()[1] // self.hidden_size

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    def sample(self, i: int) -> Sample:
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: sample {i} out of range 0..{len(self) - 1}")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        aux, last = self._f.get_slice(self._aux)[a:b], self._f.get_slice(self._last)[a:b]
        if self.encoding == "fp8_e4m3":
            aux = fp8.dequantize(aux, self._f.get_slice("aux_hidden_states_scale")[a:b], self.dtype)
            last = fp8.dequantize(
                last, self._f.get_slice("last_hidden_state_scale")[a:b], self.dtype
            )
        return Sample(
            input_ids=self._f.get_slice("input_ids")[a:b].long(),
            loss_mask=self._f.get_slice("loss_mask")[a:b].bool(),
            aux_hidden_states=aux,
            last_hidden_state=last,
        )

    def __iter__(self):
        return (self.sample(i) for i in range(len(self)))


@dataclass(frozen=True)
class ShardManifest:
    """A shard's manifest as tasks and flows pass it; `to_json()` is the file shard-NNNNN.json.

    `meta` holds the rest of that file: layer ids and their conventions, provenance, the cache key,
    seconds, fp8_error. `reused` is this run's, never written: the shard was found intact on
    disk."""

    file: str
    num_samples: int
    num_tokens: int
    bytes: int
    sha256: str
    dtype: str
    encoding: str
    hidden_size: int
    num_aux_layers: int
    meta: dict[str, Any] = field(default_factory=dict)
    reused: bool = False

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, reused: bool = False) -> ShardManifest:
        """The manifest a shard file's JSON holds (ShardError naming the fields it lacks)."""
        core = [f.name for f in fields(cls) if f.name not in ("meta", "reused")]
        missing = [k for k in core if k not in obj]
        if missing:
            raise ShardError(f"{obj.get('file', 'a shard')}: manifest lacks {missing}")
        return cls(
            **{k: obj[k] for k in core},
            meta={k: v for k, v in obj.items() if k not in core},
            reused=reused,
        )

    def to_json(self) -> dict[str, Any]:
        core = {
            f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("meta", "reused")
        }
        return {**self.meta, **core}


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest beside a shard file (ShardError if missing or not JSON)."""
    mpath = manifest_path(path)
    try:
        return json.loads(mpath.read_text())
    except FileNotFoundError:
        raise ShardError(f"{path}: manifest {mpath.name} missing") from None
    except json.JSONDecodeError as e:
        raise ShardError(f"{mpath}: manifest is not valid JSON ({e})") from None


def verify_shard(path: str | Path, *, full: bool = True) -> dict[str, Any]:
    """Check a shard against its manifest (size always; sha256 when full); returns the manifest."""
    path = Path(path)
    if not path.exists() or not manifest_path(path).exists():
        raise ShardError(f"{path}: shard or manifest missing")
    manifest = read_manifest(path)
    size = path.stat().st_size
    if size != manifest["bytes"]:
        raise ShardError(
            f"{path}: {size} bytes on disk, manifest says {manifest['bytes']} (truncated?)"
        )
    if full and sha256_file(path) != manifest["sha256"]:
        raise ShardError(f"{path}: sha256 differs from the manifest (corrupted)")
    return manifest
