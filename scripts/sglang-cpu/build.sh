#!/usr/bin/env bash
# Build a real SGLang 0.5.23 environment that serves on an x86-64 CPU with AMX (the development
# machine), for the integration tier tests/integration/test_sglang_cpu.py. Reference: the shared
# notes sglang-cpu.md, and SGLang's own CPU recipe (docker/xeon.Dockerfile,
# docs/docs/hardware-platforms/cpu_server.mdx in SGLang's repository).
#
#   scripts/sglang-cpu/build.sh SOURCE [DEST]
#
# SOURCE  SGLang's repository at commit 44806dc5 (2026-08-21): a work tree, or a bare git directory
#         holding that commit. No CPU kernel wheel is published and SGLang ships no source
#         distribution after 0.5.10.post1, so the kernel is built from this source. The public
#         mirror github.com/xinguozhu-2026/sglang has that commit; on this machine it was brought
#         in with the session's repository fetch (a bare copy under /work/.mirror/...). Elsewhere:
#         git clone <the mirror> && git -C sglang checkout 44806dc5.
# DEST    where the environment goes (default /work/sglang-cpu; several GB: never inside the repo).
#
# What it does, each step skipped when already done (re-running is cheap):
#   1. Debian's libnuma-dev (the kernel links libnuma) if numa.h is missing.
#   2. A venv at DEST/.venv (Python 3.11: pip takes its pinned torch 2.14.1 from this machine's disk).
#   3. pip install sglang==0.5.23 with its pins (torch 2.14.1, a CUDA build that runs on the CPU).
#   4. The CPU kernel package sglang-kernel-cpu 0.4.6.post1 (module sgl_kernel, replacing the CUDA
#      package sglang-kernel that the sglang wheel pulls in) from SOURCE's
#      python/sglang/kernels/aot, built against that torch without build isolation, with the
#      C++ standard raised from 17 to 20 (torch 2.14's headers need it) and CUDA_HOME pointed at
#      the machine's toolkit (torch's CMake config looks for it). ~3 min on 2 idle cores.
#   5. A smoke check: sglang and sgl_kernel import, the CPU ops are registered.
# Afterwards: EYAS_SGLANG_CPU_PYTHON=DEST/.venv/bin/python runs the tier; DEST/build-info.json
# records what was built.
set -euo pipefail

COMMIT=44806dc507835746b67abebad041726c422030ea
SGLANG_VERSION=0.5.23
KERNEL_DIR=python/sglang/kernels/aot
PYTHON=${PYTHON:-python3.11}
JOBS=${JOBS:-2}

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  sed -n '2,27p' "$0" >&2
  exit 2
fi
SOURCE=$(realpath "$1")
DEST=$(realpath -m "${2:-/work/sglang-cpu}")
mkdir -p "$DEST/logs"
log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# --- 0. the source: a work tree at COMMIT, or a git dir that has it ----------------------------
if git -C "$SOURCE" rev-parse --is-bare-repository >/dev/null 2>&1 && \
   [ "$(git -C "$SOURCE" rev-parse --is-bare-repository)" = true ]; then
  GIT=(git --git-dir "$SOURCE")
  BARE=1
else
  GIT=(git -C "$SOURCE")
  BARE=0
fi
if ! "${GIT[@]}" cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
  echo "error: $SOURCE has no commit $COMMIT (SGLang's repository at 2026-08-21)" >&2
  exit 1
fi
if [ "$BARE" = 0 ] && [ "$("${GIT[@]}" rev-parse HEAD)" != "$COMMIT" ]; then
  echo "error: $SOURCE is checked out at $("${GIT[@]}" rev-parse --short HEAD), not ${COMMIT:0:9}" >&2
  exit 1
fi

# --- 1. libnuma's header ------------------------------------------------------------------------
if [ ! -e /usr/include/numa.h ]; then
  log "installing libnuma-dev"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libnuma-dev >/dev/null
fi

# --- 2. the venv --------------------------------------------------------------------------------
VENV="$DEST/.venv"
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PIP=(nice -n 10 "$VENV/bin/python" -m pip)

# --- 3. sglang and its pinned torch -------------------------------------------------------------
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" 2>/dev/null; then
  log "pip install sglang==$SGLANG_VERSION (its torch pin pulls a CUDA build of several GB)"
  "${PIP[@]}" install "sglang==$SGLANG_VERSION" >"$DEST/logs/pip-sglang.log" 2>&1 || {
    tail -20 "$DEST/logs/pip-sglang.log" >&2; exit 1; }
