#!/usr/bin/env bash
# The FP8-vs-BF16 convergence runs (fp8dp.train.runs): FP8 delayed (HYBRID), FP8
# current and FP8 off on the same seed and data, then a short plain-torch DDP baseline, then the
# comparison (table, gaps, plot). One invocation trains for at most BUDGET seconds (default 540,
# for a 10-minute GPU command) and checkpoints; run it again until it exits 0 ("all runs
# complete"); exit 3 means "run again". Arguments go to fp8dp.train.runs, e.g.
#   scripts/train_runs.sh                                  # configs/gpt350m.yaml on one GPU
#   scripts/train_runs.sh --nproc 2 --set train.micro_batch_size=8   # on 2 GPUs
#   scripts/train_runs.sh --only block                     # Float8BlockScaling beside them
#   scripts/train_runs.sh --seeds 1234,1,2 --only delayed,current,off   # mean and paired gaps
#   BUDGET=300 scripts/train_runs.sh --config configs/ci_convergence.yaml --device cpu --nproc 2
# Outputs: runs/gpt350m/{delayed,current,off}/{fp8,nofp8}/metrics.jsonl, torch/torch/metrics.jsonl,
# compare.md (the table for BENCHMARKS.md), compare.json, and the plot (--png docs/gpt350m_loss.png).
set -euo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off: on a shared host it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}
exec "$PY" -m fp8dp.train.runs --budget "${BUDGET:-540}" "$@"
