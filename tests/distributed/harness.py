"""The distributed test harness: one case registry, torchrun launches, and per-case results that
pytest reports one test per case.

Starting a process group costs seconds on a small machine, so one launch runs many cases: every
case of a run (below) at one world size. Results travel as files, not as scraped output: before a
case each rank appends {"case", "rank", "status": "started"} to OUT/rank<R>.jsonl and after it
"pass" or "fail" (with the error and the traceback), flushed each time, so a rank that dies leaves
the lines of the cases it finished and names the case it died in.

Rank side: cases register with @case (cases_ddp.py, cases_nccl.py); worker.py, the torchrun entry,
sets the run up and calls run_cases(), which stops after the first case that failed on any rank.
Pytest side: launch() runs worker.py once, and again for the cases after a failure or a death, and
returns a Launch; Launch.check(name) fails with every failing rank's traceback, or with the end of
the log when a rank never finished the case. conftest.py's `launch` fixture launches once per
session and (run, world size); test_cases_gloo.py and test_cases_nccl.py parametrize over the
cases.
torchrun() is the one launcher of tests/distributed: the property test, the training demo's test
and the matrix runner (matrix/) start their ranks with it too, and run_ranks() runs one function of
a test module on a few gloo ranks (ranks.py) for tests that need no case registry.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


# ---- runs -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    name: str
    group: str  # backend of the torch.distributed world group
    device: str  # "cpu", or "cuda": one GPU per rank (LOCAL_RANK)
    timeout_s: int  # the whole launch
    doc: str


RUNS = {
    r.name: r
    for r in (
        Run(
            "gloo",
            "gloo",
            "cpu",
            600,
            "CPU processes on a gloo group; DDP's communicator is the " "ProcessGroupCommunicator",
        ),
        Run(
            "nccl",
            "nccl",
            "cuda",
            480,
            "one GPU per rank on a pure NCCL group, CUDA models and "
            "data; comm_backend 'auto' picks fp8dp's native NCCL communicator (the unique id "
            "travels as a CUDA tensor)",
        ),
        Run(
            "nccl_native",
            "gloo",
            "cuda",
            300,
            "one GPU per rank on a gloo group: fp8dp's native "
            "NCCL communicator asked for by name (the unique id travels as a CPU tensor), and "
            "gloo collectives that outlive an aborted NCCL communicator",
        ),
    )
}


def skip_reason(run: str, world_size: int) -> str | None:
    """Why this machine cannot launch `run` at `world_size` (None: it can)."""
    if RUNS[run].device == "cpu":
        return None
    import torch

    import fp8dp

    ok, reason = fp8dp.cuda_available(return_reason=True)
    if not ok:
        return f"{run} needs CUDA: {reason}"
    if torch.cuda.device_count() < world_size:
        return f"{run} needs {world_size} GPUs, torch sees {torch.cuda.device_count()}"
    if not fp8dp._C.native_nccl_available():
        return "fp8dp was built without the native NCCL communicator"
    return None


# ---- the case registry ----------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str  # fn.__name__[key=value,...]: the pytest id and the key of the results
    fn: Callable  # fn(rank, world_size, **kw), raises on failure
    kw: dict
    runs: tuple  # the runs it belongs to
    skip: dict = field(default_factory=dict)  # run -> why it is reported as skipped there


CASES: dict = {}


def case(runs=("gloo", "nccl"), skip=None, when=None, **grid):
    """Registers fn once per point of the product of `grid` (where when(**point) holds) for the
    given runs; `skip` maps a run to the reason the case is reported skipped on it."""
    skip = dict(skip or {})
    for r in (*runs, *skip):
        if r not in RUNS:
            raise ValueError(f"runs: unknown run {r!r}; expected one of {list(RUNS)}")

    def register(fn):
        for combo in itertools.product(*grid.values()):
            kw = dict(zip(grid.keys(), combo))
            if when is not None and not when(**kw):
                continue
            name = f"{fn.__name__}[{','.join(f'{k}={v}' for k, v in kw.items())}]"
            if name in CASES:
                raise ValueError(f"case {name!r} is registered twice")
            CASES[name] = Case(name, fn, kw, tuple(runs), skip)
        return fn

    return register


def load_cases() -> dict:
    """Every registered case (importing the case modules registers them)."""
    import cases_agreement  # noqa: F401
    import cases_ddp  # noqa: F401
    import cases_nccl  # noqa: F401
    import cases_optstate  # noqa: F401
    import cases_phases  # noqa: F401
    import cases_wire  # noqa: F401

    return CASES


# ---- rank side ------------------------------------------------------------------------------
def run_cases(names, out_dir, after_case=None, case_timeout_s=600) -> int:
    """Runs the named cases on this rank in order, one JSON line each (see the module docstring),
    up to and including the first case that fails on any rank; returns how many failed here.
    after_case() runs after every case (e.g. to free a communicator before the next case builds
    one).

    After each case the ranks exchange their results on a gloo group of its own (CPU, whatever
    the run's backend), so all of them start the next case together, or all stop: after a failure
    the world group may be out of step (a rank left a collective that the others still wait in,
    and gloo closes a timed-out connection for good), and the harness relaunches the remaining
    cases in a fresh process group rather than let them fail for a case that was not theirs."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, ws = dist.get_rank(), dist.get_world_size()
    between_cases = dist.new_group(backend="gloo", timeout=timedelta(seconds=case_timeout_s))
    failed = 0
    with open(Path(out_dir) / f"rank{rank}.jsonl", "w") as out:

        def write(rec):
            out.write(json.dumps(rec) + "\n")
            out.flush()

        for name in names:
            c = CASES[name]
            write({"case": name, "rank": rank, "status": "started"})
            t0 = time.perf_counter()
            rec = {"case": name, "rank": rank, "status": "pass"}
            try:
                c.fn(rank, ws, **c.kw)
            except Exception as e:
                failed += 1
                rec.update(
                    status="fail",
                    error=f"{type(e).__name__}: {e}",
                    traceback=traceback.format_exc(),
                )
            rec["seconds"] = round(time.perf_counter() - t0, 3)
            write(rec)
            # for whoever reads the log; the harness reads the files
            print(f"[rank {rank}/{ws}] {rec['status'].upper()} {name}", flush=True)
            if after_case is not None:
                after_case()
            any_failed = torch.tensor([rec["status"] == "fail"], dtype=torch.int32)
            dist.all_reduce(any_failed, op=dist.ReduceOp.MAX, group=between_cases)
            if any_failed.item():
                break
    return failed


# ---- pytest side ----------------------------------------------------------------------------
def torchrun(
    target, nproc: int, args=(), env=None, timeout: float = 600, module=False, cwd=None
) -> tuple:
    """Runs `target` (a script path, or a module with module=True) under torchrun --standalone
    with `nproc` ranks; returns (exit code, output). The environment gets this tree's fp8dp (its
    python/ when it holds a build, else the fp8dp already on PYTHONPATH, e.g. a worktree testing
    another tree's build) and the repository root (for `-m tests.distributed...`),
    OMP_NUM_THREADS=1, NCCL_NVLS_ENABLE=0 and PYTHONFAULTHANDLER=1 unless set. On timeout the whole process group is
    killed (torchrun's ranks too) and the exit code is "timeout"."""
    e = dict(os.environ)
    paths = [str(ROOT)]
    if list((ROOT / "python" / "fp8dp").glob("_C*.so")):
        paths.insert(0, str(ROOT / "python"))
    e["PYTHONPATH"] = os.pathsep.join(paths + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast: off, see scripts/gpu_check.sh
    # A rank that dies of SIGSEGV / SIGABRT prints every thread's Python stack: a rare abort in CI
    # then says where it came from instead of only "terminate called".
    e.setdefault("PYTHONFAULTHANDLER", "1")
    e.update(env or {})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *(["-m"] if module else []),
        str(target),
        *map(str, args),
    ]
    proc = subprocess.Popen(
        cmd,
        env=e,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", f"{out}\n[harness] killed after {timeout:.0f} s"


DONE = ("pass", "fail")


class Launch:
    """The results of one (run, world size): every rank's last record of every case, from one
    torchrun launch, or from several when a case failed (run_cases stops there) or a launch died
    in a case (that case's test fails with the log): each relaunch runs the cases after it."""

    MAX_LAUNCHES = 12  # then the remaining cases fail unrun: a broken build, not 76 failures

    def __init__(self, run: str, world_size: int, names: list, out_dir):
        self.run, self.world_size, self.names = run, world_size, list(names)
        self.records = {}  # (case, rank) -> (the rank's last line about it, launch index)
        self.launches = []  # (names, exit code, log)
        pending = list(names)
        while pending and len(self.launches) < self.MAX_LAUNCHES:
            k = len(self.launches)
            d = Path(out_dir) / f"launch{k}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "cases.json").write_text(json.dumps(pending))
            args = ["--run-name", run, "--out", d, "--cases", d / "cases.json"]
            rc, log = torchrun(HERE / "worker.py", world_size, args, timeout=RUNS[run].timeout_s)
            self.launches.append((pending, rc, log))
            for rank in range(world_size):
                f = d / f"rank{rank}.jsonl"
                for line in f.read_text().splitlines() if f.exists() else ():
                    rec = json.loads(line)
                    self.records[(rec["case"], rec["rank"])] = (rec, k)
            rest = [n for n in pending if not self._complete(n)]
            if rest and self._died_in(rest[0], k):
                rest = rest[1:]  # it died in this case (a crash, a hang): resume after it
            elif len(rest) == len(pending):
                break  # nothing ran at all: relaunching would not either
            pending = rest

    def _died_in(self, name, k) -> bool:
        """Some rank began the case in launch k and never finished it."""
        recs = [self.records.get((name, r)) for r in range(self.world_size)]
        return any(rec and rec[1] == k and rec[0]["status"] == "started" for rec in recs)

    def _complete(self, name) -> bool:
        return all(
            self.records.get((name, r), ({}, 0))[0].get("status") in DONE
            for r in range(self.world_size)
        )

    def _where(self) -> str:
        return f"{self.run}, world size {self.world_size}"

    def _log_tail(self, k) -> str:
        _, rc, log = self.launches[k]
        return f"\n--- end of the log of launch {k + 1} (exit code {rc}) ---\n{log[-6000:]}"

    def check(self, name: str) -> None:
        """Passes when every rank passed the case; fails with each failing rank's traceback, or
        with the log's end when a rank died in the case or never reached it."""
        import pytest

        problems, died = [], None
        for rank in range(self.world_size):
            rec, k = self.records.get((name, rank), (None, len(self.launches) - 1))
            if rec is None:
                died = k
                problems.append(f"rank {rank}: no result: its launch ended before this case")
            elif rec["status"] == "started":
                died = k
                problems.append(f"rank {rank}: started this case and never finished it")
            elif rec["status"] == "fail":
                problems.append(f"rank {rank}: {rec['error']}\n{rec['traceback']}")
        if problems:
            msg = f"{name} failed ({self._where()}):\n" + "\n".join(problems)
            pytest.fail(msg + (self._log_tail(died) if died is not None else ""), pytrace=False)

    def check_exit(self) -> None:
        """The launches themselves: each exited with 0, or with 1 after a case failed, and every
        case has a result from every rank."""
        import pytest

        problems = []
        failed_in = {k for rec, k in self.records.values() if rec["status"] == "fail"}
        for k, (_, rc, _) in enumerate(self.launches):
            if rc != (1 if k in failed_in else 0):
                problems.append(
                    f"launch {k + 1} of {len(self.launches)} exited with {rc}"
                    + (" after a failed case" if k in failed_in else "")
                    + self._log_tail(k)
                )
        missing = [n for n in self.names if not self._complete(n)]
        if missing:
            problems.append(
                f"{len(missing)} case(s) without a result from every rank: "
                + ", ".join(missing[:10])
            )
        if problems:
            pytest.fail(f"{self._where()}:\n" + "\n".join(problems), pytrace=False)


def launch(run: str, world_size: int, names: list, out_dir) -> Launch:
    """Runs the named cases of `run` at `world_size` ranks: one torchrun launch, more on a
    failure (Launch)."""
    return Launch(run, world_size, names, out_dir)


def case_params(launches) -> list:
    """pytest params (launch key, case name) for every case of every (run, world size) in
    `launches`, with readable ids; a case listed in its `skip` for a run is marked skipped."""
    import pytest

    params = []
    for run, ws in launches:
        for name, c in load_cases().items():
            if run in c.runs:
                params.append(pytest.param((run, ws), name, id=f"{run}-ws{ws}-{name}"))
            elif run in c.skip:
                params.append(
                    pytest.param(
                        (run, ws),
                        name,
                        id=f"{run}-ws{ws}-{name}",
                        marks=pytest.mark.skip(reason=c.skip[run]),
                    )
                )
    return params


def cases_of(run: str) -> list:
    return [n for n, c in load_cases().items() if run in c.runs]


# ---- one function on every rank ---------------------------------------------------------------
_RANK_RESULTS = {}  # (file, function, world size, args) -> results, or why the launch failed


def run_ranks(fn, world_size: int, *args, timeout: float = 300, pg_timeout_s: float = 60) -> list:
    """What fn(rank, world_size, *args) returned on each of `world_size` CPU ranks of one gloo
    process group, in rank order. fn is a module-level function of a test module (ranks.py
    imports the module from its file on every rank, joins the group and calls fn); args must be
    JSON values, and what fn returns travels through torch.save. One launch per (fn, world size,
    args) per session: later calls, from other tests, get the same results.

    A rank that raised, died or never returned fails the calling test (pytest.fail) with every
    failing rank's traceback, or with the end of the log; the process group times out after
    pg_timeout_s, so a rank left alone in a collective ends the launch instead of hanging it."""
    import inspect

    import pytest

    file = str(Path(inspect.getfile(fn)).resolve())
    key = (file, fn.__name__, world_size, json.dumps(args))
    if key not in _RANK_RESULTS:
        _RANK_RESULTS[key] = _launch_ranks(
            file, fn.__name__, world_size, args, timeout, pg_timeout_s
        )
    got = _RANK_RESULTS[key]
    if isinstance(got, str):
        pytest.fail(got, pytrace=False)
    return got


def _launch_ranks(file, name, world_size, args, timeout, pg_timeout_s):
    """run_ranks' launch: the results, or (a str) what went wrong."""
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "args.json").write_text(json.dumps(args))
        argv = ["--file", file, "--function", name, "--args", d / "args.json", "--out", d]
        argv += ["--timeout-s", pg_timeout_s]
        rc, log = torchrun(HERE / "ranks.py", world_size, argv, timeout=timeout)
        recs = []
        for r in range(world_size):
            f = d / f"rank{r}.pt"
            recs.append(torch.load(f, weights_only=False) if f.exists() else None)
    problems = []
    for r, rec in enumerate(recs):
        if rec is None:
            problems.append(f"rank {r}: no result (it died, or the launch ended first)")
        elif "error" in rec:
            problems.append(f"rank {r}: {rec['error']}\n{rec['traceback']}")
    if problems or rc != 0:
        where = f"{Path(file).name}::{name} on {world_size} ranks (exit code {rc})"
        tail = f"\n--- end of the log ---\n{log[-6000:]}"
        return f"{where}:\n" + "\n".join(problems) + tail
    return [rec["result"] for rec in recs]
