"""Where the demo's ranks run: run.device / run.backend (CLI --device / --backend)
against what the machine has, decided before torch.distributed starts.

The failure this fixes, on a one-GPU H200 machine: `make test` starts the demo with 2 or 4
ranks, the demo picked NCCL and cuda:LOCAL_RANK whenever CUDA was available, and the ranks beyond
the GPU count died in torch.cuda.set_device with "CUDA error: invalid device ordinal" (while rank
0 waited for them in init_process_group). That machine is simulated here: the decision
(fp8dp.train.device.choose_device) is a pure function of (request, CUDA usable, GPUs visible,
ranks on this node), tested case by case with exact expected results; and main() runs in this
process with fp8dp.cuda_available and torch.cuda.device_count patched to "1 GPU" and
LOCAL_WORLD_SIZE=2.

Evidence that the tests catch their defect (each mutation alone, then reverted):
- choose_device without the `local_world_size > n_gpus` check: test_choose_device's three
  "1 GPU, 2 ranks" cases fail (DID NOT RAISE: ("cuda", "nccl") returned), and
  test_one_gpu_two_ranks_stops_before_joining fails: main() goes on to torch.cuda.set_device(0)
  (patched here to raise "set_device(0) called") instead of returning 2.
- choose_device with auto ignoring an explicit backend (`if backend != "auto":` made `if
  False:`): 3 cases of test_choose_device fail: "auto + gloo, 1 GPU, 4 ranks" raises "run.device:
  auto (CUDA is available, so cuda): expected at most one rank per visible GPU ..." instead of
  returning ("cpu", "gloo"); "auto + nccl, 1 GPU, 2 ranks" names run.device instead of
  run.backend; "auto + nccl without CUDA" DID NOT RAISE (("cpu", "gloo") returned).
- __main__.main without the --device / --backend flags appended to the overrides: 3 tests fail:
  test_device_flag_overrides_set returns 2 with "run.device: cuda: expected at most one rank per
  visible GPU ..." (the --set value stood), and test_one_gpu_two_ranks_stops_before_joining with
  --device cuda / --backend nccl names "run.device: auto (CUDA is available, so cuda)".
- RunSection without its two pair checks (`if False:`): test_run_section_refuses_pairs fails
  (DID NOT RAISE ValueError).
- checkpoint._read_and_check without the run section's defaults for old checkpoints:
  test_checkpoint_from_before_the_run_section_resumes: the resume returns 2 with "run.backend:
  expected None (the checkpoint in '...' was trained with it; only [...] may change), got 'auto'".
"""

import io
import json
import socket
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fp8dp
from fp8dp.train.config import RunSection, load_config
from fp8dp.train.device import choose_device, local_world_size

REPO = Path(__file__).resolve().parents[2]
ERROR = "fp8dp.train: error: "
NO_CUDA = "fp8dp was built without CUDA"
TOO_MANY = (
    "expected at most one rank per visible GPU, got 2 ranks on this node and 1 GPU(s); run "
    "torchrun --nproc_per_node=1, or --device cpu for 2 CPU ranks on gloo"
)


def _choose(device, backend, gpus, ranks):
    """choose_device on a machine with `gpus` GPUs (0: no usable CUDA) and `ranks` local ranks."""
    return choose_device(
        device,
        backend,
        cuda_ok=gpus > 0,
        cuda_reason="" if gpus else NO_CUDA,
        n_gpus=gpus,
        local_world_size=ranks,
    )


