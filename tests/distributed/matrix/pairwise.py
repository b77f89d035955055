"""Greedy pairwise (all-pairs) covering arrays: every pair of values of any two axes appears in at
least one cell, with far fewer cells than the full product.

Deterministic: the same axes give the same cells, so a failing cell keeps its id between runs.
Construction: while some pair is uncovered, start a cell from the first uncovered pair, then give
every other axis (in axis order) the value that covers the most still-uncovered pairs with the
values already chosen (ties: the first value). Each cell covers at least one new pair, so this
terminates; for the test-matrix axes it stays close to the lower bound (the product of the two
largest axes).
"""

from __future__ import annotations

import itertools


def _pairs_of(cell: dict, names: list) -> set:
    return {((a, cell[a]), (b, cell[b])) for a, b in itertools.combinations(names, 2)}


def all_pairs(axes: dict) -> set:
    names = list(axes)
    return {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(names, 2)
        for va in axes[a]
        for vb in axes[b]
    }


def pairwise(axes: dict) -> list:
    """Cells (dicts axis -> value) covering every pair of values of every two axes."""
    names = list(axes)
    for name, values in axes.items():
        if not values:
            raise ValueError(f"axes.{name}: expected at least one value, got {values!r}")
    if len(names) < 2:
        return [dict(zip(names, combo)) for combo in itertools.product(*axes.values())]
    order = {n: i for i, n in enumerate(names)}
    uncovered = all_pairs(axes)
    cells = []
    while uncovered:
        (a, va), (b, vb) = min(
            uncovered,
            key=lambda p: (
                order[p[0][0]],
                order[p[1][0]],
                axes[p[0][0]].index(p[0][1]),
                axes[p[1][0]].index(p[1][1]),
            ),
        )
        cell = {a: va, b: vb}
        for n in names:
            if n in cell:
                continue

            def gain(v, n=n):
                return sum(
                    1
                    for m, vm in cell.items()
                    if (((m, vm), (n, v)) if order[m] < order[n] else ((n, v), (m, vm)))
                    in uncovered
                )

            cell[n] = max(axes[n], key=lambda v: (gain(v), -axes[n].index(v)))
        cell = {n: cell[n] for n in names}
        uncovered -= _pairs_of(cell, names)
        cells.append(cell)
    return cells


def full_product(axes: dict) -> list:
    names = list(axes)
    return [dict(zip(names, combo)) for combo in itertools.product(*axes.values())]
