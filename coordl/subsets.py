"""torch's ``Subset`` and ``ConcatDataset`` of two-stage datasets, two-stage
themselves.

``torch.utils.data.random_split(dataset, ...)`` and ``Subset(dataset,
indices)`` are how most scripts split one folder into training and
validation sets.  A loader given such a part runs it on coordl's pipeline
when the dataset inside is two-stage (``coordl.ImageFolder``) or is read as
one (torchvision's folders, through ``coordl.tvcompat.adapt``):
:class:`TwoStageSubset` is that ``Subset`` (the same ``dataset`` and
``indices`` attributes, ``isinstance`` of torch's class), whose sample ``i``
is the inner dataset's sample ``indices[i]``, read by its ``raw`` and
prepared by its ``prep``.  A sample's random draws come from (seed, epoch,
``i``) as any two-stage dataset's: its position in the subset, which the
loader's plan orders.

:class:`TwoStageConcat` is torch's ``ConcatDataset`` of two-stage datasets
(folders combined into one training set): sample ``i`` is the part's that
holds it, as torch's class finds it.
"""
from __future__ import annotations

import bisect
import hashlib
import operator
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Subset

from .protocol import describe as _describe, is_two_stage

__all__ = ["TwoStageSubset", "TwoStageConcat"]


class TwoStageSubset(Subset):
    """``Subset(dataset, indices)`` of a two-stage ``dataset``: the protocol's
    ``raw``, ``prep``, ``describe``, ``sizes``, ``fingerprint()`` (and
    ``raw_uncached``/``raw_many`` where the inner dataset has them) over the
    chosen samples.  ``indices`` are read once, here (a list changed in
    place afterwards is not followed: the loader checks at each pass,
    :meth:`reads`, and says so).

    ``transform`` reads the inner dataset's; setting it (as the device
    stages do on their copies) sets it on a copy of the inner dataset, so
    the dataset this subset was made from is never modified."""

    def __init__(self, dataset: Any, indices) -> None:
        if not is_two_stage(dataset):
            raise TypeError(f"TwoStageSubset needs a two-stage dataset (raw/prep), but got {type(dataset).__name__}")
        n = len(dataset)
        if isinstance(indices, torch.Tensor):
            idx = indices.detach().cpu().numpy()
        elif isinstance(indices, (list, tuple, range, np.ndarray)):
            idx = np.asarray(indices)
        else:
            idx = None
        if idx is not None and idx.ndim == 1 and idx.dtype.kind in "iu":
            idx = idx.astype(np.int64)        # (a copy: the user's array stays theirs)
        else:
            try:
                idx = np.array([operator.index(i) for i in indices], dtype=np.int64)
            except TypeError as e:
                raise TypeError(f"a Subset's indices should be integers ({e})") from None
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise ValueError(f"a Subset's indices should lie in [-{n}, {n}) for a dataset of {n} samples, but "
                             f"they span [{int(idx.min())}, {int(idx.max())}]")
        idx[idx < 0] += n
        super().__init__(dataset, indices)
        self._map = idx

    def _base(self, index: int) -> int:
        return int(self._map[index])

    def reads(self, indices) -> bool:
        """Whether ``indices`` (the user's Subset's, at a later pass) are
        still the ones this subset reads."""
        try:
            if len(indices) != len(self._map):
                return False
            got = indices.detach().cpu().numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices)
        except (TypeError, ValueError):
            return False
        if got.ndim != 1 or (got.size and got.dtype.kind not in "iub"):
            return False
        n = len(self.dataset)
        return bool(np.array_equal(np.where(got < 0, got + n, got), self._map))

    # -- the two-stage protocol -------------------------------------------
    def raw(self, index: int) -> bytes:
        return self.dataset.raw(self._base(index))

    def prep(self, raw: bytes, index: int) -> Any:
        return self.dataset.prep(raw, self._base(index))

    def describe(self, index: int) -> str:
        return _describe(self.dataset, self._base(index))

    @property
    def raw_uncached(self):
        read = self.dataset.raw_uncached      # AttributeError where the inner dataset has none
        return lambda index: read(self._base(index))

    @property
    def raw_many(self):
        read = self.dataset.raw_many
        return lambda indices: read([self._base(i) for i in indices])

    @property
    def sizes(self):
        sizes = getattr(self.dataset, "sizes", None)
        return sizes[self._map] if isinstance(sizes, np.ndarray) else None

    @property
    def fingerprint(self):
        inner = self.dataset.fingerprint      # AttributeError where the inner dataset has none
        return lambda: self._digest(b"fingerprint", inner())

    @property
    def sample_digest(self):
        inner = self.dataset.sample_digest
        return lambda: self._digest(b"samples", inner())

    def _digest(self, kind: bytes, inner: str) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(b"coordl.TwoStageSubset\0" + kind + b"\0" + str(inner).encode() + b"\0")
        h.update(self._map.astype("<i8").tobytes())
        return h.hexdigest()

    # -- transforms: the inner dataset's ----------------------------------
    @property
    def transform(self):
        return getattr(self.dataset, "transform", None)

    @transform.setter
    def transform(self, value) -> None:
        self._own_copy().transform = value

    @property
    def target_transform(self):
        return getattr(self.dataset, "target_transform", None)

    @target_transform.setter
    def target_transform(self, value) -> None:
        self._own_copy().target_transform = value

    def _own_copy(self):
        """The inner dataset, copied (shallow) the first time this subset
        changes it: the one it was made from, which a copy of this subset
        shares, stays as it is."""
        import copy

        if not self.__dict__.get("_owns", False):
            self.dataset = copy.copy(self.dataset)
            self._owns = True
        return self.dataset

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._owns = False        # the copy shares the inner dataset until it changes it
        return new

    @property
    def views_after_transform(self) -> bool:
        return bool(getattr(self.dataset, "views_after_transform", False))

    def take_transforms(self, other: "TwoStageSubset") -> None:
        """What a newly adapted copy runs (``coordl.tvcompat.adapt``), from the next pass."""
        inner = other.dataset if isinstance(other, TwoStageSubset) else other
        self._own_copy().take_transforms(inner)

    def __repr__(self) -> str:
        return f"TwoStageSubset({len(self)} of {self.dataset!r})"


