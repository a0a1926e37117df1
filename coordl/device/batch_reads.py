"""``decode="device"`` over a plain image folder: a worker's batch read and
recorded a batch at a time.

With the decoder on the device, what a worker does per sample is small (read
the file, parse the JPEG header, draw the crop and flip), and the engine's
per-sample machinery around it (a fetch thread's hand-off, the sample's
generator context, the dataset's ``prep``, the search for its record, the
row write, then one more copy of the bytes into the batch's blob) cost
several times that.  For a dataset whose every step is known, coordl's own
folder datasets (and torchvision's, recognized) with their stock ``prep``
and ``raw``, local files and no ``target_transform``, the engine hands each
batch here instead: the files are read straight into the blob slot (one
``preadv`` each, the GIL released), the header is parsed there, the draws
are :meth:`DecodePlan.draw`'s from the sample's own generator, and the
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

from .encoded import CHANNELS, ON_DEVICE, RECORD, DecodePrep, EncodedCompose, _lazy

__all__ = ["BatchReads", "batch_reads_for"]

# False: every batch takes the per-sample path (the tests compare the two)
ENABLED = True

_O_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)


class _Fallback(Exception):
    """This sample takes the per-sample path."""


def batch_reads_for(dataset, *, cache, peers, in_place: bool, batch_size) -> "BatchReads | None":
    """A :class:`BatchReads` for the engine of ``dataset``, or None where
    the per-sample path must run (see the module docstring)."""
    if not ENABLED or peers is not None or not in_place or batch_size is None or type(dataset) is not DecodePrep \
            or not hasattr(os, "preadv"):
        return None
    from ..datasets import _FolderBase
    from ..decode.loaders import pil_decode
    from ..storage.table import SampleTable

    ds = dataset._split_ds
    if not isinstance(ds, _FolderBase) or type(ds.transform) is not EncodedCompose:
        return None
    cls = type(ds)
    stock = [(_FolderBase, n) for n in ("__getitem__", "prep", "raw", "raw_uncached", "_prep", "_raw", "_read",
                                        "_raw_uncached", "_finish")]
    stock += [(SampleTable, n) for n in ("_path", "_check_index", "sizes")]
    if any(getattr(cls, n) is not getattr(base, n) for base, n in stock):
        return None
    if ds._store is not None or ds._decode is not pil_decode or ds.target_transform is not None \
            or not ds._two_stage_ok():
        return None
    sizes, targets = ds.sizes, getattr(ds, "_targets", None)
    if not isinstance(sizes, np.ndarray) or not isinstance(targets, np.ndarray) or targets.dtype.kind not in "iu":
        return None
    return BatchReads(dataset, ds, cache)


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
        # a node cache copies a hit straight into the slot; another cache (a test's) through get
        self._into = getattr(cache, "get_into", None) or self._get_into

    def _get_into(self, i: int, dest: np.ndarray) -> bool:
        data = self.cache.get(i)
        if data is None or len(data) != dest.size:
            return False
        dest[:] = np.frombuffer(data, dtype=np.uint8)
        return True

    def _layout(self, n: int):
        from ..pipeline import collate as _collate

        lay = self._layouts.get(n)
        if lay is None:   # what the per-sample path derives from its first (record, label) sample
            lay = self._layouts[n] = _collate.layout_of((torch.zeros(RECORD, dtype=torch.int64), 0), n)
        return lay

    def _read_into(self, i: int, dest: np.ndarray, size: int) -> str:
        """Sample ``i``'s bytes into ``dest`` (``size`` of them, the table's
        size): its source, or :class:`_Fallback`."""
        cache = self.cache
        if cache is not None and self._into(i, dest):
            return "cache"
        try:
            fd = os.open(self.ds._path(i), _O_FLAGS)
        except OSError:
            raise _Fallback from None
        try:
            if os.fstat(fd).st_size != size or os.preadv(fd, [dest], 0) != size:
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
        from ..errors import Failure, SampleError
        from ..pipeline.prep import SKIP, prep_sample
        from ..pipeline import collate as _collate
        import traceback

        _rng, jpeg, _ = _lazy()
        header, eoi, fast, check_pixels, derive = jpeg._header, jpeg._ends_with_eoi, jpeg._FAST_COLORSPACES, \
            jpeg.check_pixels, _rng.derive
        draw = self.plan.draw
        seed, epoch = eng.seed, eng.epoch
        n, indices, st, slots = b.n, b.indices, b.stats, eng.slots
        clock = time.perf_counter
        sizes = self.sizes[indices]
        if (sizes < 0).any():
            sizes = np.maximum(sizes, 0)
        ends = np.cumsum(sizes)
        total = int(ends[-1]) if n else 0
        starts = (ends - sizes).tolist()
        layout = self._layout(n)
        slot, buf = slots.acquire(layout.nbytes)
        blob_slot, blob = slots.acquire(max(total, 1))
        rec_t, lab_t = _collate.views(layout, buf)
        rec, lab = rec_t.numpy(), lab_t.numpy()
        ok = [False] * n
        extra: dict = {}          # row -> a payload outside the blob (the per-sample path's)
        for j, i in enumerate(indices):
            eng.at = ("preparing", b.k, i)
            size, o = int(sizes[j]), starts[j]
            raw = blob[o:o + size]
            data = err = None
            t0 = clock()
            try:
                source = self._read_into(i, raw, size)
            except _Fallback:      # the per-sample path reads it: the engine's reader, its errors
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
                    hdr = header(raw)
                    if hdr is not None and hdr[2] in fast and eoi(raw):
                        h, w = int(hdr[0]), int(hdr[1])
                        check_pixels((h, w))
                        rec[j, :CHANNELS - 1] = [ON_DEVICE, h, w, *draw(h, w, derive(seed, epoch, i))]
                        rec[j, CHANNELS - 1:] = (i, 3)
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
                sample = prep_sample(self.prep, seed, epoch, i, data, err, st, eng.on_error)
            except SampleError as e:
                slots.release(slot)
                slots.release(blob_slot)
                b.failed = True
                eng.emit("error", b.k, Failure(f"Caught {type(e).__name__} in DataLoader worker process "
                                               f"{eng.worker_id}.\nOriginal {traceback.format_exc()}",
                                               type(e.__cause__) if e.__cause__ is not None else None, e))
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
        rows = [j for j in range(n) if ok[j]]
        if not rows:
            slots.release(slot)
            slots.release(blob_slot)
            eng.emit("empty", b.k, st)
            return
        if len(rows) < n:      # skipped samples: close the gaps, keep plan order
            rec[:len(rows)] = rec[rows].copy()
            lab[:len(rows)] = lab[rows].copy()
        offsets = np.empty((len(rows), 2), dtype=np.int64)
        if extra:              # repack: the blob and the per-sample path's payloads, one after the other
            views = [np.frombuffer(extra[j].numpy() if isinstance(extra[j], torch.Tensor) else extra[j],
                                   dtype=np.uint8) if j in extra else blob[starts[j]:starts[j] + int(sizes[j])]
                     for j in rows]
            total = sum(v.size for v in views)
            new_slot, new = slots.acquire(max(total, 1))
            o = 0
            for r, v in enumerate(views):
                new[o:o + v.size] = v
                offsets[r] = (o, v.size)
                o += v.size
            slots.release(blob_slot)
            blob_slot = new_slot
            st.decoded_cpu += sum(isinstance(extra[j], torch.Tensor) for j in extra if ok[j])
        else:
            offsets[:, 0] = [starts[j] for j in rows]
            offsets[:, 1] = sizes[rows]
        st.device_marks = ((0,),)
        st.device_blob = (blob_slot, total, offsets)
        eng.emit("batch", b.k, slot, layout, len(rows), st)
