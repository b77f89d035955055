#!/usr/bin/env bash
# Everything fp8dp checks on the GPU machine, in one run: build against that machine's own CUDA
# torch, the GPU gtests (ctest), the pytest suites, the 2-GPU NCCL tests when two GPUs are visible,
# compute-sanitizer memcheck on the kernel gtest, and the reference benchmarks (bench/). Each step runs
# even when an earlier one failed (except that nothing runs without a build); a summary of exit codes
# comes last. Logs and JSON go to $OUT (default: build/gpu/out): build.log, tests.log, sanitizer.log,
# bench.log, bench_kernels.json, bench_gemm.json, bench_linear.json, bench_gpt.json,
# bench_gpt_best.json, bench_mlp.json,
# bench_block.json, bench_ckpt.json,
# and with 2 GPUs bench_reduce_scatter.json, bench_ddp.json, bench_ddp_mb8.json; summary.txt;
# test_times.tsv (each test's start and phase seconds as they happen, conftest.py).
# Not in the default STEPS (they take minutes): "matrix" (the full NCCL test matrix: matrix.log,
# matrix_nccl.json), "demo" (configs/gpu.yaml on every GPU: demo.log, demo/), "bench_gpt_graphs"
# (the stack in CUDA graphs: bench_gpt_graphs.json) and "demo_graphs" (the demo on one GPU with
# and without train.cuda_graphs: demo_graphs/). The experiments of
# dev/ run only when STEPS names them: dev_ct_variants, dev_block_variants, dev_act_variants,
# dev_norm_variants (bench.log),
# dev_gemm_accum (dev_gemm_accum.json), dev_gemm_energy (dev_gemm_energy.json), dev_block_gemm
# (dev_block_gemm.json), dev_profile_gpt
# (profile.log, profile_gpt_SHAPE.json), dev_block_casts (dev_block_casts.json), dev_act_casts
# (dev_act_casts.json),
# dev_profile_modules (profile_modules.json), dev_ncu (ncu.log: Nsight Compute on the casts),
# dev_host_profile (dev_host_profile.json), dev_graph_ceiling (dev_graph_ceiling.json),
# dev_profile_train (the 342M training step by category: profile_train_{delayed,current,off}.json). The 2-GPU parts
# (tests/distributed's NCCL cases, the reduce-scatter and DDP benchmarks) run when two or more GPUs
# are visible: the NCCL tests on 2, the benchmarks on all.
set -uo pipefail
cd "$(dirname "$0")/.."

# NVLink multicast stays off: on a shared host it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-build/gpu/out}
mkdir -p "$OUT"
PY=${PY:-$(command -v python3)}
BUILD=build/gpu
mkdir -p "$BUILD"  # the standalone benchmarks (nvcc) write there even without the build step
JOBS=${JOBS:-$(nproc)}
# Every test's start and phase times as they happen (conftest.py), for runs a time limit cuts off.
export FP8DP_TEST_TIMES=${FP8DP_TEST_TIMES:-$OUT/test_times.tsv}
STEPS=${STEPS:-build ctest pytest distributed bench sanitizer}  # also: matrix demo

declare -A RC
run_step() {  # run_step NAME LOG TIMEOUT_S CMD...
  local name=$1 log=$2 limit=$3
  shift 3
  echo "=== [$name] $* ($(date -u +%H:%M:%S))" | tee -a "$log"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1
  RC[$name]=$?
  echo "=== [$name] rc=${RC[$name]} in $((SECONDS - t0)) s" | tee -a "$log"
}
want() { [[ " $STEPS " == *" $1 "* ]]; }
# "bench" runs every reference benchmark; STEPS may also name single ones (bench_linear, bench_ddp,
# ...). The experiments (dev_*) run only when named.
wantb() { want bench || want "$1"; }

{
  echo "date: $(date -u)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  nvcc --version | tail -1
} >"$OUT/build.log" 2>&1
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)

GEN=(-G Ninja)
command -v ninja >/dev/null || GEN=(-G "Unix Makefiles")
if want build; then
  run_step configure "$OUT/build.log" 300 cmake -S . -B "$BUILD" "${GEN[@]}" \
    -DPython3_EXECUTABLE="$PY" -DFP8DP_CUDA=ON -DFP8DP_INPLACE=ON -DCMAKE_BUILD_TYPE=Release
  run_step build "$OUT/build.log" 400 cmake --build "$BUILD" -j "$JOBS" -- -k 0
