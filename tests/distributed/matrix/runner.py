"""The distributed test matrix.

    python -m tests.distributed.matrix --backend gloo|nccl [--full] [--config CONFIG.yaml]

Builds the cells from the axes in the config (default: a pairwise covering subset, every pair of
values of any two axes in some cell; --full: the whole product), launches them with torchrun - all
cells of one world size in one launch - checks each (exactly-once accumulation and the trained
parameters, see cell.py), prints a table, writes JSON and exits non-zero when any cell failed.
nccl cells whose world size exceeds the machine's GPU count are skipped and reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from ..harness import torchrun
from .cell import Problem
from .pairwise import full_product, pairwise

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "test_matrix.yaml"

AXES = {
    "backend": ("gloo", "nccl"),
    "world_size": (1, 2, 4, 8),
    "module": ("Linear", "LayerNormLinear"),
    "recipe": ("none", "delayed", "current"),
    "bias": (False, True),
    "delay_wgrad_compute": (False, True),
    "fuse_wgrad_accumulation": (False, True),
    "overlap_grad_reduce": (False, True),
    "use_distributed_optimizer": (False, True),
    "grad_dtype": ("fp32", "bf16"),
    "consumer": ("ddp", "external"),
    "grad_reduce_wire": ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2"),
}
# Axes dealt out over the cells instead of multiplying them (pairwise or full): each value goes, in
# turn, to the cells where it means something, so adding one costs no cells. grad_reduce_wire only
# changes cells that reduce an FP32 buffer over more than one rank; every other cell gets "fp32".
SPREAD = ("grad_reduce_wire",)
_COLUMNS = [
    ("id", "id"),
    ("world_size", "ws"),
    ("module", "module"),
    ("recipe", "recipe"),
    ("bias", "bias"),
    ("delay_wgrad_compute", "delay"),
    ("fuse_wgrad_accumulation", "fuse"),
    ("overlap_grad_reduce", "overlap"),
    ("use_distributed_optimizer", "distopt"),
    ("grad_dtype", "grad"),
    ("consumer", "consumer"),
    ("grad_reduce_wire", "wire"),
]


def load_matrix(path: str) -> tuple:
    """(axes, Problem) from the YAML; every key and value is checked against what cells support."""
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    for key in raw:
        if key not in ("axes", "problem"):
            raise ValueError(f"{key}: unknown section; expected 'axes' and 'problem'")
    axes = raw.get("axes") or {}
    for name, values in axes.items():
        if name not in AXES:
            raise ValueError(f"axes.{name}: unknown axis; expected one of {list(AXES)}")
        if not isinstance(values, list) or not values:
            raise ValueError(f"axes.{name}: expected a non-empty list, got {values!r}")
        for v in values:
            if v not in AXES[name] or isinstance(v, bool) != isinstance(AXES[name][0], bool):
                raise ValueError(f"axes.{name}: expected values from {list(AXES[name])}, got {v!r}")
    for name in AXES:
        if name not in axes:
            raise ValueError(f"axes.{name}: missing; every axis needs a list of values")
    problem = raw.get("problem") or {}
    known = list(Problem.__dataclass_fields__)
    for key, value in problem.items():
        if key not in known:
            raise ValueError(f"problem.{key}: unknown key; expected one of {known}")
        if key == "lr":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"problem.lr: expected a number > 0, got {value!r}")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"problem.{key}: expected an integer >= 1, got {value!r}")
    prob = Problem(**problem)
    if prob.hidden % 16 or (prob.seq * prob.micro_batch) % 16:
        raise ValueError(
            f"problem.hidden: FP8 GEMMs need hidden and seq * micro_batch to be multiples of 16, "
            f"got hidden={prob.hidden}, seq * micro_batch={prob.seq * prob.micro_batch}"
        )
    return axes, prob


def make_cells(axes: dict, backend: str, full: bool) -> list:
    if backend not in axes["backend"]:
        raise ValueError(f"--backend: {backend!r} is not in axes.backend {axes['backend']}")
    rest = {k: v for k, v in axes.items() if k != "backend" and k not in SPREAD}
    combos = full_product(rest) if full else pairwise(rest)
    for name in SPREAD:
        values = axes[name]
        turn = 0
        for c in combos:
            if c["grad_dtype"] == "fp32" and c["world_size"] > 1:
                c[name] = values[turn % len(values)]
                turn += 1
            else:
                c[name] = "fp32"
    return [dict(id=f"{backend}-{i:04d}", backend=backend, **c) for i, c in enumerate(combos)]


def gpu_count() -> tuple:
    """(GPUs usable by fp8dp, reason when none)."""
    import torch

    import fp8dp

    ok, reason = fp8dp.cuda_available(return_reason=True)
    return (torch.cuda.device_count(), "") if ok else (0, reason)


def _launch(
    cells: list,
    world: int,
    prob: Problem,
    backend: str,
    workdir: str,
    timeout: float,
    log,
    inject: str,
    chunk=None,
    devices: str = "",
) -> dict:
    """Run cells in torchrun launches of `world` ranks until each has a result; returns id ->
    result. A launch that dies blames the first cell without a result and resumes after it.
    chunk (None: the only launch of this world size) names this launch's files; devices, if
    given, becomes CUDA_VISIBLE_DEVICES."""
    results, pending, attempt = {}, list(cells), 0
    env = {"CUDA_VISIBLE_DEVICES": devices} if devices else {}
    while pending:
        attempt += 1
        job = os.path.join(workdir, f"ws{world}-{chunk or 0}-{attempt}.json")
        out = os.path.join(workdir, f"ws{world}-{chunk or 0}-{attempt}.jsonl")
        with open(job, "w") as f:
            json.dump(
                {"backend": backend, "problem": prob.__dict__, "cells": pending, "inject": inject},
                f,
            )
        log(
            f"[matrix] world size {world}: {len(pending)} cell(s) in one torchrun launch"
            + (f" (part {chunk + 1})" if chunk is not None else "")
        )
        rc, output = torchrun(
            "tests.distributed.matrix.worker",
            world,
            [job, out],
            env=env,
            timeout=timeout,
            module=True,
        )
        tail = output[-3000:]
        if os.path.exists(out):
            with open(out) as f:
                for line in f:
                    r = json.loads(line)
                    results[r["id"]] = r
        pending = [c for c in pending if c["id"] not in results]
        if pending and rc != 0:
            blamed = pending.pop(0)
            results[blamed["id"]] = {
                "id": blamed["id"],
                "ok": False,
                "error": f"torchrun exited with {rc} during this cell",
                "log_tail": tail,
            }
        elif pending:
            for c in pending:
                results[c["id"]] = {
                    "id": c["id"],
                    "ok": False,
                    "error": "no result written",
                    "log_tail": tail,
                }
            pending = []
    return results


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "y" if v else "-"
    return str(v)


def print_table(cells: list, results: dict, out=sys.stdout) -> None:
    head = [h for _, h in _COLUMNS] + ["result", "grad err/bound", "param err/bound", "time s"]
    rows = []
    for c in cells:
        r = results[c["id"]]
        status = r["status"]
        rows.append(
            [_fmt(c[k]) for k, _ in _COLUMNS]
            + [
                status,
                f"{r['grad_ratio']:.3g}" if "grad_ratio" in r and r.get("checks") else "",
                f"{r['param_ratio']:.3g}" if "param_ratio" in r and r.get("checks") else "",
                f"{r['time_s']:.1f}" if "time_s" in r else "",
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths))
    print(line, file=out)
    print("-" * len(line), file=out)
    for row in rows:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths)), file=out)


def run_matrix(
    backend: str,
    full: bool,
    config: str,
    json_path: str,
    timeout: float,
    log=print,
    inject: str = "",
    jobs: int = 1,
) -> dict:
    """Run the matrix; ``inject`` ("double" / "skip", see cell.run_cell) is for the matrix's own
    tests, which check that a miscounted micro-batch fails its cell. ``jobs`` > 1 splits the cells
    of each world size into that many parts and runs every part's launch at once (cells are
    independent; on nccl, world-size-1 parts go round-robin over the GPUs)."""
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs: expected an integer >= 1, got {jobs!r}")
    axes, prob = load_matrix(config)
    cells = make_cells(axes, backend, full)
    t0 = time.perf_counter()
    results = {}
    if backend == "nccl":
        gpus, why = gpu_count()
    else:
        gpus, why = None, ""
    runnable = []
    for c in cells:
        if gpus is not None and c["world_size"] > gpus:
            reason = why or f"needs {c['world_size']} GPUs, this machine has {gpus}"
            results[c["id"]] = {"id": c["id"], "status": "skipped", "reason": reason}
        else:
            runnable.append(c)
    launches = []  # (cells, world, part, CUDA_VISIBLE_DEVICES)
    for world in sorted({c["world_size"] for c in runnable}):
        group = [c for c in runnable if c["world_size"] == world]
        for part in range(min(jobs, len(group))):
            devices = str(part % gpus) if gpus and world == 1 and jobs > 1 else ""
            launches.append((group[part::jobs], world, part, devices))
    with tempfile.TemporaryDirectory(prefix="fp8dp-matrix-") as workdir:
        with ThreadPoolExecutor(max_workers=len(launches) if jobs > 1 else 1) as pool:
            futures = [
                pool.submit(
                    _launch,
                    part_cells,
                    world,
                    prob,
                    backend,
                    workdir,
                    timeout,
                    log,
                    inject,
                    part if jobs > 1 else None,
                    devices,
                )
                for part_cells, world, part, devices in launches
            ]
            for fut in futures:
                for rid, r in fut.result().items():
                    r["status"] = "pass" if r["ok"] else ("error" if "error" in r else "FAIL")
                    results[rid] = r
    elapsed = time.perf_counter() - t0
    counts = {
        s: sum(1 for r in results.values() if r["status"] == s)
        for s in ("pass", "FAIL", "error", "skipped")
    }
    report = {
        "backend": backend,
        "mode": "full" if full else "pairwise",
        "config": config,
        "problem": prob.__dict__,
        "cells": [dict(c, **results[c["id"]]) for c in cells],
        "summary": dict(total=len(cells), time_s=round(elapsed, 1), **counts),
    }
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.distributed.matrix", description=__doc__.split("\n")[0]
    )
    p.add_argument("--backend", required=True, choices=["gloo", "nccl"])
    p.add_argument(
        "--full", action="store_true", help="the whole product instead of the pairwise subset"
    )
    p.add_argument(
        "--config",
        default=str(CONFIG),
        help="the axes and the problem (default configs/test_matrix.yaml)",
    )
    p.add_argument(
        "--json", default=None, help="report path (default runs/test_matrix_<backend>.json)"
    )
    p.add_argument(
        "--launch-timeout",
        type=float,
        default=1800.0,
        help="seconds one torchrun launch may take (default %(default)s)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="split each world size's cells into this many torchrun launches that run "
        "at once (default %(default)s)",
    )
    p.add_argument(
        "--inject", default="", choices=["", "double", "skip"], help=argparse.SUPPRESS
    )  # fault injection for the matrix's own tests
    args = p.parse_args(argv)
    json_path = args.json or f"runs/test_matrix_{args.backend}.json"
    report = run_matrix(
        args.backend,
        args.full,
        args.config,
        json_path,
        args.launch_timeout,
        inject=args.inject,
        jobs=args.jobs,
    )
    by_id = {c["id"]: c for c in report["cells"]}
    print_table(report["cells"], by_id)
    for c in report["cells"]:
        if c["status"] in ("FAIL", "error"):
            print(f"\n{c['id']}: {c['status']}: {c.get('error', 'a check exceeded its bound')}")
            for key in ("traceback", "log_tail"):
                if c.get(key):
                    print(c[key].rstrip())
        elif c["status"] == "skipped":
            print(f"{c['id']}: skipped: {c['reason']}")
    s = report["summary"]
    print(
        f"\n{s['total']} cells ({report['mode']}, {args.backend}): {s['pass']} passed, "
        f"{s['FAIL'] + s['error']} failed, {s['skipped']} skipped in {s['time_s']} s; "
        f"report {json_path}"
    )
    return 1 if s["FAIL"] or s["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
