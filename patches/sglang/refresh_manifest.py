"""Recompute a patch set's manifest.json from the real SGLang wheel, after editing its files.

    pip download sglang==0.5.23 --no-deps -d /tmp/wheels
    python patches/sglang/refresh_manifest.py 0.5.23 /tmp/wheels/sglang-0.5.23-*.whl

For every file already listed in the manifest it reads the original from the wheel, applies the
patch (strictly, as the patch stage does), checks that the result compiles, and writes both
sha256s; it also records the sha256 of the hook module (patches/sglang/eyas_sglang_hook.py, one for
every version). Bump `patch_version` by hand when the installed
bytes change, so that extraction caches keyed on it are not reused.
"""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eyas.server.patch_sets import PATCHES_DIR, apply_diff, hook_source  # noqa: E402


def refresh(version: str, wheel: Path) -> dict:
    folder = PATCHES_DIR / version
    manifest = json.loads((folder / "manifest.json").read_text())
    with zipfile.ZipFile(wheel) as z:
        for entry in manifest["files"]:
            original = z.read(entry["path"])
            diff = (folder / entry["patch"]).read_text()
            patched = apply_diff(original.decode(), diff, name=entry["path"]).encode()
            compile(patched, entry["path"], "exec")
            entry["original_sha256"] = hashlib.sha256(original).hexdigest()
            entry["patched_sha256"] = hashlib.sha256(patched).hexdigest()
    hook = manifest["hook"]
    hook["sha256"] = hashlib.sha256(hook_source(hook["module"]).read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(json.dumps(refresh(sys.argv[1], Path(sys.argv[2])), indent=2))
