"""What torch's worker machinery runs for coordl: batch tasks in, envelopes out.

Data flow for a two-stage dataset (see docs/architecture.md)::

    main process                         worker (or main when num_workers=0)
    ------------                         -----------------------------------
    _PassSampler --Task(epoch, idx)-->   TwoStageFetch.__getitems__
                                           raw(i)              (fetch stage)
                                           prep.prep_sample    (prep stage)
                                         CollateEnvelope       (collate)
    _LoaderIter  <----- Envelope(batch, epoch, BatchStats) ----+

The envelope carries the worker's counters back with the batch, so stats need
no shared state, and a skipped sample becomes one warning in the main process.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.pin_memory import pin_memory as _pin

from .prep import SKIP, failed, prep_sample
from ..protocol import is_two_stage
from ..stats import BatchStats

__all__ = ["Task", "Envelope", "TwoStageFetch", "CollateEnvelope", "TensorBatchFetch", "Precollated"]


class Task:
    """One step of a pass: the epoch and the index (or list of indices), and
    how many times each came before in the pass (``again``: None where none
    did; see ``coordl._rng.derive``)."""

    __slots__ = ("epoch", "indices", "again")

    def __init__(self, epoch: int, indices, again=None) -> None:
        self.epoch = epoch
        self.indices = indices
        self.again = again

    def __reduce__(self):
        return (Task, (self.epoch, self.indices, self.again))

    def __repr__(self) -> str:
        return f"Task(epoch={self.epoch}, indices={self.indices!r})"


class Prepared:
    """The prepared samples of one task and what they cost (before collation)."""

    __slots__ = ("samples", "epoch", "single", "stats")

    def __init__(self, epoch: int, single: bool) -> None:
        self.samples: list = []
        self.epoch = epoch
        self.single = single
        self.stats = BatchStats()


class Envelope:
    """A batch on its way to the loader: the batch (None when every sample
    was skipped), its epoch (-1: not a two-stage read, coordl did not see the
    I/O), its step in the pass when known, and its :class:`BatchStats`."""

    __slots__ = ("batch", "epoch", "stats", "step")

    def __init__(self, batch, epoch: int, stats: BatchStats, step: int | None = None) -> None:
        self.batch = batch
        self.epoch = epoch
        self.stats = stats
        self.step = step

    def __reduce__(self):
        return (Envelope, (self.batch, self.epoch, self.stats, self.step))

    def pin_memory(self, device=None) -> "Envelope":
        # torch's pin-memory thread calls this (it pins anything with a
        # pin_memory method); pin the payload, keep the counters.
        return Envelope(None if self.batch is None else _pin(self.batch), self.epoch, self.stats, self.step)


class TwoStageFetch(torch.utils.data.Dataset):
    """Runs the samples of a :class:`Task` under torch's worker machinery:
    ``raw(i)`` then the shared prep step (``prep.prep_sample``).

    For a dataset that is not two-stage (used with ``on_error="skip"``) it runs
    ``dataset[i]`` for each plain index instead, so bad samples can be skipped.
    """

    def __init__(self, dataset, seed: int, on_error: str) -> None:
        self.dataset = dataset
        self.seed = seed
        self.on_error = on_error
        self.generic = not is_two_stage(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def _run(self, epoch: int, indices, single: bool, again=None) -> Prepared:
        ds, out = self.dataset, Prepared(epoch, single)
        st = out.stats
        clock = time.perf_counter
        for j, i in enumerate(indices):
            t0 = clock()
            if self.generic:
                try:
                    sample = ds[i]
                except Exception as e:
                    sample = failed(ds, i, "loading", e, st, self.on_error)
                else:
                    st.prep_s += clock() - t0
                    st.samples += 1
            else:
                raw, err = None, None
                try:
                    raw = ds.raw(i)
                    try:
                        n = len(raw)
                    except TypeError:
                        raise TypeError(f"raw({i}) should return bytes, but got "
                                        f"{type(raw).__name__} {raw!r:.60}") from None
                except Exception as e:
                    err = e
                st.fetch_s += clock() - t0
                if err is None:
                    st.record_read("storage", n)
                sample = prep_sample(ds, self.seed, epoch, i, raw, err, st, self.on_error,
                                     again[j] if again is not None else 0)
            if sample is not SKIP:
                out.samples.append(sample)
        return out

    def __getitems__(self, task) -> Prepared:
        if type(task) is Task:
            return self._run(task.epoch, task.indices, single=False, again=task.again)
        return self._run(-1, task, single=False)

    def __getitem__(self, task) -> Prepared:
        if type(task) is Task:
            return self._run(task.epoch, (task.indices,), single=True,
                             again=None if task.again is None else (task.again,))
        return self._run(-1, (task,), single=True)


class CollateEnvelope:
    """Applies the user's collate_fn and packs the counters with the batch."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, f: Prepared) -> Envelope:
        t0 = time.perf_counter()
        if not f.samples:
            batch = None
        elif f.single:
            batch = self.collate_fn(f.samples[0])
        else:
            batch = self.collate_fn(f.samples)
        f.stats.prep_s += time.perf_counter() - t0
        return Envelope(batch, f.epoch, f.stats)


class Precollated:
    __slots__ = ("batch",)

    def __init__(self, batch) -> None:
        self.batch = batch


class TensorBatchFetch(torch.utils.data.Dataset):
    """Batched indexing for an unmodified ``TensorDataset`` with default collation.

    ``default_collate([ds[i] for i in idx])`` builds a list of per-sample tuples
    and stacks them; ``index_select`` on each tensor gives the identical list of
    tensors with one gather per tensor.  In a worker the output is allocated in
    shared memory, as default_collate does, so it crosses to the main process
    without a copy.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return self.tensors[0].size(0)

    def __getitems__(self, indices) -> Precollated:
        idx = torch.as_tensor(indices, dtype=torch.long)
        n = len(idx)
        if get_worker_info() is None:
            return Precollated([torch.index_select(t, 0, idx) for t in self.tensors])
        # In a worker: gather every tensor into ONE shared-memory block, so the
        # batch crosses to the main process as one file descriptor, not one
        # per tensor (the per-batch cost there is dominated by fd passing).
        shapes = [(n,) + tuple(t.shape[1:]) for t in self.tensors]
        offsets, total = [], 0
        for t, shape in zip(self.tensors, shapes):
            align = t.element_size()
            total = (total + align - 1) // align * align
            offsets.append(total)
            total += t.element_size() * (n * (t[0].numel() if t.dim() > 1 else 1))
        block = torch.UntypedStorage._new_shared(max(total, 1))
        out = []
        for t, shape, off in zip(self.tensors, shapes, offsets):
            o = torch.empty(0, dtype=t.dtype).set_(block, off // t.element_size(), shape)
            torch.index_select(t, 0, idx, out=o)
            out.append(o)
        return Precollated(out)


def passthrough_collate(p: Precollated):
    return p.batch
