"""Writing and hashing files the way every stage does: files and folders replaced atomically (a
reader sees the old one or the new one, never half; written through a temp file or folder beside
it, fsynced, then renamed), a file's sha256 read in blocks, and a full disk reported as one
DiskFull naming the file, its folder and the free bytes there.

    write_json_atomic(run_dir / "report.json", report)
    write_text_atomic(plan_path, text)
    with atomic_file(path) as f: f.write(chunk)           # streamed
    with atomic_dir(drafter_dir) as tmp: save(tmp / "model.safetensors")
    digest = sha256_file(shard_path)
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

from eyas.errors import EyasError


class DiskFull(EyasError, OSError):
    """No space left (ENOSPC, or a quota: EDQUOT) writing an output file. Never worth a retry: the
    disk stays full until someone frees it. The partial file is already removed when it is
    raised."""

    def __str__(self) -> str:
        return self.strerror


def disk_full(path: str | Path, e: OSError) -> DiskFull:
    """The DiskFull for a failed write of path: names the file, its folder and the folder's free
    bytes."""
    path = Path(path)
    try:
        free = f"{shutil.disk_usage(path.parent).free} bytes free"
    except OSError as why:
        free = f"free bytes unknown: {why.strerror}"
    return DiskFull(
        e.errno,
        f"disk full writing {path}: {free} in {path.parent} ({os.strerror(e.errno)}); "
        f"the partial file was removed. Free space there (or move the output) and run again",
        str(path),
    )


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


@contextmanager
def atomic_file(path: str | Path) -> Iterator[IO[bytes]]:
    """A binary file to write `path`'s new contents to; when the block succeeds it is fsynced and
    renamed over `path` (and the folder fsynced). On any failure the temp file is removed and
    `path` is left as it was; a full disk is raised as DiskFull."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if is_disk_full(e):
            raise disk_full(path, e) from e
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """obj as indented, key-sorted JSON at path, atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """An empty folder beside `out` to build its new contents in; when the block succeeds, every
    file in it is fsynced and it replaces `out` by rename (the old folder is removed after), so a
    reader sees the old folder or the new one, never half of one. Files are made readable to all."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp and safetensors make private files
        for file in tmp.iterdir():
            file.chmod(0o644)
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        if is_disk_full(e):
            raise disk_full(out, e) from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fsync_dir(folder: str | Path) -> None:
    """Make a rename in `folder` durable (where the filesystem supports it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
