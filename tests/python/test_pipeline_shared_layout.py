"""How fp8dp.pipeline finds parameters shared between stages (C15, pipeline_shared.py), one
process: by object identity across stages and by declared names; its errors name the argument,
what was expected and what came; which local stages run on a deep copy. (That ranks which found
different ties fail together: tests/distributed/test_pipeline_shared.py.)"""

import pytest
import torch

from fp8dp.pipeline import split_blocks, stage_ranks
from fp8dp.pipeline_shared import find_shared, untie_local_stages


class Emb(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))


class Head(torch.nn.Module):
    def __init__(self, w=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        if w is not None:
            self.lin.weight = w


def _tied():
    e = Emb()
    return [e, torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), Head(e.w)]


def test_identity_across_stages_is_found_within_a_stage_not():
    blocks = _tied()
    shared = find_shared(blocks, split_blocks(4, 2))
    assert [t.copies for t in shared] == [[(0, "blocks.0.w"), (1, "blocks.3.lin.weight")]]
    assert shared[0].shape == (4, 4) and shared[0].requires_grad
    # One stage holding both uses: DDP sums them (C8), nothing to share.
    assert find_shared(blocks, split_blocks(4, 1)) == []


def test_declared_names_tie_distinct_objects():
    blocks = [Emb(), torch.nn.Linear(4, 4), Head()]
    shared = find_shared(blocks, split_blocks(3, 3), [["blocks.0.w", "blocks.2.lin.weight"]])
    assert [t.copies for t in shared] == [[(0, "blocks.0.w"), (2, "blocks.2.lin.weight")]]


@pytest.mark.parametrize(
    "declared, match",
    [
        ("blocks.0.w", r"shared_parameters: expected a list of groups of parameter names"),
        ([["blocks.0.w"]], r"shared_parameters\[0\]: expected a list of two or more"),
        (
            [["blocks.0.w", "blocks.2.weight"]],
            r"shared_parameters\[0\]: no parameter named 'blocks.2.weight'.*similar: "
            r"\['blocks.2.lin.bias', 'blocks.2.lin.weight'\]",
        ),
        (
            [["blocks.0.w", "blocks.2.lin.bias"]],
            r"'blocks.2.lin.bias' \(\[4\], torch.float32\) cannot share with 'blocks.0.w' "
            r"\(\[4, 4\], torch.float32\): copies need the same shape and dtype",
        ),
    ],
)
def test_declaration_errors(declared, match):
    blocks = [Emb(), torch.nn.Linear(4, 4), Head()]
    with pytest.raises(ValueError, match=match):
        find_shared(blocks, split_blocks(3, 3), declared)


def test_frozen_and_trained_copies_are_refused():
    blocks = [Emb(), torch.nn.Linear(4, 4), Head()]
    blocks[2].lin.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"requires_grad=False but 'blocks.0.w' has True"):
        find_shared(blocks, split_blocks(3, 3), [["blocks.0.w", "blocks.2.lin.weight"]])


def test_a_local_stage_reaching_an_earlier_ones_object_runs_on_a_copy():
    # zbv on 2 pipeline ranks: rank 0 holds stages 0 and 3 (the tie), rank 1 stages 1 and 2.
    blocks = _tied()
    ranges = split_blocks(4, 4)
    owners = stage_ranks("zbv", 2, 2)
    r0 = untie_local_stages(blocks, ranges, owners[0])
    assert r0[0][0] is blocks[0]  # the first holder keeps the object
    head = r0[3][3]
    assert head is not blocks[3] and head.lin.weight is not blocks[0].w
    assert torch.equal(head.lin.weight, blocks[0].w)
    r1 = untie_local_stages(blocks, ranges, owners[1])
    assert r1[1][1] is blocks[1] and r1[2][2] is blocks[2]  # nothing shared: as passed
