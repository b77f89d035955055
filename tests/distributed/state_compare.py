"""Bit-for-bit comparison of saved training state (the demo tests' checkpoint checks)."""

import torch


def assert_identical(a, b, where):
    """a and b (nested dicts, lists, tuples, tensors and plain values) are equal, tensors in dtype
    and every bit; `where` names the first difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where
