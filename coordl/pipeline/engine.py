"""The fetch + prep engine of one worker (or of the main process when
``num_workers=0``).  One implementation, placed by the loader.

A worker owns a fixed share of every epoch: of the batches a pass still has
to deliver (``pass_steps``: from ``start`` on, minus those delivered before a
resume), the ``j``-th belongs to worker ``j % num_workers``.  Since the
plan is a pure function, the worker computes its own batches from the pass
parameters; main never sends indices.

Event loop (all events arrive on one ``queue.Queue``, ``Engine.q``; the
worker loop in ``_pipeline`` or ``InlineIter`` dispatches them)::

    fetch threads ---Fetched(key=(pass, pos, j)) | FetcherDied--> on_fetched
    control (main) ---("pass"|"consumed"|"free"|"retire"|"stats"|"stop")--> begin_pass,
                                                    on_consumed, slot release or retirement
    Engine.pump: prepare ready samples of batches inside the window
                 [first unconsumed, + prefetch), lowest batch first, writing
                 each into its row of the batch's slot; emit finished batches.

Samples complete out of order (a slow read holds up only its own batch); the
main process puts batches back in plan order.  A bad sample fails only its
batch (``("error", k, ...)`` is emitted, the rest of the batch is dropped and
its slot given back); a dead fetch thread raises from ``on_fetched``, and
``doing()`` names the stage/batch/sample of any unexpected failure.
"""
from __future__ import annotations

import contextlib
import heapq
import queue
import time
import traceback
from typing import Callable

import numpy as np
import torch

from . import collate as _collate
from .. import _rng
from .prep import SKIP, prep_sample
from .readahead import Fetched, Fetcher, FetcherDied
from ..errors import Failure, SampleError
from ..plan import EpochPlan, IndexOrder
from ..protocol import describe
from ..stats import BatchStats

__all__ = ["Engine", "pass_steps", "place", "finish", "to_copy_path"]


class _Builder:
    """One batch being assembled, rows in plan order, samples in any order."""

    __slots__ = ("k", "indices", "n", "done", "layout", "slot", "targets", "dests", "samples",
                 "ok", "stats", "copy", "failed", "marks", "payloads", "after", "again")

    def __init__(self, k: int, indices: list[int], copy: bool, again: list[int] | None = None) -> None:
        self.k = k
        self.indices = indices
        self.again = again              # per row, how many times its index came before in the pass (or None)
        self.n = len(indices)
        self.done = 0
        self.layout = None
        self.slot = None
        self.targets = None             # one tensor per leaf over the slot (_collate.views)
        self.dests = None               # what rows are written through (_collate.row_targets)
        self.samples: list | None = [None] * self.n if copy else None
        self.ok = [False] * self.n
        self.stats = BatchStats()
        self.copy = copy
        self.failed = False             # an error was emitted for this batch
        self.marks = None               # per row: paths of its device-split images (coordl.device)
        self.payloads = None            # decode="device": per row, what travels with its records
        self.after = None               # per row, per mark: (jitter operations, erasing rectangles) for the tail


