"""The disk read probe, run on the training host: the largest shard in the folder, else a temp file
it writes there (and removes), read once with its pages dropped from the page cache before
(posix_fadvise DONTNEED: no privileges needed) -> one JSON line.

    python -c SOURCE FOLDER BYTES
"""

import json
import os
import sys
import tempfile
import time


def main(folder: str, want: int) -> dict:
    entries = list(os.scandir(folder)) if os.path.isdir(folder) else []
    shards = sorted(
        (e.stat().st_size, e.path)
        for e in entries
        if e.name.endswith(".safetensors") and e.is_file()
    )
    temp = None
    if shards and shards[-1][0] >= want // 4:
        path = shards[-1][1]
    else:
        fd, temp = tempfile.mkstemp(prefix=".eyas-disk-probe-", dir=folder)
        block = os.urandom(1 << 20)
        for _ in range(want >> 20):
            os.write(fd, block)
        os.close(fd)
        path = temp
    try:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf, done = bytearray(16 << 20), 0
        t0 = time.perf_counter()
        while done < want:
            got = os.preadv(fd, [memoryview(buf)[: min(len(buf), want - done)]], done)
            if got <= 0:
                break
            done += got
        seconds = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    finally:
        if temp:
            os.unlink(temp)
    rate = done / max(seconds, 1e-9)
    return {"bytes_per_s": rate, "bytes": done, "file": path, "temp": bool(temp)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
