"""The dump protocol: writer, reader and reassembly, on real safetensors files; records fetched as
bytes (a dump folder on another machine) read the same, with the same refusals, as the files
here."""

from __future__ import annotations

import json
import os
import struct
import threading

import pytest
import torch
from safetensors import safe_open

from eyas.dump import (
    DTYPES,
    DUMP_DIR_ENV,
    ST_DTYPES,
    TORCH_DTYPES,
    AssembledSample,
    DumpError,
    DumpWriter,
    HeaderError,
    assemble,
    dtype_name,
    encode_header,
    parse_header,
    read_header,
    read_records,
    records_from_bytes,
    remove_records,
    should_skip,
    validate,
)

H, K = 8, 3  # hidden size, captured layers


def chunks(n: int, step: int, seed: int = 0):
    """Token ids and hidden states for n tokens, cut into prefill chunks of `step`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (n,), generator=g)
    aux = torch.randn(n, K * H, generator=g)
    last = torch.randn(n, H, generator=g)
    return ids, aux, last, [(s, min(s + step, n)) for s in range(0, n, step)]


def write_all(writer: DumpWriter, rid: str, n: int = 10, step: int = 4):
    ids, aux, last, spans = chunks(n, step)
    for s, e in spans:
        writer.write(rid, s, ids[s:e], aux[s:e], last[s:e])
    return ids, aux, last


@pytest.fixture
def writer(tmp_path) -> DumpWriter:
    return DumpWriter(tmp_path, layer_ids=[1, 3, 5], dtype=torch.float32)


def test_write_layout_and_metadata(writer, tmp_path):
    ids, aux, last, _ = chunks(5, 5)
    path = writer.write("req-1", 0, ids, aux, last)
    assert path == tmp_path / "req-1" / "0000000000.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert f.get_tensor("token_ids").dtype == torch.int32
        assert f.get_tensor("aux_hidden_states").shape == (5, K * H)
    assert meta["rid"] == "req-1" and meta["prefix_offset"] == "0" and meta["num_tokens"] == "5"
    assert json.loads(meta["layer_ids"]) == [1, 3, 5]
    assert meta["layer_convention"] == "capture-before" and meta["last_hidden_norm"] == "post"
    assert meta["hidden_size"] == str(H) and meta["format_version"] == "1"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    assert DUMP_DIR_ENV == "EYAS_DUMP_DIR"


def test_roundtrip_three_chunks(writer, tmp_path):
    ids, aux, last = write_all(writer, "r:1", n=10, step=4)
    records = read_records(tmp_path, "r:1")
    assert [r.prefix_offset for r in records] == [0, 4, 8]
    sample = assemble(records, ids.tolist())
    assert isinstance(sample, AssembledSample)
    assert torch.equal(sample.aux_hidden_states, aux) and torch.equal(
        sample.last_hidden_state, last
    )
    assert sample.token_ids.tolist() == ids.tolist()
    assert sample.meta["num_chunks"] == 3 and sample.meta["layer_ids"] == [1, 3, 5]


def test_default_dtype_is_bfloat16(tmp_path):
    w = DumpWriter(tmp_path, layer_ids=[1, 3, 5])
    ids, aux, last = write_all(w, "bf", n=4, step=4)
    sample = assemble(read_records(tmp_path, "bf"), ids.tolist())
    assert sample.aux_hidden_states.dtype == torch.bfloat16
    assert torch.allclose(sample.aux_hidden_states.float(), aux, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rid", ["", "a/b", "../x", "a..b", "sp ace", "é"])
def test_bad_rids_are_refused(writer, rid):
    ids, aux, last, _ = chunks(2, 2)
    with pytest.raises(ValueError, match="invalid rid"):
        writer.write(rid, 0, ids, aux, last)


def test_health_checks_and_warmup_are_skipped(writer, tmp_path):
    assert should_skip("HEALTH_CHECK_1733150000.1") and should_skip("WARMUP_abc")
    assert not should_skip("req-HEALTH_CHECK")
    ids, aux, last, _ = chunks(2, 2)
    assert writer.write("HEALTH_CHECK_1733150000.1", 0, ids, aux, last) is None
    assert not any(tmp_path.iterdir())
    only = DumpWriter(tmp_path, layer_ids=[1, 3, 5], rid_prefix="eyas-")
    assert only.write("3f2a9c", 0, ids, aux, last) is None  # e.g. SGLang's warmup uuid
    assert only.write("eyas-0", 0, ids, aux, last) is not None


def test_writer_checks_shapes(writer):
    ids, aux, last, _ = chunks(4, 4)
    with pytest.raises(ValueError, match=r"aux_hidden_states must be \[4, 3\*8\]"):
        writer.write("r", 0, ids, aux[:, :H], last)


def test_gap_names_the_missing_positions(writer, tmp_path):
    ids, aux, last, _ = chunks(10, 4)
    writer.write("gap", 4, ids[4:10], aux[4:10], last[4:10])  # as after a radix-cache hit on 0..3
    with pytest.raises(DumpError, match=r"'gap'.*positions 0\.\.3 are missing.*radix-cache"):
        assemble(read_records(tmp_path, "gap"), ids.tolist())


def test_missing_tail_and_overlap(writer, tmp_path):
    ids, aux, last, _ = chunks(10, 4)
    writer.write("tail", 0, ids[:4], aux[:4], last[:4])
    with pytest.raises(DumpError, match=r"positions 4\.\.9 missing"):
        assemble(read_records(tmp_path, "tail"), ids.tolist())
    writer.write("ov", 0, ids[:6], aux[:6], last[:6])
    writer.write("ov", 4, ids[4:], aux[4:], last[4:])
    with pytest.raises(DumpError, match=r"offset 4 overlaps positions 4\.\.5"):
        assemble(read_records(tmp_path, "ov"), ids.tolist())


def test_token_mismatch_and_too_many_tokens(writer, tmp_path):
    ids, aux, last = write_all(writer, "tok", n=10, step=4)
    sent = ids.tolist()
    sent[6] = (sent[6] + 1) % 100
    with pytest.raises(DumpError, match=rf"position 6 is {int(ids[6])}, but {sent[6]} was sent"):
        assemble(read_records(tmp_path, "tok"), sent)
    with pytest.raises(DumpError, match="only 9 tokens were sent"):
        assemble(read_records(tmp_path, "tok"), ids.tolist()[:9])


def test_non_finite_and_inconsistent_metadata(writer, tmp_path):
    ids, aux, last, _ = chunks(8, 4)
    bad = aux.clone()
    bad[5, 0] = float("nan")
    writer.write("nan", 0, ids[:4], aux[:4], last[:4])
    writer.write("nan", 4, ids[4:], bad[4:], last[4:])
    with pytest.raises(DumpError, match="offset 4: aux_hidden_states has non-finite"):
        assemble(read_records(tmp_path, "nan"), ids.tolist())
    other = DumpWriter(tmp_path, layer_ids=[2, 4, 6], dtype=torch.float32)
    writer.write("mix", 0, ids[:4], aux[:4], last[:4])
    other.write("mix", 4, ids[4:], aux[4:], last[4:])
    with pytest.raises(DumpError, match=r"layer_ids=\[2, 4, 6\] differs"):
        assemble(read_records(tmp_path, "mix"), ids.tolist())


def test_no_records(tmp_path):
    assert read_records(tmp_path, "nothing") == []
    with pytest.raises(DumpError, match="'nothing': no records found"):
        assemble([], [1, 2], rid="nothing")


def test_reader_ignores_temp_files_and_remove(writer, tmp_path):
    ids, aux, last = write_all(writer, "tmp", n=8, step=4)
    (tmp_path / "tmp" / ".0000000008.safetensors.tmp-1-2").write_bytes(b"half a file")
    assert len(read_records(tmp_path, "tmp")) == 2
    assert remove_records(tmp_path, "tmp") == 3
    assert read_records(tmp_path, "tmp") == [] and remove_records(tmp_path, "tmp") == 0


def test_corrupt_record_names_the_file(writer, tmp_path):
    write_all(writer, "bad", n=4, step=4)
    path = tmp_path / "bad" / "0000000000.safetensors"
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(DumpError, match=r"'bad': cannot read .*0000000000\.safetensors"):
        read_records(tmp_path, "bad")


def test_reader_never_sees_a_half_file(tmp_path):
    """A reader polling while a writer rewrites the same record sees only whole files."""
    w = DumpWriter(tmp_path, layer_ids=[1, 3, 5], dtype=torch.float32)
    ids, aux, last, _ = chunks(64, 64)
    stop = threading.Event()

    def keep_writing():
        while not stop.is_set():
            w.write("race", 0, ids, aux, last)

    w.write("race", 0, ids, aux, last)
    t = threading.Thread(target=keep_writing)
    t.start()
    try:
        seen = 0
        while seen < 200:
            for rec in read_records(tmp_path, "race"):
                assert torch.equal(rec.aux_hidden_states, aux)
                seen += 1
    finally:
        stop.set()
        t.join()
    assert sorted(os.listdir(tmp_path / "race")) == ["0000000000.safetensors"]


# ----------------------------------------------------------------------------- records fetched as b


@pytest.fixture
def dumped(tmp_path):
    w = DumpWriter(tmp_path, layer_ids=[2, 4, 5])
    ids = list(range(10, 30))
    for a, b in ((0, 8), (8, 16), (16, 20)):
        n = b - a
        w.write("r-1", a, torch.tensor(ids[a:b]), torch.randn(n, 3 * 16), torch.randn(n, 16))
    return tmp_path, ids


def _files(folder, rid):
    return [(f"node:{p}", p.read_bytes()) for p in sorted((folder / rid).iterdir())]


def test_bytes_give_the_same_records_as_the_files(dumped):
    folder, ids = dumped
    (folder / "r-1" / ".0000000099.safetensors.tmp-1-2").write_bytes(
        b"half"
    )  # a temp file: skipped
    here, there = (
        read_records(folder, "r-1"),
        records_from_bytes("r-1", _files(folder, "r-1")[::-1]),
    )
    assert [r.prefix_offset for r in there] == [0, 8, 16]
    for a, b in zip(here, there):
        assert a.meta == b.meta
        for name in ("token_ids", "aux_hidden_states", "last_hidden_state"):
            assert torch.equal(getattr(a, name), getattr(b, name))
    assert validate(there, ids)["num_chunks"] == 3


def test_truncated_bytes_name_the_remote_file(dumped):
    folder, _ = dumped
    files = _files(folder, "r-1")
    files[1] = (files[1][0], files[1][1][:-100])
    with pytest.raises(DumpError, match=r"cannot read node:.*0000000008\.safetensors"):
        records_from_bytes("r-1", files)
    with pytest.raises(DumpError, match=r"cannot read node:.*0000000008\.safetensors"):
        records_from_bytes("r-1", [(files[1][0], b"\xff" * 16)])  # header larger than the file


def test_a_record_under_another_name_is_refused(dumped):
    folder, _ = dumped
    files = _files(folder, "r-1")
    with pytest.raises(DumpError, match="does not match its path"):
        records_from_bytes("r-1", [("node:/d/r-1/0000000016.safetensors", files[0][1])])
    with pytest.raises(DumpError, match="does not match its path"):
        records_from_bytes("r-2", files[:1])
    with pytest.raises(ValueError, match="invalid rid"):
        records_from_bytes("../x", files)


# ---------------------------------------------------------------------------------------------
# The safetensors header codec (dump records, shards and the training loader all use it)
# ---------------------------------------------------------------------------------------------


def _codec_file(path, metadata=None):
    """A file of three tensors written with encode_header, and the tensors."""
    tensors = {
        "x": torch.arange(12, dtype=torch.float32).view(3, 4).to(torch.bfloat16),
        "ids": torch.arange(5, dtype=torch.int64),
        "q": torch.randn(2, 6).to(torch.float8_e4m3fn),
    }
    head, header = encode_header(
        [(name, t.dtype, list(t.shape)) for name, t in tensors.items()], metadata or {"k": "v"}
    )
    path.write_bytes(
        head + b"".join(t.view(torch.uint8).numpy().tobytes() for t in tensors.values())
    )
    return tensors, header


def test_an_encoded_header_reads_back_and_safetensors_reads_its_file(tmp_path):
    path = tmp_path / "t.safetensors"
    tensors, header = _codec_file(path)
    assert read_header(path) == header == parse_header(path.read_bytes(), "there")
    assert list(header.tensors) == ["x", "ids", "q"] and header.metadata == {"k": "v"}
    assert header.data_start % 8 == 0 and header.file_size == path.stat().st_size
    x = header.tensors["x"]
    assert (x.dtype, x.shape, x.start, x.end, x.row_bytes) == (
        torch.bfloat16,
        (3, 4),
        header.data_start,
        header.data_start + 24,
        8,
    )
    assert header.tensors["ids"].row_bytes == 8 and header.tensors["ids"].start == x.end
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"k": "v"}
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def test_the_dtype_tables_agree():
    assert {TORCH_DTYPES[ST_DTYPES[d]] for d in ST_DTYPES} == set(ST_DTYPES)
    assert set(DTYPES.values()) <= set(ST_DTYPES)
    assert [dtype_name(d) for d in DTYPES.values()] == list(DTYPES)


@pytest.mark.parametrize(
    "data, fault",
    [
        (b"\x01\x00", "shorter than the 8-byte length"),
        (b"\xff" * 16, "a header of 18446744073709551615 bytes in a file of 16"),
        (struct.pack("<Q", 4) + b"{no}", "not JSON"),
        (struct.pack("<Q", 2) + b"[]", "a JSON list, not an object"),
        (struct.pack("<Q", 19) + b'{"__metadata__": 1}', "__metadata__ is a int"),
        (struct.pack("<Q", 10) + b'{"x": {}} ', "tensor 'x': KeyError: 'dtype'"),
    ],
)
def test_a_malformed_header_is_refused_naming_the_file(tmp_path, data, fault):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(
        HeaderError, match=rf"^{path}: not a readable safetensors header: .*{fault}"
    ):
        read_header(path)
    with pytest.raises(HeaderError, match=rf"^node:bad: not a readable .*{fault}"):
        parse_header(data, "node:bad")


def test_a_header_with_an_unknown_dtype_or_wrong_offsets_is_refused(tmp_path):
    def file(entry):
        blob = json.dumps({"x": entry}).encode()
        return struct.pack("<Q", len(blob)) + blob + bytes(64)

    with pytest.raises(HeaderError, match=r"tensor 'x': dtype 'BOOL' is none of eyas's"):
        parse_header(file({"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}), "f")
    with pytest.raises(HeaderError, match=r"data_offsets \[0, 4\] do not fit F32 \[2\]"):
        parse_header(file({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}), "f")
