"""bench/ holds the reference benchmarks and their helpers, dev/ the experiments (dev/README.md).
Every reference benchmark still runs: the CPU ones through bench/run_cpu.py --smoke (the runner
behind `make bench`), the GPU ones as far as `--help` (their imports and argument parser), and
scripts/gpu_check.sh names only paths that exist. dev/ is only compiled.

Evidence that these tests catch a moved or broken benchmark (2026-12-03, each reverted):

1. A reference benchmark moved (`git mv bench/gemm_cuda.py dev/`): 3 fail:
   test_every_bench_file_is_a_reference_benchmark_or_a_helper (the listing lacks 'gemm_cuda'),
   test_gpu_benchmark_parses_its_arguments[gemm_cuda] ("FileNotFoundError: ... bench/gemm_cuda.py"),
   test_gpu_check_runs_every_gpu_benchmark_and_names_only_existing_paths
   (['bench/gemm_cuda.py'] == []).
2. A helper moved (`git mv bench/linear_step.py dev/`): test_cpu_benchmark_runs[linear_cpu] and
   test_gpu_benchmark_parses_its_arguments[linear_gpu] fail with
   "ModuleNotFoundError: No module named 'linear_step'".
3. gpu_check.sh building the old path bench/cast_transpose_variants.cu: the gpu_check test fails
   (['bench/cast_transpose_variants.cu'] == []).
4. `hasattr(ddp._sync, "check_params_in_buffers")` back in accounting_cpu.py:
   test_benchmarks_do_not_probe_the_library_version fails (['accounting_cpu.py:136'] == []).
"""

import json
import os
import py_compile
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
DEV = os.path.join(ROOT, "dev")
sys.path.insert(0, BENCH)
import run_cpu  # noqa: E402

CPU = sorted(run_cpu.BENCHES)
GPU = sorted(
    [
        "block_scaling_gpu",
        "checkpoint_memory_gpu",
        "ddp_gpu",
        "gemm_cuda",
        "gpt_block_gpu",
        "kernels_cuda",
        "layernorm_mlp_gpu",
        "linear_gpu",
        "reduce_scatter_gpu",
    ]
)
# Imported by the benchmarks (and by dev/'s experiments), not run on their own.
HELPERS = sorted(["cuda_timing", "linear_step", "machine", "run_cpu", "torchrun_launch"])


def _extension_built() -> bool:
    try:
        import fp8dp  # noqa: F401
    except ImportError:
        return False
    return True


needs_extension = pytest.mark.skipif(
    not _extension_built(), reason="fp8dp's extension is not built (make build)"
)


def _env():
    env = dict(os.environ)
    python = os.path.join(ROOT, "python")
    env["PYTHONPATH"] = python + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def test_every_bench_file_is_a_reference_benchmark_or_a_helper():
    """A new file in bench/ is either a reference benchmark (and then runs below and in a runner)
    or a helper; an experiment goes to dev/."""
    found = sorted(f[:-3] for f in os.listdir(BENCH) if f.endswith(".py"))
    assert found == sorted(CPU + GPU + HELPERS)
    assert not [f for f in os.listdir(BENCH) if f.endswith((".cu", ".cpp"))], "experiments: dev/"


# The two that start ranks (torchrun) take 13-18 s even at smoke size: slow (pyproject's markers).
STARTS_RANKS = {"ddp_cpu", "pipeline_bubble_cpu"}


@needs_extension
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in STARTS_RANKS else n for n in CPU]
)
def test_cpu_benchmark_runs(name, tmp_path):
    """bench/run_cpu.py --smoke --only NAME: tiny shapes, 1-2 iterations, its JSON written."""
    cmd = [sys.executable, os.path.join(BENCH, "run_cpu.py"), "--smoke", "--only", name]
    r = subprocess.run(
        cmd + ["--out", str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / f"{name}.json").stat().st_size > 0


# Every GPU benchmark's `--help`, run in ONE process (runpy, each as __main__): importing torch
# once instead of once per benchmark keeps this under make test-fast's budget.
_HELP_RUNNER = """
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    buf = io.StringIO()
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
        out[path] = [None, buf.getvalue()]
    except SystemExit as e:
        out[path] = [e.code, buf.getvalue()]
    except BaseException as e:  # an import or parser error: reported per benchmark
        out[path] = ["error", f"{type(e).__name__}: {e}"]
print("HELP-RESULTS" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def help_results():
    paths = [os.path.join(BENCH, f"{n}.py") for n in GPU]
    r = subprocess.run(
        [sys.executable, "-c", _HELP_RUNNER, *paths],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("HELP-RESULTS")]
    assert line, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(line[-1][len("HELP-RESULTS") :])
    return {os.path.basename(p)[:-3]: v for p, v in res.items()}


@needs_extension
@pytest.mark.parametrize("name", GPU)
def test_gpu_benchmark_parses_its_arguments(name, help_results):
    """`--help` imports the benchmark and its helpers and builds its parser, without a GPU."""
    code, text = help_results[name]
    assert code == 0, text[-3000:]
    assert "usage:" in text


def test_gpu_check_runs_every_gpu_benchmark_and_names_only_existing_paths():
    with open(os.path.join(ROOT, "scripts", "gpu_check.sh")) as f:
        script = f.read()
    paths = set(re.findall(r"\b((?:bench|dev)/[\w./-]+\.(?:py|cu))\b", script))
    assert sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p))) == []
    assert sorted(f"bench/{n}.py" for n in GPU if f"bench/{n}.py" not in paths) == []


def test_make_bench_runs_the_cpu_runner():
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    recipe = re.search(r"^bench:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe and "bench/run_cpu.py" in recipe.group(1)


def test_benchmarks_do_not_probe_the_library_version():
    """Benchmarks call the public API (or fp8dp._C, documented in bench/README.md), never
    `hasattr` on the library to run against older trees."""
    probes = []
    for f in sorted(os.listdir(BENCH)):
        if f.endswith(".py"):
            with open(os.path.join(BENCH, f)) as fh:
                probes += [f"{f}:{i}" for i, line in enumerate(fh, 1) if "hasattr(" in line]
    assert probes == []


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(DEV) if f.endswith(".py")))
def test_dev_experiment_compiles(name, tmp_path):
    py_compile.compile(os.path.join(DEV, name), cfile=str(tmp_path / "c.pyc"), doraise=True)


@pytest.mark.parametrize(
    "torch_version, zbv", [("2.11.0+cu130", False), ("2.13.0", True), ("2.14.1+cu130", True)]
)
def test_pipeline_bubble_leaves_out_what_torch_cannot_run_on_gloo(torch_version, zbv):
    """On torch 2.11 the bench once failed every rank with zbv on gloo (the GPU machine, make
    test); it now leaves out what fp8dp.pipeline.check_backend refuses, and only that."""
    import pipeline_bubble_cpu

    got = pipeline_bubble_cpu.runnable_schedules("gloo", say=False, torch_version=torch_version)
    want = [k for k in pipeline_bubble_cpu.SCHEDULES if zbv or k[0] != "zbv"]
    assert got == want
    nccl = pipeline_bubble_cpu.runnable_schedules("nccl", say=False, torch_version=torch_version)
    assert nccl == pipeline_bubble_cpu.SCHEDULES
