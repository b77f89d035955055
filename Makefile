# fp8dp: `make demo` sets everything up and trains the demo; `make test` sets everything up and tests.
PY        := .venv/bin/python
BUILD     ?= build/dev
JOBS      ?= $(shell nproc)
CMAKE_ARGS ?=
export PYTHONPATH := $(CURDIR)/python$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: setup build test test-fast test-cpp test-python test-wheel bench format format-check install clean demo matrix

setup:
	bash scripts/setup_env.sh

# ccache, where installed: rebuilds, and the wheel that test-wheel builds from the same sources with
# the same flags, reuse these objects instead of compiling everything a second time.
CCACHE_ARGS := $(if $(shell command -v ccache 2>/dev/null),-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)

# In-place build: the extension is copied into python/fp8dp, so PYTHONPATH=python imports it.
build: setup
	cmake -S . -B $(BUILD) -G Ninja -DPython3_EXECUTABLE=$(CURDIR)/$(PY) -DFP8DP_INPLACE=ON $(CCACHE_ARGS) $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

test-cpp: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

# Only the test folders that exist (tests/distributed arrives with the DDP work). tests/distributed
# first: pytest-xdist hands out work in collection order, and each of its files is one long unit
# of work in one worker (below); collected last, they started when the single-process tests were
# done and set the pace alone (the GPU machine's pytest sat at 99% with 16 workers, 2026-12-06).
PYTEST_DIRS := $(foreach d,tests/distributed tests/python,$(wildcard $(d)))

# pytest-xdist, when .venv has it (extra "test"): min(nproc, 16) workers. --dist loadgroup: each
# file of tests/distributed in one worker (its tests share one launch of ranks, harness.py, which a
# second worker would start again; tests/distributed/conftest.py groups them) but for the tests
# marked own_launch (they start ranks of their own: the stateful, property and demo tests), and
# every other test wherever a worker is free, so that no long file sets the pace.
# Expanded when a recipe runs, after setup installed it.
XDIST_N := $(shell n=$$(nproc); [ $$n -gt 16 ] && n=16; echo $$n)
XDIST = $(shell $(PY) -c "import xdist" 2>/dev/null && echo "-n $(XDIST_N) --dist loadgroup")
# Threads per pytest process: the cores over the workers (at least 1). With torch's default, every
# core in every worker, 16 workers ran 16 threads each on the 16-core GPU machine and pytest kept
# 13 cores busy for its 6.7 minutes (2026-12-03). Ranks that tests start take 1 thread each
# (torchrun, harness.py).
TEST_THREADS := $(shell n=$$(( $$(nproc) / $(XDIST_N) )); [ $$n -lt 1 ] && n=1; echo $$n)

test-python: build
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q $(XDIST) --durations=20 $(PYTEST_DIRS)

# Between edits: the C++ tests and every Python test not marked slow (pyproject.toml's markers:
# slow = more than ~10 s on 2 cores, or a parametrized family of more than ~15 s; every test that
# starts ranks is slow). Under 2 minutes on a quiet 2-core machine (1 min 44 s, 2026-12-03, after
# an incremental build); `make test` runs everything.
test-fast: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q $(XDIST) -m "not slow" --durations=10 $(PYTEST_DIRS)

# The wheel as a user installs it (pip --no-build-isolation), imported from a fresh environment.
test-wheel: build
	bash scripts/check_wheel.sh

# The format check runs last, so that a formatting slip does not hide test results.
test: test-cpp test-python test-wheel format-check

# The training demo: torchrun with one rank per GPU (--device cuda, NCCL) when fp8dp was built with
# CUDA and sees GPUs, else 2 CPU ranks (--device cpu, gloo). DEMO_CONFIG overrides the config,
# DEMO_ARGS the extra arguments (they come last: DEMO_ARGS="--device cpu" wins).
DEMO_ARGS ?= --compare-bf16
demo: build
	@set -e; \
	ngpu=$$($(PY) -c "import fp8dp, torch; print(torch.cuda.device_count() if fp8dp.cuda_available() else 0)"); \
	if [ "$$ngpu" -gt 0 ]; then \
	  nproc=$$ngpu; dev=cuda; cfg=$(or $(DEMO_CONFIG),configs/gpu.yaml); echo "[demo] $$ngpu GPU(s), NCCL: $$cfg"; \
	else \
	  why=$$($(PY) -c "import fp8dp; print(fp8dp.cuda_available(return_reason=True)[1])"); \
	  nproc=2; dev=cpu; cfg=$(or $(DEMO_CONFIG),configs/demo.yaml); echo "[demo] no GPU ($$why): 2 CPU ranks, gloo: $$cfg"; \
	fi; \
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$$nproc -m fp8dp.train --config $$cfg --device $$dev $(DEMO_ARGS); \
	out=$$($(PY) -c "from fp8dp.train import load_config; print(load_config('$$cfg').out.dir)"); \
	echo "[demo] metrics: $$out/fp8/metrics.jsonl (FP8) and $$out/nofp8/metrics.jsonl (no FP8, if run)"; \
	echo "[demo] plot:    $$out/loss.png"

# The distributed test matrix: BACKEND=gloo|nccl, FULL=1 for the whole product.
BACKEND ?= gloo
matrix: build
	$(PY) -m tests.distributed.matrix --backend $(BACKEND) $(if $(FULL),--full)

# The CPU reference benchmarks, quick (JSON into bench/results/quick/); BENCH_ARGS="--full" for the
# reference iteration counts (bench/results/), "--only quantize_cpu,ddp_cpu" for some. The GPU ones:
# scripts/gpu_check.sh.
BENCH_ARGS ?=
bench: build
	$(PY) bench/run_cpu.py $(BENCH_ARGS)

# A regular (non-editable) install into .venv, built against the torch already there.
install: setup
	$(PY) -m pip install --no-build-isolation .

# clang-format, ruff and black at the versions pinned in pyproject.toml (extra "format"), from .venv.
# format-check skips with a message when setup could not install them (offline), fails under CI=true.
format: setup
	bash scripts/format.sh fix

format-check: setup
	bash scripts/format.sh check

clean:
	rm -rf build python/fp8dp/_C*.so
