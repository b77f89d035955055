"""DistributedOptimizer.load_state_dict refuses a state_dict that does not fit, naming the entry,
and changes nothing when it does (C13 — masters follow parameters: check before change).

Before the check, a master of the wrong size went to `copy_`, which broadcasts: a 1-element master
made every element of its parameter one constant, silently; a short `masters` list restored only
the first shards (zip stops early); a missing key was a bare KeyError.

Evidence that the tests catch a missing check (2026-12-01, then restored):
1. The line `self._check_state_dict(state_dict)` in DistributedOptimizer.load_state_dict replaced
   by `pass`: 20 of 21 fail (all 19 cases and the broadcast test; the round trip passes), e.g.
       [master-one-element], [masters-short], [exp_avg-one-element]:
           Failed: DID NOT RAISE ValueError          (the broadcast; a partial restore)
       [no-masters]  KeyError: 'masters'
       [master-2d]   RuntimeError: The size of tensor a (256) must match the size of tensor b (16)
       [inner-two-groups]  'loaded state dict has a different number of parameter groups'
                     (torch's own check, after the masters were already overwritten)
2. The whole of optimizer.py as it was before (git show 1a0ce06:python/fp8dp/optimizer.py): the
   same 20 fail; world_size and rank only on the wording, they were checked before.

C13 (CASES_28): another optimizer's state (SGD's into AdamW) was accepted, replaced
the settings and failed at the next step() with KeyError: 'betas'; BF16 masters and BF16 state
were accepted (torch casts state to the master's dtype on load, silently). Mutations (2026-12-03,
each restored):
3. the 'optimizer_class' check off: [other-optimizer] (the settings check answers instead, with
   another message) and [class] (DID NOT RAISE) fail;
4. the group-settings check off (`if missing:`): [other-optimizer-no-class-key] and
   [group-no-betas] fail (the probe's "step() fails with the saved settings" answers instead);
5. the probe off (`probes[gi] = None`): [exp_avg-bf16], [state-no-step], [state-extra-key],
   [step-vector] (DID NOT RAISE) and [group-bad-betas] fail;
6. masters checked with is_floating_point() again: [master-bf16] DID NOT RAISE;
7. the per-element check without `v.dim() != 1`: [exp_avg-2d] DID NOT RAISE.
"""

import copy
import math

import pytest
import torch

import fp8dp


