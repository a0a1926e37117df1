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
from typing import Any, Iterator

import numpy as np
import torch

__all__ = ["plan", "EpochPlan", "IndexOrder", "check_seed"]

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

    def steps(self, epoch: int, ks) -> list[tuple[int, list[int]]]:
        """``(k, indices of step k)`` for each step ``k`` in ``ks`` of
        ``epoch`` (one index per step when ``batch_size`` is None): what a
        worker prepares (coordl.pipeline.engine)."""
        idx = self.indices(epoch)
        bs = self.batch_size
        if bs is None:
            return [(k, [int(idx[k])]) for k in ks]
        return [(k, idx[k * bs:(k + 1) * bs].tolist()) for k in ks]

    def again(self, epoch: int, ks) -> None:
        """For each step of :meth:`steps`, how many times each of its
        indices came before in the epoch's order: None, as a rank's order
        never repeats an index (a permutation; DistributedSampler's padding
        repeats the head on other ranks)."""
        return None

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


def lane_again(again: Any, rank: int, replicas: int) -> Any:
    """``again`` (a count, or an array of counts, of an index's earlier
    times in a rank's order) as a key of its own for each (count, rank) of
    ``replicas`` ranks: ``again * replicas + rank`` (0 for rank 0's first)."""
    return again * replicas + rank


