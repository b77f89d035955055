"""DistributedDataParallelConfig.defer_nan_check: the NaN check without the host's wait.

finish_grad_sync() launches the agreed NaN flags and returns; DistributedOptimizer hands them to
its fused optimizer as found_inf, which skips its step on the device; the next finish_grad_sync()
raises (naming the parameters) before it launches anything; check_deferred() raises at once.

Checked here, one process (a gloo group of one; tests/distributed/cases_ddp.py has the agreement
across ranks): over five iterations with NaN injected into one parameter's main_grad at the
third, the deferred run's parameters, master shards and AdamW state equal (bit for bit, the same
fused kernel on the same values) those of a synchronous run that skips the poisoned iteration; the
poisoned step itself changes nothing; the error arrives at the fourth finish (or at
check_deferred()), names the parameter, and a second finish goes on; clean runs never raise. Also
the config's refusals and the optimizer refusal. Generated sequences (seed printed,
FP8DP_DEFER_SEED replays one) poison random iterations and parameters, report at once or at the
next finish, with or without overlap, and compare every iteration bit for bit with the
synchronous check's run that drops the poisoned iterations. On CPU and, when present, CUDA.

Mutations (2026-12-06, restored): DistributedOptimizer.step without found_inf -> the poisoned
step wrote NaN into the parameters (the equality tests fail, the generated one at 3 seeds of 3); finish_grad_sync without
take_deferred_locked -> "DID NOT RAISE" in the error tests.
"""

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import fp8dp

N_MB = 2
POISONED = 2  # the third iteration (0-based)


def mlp(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 5)).to(device)


def batch(step, device):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(N_MB, 4, 12, generator=g), torch.randn(N_MB, 4, 5, generator=g)
    return x.to(device), y.to(device)


def build(group, device, *, defer, overlap):
    model = mlp(device)
    cfg = fp8dp.DistributedDataParallelConfig(
        overlap_grad_reduce=overlap,
        bucket_size=100,
        use_distributed_optimizer=True,
        check_for_nan_in_grad=True,
        defer_nan_check=defer,
    )
    ddp = fp8dp.DistributedDataParallel(model, cfg, process_group=group)
    opt = fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, lr=0.05, fused=True)
    return model, ddp, opt


def backward(ddp, step, device, poison=False):
    ddp.zero_grad_buffer()
    x, y = batch(step, device)
    for k in range(N_MB):
        ctx = ddp.no_sync() if k < N_MB - 1 else _null()
        with ctx:
            ((ddp(x[k]) - y[k]) ** 2).mean().backward()
    if poison:  # only '0.weight' (without overlap nothing has launched, nothing is flagged yet)
        ddp._params[0].main_grad.view(-1)[3] = float("nan")


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def state(model, opt):
    return (
        [p.detach().clone() for p in model.parameters()],
        [m.detach().clone() for m in opt._masters],
        [
            {k: v.clone() for k, v in opt.optimizer.state[m].items()}
            for m in opt._masters
            if m in opt.optimizer.state
        ],
    )


def assert_same(a, b):
    for xs, ys in zip(a[:2], b[:2]):
        assert len(xs) == len(ys)
        for x, y in zip(xs, ys):
            assert torch.equal(x, y)
    assert len(a[2]) == len(b[2])
    for sa, sb in zip(a[2], b[2]):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def test_poisoned_step_changes_nothing_and_the_next_finish_raises(group, device):
    model, ddp, opt = build(group, device, defer=True, overlap=False)
    ref_model, ref_ddp, ref_opt = build(group, device, defer=False, overlap=False)
    for step in range(5):
        if step == POISONED:
            before = state(model, opt)
            backward(ddp, step, device, poison=True)
            ddp.finish_grad_sync()  # no host wait, no error yet
            opt.step()
            assert_same(state(model, opt), before)  # skipped on the device
            assert all(torch.isfinite(p).all() for p in model.parameters())
            continue
        backward(ddp, step, device)
        if step == POISONED + 1:
            with pytest.raises(RuntimeError) as e:
                ddp.finish_grad_sync()
            msg = str(e.value)
            assert "rank 0 has NaN or Inf in the local gradients of '0.weight'" in msg, msg
            assert "'2.weight'" not in msg and "'0.bias'" not in msg, msg
            assert f"the gradients of iteration {POISONED + 1} (counted by zero_grad" in msg, msg
            assert "nothing changed" in msg, msg  # no group of this iteration had launched
            assert ddp.phase == "accumulating"
        ddp.finish_grad_sync()
        opt.step()
        backward(ref_ddp, step, device)
        ref_ddp.finish_grad_sync()
        ref_opt.step()
        assert_same(state(model, opt), state(ref_model, ref_opt))
    ddp.check_deferred()  # the last iteration was clean


