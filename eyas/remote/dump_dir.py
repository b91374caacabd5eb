"""A server's dump folder on its host: made and marked as eyas's, or cleaned of eyas's records only
(record folders named like rids, holding nothing but dump records); anything else in it is foreign
and left alone. One JSON line: the folder's state, and what foreign entries there are.

    python -c SOURCE prepare|clean PATH CONFIG_NAME
"""

import json
import os
import re
import shutil
import sys
import time

MARK = ".eyas-owned"
RID = re.compile(r"[A-Za-z0-9_.:-]+")
REC = re.compile(r"\d{10}\.safetensors|\.\d{10}\.safetensors\.tmp-.+")


def ours(path: str, e: str) -> bool:
    p = os.path.join(path, e)
    if e == MARK:
        return True
    if os.path.islink(p) or not os.path.isdir(p) or not RID.fullmatch(e) or ".." in e:
        return False
    return all(REC.fullmatch(f) and not os.path.islink(os.path.join(p, f)) for f in os.listdir(p))


def mark(path: str, name: str, created: bool) -> None:
    with open(os.path.join(path, MARK), "w") as f:
        json.dump(
            {
                "owner": "eyas",
                "what": "server.dump_dir",
                "created": created,
                "config": name,
                "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            },
            f,
        )


def remove_records(path: str, entries: list[str]) -> None:
    for e in entries:
        if e != MARK and ours(path, e):
            shutil.rmtree(os.path.join(path, e))


def main(action: str, path: str, name: str) -> dict:
    if not os.path.lexists(path):
        if action == "prepare":
            os.makedirs(path)
            mark(path, name, True)
        return {"state": "created" if action == "prepare" else "absent"}
    if not os.path.isdir(path):
        return {"state": "refused", "foreign": [path + " is not a folder"]}
    entries = sorted(os.listdir(path))
    foreign = [e for e in entries if not ours(path, e)]
    marker = os.path.join(path, MARK)
    created = os.path.exists(marker) and json.load(open(marker)).get("created") is True
    if action == "prepare":
        if foreign:
            return {"state": "refused", "foreign": foreign[:5], "count": len(foreign)}
        remove_records(path, entries)
        if MARK not in entries:
            mark(path, name, False)
        return {"state": "ready"}
    if MARK not in entries:
        return {"state": "left alone: no " + MARK + " marker (not a folder eyas made)"}
    remove_records(path, entries)
    if foreign:
        return {
            "state": "records removed; other files left",
            "foreign": foreign[:5],
            "count": len(foreign),
        }
    if created:
        os.remove(marker)
        os.rmdir(path)
        return {"state": "removed"}
    return {"state": "records removed (folder kept: eyas did not create it)"}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