@pytest.mark.parametrize(
    "device, backend, gpus, ranks, expected",
    [
        # auto keeps the demo's old choice wherever the ranks fit
        ("auto", "auto", 0, 2, ("cpu", "gloo")),
        ("auto", "auto", 1, 1, ("cuda", "nccl")),
        ("auto", "auto", 2, 2, ("cuda", "nccl")),
        ("auto", "auto", 8, 4, ("cuda", "nccl")),
        # an explicit backend picks auto's device
        ("auto", "gloo", 1, 4, ("cpu", "gloo")),
        ("auto", "nccl", 2, 2, ("cuda", "nccl")),
        # cpu whatever the machine has
        ("cpu", "auto", 1, 4, ("cpu", "gloo")),
        ("cpu", "gloo", 0, 3, ("cpu", "gloo")),
        ("cuda", "auto", 1, 1, ("cuda", "nccl")),
        ("cuda", "nccl", 4, 4, ("cuda", "nccl")),
        # the one-GPU machine asked for two ranks: every spelling stops, saying what to run
        ("auto", "auto", 1, 2, "run.device: auto (CUDA is available, so cuda): " + TOO_MANY),
        ("cuda", "auto", 1, 2, "run.device: cuda: " + TOO_MANY),
        ("auto", "nccl", 1, 2, "run.backend: nccl: " + TOO_MANY),
        # asked for a GPU where there is none
        (
            "cuda",
            "auto",
            0,
            1,
            f"run.device: cuda: expected a usable GPU, got none ({NO_CUDA}); run with "
            f"--device cpu (CPU ranks on gloo)",
        ),
        (
            "auto",
            "nccl",
            0,
            1,
            f"run.backend: nccl: expected a usable GPU, got none ({NO_CUDA}); run with "
            f"--device cpu (CPU ranks on gloo)",
        ),
    ],
)
def test_choose_device(device, backend, gpus, ranks, expected):
    if isinstance(expected, tuple):
        assert _choose(device, backend, gpus, ranks) == expected
    else:
        with pytest.raises(ValueError) as e:
            _choose(device, backend, gpus, ranks)
        assert str(e.value) == expected


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, 1),  # plain `python -m fp8dp.train`
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 2),  # torchrun
        ({"LOCAL_RANK": "3"}, 4),  # a launcher without LOCAL_WORLD_SIZE: at least this rank's GPU
    ],
)
def test_local_world_size(env, expected):
    assert local_world_size(env) == expected


def test_run_section_refuses_pairs():
    with pytest.raises(
        ValueError, match=r"^run.backend: expected gloo or auto with run.device cpu"
    ):
        RunSection(device="cpu", backend="nccl")
    with pytest.raises(
        ValueError, match=r"^run.backend: expected nccl or auto with run.device cuda"
    ):
        RunSection(device="cuda", backend="gloo")
    with pytest.raises(ValueError, match=r"^run.device: expected one of \['auto', 'cpu', 'cuda'\]"):
        load_config(str(REPO / "configs" / "demo.yaml"), ["run.device=gpu"])
    assert load_config(str(REPO / "configs" / "demo.yaml")).run == RunSection("auto", "auto")


# ---- main() on a simulated one-GPU machine --------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_config(tmp: Path) -> Path:
    path = tmp / "tiny.yaml"
    path.write_text(
        "model: {n_layer: 1, d_model: 16, n_head: 1, seq_len: 16}\n"
        "train: {steps: 2, global_batch_size: 2, micro_batch_size: 1, warmup_steps: 1,\n"
        "        eval_every: 1, eval_batches: 1}\n"
        f"data: {{path: {REPO / 'data' / 'shakespeare.txt'}}}\n"
        f"out: {{dir: {tmp / 'run'}}}\n"
    )
    return path


