"""The include graph of src/ keeps its layers (scripts/check_includes.py): common < fp8, norm, gemm
< comm, grad_buffer, modules < python, no include cycle, no cycle between folders.

The real tree must pass; copies of it with one bad include added must fail, naming the include.
Exact expected values: the script's lines for the one edit made.

Mutations tried: an upward include (src/fp8/format.h including "modules/linear_core.h", in a
copy of src/) -> the script printed "upward include: fp8/format.h (layer 1, fp8) includes
modules/linear_core.h (layer 2, modules)", "include cycle: fp8/format.h -> modules/linear_core.h
-> fp8/recipe.h -> fp8/format.h" and "folder cycle: fp8 -> modules -> fp8", so
test_src_keeps_its_layers fails on such a tree; upward_includes() returning [] ->
test_an_upward_include_is_reported and test_a_folder_without_a_layer_is_reported failed (no
error); find_cycle() returning [] -> test_an_include_cycle_is_reported and
test_a_cycle_between_folders_of_one_layer_is_reported failed (no error).
"""

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_includes", ROOT / "scripts/check_includes.py")
check_includes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_includes)


def test_src_keeps_its_layers():
    assert check_includes.check(ROOT / "src") == []


@pytest.fixture
def src_copy(tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(ROOT / "src", dst, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return dst


def _add_include(src: Path, file: str, target: str):
    p = src / file
    p.write_text(f'#include "{target}"\n' + p.read_text())


def test_an_upward_include_is_reported(src_copy):
    _add_include(src_copy, "common/check.h", "grad_buffer/layout.h")
    errors = check_includes.check(src_copy)
    assert (
        "upward include: common/check.h (layer 0, common) includes grad_buffer/layout.h "
        "(layer 2, grad_buffer)" in errors
    )


def test_an_include_cycle_is_reported(src_copy):
    # layout.h includes nothing of ours; layout.cpp includes layout.h: make the headers a circle.
    (src_copy / "grad_buffer/readiness.h").write_text(
        '#include "grad_buffer/layout.h"\n' + (src_copy / "grad_buffer/readiness.h").read_text()
    )
    _add_include(src_copy, "grad_buffer/layout.h", "grad_buffer/readiness.h")
    errors = check_includes.check(src_copy)
    cycles = [e for e in errors if e.startswith("include cycle: ")]
    assert len(cycles) == 1, errors
    assert "grad_buffer/layout.h" in cycles[0] and "grad_buffer/readiness.h" in cycles[0]


def test_a_cycle_between_folders_of_one_layer_is_reported(src_copy):
    # norm includes fp8 today; fp8 including norm makes the two folders a circle (same layer, so
    # not an upward include).
    _add_include(src_copy, "fp8/recipe.cpp", "norm/norm_kernel.h")
    errors = check_includes.check(src_copy)
    assert errors == ["folder cycle: fp8 -> norm -> fp8"], errors


def test_a_folder_without_a_layer_is_reported(src_copy):
    (src_copy / "extra").mkdir()
    (src_copy / "extra/x.h").write_text('#include "common/check.h"\n')
    errors = check_includes.check(src_copy)
    assert "extra/x.h: folder 'extra' has no layer (add it to LAYERS)" in errors
