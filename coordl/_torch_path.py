"""What torch's worker machinery runs for coordl: batch tasks in, envelopes out.

Data flow for a two-stage dataset (see docs/architecture.md)::

    main process                         worker (or main when num_workers=0)
    ------------                         -----------------------------------
    _PassSampler --Task(epoch, idx)-->   TwoStageFetch.__getitems__
                                           raw(i)              (fetch stage)
                                           prep(raw, i) in sample_rng(seed, epoch, i)
                                         CollateEnvelope       (collate)
    _LoaderIter  <----- Envelope(batch, counters, skipped) ----+

The envelope carries the worker's counters back with the batch, so stats need
no shared state, and a skipped sample becomes one warning in the main process.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.pin_memory import pin_memory as _pin

from ._rng import sample_rng
from .errors import sample_error
from .protocol import describe, is_two_stage

__all__ = ["Task", "Envelope", "TwoStageFetch", "CollateEnvelope", "TensorBatchFetch", "Precollated"]


class Task:
    """One step of a pass: the epoch and the index (or list of indices)."""

    __slots__ = ("epoch", "indices")

    def __init__(self, epoch: int, indices) -> None:
        self.epoch = epoch
        self.indices = indices

    def __reduce__(self):
        return (Task, (self.epoch, self.indices))

    def __repr__(self) -> str:
        return f"Task(epoch={self.epoch}, indices={self.indices!r})"


class Prepared:
    """Prepared samples of one task plus what it cost (before collation).
    (Not to be confused with ``coordl.fetch.Fetched``, one completed read.)"""

    __slots__ = ("samples", "epoch", "requested", "nbytes", "fetch_s", "prep_s", "skips", "single")

    def __init__(self, epoch, requested, single) -> None:
        self.samples: list = []
        self.epoch = epoch
        self.requested = requested
        self.nbytes = 0
        self.fetch_s = 0.0
        self.prep_s = 0.0
        self.skips: list[tuple[int, str, str]] = []
        self.single = single


class Envelope:
    """A collated batch travelling from a worker to the main process."""

    __slots__ = ("batch", "epoch", "samples", "nbytes", "fetch_s", "prep_s", "skips",
                 "from_cache", "bytes_cache", "from_peers", "bytes_peers", "step")

    def __init__(self, batch, epoch, samples, nbytes, fetch_s, prep_s, skips,
                 from_cache=0, bytes_cache=0, from_peers=0, bytes_peers=0, step=None) -> None:
        self.batch = batch
        self.epoch = epoch
        self.samples = samples          # samples in the batch
        self.nbytes = nbytes            # raw bytes read from storage
        self.fetch_s = fetch_s
        self.prep_s = prep_s
        self.skips = skips
        self.from_cache = from_cache    # samples whose bytes came from the node cache
        self.bytes_cache = bytes_cache
        self.from_peers = from_peers
        self.bytes_peers = bytes_peers
        self.step = step                # batch index k in the epoch (None: the loader counts)

    def _fields(self):
        return tuple(getattr(self, k) for k in self.__slots__)

    def __reduce__(self):
        return (Envelope, self._fields())

    def pin_memory(self, device=None) -> "Envelope":
        # torch's pin-memory thread calls this (it pins anything with a
        # pin_memory method); pin the payload, keep the counters.
        f = list(self._fields())
        f[0] = None if self.batch is None else _pin(self.batch)
        return Envelope(*f)


class TwoStageFetch(torch.utils.data.Dataset):
    """Runs raw -> prep for each index of a :class:`Task`.

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

    def _run(self, epoch: int, indices, single: bool) -> Prepared:
        ds, seed, out = self.dataset, self.seed, Prepared(epoch, len(indices), single)
        clock = time.perf_counter
        for i in indices:
            t0 = clock()
            stage = "reading"
            try:
                if self.generic:
                    stage = "loading"
                    out.samples.append(ds[i])
                    out.prep_s += clock() - t0
                    continue
                raw = ds.raw(i)
                t1 = clock()
                out.fetch_s += t1 - t0
                out.nbytes += len(raw)
                stage = "preparing"
                with sample_rng(seed, epoch, i):
                    sample = ds.prep(raw, i)
                out.prep_s += clock() - t1
            except Exception as e:
                where = describe(ds, i)
                if self.on_error == "raise":
                    raise sample_error(stage, i, where, e) from e
                out.skips.append((i, where, f"{stage}: {type(e).__name__}: {e}"))
                continue
            out.samples.append(sample)
        return out

    def __getitems__(self, task) -> Prepared:
        if type(task) is Task:
            return self._run(task.epoch, task.indices, single=False)
        return self._run(-1, task, single=False)

    def __getitem__(self, task) -> Prepared:
        if type(task) is Task:
            return self._run(task.epoch, (task.indices,), single=True)
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
        prep_s = f.prep_s + (time.perf_counter() - t0)
        return Envelope(batch, f.epoch, len(f.samples), f.nbytes, f.fetch_s, prep_s, f.skips)


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