@pytest.fixture
def one_gpu_two_ranks(monkeypatch):
    """Rank 0 of `torchrun --nproc_per_node=2` on a machine whose fp8dp has CUDA and 1 GPU;
    torch.cuda.set_device raises, so a run that reaches it fails loudly here."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="2")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(fp8dp, "cuda_available", lambda return_reason=False: (True, ""))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def set_device(i):
        raise AssertionError(f"set_device({i}) called")

    monkeypatch.setattr(torch.cuda, "set_device", set_device)


def _main(*argv):
    from fp8dp.train.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main([str(a) for a in argv] + ["--no-progress"])
    return rc, out.getvalue(), err.getvalue()


def _one_error(rc, err) -> str:
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.startswith(ERROR)]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0][len(ERROR) :]


@pytest.mark.parametrize(
    "flags, key",
    [
        ([], "run.device: auto (CUDA is available, so cuda)"),
        (["--device", "cuda"], "run.device: cuda"),
        (["--backend", "nccl"], "run.backend: nccl"),
    ],
)
def test_one_gpu_two_ranks_stops_before_joining(one_gpu_two_ranks, tmp_path, flags, key):
    rc, out, err = _main("--config", _tiny_config(tmp_path), *flags)
    assert _one_error(rc, err) == f"{key}: {TOO_MANY}"
    assert not dist.is_initialized()  # stopped before init_process_group: nobody waits on it
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_prints_and_the_others_wait_for_it(
    one_gpu_two_ranks, tmp_path, monkeypatch, rank
):
    """Every rank of the node meets the same error; rank 0 prints it and exits at once, the others
    wait (torchrun then ends them). Without the wait, rank 1 exited first on the one-GPU H200, and
    torchrun stopped rank 0 before it printed: the job failed with no error line."""
    import fp8dp.train.__main__ as train_main

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    waits = []
    monkeypatch.setattr(train_main.time, "sleep", waits.append)
    rc, out, err = _main("--config", _tiny_config(tmp_path), "--device", "cuda")
    assert rc == 2
    if rank == 0:
        assert _one_error(rc, err) == f"run.device: cuda: {TOO_MANY}"
        assert waits == []
    else:
        assert err == ""
        assert waits == [train_main._FAIL_WAIT_S] and train_main._FAIL_WAIT_S >= 10


def test_device_flag_overrides_set(one_gpu_two_ranks, tmp_path, fp8_states_released):
    """The command the error suggests, on the same machine: 2 CPU ranks on gloo (here rank 0 of
    them, in a world of one), even where the config asks for cuda."""
    cfg = _tiny_config(tmp_path)
    rc, out, err = _main("--config", cfg, "--set", "run.device=cuda", "--device", "cpu")
    assert rc == 0, err
    assert "[fp8dp.train] fp8: 1 rank(s), gloo" in out, out
    summary = json.loads((tmp_path / "run" / "fp8" / "summary.json").read_text())
    assert summary["steps"] == 2


def test_checkpoint_from_before_the_run_section_resumes(tmp_path, monkeypatch, fp8_states_released):
    """A checkpoint whose meta.json has no run section (written before it existed, with the
    device that auto picks) resumes under run.device / run.backend auto."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(k, v)
    cfg = _tiny_config(tmp_path)
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    rc, out, err = _main("--config", cfg, "--save", tmp_path / "ckpt")
    assert rc == 0, err
    meta_path = tmp_path / "ckpt" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["config"].pop("run") == {"device": "auto", "backend": "auto"}
    meta_path.write_text(json.dumps(meta))
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    rc, out, err = _main("--config", cfg, "--set", "train.steps=3", "--resume", tmp_path / "ckpt")
    assert rc == 0, err
    # and a checkpoint trained on one device resumes only on the same request
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    rc, out, err = _main(
        "--config", cfg, "--set", "train.steps=3", "--device", "cpu", "--resume", tmp_path / "ckpt"
    )
    assert _one_error(rc, err).startswith("run.device: expected 'auto' (the checkpoint in ")


def test_one_rank_without_torchrun_needs_no_port(tmp_path):
    """`python -m fp8dp.train` without torchrun rendezvouses in its own memory: it runs while
    another process holds the port the launcher used to default to (29517), as a concurrent
    one-rank job did in CI (EADDRINUSE), and it never reads MASTER_PORT."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO / "python"), MASTER_PORT="not a port", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "fp8dp.train", "--config", str(_tiny_config(tmp_path))]
    cmd += ["--device", "cpu", "--no-progress"]
    with socket.socket() as held:
        try:
            held.bind(("127.0.0.1", 29517))
            held.listen()
        except OSError:
            pass  # someone else holds it: the same situation
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[fp8dp.train] fp8: 1 rank(s), gloo" in p.stdout, p.stdout
