"""fp8_autocast(fp8_group=...) chooses the amax-reduction group of update_fp8_scales() called without
one, across 4 processes (gloo) in two groups {0, 1} and {2, 3}: the amaxes are reduced within each
group only, the registry check (C9) runs over the same group, the next step without fp8_group
reduces across the world again, and a conflicting group is refused before any collective.

Evidence (both tried): with the fp8_group ignored (update_fp8_scales reducing across its argument
only, as before), step 1's histories hold the world's maximum and the first test fails
("Mismatched elements: 1 / 3"); with the recorded groups never forgotten after an update, step 2
reduces within the pairs and the workers' last update raises ValueError (the pair and the world
both still recorded), so every test fails."""

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 4
PAIRS = ([0, 1], [2, 3])


def _recipe(fp8dp):
    return fp8dp.DelayedScaling(amax_history_len=4)


def _step(fp8dp, lin, rank, group, **update_kwargs):
    """One forward and backward whose input amax grows with the rank and grad amax shrinks with it;
    returns this rank's amaxes before the update and the history row the update wrote."""
    x = torch.randn(16, 32) * (rank + 1)
    with fp8dp.fp8_autocast(fp8_recipe=_recipe(fp8dp), fp8_group=group):
        y = lin(x)
    y.backward(torch.randn(16, 32) * (WORLD - rank))
    local = lin._core.amax_history[0].clone()
    fp8dp.update_fp8_scales(**update_kwargs)
    return local, lin._core.amax_history[1].clone()


def _worker(rank, world):
    """On every rank (harness.run_ranks): two steps with and without fp8_group, then the
    conflicting groups; returns what each saw."""
    import fp8dp

    pairs = [dist.new_group(r) for r in PAIRS]  # every rank creates every group
    mine = pairs[rank // 2]
    calls = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(t, *args, group=None, **kwargs):
        calls.append(
            (
                t.numel(),
                dist.get_process_group_ranks(group if group is not None else dist.group.WORLD),
            )
        )
        return real_all_reduce(t, *args, group=group, **kwargs)

    dist.all_reduce = recording_all_reduce
    torch.manual_seed(0)  # identical parameters on every rank
    lin = fp8dp.Linear(32, 32)
    torch.manual_seed(1 + rank)
    res = {}
    res["local1"], res["row1"] = _step(fp8dp, lin, rank, mine)  # within the pair
    res["calls1"], calls[:] = list(calls), []
    res["local2"], res["row2"] = _step(fp8dp, lin, rank, None)  # no fp8_group: the world
    res["calls2"], calls[:] = list(calls), []

    # Conflicts: refused on every rank alike, before any collective, nothing updated.
    history = lin._core.amax_history.clone()
    errors = []
    for kwargs, groups in (
        ({"group": dist.group.WORLD}, [mine]),
        ({}, [mine, None, dist.group.WORLD]),
    ):
        for g in groups:
            with fp8dp.fp8_autocast(fp8_recipe=_recipe(fp8dp), fp8_group=g):
                lin(torch.randn(16, 32)).sum().backward()
        try:
            fp8dp.update_fp8_scales(**kwargs)
        except ValueError as e:
            errors.append(str(e))
    res["errors"], res["calls3"] = errors, list(calls)
    res["unchanged"] = torch.equal(history[1:], lin._core.amax_history[1:])
    dist.all_reduce = real_all_reduce
    fp8dp.update_fp8_scales()  # the pending amaxes, across the world: ranks stay in step
    return res


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, WORLD)


def test_fp8_group_reduces_amaxes_within_the_group_only(results):
    for ranks in PAIRS:
        expected = torch.maximum(results[ranks[0]]["local1"], results[ranks[1]]["local1"])
        for r in ranks:
            torch.testing.assert_close(results[r]["row1"], expected, rtol=0, atol=0)
            # The check (5 int64s) and the amaxes (3 roles), both over the pair.
            assert results[r]["calls1"] == [(5, ranks), (3, ranks)]
    # The pairs saw different maxima, so a reduction across the world would have shown.
    assert not torch.equal(results[0]["row1"], results[2]["row1"])


def test_without_fp8_group_the_next_step_reduces_across_the_world(results):
    expected = torch.stack([r["local2"] for r in results]).amax(dim=0)
    for r in results:
        torch.testing.assert_close(r["row2"], expected, rtol=0, atol=0)
        assert r["calls2"] == [(5, [0, 1, 2, 3]), (3, [0, 1, 2, 3])]


def test_conflicting_groups_are_refused_before_any_collective(results):
    for rank, r in enumerate(results):
        pair = PAIRS[rank // 2]
        explicit, mixed = r["errors"]
        assert "group (ranks [0, 1, 2, 3]) differs from the fp8_group" in explicit
        assert f"(ranks {pair})" in explicit
        assert f"named different fp8_group's (ranks {pair} and [0, 1, 2, 3])" in mixed
        assert r["calls3"] == [] and r["unchanged"]
