"""Datasets for the sharing tests that need the daemon's workers to behave
differently from the job (importable there: this directory is on the
job's sys.path, which the daemon's workers take)."""
from __future__ import annotations

import fcntl
import os

import torch

from toydata import TwoStageToy


class VarShape(TwoStageToy):
    """Samples of three lengths; every prep done outside the job (by the
    daemon's workers) appends a line to ``log``."""

    def __init__(self, n: int, log: str):
        super().__init__(n)
        self.log = log
        self.owner = os.getpid()

    def prep(self, raw: bytes, i: int):
        x, y = super().prep(raw, i)
        if os.getpid() != self.owner:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} {i}\n")
        return torch.cat([x, torch.zeros(i % 3, dtype=x.dtype)]), y


class FlakySetup(TwoStageToy):
    """Unpickling it fails in any process but the job's while the number in
    ``counter`` is above 0 (each failure takes one off): a daemon worker's
    setup fails that many times, for a reason that is not the dataset's."""

    def __init__(self, n: int, counter: str):
        super().__init__(n)
        self.counter = counter
        self.owner = os.getpid()

    def __setstate__(self, state):
        self.__dict__.update(state)
        if os.getpid() == self.owner:
            return
        with open(self.counter, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            left = int(f.read() or 0)
            if left > 0:
                f.seek(0)
                f.truncate()
                f.write(str(left - 1))
                raise MemoryError("flaky worker setup (test): out of memory while loading")


class SlowInWorker(TwoStageToy):
    """While the file ``flag`` exists, sample ``slow`` costs ``secs`` of CPU
    time to prepare in any process but the job's (the daemon's workers): a
    worker that runs, slowly, not a hung one."""

    def __init__(self, n: int, slow: int, secs: float, flag: str):
        super().__init__(n)
        self.slow, self.secs, self.flag = slow, secs, flag
        self.owner = os.getpid()

    def prep(self, raw: bytes, i: int):
        if i == self.slow and os.getpid() != self.owner and os.path.exists(self.flag):
            import time

            end = time.process_time() + self.secs
            while time.process_time() < end:
                pass
        return super().prep(raw, i)


class NumpyLabels(TwoStageToy):
    """Samples whose label and weight are numpy scalars (a label read from
    an array or a DataFrame)."""

    def prep(self, raw: bytes, i: int):
        import numpy as np

        x, y = super().prep(raw, i)
        return x, np.int64(i % 3), np.float32(i / 4)
