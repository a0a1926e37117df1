"""Batch slots: reusable shared-memory buffers that batches are prepared into.

A worker owns its slots.  Each is an anonymous ``memfd`` (never a name in
/dev/shm, so nothing outlives a SIGKILL) mapped in the worker and, after its
descriptor is passed over the worker's result socket, in the main process.
A slot travels worker -> main as a small message; the consumer gets tensors
that view it (``torch.from_numpy`` over a per-batch numpy owner), and a
``weakref.finalize`` on that owner tells the worker the slot is free once the
last tensor of the batch is gone.  A batch is therefore never overwritten
while anything still references it, by construction; a consumer that keeps
many batches makes the worker allocate more slots, as torch would allocate
more batches.

A child forked from the main process while a batch lives maps the same
memfd and may keep the batch after main drops it.  Such a slot is
*retired* instead of freed (``WorkerPool._forked_now``): the worker unmaps
it and never writes it again, and allocates a fresh slot when it needs
one; the kernel keeps the memfd's pages for as long as the child maps them
and frees them when it exits.
"""
from __future__ import annotations

import mmap
import os
import weakref

import numpy as np

from ..base import forks as _forks

__all__ = ["WorkerSlots", "LocalSlots", "SlotStash", "map_slot"]

_GRAIN = 1 << 20


class WorkerSlots:
    """Slots of one worker.  ``announce(slot_id, gen, size, fd)`` sends a new
    slot to the main process (before any batch that uses it).  ``spares``:
    slots of an earlier pool's workers that main kept (:class:`SlotStash`),
    mapped here through the fork; one taken is announced with
    ``announce_spare(slot_id, gen, index in spares)``."""

    def __init__(self, announce, spares=(), announce_spare=None) -> None:
        self._announce = announce
        self._slots: dict[int, tuple[int, int, mmap.mmap, np.ndarray]] = {}
        self._free: list[int] = []
        self._next_id = 0
        self._spares = list(enumerate(spares)) if announce_spare is not None else []
        self._announce_spare = announce_spare

    def acquire(self, nbytes: int):
        fits = [s for s in self._free if self._slots[s][1] >= nbytes]
        if fits:
            sid = min(fits, key=lambda s: self._slots[s][1])
            self._free.remove(sid)
            gen, _, _, arr = self._slots[sid]
            return (sid, gen), arr
        spare = min((x for x in self._spares if nbytes <= len(x[1]) <= 2 * nbytes + _GRAIN),
                    key=lambda x: len(x[1]), default=None)
        if spare is not None:   # pages allocated already: mapped here in one call, not faulted in
            self._spares.remove(spare)
            i, mm = spare
            sid, gen = self._next_id, 0
            self._next_id += 1
            _populate(mm)
            self._announce_spare(sid, gen, i)
            arr = np.frombuffer(mm, dtype=np.uint8)
            self._slots[sid] = (gen, len(mm), mm, arr)
            return (sid, gen), arr
        if self._free:  # grow a free slot that is too small
            sid = self._free.pop()
            gen = self._slots[sid][0] + 1
            self._slots.pop(sid)[2].close()
        else:
            sid, gen = self._next_id, 0
            self._next_id += 1
        size = (nbytes + nbytes // 8 + _GRAIN - 1) // _GRAIN * _GRAIN
        fd = os.memfd_create(f"coordl-slot-{os.getpid()}-{sid}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
            self._announce(sid, gen, size, fd)
        finally:
            os.close(fd)
        arr = np.frombuffer(mm, dtype=np.uint8)
        self._slots[sid] = (gen, size, mm, arr)
        return (sid, gen), arr

    def release(self, slot) -> None:
        sid, gen = slot
        cur = self._slots.get(sid)
        if cur is not None and cur[0] == gen and sid not in self._free:
            self._free.append(sid)

    def retire(self, slot) -> None:
        """Drop a slot for good (a forked child of main may still view it)."""
        sid, gen = slot
        cur = self._slots.get(sid)
        if cur is not None and cur[0] == gen:
            if sid in self._free:
                self._free.remove(sid)
            del self._slots[sid]
            mm = cur[2]
            del cur
            try:
                mm.close()
            except BufferError:
                pass  # still viewed here (it cannot be written again: no id names it); unmapped with the view

    @property
    def count(self) -> int:
        return len(self._slots)

    @property
    def nbytes(self) -> int:
        return sum(s[1] for s in self._slots.values())


class LocalSlots:
    """In-process placement: a fresh buffer per batch (nothing to recycle)."""

    def acquire(self, nbytes: int):
        buf = np.empty(nbytes, dtype=np.uint8)
        return buf, buf

    def release(self, slot) -> None:
        pass


# madvise(MADV_POPULATE_WRITE), Linux 5.14: every page of a mapping mapped writable in one call
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _populate(mm: mmap.mmap) -> None:
    """Map a kept slot's pages (present in its memfd already) at once, not
    one page fault each as a batch is written; where the kernel lacks it
    (EINVAL), they fault in as written."""
    try:
        mm.madvise(_POPULATE_WRITE)
    except (OSError, ValueError, AttributeError):
        pass


class SlotStash:
    """Slots a loader keeps between the pools of its passes (workers not
    persistent: a pool per pass).  A new slot's pages are allocated and
    cleared by the kernel one page fault at a time as its first batch is
    written (~4,700 for a batch of 32 float images), in every worker of
    every pass; a kept slot's pages stay in its memfd, and a worker forked
    for the next pass maps them through the fork (:class:`WorkerSlots`).

    A slot goes in once its pool's workers have exited and no child was
    forked while a batch viewed it (``WorkerPool.shutdown``), with the
    finalizer of the batch that may still view it; it is handed out only
    once that batch is gone, and dropped for good if this process forks
    while it lives (the child may keep the batch).  It holds at most what
    the last pool used, or what it was given and left untouched if that is
    more; the rest, and everything when the loader goes, is unmapped (the
    kernel frees the pages).  Main process; under
    ``base.forks.lock``, which the fork hook holds."""

    def __init__(self) -> None:
        self._kept: list = []   # (mmap, finalizer of the batch that viewed it last, or None)
        with _forks.lock:
            _stashes.add(self)

    def take(self, parts: int) -> list[list]:
        """The slots no batch views any more, dealt to ``parts`` workers (largest first, in turn)."""
        with _forks.lock:
            free = [mm for mm, f in self._kept if f is None or not f.alive]
            self._kept = [(mm, f) for mm, f in self._kept if f is not None and f.alive]
        free.sort(key=len, reverse=True)
        return [free[i::parts] for i in range(parts)]

    def put(self, entries: list, cap: int) -> None:
        """Keep ``entries`` ((mmap, finalizer or None)) with what is kept,
        those no batch views first, up to ``cap`` bytes."""
        with _forks.lock:
            every = sorted(self._kept + list(entries), key=lambda e: (e[1] is not None and e[1].alive, -len(e[0])))
            self._kept, total = [], 0
            for mm, f in every:
                if total + len(mm) <= cap:
                    self._kept.append((mm, f))
                    total += len(mm)

    def _forked_now(self) -> None:
        self._kept = [(mm, f) for mm, f in self._kept if f is None or not f.alive]


_stashes: weakref.WeakSet = weakref.WeakSet()


def _forking() -> None:
    for st in list(_stashes):
        st._forked_now()


_forks.on_fork(_forking)


def map_slot(fd: int, size: int) -> mmap.mmap:
    """Map a slot received from a worker (main process side)."""
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
