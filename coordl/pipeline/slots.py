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

import numpy as np

__all__ = ["WorkerSlots", "LocalSlots", "map_slot"]

_GRAIN = 1 << 20


class WorkerSlots:
    """Slots of one worker.  ``announce(slot_id, gen, size, fd)`` sends a new
    slot to the main process (before any batch that uses it)."""

    def __init__(self, announce) -> None:
        self._announce = announce
        self._slots: dict[int, tuple[int, int, mmap.mmap, np.ndarray]] = {}
        self._free: list[int] = []
        self._next_id = 0

    def acquire(self, nbytes: int):
        fits = [s for s in self._free if self._slots[s][1] >= nbytes]
        if fits:
            sid = min(fits, key=lambda s: self._slots[s][1])
            self._free.remove(sid)
            gen, _, _, arr = self._slots[sid]
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


def map_slot(fd: int, size: int) -> mmap.mmap:
    """Map a slot received from a worker (main process side)."""
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
