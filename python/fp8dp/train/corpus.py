"""A real corpus on every machine without a download: the Python source files of the running
interpreter's standard library (and of installed packages, e.g. torch, when more bytes are
needed), as bytes.

Collection is deterministic: every root is walked in sorted order and each file is named by a
label and its path under the root ("stdlib/json/decoder.py", "torch/nn/modules/linear.py"), so the
same installation gives the same list on every machine. A file goes to the validation split when
the SHA-256 of its name falls below val_fraction: a file is never in both splits, and adding or
removing other files moves no file from one split to the other.

The files are concatenated once into train.bin / val.bin (uint8, each file followed by one NUL
byte, which Python source never contains, so the model sees where files end) in a cache directory
named after the listing (names, sizes, mtimes), next to manifest.json: every file with its split,
size and SHA-256, and the corpus hash over them. Training opens the .bin files with np.memmap: no
Python string per file, and the pages are shared by the ranks of a machine.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sysconfig

import numpy as np

FORMAT = 1  # bump when the layout of the .bin files or the manifest changes
SEPARATOR = b"\0"
# Never source of the standard library: the installed packages live under it in some layouts.
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}


def source_roots(packages) -> list:
    """[(label, directory)]: the standard library, then each package in the order given. A package
    that is not installed, or is a single module, is a ValueError naming it."""
    roots = [("stdlib", sysconfig.get_paths()["stdlib"])]
    for name in packages:
        spec = importlib.util.find_spec(name) if isinstance(name, str) and name else None
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"data.packages: expected names of installed packages (directories of .py files), "
                f"got {name!r}, which this interpreter cannot import as a package"
            )
        roots.append((name, sorted(spec.submodule_search_locations)[0]))
    return roots


def list_files(roots) -> list:
    """[(name, path)] of every .py file under the roots, sorted by name; a name appears once."""
    out = {}
    for label, root in roots:
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
            for f in sorted(files):
                path = os.path.join(d, f)
                if f.endswith(".py") and os.path.isfile(path):
                    rel = os.path.relpath(path, root).replace(os.sep, "/")
                    out.setdefault(f"{label}/{rel}", path)
    return sorted(out.items())


def is_val(name: str, val_fraction: float) -> bool:
    """The file's split, from its name alone (the first 8 bytes of its SHA-256 as a fraction)."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return h < val_fraction * 2.0**64


def _listing_key(files, val_fraction: float) -> str:
    # Names, sizes and mtimes decide whether a cache is still this installation's; the content
    # hash (computed once, when building) is what the metadata reports.
    h = hashlib.sha256(json.dumps([FORMAT, val_fraction]).encode())
    for name, path in files:
        st = os.stat(path)
        h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def build(packages, val_fraction: float, cache_dir: str, roots=None) -> str:
    """The cache directory of this corpus, built if missing; returns its path. Concurrent builders
    each write a private temporary directory and rename it into place: the result is whole.
    roots: [(label, directory)] instead of source_roots(packages) (tests)."""
    roots = source_roots(packages) if roots is None else roots
    files = list_files(roots)
    if not files:
        raise ValueError(f"data.corpus: python: no .py files found under {roots}")
    out = os.path.join(cache_dir, f"python-{_listing_key(files, val_fraction)}")
    if os.path.exists(os.path.join(out, "manifest.json")):
        return out
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    entries, sizes = [], {"train": 0, "val": 0}
    with (
        open(os.path.join(tmp, "train.bin"), "wb") as ft,
        open(os.path.join(tmp, "val.bin"), "wb") as fv,
    ):
        for name, path in files:
            with open(path, "rb") as f:
                data = f.read()
            split = "val" if is_val(name, val_fraction) else "train"
            (fv if split == "val" else ft).write(data + SEPARATOR)
            sizes[split] += len(data) + 1
            entries.append([name, split, len(data), hashlib.sha256(data).hexdigest()])
    corpus_hash = hashlib.sha256(json.dumps(entries).encode()).hexdigest()
    manifest = {
        "format": FORMAT,
        "corpus": "python",
        "packages": list(packages),
        "roots": [[label, root] for label, root in roots],
        "val_fraction": val_fraction,
        "files": len(entries),
        "bytes": sizes,
        "sha256": corpus_hash,
        "entries": entries,  # [name, split, bytes, sha256 of the file]
    }
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    try:
        os.replace(tmp, out)
    except OSError:  # another builder was first; its copy is the same corpus
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_manifest(corpus_dir: str) -> dict:
    with open(os.path.join(corpus_dir, "manifest.json")) as f:
        return json.load(f)


def open_split(corpus_dir: str, split: str) -> np.memmap:
    """One split as a read-only uint8 memmap."""
    return np.memmap(os.path.join(corpus_dir, f"{split}.bin"), dtype=np.uint8, mode="r")
