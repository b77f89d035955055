"""The pipeline bubble of each fp8dp.pipeline schedule on CPU ranks (gloo), per rank: time in
compute (F, B and separate W steps), time waiting on the pipeline's point-to-point transfers (the
bubble), and how many W steps ran inside it, all in one run on one model, so the ratios compare.

How it is measured, without changing torch: torch's schedules wait for every pipeline transfer
through one module-level function of torch.distributed.pipelining.schedules (_wait_batch_p2p),
which this benchmark wraps with a timer while it runs, and each PipelineStage's forward_one_chunk
/ backward_one_chunk / backward_weight_one_chunk, wrapped per stage instance. A W step is "inside
the bubble" when it starts while a receive that the schedule already posted (RECV_F / RECV_B
actions of torch's runtime schedules) has not completed: the rank would otherwise have waited
for that data, and ran fp8dp's deferred weight-gradient GEMMs instead. 1f1b and interleaved_1f1b
run W inside B (full backward), so they have no separate W step to count.

Model: PP 4 x DP 1 (4 ranks, one pipeline: the largest bubble 4 ranks can show) over 8 blocks of
x + fc2(gelu(fc1(layernorm(x)))) (fp8dp.LayerNormLinear + fp8dp.Linear, FP8 delayed scaling,
delayed and fused weight gradients), 8 micro-batches per step; every schedule runs the same 8
blocks (1f1b and zero_bubble/1: 4 stages of 2 blocks, the others 8 stages of 1). Schedules run round-robin
(A B C D A B C D ...) so that load from other processes hits them alike. Note: on a 2-core
machine the 4 ranks share 2 cores, so a waiting rank's core runs another rank; the bubble here
is time a rank is blocked on its pipeline peers, which is what the schedules differ in.

    PYTHONPATH=python .venv/bin/python bench/pipeline_bubble_cpu.py [--hidden 256 --rows 256]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from machine import cpu_name
from torchrun_launch import main_or_worker

# (schedule, stages per rank): the pairs to compare hold the same stages on the same ranks:
# 1f1b and zero_bubble/1 (4 stages of 2 blocks), interleaved_1f1b/2 and zero_bubble/2 (8 stages
# of 1 block, stage s on rank s % 4); zbv places the same 8 stages in a V.
SCHEDULES = [
    ("1f1b", 1),
    ("zero_bubble", 1),
    ("interleaved_1f1b", 2),
    ("zero_bubble", 2),
    ("zbv", 2),
]


def runnable_schedules(backend: str, say: bool, torch_version: str = torch.__version__) -> list:
    """SCHEDULES less those this torch cannot run on the backend (fp8dp.pipeline.check_backend:
    zbv on gloo needs torch >= 2.13), each left out with a line that says why."""
    from fp8dp.pipeline import check_backend

    keep = []
    for name, v in SCHEDULES:
        try:
            check_backend(name, backend, torch_version)
        except ValueError as e:
            if say:
                print(f"[bubble] leaving out {name}/{v}: {e}", flush=True)
            continue
        keep.append((name, v))
    return keep


def parse():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256, help="tokens per micro-batch")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--json", default="bench/results/pipeline_bubble_cpu.json")
    return ap.parse_args()


class Block(torch.nn.Module):
    def __init__(self, h: int):
        super().__init__()
        import fp8dp

        kw = {"fuse_wgrad_accumulation": True, "delay_wgrad_compute": True}
        self.fc1 = fp8dp.LayerNormLinear(h, 2 * h, **kw)
        self.fc2 = fp8dp.Linear(2 * h, h, **kw)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Probe:
    """Per-step counters of one rank: seconds per kind, W steps and those inside the bubble."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.t = defaultdict(float)
        self.n = defaultdict(int)

    def timed(self, kind, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[kind] += time.perf_counter() - t0
                self.n[kind] += 1

        return run


def _pending_recv(schedule) -> bool:
    """A receive posted by the schedule (RECV_F / RECV_B) whose data has not arrived."""
    posted = list(getattr(schedule, "fwd_recv_ops", {}).values())
    posted += list(getattr(schedule, "bwd_recv_ops", {}).values())
    return any(not w.is_completed() for works in posted for w in works)


def instrument(pp, probe: Probe) -> None:
    for stage in pp.stages:
        stage.forward_one_chunk = probe.timed("F", stage.forward_one_chunk)
        stage.backward_one_chunk = probe.timed("B", stage.backward_one_chunk)
        w = probe.timed("W", stage.backward_weight_one_chunk)

        def w_step(*a, _w=w, **k):
            if _pending_recv(pp.schedule):
                probe.n["W_in_bubble"] += 1
                t0 = time.perf_counter()
                out = _w(*a, **k)
                probe.t["W_in_bubble"] += time.perf_counter() - t0
                return out
            return _w(*a, **k)

        stage.backward_weight_one_chunk = w_step


def worker(args) -> None:
    import torch.distributed.pipelining.schedules as torch_schedules

    import fp8dp
    from fp8dp.pipeline import Pipeline, make_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    rank, ws = dist.get_rank(), dist.get_world_size()
    groups = make_groups(ws)  # one pipeline over every rank
    probe = Probe()
    wait = torch_schedules._wait_batch_p2p
    torch_schedules._wait_batch_p2p = probe.timed("wait", wait)  # every pipeline transfer wait
    h, rows, n_mb = args.hidden, args.rows, args.microbatches
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_mb * rows, h, generator=g)
    y = torch.randn(n_mb * rows, h, generator=g)
    ex = torch.empty(rows, h)
    recipe = fp8dp.DelayedScaling(amax_history_len=16)
    pipes = {}
    schedules = runnable_schedules("gloo", say=rank == 0)
    for key in schedules:
        name, v = key
        torch.manual_seed(1)  # the same weights for every schedule
        pp = Pipeline(
            [Block(h) for _ in range(args.blocks)],
            groups,
            schedule=name,
            n_microbatches=n_mb,
            loss_fn=F.mse_loss,
            microbatch_input=ex,
            activation=ex,
            microbatch_output=ex,
            virtual_stages=v,
            ddp_config=fp8dp.DistributedDataParallelConfig(
                delay_wgrad_compute=True, overlap_grad_reduce=True
            ),
        )
        instrument(pp, probe)
        pipes[key] = pp
    rows_out = defaultdict(list)  # schedule -> per-iteration dicts of this rank
    total = args.warmup + args.iters
    for it in range(total):
        for key, pp in pipes.items():
            dist.barrier()
            probe.reset()
            t0 = time.perf_counter()
            with fp8dp.fp8_autocast(fp8_recipe=recipe):
                pp.step(*((x,) if pp.is_first else ()), target=y if pp.is_last else None)
            step = time.perf_counter() - t0
            pp.update_fp8_scales()
            if it >= args.warmup:
                rows_out[f"{key[0]}/{key[1]}"].append(
                    {"step": step, **probe.t, **{f"n_{k}": c for k, c in probe.n.items()}}
                )
        if rank == 0:
            print(
                f"[bubble] iteration {it + 1}/{total}" + (" (warm-up)" if it < args.warmup else ""),
                flush=True,
            )
    torch_schedules._wait_batch_p2p = wait
    per_rank = [None] * ws
    dist.all_gather_object(per_rank, {k: v for k, v in rows_out.items()})
    if rank == 0:
        report(args, per_rank, ws, schedules)
    dist.destroy_process_group()


