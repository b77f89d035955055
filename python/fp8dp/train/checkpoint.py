"""Checkpoints that resume bit-exactly at the same world size.

Every rank writes its own file: the model's state dict (parameters and each fp8dp module's FP8
scaling state: amax histories and scales, which after the per-step MAX reduction agree across ranks
but whose current-step amax row is rank-local), the distributed optimizer's state (this rank's
shard of FP32 master weights and AdamW moments), the RNG states and the step, which is the whole
data position (the sampler is stateless, see data.py). Rank 0 adds meta.json with the world size
and the config, checked on resume.
"""

from __future__ import annotations

import json
import os
import random

import torch

_RESUMABLE_CHANGES = {"train.steps", "train.eval_every", "train.save_every", "out.dir"}


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank:03d}.pt")


def save_checkpoint(path: str, *, step: int, model, optimizer, config: dict, rank: int,
                    world_size: int, barrier) -> None:
    os.makedirs(path, exist_ok=True)
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "python": random.getstate(),
        },
    }
    tmp = _rank_file(path, rank) + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, _rank_file(path, rank))  # a crash mid-write never leaves a torn file
    barrier()
    if rank == 0:
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump({"step": step, "world_size": world_size, "config": config}, f, indent=1)
    barrier()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load_checkpoint(path: str, *, model, optimizer, config: dict, rank: int,
                    world_size: int) -> int:
    """Restore everything save_checkpoint wrote; returns the step to continue from."""
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        raise ValueError(f"--resume: {path!r} holds no checkpoint (no meta.json)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta["world_size"] != world_size:
        raise ValueError(
            f"--resume: the checkpoint was written by {meta['world_size']} ranks and resumes "
            f"exactly only at the same world size, got {world_size}"
        )
    old, new = _flatten(meta["config"]), _flatten(config)
    for key in sorted(set(old) | set(new)):
        if key not in _RESUMABLE_CHANGES and old.get(key) != new.get(key):
            raise ValueError(
                f"{key}: the checkpoint in {path!r} was trained with {old.get(key)!r}, "
                f"the config says {new.get(key)!r}; only {sorted(_RESUMABLE_CHANGES)} may change"
            )
    state = torch.load(_rank_file(path, rank), map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    random.setstate(state["rng"]["python"])
    return state["step"]
