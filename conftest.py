"""pytest hooks for every test folder (tests/python, tests/distributed).

FP8DP_TEST_TIMES=PATH writes a live log of the run to PATH, one tab-separated line per event as it
happens: the wall time, "start" or the phase that ended (setup / call / teardown) with its seconds
and outcome, and the test's node id. `--durations` reports only when the run ends; a run that a
time limit cuts off (the GPU machine's commands stop after 10 minutes, and `make test` there has
ended past 99% with no failure) then says nothing about which tests held it up. With the log, the
tests that started and never ended, and the longest phases, are there to read:

    FP8DP_TEST_TIMES=$OUT/test_times.tsv make test
    sort -t$'\\t' -k3 -g -r $OUT/test_times.tsv | head -20

Under pytest-xdist the controller writes every worker's events (each worker only reports them),
so the log has each event once.
"""

import os
import time

_PATH = os.environ.get("FP8DP_TEST_TIMES")
_IN_WORKER = "PYTEST_XDIST_WORKER" in os.environ


def _write(fields):
    with open(_PATH, "a") as f:
        f.write("\t".join(str(v) for v in (f"{time.time():.1f}", *fields)) + "\n")


def pytest_runtest_logstart(nodeid, location):
    if _PATH and not _IN_WORKER:
        _write(("start", "", "", nodeid))


def pytest_runtest_logreport(report):
    if _PATH and not _IN_WORKER:
        _write((report.when, f"{report.duration:.2f}", report.outcome, report.nodeid))
