#!/usr/bin/env bash
# Why FP8 falls behind FP8 off on configs/gpt350m.yaml (H200, 2026-12-04: 38% behind at step 800,
# 10% at step 2,000; bench/results/gpt350m_runs.json): short runs of the same config and seed to
# --stop-at STOP (default 700), each changing one thing, in one GPU command (~2 min each), then a
# table of their validation losses against the stored FP8 off and FP8 delayed curves.
#   scripts/fp8_ablations.sh                      # probe, e4m3, fpropbf16, fprop
#   STOP=400 scripts/fp8_ablations.sh probe head  # some of them
#   STOP=2000 BUDGET=480 scripts/fp8_ablations.sh head   # again until it exits 0 (3: not done)
# Variants (fp8.* over the config's delayed scaling with the head in FP8, the stored reference
# run's setting: since 2026-12-05 the config keeps the head in BF16, so every variant starts from
# fp8.exclude=[] and those named *head put it back):
#   probe  nothing changed, train.fp8_stats_every=100: what the casts do, per layer
#          (runs/ablate/probe/fp8/fp8_stats.jsonl; python -m fp8dp.train.fp8_stats FILE)
#   head   fp8.exclude=[head]: the output head in BF16
#   qkv    fp8.exclude=[qkv]: the QKV projections in BF16 (the attention logits' inputs)
#   fprop  fp8.split_accumulator_fprop=true: FP32-promoted accumulation in the forward GEMMs
#   e4m3   fp8.format=E4M3: gradients in E4M3 (one more mantissa bit) instead of E5M2
#   e4m3head  both of the two that helped most at CPU size: E4M3 gradients, the head in BF16
#   block  fp8.recipe=block: Float8BlockScaling (1x128 tiles, 128x128 weight blocks, E4M3), the
#          smallest lag at CPU size (0.9% and 2.1% with two seeds; delayed 2.9% and 3.1%)
#   blockprobe  block with the probe (its casts emulated with fp8dp's own CPU block casts)
#   blockhead  block with the output head in BF16 (DeepSeek-V3 keeps its output head in high
#          precision; at CPU size the head in FP32 saved 1 of delayed scaling's 2.9 points,
#          nothing under block scaling)
#   fpropbf16, dgradbf16, wgradbf16  fp8.override_linear_precision: that GEMM of every layer
#          in BF16 (which GEMM costs the loss; at CPU size the forward's: BENCHMARKS.md)
#   off    fp8.enabled=false: FP8 off again, the noise floor of the comparison (GPU runs of the
#          same seed are not bit-identical: two E4M3 runs were 1.46 and 1.70 at step 700; two FP8
#          off runs ended 0.72% apart at step 2,000, 2026-12-05)
#   currenthead       fp8.recipe=current with the head in BF16 (ended 5.3% behind on 12-05, where
#          delayed with the head in BF16 ended level: BENCHMARKS.md)
#   currentheadprobe  the same with the probe, for what current scaling's casts do per layer
#          (12-05, an H100, to step 1,000: level with delayed scaling and FP8 off, where the
#          first currenthead run was 7.7% behind there; nothing saturates)
#   headprobe         delayed with the head in BF16 and the probe, the comparison for it
# Checkpoints (needed by --stop-at) are deleted after each run. Outputs: runs/ablate/<variant>/.
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)}
STOP=${STOP:-700}
CONFIG=${CONFIG:-configs/gpt350m.yaml}
OUTDIR=${OUTDIR:-runs/ablate}
declare -A SETS=(
  [probe]="train.fp8_stats_every=100"
  [head]="fp8.exclude=[head]"
  [qkv]="fp8.exclude=[qkv]"
  [fprop]="fp8.split_accumulator_fprop=true"
  [e4m3]="fp8.format=E4M3"
  [e4m3head]="fp8.format=E4M3 fp8.exclude=[head]"
  [block]="fp8.recipe=block"
  [blockprobe]="fp8.recipe=block train.fp8_stats_every=100"
  [blockhead]="fp8.recipe=block fp8.exclude=[head]"
  [fpropbf16]="fp8.override_linear_precision=[true,false,false]"
  [dgradbf16]="fp8.override_linear_precision=[false,true,false]"
  [wgradbf16]="fp8.override_linear_precision=[false,false,true]"
  [off]="fp8.enabled=false"
  [currenthead]="fp8.recipe=current fp8.exclude=[head]"
  [currentheadprobe]="fp8.recipe=current fp8.exclude=[head] train.fp8_stats_every=100"
  [headprobe]="fp8.exclude=[head] train.fp8_stats_every=100"
)
variants=("$@")
# The default: the probe (a GPU kernel wrong at these widths would show against its emulation);
# E4M3 gradients, the largest single saving at CPU size (1.7 of 2.9 points, more than block
# scaling's tiles: BENCHMARKS.md); the forward GEMMs in BF16, which cost most at CPU size ("Which
# GEMM"); fprop, whether the GPU's fast accumulation adds to it. Measured on the H200 on
# 2026-12-05 (BENCHMARKS.md, "Training runs"). At step 2,000: block 1.8% behind FP8 off, E4M3
# gradients 11.7%, delayed 10.3%; mid-run gaps are noise-dominated (the loss's fast drop starts
# 100-200 steps earlier or later between repeats), so only 2,000-step runs decide. Next, one per
# GPU command: STOP=2000 for fprop (the forward's fast accumulation: the only per-tensor difference
# from block scaling's GEMMs besides the tiles), head, blockhead, and off (the noise floor).
[ ${#variants[@]} -gt 0 ] || variants=(probe e4m3 fpropbf16 fprop)
for v in "${variants[@]}"; do
  if [ -z "${SETS[$v]+x}" ]; then
    echo "fp8_ablations: error: variant: expected one of ${!SETS[*]}, got '$v'" >&2
    exit 2
  fi
done
# BUDGET=SECONDS: each run stops at a step boundary within that much training time and keeps its
# checkpoint; the same command later resumes it bit-exactly (a 2,000-step variant takes 5-7 min,
# close to a 10-minute GPU command with the build). Exit status 3: some variant is short of STOP.
step_of() { "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["step"])' "$1/meta.json" 2>/dev/null || echo 0; }
short=0
for v in "${variants[@]}"; do
  ckpt="$OUTDIR/$v/ckpt"
  at=$(cat "$OUTDIR/$v/reached" 2>/dev/null || step_of "$ckpt")
  if [ "$at" -ge "$STOP" ]; then echo "[ablate] $v: at step $at already"; continue; fi
  [ -f "$ckpt/meta.json" ] || at=0  # reached a smaller STOP before: train again from the start
  echo "[ablate] $v: ${SETS[$v]} to step $STOP from step $at ($(date -u +%H:%M:%S))"
  # The variant's own sets come after. The separate MLP modules, as every ablation so far was run
  # (and the probe reads only those: config.py refuses it with model.fused_mlp).
  sets=(--set "out.dir=$OUTDIR/$v" --set "fp8.exclude=[]" --set model.fused_mlp=false --set model.fused_residual=false)
  for s in ${SETS[$v]}; do sets+=(--set "$s"); done
  extra=()
  [ "$at" -gt 0 ] && extra+=(--resume "$ckpt")
  [ -n "${BUDGET:-}" ] && extra+=(--time-budget "$BUDGET")
  "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 -m fp8dp.train \
    --config "$CONFIG" --no-progress --save "$ckpt" --stop-at "$STOP" "${extra[@]}" "${sets[@]}"
  at=$(step_of "$ckpt")
  if [ "$at" -ge "$STOP" ]; then
    rm -rf "$ckpt"
    echo "$at" > "$OUTDIR/$v/reached"
  else
    echo "[ablate] $v: stopped at step $at of $STOP; run the same command again to continue"
    short=1
  fi
done
for v in "${variants[@]}"; do
  # A probed variant's summary (worst modules per measure) next to the table, so one command's log
  # holds both.
  if [ -f "$OUTDIR/$v/fp8/fp8_stats.jsonl" ]; then
    echo "[ablate] $v: the probe's summary"
    "$PY" -m fp8dp.train.fp8_stats "$OUTDIR/$v/fp8/fp8_stats.jsonl" || true
  fi
done
"$PY" - "$OUTDIR" "${variants[@]}" <<'EOF'
import json, os, sys
base, names = sys.argv[1], sys.argv[2:]
ref = json.load(open("bench/results/gpt350m_runs.json"))["curves"]
off, delayed = ref["off"]["val_loss"], ref["delayed"]["val_loss"]
runs = {}
for n in names:
    path = os.path.join(base, n, "nofp8" if n == "off" else "fp8", "metrics.jsonl")
    recs = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    runs[n] = {str(r["step"]): r["val_loss"] for r in recs if r.get("val_loss") is not None}
steps = sorted({int(s) for r in runs.values() for s in r} & {int(s) for s in off})
print("| step | FP8 off | FP8 delayed | " + " | ".join(names) + " |")
print("|---:" * (3 + len(names)) + "|")
for s in steps:
    k = str(s)
    gap = lambda v: f"{v:.4f} ({100 * (v - off[k]) / off[k]:+.1f}%)" if v is not None else ""
    cells = [gap(runs[n].get(k)) for n in names]
    print(f"| {s} | {off[k]:.4f} | {gap(delayed.get(k))} | " + " | ".join(cells) + " |")
EOF
[ "$short" -eq 0 ] || exit 3
