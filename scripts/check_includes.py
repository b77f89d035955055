#!/usr/bin/env python3
"""Checks the include graph of src/: no include cycle and no upward include.

The layers, lowest first (a file may include its own layer's and lower layers' headers only):

    0  common                       check macros, dtypes, CUDA checks: depends on nothing of ours
    1  fp8, norm, gemm              kernels and their tensor-level front ends
    2  comm, grad_buffer, modules   orchestration: communicators, gradient buffers, Linear modules
    3  python                       pybind11 bindings only

Within a layer the folders must not depend on each other in a circle either (today fp8 < norm,
gemm and comm < grad_buffer < modules), so that each folder can be read, built and tested with
only what lies below it. And no file may reach itself through its includes.

Includes are resolved as the build does: "dir/file.h" from src/, else relative to the including
file. <...> includes (system, CUDA, torch) are not ours and are ignored here; which files may use
torch is enforced by the linker (the torch-free fp8dp_kernels target, CMakeLists.txt).

Usage: scripts/check_includes.py [SRC_DIR]; prints one line per violation and exits 1 if any.
"""

import re
import sys
from pathlib import Path

LAYERS = {
    "common": 0,
    "fp8": 1,
    "norm": 1,
    "gemm": 1,
    "comm": 2,
    "grad_buffer": 2,
    "modules": 2,
    "python": 3,
}
_SUFFIXES = (".h", ".cuh", ".cpp", ".cu")
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def include_graph(src: Path) -> dict:
    """{file: [included files]} over src/, paths relative to src (posix strings)."""
    files = sorted(p for p in src.rglob("*") if p.suffix in _SUFFIXES and p.is_file())
    graph = {}
    for f in files:
        rel = f.relative_to(src).as_posix()
        targets = []
        for name in _INCLUDE.findall(f.read_text(errors="replace")):
            for cand in (src / name, f.parent / name):
                if cand.is_file():
                    targets.append(cand.resolve().relative_to(src.resolve()).as_posix())
                    break
        graph[rel] = targets
    return graph


def folder(path: str) -> str:
    return path.split("/", 1)[0]


def upward_includes(graph: dict) -> list:
    errors = []
    for f, targets in graph.items():
        for t in targets:
            lf, lt = LAYERS.get(folder(f)), LAYERS.get(folder(t))
            if lf is None:
                errors.append(f"{f}: folder '{folder(f)}' has no layer (add it to LAYERS)")
                break
            if lt is not None and lt > lf:
                errors.append(
                    f"upward include: {f} (layer {lf}, {folder(f)}) includes {t} "
                    f"(layer {lt}, {folder(t)})"
                )
    return errors


def find_cycle(graph: dict) -> list:
    """One cycle of the directed graph as [a, b, ..., a], or [] when it has none."""
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in graph.get(n, ()):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                cycle = visit(m)
                if cycle:
                    return cycle
        stack.pop()
        state[n] = 2
        return []

    for n in sorted(graph):
        if n not in state:
            cycle = visit(n)
            if cycle:
                return cycle
    return []


def folder_graph(graph: dict) -> dict:
    out = {}
    for f, targets in graph.items():
        out.setdefault(folder(f), set()).update(
            folder(t) for t in targets if folder(t) != folder(f)
        )
    return {k: sorted(v) for k, v in out.items()}


def check(src: Path) -> list:
    graph = include_graph(src)
    errors = upward_includes(graph)
    cycle = find_cycle(graph)
    if cycle:
        errors.append("include cycle: " + " -> ".join(cycle))
    cycle = find_cycle(folder_graph(graph))
    if cycle:
        errors.append("folder cycle: " + " -> ".join(cycle))
    return errors


def main(argv: list) -> int:
    src = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "src"
    errors = check(src)
    for e in errors:
        print(e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