fi
"$PY" -c 'import fp8dp; print("fp8dp build_info", fp8dp.build_info())' >>"$OUT/build.log" 2>&1

if want ctest; then
  run_step ctest "$OUT/tests.log" 300 ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS"
fi
if want pytest; then
  # One process per file: a crash in one file must not hide the results of the others.
  # (PYTEST_FILE_TIMEOUT, not PYTEST_TIMEOUT: pytest-timeout reads that one as a per-test limit.)
  # PYTEST_JOBS=N (N > 1, pytest-xdist installed): all files in one run of N workers instead,
  # as `make test` runs them (4 minutes for the whole suite on 16 workers, 12-05); a crashed
  # worker is reported as its test's failure and replaced, so a crash hides nothing there either.
  prc=0
  if [ "${PYTEST_JOBS:-1}" -gt 1 ] && "$PY" -c "import xdist" 2>/dev/null; then
    run_step "pytest" "$OUT/tests.log" "${PYTEST_FILE_TIMEOUT:-900}" \
      env OMP_NUM_THREADS=1 "$PY" -m pytest -q -rs -n "$PYTEST_JOBS" --dist loadgroup \
      ${PYTEST_FILES:-tests/python}
    [ "${RC[pytest]}" = 0 ] || [ "${RC[pytest]}" = 5 ] || prc=${RC[pytest]}
  else
    for f in ${PYTEST_FILES:-tests/python/test_*.py}; do
      run_step "pytest" "$OUT/tests.log" "${PYTEST_FILE_TIMEOUT:-300}" "$PY" -m pytest -q -rs "$f"
      [ "${RC[pytest]}" = 0 ] || [ "${RC[pytest]}" = 5 ] || prc=${RC[pytest]}
    done
  fi
  RC[pytest]=$prc
fi
if want distributed; then
  if [ "$NGPU" -ge 2 ] && [ -d tests/distributed ]; then
    # The NCCL cases (torchrun, 2 GPUs, tests/distributed/harness.py): the DDP cases that CPU CI
    # runs on gloo, here on NCCL, and the native communicator's own cases. DIST_TESTS narrows it
    # (pytest arguments: a file, a node id, -k EXPR).
    run_step distributed "$OUT/tests.log" "${DIST_TIMEOUT:-480}" "$PY" -m pytest -q -rs \
      ${DIST_TESTS:-tests/distributed/test_cases_nccl.py}
    [ "${RC[distributed]}" = 5 ] && RC[distributed]=0  # pytest's "no tests collected"
  else
    echo "=== [distributed] skipped: $NGPU GPU(s) visible or no tests/distributed" | tee -a "$OUT/tests.log"
  fi
fi
wantb bench_kernels && run_step bench_kernels "$OUT/bench.log" 300 "$PY" bench/kernels_cuda.py --json "$OUT/bench_kernels.json"
if want dev_ct_variants; then
  # Cast + transpose (+ dbias) kernel variants against a copy (torch-free; prints the fastest).
  run_step dev_ct_variants "$OUT/bench.log" 300 bash -c "nvcc -std=c++17 -O3 \
    -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DFP8DP_WITH_CUDA=1 -I src \
    -o $BUILD/ct_variants dev/cast_transpose_variants.cu && $BUILD/ct_variants"
fi
if want dev_block_variants; then
  # The block cast's load batch (kBatch: 1, 4, 8 row passes loaded before use; torch-free; bytes,
  # scales and dbias compared exactly, exit 1 on a mismatch).
  run_step dev_block_variants "$OUT/bench.log" 300 bash -c "nvcc -std=c++17 -O3 \
    -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DFP8DP_WITH_CUDA=1 -I src \
    -o $BUILD/block_variants dev/block_cast_variants.cu src/fp8/cuda/quantize.cu && $BUILD/block_variants"
fi
if want dev_act_variants; then
  # The fused activation casts' load-ahead (kAhead: 0, 1, 2, 3; torch-free; bytes, amax and dbias
  # compared exactly, exit 1 on a mismatch).
  run_step dev_act_variants "$OUT/bench.log" 400 bash -c "nvcc -std=c++17 -O3 \
    -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DFP8DP_WITH_CUDA=1 -I src \
    -o $BUILD/act_variants dev/act_cast_variants.cu src/fp8/cuda/quantize.cu && $BUILD/act_variants"
