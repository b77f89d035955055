"""Reduce-scatter of one gradient bucket on 2 GPUs: fp8dp's native NCCL communicator vs
torch.distributed.reduce_scatter_tensor on the same buffers, interleaved.

    torchrun --standalone --nproc_per_node=2 bench/reduce_scatter_gpu.py [--json out.json]

float32 buckets of 64 MiB, 256 MiB and 1 GiB (the whole bucket is the input; each rank receives
1/world of it). Each sample times `--batch` back-to-back collectives between two CUDA events on the
caller's stream, so neither side pays a host round trip per call, then syncs the device; bus bandwidth as nccl-tests
defines it for reduce-scatter: bytes_in / time * (world - 1) / world. Target: >= 0.95x
torch's bus bandwidth.
"""

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import device_info, print_table, time_interleaved, write_json  # noqa: E402

import fp8dp  # noqa: E402

SIZES_MIB = [64, 256, 1024]
SUM = fp8dp._C.ReduceOp.SUM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench/results/reduce_scatter_gpu.json")
    ap.add_argument("--batch", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        "nccl",
        timeout=timedelta(seconds=120),
        device_id=torch.device("cuda", torch.cuda.current_device()),
    )
    rank, ws = dist.get_rank(), dist.get_world_size()
    comm = fp8dp._C.make_communicator("nccl", dist.group.WORLD, True)
    results = []
    for mib in SIZES_MIB:
        n = mib * 2**20 // 4 // ws * ws
        inp = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
        out_ours = torch.empty(n // ws, device="cuda")
        out_torch = torch.empty(n // ws, device="cuda")

        # Both end in a device sync, so both start from an idle GPU and pay their first launch
        # alike (fp8dp's wait() polls on the host; torch's returns at once).
        def ours():
            works = [comm.reduce_scatter([inp], [out_ours], SUM) for _ in range(args.batch)]
            for w in works:
                w.wait()
            torch.cuda.synchronize()

        def theirs():
            for _ in range(args.batch):
                dist.reduce_scatter_tensor(out_torch, inp)
            torch.cuda.synchronize()

        ours()
        theirs()
        torch.cuda.synchronize()
        # Two ranks: each sum is a + b in either order, so the results must be identical.
        same = torch.equal(out_ours, out_torch)
        ms = time_interleaved({"fp8dp": ours, "torch": theirs}, warmup=2, rounds=args.rounds)
        nbytes = n * 4

        def busbw(t_ms):
            return nbytes / (t_ms / args.batch * 1e-3) * (ws - 1) / ws / 1e9

        results.append(
            {
                "bucket_mib": mib,
                "world": ws,
                "dtype": "float32",
                "identical": same,
                "fp8dp_ms": ms["fp8dp"] / args.batch,
                "torch_ms": ms["torch"] / args.batch,
                "fp8dp_busbw_gbs": busbw(ms["fp8dp"]),
                "torch_busbw_gbs": busbw(ms["torch"]),
                "ratio": ms["torch"] / ms["fp8dp"],
            }
        )
        inp = out_ours = out_torch = None  # free this size's buffers (the closures share them)
    if rank == 0:
        rows = [
            [
                r["bucket_mib"],
                f"{r['fp8dp_ms']:.3f}",
                f"{r['torch_ms']:.3f}",
                f"{r['fp8dp_busbw_gbs']:.1f}",
                f"{r['torch_busbw_gbs']:.1f}",
                f"{r['ratio']:.3f}x",
                r["identical"],
            ]
            for r in results
        ]
        print_table(
            f"reduce-scatter float32, {ws} GPUs (target >= 0.95x torch busbw)",
            ["MiB", "fp8dp ms", "torch ms", "fp8dp GB/s", "torch GB/s", "ratio", "identical"],
            rows,
        )
        write_json(
            args.json,
            {
                "benchmark": "reduce_scatter_gpu",
                **device_info(),
                "command": f"torchrun --standalone --nproc_per_node={ws} "
                "bench/reduce_scatter_gpu.py",
                "results": results,
            },
        )
    dist.barrier()
    dist.destroy_process_group()
    ok = all(r["identical"] for r in results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
