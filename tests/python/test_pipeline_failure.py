"""A pipeline whose peer is gone ends with an error on the surviving rank, not a hang
(C10 — pipelines): PP 2 × DP 1 on gloo, groups made with make_groups(timeout=5 s); rank 1 either
dies (os._exit) or stays alive but never runs its step (it skips every send and receive). Rank 0's
step must raise within the timeout plus slack. Evidence: with make_groups(2) (torch's default
timeout, 30 minutes on gloo) the "skips" case fails here, rank 0 still waiting after 45 s; the
"dies" case passes either way (gloo sees the closed connection at once)."""

import datetime
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

TIMEOUT_S = 5

# Starts 2 ranks itself (one of them dies on purpose, which harness.run_ranks reports as a failure).
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _worker(rank, mode, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    import fp8dp
    from fp8dp.pipeline import Pipeline, make_groups

    groups = make_groups(2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    blocks = [fp8dp.Linear(16, 16, delay_wgrad_compute=True) for _ in range(2)]
    ex = torch.empty(16, 16)
    pp = Pipeline(
        blocks,
        groups,
        schedule="zero_bubble",
        n_microbatches=2,
        loss_fn=F.mse_loss,
        microbatch_input=ex,
        activation=ex,
        microbatch_output=ex,
        ddp_config=fp8dp.DistributedDataParallelConfig(delay_wgrad_compute=True),
    )
    dist.barrier()  # both built their stages
    if rank == 1:
        if mode == "dies":
            os._exit(3)
        time.sleep(120)  # alive, but skips its step (the test kills it once rank 0 is done)
        os._exit(0)
    t0 = time.monotonic()
    try:
        pp.step(torch.randn(32, 16))
        outcome = "no error"
    except Exception as e:  # noqa: BLE001  (any error type will do; a hang will not)
        outcome = f"{type(e).__name__}: {str(e)[:200]}"
    torch.save(
        {"outcome": outcome, "elapsed": time.monotonic() - t0}, os.path.join(out_dir, "rank0.pt")
    )
    os._exit(0)  # the world group cannot be torn down cleanly without its peer


@pytest.mark.parametrize("mode", ["dies", "skips"])
def test_lost_peer_fails_the_step_within_the_timeout(mode):
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_worker, args=(r, mode, os.path.join(tmp, "init"), tmp))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        procs[0].join(timeout=45)
        hung = procs[0].is_alive()
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        assert not hung, "rank 0 still running after 45 s: its step hung"
        path = os.path.join(tmp, "rank0.pt")
        assert os.path.exists(path), "rank 0 died instead of raising"
        res = torch.load(path)
    assert res["outcome"] != "no error", "rank 0's step succeeded without its peer"
    assert res["elapsed"] < TIMEOUT_S + 20, f"rank 0 raised only after {res['elapsed']:.1f} s"
