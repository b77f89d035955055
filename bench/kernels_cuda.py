"""FP8 cast kernels on the GPU vs the device copy bandwidth and a naive torch quantize; the fused
LayerNorm / RMSNorm (+ FP8 cast) forward and backward vs torch's layer_norm / rms_norm.

Usage: python3 bench/kernels_cuda.py [--json out.json] [--only {all,block,act,parts}]
Bandwidth counts the fewest bytes each op must move: the input read once plus every output written
once (FP8 data, transposed data, dbias). Targets: >= 80% of the copy bandwidth measured in
the same run, >= 8x the naive torch quantize (amax, scale, cast as separate torch ops).
`--only parts` times the QKV projection's gradient cast read from the three attention gradients
in place (quantize_parts) against stacking them first and casting the stack (what autograd did).
The launch choices of the cast + transpose (+ dbias) kernel are timed against each other by
dev/cast_transpose_variants.cu (build and run commands in its header); this script times the
library's defaults.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import device_info, print_table, time_interleaved, write_json  # noqa: E402

import fp8dp  # noqa: E402

_C = fp8dp._C
E4M3 = _C.Format.E4M3


# The ratio each table's last column shows: an op's baseline time over its own (shape_result).
SPEEDUP_KEYS = ("speedup_vs_naive", "speedup_vs_torch", "speedup_vs_separate", "speedup_vs_stack")


def naive_quantize(x, transpose):
    """What a user writes without fused kernels: amax, scale, scaled cast, (transpose copy)."""
    amax = x.abs().amax().float()
    scale = 448.0 / amax
    q = (x.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q, q.t().contiguous()) if transpose else q


def check_against_cpu(x, scale):
    """The timed shapes use launch configurations (several tiles per block) that the small test
    shapes do not reach: check bytes, amax and dbias against the CPU kernels here too."""
    gpu = _C.quantize(x, scale, E4M3, True, True, True)
    cpu = _C.quantize(x.cpu(), scale.cpu(), E4M3, True, True, True)
    same = torch.equal(gpu.data.view(torch.uint8).cpu(), cpu.data.view(torch.uint8))
    same &= torch.equal(gpu.data_t.view(torch.uint8).cpu(), cpu.data_t.view(torch.uint8))
    same &= torch.equal(gpu.amax.cpu(), cpu.amax)
    # Two FP32 sums of the same column in different orders: within 2 (rows - 1) 2^-24 sum|x|.
    bound = 2 * (x.shape[0] - 1) * 2.0**-24 * x.float().abs().sum(0).cpu()
    same &= bool(((gpu.dbias.cpu() - cpu.dbias).abs() <= bound).all())
    if not same:
        print("MISMATCH between the CUDA and CPU casts", file=sys.stderr)
    return bool(same)


def shape_result(x, ops, ms, matches, baselines=None, key="speedup_vs_naive"):
    """One shape's entry: every op's time, bandwidth (its fewest bytes, ops[op][1]) and share of
    the copy's; with baselines {op: baseline op}, the baseline's time over the op's as `key`."""
    copy_bw = ops["copy"][1] / ms["copy"] / 1e9
    res = []
    for op, (_, nbytes) in ops.items():
        bw = nbytes / ms[op] / 1e9  # bytes / ms / 1e9 = TB/s
        entry = {"op": op, "ms": ms[op], "TBps": bw, "frac_copy_bw": bw / copy_bw}
        if baselines and op in baselines:
            entry[key] = ms[baselines[op]] / ms[op]
        res.append(entry)
    return {
        "shape": list(x.shape),
        "dtype": str(x.dtype),
        "input_MiB": x.numel() * x.element_size() / 2**20,
        "matches_cpu": bool(matches),
        "ops": res,
    }


def bench_one(rows, cols, dtype):
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    scale = torch.tensor([2.0], device="cuda")
    copy_dst = torch.empty_like(x)
    n, es = x.numel(), x.element_size()
    ops = {
        "copy": (lambda: copy_dst.copy_(x), 2 * n * es),
        "amax": (lambda: _C.quantize(x, scale, E4M3, False, False, False), n * es),
        "quantize": (lambda: _C.quantize(x, scale, E4M3, True, False, False), n * es + n),
        "cast_transpose": (lambda: _C.quantize(x, scale, E4M3, True, True, False), n * es + 2 * n),
        "cast_transpose_dbias": (
            lambda: _C.quantize(x, scale, E4M3, True, True, True),
            n * es + 2 * n + 4 * cols,
        ),
        "naive_quantize": (lambda: naive_quantize(x, False), n * es + n),
        "naive_cast_transpose": (lambda: naive_quantize(x, True), n * es + 2 * n),
    }
    ms = time_interleaved({k: v[0] for k, v in ops.items()})
    matches = check_against_cpu(x, scale)
    naive = {"quantize": "naive_quantize", "cast_transpose": "naive_cast_transpose"}
    return shape_result(x, ops, ms, matches, naive)