def _trained(group, steps=1, optimizer=torch.optim.AdamW, **kwargs):
    """Two Linear layers (4 shards at world size 1, in bucket order: 8, 128, 16, 256 elements),
    AdamW (lr 1e-2) unless told otherwise, `steps` steps so the inner optimizer has state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(fp8dp.Linear(16, 16), fp8dp.Linear(16, 8))
    cfg = fp8dp.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=False
    )
    ddp = fp8dp.DistributedDataParallel(model, cfg, process_group=group)
    opt = fp8dp.DistributedOptimizer(optimizer, ddp, **(kwargs or {"lr": 1e-2}))
    for _ in range(steps):
        _step(opt)
    return model, opt


def _step(opt):
    opt.zero_grad()
    opt._ddp(torch.randn(16, 16)).square().sum().backward()
    opt._ddp.finish_grad_sync()
    opt.step()


def _snapshot(model, opt):
    return (
        [p.detach().clone() for p in model.parameters()],
        [m.detach().clone() for m in opt._masters],
        copy.deepcopy(opt.optimizer.state_dict()),
    )


def _assert_same(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y), "the parameters or masters changed"
    sa, sb = a[2], b[2]
    assert sa["param_groups"] == sb["param_groups"], "the inner optimizer's groups changed"
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for name, v in sa["state"][k].items():
            assert torch.equal(v, sb["state"][k][name]), f"the inner state {k}.{name} changed"


def _set(key, value):
    def f(sd):
        sd[key] = value
        return sd

    return f


def _drop(key):
    def f(sd):
        del sd[key]
        return sd

    return f


def _edit(fn):
    def f(sd):
        fn(sd)
        return sd

    return f


CASES = {
    "not-a-dict": (
        lambda sd: list(sd.items()),
        r"^state_dict: expected the dict of DistributedOptimizer.state_dict\(\), " r"got list",
    ),
    "no-world_size": (_drop("world_size"), r"^state_dict\['world_size'\]: expected a key"),
    "no-shards": (_drop("shards"), r"^state_dict\['shards'\]: expected a key"),
    "no-masters": (_drop("masters"), r"^state_dict\['masters'\]: expected a key .* got none"),
    "no-optimizer": (_drop("optimizer"), r"^state_dict\['optimizer'\]: expected a key"),
    "world_size": (
        _set("world_size", 2),
        r"^state_dict\['world_size'\]: expected 1 \(this job's world size\), got 2: "
        r"saved at world size 2, loading at world size 1 \(resharding",
    ),
    "rank": (_set("rank", 1), r"^state_dict\['rank'\]: expected 0 .*, got 1"),
    "shards-short": (
        _edit(lambda sd: sd["shards"].pop()),
        r"^state_dict\['shards'\]: expected 4 shards .*, got 3",
    ),
    "shard-numel": (
        _edit(lambda sd: sd["shards"].__setitem__(1, (2, 0, 64))),
        r"^state_dict\['shards'\]\[1\]: expected \(param, offset, numel\) = "
        r"\(2, 0, 128\) .*, got \(2, 0, 64\)",
    ),
    "masters-short": (
        _edit(lambda sd: sd["masters"].pop()),
        r"^state_dict\['masters'\]: expected a list of 4 tensors .*, got 3",
    ),
    "master-one-element": (
        _edit(lambda sd: sd["masters"].__setitem__(3, torch.ones(1))),
        r"^state_dict\['masters'\]\[3\]: expected 256 elements \(float32\), "
        r"got 1 \(float32, shape \[1\]\)$",
    ),
    "master-int": (
        _edit(lambda sd: sd["masters"].__setitem__(3, torch.ones(256).long())),
        r"^state_dict\['masters'\]\[3\]: expected 256 elements \(float32\), got 256 "
        r"\(int64, shape \[256\]\)$",
    ),
    "master-2d": (
        _edit(lambda sd: sd["masters"].__setitem__(3, torch.ones(16, 16))),
        r"^state_dict\['masters'\]\[3\]: expected 256 elements \(float32\), got 256 "
        r"\(float32, shape \[16, 16\]\)$",
    ),
    "master-not-tensor": (
        _edit(lambda sd: sd["masters"].__setitem__(0, [0.0] * 8)),
        r"^state_dict\['masters'\]\[0\]: expected a tensor of 8 elements " r"\(float32\), got list",
    ),
    "inner-no-state": (
        _edit(lambda sd: sd["optimizer"].pop("state")),
        r"^state_dict\['optimizer'\]: expected a torch.optim state_dict",
    ),
    "inner-two-groups": (
        _edit(
            lambda sd: sd["optimizer"]["param_groups"].append(
                dict(sd["optimizer"]["param_groups"][0])
            )
        ),
        r"^state_dict\['optimizer'\]\['param_groups'\]: expected 1 group\(s\) "
        r"with 'params', got 2",
    ),
    "inner-group-short": (
        _edit(lambda sd: sd["optimizer"]["param_groups"][0]["params"].pop()),
        r"^state_dict\['optimizer'\]\['param_groups'\]\[0\]\['params'\]: "
        r"expected 4 parameters .*, got 3",
    ),
    "inner-unknown-id": (
        _edit(lambda sd: sd["optimizer"]["state"].__setitem__(99, sd["optimizer"]["state"][0])),
        r"^state_dict\['optimizer'\]\['state'\]\[99\]: expected one of the "
        r"parameter ids of 'param_groups' \[0, 1, 2, 3\], got 99",
    ),
    "exp_avg-one-element": (
        _edit(lambda sd: sd["optimizer"]["state"][3].__setitem__("exp_avg", torch.zeros(1))),
        r"^state_dict\['optimizer'\]\['state'\]\[3\]\['exp_avg'\]: expected "
        r"256 elements \(the master's\) or a scalar, got 1",
    ),
}


def _sgd_state(group):
    """The state_dict of the same model under SGD with momentum (another optimizer class)."""
    return _trained(group, optimizer=torch.optim.SGD, lr=0.1, momentum=0.9)[1].state_dict()


def _other_optimizer(keep_class_key):
    def f(sd, group):
        other = _sgd_state(group)
        if not keep_class_key:  # a state_dict saved before the class was recorded
            del other["optimizer_class"]
        return other

    return f


# C13 — masters follow parameters: another optimizer's state, dtypes and the class's own state keys.
# These take the process group (another model is built for the SGD state).
CASES_28 = {
    "other-optimizer": (
        _other_optimizer(keep_class_key=True),
        r"^state_dict\['optimizer_class'\]: expected 'torch.optim.adamw.AdamW' \(this optimizer's "
        r"inner class\), got 'torch.optim.sgd.SGD': another optimizer's state cannot be loaded",
    ),
    "other-optimizer-no-class-key": (
        _other_optimizer(keep_class_key=False),
        r"^state_dict\['optimizer'\]\['param_groups'\]\[0\]: expected the settings of AdamW "
        r"\[.*\], got \[.*'momentum'.*\] \(missing \['amsgrad', 'betas', .*\]\): the state "
        r"of another optimizer class\?",
    ),
    "class": (
        lambda sd, g: _set("optimizer_class", "torch.optim.adam.Adam")(sd),
        r"^state_dict\['optimizer_class'\]: expected 'torch.optim.adamw.AdamW' .*, got "
        r"'torch.optim.adam.Adam'",
    ),
    "master-bf16": (
        lambda sd, g: _edit(lambda sd: sd["masters"].__setitem__(3, sd["masters"][3].bfloat16()))(
            sd
        ),
        r"^state_dict\['masters'\]\[3\]: expected 256 elements \(float32\), got 256 "
        r"\(bfloat16, shape \[256\]\)$",
    ),
    "exp_avg-bf16": (
        lambda sd, g: _edit(
            lambda sd: sd["optimizer"]["state"][3].__setitem__(
                "exp_avg", sd["optimizer"]["state"][3]["exp_avg"].bfloat16()
            )
        )(sd),
        r"^state_dict\['optimizer'\]\['state'\]\[3\]\['exp_avg'\]: expected float32 "
        r"\(AdamW's\), got bfloat16$",
    ),
    "exp_avg-2d": (
        lambda sd, g: _edit(
            lambda sd: sd["optimizer"]["state"][3].__setitem__("exp_avg", torch.zeros(16, 16))
        )(sd),
        r"^state_dict\['optimizer'\]\['state'\]\[3\]\['exp_avg'\]: expected 256 elements "
        r"\(the master's\) or a scalar, got 256 \(shape \[16, 16\]\)$",
    ),
    "state-no-step": (
        lambda sd, g: _edit(lambda sd: sd["optimizer"]["state"][1].pop("step"))(sd),
        r"^state_dict\['optimizer'\]\['state'\]\[1\]: expected the keys \['exp_avg', "
        r"'exp_avg_sq', 'step'\] \(AdamW's state with the saved settings\), got \['exp_avg', "
        r"'exp_avg_sq'\] \(missing \['step'\], unexpected \[\]\)$",
    ),
    "state-extra-key": (
        lambda sd, g: _edit(
            lambda sd: sd["optimizer"]["state"][0].__setitem__("momentum_buffer", torch.zeros(8))
        )(sd),
        r"^state_dict\['optimizer'\]\['state'\]\[0\]: expected the keys .* unexpected "
        r"\['momentum_buffer'\]\)$",
    ),
    "step-vector": (
        lambda sd, g: _edit(
            lambda sd: sd["optimizer"]["state"][0].__setitem__("step", torch.ones(8))
        )(sd),
        r"^state_dict\['optimizer'\]\['state'\]\[0\]\['step'\]: expected a scalar "
        r"\(AdamW's\), got 8 elements$",
    ),
    "group-no-betas": (
        lambda sd, g: _edit(lambda sd: sd["optimizer"]["param_groups"][0].pop("betas"))(sd),
        r"^state_dict\['optimizer'\]\['param_groups'\]\[0\]: expected the settings of AdamW "
        r".*\(missing \['betas'\]\)",
    ),
    "group-bad-betas": (
        lambda sd, g: _edit(
            lambda sd: sd["optimizer"]["param_groups"][0].__setitem__("betas", "0.9")
        )(sd),
        r"^state_dict\['optimizer'\]\['param_groups'\]\[0\]: AdamW.step\(\) fails with the "
        r"saved settings \(ValueError: ",
    ),
}


@pytest.mark.parametrize("case", list(CASES_28))
def test_bad_state_dict_28_is_refused_and_changes_nothing(group, case):
    """C13: each of these was accepted before (or failed only after the settings
    were replaced) and is refused now, leaving the masters, the parameters and the inner
    optimizer bit-identical."""
    model, opt = _trained(group)
    saved = opt.state_dict()
    _step(opt)
    before = _snapshot(model, opt)
    mutate, message = CASES_28[case]
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(mutate(copy.deepcopy(saved), group))
    _assert_same(before, _snapshot(model, opt))
    _step(opt)  # and the optimizer still steps


def test_state_dict_without_class_key_still_loads(group):
    """A state_dict saved before 'optimizer_class' was recorded restores as before."""
    model, opt = _trained(group)
    saved = copy.deepcopy(opt.state_dict())
    at_save = _snapshot(model, opt)
    del saved["optimizer_class"]
    _step(opt)
    opt.load_state_dict(saved)
    _assert_same(at_save, _snapshot(model, opt))


@pytest.mark.parametrize("case", list(CASES))
def test_bad_state_dict_is_refused_and_changes_nothing(group, case):
    model, opt = _trained(group)
    saved = opt.state_dict()
    _step(opt)  # a second step, so that loading `saved` would change every value
    before = _snapshot(model, opt)
    mutate, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(mutate(copy.deepcopy(saved)))
    _assert_same(before, _snapshot(model, opt))


def test_round_trip_restores_exactly(group):
    model, opt = _trained(group)
    saved = copy.deepcopy(opt.state_dict())
    at_save = _snapshot(model, opt)
    _step(opt)
    opt.load_state_dict(saved)
    _assert_same(at_save, _snapshot(model, opt))


def test_wrong_size_master_would_have_been_broadcast(group):
    """What the check prevents: copy_ broadcasts a 1-element master over the whole shard, so the
    parameter becomes one constant (a silently untrainable model)."""
    model, opt = _trained(group)
    sd = copy.deepcopy(opt.state_dict())
    sd["masters"][3] = torch.full((1,), math.pi)  # the shards run in bucket order: 3 is weight 0
    with pytest.raises(ValueError, match=r"state_dict\['masters'\]\[3\]: expected 256 elements"):
        opt.load_state_dict(sd)
    w = model[0].weight
    assert not torch.all(w == math.pi), "the weight became the broadcast constant"


@pytest.mark.parametrize("write", ["copy_", "load_state_dict"])
def test_state_dict_saves_weights_written_outside_step(group, write):
    """C13 in the checkpoint: weights written after the last step() (an in-place copy_, a model
    load_state_dict) are what state_dict() saves, so a save / load round trip restores them, not
    the weights of before the write. Stateful finding (params family, seed 11: step, copy_ into
    a weight, save, load -> every element back to the pre-copy value).

    Mutation (run 2026-12-03): the _refresh_moved_masters() call in state_dict() removed -> both
    cases fail with "the written weights were not restored".
    """
    model, opt = _trained(group, optimizer=torch.optim.SGD, lr=0.0)
    new = [torch.full_like(p, 0.5 + i) for i, p in enumerate(model.parameters())]
    with torch.no_grad():
        if write == "copy_":
            for p, v in zip(model.parameters(), new):
                p.copy_(v)
        else:
            named = {n: v for (n, _), v in zip(model.named_parameters(), new)}
            model.load_state_dict(named, strict=False)
    sd = copy.deepcopy(opt.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt.load_state_dict(sd)
    for p, v in zip(model.parameters(), new):
        assert torch.equal(p, v), "the written weights were not restored"
