"""SASS instruction counts of the kernels in a .cu file, compiled for a GPU this machine does not
need to have: for kernels bound by instruction issue (the activation casts, the block casts), the
count is what their speed follows, and it can be compared between two trees without a GPU.

    python3 dev/sass_count.py dev/sass_activation_math.cu [--filter gelu] [--src OTHER/src]
    python3 dev/sass_count.py src/fp8/cuda/activation_cast.cu --filter act_tile_kernel

Per kernel: "to EXIT", the instructions laid out before the first EXIT (both sides of every
branch; the usual single-path kernel's whole work), without NOPs; "all", the whole function,
subroutines (slow paths such as the division's) included; "quarter-rate", MUFU, F2I, I2F, FRND,
F2F (16 results per clock and SM on Hopper, against 128 for FFMA); "branch", BRA, BSSY, BSYNC,
CALL. --src compiles against another tree's src/ (a git worktree of an older commit) to compare.
Needs nvcc and cuobjdump: on the PATH, under CUDA_HOME or /usr/local/cuda*/bin, or the copy that
triton's wheel carries (backends/nvidia/bin).
"""

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUARTER = re.compile(r"\b(MUFU|F2I|I2F|FRND|F2F)\b")
BRANCH = re.compile(r"\b(BRA|BSSY|BSYNC|CALL)\b")
INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);")


def find_tool(name: str) -> str:
    """The tool on the PATH, in a CUDA installation, or in triton's wheel; else a clear error."""
    found = shutil.which(name)
    if found:
        return found
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", name))
    candidates += sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"))
    try:
        import triton

        candidates.append(
            os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
        )
    except ImportError:
        pass
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit(
        f"sass_count: error: {name}: expected it on the PATH, under CUDA_HOME/bin, "
        f"/usr/local/cuda*/bin or triton's backends/nvidia/bin; found none of {candidates or 'them'}"
    )


def torch_includes() -> list:
    try:
        from torch.utils.cpp_extension import include_paths
    except ImportError:
        return []
    return [a for p in include_paths() for a in ("-isystem", p)]


def functions(sass: str):
    """(name, instructions) per function of cuobjdump's output."""
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name, body = part.split("\n", 1)
        yield name.strip(), INSTR.findall(body)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a .cu file")
    p.add_argument("--arch", default="sm_90a", help="nvcc -arch (default sm_90a, the H200)")
    p.add_argument("--filter", default="", help="only kernels whose mangled name contains this")
    p.add_argument("--src", default=os.path.join(ROOT, "src"), help="the src/ to include")
    args = p.parse_args(argv)
    if not os.path.isfile(args.source):
        sys.exit(f"sass_count: error: source: expected a .cu file, got {args.source!r}")
    nvcc, cuobjdump = find_tool("nvcc"), find_tool("cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        cmd = [nvcc, "-std=c++17", f"-arch={args.arch}", "-cubin", "-o", cubin]
        cmd += ["-I", args.src, *torch_includes(), "-DFP8DP_WITH_CUDA=1"]
        cmd += ["--expt-relaxed-constexpr", args.source]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"sass_count: error: nvcc failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
        sass = subprocess.run(
            [cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True
        ).stdout
    rows = []
    for name, instrs in functions(sass):
        if args.filter not in name:
            continue
        head = []
        for i in instrs:
            head.append(i)
            if i.strip().startswith("EXIT"):
                break
        real = [i for i in head if not i.strip().startswith("NOP")]
        kinds = collections.Counter(
            "quarter" if QUARTER.search(i) else "branch" if BRANCH.search(i) else "other"
            for i in real
        )
        total = sum(1 for i in instrs if not i.strip().startswith("NOP"))
        rows.append((name, len(real), total, kinds["quarter"], kinds["branch"]))
    if not rows:
        sys.exit(f"sass_count: error: --filter: no kernel name contains {args.filter!r}")
    print(f"{'to EXIT':>8} {'all':>6} {'quarter-rate':>12} {'branch':>6}  kernel ({args.arch})")
    for name, head, total, quarter, branch in rows:
        print(f"{head:8d} {total:6d} {quarter:12d} {branch:6d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