def _sum(its, key):
    return sum(r.get(key, 0.0) for r in its)


def report(args, per_rank, ws, schedules) -> None:
    results = []
    print(
        f"{'schedule':18s} {'rank':>4s} {'step ms':>8s} {'compute':>8s} {'wait':>8s} "
        f"{'bubble %':>8s} {'W steps':>8s} {'W in bubble':>11s}"
    )
    for sched, v in schedules:
        name = f"{sched}/{v}"
        ranks = []
        for r in range(ws):
            its = per_rank[r][name]
            n = len(its)
            step, wait = _sum(its, "step"), _sum(its, "wait")
            compute = _sum(its, "F") + _sum(its, "B") + _sum(its, "W")
            row = {
                "rank": r,
                "step_ms": 1e3 * step / n,
                "compute_ms": 1e3 * compute / n,
                "forward_ms": 1e3 * _sum(its, "F") / n,
                "backward_ms": 1e3 * _sum(its, "B") / n,
                "weight_ms": 1e3 * _sum(its, "W") / n,
                "wait_ms": 1e3 * wait / n,
                "bubble_fraction": wait / step,
                "w_steps": _sum(its, "n_W") / n,
                "w_in_bubble": _sum(its, "n_W_in_bubble") / n,
                "w_in_bubble_ms": 1e3 * _sum(its, "W_in_bubble") / n,
            }
            ranks.append(row)
            print(
                f"{name:18s} {r:4d} {row['step_ms']:8.1f} {row['compute_ms']:8.1f} "
                f"{row['wait_ms']:8.1f} {100 * row['bubble_fraction']:7.1f}% "
                f"{row['w_steps']:8.1f} {row['w_in_bubble']:11.1f}"
            )
        wait = sum(x["wait_ms"] for x in ranks)
        results.append(
            {
                "schedule": sched,
                "virtual_stages": v,
                "ranks": ranks,
                "mean_step_ms": sum(x["step_ms"] for x in ranks) / ws,
                "mean_wait_ms": wait / ws,
                "mean_compute_ms": sum(x["compute_ms"] for x in ranks) / ws,
                "mean_bubble_fraction": sum(x["bubble_fraction"] for x in ranks) / ws,
                "w_in_bubble_total": sum(x["w_in_bubble"] for x in ranks),
            }
        )
    base = results[0]["mean_wait_ms"]
    for res in results:
        res["wait_over_1f1b"] = res["mean_wait_ms"] / base
        print(
            f"{res['schedule'] + '/' + str(res['virtual_stages']):18s} mean over ranks: step {res['mean_step_ms']:.1f} ms, "
            f"wait {res['mean_wait_ms']:.1f} ms ({100 * res['mean_bubble_fraction']:.1f}% of the "
            f"step, {res['wait_over_1f1b']:.2f}x 1f1b's), W in bubble {res['w_in_bubble_total']:.1f}"
        )
    out = {
        "benchmark": "pipeline_bubble_cpu",
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "world_size": ws,
        "layout": f"PP {ws} x DP 1",
        "blocks": args.blocks,
        "hidden": args.hidden,
        "rows_per_microbatch": args.rows,
        "microbatches": args.microbatches,
        "iters": args.iters,
        "warmup": args.warmup,
        "load_average": os.getloadavg(),
        "command": "PYTHONPATH=python .venv/bin/python bench/pipeline_bubble_cpu.py "
        + " ".join(sys.argv[1:]),
        "results": results,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"[bubble] wrote {args.json}")


def main() -> None:
    args = parse()
    main_or_worker(__file__, args.nproc, worker, args)


if __name__ == "__main__":
    main()
