"""Writing and hashing files the way every stage does: JSON replaced atomically (a reader sees the
old file or the new one, never half), a file's sha256 read in blocks, and a full disk reported as
one DiskFull naming the file, its folder and the free bytes there.

    write_json_atomic(run_dir / "report.json", report)
    digest = sha256_file(shard_path)
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

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
        f"disk full writing {path}: {free} in {path.parent} "
        f"({os.strerror(e.errno)}); "
        f"the partial file was removed. Free space there (or move the output) "
        f"and run "
        f"again",
        str(path),
    )


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """obj as indented, key-sorted JSON at path, through a temp file beside it (fsynced, then
    renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if is_disk_full(e):
            raise disk_full(path, e) from e
        raise
    os.replace(tmp, path)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
