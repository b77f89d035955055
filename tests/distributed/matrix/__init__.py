"""The distributed test matrix (``python -m tests.distributed.matrix``, from the repository root):
cells of configs/test_matrix.yaml, each trained under fp8dp.DistributedDataParallel and checked
against a reference built without it (cell.py); runner.py builds the cells and launches them,
worker.py runs them on every rank, pairwise.py picks the covering subset."""
