"""C7 guard for LayerNormMLP's activation math on the host (src/fp8/activation_math.h).

The header spells every operation out so that the CPU and CUDA give the same bits; that holds on
the host only where the compiler does not contract a*b+c into an fma, which g++ does by default
under -march=native. CMake compiles the one file that computes activations on the host,
src/fp8/activation_cpu.cpp, with -ffp-contract=off. Two ways that could silently break:

- the option is dropped from that file: checked on the build's compile_commands.json;
- another translation unit (compiled with contraction on) emits an out-of-line copy of an
  fp8dp::act:: function: the header's functions are inline, so the linker keeps one copy of each
  for the whole library, and it may be the contracted one. Checked with nm on every host object
  of the build: only activation_cpu.cpp may define them.

Skips without a build (make build) or without nm. Mutations tried (each then restored): the
COMPILE_OPTIONS line removed from CMakeLists.txt, then a reconfigure: the first test failed;
act::gelu marked noinline and called from src/fp8/activation.cpp: the second test failed, naming
activation.cpp.o and fp8dp::act::gelu.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "build" / "dev"


def _need_build():
    if not (BUILD / "compile_commands.json").exists():
        pytest.skip("no build/dev/compile_commands.json (make build)")


def test_the_activation_file_is_compiled_without_contraction():
    _need_build()
    cmds = json.loads((BUILD / "compile_commands.json").read_text())
    mine = [c for c in cmds if c["file"].endswith("src/fp8/activation_cpu.cpp")]
    assert len(mine) == 1, [c["file"] for c in cmds]
    assert "-ffp-contract=off" in mine[0]["command"], mine[0]["command"]


def test_no_other_host_object_defines_the_activation_math():
    _need_build()
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not installed")
    objs = [p for p in (BUILD / "CMakeFiles").rglob("*.o") if not p.name.endswith(".cu.o")]
    assert any(p.name == "activation_cpu.cpp.o" for p in objs), "the build has no activation_cpu"
    bad = {}
    for o in objs:
        if o.name == "activation_cpu.cpp.o":
            continue
        out = subprocess.run(
            [nm, "-C", "--defined-only", str(o)], capture_output=True, text=True, check=True
        ).stdout
        syms = [line for line in out.splitlines() if "fp8dp::act::" in line]
        if syms:
            bad[str(o.relative_to(REPO))] = syms[:4]
    assert not bad, f"out-of-line copies of activation_math.h outside activation_cpu.cpp: {bad}"