fi
if want dev_norm_variants; then
  # LayerNorm forward / backward launch choices against a copy (torch-free).
  run_step dev_norm_variants "$OUT/bench.log" 300 bash -c "nvcc -std=c++17 -O3 \
    -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DFP8DP_WITH_CUDA=1 -I src \
    -o $BUILD/norm_variants dev/norm_variants.cu src/fp8/cuda/quantize.cu && $BUILD/norm_variants"
fi
wantb bench_gemm && run_step bench_gemm "$OUT/bench.log" 300 "$PY" bench/gemm_cuda.py --json "$OUT/bench_gemm.json"
# GEMM_ACCUM_ARGS / GPT_ARGS add arguments (e.g. --gemms backward; --compare-qkv unbind --fast-backward).
want dev_gemm_accum && run_step dev_gemm_accum "$OUT/bench.log" 300 "$PY" dev/gemm_accum_choice.py \
  ${GEMM_ACCUM_ARGS:-} --json "$OUT/dev_gemm_accum.json"
want dev_gemm_energy && run_step dev_gemm_energy "$OUT/bench.log" 300 "$PY" dev/gemm_energy_candidates.py \
  --json "$OUT/dev_gemm_energy.json"
want dev_block_gemm && run_step dev_block_gemm "$OUT/bench.log" 300 "$PY" dev/block_gemm_candidates.py \
  --json "$OUT/dev_block_gemm.json"
wantb bench_ckpt && run_step bench_ckpt "$OUT/bench.log" 180 "$PY" bench/checkpoint_memory_gpu.py \
  --json "$OUT/bench_ckpt.json"
wantb bench_linear && run_step bench_linear "$OUT/bench.log" 180 "$PY" bench/linear_gpu.py --json "$OUT/bench_linear.json"
# LayerNormMLP: fused module vs the separate-module stack, torch BF16 and TE's LayerNormMLP.
wantb bench_mlp && run_step bench_mlp "$OUT/bench.log" 420 "$PY" bench/layernorm_mlp_gpu.py \
  --json "$OUT/bench_mlp.json"
# Float8BlockScaling: Linear under block scaling vs BF16, delayed and TE's block recipe.
wantb bench_block && run_step bench_block "$OUT/bench.log" 240 "$PY" bench/block_scaling_gpu.py \
  --json "$OUT/bench_block.json"
wantb bench_gpt && run_step bench_gpt "$OUT/bench.log" 420 "$PY" bench/gpt_block_gpu.py ${GPT_ARGS:-} \
  --json "$OUT/bench_gpt.json"
# Each library's best modules (LayerNormMLP) and the Llama-style block, without the
# sustained per-variant blocks so that both fit one step's limit.
wantb bench_gpt_best && run_step bench_gpt_best "$OUT/bench.log" 420 "$PY" bench/gpt_block_gpu.py \
  --arch gpt_fused,llama --no-alone ${GPT_BEST_ARGS:-} --json "$OUT/bench_gpt_best.json"
# The stack captured in CUDA graphs (fp8dp.make_graphed_callables, torch's for BF16) next to eager:
# only when STEPS names it.
want bench_gpt_graphs && run_step bench_gpt_graphs "$OUT/bench.log" 420 "$PY" bench/gpt_block_gpu.py \
  --shapes 2048x8,4096x4 --graphs --no-alone --no-te --json "$OUT/bench_gpt_graphs.json"
if want dev_profile_gpt; then
  # Kernel time and launches per step of the GPT block stack, per variant (PROFILE_SHAPES;
  # PROFILE_ARGS adds arguments, e.g. --host for the CPU time per operator).
  for s in ${PROFILE_SHAPES:-8192x2 2048x8}; do
    run_step dev_profile_gpt "$OUT/profile.log" 200 "$PY" dev/profile_gpt_block.py --shape "$s" \
      ${PROFILE_ARGS:-} --json "$OUT/profile_gpt_$s.json"
  done
fi
# The block casts alone against the copy bandwidth (8192 x 8192 and the 342M width).
want dev_block_casts && run_step dev_block_casts "$OUT/bench.log" 120 "$PY" bench/kernels_cuda.py \
  --only block --json "$OUT/dev_block_casts.json"