fi

# --- 4. the CPU kernel from source --------------------------------------------------------------
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('sglang-kernel-cpu')" 2>/dev/null; then
  SRC="$DEST/src/sglang-kernel-cpu"
  rm -rf "$SRC" && mkdir -p "$SRC"
  log "exporting $KERNEL_DIR at ${COMMIT:0:9} to $SRC"
  "${GIT[@]}" archive "$COMMIT" "$KERNEL_DIR" | tar -x -C "$SRC" --strip-components=4
  cd "$SRC"
  # SGLang's recipe: the CPU project file replaces the CUDA one. Its build requirement pins torch
  # 2.12.0; the build runs without isolation against the venv's torch instead.
  cp pyproject_cpu.toml pyproject.toml
  # torch 2.14's headers use C++20 features; the CMakeLists asks for 17.
  sed -i 's/set(CMAKE_CXX_STANDARD 17)/set(CMAKE_CXX_STANDARD 20)/' csrc/cpu/CMakeLists.txt
  grep -q 'CMAKE_CXX_STANDARD 20' csrc/cpu/CMakeLists.txt
  "${PIP[@]}" install -q scikit-build-core wheel ninja >>"$DEST/logs/pip-build-deps.log" 2>&1
  # sglang's wheel depends on the CUDA kernel package sglang-kernel, which owns the same module
  # name (sgl_kernel) and has no CPU ops; the CPU build replaces it, as SGLang's CPU recipe never
  # installs it (pip check then names the dependency as missing: expected).
  "${PIP[@]}" uninstall -y -q sglang-kernel 2>/dev/null || true
  log "building sglang-kernel-cpu with $JOBS jobs (minutes)"
  # torch's CMake config (Caffe2Config.cmake) insists on finding CUDA for a CUDA build of torch,
  # although nothing here compiles for a GPU; FindCUDA misses this image's layout (lib, not lib64
  # targets), so the paths are given outright.
  CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  CUDA_ARGS="-DCUDA_TOOLKIT_ROOT_DIR=$CUDA_HOME -DCUDA_INCLUDE_DIRS=$CUDA_HOME/include"
  CUDA_ARGS="$CUDA_ARGS -DCUDA_CUDART_LIBRARY=$CUDA_HOME/lib/libcudart.so"
  # The image's toolkit has no NVRTC; torch's own wheel dependency (nvidia/cu13) has, the one torch
  # loads at run time anyway.
  NVRTC=$(ls "$VENV"/lib/python3*/site-packages/nvidia/cu*/lib/libnvrtc.so.* 2>/dev/null | head -1)
  [ -n "$NVRTC" ] || NVRTC=$(ls "$CUDA_HOME"/lib*/libnvrtc.so* | head -1)
  CUDA_ARGS="$CUDA_ARGS -DCUDA_nvrtc_LIBRARY=$NVRTC"
  # A fixed arch list: otherwise torch's config test-compiles a CUDA program to detect GPUs, which
  # fails here (CMake 3.25 knows no CUDA20 dialect) and is pointless without a GPU.
  CUDA_HOME=$CUDA_HOME CMAKE_ARGS="$CUDA_ARGS" TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
    CMAKE_BUILD_PARALLEL_LEVEL=$JOBS MAX_JOBS=$JOBS \
    "${PIP[@]}" install -v --no-build-isolation --no-deps . >"$DEST/logs/kernel-build.log" 2>&1 || {
      tail -40 "$DEST/logs/kernel-build.log" >&2; exit 1; }
  cd - >/dev/null
fi

# --- 5. smoke check and record ------------------------------------------------------------------
log "checking the environment"
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" - "$DEST" "$COMMIT" <<'EOF'
import importlib.metadata as md, json, platform, sys, time
import torch, sgl_kernel, sglang  # noqa: F401
assert hasattr(torch.ops.sgl_kernel, "extend_attention_cpu"), "the CPU ops are not registered"
info = {"built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0],
        "machine": platform.machine(), "source_commit": sys.argv[2],
        "versions": {p: md.version(p) for p in ("sglang", "torch", "sglang-kernel-cpu", "transformers")},
        "sgl_kernel": sgl_kernel.__file__}
with open(f"{sys.argv[1]}/build-info.json", "w") as f:
    json.dump(info, f, indent=1)
print(json.dumps(info, indent=1))
EOF
log "done: EYAS_SGLANG_CPU_PYTHON=$VENV/bin/python"
