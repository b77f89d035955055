"""DDP training step of a 24-layer stack of fp8dp.Linear(4096, 4096) (FP8 delayed scaling, fused
wgrad accumulation into main_grad, overlap_grad_reduce, distributed optimizer with AdamW) on 2 GPUs
with fp8dp's native NCCL communicator, against the same per-GPU step with communication disabled.

    torchrun --standalone --nproc_per_node=2 bench/ddp_gpu.py [--json out.json]

Variants (same model, same inputs, same compute):
- full: zero_grad_buffer, forward + backward (buckets reduce-scatter while backward runs), then
  DistributedOptimizer.step() (finish_grad_sync, AdamW on the rank's shard, copy back, launch of
  the parameter all-gather, amax all-reduce). With overlap_param_gather=True (set here) the
  all-gather is waited for by the next forward, module by module.
- full_no_param_overlap: the same, but opt.finish_param_sync() right after step(): the all-gather
  is paid inside the step (what overlap_param_gather=False does).
- compute_only: the same work without a single collective: backward under no_sync(), AdamW on the
  same shard, local copy-back, the local scale update.

Timing is steady state: each sample is one untimed step followed by --steps timed steps, each
step from its first event to the next step's, so an all-gather left in flight by one step is paid
where training pays it (in the next forward). CUDA events on the compute stream between the phases
of each step (zero, forward, backward, finish_grad_sync, optimizer step) give a per-phase breakdown;
full - compute_only per phase says where communication is still exposed:
  forward     waiting for the parameter all-gather (overlap_param_gather)
  backward    pre-scale passes, NCCL kernels slowing the GEMMs they overlap, late launches
  grad sync   the reduce-scatter still running when backward ends (the last bucket)
  optimizer   the all-gather when it is not overlapped, the amax all-reduce
The collectives alone (every bucket's reduce-scatter, then every bucket's all-gather, no compute)
give the communication that there is to hide. Everything runs once per --bucket-sizes entry
(default: DDP's default bucket size, then one layer per bucket, where the last bucket's
reduce-scatter and the first bucket's all-gather, the parts nothing can hide, are smallest).
--micro-batches M makes each step M micro-batches of --tokens tokens, the first M - 1 under no_sync()
(Megatron's gradient accumulation; in the breakdown they count as "forward"): the reduce-scatters
still overlap only the last backward, but there is M times the compute to hide them behind.
--profile DIR also writes a torch.profiler trace of 3 steps of each variant per rank.
Target: full <= 1.05x compute-only.
"""

import argparse
import gc
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import device_info, print_table, write_json  # noqa: E402

import fp8dp  # noqa: E402

PHASES = ["zero", "forward", "backward", "grad_sync", "optimizer"]


def timed_steps(step, steps, rounds, drain):
    """Median ms per step and per phase over rounds x steps steady-state steps, on the GPU (CUDA
    events) and on the host (time the Python thread spent enqueueing). step(ev) runs one training
    step and appends len(PHASES) (event, host time) marks to ev, the first one at its start. A
    host time close to (or above) the GPU time means the step is launch-bound: the GPU waits for
    the host, and host work added by communication shows up as GPU time."""
    per_step, per_phase = [], {p: [] for p in PHASES}
    host_step, host_phase = [], {p: [] for p in PHASES}
    for _ in range(rounds):
        step([])  # untimed: leaves the steady state (e.g. an all-gather in flight) behind it
        marks = []
        for _ in range(steps):
            ev = []
            step(ev)
            marks.append(ev)
        tail = torch.cuda.Event(enable_timing=True)
        tail.record()
        tail_host = time.perf_counter()
        drain()
        torch.cuda.synchronize()
        starts = [m[0] for m in marks] + [(tail, tail_host)]
        for i, ev in enumerate(marks):
            per_step.append(starts[i][0].elapsed_time(starts[i + 1][0]))
            host_step.append(1e3 * (starts[i + 1][1] - starts[i][1]))
            bounds = ev + [starts[i + 1]]
            for k, p in enumerate(PHASES):
                per_phase[p].append(bounds[k][0].elapsed_time(bounds[k + 1][0]))
                host_phase[p].append(1e3 * (bounds[k + 1][1] - bounds[k][1]))
    med = statistics.median
    return (
        med(per_step),
        {p: med(v) for p, v in per_phase.items()},
        med(host_step),
        {p: med(v) for p, v in host_phase.items()},
    )


