"""Test tooling shipped with fp8dp: the distributed test matrix
(``python -m fp8dp.testing.matrix``)."""
