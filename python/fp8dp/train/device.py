"""Where the demo's ranks run: the run.device / run.backend request (config.RunSection, CLI
--device / --backend) against what the machine has.

choose_device is a pure function of the request and of the machine's facts (CUDA usable, GPUs
visible, ranks on this node), so every case, a one-GPU machine asked for two ranks included, is
tested without that machine. setup_distributed (loop.py) gathers the facts and calls it before
init_process_group: every rank of a node sees the same facts, so all of them stop with the same
one-line error, and none waits in init_process_group for a rank that died (a rank beyond the GPU
count used to die in torch.cuda.set_device with "invalid device ordinal")."""

from __future__ import annotations

import os


def local_world_size(env=None) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE; without it (no launcher, or one that does
    not set it) at least LOCAL_RANK + 1, so the rank's own GPU index is always checked."""
    env = os.environ if env is None else env
    local_rank = int(env.get("LOCAL_RANK", "0"))
    return max(int(env.get("LOCAL_WORLD_SIZE", "1")), local_rank + 1)


def choose_device(
    device: str,
    backend: str,
    *,
    cuda_ok: bool,
    cuda_reason: str,
    n_gpus: int,
    local_world_size: int,
) -> tuple:
    """(device type, backend): ("cuda", "nccl") or ("cpu", "gloo"), or a ValueError naming the
    key, what was expected, what the machine has and what to run instead.

    device, backend: run.device ("auto" | "cpu" | "cuda") and run.backend ("auto" | "gloo" |
    "nccl"), already checked by config.RunSection (which refuses cpu + nccl and cuda + gloo).
    cuda_ok, cuda_reason: fp8dp.cuda_available(return_reason=True). n_gpus: the GPUs torch sees
    (torch.cuda.device_count()). local_world_size: ranks on this node.

    auto follows an explicit backend (gloo: cpu, nccl: cuda); with both auto it is cuda when
    cuda_ok, else cpu (the demo's behaviour before run.device existed). A cuda run needs one GPU
    per rank of the node: with fewer, auto does not fall back to the CPU either, since a GPU
    machine training on its CPU by surprise is slower by orders of magnitude; the error says how
    to get either."""
    key = f"run.device: {device}"
    if device == "auto":
        if backend != "auto":
            device = "cpu" if backend == "gloo" else "cuda"
            key = f"run.backend: {backend}"
        else:
            device = "cuda" if cuda_ok else "cpu"
            key = "run.device: auto (CUDA is available, so cuda)"
    if device == "cpu":
        return "cpu", "gloo"
    if not cuda_ok or n_gpus < 1:
        raise ValueError(
            f"{key}: expected a usable GPU, got none ({cuda_reason or 'torch sees 0 GPUs'}); run "
            f"with --device cpu (CPU ranks on gloo)"
        )
    if local_world_size > n_gpus:
        raise ValueError(
            f"{key}: expected at most one rank per visible GPU, got {local_world_size} ranks on "
            f"this node and {n_gpus} GPU(s); run torchrun --nproc_per_node={n_gpus}, or "
            f"--device cpu for {local_world_size} CPU ranks on gloo"
        )
    return "cuda", "nccl"
