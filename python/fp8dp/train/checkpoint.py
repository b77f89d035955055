"""Checkpoints that resume bit-exactly at the same world size.

Every rank writes its own file: the model's state dict (parameters and each fp8dp module's FP8
scaling state: amax histories and scales, which after the per-step MAX reduction agree across ranks
but whose current-step amax row is rank-local), the distributed optimizer's state (this rank's
shard of FP32 master weights and AdamW moments), the RNG states and the step, which is the whole
data position (the sampler is stateless, see data.py). Rank 0 adds meta.json with the world size
and the config, checked on resume.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

import torch
import torch.distributed as dist

from .config import ParallelSection, RunSection

_RESUMABLE_CHANGES = {
    "train.steps",
    "train.eval_every",
    "train.save_every",
    "train.fp8_stats_every",
    "out.dir",
}
_STATE_KEYS = {"step", "model", "optimizer", "rng"}


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank:03d}.pt")


def save_checkpoint(
    path: str, *, step: int, model, optimizer, config: dict, rank: int, world_size: int, barrier
) -> None:
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


def load_checkpoint(
    path: str, *, model, optimizer, config: dict, rank: int, world_size: int
) -> int:
    """Restore everything save_checkpoint wrote; returns the step to continue from.

    Every file is checked before the distributed optimizer's load (which all-gathers the
    parameters): meta.json, the config it holds and this rank's file. A problem is a ValueError
    naming the file and key, raised on every rank together (rank files are rank-local, and only
    rank 0 prints; a rank whose file is fine would otherwise wait in the all-gather for one that
    has left)."""
    error, state = None, None
    try:
        state = _read_and_check(
            path, model=model, optimizer=optimizer, config=config, rank=rank, world_size=world_size
        )
    except ValueError as e:
        error = str(e)
    _raise_on_every_rank(error, world_size)
    optimizer.load_state_dict(state["optimizer"])  # checked above: changes nothing on failure
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    random.setstate(state["rng"]["python"])
    return state["step"]


def _raise_on_every_rank(error, world_size: int) -> None:
    """Raise the lowest failing rank's error on every rank, or return when no rank failed."""
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        errors = [None] * world_size
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise ValueError(error)


def _one_line(e: Exception, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_meta(path: str) -> dict:
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        got = "a directory without meta.json" if os.path.isdir(path) else "no such directory"
        raise ValueError(
            f"--resume {path}: expected a checkpoint directory (with meta.json), " f"got {got}"
        )
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{meta_path}: expected JSON written by fp8dp.train, got a parse error "
            f"at line {e.lineno}, column {e.colno}: {e.msg}"
        ) from e
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_path}: expected a readable JSON file, got {_one_line(e)}") from e
    if not isinstance(meta, dict):
        raise ValueError(
            f"{meta_path}: expected a JSON object with keys config, step and "
            f"world_size, got {type(meta).__name__}"
        )
    for key, ok, what in (
        ("step", lambda v: _is_count(v, 0), "an integer >= 0"),
        ("world_size", lambda v: _is_count(v, 1), "an integer >= 1"),
        ("config", lambda v: isinstance(v, dict), "an object (the run's config)"),
    ):
        if key not in meta:
            raise ValueError(
                f"{meta_path}: expected key {key!r} ({what}), got keys " f"{sorted(meta)}"
            )
        if not ok(meta[key]):
            raise ValueError(f"{meta_path}: {key}: expected {what}, got {meta[key]!r}")
    return meta


def _is_count(v, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _read_and_check(
    path: str, *, model, optimizer, config: dict, rank: int, world_size: int
) -> dict:
    meta = _read_meta(path)
    if meta["world_size"] != world_size:
        raise ValueError(
            f"--resume: the checkpoint was written by {meta['world_size']} ranks and resumes "
            f"exactly only at the same world size, got {world_size}"
        )
    # A checkpoint written before the parallel (run) section existed was trained data-parallel
    # (on the device that run.device auto picks): the section's defaults.
    old = {
        **_flatten({"parallel": dataclasses.asdict(ParallelSection())}),
        **_flatten({"run": dataclasses.asdict(RunSection())}),
        # Before these keys existed: the head ran in FP8 with the blocks, in the recipes' formats.
        "fp8.exclude": [],
        "fp8.format": "HYBRID",
        "fp8.override_linear_precision": [False, False, False],
        **_flatten(meta["config"]),
    }
    new = _flatten(json.loads(json.dumps(config)))  # as meta.json holds it: tuples are lists
    for key in sorted(set(old) | set(new)):
        if key not in _RESUMABLE_CHANGES and old.get(key) != new.get(key):
            raise ValueError(
                f"{key}: expected {old.get(key)!r} (the checkpoint in {path!r} was trained with "
                f"it; only {sorted(_RESUMABLE_CHANGES)} may change), got {new.get(key)!r}"
            )
    file = _rank_file(path, rank)
    if not os.path.exists(file):
        raise ValueError(
            f"{file}: expected rank {rank}'s checkpoint file, got none "
            f"(an incomplete checkpoint)"
        )
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated zip, a torn pickle: torch raises several kinds
        raise ValueError(
            f"{file}: expected a checkpoint written by fp8dp.train, got a "
            f"truncated or corrupt file (torch.load: {type(e).__name__}: "
            f"{_one_line(e)})"
        ) from e
    if not isinstance(state, dict):
        raise ValueError(
            f"{file}: expected a dict with keys {sorted(_STATE_KEYS)}, "
            f"got {type(state).__name__}"
        )
    missing = sorted(_STATE_KEYS - set(state))
    if missing:
        raise ValueError(f"{file}: expected keys {sorted(_STATE_KEYS)}, got no {missing}")
    if state["step"] != meta["step"]:
        # save_checkpoint writes the rank files before meta.json: a save that died between the
        # two leaves new rank files under the old meta.json.
        raise ValueError(
            f"{file}: step: expected {meta['step']} (meta.json's), got "
            f"{state['step']!r} (meta.json and the rank files come from different "
            f"saves)"
        )
    rng = state["rng"]
    if not (
        isinstance(rng, dict)
        and isinstance(rng.get("torch"), torch.Tensor)
        and rng["torch"].dtype == torch.uint8
        and isinstance(rng.get("python"), tuple)
        and "cuda" in rng
    ):
        raise ValueError(
            f"{file}: rng: expected the torch, cuda and python RNG states, got "
            f"{_one_line(rng, 100)}"
        )
    try:
        model.load_state_dict(state["model"])  # local: no collective
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{file}: model: expected this model's state dict, got " f"{_one_line(e)}"
        ) from e
    try:
        optimizer._check_state_dict(state["optimizer"])
    except ValueError as e:
        raise ValueError(f"{file}: optimizer {e}") from e
    return state
