"""Small datasets for tests, importable by spawned workers."""
from __future__ import annotations

import os
import time

import torch

from coordl import _rng


class TwoStageToy(torch.utils.data.Dataset):
    """Two-stage dataset whose samples record index and one random draw.

    ``bad`` indices raise in ``prep`` (like a corrupt file); ``delay`` sleeps in
    ``raw`` (a slow read).
    """

    def __init__(self, n: int, bad=(), delay: float = 0.0, missing=(), prep_delay: float = 0.0):
        self.n = n
        self.bad = frozenset(bad)
        self.missing = frozenset(missing)
        self.delay = delay
        self.prep_delay = prep_delay   # a slow decode

    def __len__(self) -> int:
        return self.n

    def describe(self, i: int) -> str:
        return f"/toy/sample_{i}.bin"

    def raw(self, i: int) -> bytes:
        if i in self.missing:
            raise FileNotFoundError(2, "No such file or directory", self.describe(i))
        if self.delay:
            time.sleep(self.delay)
        return int(i).to_bytes(8, "little") * 4

    def prep(self, raw: bytes, i: int):
        if i in self.bad:
            raise OSError(f"image file is truncated ({len(raw)} bytes)")
        value = int.from_bytes(raw[:8], "little")
        if self.prep_delay:
            time.sleep(self.prep_delay)
        draw = int(_rng.current().random() * 2**30)
        return torch.tensor([value, draw, os.getpid() * 0], dtype=torch.int64), value % 3

    def __getitem__(self, i: int):
        return self.prep(self.raw(i), i)


class Plain(torch.utils.data.Dataset):
    """Map-style dataset that is not two-stage."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([i, i * i])


class Unsized(torch.utils.data.Sampler):
    """Indices 0..n-1 from a sampler without ``__len__``: a two-stage
    dataset with it stays on torch's machinery (coordl reads a sampler's
    whole epoch only when it has a length)."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def mixing_collate(batch):
    """A collate_fn that makes new tensors of default_collate's (as mixup
    does): each sample's row plus the next one's, and float labels."""
    x, y = torch.utils.data.default_collate(batch)
    return x + x.roll(1, 0), y.to(torch.float32) / 2
