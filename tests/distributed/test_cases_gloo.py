"""The distributed cases on CPU processes (gloo) at world sizes 2 and 3 (3: uneven padding): one
torchrun launch per world size, one test per case and a test of the launch itself (harness.py)."""

import pytest
from harness import case_params

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # starts ranks (pyproject markers)

LAUNCHES = [("gloo", 2), ("gloo", 3)]


@pytest.mark.parametrize("launch, name", case_params(LAUNCHES), indirect=["launch"])
def test_case(launch, name):
    launch.check(name)


@pytest.mark.parametrize("launch", LAUNCHES, indirect=True, ids=lambda k: f"{k[0]}-ws{k[1]}")
def test_launch(launch):
    launch.check_exit()
