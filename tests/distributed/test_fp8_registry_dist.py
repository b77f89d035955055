"""C9 across 2 processes (gloo, CPU): update_fp8_scales reduces the amaxes of the same states, in
the same order (by identity), on every rank, and fails on every rank, naming the first differing
state, when the ranks' FP8 states differ: identities, an empty micro-batch on one rank, a
different recipe on one rank (also between block and current scaling, which keep no state),
update_fp8_scales twice in one step.

Each rank names its modules with fp8dp.scaling.set_fp8_identities(model), as
fp8dp.DistributedDataParallel does. The process group (harness.run_ranks) has a 60 s timeout, so
a rank left alone in a collective ends the test instead of hanging it.

Evidence that these tests catch the defects (run on 2026-12-01, then restored):

1. The registry check removed (update_fp8_scales straight to the amax all_reduce, as before):
   - count_differs: rank 0 dies in gloo ("terminate called after throwing an instance of
     'gloo::EnforceNotMet' ... op.preamble.length <= op.nbytes. 12 vs 8. Received data size
     doesn't match expected size"), torch.multiprocessing reports "process 0 terminated with
     signal SIGABRT" (the original defect; under harness.run_ranks: "rank 0: no result");
   - modules_differ and recipe_differs: no error at all, the update runs with the other rank's
     amaxes ('error' missing from both ranks' results, histories rolled).
2. The registry ordered by creation instead of identity (refresh() sorting by id only):
   order_differs fails on both ranks with "RuntimeError: update_fp8_scales: the ranks' FP8
   scaling states differ (C9) ... first difference at position 0 of the amax reduction: rank 0:
   'fc1: Linear(in_features=32, out_features=32) [...]'; rank 1: 'fc2: ...'" (before this fix,
   with no check, fc1's amax was silently reduced with the other rank's fc2).
3. ScalingState::note_reduced made a no-op (an update that another rank's amax made does not
   count as a scale on the rank whose micro-batch was empty): the empty-rank test fails with
   "the ranks' scales differ after step 1's forward: [140.45, 2534.67, 57344.0] vs
   [16.47, 2534.67, 57344.0]" (rank 1 took its own first input scale).
4. The "observed" flag decided per rank (update_fp8_scales returning before the check when this
   rank recorded nothing): in step 2 rank 1, which ran no micro-batch, returns while rank 0 waits
   in the check's all_reduce; rank 0 fails with "RuntimeError: [.../gloo/transport/tcp/pair.cc:553]
   Connection closed by peer" (a hang until the timeout if rank 1 had stayed alive).
5. registry_note_recipe made a no-op (2026-12-03, the stateless recipes out of the check):
   block_against_current and current_margin_differs pass the update without a word ("update_fp8_
   scales must fail on every rank"), block_on_one_rank names "none (0 entries)" instead of the
   recipe, and the agreeing stateless recipes are not seen.
"""

import pytest
import torch
from harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2
N = 32  # features: a multiple of 16, as FP8 GEMMs need


def _model(names, rank, creation_order=None):
    import fp8dp

    torch.manual_seed(0)
    order = creation_order or names
    built = {n: fp8dp.Linear(N, N) for n in order}
    model = torch.nn.ModuleDict({n: built[n] for n in names})
    fp8dp.scaling.set_fp8_identities(model)
    return model


def _step(model, names, rank, recipe, tokens=16, scale=1.0):
    import fp8dp

    gen = torch.Generator().manual_seed(100 + rank)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        for i, n in enumerate(names):
            x = torch.randn(tokens, N, generator=gen) * scale * (i + 1) * (rank + 1)
            model[n](x).sum().backward()


def _histories(model):
    return {n: m._core.amax_history.clone() for n, m in model.items() if m.get_extra_state()}