class TwoStageConcat(ConcatDataset):
    """``ConcatDataset(datasets)`` of two-stage datasets: the protocol's
    ``raw``, ``prep``, ``describe``, ``sizes``, ``fingerprint()`` (and
    ``raw_uncached``/``raw_many`` where every part has them), each sample
    read and prepared by the part that holds it.  The parts keep their own
    transforms: there is no one ``transform`` (the device split converts
    on the CPU; ``decode="device"`` is refused)."""

    def __init__(self, datasets) -> None:
        super().__init__(datasets)
        for d in self.datasets:
            if not is_two_stage(d):
                raise TypeError(f"TwoStageConcat needs two-stage datasets (raw/prep), but got {type(d).__name__}")

    def _locate(self, index: int) -> tuple[int, int]:
        """``(part's number, index in it)`` of sample ``index``, as torch's class finds it."""
        n = len(self)
        if index < 0:
            if -index > n:
                raise ValueError("absolute value of index should not exceed dataset length")
            index += n
        if index >= n:
            raise IndexError(f"index {index} is out of range for {n} samples")
        k = bisect.bisect_right(self.cumulative_sizes, index)
        return k, index - (self.cumulative_sizes[k - 1] if k else 0)

    def _each(self, name: str) -> list:
        """Every part's ``name`` (AttributeError where one has none)."""
        return [getattr(d, name) for d in self.datasets]

    # -- the two-stage protocol -------------------------------------------
    def raw(self, index: int) -> bytes:
        k, j = self._locate(index)
        return self.datasets[k].raw(j)

    def prep(self, raw: bytes, index: int) -> Any:
        k, j = self._locate(index)
        return self.datasets[k].prep(raw, j)

    def describe(self, index: int) -> str:
        k, j = self._locate(index)
        return _describe(self.datasets[k], j)

    @property
    def raw_uncached(self):
        reads = self._each("raw_uncached")

        def read(index: int) -> bytes:
            k, j = self._locate(index)
            return reads[k](j)
        return read

    @property
    def raw_many(self):
        reads = self._each("raw_many")

        def read(indices: list) -> list:
            out: list = [None] * len(indices)
            by_part: dict = {}
            for r, i in enumerate(indices):
                k, j = self._locate(i)
                by_part.setdefault(k, []).append((r, j))
            for k, rows in by_part.items():
                for (r, _), got in zip(rows, reads[k]([j for _, j in rows])):
                    out[r] = got
            return out
        return read

    @property
    def sizes(self):
        parts = [getattr(d, "sizes", None) for d in self.datasets]
        if not all(isinstance(s, np.ndarray) for s in parts):
            return None
        return np.concatenate([s.astype(np.int64, copy=False) for s in parts]) if parts else np.zeros(0, np.int64)

    @property
    def fingerprint(self):
        inner = self._each("fingerprint")
        return lambda: self._digest(b"fingerprint", [f() for f in inner])

    @property
    def sample_digest(self):
        inner = self._each("sample_digest")
        return lambda: self._digest(b"samples", [f() for f in inner])

    def _digest(self, kind: bytes, parts: list) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(b"coordl.TwoStageConcat\0" + kind + b"\0")
        for p, n in zip(parts, self.cumulative_sizes):
            h.update(str(p).encode() + b"\0" + str(n).encode() + b"\0")
        return h.hexdigest()

    @property
    def views_after_transform(self) -> bool:
        return any(getattr(d, "views_after_transform", False) for d in self.datasets)

    def __repr__(self) -> str:
        return f"TwoStageConcat({', '.join(repr(d) for d in self.datasets)})"
