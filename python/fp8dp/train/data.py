"""Byte-level data: a train/validation split and a stateless batch sampler.

Tokens are bytes (vocabulary 256), so no tokenizer file is needed. Two corpora (data.corpus):
"text", one text file whose last val_fraction is held out (the shipped demo text, the default for
CPU tests), and "python", the Python sources of this interpreter (corpus.py), split by file and
read through np.memmap. The batch for (step, rank, micro-batch) is drawn from a generator seeded
by those numbers alone: the data position of a run is just its step, which makes a resumed run
read exactly the batches the uninterrupted one would have read, and runs with the same seed (FP8
or not) read the same batches. Validation batches are the same for every seed.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from . import corpus as pysrc

VOCAB_SIZE = 256


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` (a batch built on the host) on `device`, without making the host wait for the device.

    A plain ``.to("cuda")`` from pageable memory copies and then synchronizes the stream, so the
    host waited there for everything queued before it (the previous micro-batch's backward, the
    last step's optimizer) and the GPU then idled while the host launched the next forward: four
    waits per step at 342M (two micro-batches, inputs and targets), 2-3 ms of idle GPU per step
    in the H100 profiles' data and forward phases. From pinned memory the copy is queued like a
    kernel; torch's pinned allocator keeps the block until the copy has run. On a CPU: `t`."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class _Sampler:
    """Random windows of seq_len + 1 bytes from self.train / self.val (1-D uint8 or int64)."""

    seq_len: int

    def _check(self, where: str) -> None:
        for name, split in (("train", self.train), ("validation", self.val)):
            if len(split) <= self.seq_len + 1:
                raise ValueError(
                    f"model.seq_len: the {name} split of {where} has {len(split)} bytes, too few "
                    f"for sequences of {self.seq_len} (+1 target)"
                )

    def batch(self, split: str, seed: int, step: int, rank: int, micro: int, batch_size: int):
        """(inputs, targets), each [seq_len, batch_size] (sequence-first, as Megatron passes)."""
        data = self.train if split == "train" else self.val
        # The validation windows do not depend on the seed: runs of different seeds are measured
        # on the same bytes, so their spread is the training's, not the sampling of the val set's.
        seed = seed if split == "train" else 0
        g = torch.Generator().manual_seed(_mix(seed, step, rank, micro, split == "val"))
        starts = torch.randint(0, len(data) - self.seq_len - 1, (batch_size,), generator=g)
        window = self._windows(data, starts)
        return window[:-1].contiguous(), window[1:].contiguous()

    def _windows(self, data, starts: torch.Tensor) -> torch.Tensor:
        """[seq_len + 1, batch] int64."""
        idx = starts[None, :] + torch.arange(self.seq_len + 1)[:, None]
        return data[idx]


class ByteCorpus(_Sampler):
    """data.corpus "text": one file, read whole; its last val_fraction is the validation split."""

    def __init__(self, path: str, val_fraction: float, seq_len: int):
        if not os.path.isfile(path):
            raise ValueError(f"data.path: no such file: {path!r}")
        with open(path, "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).to(torch.long)
        n_val = int(len(data) * val_fraction)
        self.train = data[: len(data) - n_val]
        self.val = data[len(data) - n_val :]
        self.seq_len = seq_len
        self.meta = {"corpus": "text", "path": path, "bytes": {"train": len(self.train)}}
        self._check(repr(path))


class PythonSourceCorpus(_Sampler):
    """data.corpus "python": corpus.build's cache, memory-mapped; self.meta is its manifest."""

    def __init__(self, corpus_dir: str, seq_len: int):
        self.meta = pysrc.read_manifest(corpus_dir)
        self.train = pysrc.open_split(corpus_dir, "train")
        self.val = pysrc.open_split(corpus_dir, "val")
        self.seq_len = seq_len
        self._check(f"the Python-source corpus in {corpus_dir!r}")

    def _windows(self, data, starts: torch.Tensor) -> torch.Tensor:
        # Only the bytes of the batch leave the page cache: one slice per sequence.
        n = self.seq_len + 1
        rows = np.stack([data[s : s + n] for s in starts.tolist()], axis=1)
        return torch.from_numpy(rows).to(torch.long)


def load_corpus(data_cfg, seq_len: int, *, rank: int = 0, barrier=None) -> _Sampler:
    """The corpus data.corpus names. For "python", rank 0 builds the cache (once per listing) while
    the others wait at `barrier`, then every rank maps it."""
    if data_cfg.corpus == "text":
        return ByteCorpus(data_cfg.path, data_cfg.val_fraction, seq_len)
    error, corpus_dir = None, None
    if rank == 0:
        try:
            corpus_dir = pysrc.build(data_cfg.packages, data_cfg.val_fraction, data_cfg.cache_dir)
        except ValueError as e:
            error = e
    if barrier is not None:
        barrier()
    if error is not None:
        raise error
    if corpus_dir is None:  # not rank 0: the same listing names the directory rank 0 built
        corpus_dir = pysrc.build(data_cfg.packages, data_cfg.val_fraction, data_cfg.cache_dir)
    return PythonSourceCorpus(corpus_dir, seq_len)


def _mix(*parts) -> int:
    # A fixed, platform-independent mix of the integers into a 63-bit seed.
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ int(p)) * 1099511628211) & ((1 << 63) - 1)
    return h