class IndexOrder:
    """One pass's order given explicitly: the steps a user's sampler (or
    batch sampler) yielded for an epoch, read once in the main process at
    the start of the pass.  coordl's pipeline runs it as it runs an
    ``EpochPlan`` (``num_batches``, ``steps``), so reading ahead, prep in the
    workers and zero-copy batches do not depend on where the order comes
    from.

    ``indices``: every index of the pass in order (int64); ``lengths``: the
    number of indices of each step (int64), or None when every step is one
    index (no batching: ``batch_size=None`` with a ``sampler``).
    """

    __slots__ = ("indices", "lengths", "_offsets", "_again", "_lane")

    def __init__(self, indices: np.ndarray, lengths: np.ndarray | None) -> None:
        self.indices = np.ascontiguousarray(indices, dtype=np.int64)
        self.lengths = None if lengths is None else np.ascontiguousarray(lengths, dtype=np.int64)
        self._offsets = None
        self._again: Any = False        # not computed yet
        self._lane = (0, 1)

    def __getstate__(self):
        return self.indices, self.lengths, self._lane

    def __setstate__(self, state) -> None:
        self.indices, self.lengths = state[:2]
        self._lane = state[2] if len(state) > 2 else (0, 1)
        self._offsets = None
        self._again = False

    def set_lane(self, rank: int, replicas: int) -> None:
        """The sampler drew this order for ``rank`` of ``replicas`` ranks
        that may each be given the same index (a sampler of repeated
        augmentation spreads an index's repeats over the ranks): each
        position's ``again`` becomes ``again * replicas + rank``
        (:func:`lane_again`), so that the same index draws anew on each
        rank, as under torch, and rank 0's first time keeps the index's own
        generator."""
        if (rank, replicas) != self._lane:
            self._lane, self._again = (rank, replicas), False

    @classmethod
    def from_steps(cls, steps, batched: bool, num_samples: int) -> "IndexOrder":
        """The order of ``steps`` (what an index sampler yields: lists of
        indices when ``batched``, else single indices), checked: every index
        an int in ``[-num_samples, num_samples)`` (negative ones counted from
        the end, as ``dataset[i]`` does)."""
        lengths = None
        if batched:
            flat: list = []
            lens: list[int] = []
            for b in steps:
                n0 = len(flat)
                flat.extend(b)
                lens.append(len(flat) - n0)
            lengths = np.asarray(lens, dtype=np.int64)
        else:
            flat = list(steps)
        return cls(_as_indices(flat, num_samples), lengths)

    @property
    def num_batches(self) -> int:
        return len(self.indices) if self.lengths is None else len(self.lengths)

    @property
    def num_samples(self) -> int:
        return len(self.indices)

    def _offs(self) -> np.ndarray:
        if self._offsets is None:
            offs = np.zeros(len(self.lengths) + 1, dtype=np.int64)
            np.cumsum(self.lengths, out=offs[1:])
            self._offsets = offs
        return self._offsets

    def steps(self, epoch: int, ks) -> list[tuple[int, list[int]]]:
        """``(k, indices of step k)`` for each ``k`` in ``ks`` (``epoch`` is
        not needed: the order is this pass's)."""
        idx = self.indices
        if self.lengths is None:
            return [(k, [int(idx[k])]) for k in ks]
        offs = self._offs()
        return [(k, idx[offs[k]:offs[k + 1]].tolist()) for k in ks]

    def step(self, k: int) -> list[int]:
        return self.steps(0, [k])[0][1]

    def repeats(self) -> np.ndarray | None:
        """For each position of the order, how many times its index came
        before (a sampler drawing with replacement, or repeating each index
        for repeated augmentation), or None where no index repeats: so a
        repeat draws its own augmentation, as under torch
        (``coordl._rng.derive``'s ``again``).  Made once per process."""
        if self._again is False:
            idx, got = self.indices, None
            if len(idx) and int(np.bincount(idx - idx.min()).max()) > 1:
                order = np.argsort(idx, kind="stable")
                s = idx[order]
                pos = np.arange(len(idx))
                first = np.maximum.accumulate(np.where(np.r_[True, s[1:] != s[:-1]], pos, 0))
                got = np.empty(len(idx), dtype=np.int64)
                got[order] = pos - first
            rank, replicas = self._lane
            if rank and got is None:
                got = np.zeros(len(idx), dtype=np.int64)
            if got is not None and replicas > 1:
                got = lane_again(got, rank, replicas)
            self._again = got
        return self._again

    def again(self, epoch: int, ks) -> list | None:
        """For each step of :meth:`steps`, how many times each of its
        indices came before in the pass's order (:meth:`repeats`), or None
        where no index repeats."""
        rep = self.repeats()
        if rep is None:
            return None
        if self.lengths is None:
            return [[int(rep[k])] for k in ks]
        offs = self._offs()
        return [rep[offs[k]:offs[k + 1]].tolist() for k in ks]

    def same_as(self, other: "IndexOrder") -> bool:
        if (self.lengths is None) != (other.lengths is None):
            return False
        return (np.array_equal(self.indices, other.indices)
                and (self.lengths is None or np.array_equal(self.lengths, other.lengths)))

    def to_state(self) -> dict:
        """Plain tensors for a loader's state (``torch.save`` keeps them compact)."""
        return {"indices": torch.from_numpy(self.indices.copy()),
                "lengths": None if self.lengths is None else torch.from_numpy(self.lengths.copy())}

    @classmethod
    def from_state(cls, state: dict, num_samples: int) -> "IndexOrder":
        idx = torch.as_tensor(state["indices"], dtype=torch.int64).numpy()
        lengths = state.get("lengths")
        lengths = None if lengths is None else torch.as_tensor(lengths, dtype=torch.int64).numpy()
        if lengths is not None and (int(lengths.sum()) != len(idx) or (lengths < 0).any()):
            raise ValueError(f"the state's order has {len(idx)} indices, but its step lengths add up to "
                             f"{int(lengths.sum())}")
        return cls(_as_indices(idx, num_samples), lengths)


def _as_indices(values, n: int) -> np.ndarray:
    """``values`` as an int64 array of indices into a dataset of ``n``
    samples (negative ones counted from the end); a value that is not an
    integer or is out of range raises, naming it."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        arr = values.astype(np.int64, copy=True)
    else:
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError):
            arr = np.asarray(values, dtype=object)
        if arr.dtype.kind not in "iu" or arr.ndim != 1:
            import operator

            out = np.empty(len(values), dtype=np.int64)
            for j, v in enumerate(values):
                try:
                    out[j] = operator.index(v)
                except TypeError:
                    raise TypeError(f"the sampler yielded {v!r} ({type(v).__name__}) at position {j}, but a "
                                    "dataset with raw/prep is read by integer index") from None
            arr = out
        else:
            arr = arr.astype(np.int64, copy=False)
    if len(arr):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < -n or hi >= n:
            bad = lo if lo < -n else hi
            raise IndexError(f"the sampler yielded index {bad}, but the dataset has {n} samples "
                             f"(indices {-n} to {n - 1})")
        if lo < 0:
            arr = np.where(arr < 0, arr + n, arr)
    return arr
