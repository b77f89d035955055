"""Imports fp8dp._C, or raises an ImportError that says whether the extension is missing or does
not load, and how to build it. fp8dp/__init__.py imports this module first. Without it a missing
extension reads "cannot import name '_C' from partially initialized module 'fp8dp' (most likely
due to a circular import)", which sends a reader to the wrong place."""

import glob
import importlib.machinery
import os

import torch  # libtorch before the extension that links against it


def _error(e: ImportError) -> ImportError:
    """The ImportError for an fp8dp._C that does not import (module docstring)."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(
        f
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
        for f in glob.glob(f"{here}/_C{suffix}")
    )
    build = (
        "`make build` (in place: then PYTHONPATH=python imports it) or `pip install "
        "--no-build-isolation .` (into this environment), from the repository root"
    )
    if not found:
        return ImportError(
            f"fp8dp: the C++ extension fp8dp._C is not built (no _C*.so in {here}); build it "
            f"with {build}"
        )
    return ImportError(
        f"fp8dp: the C++ extension {found[0]} is there but does not load ({e}); it may be built "
        f"against another torch than this one ({torch.__version__}); rebuild it with {build}"
    )


try:
    from . import _C  # noqa: F401
except ImportError as e:
    raise _error(e) from None
