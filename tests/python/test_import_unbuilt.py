"""`import fp8dp` without a loadable extension says what is wrong and how to build it.

Each test copies the Python package without its _C*.so into a temporary folder and imports it in a
subprocess with only that folder on PYTHONPATH (the tests' own fp8dp stays untouched):
- no extension at all: "fp8dp: the C++ extension fp8dp._C is not built ...; build it with `make
  build` ... or `pip install --no-build-isolation .`";
- an extension file that does not load (here: not an ELF file, as a file built against another
  torch fails with an undefined symbol): it names the file, the loader's reason and the same two
  commands.

Mutation tried (then reverted): fp8dp/__init__.py without `from . import _extension` (so `from .
import _C` comes first, as before the fix). Both tests fail at their first assertion: the
subprocess's last line is Python's "ImportError: cannot import name '_C' from partially
initialized module 'fp8dp' (most likely due to a circular import)" for the missing extension, and
the loader's bare "ImportError: .../_C.cpython-311-x86_64-linux-gnu.so: file too short" for the
broken one; neither names a build command.
"""

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fp8dp

PACKAGE = Path(fp8dp.__file__).resolve().parent


def _unbuilt_copy(tmp_path: Path) -> Path:
    dest = tmp_path / "site" / "fp8dp"
    shutil.copytree(
        PACKAGE, dest, ignore=shutil.ignore_patterns("_C*.so", "_C*.pyd", "__pycache__")
    )
    return dest


def _import_error(site: Path) -> str:
    """The last line of `python -c "import fp8dp"` with only `site` on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=str(site))
    p = subprocess.run(
        [sys.executable, "-c", "import fp8dp"],
        cwd=site,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0, "the copy without an extension imported"
    return p.stderr.strip().splitlines()[-1]


def test_missing_extension_says_how_to_build(tmp_path):
    pkg = _unbuilt_copy(tmp_path)
    last = _import_error(pkg.parent)
    assert last.startswith("ImportError: fp8dp: the C++ extension fp8dp._C is not built"), last
    assert f"(no _C*.so in {pkg})" in last, last
    assert "make build" in last and "pip install --no-build-isolation ." in last, last
    assert "circular import" not in last, last


def test_extension_that_does_not_load_names_file_and_reason(tmp_path):
    pkg = _unbuilt_copy(tmp_path)
    bad = pkg / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    bad.write_text("not a shared object\n")
    last = _import_error(pkg.parent)
    assert last.startswith(
        f"ImportError: fp8dp: the C++ extension {bad} is there but does not load ("
    ), last
    assert "make build" in last and "pip install --no-build-isolation ." in last, last
