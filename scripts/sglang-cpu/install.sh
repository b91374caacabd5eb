#!/usr/bin/env bash
# Install a real SGLang that serves on this x86-64 CPU (AMX or AVX512-BF16), from the registry plus a
# prebuilt CPU kernel wheel, for the real-SGLang tests (tests/integration/test_sglang_cpu*.py).
#
#   scripts/sglang-cpu/install.sh VERSION KERNEL_WHEEL [DEST]
#
# VERSION       0.5.23 (serves a Llama with aux capture) or 0.5.18 (serves DeepSeek-V3 with EAGLE3)
# KERNEL_WHEEL  sglang_kernel_cpu-*.whl built for that version: scripts/sglang-cpu/build.sh builds
#               one from SGLang's source; the development environment keeps prebuilt ones in
#               ../shared/sglang-cpu/<VERSION>/ (its README says how they were built).
# DEST          the environment (default ~/.cache/eyas-sglang-cpu/VERSION; about 8 GB: never
#               inside the repository). Prints the python to use on its last line.
#
# What it does (about 2 minutes; a second run finds DEST/ready.json and returns at once):
#   1. A Python 3.11 venv.
#   2. torch at the version the sglang wheel pins, from the registry: the CUDA build, which runs on
#      a CPU. This machine's CPU-only torch cannot serve: torchvision, which SGLang imports at start,
#      has only CUDA builds on the registry, and they do not load against a CPU-only torch.
#   3. sglang's own requirements, less two the registry cannot satisfy on a CPU machine:
#      `sglang-kernel` (the CUDA kernel, which owns the module name sgl_kernel that the CPU kernel
#      replaces) and a pre-release `cuda-tile` pin with no wheel. Then sglang itself with --no-deps.
#   4. The CPU kernel wheel with --no-deps.
#   5. Fixes to SGLang's CPU path from scripts/sglang-cpu/patches/VERSION/ (each file says what it
#      fixes; none touches what a GPU runs), applied to the installed package.
#   6. A smoke check: sglang and sgl_kernel import and the CPU attention op is registered.
set -euo pipefail

if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  sed -n '2,25p' "$0" >&2
  exit 2
fi
VERSION=$1
KERNEL=$(realpath "$2")
DEST=$(realpath -m "${3:-$HOME/.cache/eyas-sglang-cpu/$VERSION}")
PYTHON=${PYTHON:-python3.11}
SKIP="sglang-kernel cuda-tile"
[ -f "$KERNEL" ] || { echo "error: no kernel wheel at $2" >&2; exit 1; }
KERNEL_SHA=$(sha256sum "$KERNEL" | cut -d' ' -f1)
FIXES=$(dirname "$(realpath "$0")")/patches/$VERSION
# One hash over the kernel and the fixes: a changed fix means a reinstall, like a changed kernel.
# (a version with no fixes has no folder: its hash is the kernel's alone, hashed once more)
BUILD_SHA=$( { echo "$KERNEL_SHA"; cat "$FIXES"/*.patch 2>/dev/null || true; } | sha256sum | cut -d' ' -f1)
log() { printf '[%s] sglang-cpu %s: %s\n' "$(date +%H:%M:%S)" "$VERSION" "$*" >&2; }

# The stamp names what was installed: another version or kernel wheel means a rebuild.
STAMP="$DEST/ready.json"
if [ -f "$STAMP" ] && grep -q "\"sglang\": \"$VERSION\"" "$STAMP" && grep -q "$BUILD_SHA" "$STAMP" \
   && [ -x "$DEST/bin/python" ]; then
  log "ready ($STAMP)"
  echo "$DEST/bin/python"
  exit 0
fi

rm -rf "$DEST"
mkdir -p "$DEST"
"$PYTHON" -m venv "$DEST"
# Registry packages only: this machine's pip settings add a folder of CPU-only wheels, which would
# put a CPU-only torch under the registry's torchvision (step 2).
PIP=(env PIP_FIND_LINKS= PIP_CONFIG_FILE=/dev/null "$DEST/bin/python" -m pip -q --disable-pip-version-check)
LOGFILE="$DEST/install.log"
run() { "$@" >>"$LOGFILE" 2>&1 || { tail -30 "$LOGFILE" >&2; exit 1; }; }

log "fetching sglang==$VERSION"
WHEELS="$DEST/wheels"
run "${PIP[@]}" download --no-deps -d "$WHEELS" "sglang==$VERSION"
run "${PIP[@]}" install packaging
"$DEST/bin/python" - "$WHEELS"/sglang-"$VERSION"-*.whl $SKIP >"$DEST/requirements.txt" <<'EOF'
import sys, zipfile
from packaging.requirements import Requirement

wheel, *skip = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1].strip())
        if (req.marker is None or req.marker.evaluate({"extra": ""})) and req.name.lower() not in skip:
            req.marker = None
            print(req)
EOF
log "installing its requirements ($(wc -l <"$DEST/requirements.txt") packages, torch $(grep '^torch==' "$DEST/requirements.txt"))"
run "${PIP[@]}" install -r "$DEST/requirements.txt"
run "${PIP[@]}" install --no-deps "$WHEELS"/sglang-"$VERSION"-*.whl "$KERNEL"
rm -rf "$WHEELS"
SITE=$("$DEST/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for fix in "$FIXES"/*.patch; do
  [ -f "$fix" ] || continue
  log "applying $(basename "$fix")"
  run patch -p1 -d "$SITE" --forward --batch -i "$fix"
done

log "checking"
SGLANG_USE_CPU_ENGINE=1 "$DEST/bin/python" - "$STAMP" "$KERNEL_SHA" "$BUILD_SHA" <<'EOF' >>"$LOGFILE" 2>&1 || { tail -30 "$LOGFILE" >&2; exit 1; }
import importlib.metadata as md, json, os, sys
import sgl_kernel, sglang, torch  # noqa: F401
assert hasattr(torch.ops.sgl_kernel, "extend_attention_cpu"), "the CPU kernel's ops are not registered"
info = {"sglang": md.version("sglang"), "torch": md.version("torch"), "kernel_sha256": sys.argv[2],
        "build_sha256": sys.argv[3], "transformers": md.version("transformers")}
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(info, f)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
print(info)
EOF
log "ready in $DEST"
echo "$DEST/bin/python"
