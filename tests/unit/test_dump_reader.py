"""eyas.dump's reader for records fetched as bytes (a dump folder on another machine): the same
records, and the same refusals, as reading the files here."""

from __future__ import annotations

import pytest
import torch

from eyas.dump import DumpError, DumpWriter, read_records, records_from_bytes, validate


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
    (folder / "r-1" / ".0000000099.safetensors.tmp-1-2").write_bytes(b"half")  # a temp file: skipped
    here, there = read_records(folder, "r-1"), records_from_bytes("r-1", _files(folder, "r-1")[::-1])
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