def test_check_deferred_raises_at_once_and_consumes(group, device):
    model, ddp, opt = build(group, device, defer=True, overlap=False)
    backward(ddp, 0, device, poison=True)
    ddp.finish_grad_sync()
    opt.step()
    with pytest.raises(RuntimeError, match="'0.weight'"):
        ddp.check_deferred()
    ddp.check_deferred()  # consumed: nothing pending
    backward(ddp, 1, device)
    ddp.finish_grad_sync()  # and the next finish does not raise it again
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nan_through_the_data_with_overlap(group, device):
    """With overlap_grad_reduce the groups launch during the backward: NaN in the input poisons
    every gradient; the next finish (its groups launched too) raises and the iteration fails, so
    the caller redoes it; the parameters never see the NaN."""
    model, ddp, opt = build(group, device, defer=True, overlap=True)
    clean = state(model, opt)
    ddp.zero_grad_buffer()
    x, y = batch(0, device)
    x[0, 0, 0] = float("nan")
    for k in range(N_MB):
        with ddp.no_sync() if k < N_MB - 1 else _null():
            ((ddp(x[k]) - y[k]) ** 2).mean().backward()
    ddp.finish_grad_sync()
    opt.step()
    after = state(model, opt)
    assert_same(after[:2] + ([],), clean[:2] + ([],))
    # the first step made AdamW's state; skipped, it stands at step 0 with zero moments
    assert after[2] and all(not any(v.any() for v in st.values()) for st in after[2])
    backward(ddp, 1, device)
    assert ddp.phase == "sync_started"
    with pytest.raises(RuntimeError) as e:
        ddp.finish_grad_sync()
    assert "'0.weight'" in str(e.value) and "'2.bias'" in str(e.value)
    assert ddp.phase == "failed"
    backward(ddp, 1, device)  # redo: zero_grad_buffer() first
    ddp.finish_grad_sync()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(model[0].weight, clean[0][0])  # this step did update


@pytest.mark.parametrize(
    "kw, needs",
    [
        (dict(use_distributed_optimizer=True), "check_for_nan_in_grad=True"),
        (dict(check_for_nan_in_grad=True), "use_distributed_optimizer=True"),
        (
            dict(check_for_nan_in_grad=True, use_distributed_optimizer=True, grad_ledger=True),
            "grad_ledger=False",
        ),
    ],
)
def test_config_refusals(kw, needs):
    with pytest.raises(ValueError, match=f"defer_nan_check: True needs {needs}"):
        fp8dp.DistributedDataParallelConfig(defer_nan_check=True, **kw)


def test_an_optimizer_that_cannot_skip_on_the_device_is_refused(group):
    model = mlp("cpu")
    cfg = fp8dp.DistributedDataParallelConfig(
        use_distributed_optimizer=True, check_for_nan_in_grad=True, defer_nan_check=True
    )
    ddp = fp8dp.DistributedDataParallel(copy.deepcopy(model), cfg, process_group=group)
    with pytest.raises(ValueError) as e:
        fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, lr=0.1)
    assert "optimizer_cls: defer_nan_check needs an optimizer that skips" in str(e.value)
    assert "got AdamW(lr=0.1)" in str(e.value)


CI_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "ci_convergence.yaml")


