#!/usr/bin/env bash
# `make format` (fix) and `make format-check` (check): clang-format over the git-tracked C++/CUDA
# files of src/ and tests/cpp, ruff and black over the Python of python, tests, bench, dev,
# scripts and the root conftest.py, with the versions pinned in pyproject.toml's extra "format",
# as installed in .venv by scripts/setup_env.sh. Any other version formats differently, so it is
# refused.
#
# Without the pinned tools (setup could not install them: offline) the check is skipped with a
# message, except under CI=true, where it fails: CI must never pass a format check it did not run.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-check}
BIN=.venv/bin
PY_DIRS=(python tests bench dev scripts conftest.py)
mapfile -t CXX_FILES < <(git ls-files 'src/*.h' 'src/*.cpp' 'src/*.cu' 'src/*.cuh' \
  'tests/cpp/*.h' 'tests/cpp/*.cpp' 'tests/cpp/*.cu')

# The pinned versions, checked against what each tool reports.
problems=()
while read -r req; do
  tool=${req%%==*}
  want=${req#*==}
  if [ ! -x "$BIN/$tool" ]; then
    problems+=("$tool not installed in .venv (want $want)")
  elif ! "$BIN/$tool" --version 2>/dev/null | head -1 | grep -qw -- "$want"; then
    problems+=("$BIN/$tool is $("$BIN/$tool" --version | head -1), want $want")
  fi
done < <(.venv/bin/python scripts/requirements.py format)
if [ ${#problems[@]} -gt 0 ]; then
  msg="format $mode: $(IFS=';'; echo "${problems[*]}"); run scripts/setup_env.sh (needs the network)"
  if [ "$mode" = check ] && [ "${CI:-}" != true ]; then
    echo "[format] SKIPPED: $msg" >&2
    exit 0
  fi
  echo "[format] FAILED: $msg" >&2
  exit 1
fi

# Every tool runs, and each failure is reported, before the script fails.
failed=()
case "$mode" in
  fix)
    "$BIN/clang-format" -i "${CXX_FILES[@]}" || failed+=(clang-format)
    # ruff before black, so that black has the last word on layout; ruff fails on what it cannot fix.
    "$BIN/ruff" check --fix -q "${PY_DIRS[@]}" || failed+=("ruff (fix the rest by hand)")
    "$BIN/black" -q "${PY_DIRS[@]}" || failed+=(black)
    ;;
  check)
    "$BIN/clang-format" --dry-run -Werror "${CXX_FILES[@]}" || failed+=(clang-format)
    "$BIN/ruff" check "${PY_DIRS[@]}" || failed+=(ruff)
    "$BIN/black" --check "${PY_DIRS[@]}" || failed+=(black)
    ;;
  *)
    echo "usage: scripts/format.sh check|fix" >&2
    exit 2
    ;;
esac
if [ ${#failed[@]} -gt 0 ]; then
  hint=""
  [ "$mode" = check ] && hint=" (make format fixes what it can)"
  echo "[format] FAILED: ${failed[*]}$hint" >&2
  exit 1
fi
echo "[format] $mode: ok, ${#CXX_FILES[@]} C++/CUDA files and the Python in ${PY_DIRS[*]}"