def _scenario(name, rank):
    import fp8dp

    recipe = fp8dp.DelayedScaling(amax_history_len=4)
    out = {}
    if name in MISMATCH:
        model = _model(["fc1", "fc2", "fc3"], rank)
        used = {
            "count_differs": [["fc1", "fc2"], ["fc1", "fc2", "fc3"]],
            "modules_differ": [["fc1", "fc2"], ["fc1", "fc3"]],
        }.get(name, [["fc1", "fc2"], ["fc1", "fc2"]])[rank]
        if name == "recipe_differs" and rank == 1:
            recipe = fp8dp.DelayedScaling(amax_history_len=4, margin=1)
        if name == "block_on_one_rank" and rank == 0:  # block scaling keeps no scaling state
            recipe = fp8dp.Float8BlockScaling()
        if name == "block_against_current":  # neither keeps state: only the noted recipes differ
            recipe = fp8dp.Float8BlockScaling() if rank == 0 else fp8dp.Float8CurrentScaling()
        if name == "current_margin_differs":
            recipe = fp8dp.Float8CurrentScaling(margin=rank)
        _step(model, used, rank, recipe)
        before = _histories(model)
        try:
            fp8dp.update_fp8_scales()
        except RuntimeError as e:
            out["error"] = str(e)
        out["unchanged"] = all(torch.equal(before[n], h) for n, h in _histories(model).items())
    elif name == "order_differs":
        # Same modules, created in the opposite order on the two ranks (and first cast in the
        # opposite order too): each one's amax must meet its namesake's.
        names = ["fc1", "fc2"]
        model = _model(names, rank, creation_order=names if rank == 0 else names[::-1])
        _step(model, names if rank == 0 else names[::-1], rank, recipe)
        out["local"] = {n: model[n]._core.amax_history[0].clone() for n in names}
        fp8dp.update_fp8_scales()
        out["scale"] = {n: model[n]._core.scale.clone() for n in names}
    elif name == "empty_rank":
        names = ["fc1"]
        model = _model(names, rank)
        # Step 0: rank 1's micro-batch has 0 tokens (no observation, no first scale).
        _step(model, names, rank, recipe, tokens=16 if rank == 0 else 0)
        fp8dp.update_fp8_scales()
        out["scale0"] = model["fc1"]._core.scale.clone()
        # Step 1: both ranks see data; rank 1's first non-empty cast keeps the reduced scale.
        _step(model, names, rank, recipe, scale=4.0)
        out["scale1_before_update"] = model["fc1"]._core.scale.clone()
        fp8dp.update_fp8_scales()
        hist = model["fc1"]._core.amax_history.clone()
        fp8dp.update_fp8_scales()  # twice in one step: a no-op on every rank
        out["twice_unchanged"] = torch.equal(hist, model["fc1"]._core.amax_history)
        # Step 2: only rank 0 runs a micro-batch (a 0-token one would still cast the weight, an
        # observation), so only rank 0 observed; both ranks must still update together.
        if rank == 0:
            _step(model, names, rank, recipe, scale=2.0)
        fp8dp.update_fp8_scales()
        out["hist2"] = model["fc1"]._core.amax_history.clone()
        out["scale2"] = model["fc1"]._core.scale.clone()
    elif name == "stateless_agree":
        # Both ranks train with current scaling, then block scaling; rank 0 alone also runs a
        # forward under no_grad with another recipe (an evaluation on one rank): no training
        # forward, so nothing to agree on. Every update passes, and the second sees block only.
        model = _model(["fc1", "fc2"], rank)
        out["errors"] = []
        for r in (fp8dp.Float8CurrentScaling(), fp8dp.Float8BlockScaling()):
            _step(model, ["fc1", "fc2"], rank, r)
            if rank == 0:
                with (
                    torch.no_grad(),
                    fp8dp.fp8_autocast(fp8_recipe=fp8dp.Float8CurrentScaling(margin=3)),
                ):
                    model["fc1"](torch.randn(16, N))
            out.setdefault("noted", []).append(list(fp8dp._C.fp8_registry_descriptions()))
            try:
                fp8dp.update_fp8_scales()
            except RuntimeError as e:
                out["errors"].append(str(e))
        out["after"] = list(fp8dp._C.fp8_registry_descriptions())
        # A step in which only rank 0 trains: rank 1 has no recipe to disagree with.
        if rank == 0:
            _step(model, ["fc1"], rank, fp8dp.Float8CurrentScaling())
        try:
            fp8dp.update_fp8_scales()
        except RuntimeError as e:
            out["errors"].append(str(e))
    else:
        raise AssertionError(name)
    return out


def _worker(rank, world, names):
    """On every rank (harness.run_ranks, whose process group times out after 60 s): the
    scenarios `names` in order (one launch for several: starting ranks costs seconds); returns
    {scenario: result}."""
    import gc

    import fp8dp

    results = {}
    for name in names:
        results[name] = _scenario(name, rank)
        gc.collect()  # the scenario's modules leave the registry before the next one
        # and so do the recipes a failed update kept (a refused update changes nothing)
        fp8dp._C.fp8_registry_forget_recipes()
    return results


def _run(names):
    """[rank 0's, rank 1's] results of the scenarios `names`, each {scenario: result}."""
    return run_ranks(_worker, WORLD, list(names))


