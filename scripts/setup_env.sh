#!/usr/bin/env bash
# Set up everything `make demo` and `make test` need on a fresh Debian/Ubuntu machine: system
# packages (g++, cmake, ninja, GoogleTest) and a virtual environment in .venv with torch and the
# Python packages of pyproject.toml (dependencies, build-system.requires, extras demo and test).
# Idempotent: each step is skipped when what it installs is already there.
#
# Which torch: fp8dp is compiled against the torch it runs with. When the Python that creates .venv
# (PYTHON, default python3) already imports a CUDA torch, as in a framework container, .venv reuses
# that Python's packages (torch included) instead of installing another torch; otherwise it gets
# FP8DP_TORCH (default: the CPU build on this project's CI disk). FP8DP_SYSTEM_TORCH=1 forces the
# reuse (a CPU torch too), FP8DP_SYSTEM_TORCH=0 forbids it. The decision is made when .venv is
# created: `rm -rf .venv` to make it again.
#
# The formatters (extra "format": pinned ruff, black, clang-format) are installed when they can be;
# without them (offline, say) setup still succeeds and `make test` skips the format check, except
# under CI=true, where it fails.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TORCH_SPEC=${FP8DP_TORCH:-torch==2.13.0}   # the CPU build that lies on local disk; override for CUDA
SYSTEM_TORCH=${FP8DP_SYSTEM_TORCH:-auto}   # auto | 1 | 0, see above

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
# ccache is optional: with it, `make test`'s wheel check reuses make build's objects instead of
# compiling the extension a second time. Offline (the GPU machine) it is skipped with a message.
if ! command -v ccache >/dev/null && command -v apt-get >/dev/null; then
  log "installing ccache (optional)"
  { as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq ccache; } \
    >/dev/null 2>&1 || log "ccache not installable here (offline?): the wheel check compiles again"
fi

# --- which torch -----------------------------------------------------------------------------
# Prints "version cuda" of the torch that $PY imports, or nothing.
system_torch=$($PY -c 'import torch; print(torch.__version__, torch.version.cuda or "none")' 2>/dev/null || true)

# .venv sees the packages of $PY through a .pth file that calls site.addsitedir on each of $PY's
# site-packages (after .venv's own, so what .venv installs wins). Not `venv --system-site-packages`:
# when $PY is itself a virtual environment (a container's /opt/.../.venv), that flag reaches the
# base interpreter's packages, not $PY's, and torch would be missing.
reuse_packages_of() {
  local dirs site
  dirs=$($1 -c 'import site; print(site.getsitepackages() + [site.getusersitepackages()] * (site.ENABLE_USER_SITE is True))')
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # map, not a comprehension: before Python 3.12 a comprehension in a .pth line cannot see `site`.
  {
    echo "# Written by scripts/setup_env.sh: the packages of $1 (torch among them), after .venv's own."
    echo "import site; list(map(site.addsitedir, $dirs))"
  } >"$site/_fp8dp_system_packages.pth"
}

if [ ! -x .venv/bin/python ]; then
  reuse=0
  case "$SYSTEM_TORCH" in
    1) [ -n "$system_torch" ] || { echo "[setup] FP8DP_SYSTEM_TORCH=1 but $PY does not import torch" >&2; exit 1; }
       reuse=1; why="FP8DP_SYSTEM_TORCH=1" ;;
    0) why="FP8DP_SYSTEM_TORCH=0" ;;
    auto)
      if [ -n "$system_torch" ] && [ "${system_torch#* }" != none ]; then
        reuse=1; why="it has a CUDA torch; FP8DP_SYSTEM_TORCH=0 installs $TORCH_SPEC instead"
      elif [ -n "$system_torch" ]; then
        why="its torch ${system_torch% *} has no CUDA; FP8DP_SYSTEM_TORCH=1 reuses it"
      else
        why="it has no torch"
      fi ;;
    *) echo "[setup] FP8DP_SYSTEM_TORCH: expected auto, 1 or 0, got '$SYSTEM_TORCH'" >&2; exit 1 ;;
  esac
  $PY -m venv .venv
  if [ $reuse = 1 ]; then
    reuse_packages_of "$(command -v "$PY")"
    log "created .venv reusing the packages of $PY (torch ${system_torch% *}, CUDA ${system_torch#* }): $why"
  else
    log "created .venv with $($PY --version), torch to be installed ($TORCH_SPEC): $PY: $why"
  fi
else
  log "keeping the existing .venv (rm -rf .venv to set it up again)"
fi
VPY=.venv/bin/python
if ! $VPY -c "import torch" 2>/dev/null; then
  log "installing $TORCH_SPEC"
  $VPY -m pip install -q "$TORCH_SPEC"
fi

# --- Python packages -------------------------------------------------------------------------
# Everything but the formatters must be there: a failure stops setup.
missing=$($VPY scripts/requirements.py --missing --exclude format dependencies build demo test)
if [ -n "$missing" ]; then
  log "installing Python packages: $(echo $missing)"
  # shellcheck disable=SC2086
  $VPY -m pip install -q $missing
fi
# The formatters when they can be installed; without a network pip gives up fast (no retries).
missing=$($VPY scripts/requirements.py --missing format)
if [ -n "$missing" ]; then
  log "installing the formatters: $(echo $missing)"
  # shellcheck disable=SC2086
  if ! $VPY -m pip install -q --retries 0 --timeout 15 $missing; then
    log "could not install the formatters (offline?): make test skips the format check (fails under CI=true)"
  fi
fi
log "ready: $($VPY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "from", torch.__file__.rsplit("/", 2)[0])')"