@pytest.mark.parametrize("poisoned, raised_by", [(2, "finish_grad_sync"), (3, "check_deferred")])
def test_the_training_loop_raises_a_deferred_nan(group, tmp_path, monkeypatch, poisoned, raised_by):
    """fp8dp.train with ddp.defer_nan_check, NaN put into main_grad before the finish of step
    `poisoned` of 3: a middle step raises at the next step's finish_grad_sync, the last at the
    loop's check_deferred() after its steps, each naming the parameter."""
    from fp8dp.train import loop
    from fp8dp.train.config import load_config

    finish, calls = fp8dp.DistributedDataParallel.finish_grad_sync, []

    def poisoning_finish(self):  # twice per step: the loop's, then the optimizer's (a no-op)
        calls.append(1)
        if len(calls) == 2 * poisoned - 1:
            self._params[0].main_grad.view(-1)[0] = float("nan")
        return finish(self)

    monkeypatch.setattr(fp8dp.DistributedDataParallel, "finish_grad_sync", poisoning_finish)
    check = fp8dp.DistributedDataParallel.check_deferred
    checked = []
    monkeypatch.setattr(
        fp8dp.DistributedDataParallel,
        "check_deferred",
        lambda self: (checked.append(len(calls)), check(self))[1],
    )
    cfg = load_config(
        CI_CONFIG,
        [
            "train.steps=3",
            "train.eval_every=100",
            "ddp.defer_nan_check=true",
            "ddp.overlap_grad_reduce=false",
            f"out.dir={tmp_path / 'run'}",
            f"data.cache_dir={tmp_path / 'corpus'}",
            "run.device=cpu",
        ],
    )
    torch.manual_seed(0)
    with pytest.raises(RuntimeError) as e:
        loop.train(
            cfg, str(tmp_path / "run" / "fp8"), rank=0, world_size=1,
            device=torch.device("cpu"), progress=False,
        )  # fmt: skip
    msg = str(e.value)
    assert "has NaN or Inf in the local gradients of" in msg and "defer_nan_check" in msg, msg
    if raised_by == "finish_grad_sync":
        assert len(calls) == 2 * poisoned + 1 and not checked  # the next step's first finish
    else:
        assert checked == [6]  # after the last step's two finishes


def test_random_sequences_equal_the_synchronous_check(group, device):
    """Generated sequences (seed printed; FP8DP_DEFER_SEED replays one): eight iterations, each
    poisoned with probability 0.35 (NaN into one random parameter's main_grad, or, with overlap,
    into the input), and after a poisoned step either check_deferred() at once or the next
    finish_grad_sync() raising (redoing the iteration when its groups had launched). After every
    iteration parameters, masters and AdamW state equal, bit for bit, those of a run with the
    synchronous check that drops each poisoned iteration (its finish refuses; zero_grad_buffer()).
    """
    import os
    import random

    seed = int(os.environ.get("FP8DP_DEFER_SEED", random.randrange(2**31)))
    print(f"FP8DP_DEFER_SEED={seed}")
    rng = random.Random(seed)
    overlap = rng.random() < 0.5
    model, ddp, opt = build(group, device, defer=True, overlap=overlap)
    ref_model, ref_ddp, ref_opt = build(group, device, defer=False, overlap=overlap)
    n_params = len(ddp._params)

    def run_backward(d, step, poison, where):
        """One iteration's backward; poisoned: NaN in the input with overlap (every gradient,
        before its group launches), else in one element of parameter `where`'s main_grad."""
        d.zero_grad_buffer()
        x, y = batch(step, device)
        if poison and overlap:
            x[0, 0, 0] = float("nan")
        for k in range(N_MB):
            with d.no_sync() if k < N_MB - 1 else _null():
                ((d(x[k]) - y[k]) ** 2).mean().backward()
        if poison and not overlap:
            d._params[where].main_grad.view(-1)[0] = float("nan")

    pending = False  # the defer run has a poisoned step not yet reported
    for step in range(8):
        poison = rng.random() < 0.35
        where = rng.randrange(n_params)
        # the defer run: the last poisoned step's report first (at once, or at this finish)
        if pending and rng.random() < 0.4:
            with pytest.raises(RuntimeError, match="defer_nan_check"):
                ddp.check_deferred()
            pending = False
        run_backward(ddp, step, poison, where)
        if pending:
            with pytest.raises(RuntimeError, match="defer_nan_check"):
                ddp.finish_grad_sync()
            if ddp.phase == "failed":  # its groups had launched: redo the iteration
                run_backward(ddp, step, poison, where)
        ddp.finish_grad_sync()
        opt.step()
        pending = poison
        # the reference: the synchronous check refuses the poisoned iteration; it is dropped
        run_backward(ref_ddp, step, poison, where)
        if poison:
            with pytest.raises(RuntimeError, match="check_for_nan_in_grad"):
                ref_ddp.finish_grad_sync()
        else:
            ref_ddp.finish_grad_sync()
            ref_opt.step()
        a, b = state(model, opt), state(ref_model, ref_opt)
        assert_same(a[:2] + ([],), b[:2] + ([],))
        # AdamW's state: equal where the reference has it (a run whose first steps were all
        # skipped has a state at step 0 with zero moments that the reference lacks)
        if b[2]:
            assert_same(a, b)
    if pending:
        with pytest.raises(RuntimeError, match="defer_nan_check"):
            ddp.check_deferred()
    ddp.check_deferred()
