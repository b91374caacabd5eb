"""The hidden-state dump protocol: one safetensors file per (request id, prefill chunk).

A server (eyas's local server, or SGLang with the eyas hook) writes every prefill chunk of every
request to `<dump_dir>/<rid>/<prefix_offset:010d>.safetensors`; the collector reads a request's
records back after the HTTP response and reassembles them:

    writer = DumpWriter("/data/dump", layer_ids=[2, 4, 5])
    writer.write("req-0", 0, token_ids, aux_hidden_states, last_hidden_state)   # one per chunk
    sample = assemble(read_records("/data/dump", "req-0"), expected_token_ids=ids)
    remove_records("/data/dump", "req-0")

A dump folder on another machine is read as bytes through the Host seam (eyas/extraction/
records.py) and parsed here with the same checks: `records_from_bytes(rid, [(path, data), ...])`.

The writer only writes; the reader owns all validation (coverage, token ids, shapes, finiteness),
because a radix-cache hit or a lost chunk shows up only when the pieces are put back together.

This module is imported by the SGLang hook on the GPU host, so it needs only stdlib, torch and
safetensors. For that reason it also holds eyas's one safetensors header codec (dtype tables,
encode_header, read_header, parse_header), which the shard writer and the training loader share.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

DUMP_DIR_ENV = "EYAS_DUMP_DIR"  #: set on the server: where records go (unset = no dump)
DUMP_DTYPE_ENV = "EYAS_DUMP_DTYPE"  #: optional: bfloat16 (default), float16 or float32

FORMAT_NAME = "eyas-dump"
FORMAT_VERSION = 1

LAYER_CONVENTIONS = ("capture-before", "output-of")

# How an SGLang 0.5.23 model class turns --return-aux-hidden-state-layer-ids into the layers it
# captures (its set_eagle3_layers_to_capture): DeepSeek-V2's family shifts a list starting with 1
# by +1 and takes any other as capture-before ids; Llama's (llama.py) always shifts by +1. The
# launch asks for ids that the class maps to the wanted capture-before ids, and the hook checks it.
PLUS_ONE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Phi3ForCausalLM",
    "InternLM3ForCausalLM",
    "IQuestCoderForCausalLM",
)


def captured_layer_ids(server_ids: list[int], architecture: str | None = None) -> list[int]:
    """The capture-before layers `architecture` captures for --return-aux-hidden-state-layer-ids."""
    ids = [int(i) for i in server_ids]
    if architecture in PLUS_ONE_ARCHITECTURES or (ids and ids[0] == 1):
        return [i + 1 for i in ids]
    return ids


def server_layer_ids(capture_ids: list[int], architecture: str | None = None) -> list[int]:
    """The --return-aux-hidden-state-layer-ids that make `architecture` capture `capture_ids`."""
    ids = [int(i) for i in capture_ids]
    asked = [i - 1 for i in ids] if architecture in PLUS_ONE_ARCHITECTURES else ids
    if any(i < 0 for i in asked) or captured_layer_ids(asked, architecture) != ids:
        raise ValueError(
            f"capture-before layers {ids} cannot be asked of {architecture or 'DeepSeek-V2'}'s "
            f"rule (a list starting with 1 is shifted by "
            f"+1{'; every id by +1' if asked != ids else ''})"
        )
    return asked


LAST_HIDDEN_NORMS = ("post", "pre")  # whether last_hidden_state went through the final norm

_RID_RE = re.compile(r"[A-Za-z0-9_.:-]+")
# A rid names its dump folder, <dump_dir>/<rid>: a folder name has at most 255 bytes (NAME_MAX),
# and 200 leaves room for what eyas appends to its own rids (the pool's attempt suffix "-a<k>").
MAX_RID_LENGTH = 200
# SGLang's own traffic: /health and /health_generate send rid HEALTH_CHECK_<time>; eyas's local
# server names its warmup WARMUP_<hex>. (SGLang's warmup carries a random uuid: see rid_prefix.)
_SKIP_PREFIXES = ("HEALTH_CHECK", "WARMUP")


class DumpError(ValueError):
    """Dump records that cannot be turned into a sample; the message names the rid and the fault.

    Not an EyasError: this module runs inside SGLang's python, where eyas is not installed. The
    collector wraps it in an ExtractionError (eyas/extraction/extract.py).
    """

    retryable = False  # the same records read again are wrong again

    def __init__(self, rid: str | None, message: str):
        self.rid = rid
        super().__init__(f"dump records for rid {rid!r}: {message}")


def check_rid(rid: str) -> str:
    """Return rid if it is safe as a folder name, else raise ValueError saying why."""
    if isinstance(rid, str) and len(rid) > MAX_RID_LENGTH:
        raise ValueError(
            f"invalid rid {rid[:40]!r}...: {len(rid)} characters, at most {MAX_RID_LENGTH} "
            f"(it names the dump folder <dump_dir>/<rid>)"
        )
    if not isinstance(rid, str) or not _RID_RE.fullmatch(rid):
        raise ValueError(f"invalid rid {rid!r}: use only letters, digits and _ . : -")
    if ".." in rid:
        raise ValueError(f"invalid rid {rid!r}: '..' is not allowed")
    return rid


def should_skip(rid: str) -> bool:
    """True for requests the server makes itself (health checks, warmup): never dumped."""
    return rid.startswith(_SKIP_PREFIXES)


def dtype_from_env(default: str = "bfloat16") -> torch.dtype:
    """The dump dtype named by EYAS_DUMP_DTYPE (or default)."""
    name = os.environ.get(DUMP_DTYPE_ENV, default)
    if name not in DTYPES:
        raise ValueError(f"{DUMP_DTYPE_ENV}={name!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def record_path(dump_dir: str | Path, rid: str, prefix_offset: int) -> Path:
    return Path(dump_dir) / check_rid(rid) / f"{prefix_offset:010d}.safetensors"


# ---------------------------------------------------------------------------------------------
# Safetensors files: eyas's one codec for their header (dtype tables, encoding, decoding)
# ---------------------------------------------------------------------------------------------
# It lives here because this module is the one copied into SGLang, alone: the dump writer needs it
# there, and the shard writer and the training loader import it from here.

#: eyas's dtype names (config, manifests, record metadata) for hidden states
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: torch dtype -> safetensors dtype string, for every dtype eyas stores
ST_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3",
}
TORCH_DTYPES = {name: dtype for dtype, name in ST_DTYPES.items()}  #: safetensors string -> torch
_LENGTH = struct.Struct("<Q")  # the header starts with its JSON's length, 8 bytes little-endian


def dtype_name(dtype: torch.dtype) -> str:
    """eyas's name of a hidden-state dtype ("bfloat16", ...): the key of DTYPES."""
    return next(name for name, d in DTYPES.items() if d == dtype)


