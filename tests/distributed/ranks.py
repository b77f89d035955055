"""torchrun entry of harness.run_ranks: imports a test module from its file, joins a gloo process
group, runs one of the module's functions on this rank and writes what it returned, or the error
it raised, to OUT/rank<R>.pt.

    torchrun --standalone --nproc_per_node=W tests/distributed/ranks.py --file TEST.py
        --function NAME --args ARGS.json --out DIR [--timeout-s 60]

Exits 1 when the function raised on this rank."""

import argparse
import importlib.util
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", required=True, help="the test module's file")
    ap.add_argument("--function", required=True, help="fn(rank, world_size, *args)")
    ap.add_argument("--args", required=True, help="JSON file: the list of args")
    ap.add_argument("--out", required=True, help="folder for rank<R>.pt")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="the process group's timeout")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = Path(args.file).resolve()
    sys.path.insert(0, str(path.parent))  # the test module's own imports (harness, helpers)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, args.function)
    fn_args = json.loads(Path(args.args).read_text())
    # A rank left alone in a collective (a peer raised or died) fails after this long, not hangs.
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        rec = {"result": fn(rank, world_size, *fn_args)}
    except Exception as e:
        rec = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    torch.save(rec, os.path.join(args.out, f"rank{rank}.pt"))
    print(f"[rank {rank}/{world_size}] {'FAIL' if 'error' in rec else 'PASS'}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if "error" in rec else 0)


if __name__ == "__main__":
    main()
