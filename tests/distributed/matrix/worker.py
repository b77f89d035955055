"""torchrun worker of the test matrix: runs a list of cells one after another in one process group
(so the ~5 s start-up of a torchrun launch is paid once per world size, not once per cell).

    torchrun --standalone --nproc_per_node=W -m tests.distributed.matrix.worker CELLS.json OUT.jsonl

Rank 0 appends one JSON line per finished cell to OUT.jsonl: the runner reads them even when a
later cell kills the job, and relaunches the cells that have no line.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from .cell import Problem, run_cell


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cells_path, results_path = argv
    with open(cells_path) as f:
        job = json.load(f)
    prob = Problem(**job["problem"])
    backend = job["backend"]
    if backend == "nccl":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    # A short timeout: a rank stuck in a collective after another rank's error ends the job (and
    # the runner relaunches the remaining cells) instead of hanging it.
    dist.init_process_group(backend, timeout=timedelta(seconds=job.get("timeout_s", 120)))
    rank = dist.get_rank()
    inject = job.get("inject", "")
    for cell in job["cells"]:
        t0 = time.perf_counter()
        try:
            res = run_cell(cell, prob, device, inject)
        except Exception as e:  # recorded per rank; the cell fails, the next one still runs
            res = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=4),
            }
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, res)
        if rank == 0:
            errors = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if "error" in g]
            line = {
                "id": cell["id"],
                "ok": all(g["ok"] for g in gathered),
                "grad_ratio": max((g.get("grad_ratio", 0.0) for g in gathered), default=0.0),
                "param_ratio": max((g.get("param_ratio", 0.0) for g in gathered), default=0.0),
                "checks": sum(g.get("checks", 0) for g in gathered),
                "time_s": time.perf_counter() - t0,
            }
            if errors:
                line["error"] = "; ".join(errors)
                line["traceback"] = next(g["traceback"] for g in gathered if "traceback" in g)
            with open(results_path, "a") as f:
                f.write(json.dumps(line) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
