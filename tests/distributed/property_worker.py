"""torchrun worker of the randomized gradient-accounting property test.

Each case is a random configuration drawn from one integer seed: a model graph of fp8dp.Linear /
fp8dp.LayerNormLinear / fp8dp.LayerNormMLP (GELU or SwiGLU; since 2026-12-05), torch.nn.Linear
and plain parameters (used through F.linear, matmul and
indexing), with tied weights across both kinds, parameters used twice in one forward, unused and
frozen parameters, bias on/off, fused / delayed weight gradients per module; 1-4 micro-batches (all
but the last under no_sync(), is_first_microbatch=(k == 0)), a backward_dw() schedule that FIFO
allows (any interleaving across modules, and deferral of a micro-batch's calls to a later window);
and a DDP configuration (overlap, distributed optimizer, AVG / pre-scale, grad_reduce_in_fp32,
ledger, NaN check, a small bucket_size). Every case runs a few steps: step 0 learns the readiness
counts, later steps launch buckets from the hooks.

Checks, on every rank and every step:
- each trainable parameter's reduced gradient (p.main_grad; with the distributed optimizer the
  rank's owned shards) equals the reference (below) within the tolerance of `grad_tolerance`;
- frozen parameters have no main_grad, and DDP-managed parameters have p.grad None after the sync;
- with the distributed optimizer (torch.optim.SGD, lr=LR), every parameter after step() equals
  p - LR * g_ref (the all-gathered full tensor on every rank); frozen parameters are unchanged.

The reference, computed on every rank from all ranks' micro-batches (the data is a function of the
case seed and the step):
- FP8 off: the same graph (same tying, same frozen set) written in plain torch float64 ops (linear,
  layer_norm / rms_norm, indexing), each rank's micro-batch losses mse / n_mb summed over ranks and
  micro-batches, gradients divided by the world size (mean over the global batch).
- FP8 on (Float8CurrentScaling, so no state carries across casts or steps): the same graph built
  from fp8dp modules, unfused, immediate wgrad, no DDP, is_first_microbatch=None (always a fresh
  weight cast), run single-process per rank per micro-batch in float32; the per-micro-batch
  gradients are summed (and divided by the world size) in float64. The FP8-quantized operands are
  therefore the same as in the DDP run. What this checks: that every use's gradient reaches
  main_grad exactly once whatever route it takes (autograd hook, fused GEMM, delayed GEMM, plain
  torch use of a tied weight), the micro-batch and rank sums, the averaging and the sharding, and
  that a cached FP8 weight is not stale. What it does not check: the FP8 numerics themselves
  (quantization, GEMM, the eager FP8 bias gradient), which are the same code on both sides and are
  tested against float64 in tests/python.

Not covered yet: parameters in bf16 / fp16 (every parameter is FP32, so grad_reduce_in_fp32 is
drawn but changes nothing), DelayedScaling (its scales carry state across steps and ranks; only
Float8CurrentScaling is drawn), double backward, an external consumer hooked before DDP, a
different backward_dw() schedule in each step (the windows are fixed per configuration, like a
pipeline schedule; the order inside a window varies), NCCL / CUDA. Pipeline stages (C10) are
the pipeline axis, property_pipeline.py (--pipeline-cases, PP 2 at even world sizes).

A configuration that the library may reject (see `may_reject`) must either pass or raise an
exception of the class listed there with a message naming the parameter or module; any other
exception, or a silent wrong gradient, fails the case.

Output: one JSON line per case and rank in --out (results_ws{W}_rank{R}.jsonl) with status
(pass / fail / error / rejected), the case seed, the configuration and the first mismatch.
Reproduce one case:  torchrun --standalone --nproc_per_node=W property_worker.py --case-seed S
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import property_pipeline
import torch
import torch.distributed as dist
from property_gen import BACKEND
from property_run import Runner, case_seeds, gen_any_config
from property_shrink import shrink, signature

# The parts: property_gen.py (configurations), property_model.py (the model, its float64 reference
# and tolerances), property_run.py (running and classifying a case), property_shrink.py.


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=int(os.environ.get("FP8DP_PROPERTY_SEED", 0)))
    ap.add_argument("--cases", type=int, default=20, help="cases in this launch")
    ap.add_argument(
        "--case-seed", type=int, action="append", default=[], help="run only this case (repeatable)"
    )
    ap.add_argument(
        "--config-json",
        default=None,
        help="run this configuration (a JSON object as written in the results)",
    )
    ap.add_argument(
        "--regressions",
        default=None,
        help="also run the named minimal configurations of this JSON file (a list of "
        "{name, why, world_size, config}) whose world size is this one's, first",
    )
    ap.add_argument(
        "--pipeline-cases",
        type=int,
        default=0,
        help="also run this many generated pipeline cases (PP 2; even world sizes only)",
    )
    ap.add_argument(
        "--shrink",
        action="store_true",
        help="shrink every failing case to a minimal configuration that fails alike",
    )
    ap.add_argument("--out", default=None, help="folder for the JSON results (one file per rank)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=60))
    rank, ws = dist.get_rank(), dist.get_world_size()
    if args.config_json:
        c = json.loads(args.config_json)
        c["ws"] = ws
        configs = [c]
    else:
        seeds = args.case_seed or case_seeds(args.seed, args.cases, ws)
        if not args.case_seed and ws % property_pipeline.PP == 0:
            seeds += property_pipeline.pipeline_case_seeds(args.seed, args.pipeline_cases, ws)
        configs = [gen_any_config(cs, ws) for cs in seeds]
        if args.regressions:
            with open(args.regressions) as f:
                named = json.load(f)
            for i, r in enumerate(named):  # negative seeds: no clash with generated cases
                r["config"].update(ws=ws, case_seed=-1 - i, pattern=r["name"])
            # each at the world size it was found at
            configs = [r["config"] for r in named if r.get("world_size", 1) == ws] + configs
    if rank == 0:
        print(f"[property] world size {ws}, seed {args.seed}, {len(configs)} cases", flush=True)
    runner = Runner()
    out = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        out = open(os.path.join(args.out, f"results_ws{ws}_rank{rank}.jsonl"), "w")
    n_bad = 0
    for c in configs:
        res = runner.run(c)
        cs = c["case_seed"]
        bad = res["status"] in ("fail", "error")
        n_bad += bad
        if args.shrink and c.get("pattern") != "pipeline" and runner.anywhere(bad):
            sig = signature(res) if bad else None
            # every rank shrinks the same signature: the first failing rank's
            sigs = [None] * ws
            dist.all_gather_object(sigs, sig, group=runner.ctrl)
            sig = next(s for s in sigs if s)
            res["shrunk"] = dict(signature=sig, config=shrink(runner, c, sig))
        line = (
            f"[rank {rank}/{ws}] {res['status'].upper()} case_seed={cs} "
            f"({res.get('seconds', 0)} s)"
        )
        if res["status"] == "fail":
            line += " " + json.dumps(res["mismatch"])
        elif res["status"] in ("error", "rejected"):
            line += " " + res["error"][:300]
        if args.verbose or res["status"] != "pass" or rank == 0:
            print(line, flush=True)  # every case's seed, so that any one reruns alone
        if out:
            out.write(json.dumps(res) + "\n")
            out.flush()
    if out:
        out.close()
    dist.barrier(group=runner.ctrl)
    dist.destroy_process_group()
    sys.exit(1 if n_bad else 0)


if __name__ == "__main__":
    main()
