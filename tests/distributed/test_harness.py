"""The harness's bookkeeping (harness.Launch) without launching anything: torchrun is replaced by
a fake that writes what ranks would have written. Each case's test must fail with the failing
rank's own traceback; a case a rank died in must fail with the launch's log and the cases after
it must still run (in a relaunch); and the launch test must notice a launch that died.

The same, end to end (2026-12-01): broadcast_and_scale with an assertion injected on rank 1 at
root=0 and os._exit(3) on rank 0 at root=-1 (world size 3) failed exactly
gloo-ws2-broadcast_and_scale[root=0] (rank 1's AssertionError, rank 0's gloo timeout),
gloo-ws3-broadcast_and_scale[root=0] and [root=-1] ("rank 0: started this case and never
finished it" and the log); nan_check_names_parameters and bad_input, selected with them, passed.
Before run_cases stopped after a failure, root=-1 at world size 2 failed too, on the broken gloo
connection that root=0 left behind."""

import json

import harness
import pytest


def fake_torchrun(script):
    """A torchrun that plays `script`: one (exit code, {rank: [records]}) per launch."""
    calls = []

    def run(target, nproc, args, timeout):
        args = [str(a) for a in args]
        out = args[args.index("--out") + 1]
        names = json.loads(open(args[args.index("--cases") + 1]).read())
        rc, per_rank = script[len(calls)]
        calls.append(names)
        for rank, recs in per_rank.items():
            with open(f"{out}/rank{rank}.jsonl", "w") as f:
                for case, status in recs:
                    rec = {"case": case, "rank": rank, "status": status}
                    if status == "fail":
                        rec.update(
                            error=f"AssertionError: bad on rank {rank}",
                            traceback=f"Traceback ...\nAssertionError: bad on rank {rank}",
                        )
                    f.write(json.dumps(rec) + "\n")
        return rc, f"log of launch {len(calls)}"

    return run, calls


def test_failures_deaths_and_relaunches(tmp_path, monkeypatch):
    names = ["a", "b", "c", "d"]
    script = [
        # b fails on rank 1: both ranks stop there
        (1, {0: [("a", "pass"), ("b", "pass")], 1: [("a", "pass"), ("b", "fail")]}),
        # rank 0 dies in c
        (1, {0: [("c", "started")], 1: [("c", "pass")]}),
        (0, {0: [("d", "pass")], 1: [("d", "pass")]}),
    ]
    run, calls = fake_torchrun(script)
    monkeypatch.setattr(harness, "torchrun", run)
    launch = harness.launch("gloo", 2, names, tmp_path)
    assert calls == [names, ["c", "d"], ["d"]]
    launch.check("a")
    launch.check("d")
    with pytest.raises(pytest.fail.Exception) as e:
        launch.check("b")
    assert "rank 1: AssertionError: bad on rank 1\nTraceback" in str(e.value)
    assert "rank 0" not in str(e.value)
    with pytest.raises(pytest.fail.Exception) as e:
        launch.check("c")
    assert "rank 0: started this case and never finished it" in str(e.value)
    assert "log of launch 2" in str(e.value)
    with pytest.raises(pytest.fail.Exception) as e:  # launch 2 died: exit 1 with no failed case
        launch.check_exit()
    assert "launch 2 of 3 exited with 1\n--- end of the log of launch 2" in str(e.value)
    assert "launch 1 " not in str(e.value)  # exit 1 after b failed: as it should
    assert "1 case(s) without a result from every rank: c" in str(e.value)


def test_a_launch_that_runs_nothing_is_not_retried(tmp_path, monkeypatch):
    run, calls = fake_torchrun([(1, {})])
    monkeypatch.setattr(harness, "torchrun", run)
    launch = harness.launch("gloo", 2, ["a", "b"], tmp_path)
    assert len(calls) == 1
    with pytest.raises(pytest.fail.Exception, match="no result: its launch ended before"):
        launch.check("b")
    with pytest.raises(pytest.fail.Exception) as e:
        launch.check_exit()
    assert "launch 1 of 1 exited with 1" in str(e.value)
    assert "2 case(s) without a result from every rank: a, b" in str(e.value)


def _rank_fn(rank, world, fail_on):
    """run_ranks' target below: returns (rank, world), or raises on rank `fail_on`."""
    if rank == fail_on:
        raise ValueError(f"rank {rank} was told to fail")
    return [rank, world]


@pytest.mark.distributed
@pytest.mark.slow
def test_run_ranks_returns_in_rank_order_and_fails_with_the_failing_ranks_traceback():
    """harness.run_ranks (the launcher of the tests that moved off mp.spawn): one launch of 2
    gloo ranks returns each rank's value in rank order; a rank that raises fails the calling test
    with that rank's error and traceback.

    Mutation tried (2026-12-03, then restored): _launch_ranks not treating a record with "error"
    as a problem: the test fails, the message holding only "exit code 1" and the log's
    "[rank 1/2] FAIL", not rank 1's error or traceback."""
    assert harness.run_ranks(_rank_fn, 2, -1) == [[0, 2], [1, 2]]
    with pytest.raises(pytest.fail.Exception) as e:
        harness.run_ranks(_rank_fn, 2, 1)
    msg = str(e.value)
    assert "rank 1: ValueError: rank 1 was told to fail" in msg and "Traceback" in msg, msg
    assert "rank 0:" not in msg, msg


def test_the_tests_of_a_file_here_share_one_worker(request):
    """Under `make test` (pytest-xdist --dist loadgroup) the tests of a file in tests/distributed
    run in one worker, so its launches of ranks are shared (conftest.py marks them). pytest 9.2
    dropped the node id suffix that carries the group and every test went its own way, silently
    (the convergence runs trained twice): pyproject pins pytest below 9.2, and this guards it."""
    if not getattr(request.config.option, "loadgroup", False):  # set by xdist in a worker
        pytest.skip("not under pytest-xdist --dist loadgroup (make test)")
    assert request.node.nodeid.endswith("@test_harness.py"), request.node.nodeid