# The fused GELU casts alone at the 342M MLP's micro-batch (16384 x 6144), each stage timed by
# leaving it out, against torch's GELU + fp8dp's cast and the copy bandwidth (no counters needed).
want dev_act_casts && run_step dev_act_casts "$OUT/bench.log" 120 "$PY" bench/kernels_cuda.py \
  --only act --json "$OUT/dev_act_casts.json"
# Kernel time per step of single modules: the block-scaled Linear, LayerNormMLP vs separate modules
# (PROFILE_MODULES_ARGS adds arguments, e.g. --mlp-shape 1536x8192 for the 342M MLP).
want dev_profile_modules && run_step dev_profile_modules "$OUT/profile.log" 200 "$PY" \
  dev/profile_modules.py ${PROFILE_MODULES_ARGS:-} --json "$OUT/profile_modules.json"
# Host time of one Linear step by Python function and operator (HOST_PROFILE_ARGS adds arguments).
want dev_host_profile && run_step dev_host_profile "$OUT/bench.log" 200 "$PY" dev/host_profile.py \
  ${HOST_PROFILE_ARGS:-} --json "$OUT/dev_host_profile.json"
# Where the 342M training step's GPU time goes (fp8dp.train --profile): FP8 delayed, current and
# FP8 off, steps 20-22 of a 24-step run (PROFILE_TRAIN_SETS adds --set arguments;
# PROFILE_TRAIN_VARIANTS picks recipes: delayed, current, block, off).
if want dev_profile_train; then
  # PROFILE_TRAIN_SETS adds --set options to every variant and PROFILE_TRAIN_TAG to the file
  # names (e.g. PROFILE_TRAIN_SETS="--set train.cuda_graphs=true" PROFILE_TRAIN_TAG=_graphs).
  for v in ${PROFILE_TRAIN_VARIANTS:-delayed current off}; do
    vt="$v${PROFILE_TRAIN_TAG:-}"
    sets=(--set train.steps=24 --set "out.dir=$BUILD/profile_train/$vt")
    [ "$v" = off ] && sets+=(--set fp8.enabled=false) || sets+=(--set fp8.recipe=$v)
    run_step dev_profile_train "$OUT/profile.log" 240 "$PY" -m torch.distributed.run --standalone \
      --nproc_per_node=1 -m fp8dp.train --config configs/gpt350m.yaml --no-progress \
      --profile 20:3 "${sets[@]}" ${PROFILE_TRAIN_SETS:-}
    cp "$BUILD/profile_train/$vt"/*/step_profile.json "$OUT/profile_train_$vt.json" 2>/dev/null
    # tokens/s of the unprofiled steps
    cp "$BUILD/profile_train/$vt"/*/metrics.jsonl "$OUT/profile_train_${vt}_metrics.jsonl" 2>/dev/null
  done
fi
# Nsight Compute on fp8dp's cast kernels (what bounds each: the speed-of-light, memory and
# occupancy sections; ncu.log): the fused activation casts against the separate path's, and the
# block casts, at the 342M MLP shape. NCU_CASES / NCU_KERNELS / NCU_COUNT / NCU_ARGS narrow it.
if want dev_ncu; then
  run_step dev_ncu "$OUT/ncu.log" 400 ncu --clock-control none --target-processes all \
    -k "regex:${NCU_KERNELS:-act_|cast_transpose|block_cast}" --launch-count "${NCU_COUNT:-24}" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats "$PY" dev/profile_modules.py \
    --cases "${NCU_CASES:-mlp_gelu_fp8,sep_gelu_fp8,linear_block}" --plain --steps 1 \
    ${NCU_ARGS:---mlp-shape 1536x8192}
fi
# What capturing the GPT stack whole in a CUDA graph gives at most, with today's code.
want dev_graph_ceiling && run_step dev_graph_ceiling "$OUT/bench.log" 200 "$PY" dev/graph_ceiling.py \
  --json "$OUT/dev_graph_ceiling.json"
