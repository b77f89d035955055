"""The distributed optimizer's masters follow the parameters (C13 — masters follow parameters), on
the harness's runs (gloo at world sizes 2 and 3, nccl on 2 GPUs).

Weights changed after fp8dp.DistributedOptimizer was built, in each way a training script does it
(model.load_state_dict on every rank; rank 0 loads and ddp.broadcast_params(0) shares; an in-place
copy_ into every parameter; a write through p.data followed by reload_model_params()), with and
without a step before the change, then one step():
- at lr = 0 the parameters are the new weights exactly (before the fix: the old ones, 3.5-4.05
  off), on every rank;
- at lr > 0 they equal a float64 single-process AdamW that took the same steps and had its
  weights set to the new ones (the reference step from the new weights, with the moments of the
  steps before).

Tolerance at lr > 0: the FP32 one of cases_ddp (each gradient element a sum of <= 3 * 4 per-sample
terms reduced in another order than the reference, relative 2^-24 each), which AdamW's
normalised update passes on undamped (update = lr m / (sqrt(v) + eps), so a relative error e of
the gradient moves it by <= lr e); the parameters' own FP32 rounding adds 2^-24 relative.

Mutations tried (2026-12-03, 2 ranks, each caught, then restored):
1. DistributedOptimizer.step() without `self._refresh_moved_masters()`: the 20
   masters_follow_params cases of load, broadcast and copy_ fail (the 4 of reload pass: it
   refreshes by itself), e.g. [how=load,steps_before=0,lr=0.0,...] "rank 0: parameter 0 is not
   the new weight after step() at lr=0 (max |diff| 0.519)", [how=load,...,lr=0.01,...]
   "Tensor-likes are not close!" (the step went from the old weights).
2. reload_model_params() as `pass`: the [how=reload,...] cases fail alike (a write through .data
   is invisible to version counters, by torch's design).
3. `self._versions = self._param_versions()` moved above copy_shards in step() (the optimizer's
   own bump then looks like an outside write): masters_survive_own_writes fails for both dtypes,
   "the optimizer's own writes were taken for outside ones: [{0, 1, 2, 3, 4, 5}, ...]".
4. _copy_params_to_masters copying whole shards (no torch.where): masters_survive_own_writes
   [bfloat16] "writing the same weights again changed a master", and both
   bf16_changed_elements_take_the_new_value cases "an unchanged element lost its master".
"""

import copy

import cases_ddp as D
import torch
from harness import case

import fp8dp

HOWS = ["load", "broadcast", "copy_", "reload"]


def _build(lr, overlap_param_gather=False, dtype=torch.float32):
    model = D.mlp(seed=0, dtype=dtype)
    cfg = D.cfg(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=overlap_param_gather,
        bucket_size=150,  # several buckets, so shards of one parameter land on several ranks
    )
    ddp = fp8dp.DistributedDataParallel(model, cfg)
    opt = fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, lr=lr, weight_decay=0.1)
    return model, ddp, opt


def _train_step(ddp, opt, step, rank, ws):
    dtype = next(ddp.module.parameters()).dtype
    x, y = D.data(step, ws, 1)
    opt.zero_grad()
    D.mse(ddp(D.micro(x, rank, 0, 1).to(dtype)), D.micro(y, rank, 0, 1).to(dtype)).backward()
    opt.step()


def _ref_step(ref, ref_opt, step, ws):
    """The same step on the float64 single-process twin: the global batch's mean loss."""
    x, y = D.data(step, ws, 1)
    ref_opt.zero_grad()
    D.mse(ref(x.double()), y.double()).backward()
    ref_opt.step()


def _change_weights(how, model, ddp, opt, new_sd, rank):
    if how == "load":
        model.load_state_dict(new_sd)
    elif how == "broadcast":
        if rank == 0:  # rank 0 reads the checkpoint, the others get it from there
            model.load_state_dict(new_sd)
        ddp.broadcast_params(0)
    elif how == "copy_":
        with torch.no_grad():
            for p, w in zip(model.parameters(), new_sd.values()):
                p.copy_(w)
    elif how == "reload":
        opt.finish_param_sync()  # .data writes are not waited for by any hook
        for p, w in zip(model.parameters(), new_sd.values()):
            p.data.copy_(w)  # invisible to version counters: reload_model_params says so
        opt.reload_model_params()
    else:
        raise ValueError(how)


