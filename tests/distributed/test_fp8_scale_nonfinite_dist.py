"""A NaN or Inf amax on one rank is no observation across ranks either (C7 — FP8 numerics):
update_fp8_scales zeroes it before the cross-rank MAX (registry_amaxes), so the other rank's
finite amax of that step sets the scale on both ranks.

Two gloo processes, one fp8dp.Linear each (same weights), delayed scaling (HYBRID, history 4):
step 0, rank 1's grad_output holds one Inf or NaN and rank 0's is finite; then clean steps. Every
rank's grad_output scale after step 0 must be 57344 / (rank 0's finite amax), bit for bit (the
same FP32 division), and the ranks' scales equal after every step.

Mutation tried (2026-12-03, then restored): registry_amaxes without `.nan_to_num_(0, 0, 0)`:
both cases fail, "rank 1: grad_output scale after step 0 is 1.0, want 15393.948" (the MAX let
the NaN / Inf win, the update counted it as no observation, and rank 1, whose own first cast saw
only the poison, kept scale 1 while rank 0 kept its own first scale: the ranks disagree).
"""

import pytest
import torch
from harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2


def _worker(rank, world, poison):
    """On every rank (harness.run_ranks): 4 steps of one fp8dp.Linear, rank 1's first
    grad_output poisoned; returns each step's grad_output amax and scale."""
    import fp8dp

    torch.manual_seed(0)  # identical parameters on both ranks
    m = fp8dp.Linear(32, 48)
    recipe = fp8dp.DelayedScaling(fp8_format=fp8dp.Format.HYBRID, amax_history_len=4)
    out = {"scales": [], "amax": []}
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, dy = torch.randn(32, 32, generator=g), torch.randn(32, 48, generator=g)
        if step == 0 and rank == 1:
            dy[2, 7] = float(poison)
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            y = m(x)
        y.backward(dy)
        out["amax"].append(float(dy.abs().max()))
        fp8dp.update_fp8_scales()
        out["scales"].append(float(m._core.scale[2]))
    return out


@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_one_rank_nonfinite_amax_does_not_hide_the_others(poison):
    res = run_ranks(_worker, WORLD, poison)
    a0 = res[0]["amax"][0]  # rank 0's finite grad_output amax of step 0
    want = float(torch.tensor(57344.0) / torch.tensor(a0, dtype=torch.float32))
    for r in range(WORLD):
        got = res[r]["scales"][0]
        assert got == want, f"rank {r}: grad_output scale after step 0 is {got}, want {want}"
    assert res[0]["scales"] == res[1]["scales"], "the ranks' scales differ"
