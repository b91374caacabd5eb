"""eyas/files.py: JSON replaced atomically, a file's sha256, and a full disk named in one error."""

from __future__ import annotations

import errno
import hashlib
import json

import pytest

from eyas.files import DiskFull, disk_full, is_disk_full, sha256_file, write_json_atomic


def test_write_json_atomic_writes_sorted_json_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "deep" / "report.json"
    write_json_atomic(path, {"b": 1, "a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2], "b": 1}
    assert path.read_text().index('"a"') < path.read_text().index('"b"')
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]


def test_a_failed_write_leaves_the_old_file_intact(tmp_path):
    path = tmp_path / "report.json"
    write_json_atomic(path, {"run": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"run": object()})  # not serialisable
    assert json.loads(path.read_text()) == {"run": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_sha256_file_reads_in_blocks(tmp_path):
    data = bytes(range(256)) * 20_000  # over one 4 MiB block
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_disk_full_names_the_file_and_its_free_bytes(tmp_path):
    e = disk_full(tmp_path / "shard.safetensors", OSError(errno.ENOSPC, "No space left on device"))
    assert isinstance(e, DiskFull) and is_disk_full(e)
    assert str(e).startswith(f"disk full writing {tmp_path / 'shard.safetensors'}: ")
    assert "bytes free in" in str(e)
    assert is_disk_full(OSError(errno.EDQUOT, "quota")) and not is_disk_full(
        OSError(errno.EIO, "io")
    )
