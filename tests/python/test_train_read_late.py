"""The training loop reads a plain step's loss one step late (loop._train_steps): on CUDA, reading
it at once makes the host wait for the step's end, and the GPU idles while the next step's first
kernels are launched.

- The order of launches and reads over six steps with validation every three: a plain step is
  read after the next step has been launched; a step with validation, the last step, a step
  before a checkpoint or at --stop-at, and every step of a pipeline run are read before the next
  launch (the weights they validate or save are those of that step).
- The records are the same, bit for bit (train_loss, grad_norm, val_loss, lr), as those of the
  same run read at once (`_reads_late` forced to False), and both runs train the same weights.
- A step's time is taken where the device runs it (loop._StepTimer: CUDA events, or the host
  clock around the launch on a CPU), so every step's time covers its own step, read late or not.

Mutations (2026-12-05, restored): `_reads_late` returning False always: the two order tests
failed (each read before the next launch); the `continue` after `pending = rec` removed (a step
read at once and again after the next launch): those two and the records test failed. The
first version's timing (from the host's read of the step before): the step-time test failed
(a step at 0.0001 s).
"""

import math
import time
from pathlib import Path

import pytest
import torch

from fp8dp.train import loop
from fp8dp.train.config import load_config
from fp8dp.train.metrics import MetricsWriter

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "ci_convergence.yaml")


def _run(tmp_path, name, monkeypatch, *, read_late=True, stop_at=None, sets=(), sleep=0.0):
    """Trains the CI config for six steps on the CPU (rank 0 of the module's gloo group);
    returns (events, records): ("launch", step) when a step is launched, ("read", step) when its
    record is written."""
    events = []
    step_fn, write_fn = loop._Run.step, MetricsWriter.write

    def step(self, s):
        events.append(("launch", s + 1))
        time.sleep(sleep)  # part of the step: on the CPU a step runs while it is launched
        return step_fn(self, s)

    def write(self, rec):
        if rec["step"] > 0:
            events.append(("read", rec["step"]))
        return write_fn(self, rec)

    monkeypatch.setattr(loop._Run, "step", step)
    monkeypatch.setattr(MetricsWriter, "write", write)
    if not read_late:
        monkeypatch.setattr(loop, "_reads_late", lambda *a, **k: False)
    base = [
        "train.steps=6",
        "train.eval_every=3",
        f"out.dir={tmp_path / name}",
        f"data.cache_dir={tmp_path / 'corpus'}",
    ]
    cfg = load_config(CONFIG, base + list(sets) + ["run.device=cpu"])
    run_dir = tmp_path / name / "fp8"
    save = str(tmp_path / name / "ckpt") if stop_at else None
    torch.manual_seed(0)
    loop.train(
        cfg, str(run_dir), rank=0, world_size=1, device=torch.device("cpu"), progress=False,
        save=save, stop_at=stop_at,
    )  # fmt: skip
    monkeypatch.undo()
    import json

    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return events, recs


def test_plain_steps_are_read_after_the_next_launch(group, tmp_path, monkeypatch):
    events, recs = _run(tmp_path, "late", monkeypatch)
    # Steps 3 and 6 validate (eval_every 3; 6 is the last): read before the next launch.
    assert events == [
        ("launch", 1), ("launch", 2), ("read", 1), ("launch", 3), ("read", 2), ("read", 3),
        ("launch", 4), ("launch", 5), ("read", 4), ("launch", 6), ("read", 5), ("read", 6),
    ]  # fmt: skip
    steps = [r for r in recs if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in steps)
    assert [r["step"] for r in steps if "val_loss" in r] == [3, 6]


def test_a_stop_at_step_is_read_before_the_next_launch(group, tmp_path, monkeypatch):
    events, _ = _run(tmp_path, "stop", monkeypatch, stop_at=2)
    assert events == [("launch", 1), ("launch", 2), ("read", 1), ("read", 2)]


def test_read_late_records_equal_read_at_once(group, tmp_path, monkeypatch):
    _, late = _run(tmp_path, "late", monkeypatch)
    events, now = _run(tmp_path, "now", monkeypatch, read_late=False)
    assert events == [(kind, s) for s in range(1, 7) for kind in ("launch", "read")]
    keys = ("step", "train_loss", "grad_norm", "val_loss", "lr")
    assert [{k: r.get(k) for k in keys} for r in late] == [{k: r.get(k) for k in keys} for r in now]
    assert any("grad_norm" in r for r in late)  # the CI config clips: the norm is read late too


def test_every_step_time_covers_its_own_step(group, tmp_path, monkeypatch):
    """Each step's step_time_s includes its own run (a step made 50 ms longer): a step read late
    is not timed from when the host read the one before it (which, on the CPU, is after the
    step itself ran: the validation steps of a first version were timed at ~0 s)."""
    _, recs = _run(tmp_path, "sleep", monkeypatch, sleep=0.05)
    times = [r["step_time_s"] for r in recs if r["step"] > 0]
    assert len(times) == 6 and min(times) >= 0.05, times


@pytest.mark.parametrize("backlog, expected", [(0, False), (1, True)])
def test_the_stop_margin_grows_with_the_steps_in_flight(backlog, expected):
    """A time budget with 2.5 longest iterations left: stop only when a step launched but not
    finished counts too (2 + 1 > 2.5)."""
    cfg = load_config(CONFIG, ["train.steps=100"])
    t_enter = loop.time.perf_counter()
    stop = loop._Stopper(cfg, None, 2.5, t_enter, torch.device("cpu"), world_size=1)
    assert not stop.waits
    assert stop(10, 1.0 - 1e-3, backlog) is expected


def test_several_ranks_with_a_time_budget_decide_on_the_host(group):
    """With several ranks and a time budget, rank 0's stop decision reaches the others through a
    gloo group (here the default group is gloo: that one), so it waits for no device work and
    steps can still be read late; before 2026-12-05 it was a broadcast from the device, `waits`,
    and every such run read each step at once. One rank alone never broadcasts."""
    cfg = load_config(CONFIG, ["train.steps=100"])
    t_enter = loop.time.perf_counter()
    stop = loop._Stopper(cfg, None, 3600.0, t_enter, torch.device("cpu"), world_size=2)
    assert stop.group is torch.distributed.group.WORLD and not stop.waits
    assert stop(10, 1.0, backlog=1) is False  # the broadcast runs (a world of one here)
    alone = loop._Stopper(cfg, None, 3600.0, t_enter, torch.device("cpu"), world_size=1)
    assert alone.group is None and not alone.waits