@case(
    how=HOWS,
    steps_before=[0, 1],
    lr=[0.0, 1e-2],
    overlap_param_gather=[False, True],
    # with overlapped gathers, copy_ and .data writes need opt.finish_param_sync() first (README);
    # the cases without it are the ones a script can get wrong
    when=lambda how, overlap_param_gather, **_: how in ("load", "broadcast")
    or not overlap_param_gather,
)
def masters_follow_params(rank, ws, how, steps_before, lr, overlap_param_gather):
    model, ddp, opt = _build(lr, overlap_param_gather)
    ref = copy.deepcopy(model).double()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1)
    for step in range(steps_before):
        _train_step(ddp, opt, step, rank, ws)
        _ref_step(ref, ref_opt, step, ws)
    opt.finish_param_sync()
    new_sd = {k: v.clone() for k, v in D.mlp(seed=5).state_dict().items()}  # the checkpoint
    _change_weights(how, model, ddp, opt, new_sd, rank)
    with torch.no_grad():
        for p, w in zip(ref.parameters(), new_sd.values()):
            p.copy_(w.double())
    _train_step(ddp, opt, steps_before, rank, ws)
    _ref_step(ref, ref_opt, steps_before, ws)
    opt.finish_param_sync()
    for i, (p, w, r) in enumerate(zip(model.parameters(), new_sd.values(), ref.parameters())):
        if lr == 0.0:
            assert torch.equal(p, w.to(p.device)), (
                f"rank {rank}: parameter {i} is not the new weight after step() at lr=0 "
                f"(max |diff| {(p - w.to(p.device)).abs().max().item():.3g})"
            )
        else:
            torch.testing.assert_close(p.double(), r.to(p.device), **D.FP32)
    # every rank holds the same parameters (the all-gather shared the refreshed shards)
    for p in model.parameters():
        gathered = [torch.empty_like(p) for _ in range(ws)]
        torch.distributed.all_gather(gathered, p.detach().contiguous())
        assert all(torch.equal(g, gathered[0]) for g in gathered), "the ranks' parameters differ"


@case(dtype=[torch.float32, torch.bfloat16])
def masters_survive_own_writes(rank, ws, dtype):
    """The optimizer's own writes (copy_shards and the all-gather in step(), its load_state_dict)
    bump the parameters' version counters too; they must not count as writes from outside (no
    refresh at all after them). A write from outside that leaves the values as they were (the
    same weights loaded again, a broadcast of equal weights: a resume that loads the model after
    the optimizer) is seen, but changes no master, so BF16 masters keep their extra bits."""
    model, ddp, opt = _build(1e-3, dtype=dtype)
    refreshes = []
    real = opt._copy_params_to_masters
    opt._copy_params_to_masters = lambda moved: (refreshes.append(moved), real(moved))
    for step in range(3):
        _train_step(ddp, opt, step, rank, ws)
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)
    _train_step(ddp, opt, 3, rank, ws)
    assert refreshes == [], f"the optimizer's own writes were taken for outside ones: {refreshes}"
    if dtype == torch.bfloat16:  # the masters do hold more than the parameters
        assert (
            any(
                not torch.equal(m, ddp.param_shard(s).float())
                for m, s in zip(opt._masters, opt._shards)
            )
            or not opt._masters
        )
    masters = [m.detach().clone() for m in opt._masters]
    model.load_state_dict(copy.deepcopy(model.state_dict()))  # the same weights again
    ddp.broadcast_params(0)
    opt._refresh_moved_masters()  # what the next step() does first
    assert len(refreshes) == 1 or not opt._masters, "the writes from outside went unseen"
    for a, b in zip(masters, opt._masters):
        assert torch.equal(a, b), "writing the same weights again changed a master"


@case(how=["load", "copy_"])
def bf16_changed_elements_take_the_new_value(rank, ws, how):
    """BF16 parameters: after a write from outside, a changed element's master is the new value
    exactly (the next step at lr=0 leaves the new weights), an unchanged one keeps its master."""
    model, ddp, opt = _build(0.0, dtype=torch.bfloat16)
    with torch.no_grad():  # masters with bits below BF16's, as training leaves them
        for m in opt._masters:  # < half a BF16 spacing (>= 2^-9 relative): still rounds to p
            m.mul_(1.0 + torch.rand_like(m) * 2.0**-10)
    new_sd = {k: v.clone() for k, v in model.state_dict().items()}
    new_sd["0.weight"][0].fill_(0.25)  # one row changes, the rest is written back unchanged
    kept = [m.detach().clone() for m in opt._masters]
    _change_weights(how, model, ddp, opt, new_sd, rank)
    _train_step(ddp, opt, 0, rank, ws)
    for p, w in zip(model.parameters(), new_sd.values()):
        assert torch.equal(p, w), "the step at lr=0 did not leave the new weights"
    changed = 0
    for m, k, s in zip(opt._masters, kept, opt._shards):
        p = ddp.param_shard(s)
        differs = p != k.to(p.dtype)
        assert torch.equal(m[differs], p[differs].float()), "a changed element kept its old master"
        assert torch.equal(m[~differs], k[~differs]), "an unchanged element lost its master"
        changed += int(differs.sum())
    total = torch.tensor([changed])
    torch.distributed.all_reduce(total)
    assert total.item() == 12, f"expected the 12 elements of row 0 to change, got {total.item()}"


@case()
def reload_model_params_is_local_and_exact(rank, ws):
    """reload_model_params(): every master equals its parameter (FP32 of it), inner state kept."""
    model, ddp, opt = _build(1e-2)
    _train_step(ddp, opt, 0, rank, ws)
    opt.finish_param_sync()
    state = copy.deepcopy(opt.optimizer.state_dict()["state"])
    with torch.no_grad():
        for p in model.parameters():
            p.data.mul_(2.0)
    opt.reload_model_params()
    for m, s in zip(opt._masters, opt._shards):
        assert torch.equal(m, ddp.param_shard(s).float())
    after = opt.optimizer.state_dict()["state"]
    for k in state:
        for name, v in state[k].items():
            assert torch.equal(v, after[k][name]), f"inner state {k}.{name} changed"