class HeaderError(ValueError):
    """A safetensors header eyas cannot read; the message names the file and the fault.

    A builtin ValueError, not an EyasError: this module runs where eyas is not installed.
    """

    def __init__(self, where: str, message: str):
        self.where = where
        super().__init__(f"{where}: not a readable safetensors header: {message}")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file and where its bytes lie in the file (start..end)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along the first dimension (a row of a matrix, an element of a
        vector)."""
        return _nbytes(self.dtype, self.shape[1:])


@dataclass(frozen=True)
class Header:
    """A safetensors file's header: its tensors in file order, metadata, and where data begins."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int  # the 8-byte length plus the JSON (padded to 8 bytes)

    @property
    def file_size(self) -> int:
        """The bytes of the whole file: the header and every tensor's data."""
        return max((t.end for t in self.tensors.values()), default=self.data_start)


def _nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * dtype.itemsize


def encode_header(
    tensors: list[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str]
) -> tuple[bytes, Header]:
    """The header of a file holding `tensors` (name, dtype, shape) back to back in this order: the
    bytes the file starts with (length + JSON, padded to 8) and the Header (where each tensor goes).
    """
    fields, offset = {}, 0
    for name, dtype, shape in tensors:
        size = _nbytes(dtype, shape)
        fields[name] = {
            "dtype": ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    fields["__metadata__"] = metadata
    blob = json.dumps(fields, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data buffer to 8 bytes
    data = _LENGTH.pack(len(blob)) + blob
    return data, _decode(fields, len(data), "a new header")


def read_header(path: str | Path) -> Header:
    """The header of the safetensors file at `path` (HeaderError naming it if malformed). Only the
    header is read: a file cut short in its data fails where the data is read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = _json_length(f.read(_LENGTH.size), size, str(path))
        return _parse(f.read(n), str(path))


def parse_header(data: bytes, where: str) -> Header:
    """The header of a safetensors file given as its bytes; `where` names it in a HeaderError."""
    n = _json_length(data[: _LENGTH.size], len(data), where)
    return _parse(bytes(data[_LENGTH.size : _LENGTH.size + n]), where)


def _json_length(prefix: bytes, size: int, where: str) -> int:
    if len(prefix) < _LENGTH.size:
        raise HeaderError(where, f"a file of {size} bytes is shorter than the 8-byte length")
    (n,) = _LENGTH.unpack(prefix)
    if n > size - _LENGTH.size:
        raise HeaderError(where, f"a header of {n} bytes in a file of {size}")
    return n


def _parse(blob: bytes, where: str) -> Header:
    try:
        fields = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeaderError(where, f"the header is not JSON ({e})") from None
    if not isinstance(fields, dict):
        raise HeaderError(where, f"the header is a JSON {type(fields).__name__}, not an object")
    return _decode(fields, _LENGTH.size + len(blob), where)


def _decode(fields: dict, data_start: int, where: str) -> Header:
    fields = dict(fields)
    metadata = fields.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise HeaderError(where, f"__metadata__ is a {type(metadata).__name__}, not an object")
    return Header(
        {name: _entry(name, f, data_start, where) for name, f in fields.items()},
        metadata,
        data_start,
    )


def _entry(name: str, field_: Any, data_start: int, where: str) -> TensorEntry:
    try:
        st_dtype = field_["dtype"]
        shape = tuple(int(d) for d in field_["shape"])
        begin, end = (int(o) for o in field_["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise HeaderError(
            where, f"tensor {name!r}: {type(e).__name__}: {e} in {field_!r}"
        ) from None
    dtype = TORCH_DTYPES.get(st_dtype) if isinstance(st_dtype, str) else None
    if dtype is None:
        raise HeaderError(
            where, f"tensor {name!r}: dtype {st_dtype!r} is none of eyas's {sorted(TORCH_DTYPES)}"
        )
    if begin < 0 or end - begin != _nbytes(dtype, shape):
        raise HeaderError(
            where,
            f"tensor {name!r}: data_offsets {[begin, end]} do not fit {ST_DTYPES[dtype]} "
            f"{list(shape)}",
        )
    return TensorEntry(dtype, shape, data_start + begin, data_start + end)


# ---------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------


class DumpWriter:
    """Writes one record per prefill chunk, atomically (temp file in the same folder, then rename).

    `layer_ids` are the captured layers in `layer_convention`; `last_hidden_norm` says whether
    last_hidden_state is after the model's final norm ("post", as SGLang's last_hidden_states and
    HF's hidden_states[-1]) or before it ("pre"). `rid_prefix`, when set, restricts dumping to
    requests whose rid starts with it (SGLang's warmup request has a random rid, so a hook that
    must not dump it can dump only the collector's own rids).
    """

    def __init__(
        self,
        dump_dir: str | Path,
        *,
        layer_ids: list[int],
        layer_convention: str = "capture-before",
        last_hidden_norm: str = "post",
        dtype: torch.dtype = torch.bfloat16,
        rid_prefix: str | None = None,
    ):
        if layer_convention not in LAYER_CONVENTIONS:
            raise ValueError(
                f"layer_convention must be one of {LAYER_CONVENTIONS}, got {layer_convention!r}"
            )
        if last_hidden_norm not in LAST_HIDDEN_NORMS:
            raise ValueError(
                f"last_hidden_norm must be one of {LAST_HIDDEN_NORMS}, got {last_hidden_norm!r}"
            )
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")
        if not layer_ids or any(not isinstance(i, int) or i < 0 for i in layer_ids):
            raise ValueError(
                f"layer_ids must be a non-empty list of non-negative ints, got {layer_ids}"
            )
        self.dump_dir = Path(dump_dir)
        self.layer_ids = list(layer_ids)
        self.layer_convention = layer_convention
        self.last_hidden_norm = last_hidden_norm
        self.dtype = dtype
        self.rid_prefix = rid_prefix

    def should_skip(self, rid: str) -> bool:
        if should_skip(rid):
            return True
        return self.rid_prefix is not None and not rid.startswith(self.rid_prefix)

    def write(
        self,
        rid: str,
        prefix_offset: int,
        token_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        last_hidden_state: torch.Tensor,
    ) -> Path | None:
        """Write one chunk: tokens [n], aux [n, K*H], last [n, H]. Returns the path (None if
        skipped)."""
        check_rid(rid)
        if self.should_skip(rid):
            return None
        if not isinstance(prefix_offset, int) or prefix_offset < 0:
            raise ValueError(
                f"rid {rid}: prefix_offset must be a non-negative int, got {prefix_offset!r}"
            )
        n = token_ids.shape[0]
        k = len(self.layer_ids)
        if token_ids.dim() != 1 or last_hidden_state.dim() != 2 or last_hidden_state.shape[0] != n:
            raise ValueError(
                f"rid {rid} @ {prefix_offset}: token_ids must be [n] and last_hidden_state "
                f"[n, H]; got {tuple(token_ids.shape)} and {tuple(last_hidden_state.shape)}"
            )
        hidden = last_hidden_state.shape[1]
        if tuple(aux_hidden_states.shape) != (n, k * hidden):
            raise ValueError(
                f"rid {rid} @ {prefix_offset}: aux_hidden_states must be [{n}, {k}*{hidden}] "
                f"for {k} layers, got {tuple(aux_hidden_states.shape)}"
            )

        tensors = {
            "token_ids": token_ids.detach().to("cpu", torch.int32).contiguous(),
            "aux_hidden_states": aux_hidden_states.detach().to("cpu", self.dtype).contiguous(),
            "last_hidden_state": last_hidden_state.detach().to("cpu", self.dtype).contiguous(),
        }
        metadata = {
            "format": FORMAT_NAME,
            "format_version": str(FORMAT_VERSION),
            "rid": rid,
            "prefix_offset": str(prefix_offset),
            "num_tokens": str(n),
            "layer_ids": json.dumps(self.layer_ids),
            "layer_convention": self.layer_convention,
            "last_hidden_norm": self.last_hidden_norm,
            "hidden_size": str(hidden),
            "dtype": dtype_name(self.dtype),
        }
        path = record_path(self.dump_dir, rid, prefix_offset)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A dot-name in the same folder: readers skip it, and os.replace is atomic within a
        # filesystem. No fsync: readers need visibility, not durability across a power cut.
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            _save(tensors, tmp, metadata)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """A safetensors file written straight from the tensors' memory (safetensors' save_file makes a
    bytes copy of every tensor first: at 57 KB per token that copy is a third of the write)."""
    head, _ = encode_header(
        [(name, t.dtype, list(t.shape)) for name, t in tensors.items()], metadata
    )
    with open(path, "wb") as f:
        f.write(head)
        for t in tensors.values():
            f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))


# ---------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------


@dataclass
class DumpRecord:
    rid: str
    prefix_offset: int
    token_ids: torch.Tensor  # [n] int32
    aux_hidden_states: torch.Tensor  # [n, K*H]
    last_hidden_state: torch.Tensor  # [n, H]
    meta: dict[str, Any] = field(default_factory=dict)  # parsed metadata (ints and lists decoded)


@dataclass
class AssembledSample:
    rid: str
    token_ids: torch.Tensor  # [T] int32
    aux_hidden_states: torch.Tensor  # [T, K*H]
    last_hidden_state: torch.Tensor  # [T, H]
    meta: dict[str, Any]  # the metadata shared by all chunks, plus num_chunks


_META_INTS = ("format_version", "prefix_offset", "num_tokens", "hidden_size")
# Metadata that must be the same in every chunk of one request.
_SHARED_META = (
    "format",
    "format_version",
    "rid",
    "layer_ids",
    "layer_convention",
    "last_hidden_norm",
    "hidden_size",
    "dtype",
)


def _read_record(path: Path, rid: str) -> DumpRecord:
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # noqa: BLE001 - a corrupt file is reported with its path
        raise DumpError(rid, f"cannot read {path}: {type(e).__name__}: {e}") from e
    return _record(raw, tensors, str(path), rid)


def _parse_record(data: bytes, where: str, rid: str) -> DumpRecord:
    """A record from its file's bytes (fetched from another machine): the same checks as a file."""
    from safetensors.torch import load

    try:
        raw = parse_header(data, where).metadata
    except HeaderError as e:  # its message starts with `where`
        raise DumpError(rid, f"cannot read {e}") from e
    try:
        tensors = load(bytes(data))
    except Exception as e:  # noqa: BLE001 - a corrupt or truncated file is reported with its path
        raise DumpError(rid, f"cannot read {where}: {type(e).__name__}: {e}") from e
    return _record(raw, tensors, where, rid)


def _record(raw: dict, tensors: dict[str, torch.Tensor], path: str, rid: str) -> DumpRecord:
    if raw.get("format") != FORMAT_NAME:
        raise DumpError(rid, f"{path} is not an eyas dump record (format={raw.get('format')!r})")
    missing = [
        k for k in ("token_ids", "aux_hidden_states", "last_hidden_state") if k not in tensors
    ]
    if missing:
        raise DumpError(rid, f"{path} lacks tensors {missing}")
    try:
        meta: dict[str, Any] = dict(raw)
        for key in _META_INTS:
            meta[key] = int(raw[key])
        meta["layer_ids"] = json.loads(raw["layer_ids"])
    except (KeyError, ValueError) as e:
        raise DumpError(rid, f"{path} has bad metadata: {type(e).__name__}: {e}") from e
    if meta["format_version"] != FORMAT_VERSION:
        raise DumpError(
            rid,
            f"{path} has format version {meta['format_version']}, "
            f"this eyas reads version {FORMAT_VERSION}",
        )
    return DumpRecord(
        rid=meta["rid"],
        prefix_offset=meta["prefix_offset"],
        token_ids=tensors["token_ids"],
        aux_hidden_states=tensors["aux_hidden_states"],
        last_hidden_state=tensors["last_hidden_state"],
        meta=meta,
    )


def is_record_name(name: str) -> bool:
    """A finished record's file name; temp files start with "." (half-written or abandoned)."""
    return name.endswith(".safetensors") and not name.startswith(".")


def _matching(rid: str, named: list[tuple[str, DumpRecord]]) -> list[DumpRecord]:
    for where, rec in named:
        if Path(where).name != f"{rec.prefix_offset:010d}.safetensors" or rec.rid != rid:
            raise DumpError(
                rid,
                f"{where} holds rid {rec.rid!r} at offset {rec.prefix_offset}, "
                f"which does not match its path",
            )
    return sorted((rec for _, rec in named), key=lambda r: r.prefix_offset)


def read_records(dump_dir: str | Path, rid: str) -> list[DumpRecord]:
    """All records of one request, sorted by prefix_offset ([] if none were written yet)."""
    folder = Path(dump_dir) / check_rid(rid)
    if not folder.is_dir():
        return []
    paths = sorted(p for p in folder.iterdir() if is_record_name(p.name))
    return _matching(rid, [(str(p), _read_record(p, rid)) for p in paths])


def records_from_bytes(rid: str, files: list[tuple[str, bytes]]) -> list[DumpRecord]:
    """read_records for records fetched as bytes (a dump folder on another machine): `files` are
    (where, data) pairs, `where` the file's path (its name is checked against its content)."""
    check_rid(rid)
    return _matching(
        rid,
        [
            (where, _parse_record(data, where, rid))
            for where, data in files
            if is_record_name(Path(where).name)
        ],
    )


def remove_records(dump_dir: str | Path, rid: str) -> int:
    """Delete a request's records (and leftover temp files); returns how many files were removed."""
    folder = Path(dump_dir) / check_rid(rid)
    if not folder.is_dir():
        return 0
    num_files = sum(1 for _ in folder.iterdir())
    shutil.rmtree(folder, ignore_errors=True)
    return num_files


def assemble(
    records: list[DumpRecord], expected_token_ids: list[int], *, rid: str | None = None
) -> AssembledSample:
    """Concatenate a request's chunks into one sample, checking they are exactly what was sent.

    Positions 0..T-1 (T = len(expected_token_ids)) must each be covered by one chunk, the token ids
    must equal the ones sent, shapes and metadata must agree across chunks, values must be finite.
    `rid` only names the request in the error when there are no records at all.
    """
    records = sorted(records, key=lambda r: r.prefix_offset)
    meta = validate(records, expected_token_ids, rid=rid)
    return AssembledSample(
        rid=records[0].rid,
        token_ids=torch.cat([r.token_ids for r in records]),
        aux_hidden_states=torch.cat([r.aux_hidden_states for r in records]),
        last_hidden_state=torch.cat([r.last_hidden_state for r in records]),
        meta=meta,
    )


# A float is NaN or inf exactly when its exponent bits are all ones: (bit view, exponent mask).
_EXPONENT = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
}


def _all_finite(x: torch.Tensor, rows: int = 256) -> bool:
    """No NaN or inf in x, checked on the exponent bits in blocks of rows: ~7 GB/s for bf16 where
    torch.isfinite manages ~0.1 GB/s, and the temporary stays small for a 4k-token chunk."""
    if x.dtype not in _EXPONENT or x.dim() != 2 or not x.is_contiguous():
        return bool(torch.isfinite(x).all())
    view, mask = _EXPONENT[x.dtype]
    bits = x.view(view).numpy()
    return all(
        int((bits[a : a + rows] & mask).max(initial=0)) != mask
        for a in range(0, bits.shape[0], rows)
    )


def validate(
    records: list[DumpRecord], expected_token_ids: list[int], *, rid: str | None = None
) -> dict[str, Any]:
    """assemble's checks without concatenating (a collector can then write chunk by chunk).

    `records` must be sorted by prefix_offset (read_records returns them so). Returns the metadata
    shared by the chunks, plus num_tokens and num_chunks.
    """
    if not records:
        raise DumpError(
            rid, "no records found (was EYAS_DUMP_DIR set on the server, and aux capture enabled?)"
        )
    if any(a.prefix_offset > b.prefix_offset for a, b in zip(records, records[1:])):
        records = sorted(records, key=lambda r: r.prefix_offset)
    rid = records[0].rid
    first = records[0].meta
    total = len(expected_token_ids)

    pos = 0
    for rec in records:
        _check_chunk(rec, first, pos, expected_token_ids, rid)
        pos += rec.meta["num_tokens"]
    if pos != total:
        raise DumpError(
            rid,
            f"records cover positions 0..{pos - 1}, but {total} tokens were sent "
            f"(positions {pos}..{total - 1} missing)",
        )

    meta = {k: first[k] for k in _SHARED_META}
    meta.update(num_tokens=total, num_chunks=len(records))
    return meta


def _check_chunk(
    rec: DumpRecord, first: dict[str, Any], pos: int, expected_token_ids: list[int], rid: str
) -> None:
    """One chunk, due to start at position `pos`; each property is refused with its own message."""
    where = f"chunk at offset {rec.prefix_offset}"
    _check_shared_meta(rec, first, where, rid)
    _check_start(rec, pos, where, rid)
    _check_shapes(rec, len(first["layer_ids"]), first["hidden_size"], where, rid)
    n, total = rec.meta["num_tokens"], len(expected_token_ids)
    if pos + n > total:
        raise DumpError(
            rid,
            f"{where} covers positions up to {pos + n - 1}, but only {total} tokens were sent",
        )
    _check_token_ids(rec, expected_token_ids[pos : pos + n], pos, rid)
    for name in ("aux_hidden_states", "last_hidden_state"):
        if not _all_finite(getattr(rec, name)):
            raise DumpError(rid, f"{where}: {name} has non-finite values (NaN or inf)")


def _check_shared_meta(rec: DumpRecord, first: dict[str, Any], where: str, rid: str) -> None:
    for key in _SHARED_META:
        if rec.meta.get(key) != first.get(key):
            raise DumpError(
                rid,
                f"{where}: metadata {key}={rec.meta.get(key)!r} differs from "
                f"the first chunk's {first.get(key)!r}",
            )


def _check_start(rec: DumpRecord, pos: int, where: str, rid: str) -> None:
    """The chunk starts where the previous one ended: no gap, no overlap."""
    if rec.prefix_offset > pos:
        raise DumpError(
            rid,
            f"positions {pos}..{rec.prefix_offset - 1} are missing (gap before "
            f"the {where}); a radix-cache prefix hit looks like this: run the "
            f"server with --disable-radix-cache",
        )
    if rec.prefix_offset < pos:
        raise DumpError(
            rid,
            f"{where} overlaps positions {rec.prefix_offset}..{pos - 1}, "
            f"already covered by an earlier chunk",
        )


def _check_shapes(rec: DumpRecord, num_layers: int, hidden: int, where: str, rid: str) -> None:
    n = rec.meta["num_tokens"]
    shapes = (
        tuple(rec.token_ids.shape),
        tuple(rec.aux_hidden_states.shape),
        tuple(rec.last_hidden_state.shape),
    )
    if shapes != ((n,), (n, num_layers * hidden), (n, hidden)):
        raise DumpError(
            rid,
            f"{where}: shapes token_ids/aux/last are {shapes}, expected "
            f"{((n,), (n, num_layers * hidden), (n, hidden))}",
        )


def _check_token_ids(rec: DumpRecord, sent_ids: list[int], pos: int, rid: str) -> None:
    """The chunk's token ids are the ones sent at positions pos.."""
    sent = torch.tensor(sent_ids, dtype=torch.int64)
    got = rec.token_ids.to(torch.int64)
    if not torch.equal(sent, got):
        i = int((sent != got).nonzero()[0])
        raise DumpError(
            rid, f"token id at position {pos + i} is {int(got[i])}, but {int(sent[i])} was sent"
        )
