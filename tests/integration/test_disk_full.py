"""A full disk while writing shards and manifests: one DiskFull naming the file, the folder and the
free bytes, nothing partial left, earlier shards untouched, and the extraction tasks never retry
it."""

import errno
import json
import re
import shutil
import subprocess

import pytest
import torch

from eyas.extraction import shards
from eyas.extraction.shards import Sample, ShardWriter, manifest_path, verify_shard, write_shard
from eyas.files import DiskFull, write_json_atomic

H, K = 64, 3  # bf16: (K + 1) * H * 2 + 5 = 517 bytes a token


def make_samples(n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(
            torch.randint(0, 100, (length,), generator=g),
            torch.rand(length, generator=g) > 0.5,
            torch.randn(length, K * H, generator=g).to(torch.bfloat16),
            torch.randn(length, H, generator=g).to(torch.bfloat16),
        )
        for _ in range(n)
    ]


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MiB filesystem (tmpfs): writes past it fail with ENOSPC as on a full disk."""
    where = tmp_path / "disk"
    where.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(
            f"cannot mount a 2 MiB tmpfs (needs root and CAP_SYS_ADMIN): "
            f"{getattr(e, 'stderr', None) or e}"
        )
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False, timeout=30)


def fill(folder, leave: int):
    """Take all but `leave` bytes of folder's filesystem with a file of zeros."""
    with open(folder / "filler", "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(folder).free - leave))


def free_in(message: str, folder) -> int:
    m = re.search(rf"(\d+) bytes free in {re.escape(str(folder))} ", message)
    assert m, message
    return int(m.group(1))


def finished_shard(folder):
    """An earlier shard, finished before the disk filled: (path, its manifest)."""
    path = folder / "shard-00000.safetensors"
    return path, write_shard(path, make_samples(4, 16), {"layer_ids": [2, 4, 5]})


def assert_untouched(path, manifest):
    assert verify_shard(path, full=True) == manifest == json.loads(manifest_path(path).read_text())


def test_a_shard_that_does_not_fit_raises_disk_full_and_leaves_nothing(small_disk):
    first, manifest = finished_shard(small_disk)
    path = small_disk / "shard-00001.safetensors"
    samples = make_samples(8, 512)  # 8 x 512 tokens x 517 bytes: about 2.1 MB, over what is left
    w = ShardWriter(path, [512] * 8, hidden_size=H, num_aux=K, dtype=torch.bfloat16, meta={})
    with pytest.raises(DiskFull) as got:
        for i, s in enumerate(samples):
            w.put(i, s)
    e = got.value
    assert e.errno == errno.ENOSPC and e.filename == str(path)
    assert str(e).startswith(
        f"disk full writing {path}: "
    ) and "the partial file was removed" in str(e)
    free = free_in(str(e), small_disk)
    assert 0 <= free < 64 * 1024  # what the filesystem said was left when the write failed
    assert sorted(p.name for p in small_disk.iterdir()) == [
        "shard-00000.json",
        "shard-00000.safetensors",
    ]
    with pytest.raises(DiskFull):  # every later write (another thread's sample) gets the same error
        w.put(7, samples[7])
    w.abort()
    assert (
        shutil.disk_usage(small_disk).free > 2 * 2**20 - 128 * 1024
    )  # the unlinked file's space is back
    assert_untouched(first, manifest)


def test_a_manifest_that_does_not_fit_removes_its_shard_too(small_disk):
    first, manifest = finished_shard(small_disk)
    path = small_disk / "shard-00001.safetensors"
    samples = make_samples(2, 100)
    w = ShardWriter(path, [100, 100], hidden_size=H, num_aux=K, dtype=torch.bfloat16, meta={})
    for i, s in enumerate(samples):
        w.put(i, s)
    fill(small_disk, leave=0)  # the shard's data is all on disk: only its manifest is left to write
    with pytest.raises(
        DiskFull, match=re.escape(f"disk full writing {manifest_path(path)}: ")
    ) as got:
        w.close()
    assert free_in(str(got.value), small_disk) < 4096
    assert sorted(p.name for p in small_disk.iterdir()) == [
        "filler",
        "shard-00000.json",
        "shard-00000.safetensors",
    ]
    assert_untouched(first, manifest)


def test_a_json_write_on_a_full_disk_keeps_the_old_file(small_disk):
    target = small_disk / "dataset.json"
    write_json_atomic(target, {"num_shards": 1})
    fill(small_disk, leave=0)
    with pytest.raises(DiskFull, match=re.escape(f"disk full writing {target}: ")) as got:
        write_json_atomic(target, {"num_shards": 2, "pad": "x" * 10000})
    assert free_in(str(got.value), small_disk) < 4096
    assert json.loads(target.read_text()) == {"num_shards": 1}
    assert sorted(p.name for p in small_disk.iterdir()) == ["dataset.json", "filler"]


def test_an_injected_enospc_at_the_shard_writer(tmp_path, monkeypatch):
    """Where no tmpfs can be mounted: the same error from a write that fails as a full disk's
    does."""
    first, manifest = finished_shard(tmp_path)
    real, calls = shards._pwrite_all, []

    def pwrite_all(fd, buf, offset):
        calls.append(offset)
        if len(calls) > 6:  # the header, the offsets, then one sample's tensors
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, buf, offset)

    monkeypatch.setattr(shards, "_pwrite_all", pwrite_all)
    path = tmp_path / "shard-00001.safetensors"
    w = ShardWriter(path, [16, 16], hidden_size=H, num_aux=K, dtype=torch.bfloat16, meta={})
    with pytest.raises(DiskFull) as got:
        for i, s in enumerate(make_samples(2, 16)):
            w.put(i, s)
    w.abort()
    assert got.value.filename == str(path) and free_in(str(got.value), tmp_path) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "shard-00000.json",
        "shard-00000.safetensors",
    ]
    assert_untouched(first, manifest)


def test_the_extraction_tasks_do_not_retry_a_full_disk(small_disk, monkeypatch, prefect_harness):
    """The real extract_shard_task (retries=2): a full disk runs once; another OSError three
    times."""
    import eyas_prefect.tasks.extract as tx
    from eyas_prefect.tasks.retry import worth_retrying
    from prefect import flow
    from prefect.cache_policies import NO_CACHE

    assert (
        tx.regenerate_data.retry_condition_fn
        is tx.extract_shard_task.retry_condition_fn
        is worth_retrying
    )
    calls = []

    def run_shard(ctx, cfg, plan, patch_version, *, log, warn=None, check=None):
        calls.append(plan)
        if plan == "eio":
            raise OSError(errno.EIO, "Input/output error")
        write_shard(
            small_disk / "shard-00001.safetensors", make_samples(8, 512), {}
        )  # about 2.1 MB

    monkeypatch.setattr(tx.stage, "run_shard", run_shard)
    quick = tx.extract_shard_task.with_options(
        task_run_name="extract-test",
        cache_policy=NO_CACHE,
        persist_result=False,
        retry_delay_seconds=0,
    )

    @flow
    def one(plan):
        return quick(None, None, plan, "v")

    with pytest.raises(OSError) as got:
        one("full")
    assert calls == ["full"]  # not retried
    assert isinstance(got.value, DiskFull) and "disk full writing " in str(got.value)
    assert not list(small_disk.glob(".*partial"))
    with pytest.raises(OSError, match="Input/output error"):
        one("eio")
    assert calls == ["full", "eio", "eio", "eio"]