LINEAR = "Linear(in_features=32, out_features=32)"
MISMATCH = {
    # first differing position, then what each rank has there
    "count_differs": (2, "rank 0: none (2 entries)", f"rank 1: 'fc3: {LINEAR} [E4M3/E5M2"),
    "modules_differ": (1, f"rank 0: 'fc2: {LINEAR} [E4M3/E5M2", f"rank 1: 'fc3: {LINEAR}"),
    "recipe_differs": (
        0,
        f"rank 0: 'fc1: {LINEAR} [E4M3/E5M2 history=4 max margin=0]'",
        f"rank 1: 'fc1: {LINEAR} [E4M3/E5M2 history=4 max margin=1]'",
    ),
    # Float8BlockScaling keeps no scaling state: rank 0 has none to reduce (seen 2026-12-03),
    # only the recipe its training forwards used
    "block_on_one_rank": (
        0,
        "rank 0: 'recipe without state: Float8BlockScaling E4M3/E4M3",
        f"rank 1: 'fc1: {LINEAR} [E4M3/E5M2",
    ),
    # No state on either rank: before the stateless recipes joined the check, nothing compared
    # them and the ranks reduced gradients of two numerics without a word (C12)
    "block_against_current": (
        0,
        "rank 0: 'recipe without state: Float8BlockScaling E4M3/E4M3",
        "rank 1: 'recipe without state: Float8CurrentScaling E4M3/E5M2 margin=0'",
    ),
    "current_margin_differs": (
        0,
        "rank 0: 'recipe without state: Float8CurrentScaling E4M3/E5M2 margin=0'",
        "rank 1: 'recipe without state: Float8CurrentScaling E4M3/E5M2 margin=1'",
    ),
}


@pytest.mark.parametrize("name", sorted(MISMATCH))
def test_mismatch_fails_on_every_rank_naming_the_first_difference(name):
    """Item 3 (different counts: was SIGABRT in gloo; same count, other modules: was a silently
    wrong scale) and item 10 (another recipe on one rank; also Float8BlockScaling on one rank and
    delayed scaling on the other): every rank raises, before any collective of variable size and
    with its FP8 state untouched."""
    pos, on0, on1 = MISMATCH[name]
    for r in _run(tuple(sorted(MISMATCH))):
        r = r[name]
        assert "error" in r, "update_fp8_scales must fail on every rank"
        msg = r["error"]
        assert "update_fp8_scales: the ranks' FP8 scaling states differ (C9)" in msg
        assert f"first difference at position {pos} of the amax reduction" in msg
        assert on0 in msg and on1 in msg, msg
        assert r["unchanged"], "a failed update leaves the histories as they were"


def test_registry_order_is_by_identity_not_by_creation():
    """C9: the ranks created (and first cast) fc1 and fc2 in opposite orders; each module's scale
    comes from the MAX of its own amaxes on both ranks."""
    res = [r["order_differs"] for r in _run(("order_differs", "empty_rank"))]
    for n in ("fc1", "fc2"):
        amax = torch.maximum(res[0]["local"][n], res[1]["local"][n])
        expected = torch.tensor([448.0, 448.0, 57344.0]) / amax
        for r in res:
            torch.testing.assert_close(r["scale"][n], expected, rtol=0, atol=0)
    # fc1 and fc2 really saw different amaxes (so a swap would show).
    assert not torch.equal(res[0]["local"]["fc1"], res[0]["local"]["fc2"])


def test_empty_microbatch_on_one_rank_and_update_twice():
    """Item 8 across ranks: rank 1's 0-token micro-batch in step 0 is no observation, so both
    ranks take rank 0's amax; in step 1 rank 1 keeps that scale instead of taking its own first
    scale (the ranks' scales stay equal). Item 10: a second update in the same step is a no-op. A
    step in which only rank 0 observes (rank 1 runs no micro-batch) still updates, and rolls, on
    both ranks."""
    res = [r["empty_rank"] for r in _run(("order_differs", "empty_rank"))]
    torch.testing.assert_close(res[0]["scale0"], res[1]["scale0"], rtol=0, atol=0)
    assert res[0]["scale0"][0] != 1.0, "rank 0's amax made the input scale"
    assert torch.equal(res[0]["scale1_before_update"], res[1]["scale1_before_update"]), (
        "the ranks' scales differ after step 1's forward: "
        f"{res[0]['scale1_before_update'].tolist()} vs {res[1]['scale1_before_update'].tolist()}"
    )
    for r in res:
        assert r["twice_unchanged"]
    torch.testing.assert_close(res[0]["hist2"], res[1]["hist2"], rtol=0, atol=0)
    torch.testing.assert_close(res[0]["scale2"], res[1]["scale2"], rtol=0, atol=0)
    assert res[0]["hist2"][1, 0] > 0, "step 2's amax (rank 0's) was rolled into row 1 on both"


def test_stateless_recipes_that_agree_pass_and_are_forgotten():
    """Current then block scaling on both ranks, and a no_grad forward with a third recipe on rank
    0 only: no update fails (an evaluation is no training forward); each step's update sees that
    step's recipe only, and leaves none behind. Then a step that only rank 0 trains (current
    scaling): no failure either, as for delayed scaling's empty rank."""
    res = [r["stateless_agree"] for r in _run(("stateless_agree",))]
    for rank, r in enumerate(res):
        assert r["errors"] == [], (rank, r["errors"])
        current, block = r["noted"]
        assert current == ["recipe without state: Float8CurrentScaling E4M3/E5M2 margin=0"]
        assert len(block) == 1 and block[0].startswith(
            "recipe without state: Float8BlockScaling E4M3/E4M3"
        ), block
        assert r["after"] == []
