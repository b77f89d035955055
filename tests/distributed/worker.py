"""torchrun entry of the distributed cases (harness.py): sets up one run's process group and
device, runs its cases and writes one JSON line per case to OUT/rank<R>.jsonl.

    torchrun --standalone --nproc_per_node=2 tests/distributed/worker.py --run-name gloo --out DIR
        [--cases NAMES.json] [--only SUBSTRING]

Exits 1 when a case failed (the results say which and why)."""

import argparse
import gc
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases_ddp  # noqa: E402
import harness  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-name", required=True, choices=list(harness.RUNS))
    ap.add_argument("--out", required=True, help="folder for rank<R>.jsonl")
    ap.add_argument("--cases", default=None, help="JSON list of case names (default: all)")
    ap.add_argument("--only", default="", help="only the cases whose name contains this")
    args = ap.parse_args()
    run = harness.RUNS[args.run_name]
    if args.cases:
        with open(args.cases) as f:
            names = json.load(f)
    else:
        names = harness.cases_of(run.name)
    names = [n for n in names if args.only in n]
    cases = harness.load_cases()
    unknown = [n for n in names if n not in cases or run.name not in cases[n].runs]
    if unknown:
        raise SystemExit(f"--cases: not cases of run {run.name!r}: {unknown}")
    if run.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        # FP32 GEMMs stay FP32 (TF32 would round the inputs to 10 mantissa bits).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        cases_ddp.use_device(torch.device("cuda", local))
    # A rank stuck in a collective after another rank's failure ends the launch after this long.
    timeout = timedelta(seconds=120 if run.device == "cuda" else 60)
    dist.init_process_group(run.group, timeout=timeout)

    def after_case():
        if run.device == "cuda":
            gc.collect()  # each case's NCCL communicator goes before the next one is built
            torch.cuda.synchronize()

    os.makedirs(args.out, exist_ok=True)
    failed = harness.run_cases(names, args.out, after_case)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
