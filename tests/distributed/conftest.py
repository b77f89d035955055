"""The `launch` fixture of the distributed cases: one torchrun launch per (run, world size) per
session, however many tests read it (harness.py)."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # harness, the case modules
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests.distributed.matrix
import harness  # noqa: E402


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """The tests of one file here share its launches of ranks (_LAUNCHES, harness.run_ranks' cache,
    module fixtures), so under pytest-xdist (`--dist loadgroup`, the Makefile's) they run in one
    worker, which launches once; the tests elsewhere spread over all workers one by one. A test
    that starts ranks of its own (torchrun into its own tmp_path) is marked own_launch (a whole
    file through its pytestmark) and spreads too: grouped, the stateful test's eight families
    and the convergence file's two own runs waited for each other in one worker and set the
    pace of `make test` on the 16-core GPU machine. A wrapper, marking before the yield: xdist
    reads the group marks in its own hook of this name (it appends "@group" to the node ids,
    which pytest 9.2 ignores: pyproject pins pytest below it)."""
    for item in items:
        if os.path.dirname(str(item.path)) != HERE or item.get_closest_marker("own_launch"):
            continue
        item.add_marker(pytest.mark.xdist_group(os.path.basename(str(item.path))))
    return (yield)


_LAUNCHES = {}  # (run, world size) -> harness.Launch, or the reason it cannot launch here


def _selected(session, key):
    """The case names that this session's selected tests read from the launch `key` (all of the
    run's cases when its launch test is selected): `pytest -k` narrows the launch too."""
    names, everything = set(), False
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("launch") != key:
            continue
        if "name" in params:
            names.add(params["name"])
        else:
            everything = True
    run_cases = harness.cases_of(key[0])
    return run_cases if everything else [n for n in run_cases if n in names]


@pytest.fixture
def launch(request, tmp_path_factory):
    """harness.Launch of request.param = (run, world size), launched at first use."""
    key = tuple(request.param)
    if key not in _LAUNCHES:
        run, ws = key
        reason = harness.skip_reason(run, ws)
        if reason is None:
            out = tmp_path_factory.mktemp(f"{run}-ws{ws}")
            _LAUNCHES[key] = harness.launch(run, ws, _selected(request.session, key), out)
        else:
            _LAUNCHES[key] = reason
    got = _LAUNCHES[key]
    if isinstance(got, str):
        pytest.skip(got)
    return got
