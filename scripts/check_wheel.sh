#!/usr/bin/env bash
# `make test-wheel`: build fp8dp's wheel the way the README tells users to install it
# (`pip wheel --no-build-isolation`, against the torch in .venv), install it into a fresh virtual
# environment and use it there, away from the source tree: the wheel holds the extension and every
# Python file of the package, declares only what it imports, and runs an FP8 forward and backward.
#
# The fresh environment gets .venv's packages (torch) through a .pth file rather than its own
# torch: installing one would take minutes, and the extension must load with the torch it was built
# against anyway. ccache, when present, makes the wheel's compile reuse `make build`'s objects.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=build/wheel-check
VPY=$ROOT/.venv/bin/python
t0=$SECONDS
rm -rf "$WORK"
mkdir -p "$WORK"

defines=()
if command -v ccache >/dev/null; then
  defines+=(-Ccmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache
            -Ccmake.define.CMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  # ccache hits only for the same compiler command: scikit-build-core picks Python's CXX (g++)
  # where CMake alone picks c++, so take the compilers `make build` configured.
  for lang in CXX CUDA; do
    c=$(sed -n "s/^CMAKE_${lang}_COMPILER:[A-Z]*=//p" "${BUILD:-build/dev}/CMakeCache.txt" 2>/dev/null)
    [ -z "$c" ] || defines+=("-Ccmake.define.CMAKE_${lang}_COMPILER=$c")
  done
fi
echo "[wheel] building (pip wheel --no-build-isolation)${defines:+ with ccache}"
"$VPY" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/dist" "${defines[@]}" . \
  >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; echo "[wheel] FAILED: build" >&2; exit 1; }
wheel=$(ls "$WORK"/dist/fp8dp-*.whl)

# The wheel holds every tracked Python file of the package, one extension and no bytecode.
"$VPY" - "$wheel" <<'PY'
import subprocess, sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
tracked = subprocess.run(["git", "ls-files", "python/fp8dp/*.py"], capture_output=True, text=True,
                         check=True).stdout.split()
missing = [t for t in tracked if t.removeprefix("python/") not in names]
ext = [n for n in names if n.startswith("fp8dp/_C") and n.endswith(".so")]
stray = [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
meta = next(zipfile.ZipFile(sys.argv[1]).read(n).decode() for n in names if n.endswith("/METADATA"))
requires = [l.split(":", 1)[1].strip() for l in meta.splitlines()
            if l.startswith("Requires-Dist:") and "extra ==" not in l]
problems = []
if missing:
    problems.append(f"missing {missing}")
if len(ext) != 1:
    problems.append(f"expected one fp8dp/_C*.so, got {ext}")
if stray:
    problems.append(f"stray files {stray[:5]}")
if requires != ["torch"]:
    problems.append(f"expected Requires-Dist torch only (what the library imports), got {requires}")
if problems:
    sys.exit(f"[wheel] FAILED: {sys.argv[1]}: " + "; ".join(problems))
print(f"[wheel] {sys.argv[1].rsplit('/', 1)[1]}: {len(names)} files, {ext[0]}, requires {requires}")
PY

# A fresh environment; first without torch, as pip's build isolation leaves it: CMake must stop
# before probing a compiler, with the one line that says --no-build-isolation (the README quotes it).
"$VPY" -m venv --without-pip "$WORK/venv"
if PYTHONPATH=/tmp/pip-build-env-check/site cmake -S . -B "$WORK/isolated" \
    -DPython3_EXECUTABLE="$ROOT/$WORK/venv/bin/python" >"$WORK/isolated.log" 2>&1; then
  echo "[wheel] FAILED: CMake configured without torch" >&2; exit 1
fi
msg="fp8dp: pip's build isolation hides your torch; install fp8dp with \`pip install --no-build-isolation .\` into the environment that has torch"
grep -qxF "   $msg" "$WORK/isolated.log" \
  || { cat "$WORK/isolated.log"; echo "[wheel] FAILED: isolated build message" >&2; exit 1; }
! grep -q "compiler identification" "$WORK/isolated.log" || { echo "[wheel] FAILED: not early" >&2; exit 1; }
echo "[wheel] an isolated build stops before any compiler probe: $msg"

# Now it sees .venv's packages (torch), not the source tree.
site=$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
parent=$("$VPY" -c 'import site; print(site.getsitepackages())')
# map, not a comprehension: before Python 3.12 a comprehension in a .pth line cannot see `site`.
echo "import site; list(map(site.addsitedir, $parent))" >"$site/_parent_packages.pth"
# .venv's pip installs into the fresh environment; --no-index: the dependencies it declares must
# already be there (torch, from .venv), nothing is downloaded.
"$VPY" -m pip --python "$WORK/venv/bin/python" install -q --no-index "$wheel" \
  || { echo "[wheel] FAILED: install" >&2; exit 1; }

cd /tmp
env -u PYTHONPATH "$ROOT/$WORK/venv/bin/python" - "$ROOT/$WORK/venv" <<'PY'
import sys
import torch
import fp8dp

venv = sys.argv[1]
assert fp8dp.__file__.startswith(venv), f"fp8dp imported from {fp8dp.__file__}, not from {venv}"
lin = fp8dp.Linear(32, 16)
x = torch.randn(16, 32, requires_grad=True)
with fp8dp.fp8_autocast(fp8_recipe=fp8dp.DelayedScaling(amax_history_len=4)):
    y = lin(x)
y.sum().backward()
assert y.shape == (16, 16) and torch.isfinite(x.grad).all() and lin.weight.grad is not None
print(f"[wheel] imported from {fp8dp.__file__.rsplit('/', 3)[0]}/..., FP8 forward and backward ran;",
      f"torch {torch.__version__}, build_info {fp8dp.build_info()}")
PY
echo "[wheel] OK in $((SECONDS - t0)) s"
