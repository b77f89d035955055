"""What CUDA graphs could give the GPT stack at most, with today's code: the forward + backward of
bench/gpt_block_gpu.py's stack (no DDP, weight gradients through autograd) captured whole with
torch.cuda.graph after warm-up on the capture stream, replayed, and timed interleaved against the
same step run eagerly and against torch BF16 (eager and captured).

An experiment, not a user-facing feature: a replay skips fp8dp's host-side bookkeeping (the
scaling registry's "observed" mark, so update_fp8_scales() would not update the scales after a
replay; it is not called here), so the captured FP8 numbers bound what graphs can give; the
design of a graphed fp8dp (which replays that bookkeeping) is in the changelog. A capture that
fails prints its error (which step of fp8dp cannot be captured) and the script goes on.

    python3 dev/graph_ceiling.py [--shapes 2048x8] [--rounds 20] [--json out.json]
"""

import argparse
import contextlib
import json
import os
import sys
import traceback

import torch

# fp8dp refuses captures whose replays would skip its host work (src/modules/capture_check.h),
# delayed scaling's among them; this measurement replays without it on purpose.
os.environ["FP8DP_UNSAFE_CAPTURE"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from cuda_timing import host_ms, time_interleaved  # noqa: E402
from gpt_block_gpu import BATCH, SEQ, make_model  # noqa: E402

import fp8dp  # noqa: E402


def recipe_ctx(mode):
    if mode == "fp8dp_delayed":
        r = fp8dp.DelayedScaling(fp8_format=fp8dp.Format.HYBRID, amax_history_len=16)
        return lambda: fp8dp.fp8_autocast(fp8_recipe=r)
    if mode == "fp8dp_current":
        r = fp8dp.Float8CurrentScaling(fp8_format=fp8dp.Format.HYBRID)
        return lambda: fp8dp.fp8_autocast(fp8_recipe=r)
    return contextlib.nullcontext  # torch BF16


def eager_step(model, x, dy, ctx):
    # Not bench/gpt_block_gpu.py's make_step: that one also updates the delayed scales after each
    # step, which a replay cannot (module docstring), so eager and replayed steps do the same work.
    def step():
        xa = x.detach().requires_grad_(True)
        with ctx():
            y = model(xa)
        y.backward(dy)
        for p in model.parameters():
            p.grad = None

    return step


def graphed_step(model, x, dy, ctx):
    """Warm-up on a side stream (which also builds fp8dp's GEMM plans and the workspace of that
    stream), then one capture of forward + backward into static buffers."""
    xs = x.detach().clone().requires_grad_(True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            with ctx():
                y = model(xs)
            y.backward(dy)
            xs.grad = None
            for p in model.parameters():
                p.grad = None
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        with ctx():
            y = model(xs)
        y.backward(dy)

    def step():
        g.replay()

    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2048x8")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = []
    for shape in args.shapes.split(","):
        hidden, layers = (int(v) for v in shape.split("x"))
        torch.manual_seed(1)
        x = torch.randn(SEQ, BATCH, hidden, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(SEQ, BATCH, hidden, device="cuda", dtype=torch.bfloat16) * 1e-2
        ref = make_model(hidden, layers, "torch").cuda()
        models = {"bf16": ref}
        for m in ("fp8dp_delayed", "fp8dp_current"):
            models[m] = make_model(hidden, layers, "fp8dp", ref).cuda()
        steps = {}
        for m, model in models.items():
            ctx = recipe_ctx(m)
            steps[m] = eager_step(model, x, dy, ctx)
            try:
                steps[m + "+graph"] = graphed_step(model, x, dy, ctx)
            except Exception as e:  # the blocker is the result
                print(f"[graph_ceiling] {m}: capture failed: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
                torch.cuda.synchronize()
        ms = time_interleaved(steps, warmup=3, rounds=args.rounds)
        base = ms["bf16"]
        row = {"hidden": hidden, "layers": layers, "variants": {}}
        for name, t in ms.items():
            row["variants"][name] = {
                "ms": t,
                "speedup_over_bf16_eager": base / t,
                "host_ms": host_ms(steps[name]),
            }
            print(
                f"[graph_ceiling] {hidden}x{layers} {name:22s} {t:7.2f} ms  "
                f"{base / t:5.2f}x  host {row['variants'][name]['host_ms']:6.2f} ms",
                flush=True,
            )
        out.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shapes": out}, f, indent=1)


if __name__ == "__main__":
    main()
