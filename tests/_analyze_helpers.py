"""Datasets and steps with known delays for tests/test_analyze.py (importable
by the analyzer's worker processes and by ``--dataset module:callable``)."""
from __future__ import annotations

import os
import time

import numpy as np
import torch


class SleepyDataset:
    """Two-stage: ``raw(i)`` sleeps ``fetch_ms`` and returns ``nbytes``
    bytes, ``prep(raw, i)`` sleeps ``prep_ms``.  Its fingerprint is unique to
    the process that built it, so its node cache never meets another test's."""

    def __init__(self, n: int, fetch_ms: float, prep_ms: float, nbytes: int = 4096):
        self.n, self.fetch_s, self.prep_s, self.nbytes = n, fetch_ms / 1000, prep_ms / 1000, nbytes
        self.sizes = np.full(n, nbytes, dtype=np.int64)
        self._fp = f"sleepy-{os.getpid()}-{time.monotonic_ns()}-{n}-{fetch_ms}-{prep_ms}-{nbytes}"

    def __len__(self) -> int:
        return self.n

    def fingerprint(self) -> str:
        return self._fp

    def raw(self, i: int) -> bytes:
        time.sleep(self.fetch_s)
        return bytes([i % 256]) * self.nbytes

    def prep(self, raw: bytes, i: int):
        time.sleep(self.prep_s)
        return torch.tensor([raw[0], i], dtype=torch.int64)

    def __getitem__(self, i: int):
        return self.prep(self.raw(i), i)


def slow_fetch():
    """Fetch 20 ms, prep 1 ms a sample."""
    return SleepyDataset(64, fetch_ms=20, prep_ms=1)


def slow_prep():
    """Fetch 1 ms, prep 20 ms a sample."""
    return SleepyDataset(64, fetch_ms=1, prep_ms=20)


def step_5ms(batch) -> None:
    """A model step that takes 5 ms a batch without using the CPU."""
    time.sleep(0.005)


def quick():
    """Fetch 0.5 ms, prep 0.5 ms a sample (48 samples): quick passes."""
    return SleepyDataset(48, fetch_ms=0.5, prep_ms=0.5)


def busy_step(batch) -> None:
    """A model step that computes on the CPU for 4 ms (of this thread's CPU time) a batch."""
    t = time.thread_time()
    while time.thread_time() - t < 0.004:
        pass
