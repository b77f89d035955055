"""The pairwise generator behind the test matrix's CI subset: every pair of axis values covered,
deterministic, and far smaller than the full product."""

import itertools
import math
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the matrix lives in tests/distributed/matrix, not in fp8dp
from tests.distributed.matrix.pairwise import all_pairs, full_product, pairwise  # noqa: E402
from tests.distributed.matrix.runner import SPREAD, load_matrix, make_cells  # noqa: E402

MATRIX = ROOT / "configs" / "test_matrix.yaml"


def _covered(cells, axes):
    names = list(axes)
    return {((a, c[a]), (b, c[b])) for c in cells for a, b in itertools.combinations(names, 2)}


def _random_axes(seed):
    rng = random.Random(seed)
    return {f"a{i}": list(range(rng.randint(1, 4))) for i in range(rng.randint(2, 7))}


@pytest.mark.parametrize("seed", range(8))
def test_every_pair_is_covered(seed):
    axes = _random_axes(seed)
    cells = pairwise(axes)
    assert all_pairs(axes) <= _covered(cells, axes)
    # every cell takes one allowed value per axis
    assert all(set(c) == set(axes) and all(c[k] in axes[k] for k in axes) for c in cells)
    # never more than the product, never fewer than the two largest axes multiplied
    sizes = sorted((len(v) for v in axes.values()), reverse=True)
    assert sizes[0] * sizes[1] <= len(cells) <= math.prod(sizes)


def test_matrix_subset_is_small_and_deterministic():
    axes, _ = load_matrix(str(MATRIX))
    a = make_cells(axes, "gloo", full=False)
    b = make_cells(axes, "gloo", full=False)
    assert a == b  # ids stay stable between runs
    rest = {k: v for k, v in axes.items() if k != "backend" and k not in SPREAD}
    assert all_pairs(rest) <= _covered(a, rest)
    # A dealt-out axis (the gradient wire) is no pair axis: each value reaches a cell where it
    # means something (an FP32 buffer over more than one rank), every other cell keeps "fp32".
    for name in SPREAD:
        meaningful = [c for c in a if c["grad_dtype"] == "fp32" and c["world_size"] > 1]
        assert {c[name] for c in meaningful} == set(axes[name])
        assert all(c[name] == "fp32" for c in a if c not in meaningful)
    # world size (4) x recipe (3) = 12 is the lower bound; the greedy stays within 2 of it
    assert 12 <= len(a) <= 14
    assert len(make_cells(axes, "gloo", full=True)) == len(full_product(rest)) == 3072


@pytest.mark.parametrize(
    "text, message",
    [
        ("axes: {bogus: [1]}", "axes.bogus: unknown axis"),
        ("axes: {world_size: [3]}", "axes.world_size: expected values from [1, 2, 4, 8], got 3"),
        ("axes: {bias: [1]}", "axes.bias: expected values from [False, True], got 1"),
        ("axes: {world_size: []}", "axes.world_size: expected a non-empty list"),
        ("extra: 1", "extra: unknown section"),
    ],
)
def test_matrix_config_errors(tmp_path, text, message):
    base = MATRIX.read_text()
    p = tmp_path / "m.yaml"
    if text.startswith("axes:"):
        import yaml

        raw = yaml.safe_load(base)
        raw["axes"].update(yaml.safe_load(text)["axes"])
        p.write_text(yaml.safe_dump(raw))
    else:
        p.write_text(base + "\n" + text + "\n")
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_matrix(str(p))


def test_matrix_problem_errors(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text(MATRIX.read_text().replace("hidden: 32", "hidden: 24"))
    with pytest.raises(ValueError, match="problem.hidden: FP8 GEMMs need hidden"):
        load_matrix(str(p))
