"""fp8dp.pipeline's layout arithmetic and its errors (C10 — pipelines): impossible layouts fail
before any stage or group is built, with a ValueError naming the argument, what was expected and
what was given."""

import os
import tempfile

import pytest
import torch.distributed as dist

from fp8dp.pipeline import check_backend, check_layout, split_blocks, stage_ranks


def test_split_blocks_is_contiguous_and_even():
    assert split_blocks(5, 2) == [range(3), range(3, 5)]
    assert split_blocks(4, 4) == [range(i, i + 1) for i in range(4)]


def test_stage_placement():
    # One stage per rank: stage s on rank s. Interleaved: stages r and r + pp. ZBV: the V.
    assert stage_ranks("1f1b", 4, 1) == [[0], [1], [2], [3]]
    assert stage_ranks("interleaved_1f1b", 2, 2) == [[0, 2], [1, 3]]
    assert stage_ranks("zero_bubble", 2, 2) == [[0, 2], [1, 3]]
    assert stage_ranks("zbv", 2, 2) == [[0, 3], [1, 2]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"schedule": "zbv", "n_blocks": 3, "virtual_stages": 2},
            r"blocks: expected at least one per stage \(4 stages.*got 3",
        ),
        (
            {"schedule": "zbv", "virtual_stages": 1},
            r"virtual_stages: schedule 'zbv' expected 2 .*got 1",
        ),
        (
            {"schedule": "1f1b", "virtual_stages": 2},
            r"virtual_stages: schedule '1f1b' expected 1 .*got 2",
        ),
        (
            {"n_microbatches": 1},
            r"n_microbatches: .*expected at least pipeline_parallel_size = 2, got 1",
        ),
        (
            {"schedule": "zero_bubble", "virtual_stages": 2, "n_microbatches": 5},
            r"n_microbatches: .*multiple of its 2 rounds.*got 5",
        ),
        ({"schedule": "gpipe"}, r"schedule: expected one of .*got 'gpipe'"),
    ],
    ids=["blocks", "zbv-one-stage", "1f1b-two-stages", "microbatches", "rounds", "schedule"],
)
def test_impossible_layouts(kwargs, match):
    args = {
        "schedule": "1f1b",
        "pp_size": 2,
        "virtual_stages": 1,
        "n_blocks": 4,
        "n_microbatches": 4,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        check_layout(**args)


def test_world_not_divisible():
    from fp8dp.pipeline import make_groups

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1
        )
        try:
            with pytest.raises(
                ValueError,
                match=r"pipeline_parallel_size: expected a divisor of the world size 1, got 2",
            ):
                make_groups(2)
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize(
    "schedule, backend, version, ok",
    [
        ("zbv", "gloo", "2.11.0+cu130", False),
        ("zbv", "gloo", "2.12.1", False),
        ("zbv", "gloo", "2.13.0", True),
        ("zbv", "gloo", "2.14.1+cu130", True),
        ("zbv", "nccl", "2.11.0+cu130", True),
        ("zero_bubble", "gloo", "2.11.0", True),
    ],
)
def test_zbv_on_gloo_needs_torch_2_13(schedule, backend, version, ok):
    """Before torch 2.13 the V's turn sends to itself at start-up, which gloo refuses (every rank
    then fails with "Connection reset by peer", seen with torch 2.11): refused up front instead."""
    if ok:
        check_backend(schedule, backend, version)
    else:
        with pytest.raises(ValueError, match=r"schedule: 'zbv' on gloo needs torch >= 2.13.*got"):
            check_backend(schedule, backend, version)
