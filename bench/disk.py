"""Reading shards from the disk, not the page cache, for the loader and training benchmarks."""

from __future__ import annotations

import os
import time


def drop_cache(path) -> None:
    """Ask the kernel to forget path's pages (written ones first go to disk): the next read comes
    from the disk. posix_fadvise(DONTNEED) needs no privileges; it is advice, and a host below a
    virtual machine may still hold the file in its own cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_read_rate(path, max_bytes: int = 512 << 20, chunk: int = 16 << 20) -> tuple[float, int]:
    """(bytes/s, bytes read): up to max_bytes of path read sequentially, from the disk (the file's
    pages dropped from the page cache first, and again after: the probe leaves no cache behind)."""
    drop_cache(path)
    buf = bytearray(chunk)
    view, done = memoryview(buf), 0
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        while done < max_bytes:
            got = os.preadv(fd, [view[: min(chunk, max_bytes - done)]], done)
            if got <= 0:
                break
            done += got
        seconds = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return (done / seconds if seconds > 0 else float("inf")), done
