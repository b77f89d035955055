"""Byte-level text data: a train/validation split and a stateless batch sampler.

Tokens are the file's bytes (vocabulary 256), so no tokenizer file is needed. The batch for
(step, rank, micro-batch) is drawn from a generator seeded by those numbers alone: the data
position of a run is just its step, which makes a resumed run read exactly the batches the
uninterrupted one would have read.
"""

from __future__ import annotations

import os

import torch

VOCAB_SIZE = 256


class ByteCorpus:
    def __init__(self, path: str, val_fraction: float, seq_len: int):
        if not os.path.isfile(path):
            raise ValueError(f"data.path: no such file: {path!r}")
        with open(path, "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).to(torch.long)
        n_val = int(len(data) * val_fraction)
        self.train = data[: len(data) - n_val]
        self.val = data[len(data) - n_val :]
        for name, split in (("train", self.train), ("validation", self.val)):
            if len(split) <= seq_len + 1:
                raise ValueError(
                    f"model.seq_len: the {name} split of {path!r} has {len(split)} bytes, too few "
                    f"for sequences of {seq_len} (+1 target)"
                )
        self.seq_len = seq_len

    def batch(self, split: str, seed: int, step: int, rank: int, micro: int, batch_size: int):
        """(inputs, targets), each [seq_len, batch_size] (sequence-first, as Megatron passes)."""
        data = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(_mix(seed, step, rank, micro, split == "val"))
        starts = torch.randint(0, len(data) - self.seq_len - 1, (batch_size,), generator=g)
        idx = starts[None, :] + torch.arange(self.seq_len + 1)[:, None]
        window = data[idx]
        return window[:-1].contiguous(), window[1:].contiguous()


def _mix(*parts) -> int:
    # A fixed, platform-independent mix of the integers into a 63-bit seed.
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ int(p)) * 1099511628211) & ((1 << 63) - 1)
    return h