def comm_alone(sync, grad_dtype, param_dtype, rounds):
    """ms of every bucket's reduce-scatter (grad dtype, AVG) and all-gather (param dtype) issued
    back to back like one step issues them, on scratch buffers of the same sizes, no compute."""
    comm = sync.communicator()
    ws, rank = comm.size, comm.rank
    numels = [numel for _, _, _, numel, _ in sync.buckets()]  # one bucket per group here
    grads = [torch.zeros(n, dtype=grad_dtype, device="cuda") for n in numels]
    params = [torch.zeros(n, dtype=param_dtype, device="cuda") for n in numels]

    def chunk(t):
        m = t.numel() // ws
        return t[rank * m : (rank + 1) * m]

    out = {}
    for name, fn in (
        (
            "reduce_scatter_ms",
            lambda: [comm.reduce_scatter([g], [chunk(g)], fp8dp._C.ReduceOp.AVG) for g in grads],
        ),
        ("all_gather_ms", lambda: [comm.all_gather([chunk(p)], [p]) for p in params]),
    ):
        samples = []
        for r in range(rounds + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for w in fn():
                w.wait()
            end.record()
            torch.cuda.synchronize()
            if r:
                samples.append(start.elapsed_time(end))
        out[name] = statistics.median(samples)
    return out


def profile_variants(out_dir, variants, drain, rank, bucket_size):
    """A CUDA-activity trace (torch.profiler, Chrome format, gzipped) of 3 steady-state steps of
    each variant, one file per rank and variant: the kernel timeline shows which compute kernels
    the collectives overlap and where the compute stream idles."""
    os.makedirs(out_dir, exist_ok=True)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for name, fn in variants.items():
        fn([])
        drain()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                with torch.profiler.record_function(f"step_{name}"):
                    fn([])
            drain()
            torch.cuda.synchronize()
        tag = "default" if bucket_size is None else str(bucket_size)
        prof.export_chrome_trace(os.path.join(out_dir, f"ddp_{name}_{tag}_rank{rank}.json.gz"))


def run_config(args, bucket_size, rank, ws):
    """Builds the model and DDP with this bucket size (None: DDP's default), times the variants
    and returns the slowest rank's numbers."""
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    h = args.hidden
    model = torch.nn.Sequential(
        *[
            fp8dp.Linear(
                h, h, params_dtype=torch.bfloat16, device="cuda", fuse_wgrad_accumulation=True
            )
            for _ in range(args.layers)
        ]
    )
    # AVG in the collective: NCCL applies 1/dp inside the reduce-scatter kernel, where a pre-scale
    # is one more pass over the whole FP32 gradient buffer on the compute stream.
    cfg = fp8dp.DistributedDataParallelConfig(
        overlap_grad_reduce=True,
        use_distributed_optimizer=True,
        overlap_param_gather=True,
        average_in_collective=not args.prescale,
        bucket_size=bucket_size,
        comm_backend="nccl",
        grad_reduce_in_fp32=args.grad_dtype == "fp32",
        nccl_high_priority_stream=not args.nccl_low_priority,
    )
    ddp = fp8dp.DistributedDataParallel(model, cfg)
    opt = fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, lr=1e-5)
    recipe = fp8dp.DelayedScaling()
    g = torch.Generator("cuda").manual_seed(rank)
    x = torch.randn(args.tokens, h, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(args.tokens, h, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-3
    sync = ddp._sync

    def mark(ev):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        ev.append((e, time.perf_counter()))

    def forward():
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            return ddp(x)

    def accumulate():
        for _ in range(args.micro_batches - 1):
            forward().backward(dy)

    def full(ev, overlap=True):
        mark(ev)
        ddp.zero_grad_buffer()
        mark(ev)
        with ddp.no_sync():  # gradient accumulation: the micro-batches before the last
            accumulate()
        y = forward()
        mark(ev)
        y.backward(dy)
        mark(ev)
        ddp.finish_grad_sync()
        mark(ev)
        opt.step()
        if not overlap:
            opt.finish_param_sync()

    def compute_only(ev):
        mark(ev)
        ddp.zero_grad_buffer()
        mark(ev)
        with ddp.no_sync():
            accumulate()
            y = forward()
            mark(ev)
            y.backward(dy)
        mark(ev)
        mark(ev)  # no gradient collective to finish
        with torch.no_grad():  # the optimizer half only: backward above needs autograd
            for m, s in zip(opt._masters, opt._shards):
                gs = sync.grad_shard(s)
                m.grad = gs if gs.dtype == torch.float32 else gs.float()
            opt.optimizer.step()
            for m, s in zip(opt._masters, opt._shards):
                sync.param_shard(s).copy_(m)
            fp8dp._C.fp8_registry_update(fp8dp._C.fp8_registry_amaxes())

    variants = {
        "full": lambda ev: full(ev, True),
        "full_no_param_overlap": lambda ev: full(ev, False),
        "compute_only": compute_only,
    }
    for _ in range(2):  # the first iteration learns the golden readiness counts
        full([])
    opt.finish_param_sync()
    # Interleaved: one sample of each variant per round, so clock drift hits all alike.
    step_ms = {n: [] for n in variants}
    phase_ms = {n: {p: [] for p in PHASES} for n in variants}
    host_ms = {n: [] for n in variants}
    host_phase_ms = {n: {p: [] for p in PHASES} for n in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            s, ph, hs, hph = timed_steps(fn, args.steps, 1, opt.finish_param_sync)
            step_ms[name].append(s)
            host_ms[name].append(hs)
            for p in PHASES:
                phase_ms[name][p].append(ph[p])
                host_phase_ms[name][p].append(hph[p])
    med = {n: statistics.median(v) for n, v in step_ms.items()}
    ph_med = {n: {p: statistics.median(v) for p, v in d.items()} for n, d in phase_ms.items()}
    # The host's enqueue times: rank 0's (the ranks run the same Python).
    host_med = {n: statistics.median(v) for n, v in host_ms.items()}
    host_ph = {n: {p: statistics.median(v) for p, v in d.items()} for n, d in host_phase_ms.items()}
    alone = comm_alone(sync, ddp._params[0].main_grad.dtype, ddp._params[0].dtype, 5)
    if args.profile:
        profile_variants(args.profile, variants, opt.finish_param_sync, rank, bucket_size)

    # Every rank's numbers; the slowest rank's are reported.
    names = list(variants)
    flat = [med[n] for n in names] + [ph_med[n][p] for n in names for p in PHASES]
    flat += [alone["reduce_scatter_ms"], alone["all_gather_ms"]]
    mine = torch.tensor(flat, device="cuda", dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(ws)]
    dist.all_gather(every, mine)
    worst = torch.stack(every).max(0).values.tolist()
    med = dict(zip(names, worst[: len(names)]))
    k = len(names)
    ph_med = {
        n: dict(zip(PHASES, worst[k + i * len(PHASES) : k + (i + 1) * len(PHASES)]))
        for i, n in enumerate(names)
    }
    alone = {"reduce_scatter_ms": worst[-2], "all_gather_ms": worst[-1]}
    comp = med["compute_only"]
    result = {
        "layers": args.layers,
        "hidden": h,
        "tokens_per_gpu": args.tokens,
        "world": ws,
        "micro_batches": args.micro_batches,
        "params": sum(p.numel() for p in model.parameters()),
        "communicator": sync.communicator().name,
        "bucket_groups": sync.num_bucket_groups,
        "bucket_size": cfg.resolved_bucket_size(ws),
        "average_in_collective": cfg.average_in_collective,
        "grad_dtype": args.grad_dtype,
        "nccl_high_priority_stream": cfg.nccl_high_priority_stream,
        "overlap_param_gather": ddp.overlap_param_gather,
        "full_step_ms": med["full"],
        "compute_only_step_ms": comp,
        "full_no_param_overlap_step_ms": med["full_no_param_overlap"],
        "ratio": med["full"] / comp,
        "exposed_comm_ms": med["full"] - comp,
        "ratio_no_param_overlap": med["full_no_param_overlap"] / comp,
        "phase_ms": ph_med,
        "host_step_ms": host_med,
        "host_phase_ms": host_ph,
        "comm_alone_ms": alone,
        "per_rank_step_ms": [e[:k].tolist() for e in every],
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    if rank == 0:
        print_table(
            f"DDP step, {args.layers} x fp8dp.Linear({h}), {args.micro_batches} x {args.tokens} "
            "tokens/GPU, "
            f"{ws} GPUs, bucket_size {result['bucket_size']} = "
            f"{sync.num_bucket_groups} bucket groups, "
            f"{'AVG in collective' if cfg.average_in_collective else '1/dp pre-scale'}, "
            f"{args.grad_dtype} grads, NCCL stream "
            f"{'high' if cfg.nccl_high_priority_stream else 'normal'} priority "
            "(target ratio <= 1.05; slowest rank)",
            ["variant", "step ms", "ratio", "exposed comm ms"],
            [[n, f"{med[n]:.2f}", f"{med[n] / comp:.3f}x", f"{med[n] - comp:.2f}"] for n in names],
        )
        print_table(
            "Per phase (ms, median, slowest rank); delta = full - compute_only",
            ["phase"] + names + ["delta"],
            [
                [p]
                + [f"{ph_med[n][p]:.2f}" for n in names]
                + [f"{ph_med['full'][p] - ph_med['compute_only'][p]:+.2f}"]
                for p in PHASES
            ],
        )
        print_table(
            "Host (rank 0): ms spent enqueueing each phase (GPU ms in brackets); host "
            "close to GPU = launch-bound",
            ["phase"] + names,
            [[p] + [f"{host_ph[n][p]:.2f} ({ph_med[n][p]:.2f})" for n in names] for p in PHASES]
            + [["step"] + [f"{host_med[n]:.2f} ({med[n]:.2f})" for n in names]],
        )
        print(
            f"collectives alone (no compute): reduce-scatter of every bucket "
            f"{alone['reduce_scatter_ms']:.2f} ms, all-gather {alone['all_gather_ms']:.2f} ms",
            flush=True,
        )
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench/results/ddp_gpu.json")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per GPU per step")
    ap.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches per step (of --tokens each); all but the last run under "
        "no_sync(), as in Megatron's gradient accumulation",
    )
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per sample")
    ap.add_argument(
        "--bucket-sizes",
        default="default,16000000",
        help="comma-separated bucket sizes in elements, each its own model "
        "('default': DDP's; 16000000: one layer per bucket at hidden 4096)",
    )
    ap.add_argument(
        "--prescale",
        action="store_true",
        help="pre-scale buckets by 1/dp (average_in_collective=False) instead of AVG",
    )
    ap.add_argument(
        "--nccl-low-priority",
        action="store_true",
        help="the NCCL stream at normal priority (nccl_high_priority_stream=False): "
        "compute takes SMs first",
    )
    ap.add_argument(
        "--grad-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="main_grad and reduce-scatter dtype (grad_reduce_in_fp32); bf16 halves "
        "the bytes the collectives move",
    )
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="also write a torch.profiler trace of 3 steps of each variant to DIR",
    )
    args = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        "nccl",
        timeout=timedelta(seconds=180),
        device_id=torch.device("cuda", torch.cuda.current_device()),
    )
    rank, ws = dist.get_rank(), dist.get_world_size()
    results = []
    for b in args.bucket_sizes.split(","):
        results.append(run_config(args, None if b == "default" else int(b), rank, ws))
        gc.collect()  # the model, its buffers and its NCCL communicator, before the next one
        torch.cuda.empty_cache()
    if rank == 0:
        cmd = f"torchrun --standalone --nproc_per_node={ws} bench/ddp_gpu.py " + " ".join(
            sys.argv[1:]
        )
        env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        write_json(
            args.json,
            {
                "benchmark": "ddp_gpu",
                **device_info(),
                "command": cmd,
                "nccl_env": env,
                "result": results[0],
                "bucket_sweep": results[1:],
            },
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
