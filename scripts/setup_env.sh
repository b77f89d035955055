#!/usr/bin/env bash
# Set up everything fp8dp needs on a fresh Debian/Ubuntu machine: system packages (g++, cmake, ninja,
# GoogleTest), a virtual environment in .venv with torch and the Python tools. Idempotent: each step
# is skipped when what it installs is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TORCH_SPEC=${FP8DP_TORCH:-torch==2.13.0}   # the CPU build that lies on local disk; override for CUDA

log() { echo "[setup] $*"; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "[setup] need root for: $*" >&2; return 1; fi
}

# --- system packages -------------------------------------------------------------------------
need_apt=()
command -v g++ >/dev/null || need_apt+=(g++)
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v git >/dev/null || need_apt+=(git)
[ -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] || [ -f /usr/lib/aarch64-linux-gnu/cmake/GTest/GTestConfig.cmake ] \
  || [ -f /usr/src/googletest/CMakeLists.txt ] || need_apt+=(libgtest-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null; then
    log "installing system packages: ${need_apt[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "[setup] missing ${need_apt[*]} and no apt-get; install them by hand" >&2
    exit 1
  fi
fi

# --- Python environment ----------------------------------------------------------------------
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
VPY=.venv/bin/python
if ! $VPY -c "import torch" 2>/dev/null; then
  log "installing $TORCH_SPEC"
  $VPY -m pip install -q "$TORCH_SPEC"
fi
missing=$($VPY - <<'PY'
import importlib.util
mods = {"numpy": "numpy", "pytest": "pytest", "yaml": "pyyaml", "tqdm": "tqdm",
        "matplotlib": "matplotlib", "scikit_build_core": "scikit-build-core", "ninja": "ninja"}
print(" ".join(p for m, p in mods.items() if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  log "installing Python packages: $missing"
  $VPY -m pip install -q $missing
fi
log "ready: $($VPY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)')"
