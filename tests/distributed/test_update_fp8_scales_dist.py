"""fp8dp.update_fp8_scales across 2 processes (gloo): after the fixed-size registry check (C9, see
test_fp8_registry_dist.py), one all_reduce(MAX) of one flat tensor for every delayed-scaling
state, after which every rank holds the same scales, computed from the largest amax any rank
saw."""

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2


def _worker(rank, world):
    """On every rank (harness.run_ranks): one step of two FP8 modules and update_fp8_scales(),
    counting the all_reduce calls; returns the amaxes and scales before and after."""
    import fp8dp

    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(t, *args, **kwargs):
        calls.append(t.numel())
        return real_all_reduce(t, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    torch.manual_seed(0)  # identical parameters on both ranks
    mods = [fp8dp.Linear(32, 32), fp8dp.LayerNormLinear(32, 48)]
    recipe = fp8dp.DelayedScaling(amax_history_len=2)
    x = torch.randn(16, 32) * (rank + 1)  # rank 1 sees twice the input amax
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        h = mods[0](x)
        y = mods[1](h)
    y.backward(torch.randn(16, 48) * (3 - rank))  # rank 0 sees the larger grad amax
    local = torch.stack([m._core.amax_history[0].clone() for m in mods])
    fp8dp.update_fp8_scales()
    dist.all_reduce = real_all_reduce
    return {
        "calls": calls,
        "local": local,
        "scales": torch.stack([m._core.scale for m in mods]),
        "rolled": torch.stack([m._core.amax_history[1] for m in mods]),
    }


def test_update_fp8_scales_reduces_max_across_ranks():
    res = run_ranks(_worker, WORLD)
    for r in res:
        # C9: first the fixed-size registry check (hash, -hash, observed, r, -r), then one all_reduce of
        # one flat tensor: 2 modules x 3 roles.
        assert r["calls"] == [5, 2 * 3]
    expected_amax = torch.maximum(res[0]["local"], res[1]["local"])
    fp8_max = torch.tensor([448.0, 448.0, 57344.0])
    for r in res:
        torch.testing.assert_close(r["rolled"], expected_amax, rtol=0, atol=0)
        torch.testing.assert_close(r["scales"], fp8_max / expected_amax, rtol=0, atol=0)
    # The ranks really differed before the reduction, in both directions.
    assert (res[1]["local"][0, 0] > res[0]["local"][0, 0]) and (
        res[0]["local"][1, 2] > res[1]["local"][1, 2]
    )