def check_block_against_cpu(x, shape):
    """The block casts' bytes and scales on the timed shape against the CPU kernels (the tests
    cover small shapes; the timed one has thousands of 128 x 128 regions)."""
    gpu = _C.block_quantize(x, E4M3, shape, transpose=True)
    cpu = _C.block_quantize(x.cpu(), E4M3, shape, transpose=True)
    same = all(
        torch.equal(getattr(gpu, k).view(torch.uint8).cpu(), getattr(cpu, k).view(torch.uint8))
        for k in ("data", "data_t")
    )
    same &= torch.equal(gpu.scale_inv.cpu(), cpu.scale_inv)
    same &= torch.equal(gpu.scale_inv_t.cpu(), cpu.scale_inv_t)
    if not same:
        print(f"MISMATCH between the CUDA and CPU block casts ({shape})", file=sys.stderr)
    return bool(same)


def bench_block(rows, cols, dtype):
    """Float8BlockScaling's casts (1x128 tiles of x and of its transpose, as the forward and the
    wgrad read them; 128x128 blocks of a weight in both layouts) against the copy and the
    per-tensor cast + transpose. Bytes: the input once, every FP8 output and its FP32 scales
    once."""
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    scale = torch.tensor([2.0], device="cuda")
    copy_dst = torch.empty_like(x)
    n, es = x.numel(), x.element_size()
    tile, blocks = _C.BlockShape.TILE_1x128, _C.BlockShape.BLOCK_128x128
    tile_s = 4 * (rows * -(-cols // 128) + cols * -(-rows // 128))
    block_s = 8 * -(-rows // 128) * -(-cols // 128)
    ops = {
        "copy": (lambda: copy_dst.copy_(x), 2 * n * es),
        "cast_transpose": (lambda: _C.quantize(x, scale, E4M3, True, True, False), n * es + 2 * n),
        "block_1x128_rows": (
            lambda: _C.block_quantize(x, E4M3, tile),
            n * es + n + 4 * rows * -(-cols // 128),
        ),
        "block_1x128_both": (
            lambda: _C.block_quantize(x, E4M3, tile, transpose=True),
            n * es + 2 * n + tile_s,
        ),
        "block_1x128_both_dbias": (
            lambda: _C.block_quantize(x, E4M3, tile, transpose=True, dbias=True),
            n * es + 2 * n + tile_s + 4 * cols,
        ),
        "block_128x128_both": (
            lambda: _C.block_quantize(x, E4M3, blocks, transpose=True),
            n * es + 2 * n + block_s,
        ),
    }
    ms = time_interleaved({k: v[0] for k, v in ops.items()})
    matches = check_block_against_cpu(x, tile) and check_block_against_cpu(x, blocks)
    return shape_result(x, ops, ms, matches)


def _lut(on: bool, fn):
    """fn with the activation tables switched on or off around it (host-side flag)."""

    def run():
        prev = _C._set_activation_lut(on)
        try:
            return fn()
        finally:
            _C._set_activation_lut(prev)

    return run


def check_act_against_cpu(h, da, scale, rows=2048):
    """The timed launch's bytes (the tiled kernel at the full shape: many tiles per block with the
    tables) against the CPU kernels on its first `rows` rows: an output element depends on its
    own input only, so rows [0, rows) of data, and columns [0, rows) of data_t, are the CPU's
    bytes of that slice."""
    same = True
    for d, fmt in ((None, E4M3), (da, _C.Format.E5M2)):
        gpu = _C.activation_cast(d, h, "gelu", scale, fmt, True, True, False)
        cpu = _C.activation_cast(
            None if d is None else d[:rows].cpu(),
            h[:rows].cpu(),
            "gelu",
            scale.cpu(),
            fmt,
            True,
            True,
            False,
        )
        same &= torch.equal(gpu.data[:rows].view(torch.uint8).cpu(), cpu.data.view(torch.uint8))
        same &= torch.equal(
            gpu.data_t[:, :rows].view(torch.uint8).cpu(), cpu.data_t.view(torch.uint8)
        )
    if not same:
        print("MISMATCH between the CUDA and CPU activation casts", file=sys.stderr)
    return bool(same)


def bench_act(rows, ffn, dtype):
    """GELU fused with its FP8 casts (fp8dp.LayerNormMLP's kernels) against torch's GELU followed
    by fp8dp's cast, at one micro-batch of an MLP (h [rows, ffn]): the forward (fc2's input: E4M3
    bytes, and their transpose for fc2's wgrad) and the backward (fc1's output gradient: E5M2
    bytes, transpose and fc1's bias gradient). The fused variants that leave a stage out (no
    transpose, no dbias, no tables) time each stage by difference. Bytes: what the fused op must
    move (h, and da backward, read once; every output written once); the separate path moves
    more (torch's GELU writes and the cast reads the activation), which its share shows."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(rows, ffn, device="cuda", generator=g) * 2).to(dtype)
    da = torch.randn(rows, ffn, device="cuda", generator=g).to(dtype)
    scale = torch.tensor([2.0], device="cuda")
    copy_dst = torch.empty_like(h)
    n, es = h.numel(), h.element_size()
    E5M2 = _C.Format.E5M2
    gelu, gelu_bwd = torch.nn.functional.gelu, torch.ops.aten.gelu_backward

    def act(d, fmt, data, trans, dbias):
        return lambda: _C.activation_cast(d, h, "gelu", scale, fmt, data, trans, dbias)

    ops = {
        "copy": (lambda: copy_dst.copy_(h), 2 * n * es),
        "fwd_fused": (act(None, E4M3, True, True, False), n * es + 2 * n),
        "fwd_fused_no_transpose": (act(None, E4M3, True, False, False), n * es + n),
        "fwd_fused_no_tables": (_lut(False, act(None, E4M3, True, True, False)), n * es + 2 * n),
        "fwd_torch_gelu+cast": (
            lambda: _C.quantize(gelu(h), scale, E4M3, True, True, False),
            n * es + 2 * n,
        ),
        "torch_gelu": (lambda: gelu(h), 2 * n * es),
        "bwd_fused": (act(da, E5M2, True, True, True), 2 * n * es + 2 * n + 4 * ffn),
        "bwd_fused_no_dbias": (act(da, E5M2, True, True, False), 2 * n * es + 2 * n),
        "bwd_fused_no_transpose": (act(da, E5M2, True, False, True), 2 * n * es + n + 4 * ffn),
        "bwd_fused_no_tables": (
            _lut(False, act(da, E5M2, True, True, True)),
            2 * n * es + 2 * n + 4 * ffn,
        ),
        "bwd_torch_gelu+cast": (
            lambda: _C.quantize(gelu_bwd(da, h), scale, E5M2, True, True, True),
            2 * n * es + 2 * n + 4 * ffn,
        ),
        "torch_gelu_bwd": (lambda: gelu_bwd(da, h), 3 * n * es),
    }
    ms = time_interleaved({k: v[0] for k, v in ops.items()})
    matches = check_act_against_cpu(h, da, scale)
    separate = {"fwd_fused": "fwd_torch_gelu+cast", "bwd_fused": "bwd_torch_gelu+cast"}
    return shape_result(h, ops, ms, matches, separate, key="speedup_vs_separate")


def bench_norm(rows, cols, dtype, rms):
    """LayerNorm / RMSNorm (+ FP8 cast) forward and backward against torch's own kernels (and the
    naive quantize after them). Bytes: the forward reads x (gamma / beta are negligible) and
    writes the FP8 output and / or the dtype output (plus mu / rsigma); the backward reads dz and x
    and writes dx (with dx_add it also reads the residual's gradient; the separate add reads dx
    and it and writes dx again)."""
    import torch.nn.functional as F

    name = "rmsnorm" if rms else "layernorm"
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    gamma = torch.randn(cols, device="cuda", dtype=dtype) * 0.1 + 1
    beta = None if rms else torch.randn(cols, device="cuda", dtype=dtype) * 0.1
    dz = torch.randn_like(x)
    dres = torch.randn_like(x)  # the residual path's gradient of x (dx_add)
    scale = torch.tensor([2.0], device="cuda")
    copy_dst = torch.empty_like(x)
    n, es = x.numel(), x.element_size()
    fwd = _C.norm_forward(x, gamma, beta, rms=rms)

    def torch_fwd(inp):
        if rms:
            return F.rms_norm(inp, (cols,), gamma, eps=1e-5)
        return F.layer_norm(inp, (cols,), gamma, beta, eps=1e-5)

    xr = x.detach().requires_grad_(True)
    params = [p.detach().requires_grad_(True) for p in ([gamma] if rms else [gamma, beta])]
    if rms:
        y_t = F.rms_norm(xr, (cols,), params[0], eps=1e-5)
    else:
        y_t = F.layer_norm(xr, (cols,), params[0], params[1], eps=1e-5)
    ops = {
        "copy": (lambda: copy_dst.copy_(x), 2 * n * es),
        f"{name}_fp8": (
            lambda: _C.norm_forward(x, gamma, beta, rms=rms, want_out=False, scale=scale),
            n * es + n + 8 * rows,
        ),
        f"{name}_out": (lambda: _C.norm_forward(x, gamma, beta, rms=rms), 2 * n * es + 8 * rows),
        f"{name}_out_fp8": (
            lambda: _C.norm_forward(x, gamma, beta, rms=rms, scale=scale),
            2 * n * es + n + 8 * rows,
        ),
        f"torch_{name}": (lambda: torch_fwd(x), 2 * n * es),
        f"torch_{name}+naive_quantize": (lambda: naive_quantize(torch_fwd(x), False), n * es + n),
        f"{name}_bwd": (
            lambda: _C.norm_backward(dz, x, fwd.mu, fwd.rsigma, gamma, has_beta=not rms, rms=rms),
            3 * n * es,
        ),
        f"torch_{name}_bwd": (
            lambda: torch.autograd.grad(y_t, [xr] + params, dz, retain_graph=True),
            3 * n * es,
        ),
        # A pre-norm block's x gets a second gradient, the residual's: added inside the
        # backward (dx_add, one more read) against the backward then autograd's add.
        f"{name}_bwd_dx_add": (
            lambda: _C.norm_backward(
                dz, x, fwd.mu, fwd.rsigma, gamma, has_beta=not rms, rms=rms, dx_add=dres
            ),
            4 * n * es,
        ),
        f"{name}_bwd+add": (
            lambda: _C.norm_backward(dz, x, fwd.mu, fwd.rsigma, gamma, has_beta=not rms, rms=rms)[
                0
            ].add_(dres),
            6 * n * es,
        ),
    }
    ms = time_interleaved({k: v[0] for k, v in ops.items()})
    # The timed shape's launch (rows per block, grid-stride loop) against quantize() of the
    # kernel's own output: the fused cast must give the same bytes and amax.
    r = _C.norm_forward(x, gamma, beta, rms=rms, scale=scale)
    q = _C.quantize(r.out, scale, E4M3)
    matches = torch.equal(r.out_fp8.view(torch.uint8), q.data.view(torch.uint8))
    matches &= torch.equal(r.amax, q.amax)
    if not matches:
        print(f"MISMATCH between the fused {name} cast and quantize()", file=sys.stderr)
    torch_ops = {
        f"{name}_fp8": f"torch_{name}+naive_quantize",
        f"{name}_out": f"torch_{name}",
        f"{name}_bwd": f"torch_{name}_bwd",
        f"{name}_bwd_dx_add": f"{name}_bwd+add",
    }
    return shape_result(x, ops, ms, matches, torch_ops, key="speedup_vs_torch")


def bench_parts(b, s, h, hd, dtype):
    """The QKV projection's grad_output cast: SDPA leaves dq, dk, dv as three contiguous
    [b, h, s, hd] buffers, which the projection sees as [s, b, h, hd] views. Without
    quantize_parts autograd stacks them into one [s * b, 3 * h * hd] tensor and the cast reads
    that (E5M2, transpose + dbias, as a grad_output); quantize_parts reads them where they lie.
    Also timed: the stack alone, and the dense cast of the already stacked tensor (what the
    strided loads cost over it). Bytes: the fewest each op must move (the parts read once, every
    output written once; the stack reads and writes the input once)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    parts = [
        torch.randn(b, h, s, hd, device="cuda", generator=g).to(dtype).permute(2, 0, 1, 3)
        for _ in range(3)
    ]
    scale = torch.tensor([2.0], device="cuda")
    E5M2 = _C.Format.E5M2
    rows, cols = s * b, 3 * h * hd

    def stacked():
        return torch.stack(parts, dim=2).view(rows, cols)

    x = stacked()
    copy_dst = torch.empty_like(x)
    n, es = x.numel(), x.element_size()
    cast_bytes = n * es + 2 * n + 4 * cols
    ops = {
        "copy": (lambda: copy_dst.copy_(x), 2 * n * es),
        "stack": (stacked, 2 * n * es),
        "quantize(stacked)": (lambda: _C.quantize(x, scale, E5M2, True, True, True), cast_bytes),
        "stack+quantize": (
            lambda: _C.quantize(stacked(), scale, E5M2, True, True, True),
            cast_bytes,
        ),
        "quantize_parts": (
            lambda: _C.quantize_parts(parts, scale, E5M2, True, True, True),
            cast_bytes,
        ),
    }
    ms = time_interleaved({k: v[0] for k, v in ops.items()})
    # The timed launch against the cast of the stacked tensor: same bytes, amax and dbias bits.
    strided = _C.quantize_parts_strided(parts)
    got = _C.quantize_parts(parts, scale, E5M2, True, True, True)
    want = _C.quantize(x, scale, E5M2, True, True, True)
    matches = strided and all(
        torch.equal(getattr(got, k).view(torch.uint8), getattr(want, k).view(torch.uint8))
        for k in ("data", "data_t")
    )
    matches &= all(
        torch.equal(getattr(got, k).view(torch.int32), getattr(want, k).view(torch.int32))
        for k in ("amax", "scale_inv", "dbias")
    )
    if not matches:
        print(f"MISMATCH of quantize_parts (strided kernel taken: {strided})", file=sys.stderr)
    baselines = {"quantize_parts": "stack+quantize", "quantize(stacked)": "stack+quantize"}
    return shape_result(x, ops, ms, matches, baselines, key="speedup_vs_stack")


def norm_results():
    return [
        bench_norm(16384, 8192, torch.bfloat16, rms=False),  # 256 MiB input
        bench_norm(16384, 8192, torch.bfloat16, rms=True),
        bench_norm(16384, 1536, torch.bfloat16, rms=False),  # the 342M model's micro-batch
        bench_norm(4096, 4096, torch.bfloat16, rms=False),  # bench/gpt_block_gpu.py's 4096 x 4
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--only",
        choices=("all", "block", "act", "parts", "norm"),
        default="all",
        help="block: the block casts alone; act: the fused GELU casts alone; parts: the QKV "
        "gradient cast from the three attention gradients (quantize_parts) alone; norm: the "
        "norm kernels alone",
    )
    args = ap.parse_args()
    results = []
    if args.only in ("all", "act"):
        # One micro-batch of the 342M model's MLP (16 x 1024 tokens, ffn 6144), the shape
        # whose GELU and casts its training step spends 8.6 + 8.2 ms on (BENCHMARKS.md).
        results.append(bench_act(16384, 6144, torch.bfloat16))
    if args.only in ("all", "parts"):
        # One micro-batch of the 342M model's attention (16 x 1024 tokens, 12 heads of 128): the
        # stack this replaces cost ~100 us per call, 2.4 ms per step of that model on an H100.
        results.append(bench_parts(16, 1024, 12, 128, torch.bfloat16))
    if args.only in ("all", "block"):
        results += [
            bench_block(8192, 8192, torch.bfloat16),  # the Linear 8192^3 step's x, dy and weight
            bench_block(16384, 1536, torch.bfloat16),  # the 342M model's activations (width 1536)
        ]
    if args.only == "all":
        results += [
            bench_one(16384, 8192, torch.bfloat16),  # 256 MiB input
            bench_one(8192, 8192, torch.float32),  # 256 MiB input
            bench_one(4096, 8192, torch.bfloat16),  # 64 MiB input
        ]
    if args.only in ("all", "norm"):
        results += norm_results()
    for r in results:
        rows = []
        for o in r["ops"]:
            sp = next((o[k] for k in SPEEDUP_KEYS if k in o), None)
            rows.append(
                [
                    o["op"],
                    f"{o['ms'] * 1e3:.1f}",
                    f"{o['TBps']:.2f}",
                    f"{100 * o['frac_copy_bw']:.0f}%",
                    f"{sp:.1f}x" if sp else "",
                ]
            )
        print_table(
            f"{r['dtype']} {r['shape'][0]}x{r['shape'][1]} ({r['input_MiB']:.0f} MiB), "
            f"matches CPU: {r['matches_cpu']}",
            ["op", "us", "TB/s", "of copy", "vs naive/torch/separate/stack"],
            rows,
        )
    write_json(
        args.json, {"device": device_info(), "command": " ".join(sys.argv), "results": results}
    )
    if not all(r["matches_cpu"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
