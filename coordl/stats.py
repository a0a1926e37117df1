"""Loader statistics: mutable counters inside, frozen records outside.

``DataLoader.stats()`` returns a :class:`LoaderStats`; fields are documented
on the class; docs/guide/quickstart.md shows them in use.  Counters that come from worker processes
travel back with each batch (a :class:`BatchStats` in its ``Envelope``) and are added in
the main process, so the record never needs a lock or shared memory.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["LoaderStats", "EpochStats", "BatchStats"]


class BatchStats:
    """What producing one batch cost and where its raw bytes came from.

    The one counter record of the pipeline: filled by whichever stage made
    the batch (coordl's engine in a worker or inline, or torch's workers
    through ``TwoStageFetch``), carried back with the batch in its
    ``Envelope``, and added into the loader's :class:`Counters` in the main
    process, so statistics need no shared state.  Small and picklable.
    """

    __slots__ = ("samples", "bytes_storage", "from_cache", "bytes_cache", "fetch_s", "prep_s", "skips",
                 "shared", "from_peers", "bytes_peers", "device_marks", "device_cpu", "decoded_device",
                 "decoded_cpu", "device_blob", "zero_copy", "device_pending", "decode_s", "geometry_s",
                 "device_prepared", "device_after", "layout", "device_samples")

    def __init__(self) -> None:
        self.samples = 0            # samples prepared into the batch
        self.bytes_storage = 0      # raw bytes read from storage
        self.from_cache = 0         # samples whose raw bytes came from the node cache
        self.bytes_cache = 0
        self.fetch_s = 0.0          # busy time reading
        self.prep_s = 0.0           # busy time preparing and collating
        self.skips: list = []       # (index, path, why) of samples skipped under on_error="skip"
        self.shared = 0             # of ``samples``, how many the node daemon prepared (share=True)
        self.from_peers = 0         # samples whose raw bytes came from another node's cache
        self.bytes_peers = 0
        self.device_marks = ()      # paths of the uint8 images the device tail converts (coordl.device)
        self.device_after = None    # ... per row, per path: (jitter operations, erasing rectangles) for the tail
        self.device_cpu = 0         # samples of a device-split pass whose images were converted on the CPU
        self.decoded_device = 0     # decode="device": images decoded on the device
        self.decoded_cpu = 0        # ... decoded on the CPU (a worker's CPU path, or the main process's fallback)
        self.device_blob = None     # ... (slot, total bytes, offsets) of the bytes the device decodes (not summed)
        self.zero_copy = 0          # 1: the batch is a view of the node daemon's staging (share=True), no copy
        self.device_pending = None  # decode="device": the decoded images awaiting their geometry (main process only)
        self.device_prepared = None     # ... the batch's streams and CPU rows ready for the decoder (main process only)
        self.decode_s = 0.0         # decode="device": wall time in the device decoder's calls (main process)
        self.geometry_s = 0.0       # ... in the crops, resizes and conversion after them (main process)
        self.layout = None          # the batch's collate.Layout, when it was collated in place (main process only)
        self.device_samples = None  # decode="device" with a collate_fn: the samples it gets (main process only)

    def record_read(self, source: str, nbytes: int) -> None:
        if source == "cache":
            self.from_cache += 1
            self.bytes_cache += nbytes
        elif source == "peer":
            self.from_peers += 1
            self.bytes_peers += nbytes
        else:
            self.bytes_storage += nbytes

    def add(self, other: "BatchStats") -> None:
        """Count ``other``'s samples, reads and time in this record too."""
        for k in ("samples", "bytes_storage", "from_cache", "bytes_cache", "fetch_s", "prep_s", "shared",
                  "from_peers", "bytes_peers", "device_cpu", "decoded_device", "decoded_cpu", "decode_s",
                  "geometry_s"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.skips += other.skips

    def __getstate__(self):
        # (device_pending, device_prepared and device_samples hold the main process's tensors: never sent)
        return tuple(None if k in _NOT_SENT else getattr(self, k) for k in self.__slots__)

    def __setstate__(self, st) -> None:
        self.__init__()             # fields a sender of another version did not have keep their defaults
        for k, v in zip(self.__slots__, st):
            setattr(self, k, v)


_NOT_SENT = frozenset(("device_pending", "device_prepared", "layout", "device_samples"))


@dataclass(frozen=True)
class EpochStats:
    """What one epoch read, from where.

    samples
        Samples delivered to the training loop in this epoch.
    samples_from_cache, samples_from_storage
        Where the raw bytes of those samples came from (two-stage datasets).
    bytes_from_cache, bytes_from_storage
        Raw sample bytes read from the node cache and from storage (files,
        fsspec URLs).  0 for datasets that are not two-stage,
        whose I/O coordl cannot see.
    skipped
        Bad samples skipped under ``on_error="skip"``.
    samples_shared, samples_self_prepared
        Of the samples (two-stage datasets), how many the node daemon
        prepared for this job's group (``share=True``) and how many this job
        prepared itself (all of them without sharing).
    samples_from_peers, bytes_from_peers
        Samples (and their raw bytes) another node's cache served because
        this node's did not hold them (``peers``, multi-node jobs).
    batches_zero_copy
        Of the batches (``share=True``), how many were handed out as views
        of the node daemon's staging memory, with no copy.
    wait_seconds, wall_seconds, stall_fraction
        Time the training loop waited in ``next()`` during this epoch, the
        wall time from its first ``next()`` to its last batch, and their
        ratio: the data stall (0: the loader always kept up).
    fetch_seconds, prep_seconds
        Busy time of the fetch and prep stages for this epoch's batches,
        summed over workers and threads.
    """

    epoch: int
    samples: int = 0
    batches: int = 0
    samples_from_cache: int = 0
    samples_from_storage: int = 0
    bytes_from_cache: int = 0
    bytes_from_storage: int = 0
    skipped: int = 0
    samples_shared: int = 0
    samples_self_prepared: int = 0
    samples_from_peers: int = 0
    bytes_from_peers: int = 0
    batches_zero_copy: int = 0
    wait_seconds: float = 0.0
    wall_seconds: float = 0.0
    fetch_seconds: float = 0.0
    prep_seconds: float = 0.0
    stall_fraction: float = 0.0


@dataclass(frozen=True)
class LoaderStats:
    """Totals over the loader's life (every pass, every epoch).

    samples
        Samples delivered to the training loop.  Exact for two-stage
        datasets; otherwise the leading dimension of the first tensor of each
        batch (1 per batch with ``batch_size=None``).
    batches
        Batches delivered to the training loop.
    wait_seconds
        Time the training loop was blocked inside ``next()`` on the loader's
        iterator: the data stall as the trainer sees it.
    bytes_from_cache, bytes_from_storage, samples_from_*
        As in :class:`EpochStats`, summed.
    fetch_seconds
        Busy time of the fetch stage (reading raw bytes), summed over the
        processes and threads that ran it.
    prep_seconds
        Busy time of the prep stage (decode, augment, collate), summed over
        workers.  ``fetch_seconds + prep_seconds`` above ``wait_seconds`` means
        the loader is keeping up; the analyzer compares them.
    deliver_seconds
        Main-process time spent handing batches over (unwrapping, device copy).
    skipped
        Bad samples skipped under ``on_error="skip"``.
    samples_shared, samples_self_prepared, samples_from_peers, bytes_from_peers, batches_zero_copy
        As in :class:`EpochStats`, summed.
    epoch
        The epoch of the latest pass (or of the next one if none started).
    epochs
        One :class:`EpochStats` per pass over an epoch, in the order the
        passes ran: ``epochs[-1]`` is the latest pass.  An epoch run again
        from its start (``set_epoch`` to an epoch already run) gets a record
        of its own; a pass that continues the latest pass's epoch mid-way
        (``load_state_dict`` of a state saved during it) adds to its record.
    path, path_reason
        Which machinery runs the loader's passes, ``"coordl"`` (its own
        pipeline) or ``"torch"`` (torch's DataLoader iterators), and why, in
        words (for a torchvision dataset: how it was read and which of its
        transforms were fused; see :doc:`/guide/torchvision`).
    device_split
        With ``device=``: whether the latest pass split the transform (uint8
        images travel, ``ToTensor``'s scaling and ``Normalize`` run on the
        device) or why not; ``""`` without ``device=``.
    device_split_cpu_samples
        Samples of split passes whose images were converted on the CPU all
        the same (the dataset's prep used the image in a way the split
        cannot carry, or the rows of a batch disagreed; see :doc:`/guide/gpu`).
    samples_verified
        With ``share=True``: samples this job prepared itself to check, bit
        for bit, that the node daemon's are its own (``COORDL_SHARE_VERIFY``
        per pass, default 2; see :doc:`/guide/sharing`).
    device_decode
        With ``decode="device"``: the decoder, the device and the pipeline
        the latest pass runs there; ``""`` otherwise.
    device_decode_images, device_decode_cpu_images
        With ``decode="device"``: images decoded on the device, and images
        decoded on the CPU instead (a file the device decoder cannot take:
        not a JPEG, CMYK, a header it cannot read, a stream it rejected; see
        :doc:`/guide/gpu`).  One image per sample for the usual ``(image, label)``.
    device_decode_seconds, device_geometry_seconds
        With ``decode="device"``: main-process wall time in the device
        decoder's calls (nvJPEG's batched call returns once the GPU has
        decoded), and in the launches of the crops, resizes, mirror and
        conversion that follow.  With workers they run in two threads of
        their own, each a batch ahead of the next ``next()``: a thread whose
        seconds come near the pass's wall time is what bounds it.
    """

    samples: int = 0
    batches: int = 0
    wait_seconds: float = 0.0
    bytes_from_cache: int = 0
    bytes_from_storage: int = 0
    samples_from_cache: int = 0
    samples_from_storage: int = 0
    fetch_seconds: float = 0.0
    prep_seconds: float = 0.0
    deliver_seconds: float = 0.0
    skipped: int = 0
    samples_shared: int = 0
    samples_self_prepared: int = 0
    samples_from_peers: int = 0
    bytes_from_peers: int = 0
    batches_zero_copy: int = 0
    epoch: int = 0
    epochs: tuple[EpochStats, ...] = ()
    path: str = ""
    path_reason: str = ""
    device_split: str = ""
    device_split_cpu_samples: int = 0
    samples_verified: int = 0
    device_decode: str = ""
    device_decode_images: int = 0
    device_decode_cpu_images: int = 0
    device_decode_seconds: float = 0.0
    device_geometry_seconds: float = 0.0


_EPOCH_FIELDS = tuple(f.name for f in fields(EpochStats) if f.name not in ("epoch", "stall_fraction"))
# per-epoch only (the loader's totals of these are its own fields, counted as they happen)
_TIMES = ("wait_seconds", "wall_seconds", "fetch_seconds", "prep_seconds")


class Counters:
    """The mutable side: one per loader, touched only by the main process.

    One record per pass over an epoch, in the order the passes started
    (:meth:`begin_pass`): running an epoch again from its start
    (``set_epoch`` to an epoch already run) starts a new record, so
    ``epochs[-1]`` is always the latest pass; a pass that continues the
    latest pass's epoch mid-way (``load_state_dict`` of a state saved in it)
    adds to its record."""

    def __init__(self) -> None:
        self.wait_seconds = 0.0
        self.fetch_seconds = 0.0
        self.prep_seconds = 0.0
        self.deliver_seconds = 0.0
        self.device_split = ""
        self.device_split_cpu_samples = 0
        self.samples_verified = 0
        self.device_decode = ""
        self.device_decode_images = 0
        self.device_decode_cpu_images = 0
        self.device_decode_seconds = 0.0
        self.device_geometry_seconds = 0.0
        self.epoch = 0
        self.path = self.path_reason = ""   # set once by the loader (coordl.tvcompat.record_path)
        self._records: list[tuple[int, dict[str, int]]] = []   # (epoch, counters), oldest first
        self._latest: dict[int, dict[str, int]] = {}           # epoch -> its latest record

    def _new(self, epoch: int) -> dict[str, int]:
        b = {k: (0.0 if k in _TIMES else 0) for k in _EPOCH_FIELDS}
        self._records.append((epoch, b))
        self._latest[epoch] = b
        return b

    def bucket(self, epoch: int) -> dict[str, int]:
        """The latest record of ``epoch`` (made if there is none)."""
        b = self._latest.get(epoch)
        return self._new(epoch) if b is None else b

    def begin_pass(self, epoch: int, resumed: bool) -> dict[str, int]:
        """The record a pass over ``epoch`` counts into: the latest record when
        it is this epoch's and the pass continues it (``resumed``); else a
        new record (an unused latest record, of a pass that ended before
        anything happened, is dropped first)."""
        if self._records:
            e, b = self._records[-1]
            if e == epoch and resumed:
                return b
            if b["batches"] == 0 and b["wall_seconds"] == 0 and b["skipped"] == 0:
                self._records.pop()
                if self._latest.get(e) is b:
                    prev = [r for x, r in self._records if x == e]
                    if prev:
                        self._latest[e] = prev[-1]
                    else:
                        del self._latest[e]
        return self._new(epoch)

    def absorb(self, stats: BatchStats, b: dict[str, int], reads_seen: bool) -> dict[str, int]:
        """Add one batch's ``stats`` into the record ``b``; ``reads_seen``: coordl
        did the reading (two-stage datasets), so bytes and sources count.
        Returns ``b``."""
        self.fetch_seconds += stats.fetch_s
        self.prep_seconds += stats.prep_s
        b["fetch_seconds"] += stats.fetch_s
        b["prep_seconds"] += stats.prep_s
        if reads_seen:
            b["bytes_from_storage"] += stats.bytes_storage
            b["samples_from_storage"] += stats.samples - stats.from_cache - stats.from_peers
            b["samples_from_peers"] += stats.from_peers
            b["bytes_from_peers"] += stats.bytes_peers
            b["bytes_from_cache"] += stats.bytes_cache
            b["samples_from_cache"] += stats.from_cache
            b["samples_shared"] += stats.shared
            b["samples_self_prepared"] += stats.samples - stats.shared
            b["batches_zero_copy"] += stats.zero_copy
        b["skipped"] += len(stats.skips)
        self.device_split_cpu_samples += getattr(stats, "device_cpu", 0)
        self.device_decode_images += getattr(stats, "decoded_device", 0)
        self.device_decode_cpu_images += getattr(stats, "decoded_cpu", 0)
        self.device_decode_seconds += getattr(stats, "decode_s", 0.0)
        self.device_geometry_seconds += getattr(stats, "geometry_s", 0.0)
        return b

    def snapshot(self) -> LoaderStats:
        per_epoch = tuple(EpochStats(epoch=e, stall_fraction=b["wait_seconds"] / b["wall_seconds"]
                                     if b["wall_seconds"] > 0 else 0.0, **b)
                          for e, b in self._records)
        totals = {k: 0 for k in _EPOCH_FIELDS if k not in _TIMES}
        for _, b in self._records:
            for k in totals:
                totals[k] += b[k]
        return LoaderStats(
            wait_seconds=self.wait_seconds,
            fetch_seconds=self.fetch_seconds,
            prep_seconds=self.prep_seconds,
            deliver_seconds=self.deliver_seconds,
            device_split=self.device_split,
            device_split_cpu_samples=self.device_split_cpu_samples,
            samples_verified=self.samples_verified,
            device_decode=self.device_decode,
            device_decode_images=self.device_decode_images,
            device_decode_cpu_images=self.device_decode_cpu_images,
            device_decode_seconds=self.device_decode_seconds,
            device_geometry_seconds=self.device_geometry_seconds,
            epoch=self.epoch,
            epochs=per_epoch,
            path=self.path,
            path_reason=self.path_reason,
            **totals,
        )