class Engine:
    """Fetches and prepares the batches of one worker.

    ``batch_size``: None (no batching: a step is one sample, converted by
    ``collate_fn``), else batches are collated (0: of any size, from a batch
    sampler).  ``emit(kind, *payload)`` hands results out: ``("batch", k, slot, layout,
    rows, stats)``, ``("obj", k, batch, stats)``, ``("packed", k, slot, packed, stats)``
    (a worker's: a ``collate_fn``'s batch with its tensors in a slot, :func:`coordl.pipeline.collate.pack`),
    ``("empty", k, stats)`` or ``("error", k, failure)`` (an :class:`coordl.errors.Failure`).  ``slots`` provides batch buffers:
    ``acquire(nbytes) -> (slot_id, uint8 ndarray)``.
    """

    def __init__(self, dataset, *, seed: int, on_error: str, collate_fn, batch_size,
                 prefetch: int, fetch_threads: int, budget_bytes: int, slots, emit: Callable,
                 worker_id: int = 0, cache=None, peers=None, collate_later: bool = False, pack: bool = False) -> None:
        self.dataset = dataset
        self.seed = seed
        self.on_error = on_error
        self.collate_fn = collate_fn
        # decode="device": batches are default-collated here, the user's collate_fn runs on the
        # device's batch in the main process (coordl.loader's _collate_delivered); an empty step
        # of a batch sampler is still collate_fn([]) here
        self.collate_later = collate_later
        # a worker process: a collated batch's tensors cross to the main process in a slot (_collate.pack)
        self.pack = pack
        # timm's fast_collate: its batches of (uint8 image, class index) collated in place too (_collate.layout_of)
        self.pairs = not collate_later and _collate.is_fast_collate(collate_fn)
        self.in_place = (collate_later or self.pairs or _collate.is_default_collate(collate_fn)) \
            and batch_size is not None
        self.batch_size = batch_size
        self.prefetch = max(1, prefetch)
        self.fetch_threads = fetch_threads
        self.fetch_start = 1            # threads a pass's fetcher starts with: half what the last one grew to
        self.budget = budget_bytes
        self.slots = slots
        self.emit = emit
        self.worker_id = worker_id
        self.q: queue.Queue = queue.Queue()
        self.peers = peers
        self._read, self._read_many = _make_reader(dataset, cache, peers)
        # decode="device" over a plain folder: whole batches at once (coordl.pipeline.device_batches)
        from .device_batches import batch_reads_for
        self._batches = batch_reads_for(dataset, cache=cache, peers=peers, in_place=self.in_place,
                                        batch_size=batch_size)
        # device split (coordl.device.SplitPrep): where each sample's uint8 images are
        self._take_marks = getattr(dataset, "take_device_marks", None)
        # ... and what the tail does to each besides converting (ColorJitter before, RandomErasing after)
        self._take_after = getattr(dataset, "take_device_after", None)
        # decode="device" (coordl.device.DecodePrep): the bytes (or CPU images) beside each record
        self._take_payloads = getattr(dataset, "take_device_payloads", None)
        sizes = getattr(dataset, "sizes", None)
        self._size_of = (lambda i: int(sizes[i])) if isinstance(sizes, np.ndarray) else None
        self.pass_id = None
        self.again: list | None = None         # per batch of the pass, plan.again's
        self.fetcher: Fetcher | None = None
        self.at: tuple = ("idle", None, None)  # (stage, batch, sample): names a failure

    # ------------------------------------------------------------------ passes
    def begin_pass(self, pass_id, plan: EpochPlan | IndexOrder, epoch: int, start: int,
                   num_workers: int, worker_id: int, skip=()) -> None:
        """Start batches ``start, start+1, ...`` of ``epoch`` except those in
        ``skip`` (delivered before a resume); this worker takes every
        ``num_workers``-th of what is left, from its ``worker_id``."""
        self.end_pass()
        if self.peers is not None:
            self.peers.new_epoch()      # peers that failed last epoch get another chance
        self.pass_id = pass_id
        self.epoch = epoch
        ks = pass_steps(plan.num_batches, start, skip)[worker_id::num_workers]
        # an EpochPlan, or an IndexOrder (the steps a user's sampler yielded for this pass)
        self.my = plan.steps(epoch, ks)
        # a user's sampler may repeat an index (with replacement, repeated augmentation): each time draws anew
        self.again = plan.again(epoch, ks)
        for k, ind in self.my:
            if not ind:     # an empty step of a batch sampler: collated as torch would, at once
                self._empty_step(k)
        self.first = 0                  # position of the first unconsumed batch
        self.consumed: set[int] = set()
        self.builders: dict[int, _Builder] = {}
        self.ready: list = []           # heap of (pos, j, Fetched)
        self.delivered = 0              # reads of this pass handed to on_fetched
        self.upto = np.cumsum([0] + [len(ind) for _, ind in self.my]).tolist()  # samples before pos
        self.built = 0                  # batch reads: the positions before it are built
        if self._batches is not None:
            return
        order = ((( pass_id, pos, j), i) for pos, (_, ind) in enumerate(self.my)
                 for j, i in enumerate(ind))
        self.fetcher = Fetcher(self._read, order, self.q, threads=self.fetch_threads,
                               start_threads=self.fetch_start, budget_bytes=self.budget, size_of=self._size_of,
                               name=f"coordl-fetch-w{self.worker_id}", read_many=self._read_many)

    def _empty_step(self, k: int) -> None:
        """Step ``k`` has no samples (a batch sampler yielded ``[]``): its
        batch is ``collate_fn([])``, or that call's error, as under torch."""
        try:
            with _collate_scope(self.collate_fn, self.seed, self.epoch, k):
                batch = (self.collate_fn or torch.utils.data.default_collate)([])
        except Exception as e:
            self.emit("error", k, Failure(f"Caught {type(e).__name__} in DataLoader worker process "
                                          f"{self.worker_id}.\nOriginal {traceback.format_exc()}", type(e)))
            return
        self.emit("obj", k, batch, BatchStats())

    def end_pass(self) -> None:
        if self._batches is not None:
            self._batches.close()
        if self.fetcher is not None:
            # half: storage that needed them regrows them within a few reads; a pass that
            # no longer needs them (a cold first epoch, then the page cache) sheds them
            self.fetch_start = max(1, self.fetcher.threads // 2)
            self.fetcher.close()
            # threads finish their current read; their results are dropped on arrival
            self.fetcher = None
        for b in getattr(self, "builders", {}).values():
            if b.slot is not None:
                self.slots.release(b.slot)
        self.builders = {}
        self.ready = []
        self.pass_id = None

    # ------------------------------------------------------------------ events
    def on_fetched(self, f: Fetched | FetcherDied) -> None:
        if type(f) is FetcherDied:
            if f.fetcher is not self.fetcher or self.fetcher is None:
                return  # a thread of an abandoned pass
            where = describe(self.dataset, f.index) if f.index is not None else None
            raise RuntimeError(f.message(where))
        pass_id, pos, j = f.key
        if pass_id != self.pass_id or self.fetcher is None:
            return  # stale read of an abandoned pass
        self.delivered += 1
        heapq.heappush(self.ready, (pos, j, f))

    def next_event(self):
        """The next event of ``q``, waiting for it.  Before waiting: when a
        sample inside the window is still being read (fewer reads delivered
        than the samples up to the window's end), the prep thread is about
        to wait on storage, so the fetcher gets one more thread
        (:meth:`Fetcher.grow`, up to ``fetch_threads``)."""
        try:
            return self.q.get_nowait()
        except queue.Empty:
            pass
        f = self.fetcher
        if f is not None:
            end = min(self.first + self.prefetch, len(self.my))
            if self.delivered < self.upto[end] and not (self.ready and self.ready[0][0] < end):
                f.grow()
        return self.q.get()

    def on_consumed(self, k: int) -> None:
        self.consumed.add(k)
        while self.first < len(self.my) and self.my[self.first][0] in self.consumed:
            self.consumed.discard(self.my[self.first][0])
            self.first += 1

    def pump(self, interrupt: Callable[[], bool] | None = None) -> None:
        """Prepare ready samples inside the window until none is left (or
        ``interrupt()`` says events are waiting).  With batch reads: build
        the batches inside the window not built yet, one after another."""
        if self._batches is not None:
            while self.pass_id is not None and self.built < min(self.first + self.prefetch, len(self.my)):
                pos = self.built
                self.built += 1
                k, indices = self.my[pos]
                if indices:
                    self._batches.build(self, _Builder(k, indices, copy=False, again=self._again_at(pos)))
                    self.at = ("idle", None, None)
                if interrupt is not None and interrupt():
                    return
            return
        while self.ready:
            pos = self.ready[0][0]
            if pos >= self.first + self.prefetch:
                return
            _, j, f = heapq.heappop(self.ready)
            self._prep_one(pos, j, f)
            if interrupt is not None and interrupt():
                return

    # ------------------------------------------------------------------ work
    def _prep_one(self, pos: int, j: int, f: Fetched) -> None:
        k, indices = self.my[pos]
        b = self.builders.get(pos)
        if b is None:
            b = self.builders[pos] = _Builder(k, indices, copy=not self.in_place, again=self._again_at(pos))
        st = b.stats
        i = f.index
        self.at = ("preparing", k, i)
        clock = time.perf_counter
        st.fetch_s += f.seconds
        try:
            if not b.failed:  # else its error is out: drop the batch's remaining samples, as torch does
                if f.error is None:
                    st.record_read(f.source, f.nbytes)
                try:
                    sample = prep_sample(self.dataset, self.seed, self.epoch, i, f.data, f.error,
                                         st, self.on_error, b.again[j] if b.again is not None else 0)
                except SampleError as e:
                    self._fail(b)
                    self.sample_failed(k, e)
                else:
                    if sample is not SKIP:
                        if self._take_marks is not None:
                            paths, _ = self._take_marks()
                            if b.marks is None:
                                b.marks = [()] * b.n
                            b.marks[j] = paths
                            after = self._take_after() if self._take_after is not None else None
                            if after is not None:
                                if b.after is None:
                                    b.after = [None] * b.n
                                b.after[j] = after
                            if self._take_payloads is not None:
                                self._encoded_row(b, j, i, paths)
                        t0 = clock()
                        self._place(b, j, sample)
                        st.prep_s += clock() - t0
        finally:
            if self.fetcher is not None:
                self.fetcher.release(f.nbytes)
            f.data = None
        b.done += 1
        if b.done == b.n:
            del self.builders[pos]
            if not b.failed:
                self.at = ("collating", k, None)
                self._finish(b)
        self.at = ("idle", None, None)

    def _again_at(self, pos: int) -> list[int] | None:
        """How many times each index of the batch at ``pos`` came before in
        the pass, or None where none did."""
        again = self.again[pos] if self.again is not None else None
        return again if again is not None and any(again) else None

    def _encoded_row(self, b: _Builder, j: int, i: int, paths: tuple) -> None:
        """decode="device": keep row ``j``'s payloads; every row of a batch
        must put its records at the same places (a collated leaf cannot mix
        records and images).  Either failure is the dataset's code, not a
        sample's: the pass stops with the message."""
        payloads = self._take_payloads()
        if b.payloads is None:
            b.payloads = [None] * b.n
        for r, other in enumerate(b.payloads):
            if other is not None and b.marks[r] != paths:
                raise RuntimeError(
                    f"decode='device': sample {i} ({describe(self.dataset, i)}) has its images at "
                    f"{list(paths) or 'no place'} but sample {b.indices[r]} of the same batch at "
                    f"{list(b.marks[r]) or 'no place'}; the images of one batch must sit at the same places "
                    "in every sample (or use decode='cpu')")
            if other is not None:
                break
        b.payloads[j] = payloads

    def doing(self) -> str:
        """What the engine was doing, for the message of an unexpected failure."""
        stage, k, i = self.at
        if stage == "idle":
            return "between samples"
        s = f"{stage} batch {k}"
        if i is not None:
            s += f", sample {i} ({describe(self.dataset, i)})"
        return s

    def sample_failed(self, k: int, e: SampleError) -> None:
        """Batch ``k`` fails with the sample's error ``e`` (raised inside
        an ``except`` of it: the traceback is its)."""
        self.emit("error", k, Failure(f"Caught {type(e).__name__} in DataLoader worker process "
                                      f"{self.worker_id}.\nOriginal {traceback.format_exc()}",
                                      type(e.__cause__) if e.__cause__ is not None else None, e))

    def _fail(self, b: _Builder) -> None:
        """Batch ``b`` fails (its error is emitted by the caller): give its
        slot back; the pass goes on with the next batches, as torch's
        DataLoader does after a worker exception."""
        b.failed = True
        if b.slot is not None:
            self.slots.release(b.slot)
            b.slot, b.targets, b.dests = None, None, None
        b.samples = None

    def _place(self, b: _Builder, j: int, sample) -> None:
        place(b, j, sample, self.slots, self.pairs)

    def _finish(self, b: _Builder) -> None:
        try:
            out = finish(b, None if self.collate_later else self.collate_fn, self.batch_size, self.slots,
                         getattr(self.dataset, "finish_on_cpu", None), (self.seed, self.epoch))
        except Exception as e:
            self.emit("error", b.k, Failure(f"Caught an error in collate_fn in DataLoader worker process "
                                            f"{self.worker_id}.\nOriginal {traceback.format_exc()}", type(e)))
            return
        if out[0] == "empty":
            self.emit("empty", b.k, b.stats)
        elif out[0] == "obj":
            packed = _collate.pack(out[1], self.slots) if self.pack else None
            if packed is not None:
                self.emit("packed", b.k, packed[0], packed[1], b.stats)
            else:
                self.emit("obj", b.k, out[1], b.stats)
        else:
            self.emit("batch", b.k, b.slot, b.layout, out[1], b.stats)


def place(b: _Builder, j: int, sample, slots, pairs: bool = False) -> None:
    """Put ``sample`` in row ``j`` of batch ``b``: straight into the batch
    buffer (from ``slots``) when it has the batch's fixed layout, else kept
    for collation at the end (switching the batch to that path, rows
    written so far included: what torch would do).  ``pairs``: the
    collate_fn is timm's ``fast_collate``, whose layout only (uint8 image,
    class index) samples have."""
    if not b.copy:
        if b.layout is None:
            b.layout = _collate.layout_of(sample, b.n, pair=True) if pairs else \
                _collate.layout_of(sample, b.n, objs=True)
            if b.layout is not None:
                b.slot, buf = slots.acquire(b.layout.nbytes)
                b.targets = _collate.views(b.layout, buf)
        leaves = b.layout.leaves_of(sample) if b.layout is not None else None
        if leaves is not None:
            if b.dests is None:     # once per batch (also when the caller set b.targets itself)
                b.dests = _collate.row_targets(b.layout, b.targets)
            _collate.write_row(b.dests, j, leaves)
            b.ok[j] = True
            return
        to_copy_path(b, slots)
    b.samples[j] = sample
    b.ok[j] = True


def to_copy_path(b: _Builder, slots) -> None:
    """Batch ``b`` is collated at the end: rows written so far become samples."""
    rows = [r for r in range(b.n) if b.ok[r]]
    back = _collate.rows_as_samples(b.layout, b.targets, rows) if rows else []
    b.samples = [None] * b.n
    for r, smp in zip(rows, back):
        b.samples[r] = smp
    if b.slot is not None:
        slots.release(b.slot)
    b.slot, b.targets, b.dests, b.copy = None, None, None, True


def _collate_scope(collate_fn, seed: int, epoch: int, k: int):
    """Where step ``k``'s ``collate_fn`` runs: the global generators seeded
    from (seed, epoch, step) when it may draw (:func:`coordl._rng.seeded_collate`)."""
    return _rng.seeded_collate(seed, epoch, k) if _rng.collate_draws(collate_fn) else contextlib.nullcontext()


def finish(b: _Builder, collate_fn, batch_size, slots, finish_on_cpu=None, key=None) -> tuple:
    """Batch ``b``, every row placed or skipped: ``("empty",)`` (all
    skipped), ``("obj", batch)`` (collated) or ``("batch", rows)`` (in
    ``b.slot`` with ``b.layout``, the skipped rows' gaps closed, plan order
    kept).  An error of ``collate_fn`` propagates.  ``key``: (seed, epoch)
    of the pass, for the seeded scope of a ``collate_fn`` that may draw.

    With a device split (``b.marks``), the batch's images travel as uint8
    only when every row has them at the same places (``stats.device_marks``);
    otherwise the marked rows are converted on the CPU first
    (``finish_on_cpu``), so a collated leaf never mixes uint8 and float."""
    rows = [r for r in range(b.n) if b.ok[r]]
    if not rows:
        if b.slot is not None:
            slots.release(b.slot)
        return ("empty",)
    if b.payloads is not None:
        b.stats.device_marks = b.marks[rows[0]]     # the rows agree (Engine._encoded_row)
    elif b.marks is not None:
        marks = {b.marks[r] for r in rows}
        if len(marks) == 1 and b.marks[rows[0]]:
            b.stats.device_marks = b.marks[rows[0]]
            if b.after is not None:
                b.stats.device_after = [b.after[r] for r in rows]
        else:
            if any(marks):
                if not b.copy:
                    to_copy_path(b, slots)
                for r in rows:
                    if b.marks[r]:
                        b.samples[r] = finish_on_cpu(b.samples[r], b.marks[r],
                                                     b.after[r] if b.after is not None else None)
            b.stats.device_cpu = len(rows)
    if b.copy:
        samples = [b.samples[r] for r in rows]
        b.samples = None
        t0 = time.perf_counter()
        with _collate_scope(collate_fn, *key, b.k) if key is not None else contextlib.nullcontext():
            batch = collate_fn(samples[0]) if batch_size is None else \
                (collate_fn or torch.utils.data.default_collate)(samples)
        b.stats.prep_s += time.perf_counter() - t0
        out = ("obj", batch)
    else:
        if len(rows) < b.n:  # skipped samples: close the gaps, keep plan order
            for t in b.targets:
                if type(t) is list:     # a str/bytes leaf's values (views gives the first len(rows))
                    t[: len(rows)] = [t[r] for r in rows]
                else:
                    t[: len(rows)] = t[rows].clone()
        out = ("batch", len(rows))
    if b.payloads is not None and b.stats.device_marks:
        _collate.pack_payloads(b, rows, slots)
    return out


def _make_reader(dataset, cache, peers=None):
    """The fetch stage's reads: ``(read, read_many)``.  Node cache first, then
    the peer that holds the sample (``peers``: a
    :class:`coordl.peers.PeerClient`, admitting what it sends), then
    storage (admitting what it reads).  With the cache on, storage reads go
    through the dataset's ``raw_uncached`` when it has one (local files: the
    pages are dropped from the OS page cache on the read's own descriptor),
    so memory goes to the cache that does not thrash.  ``read_many`` is set
    when the dataset can fetch several samples in one call (``raw_many``,
    e.g. an ImageFolder over an fsspec URL)."""
    raw = dataset.raw
    raw_many = getattr(dataset, "raw_many", None)
    if cache is not None:
        uncached = getattr(dataset, "raw_uncached", None)
        where = getattr(dataset, "describe", None)
        if uncached is not None:
            raw = uncached
        elif where is not None and raw_many is None:
            raw = _dropping_pages(raw, where)
    sizes = getattr(dataset, "sizes", None)
    if not isinstance(sizes, np.ndarray):
        sizes = None

    def cached(i):
        if cache is None:
            return None
        data = cache.get(i)
        # cheap verification: the entry's length must be the file's size
        # (cache_checksum=True adds a CRC32 check inside cache.get)
        if data is not None and (sizes is None or sizes[i] < 0 or len(data) == sizes[i]):
            return data
        return None

    def _keep(i, data) -> None:
        """Admit a storage read; a full cache hands it to a peer with room
        when no node holds it (coordl.peers.client.PeerClient.offer)."""
        if not cache.put(i, data) and peers is not None and getattr(cache, "free_bytes", 1) < len(data):
            peers.offer(i, data)

    def from_peers(indices) -> dict:
        got = peers.fetch(indices)
        for i, data in list(got.items()):
            if sizes is not None and sizes[i] >= 0 and len(data) != sizes[i]:
                del got[i]          # not this dataset's bytes: read it from storage instead
                continue
            if cache is not None:
                cache.note_peer_in(len(data))
                if peers.admit(cache, len(data), sizes):   # never crowding out what no node holds
                    cache.put(i, data)
        return got

    def read(i):
        data = cached(i)
        if data is not None:
            return data, "cache"
        if peers is not None:
            data = from_peers([i]).get(i)
            if data is not None:
                return data, "peer"
        data = raw(i)
        if cache is not None:
            _keep(i, data)
        return data, "storage"

    if raw_many is None and peers is None:
        return read, None

    def read_many(indices):
        out = [None] * len(indices)
        missing = []
        for k, i in enumerate(indices):
            data = cached(i)
            if data is not None:
                out[k] = (data, "cache")
            else:
                missing.append(k)
        if missing and peers is not None:
            got = from_peers([indices[k] for k in missing])
            if got:
                for k in missing:
                    if indices[k] in got:
                        out[k] = (got[indices[k]], "peer")
                missing = [k for k in missing if out[k] is None]
        if missing and raw_many is None:
            for k in missing:
                try:
                    data = raw(indices[k])
                except Exception as e:   # that sample's error, as a read() would raise it
                    out[k] = e
                    continue
                if cache is not None:
                    _keep(indices[k], data)
                out[k] = (data, "storage")
        elif missing:
            got = raw_many([indices[k] for k in missing])
            for k, res in zip(missing, got):
                if isinstance(res, BaseException):
                    out[k] = res
                else:
                    if cache is not None:
                        _keep(indices[k], res)
                    out[k] = (res, "storage")
        return out

    return read, read_many


def _dropping_pages(raw, where):
    """``raw`` for a dataset without ``raw_uncached`` whose ``describe(i)``
    names a local file: drop the file's pages after the read (a second open;
    ``raw_uncached`` does it on the read's own descriptor)."""
    import os

    def read(i):
        data = raw(i)
        try:
            fd = os.open(where(i), os.O_RDONLY)
        except (OSError, TypeError, ValueError):
            return data
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return data

    return read


def pass_steps(num_batches: int, start: int, skip=()) -> list[int]:
    """The batch indices a pass still has to deliver, in plan order."""
    skip = frozenset(skip)
    return [k for k in range(start, num_batches) if k not in skip]
