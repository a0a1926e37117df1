"""``decode="device"`` over a plain image folder: a worker's batch read and
recorded a batch at a time.

With the decoder on the device, what a worker does per sample is small (read
the file, parse the JPEG header, draw the crop and flip), and the engine's
per-sample machinery around it (a fetch thread's hand-off, the sample's
generator context, the dataset's ``prep``, the search for its record, the
row write, then one more copy of the bytes into the batch's blob) cost
several times that.  For a dataset whose every step is known, coordl's own
folder datasets (and torchvision's, recognized; with torchvision.io's
``decode_image`` as the loader, the JPEGs coordl decodes as it does, the
other files going to the per-sample path) with their stock ``prep``
and ``raw``, local files and no ``target_transform``, the engine hands each
batch here instead: the files are read straight into the blob slot (one
``preadv`` each, the GIL released; from slow storage, a batch's reads in
flight at once in read threads), the header is parsed there, the draws
are :meth:`DecodePlan.draw`'s from the sample's own generator
(``RandomResizedCrop``'s and a flip's made for the whole batch by the
``coordl.decode._draws`` extension where its draws are this Python's:
:func:`native_draws`; none made for a plan that draws nothing), and the
records and labels are written into the batch's slot as two arrays.

What reaches the main process is what the per-sample path sends, the same
records, labels, bytes and stats (the tests compare the two).  Any sample
this path does not handle itself (a read that fails or returns another
size than the table's, a file that is not a JPEG the device decoder takes,
a header whose draws raise) is prepared by the per-sample path
(:func:`coordl.pipeline.prep.prep_sample` over the engine's own reader), so
its errors, ``on_error`` handling and CPU fallback are exactly those.
With the node cache, a hit is copied from the cache and a read from
storage is admitted to it (its pages dropped, as ``raw_uncached`` does);
with peers the per-sample path runs.  Nothing here holds device state.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from ..device.encoded import (BLANK_TAIL, FLIP, H2, INDEX, MODE, ON_DEVICE, RECORD, RH, SRC_W, T1, VFLIP, W1,
                              DecodePrep, EncodedCompose, _lazy, tail_fields)

__all__ = ["BatchReads", "batch_reads_for", "native_draws"]

# False: every batch takes the per-sample path (the tests compare the two)
ENABLED = True

_O_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)
# A read slower than this (wall seconds, a batch's mean) is not served from memory (the page
# cache or the node cache: 20-40 us for 110 KB): the next batch's reads go to threads, up to the
# loader's fetch_threads, as the per-sample path's fetch threads would keep them in flight; a
# batch read through threads whose reads each took under half of it goes back to the prep thread.
SLOW_READ_S = 300e-6
_SPARE = bytearray(1)     # where a read past the table's size lands (its content is never looked at)


class _Fallback(Exception):
    """This sample takes the per-sample path."""


_CHECKED: dict = {}    # the draws' parameters -> whether the extension's draws are this Python's


def native_draws(plan):
    """``f(indices, heights, widths, seed, epoch) -> int64 (n, 7)`` array of
    (top, left, h, w, flip, torch's and Python's seeds for the as-written
    steps after them: ``coordl._rng.global_seeds``): ``plan``'s draws made by the extension
    ``coordl.decode._draws``, for a plan of ``RandomResizedCrop`` and
    optionally a ``RandomHorizontalFlip`` after it; None for other plans,
    where the extension is not built, or where its draws differ from what
    ``plan.draw`` makes on this Python (checked once per process and
    parameters, on sizes and keys chosen to reach every branch)."""
    import logging
    import math

    from .. import transforms as T
    from ..decode.extensions import load

    steps = plan.steps
    kinds = [type(t) for t in steps]
    if len(plan.modes) > 1 or plan.numpy_draws:    # a mode drawn after the box, numpy's seed: not the extension's
        return None
    if kinds == [T.RandomResizedCrop]:
        flip_p = -1.0
    elif kinds == [T.RandomResizedCrop, T.RandomHorizontalFlip]:
        flip_p = float(steps[1].p)
        if not 0 <= flip_p <= 1:
            return None
    else:
        return None
    mod = load("_draws", logging.getLogger(__name__), "the draws are made in Python")
    if mod is None:
        return None
    rrc = steps[0]
    scale, ratio = rrc.scale, rrc.ratio
    if min(ratio) <= 0:
        return None
    args = (float(min(scale)), float(max(scale)), math.log(min(ratio)), math.log(max(ratio)),
            float(min(ratio)), float(max(ratio)), flip_p)

    def draws(indices, heights, widths, seed, epoch):
        n = len(indices)
        out, seeds = np.empty((n, 5), dtype=np.int64), np.empty((n, 2), dtype=np.int64)
        mod.rrc(np.ascontiguousarray(indices, dtype=np.int64), np.ascontiguousarray(heights, dtype=np.int64),
                np.ascontiguousarray(widths, dtype=np.int64), seed & _MASK64, epoch & _MASK64, *args, out, seeds)
        return np.concatenate([out, seeds], axis=1)

    key = (tuple(scale), tuple(ratio), flip_p, rrc.size)
    ok = _CHECKED.get(key)
    if ok is None:
        try:
            ok = _agrees(plan, draws)
        except ValueError:      # an extension built from another version of its source
            ok = False
        _CHECKED[key] = ok
        if not ok:
            logging.getLogger(__name__).debug("coordl.decode._draws differs from Python's draws for %r: "
                                              "the draws are made in Python", plan)
    return draws if ok else None


_MASK64 = (1 << 64) - 1


def _agrees(plan, draws) -> bool:
    """The extension's draws are ``plan.draw``'s on this Python: sizes that
    take the first attempt, many attempts, the fallback of either ratio
    bound, a 1-pixel side; keys of one to six 32-bit words."""
    from .. import _rng

    sizes = [(375, 500), (500, 375), (1, 1), (1, 1000), (1000, 1), (3, 2), (224, 224), (3000, 4000), (17, 401)]
    keys = [(0, 0, 0), (1, 0, 5), (7, 3, 2 ** 31 + 7), (2 ** 40 + 5, 11, 2 ** 63 - 1), (2 ** 64 - 1, 2 ** 64 - 1, 9)]
    for seed, epoch, index in keys:
        idx = [index + k for k in range(len(sizes))] if index < 2 ** 62 else [index - k for k in range(len(sizes))]
        got = draws(idx, [h for h, _ in sizes], [w for _, w in sizes], seed, epoch)
        for (h, w), i, row in zip(sizes, idx, got.tolist()):
            g = _rng.derive(seed, epoch, i)
            want = plan.draw(h, w, g)
            if row != [*want[:4], want[FLIP - T1], *_rng.global_seeds(g)]:
                return False
    return True


def _draws_anything(plan) -> bool:
    """``plan.draw`` takes something from the generator (a random step)."""
    from .. import transforms as T

    return plan.draws_after or any(type(t) in (T.RandomResizedCrop, T.RandomCrop, T.RandomHorizontalFlip,
                                               T.RandomVerticalFlip)
                                     for t in plan.steps)


def batch_reads_for(dataset, *, cache, peers, in_place: bool, batch_size) -> "BatchReads | None":
    """A :class:`BatchReads` for the engine of ``dataset``, or None where
    the per-sample path must run (see the module docstring)."""
    if not ENABLED or peers is not None or not in_place or batch_size is None or type(dataset) is not DecodePrep \
            or not hasattr(os, "preadv"):
        return None
    from ..datasets import _FolderBase
    from ..decode.loaders import pil_decode
    from ..decode.tvio import TorchvisionDecode
    from ..storage.table import SampleTable

    ds = dataset._split_ds
    if dataset.plan.noise:
        return None     # the erasing's noise travels after each payload: the per-sample path packs it
    if not isinstance(ds, _FolderBase) or type(ds.transform) is not EncodedCompose:
        return None
    cls = type(ds)
    stock = [(_FolderBase, n) for n in ("__getitem__", "prep", "raw", "raw_uncached", "_prep", "_raw", "_read",
                                        "_raw_uncached", "_finish", "_fused_image")]
    stock += [(SampleTable, n) for n in ("_path", "_check_index", "sizes")]
    if any(getattr(cls, n) is not getattr(base, n) or n in vars(ds) for base, n in stock):
        return None     # a subclass's, or an instance's own, method
    if ds._store is not None or ds.target_transform is not None or not ds._two_stage_ok():
        return None
    if ds._decode is not pil_decode and not (type(ds._decode) is TorchvisionDecode and ds._decode.fused_decode()
                                             and getattr(ds, "_tensor_image", None) is not None):
        return None     # (torchvision's folder with torchvision.io's loader: its other files take the per-sample path)
    sizes, targets = ds.sizes, getattr(ds, "_targets", None)
    if not isinstance(sizes, np.ndarray) or not isinstance(targets, np.ndarray) or targets.dtype.kind not in "iu":
        return None
    return BatchReads(dataset, ds, cache)


def _place(extra: dict, rows: list, blob: np.ndarray, starts, sizes, total: int, limit: int):
    """The per-sample path's payloads (``extra``: row -> bytes or a uint8
    image) written one after the other from ``total`` up to ``limit`` in
    ``blob``, the other rows' bytes left where they were read: (int64
    [(offset, length)] in ``rows``' order, the end), or None when they do
    not fit (the caller packs the batch again)."""
    offsets = np.empty((len(rows), 2), dtype=np.int64)
    o = total
    for r, j in enumerate(rows):
        p = extra.get(j)
        if p is None:
            offsets[r] = (starts[j], sizes[j])
            continue
        v = np.frombuffer(p.numpy() if isinstance(p, torch.Tensor) else p, dtype=np.uint8)
        if o + v.size > limit:
            return None
        blob[o:o + v.size] = v
        offsets[r] = (o, v.size)
        o += v.size
    return offsets, o


def _settle(futures) -> None:
    """Cancel the reads not started, wait for those running."""
    if futures:
        from concurrent.futures import wait

        for f in futures:
            f.cancel()
        wait(futures)


class BatchReads:
    """Builds an engine's batches of a :class:`DecodePrep` over a plain
    folder (:func:`batch_reads_for`), one call per batch."""

    def __init__(self, prep: DecodePrep, ds, cache) -> None:
        self.prep = prep
        self.ds = ds
        self.plan = prep.plan
        self.cache = cache
        self.sizes = ds.sizes
        self.targets = ds._targets
        self._layouts: dict = {}
        self._draws = native_draws(self.plan)
        # Resize, CenterCrop: no draw, so no generator to make; the geometry depends on the size alone
        self._fixed = None if _draws_anything(self.plan) else {}
        self._pool = None             # reads of slow storage: a ThreadPoolExecutor (close())
        self._slow = False            # the last batch's reads were slow: read this one through the pool
        # a loader of torchvision.io's: only the JPEGs coordl decodes as it does go to the device from here
        self._fusable = getattr(ds._decode, "fusable", None)

    def close(self) -> None:
        """Let the read threads go (the pass ended); a later batch starts them again where needed."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _timed_read(self, i: int, dest: np.ndarray, size: int):
        """(source or the _Fallback, wall seconds) of :meth:`_read_into` (in the prep thread or a read thread)."""
        t0 = time.perf_counter()
        try:
            source = self._read_into(i, dest, size)
        except _Fallback as e:
            source = e
        return source, time.perf_counter() - t0

    def _reads(self, eng, indices: list, blob: np.ndarray, starts: list, sizes) -> list | None:
        """For slow storage, every read of the batch in flight at once, in
        threads: a future per row; None where the prep thread reads."""
        if not self._slow or eng.fetch_threads <= 1:
            return None
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(eng.fetch_threads, thread_name_prefix=f"coordl-fetch-w{eng.worker_id}")
        read = self._timed_read
        return [self._pool.submit(read, i, blob[o:o + int(n)], int(n)) for i, o, n in zip(indices, starts, sizes)]

    def _layout(self, n: int):
        from . import collate as _collate

        lay = self._layouts.get(n)
        if lay is None:   # what the per-sample path derives from its first (record, label) sample
            lay = self._layouts[n] = _collate.layout_of((torch.zeros(RECORD, dtype=torch.int64), 0), n)
        return lay

    def _read_into(self, i: int, dest: np.ndarray, size: int) -> str:
        """Sample ``i``'s bytes into ``dest`` (``size`` of them, the table's
        size): its source, or :class:`_Fallback`."""
        cache = self.cache
        if cache is not None and cache.get_into(i, dest):    # a hit: one copy, cache to slot
            return "cache"
        try:
            fd = os.open(self.ds._path(i), _O_FLAGS)
        except OSError:
            raise _Fallback from None
        try:
            # one byte more than the table's size: a file of another size reads another count
            if os.preadv(fd, [dest, _SPARE], 0) != size:
                raise _Fallback
            if cache is not None:
                if _DONTNEED is not None:
                    os.posix_fadvise(fd, 0, 0, _DONTNEED)
                cache.put(i, dest)
        except OSError:
            raise _Fallback from None
        finally:
            os.close(fd)
        return "storage"

    def build(self, eng, b) -> None:
        """Read and record batch ``b`` (an engine ``_Builder``, no row done
        yet), then emit it as the engine's finish would."""
        n, indices, slots = b.n, b.indices, eng.slots
        sizes = self.sizes[indices]
        if (sizes < 0).any():
            sizes = np.maximum(sizes, 0)
        ends = np.cumsum(sizes)
        total = int(ends[-1]) if n else 0
        starts = (ends - sizes).tolist()
        # room after the files' bytes for the images the workers' share prepares on the CPU path, so
        # that they land beside the bytes instead of the whole batch being packed again
        plan = self.plan
        share = sum(1 for i in indices if plan.on_cpu(i)) if plan.cpu_share else 0
        room = share * 3 * plan.size[0] * plan.size[1]
        slot, buf = slots.acquire(self._layout(n).nbytes)
        blob_slot, blob = slots.acquire(max(total + room, 1))
        futures = self._reads(eng, indices, blob, starts, sizes)
        try:
            self._rows(eng, b, slot, buf, blob_slot, blob, starts, sizes, total, futures, room)
        except BaseException:
            _settle(futures)
            raise

    def _rows(self, eng, b, slot, buf, blob_slot, blob, starts, sizes, total, futures, room=0) -> None:
        """:meth:`build`'s rows: each read (or its future's result), parsed
        and drawn, or prepared by the per-sample path; then the batch out.
        ``room``: bytes after the files' ``total`` in ``blob`` for the
        per-sample path's payloads."""
        from ..errors import SampleError
        from . import collate as _collate
        from .prep import SKIP, prep_sample

        derive = _lazy()[0].derive
        draw, draw_after, device_size = self.plan.draw, self.plan.draw_after, self.plan.device_size
        fusable, header = self._fusable, _lazy()[1]._header
        seed, epoch = eng.seed, eng.epoch
        n, indices, st, slots = b.n, b.indices, b.stats, eng.slots
        again = b.again or [0] * n      # per row, how many times its index came before in the pass
        clock = time.perf_counter
        layout = self._layout(n)
        rec_t, lab_t = _collate.views(layout, buf)
        rec, lab = rec_t.numpy(), lab_t.numpy()
        ok = [False] * n
        extra: dict = {}          # row -> a payload outside the blob (the per-sample path's)
        native = self._draws
        fixed = self._fixed       # a plan that draws nothing: geometry by image size
        later: list = []          # rows whose draws the extension makes, after the loop
        read_s = 0.0              # the reads' own wall time
        for j, i in enumerate(indices):
            eng.at = ("preparing", b.k, i)
            size, o = int(sizes[j]), starts[j]
            raw = blob[o:o + size]
            data = err = None
            t0 = clock()
            source, seconds = self._timed_read(i, raw, size) if futures is None else futures[j].result()
            read_s += seconds
            if type(source) is _Fallback:   # the per-sample path reads it: the engine's reader, its errors
                try:
                    data, source = eng._read(i)
                except Exception as e:  # noqa: BLE001 - the read's failure, as the per-sample path has it
                    err = e
            t1 = clock()
            st.fetch_s += t1 - t0
            if err is None:
                st.record_read(source, size if data is None else len(data))
            if data is None and err is None:
                try:
                    # None: the CPU path, below, as a fallback (also for a file coordl leaves to torchvision.io;
                    # the header read once for both questions)
                    if fusable is None:
                        size = device_size(raw, i)
                    else:
                        hdr = header(raw)
                        size = device_size(raw, i, hdr) if fusable(raw, hdr) else None
                    if size is not None:
                        h, w = size
                        if fixed is not None:      # nothing random: the geometry is the size's
                            geo = fixed.get((h, w))
                            if geo is None:
                                if len(fixed) >= 4096:    # a few thousand sizes at most are kept
                                    fixed.clear()
                                geo = fixed[(h, w)] = [ON_DEVICE, h, w, *draw(h, w, None)]
                            rec[j, :INDEX] = geo
                            rec[j, INDEX:] = BLANK_TAIL
                            rec[j, INDEX] = i
                        elif native is None or again[j]:     # the extension draws a first time's only
                            g = derive(seed, epoch, i, again[j])
                            rec[j, :INDEX] = [ON_DEVICE, h, w, *draw(h, w, g)]
                            rec[j, INDEX:] = tail_fields(i, *draw_after(g)[:2])
                        else:
                            rec[j, :SRC_W + 1] = (ON_DEVICE, h, w)
                            rec[j, INDEX:] = BLANK_TAIL
                            rec[j, INDEX] = i
                            later.append(j)
                        lab[j] = self.targets[i]
                        st.prep_s += clock() - t1
                        st.samples += 1
                        ok[j] = True
                        continue
                except Exception:  # noqa: BLE001 - the per-sample path raises or handles it as it would
                    pass
                data = raw.tobytes()
            # the per-sample path: the dataset's prep (the CPU decode, its errors, on_error)
            try:
                sample = prep_sample(self.prep, seed, epoch, i, data, err, st, eng.on_error, again[j])
            except SampleError as e:
                _settle(futures)    # no read thread writes into the slot once it is given back
                slots.release(slot)
                slots.release(blob_slot)
                b.failed = True
                eng.sample_failed(b.k, e)
                return
            if sample is SKIP:
                continue
            paths, _ = self.prep.take_device_marks()
            payloads = self.prep.take_device_payloads()
            if paths != ((0,),) or type(sample) is not tuple or len(sample) != 2:
                raise RuntimeError(f"decode='device': sample {i} of a plain image folder was not (record, label)")
            rec[j] = sample[0].numpy()
            lab[j] = sample[1]
            extra[j] = payloads[0]
            ok[j] = True
        eng.at = ("collating", b.k, None)
        mean = read_s / n
        self._slow = mean > SLOW_READ_S if futures is None else mean > SLOW_READ_S / 2
        if later:                 # RandomResizedCrop [+ flip]: box1, the resize, box2 = the whole resized image
            got = native(rec[later, INDEX], rec[later, 1], rec[later, SRC_W], seed, epoch)
            rh, rw = self.plan.size
            rec[later, T1:W1 + 1] = got[:, :4]
            rec[later, RH:H2] = (rh, rw, 0, 0)
            rec[later, H2:FLIP] = (rh, rw)
            rec[later, FLIP] = got[:, 4]
            rec[later, MODE:VFLIP + 1] = 0     # one mode; no vertical flip (native draws' plans)
            if self.plan.draws_after:   # ColorJitter's and RandomErasing's draws, from the seeds the extension
                for j, (ops, rects, _) in zip(later, self.plan.after_for_seeds(got[:, 5:7].tolist())):   # drew
                    rec[j, INDEX:] = tail_fields(int(rec[j, INDEX]), ops, rects)
        rows = [j for j in range(n) if ok[j]]
        if not rows:
            slots.release(slot)
            slots.release(blob_slot)
            eng.emit("empty", b.k, st)
            return
        if len(rows) < n:      # skipped samples: close the gaps, keep plan order
            rec[:len(rows)] = rec[rows].copy()
            lab[:len(rows)] = lab[rows].copy()
        placed = _place(extra, rows, blob, starts, sizes, total, total + room) if extra else None
        if placed is not None:  # the per-sample path's payloads in the room after the files' bytes
            offsets, end = placed
            st.decoded_cpu += sum(isinstance(extra[j], torch.Tensor) for j in rows if j in extra)
            st.device_blob = (blob_slot, end, offsets)
        elif extra:             # no room for them: the blob's bytes and the payloads packed again, as that path packs
            b.payloads = [None] * n
            for j in rows:
                b.payloads[j] = [extra[j] if j in extra else blob[starts[j]:starts[j] + int(sizes[j])]]
            _collate.pack_payloads(b, rows, slots)
            slots.release(blob_slot)
        else:
            offsets = np.empty((len(rows), 2), dtype=np.int64)
            offsets[:, 0] = [starts[j] for j in rows]
            offsets[:, 1] = sizes[rows]
            st.device_blob = (blob_slot, total, offsets)
        st.device_marks = ((0,),)
        eng.emit("batch", b.k, slot, layout, len(rows), st)