if [ "$NGPU" -ge 2 ]; then
  # Every visible GPU: the same benchmarks run on 4 or 8 GPUs where lent.
  TR=("$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU")
  wantb bench_reduce_scatter && run_step bench_reduce_scatter "$OUT/bench.log" 150 "${TR[@]}" bench/reduce_scatter_gpu.py \
    --json "$OUT/bench_reduce_scatter.json"
  wantb bench_ddp && run_step bench_ddp "$OUT/bench.log" 180 "${TR[@]}" bench/ddp_gpu.py --json "$OUT/bench_ddp.json"
  # The same step with Megatron-style gradient accumulation: 8 micro-batches, 7 under no_sync().
  wantb bench_ddp && run_step bench_ddp_mb8 "$OUT/bench.log" 180 "${TR[@]}" bench/ddp_gpu.py \
    --bucket-sizes default --micro-batches 8 --json "$OUT/bench_ddp_mb8.json"
else
  echo "=== [bench 2-GPU] skipped: $NGPU GPU(s) visible" | tee -a "$OUT/bench.log"
fi
if want matrix; then
  # The whole product of the test matrix on NCCL (cells above the visible GPU count are skipped).
  run_step matrix "$OUT/matrix.log" "${MATRIX_TIMEOUT:-420}" "$PY" -m tests.distributed.matrix --backend nccl \
    --full --jobs "${MATRIX_JOBS:-4}" --json "$OUT/matrix_nccl.json"
fi
if want demo; then
  # The training demo on every visible GPU (configs/gpu.yaml), with the BF16 comparison run.
  run_step demo "$OUT/demo.log" "${DEMO_TIMEOUT:-300}" "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node="$NGPU" -m fp8dp.train --config configs/gpu.yaml --compare-bf16 --no-progress \
    --set out.dir="$OUT/demo"
fi
if want demo_graphs; then
  # The demo on one GPU with its model in CUDA graphs (train.cuda_graphs) and without: tokens/s and
  # losses of each (demo_graphs/{eager,graphs}/fp8/metrics.jsonl, summary.json).
  grc=0
  for g in false true; do
    d=$([ "$g" = true ] && echo graphs || echo eager)
    run_step demo_graphs "$OUT/demo.log" 240 "$PY" -m fp8dp.train --config configs/gpu.yaml \
      --device cuda --no-progress --set train.steps=100 --set train.cuda_graphs=$g \
      --set out.dir="$OUT/demo_graphs/$d"
    [ "${RC[demo_graphs]}" = 0 ] || grc=${RC[demo_graphs]}
  done
  RC[demo_graphs]=$grc
fi
if want sanitizer; then
  # The kernel gtests under memcheck (out-of-bounds, misaligned and racy-initialisation reads).
  src=0
  for t in test_quantize_cuda test_norm_cuda; do
    [ -x "$BUILD/$t" ] || continue
    run_step sanitizer "$OUT/sanitizer.log" "${SANITIZER_TIMEOUT:-400}" compute-sanitizer --tool memcheck \
      --error-exitcode 9 --leak-check no "$BUILD/$t" --gtest_brief=1
    [ "${RC[sanitizer]}" = 0 ] || src=${RC[sanitizer]}
  done
  RC[sanitizer]=$src
fi

{
  echo "summary ($(date -u +%H:%M:%S), $NGPU GPU(s)):"
  for k in configure build ctest pytest distributed bench_kernels bench_gemm bench_linear bench_mlp bench_block \
           bench_gpt bench_gpt_best bench_gpt_graphs bench_ckpt bench_reduce_scatter bench_ddp bench_ddp_mb8 dev_ct_variants dev_block_variants dev_act_variants dev_norm_variants \
           dev_gemm_accum dev_gemm_energy dev_block_gemm dev_profile_gpt dev_block_casts dev_profile_modules dev_ncu dev_host_profile dev_graph_ceiling matrix demo demo_graphs sanitizer; do
    [ -n "${RC[$k]+x}" ] && echo "  $k: rc=${RC[$k]}"
  done
  grep -hE "^[0-9]+ passed|passed|failed|tests passed|ERROR SUMMARY" "$OUT/tests.log" "$OUT/sanitizer.log" 2>/dev/null | tail -8
} | tee "$OUT/summary.txt"
# Benchmark tables last, so they end the output.
grep -vE "^===" "$OUT/bench.log" 2>/dev/null | tail -60
for k in "${!RC[@]}"; do [ "${RC[$k]}" = 0 ] || exit 1; done
exit 0
