"""The epoch plan: which samples each rank reads, in which order, each epoch.

The order is a pure function ``plan(seed, epoch, rank, world_size)``; every
process can compute any part of it at any time without talking to anyone.  The
rest of coordl hangs on that: each worker computes its own batches, the
read-ahead knows what comes next, and a loader's resumable state is just
(epoch, steps delivered).

The permutation is drawn from the *original* order each epoch (never
cumulatively), seeded with ``seed + epoch`` exactly as
``torch.utils.data.DistributedSampler`` does, and split across ranks with the
same padding / drop-last rule: with the same seed, coordl's order for a rank is
the order DistributedSampler gives that rank.  Every rank gets the same number
of samples and therefore the same number of batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

__all__ = ["plan", "EpochPlan", "check_seed"]

_MASK64 = (1 << 64) - 1


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) <= _MASK64:
        raise ValueError(f"seed should be an int in [0, 2**64), but got seed={seed!r}")
    return int(seed)


def _check_rank(rank, world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size should be a positive int, but got world_size={world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"rank should be an int in [0, world_size={world_size}), but got rank={rank!r}"
        )


def _order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    g = torch.Generator()
    g.manual_seed((seed + epoch) & _MASK64)
    return torch.randperm(num_samples, generator=g).numpy()


def per_rank_count(num_samples: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank gets per epoch (DistributedSampler's rule)."""
    if drop_last and num_samples % world_size != 0:
        return math.ceil((num_samples - world_size) / world_size)
    return math.ceil(num_samples / world_size)


def plan(
    num_samples: int,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
    drop_last: bool = False,
) -> np.ndarray:
    """Indices rank ``rank`` reads in epoch ``epoch``, in order (int64 array).

    ``drop_last`` drops the tail so the dataset divides evenly across ranks;
    otherwise the head of the order is repeated as padding (DistributedSampler
    semantics).  With ``world_size == 1`` nothing is dropped or padded.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
        raise ValueError(f"num_samples should be a non-negative int, but got num_samples={num_samples!r}")
    seed = check_seed(seed)
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch should be a non-negative int, but got epoch={epoch!r}")
    _check_rank(rank, world_size)
    order = _order(num_samples, seed, epoch, shuffle)
    per_rank = per_rank_count(num_samples, world_size, drop_last)
    total = per_rank * world_size
    if total > num_samples:
        if num_samples == 0:
            return np.zeros(0, dtype=np.int64)
        reps = math.ceil(total / num_samples)
        order = np.tile(order, reps)[:total]
    else:
        order = order[:total]
    return np.ascontiguousarray(order[rank:total:world_size])


@dataclass(frozen=True)
class EpochPlan:
    """A loader's plan: the order of every epoch, split into batches.

    ``batch_size=None`` means no batching (one index per step).
    """

    num_samples: int
    seed: int
    batch_size: int | None = 1
    shuffle: bool = True
    drop_last: bool = False
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        check_seed(self.seed)
        _check_rank(self.rank, self.world_size)

    @property
    def samples_per_epoch(self) -> int:
        return per_rank_count(self.num_samples, self.world_size, self.drop_last)

    @property
    def num_batches(self) -> int:
        n = self.samples_per_epoch
        if self.batch_size is None:
            return n
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's sample indices for ``epoch``, in order (:func:`plan`)."""
        return plan(self.num_samples, self.seed, epoch, self.rank, self.world_size,
                    self.shuffle, self.drop_last)

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """Batches ``start, start+1, ...`` of ``epoch`` as lists of ints
        (single ints when ``batch_size`` is None)."""
        idx = self.indices(epoch)
        if self.batch_size is None:
            yield from idx[start:].tolist()
            return
        bs = self.batch_size
        for k in range(start, self.num_batches):
            yield idx[k * bs:(k + 1) * bs].tolist()
