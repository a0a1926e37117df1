"""``decode="device"``, the main process's side: the stage that turns a
batch of records and compressed bytes (:mod:`.encoded`) into the images the
CPU path would have delivered, on the device.

For each batch, on the delivery's copy stream (with workers, step 1 in a
decode thread one batch ahead of the pin thread, which runs steps 2-4;
without, all in ``next()``):

1. the JPEGs of the batch go to the decoder in one call per chunk (chunks
   of at most ``BUDGET`` decoded bytes, so a batch of large photos does not
   hold them all at once); a stream the decoder rejects is decoded on the
   CPU here (``coordl.decode.jpeg.decode_rgb``: libjpeg-turbo, then PIL
   with PIL's errors); if that fails too, it is the sample's error, raised
   (``SampleError``, the batch fails) or skipped under ``on_error="skip"``
   as on the CPU path;
2. per image: crop (``T1..W1``), resize to (``RH``, ``RW``) with the
   plan's filter on float32 (``antialias`` as the transform says: PIL's
   filters, as torch's uint8 kernels on the CPU path), crop with zero
   padding (``T2..W2``); images the workers prepared on the CPU
   (``ON_CPU``) go into their rows as they are, in one copy for the
   batch.  For a bilinear antialiased plan
   on a GPU with Triton, a batch kernel (one or two launches) does this for the whole batch
   (:mod:`.geometry_kernel`, checked against the per-image path on the
   stage's first batch; ``COORDL_DEVICE_GEOMETRY=per-image`` turns it off);
3. each image lands in its row of the batch (the resize writes it there
   itself where nothing is cropped after it), the batch is rounded half to
   even and clamped to uint8 (what torch's float resize of a uint8 image
   gives on the CPU path), its rows with ``FLIP`` mirrored (one operation
   for the batch), and
   :class:`~.split.DeviceTail` runs ``ToTensor``'s scaling and the
   ``Normalize``s: after the resize, the CPU path's operations;
4. the rest of the batch goes through the pinned ring as any batch does
   (:meth:`~.delivery.DeviceDelivery.stage` with ``replace``), and the
   images take the records' places.

Decoders: :mod:`.decoders` (``COORDL_DEVICE_DECODER``; on the CPU test
device a CPU decoder stands in for each, so the same stage, inputs and
parameters run in CI).
"""
from __future__ import annotations

import collections
import logging
import os
import time
from collections import abc

import numpy as np
import torch
import torch.nn.functional as F

from .decoders import (  # noqa: F401  (the decoders' names, as this module had them)
    DECODERS, DecoderSplit, HostDecoder, NvImageCodecDecoder, TorchvisionDecoder, _rgb_params, decoder_for, decoder_spec,
)
from .encoded import (CHANNELS, FLIP, INDEX, KIND, MODE, ON_CPU, ON_DEVICE, RH, RW, SRC_H, SRC_W, T1, T2, VFLIP, W1,
                      W2, DecodePlan, noise_sizes, ops_of, rects_of)
from .geometry_kernel import finished
from .launch import upload
from .jitter import DeviceJitter
from .split import DeviceTail

__all__ = ["DecodeStage", "HostDecoder", "TorchvisionDecoder", "NvImageCodecDecoder", "DecoderSplit", "decoder_for",
           "decoder_spec", "BUDGET"]      # the decoders' names: coordl.device.decoders

log = logging.getLogger("coordl.device")

#: decoded bytes per decoder call (a batch is decoded in chunks of at most this)
BUDGET = 256 << 20


# ---------------------------------------------------------------- the stage
class DecodeStage:
    """Decodes, crops, resizes, flips and converts the images of a batch of
    records on ``device`` (see the module doc).  ``describe(i)`` names sample
    ``i`` in errors; ``on_error`` is the loader's."""

    def __init__(self, device: torch.device, plan: DecodePlan, decoder, on_error: str, describe) -> None:
        self.device = device
        self.plan = plan
        self.decoder = decoder
        self.on_error = on_error
        self.describe = describe
        # ToTensor and Normalize, then a RandomErasing's rectangles (a plan with one converts to float)
        erase_value = plan.erasing.value if plan.erasing is not None else None
        self.tail = DeviceTail(plan.normalizes, erase_value, reciprocal=plan.reciprocal) if plan.to_float else None
        # ColorJitter between the geometry and the tail (coordl.device.jitter)
        self.jitter = DeviceJitter(device) if plan.jitters else None
        self._retired: collections.deque = collections.deque()   # (event, what the decoder's images hold)
        # the resize for each of the plan's modes (the record's MODE picks one)
        self._resizes = [_resizer(m.value, plan.antialias, device) for m in plan.modes]
        # the geometry of a batch in a batch kernel (coordl.device.geometry_kernel): None until the
        # first batch decides (then the kernel, or False: one launch per image)
        self._kinds = _geometry_kinds()     # read once, as the decoder is: the batch kernels to try
        self.batch_geometry = None if self._kinds and _batch_geometry_wanted(device, plan) else False

    def note(self) -> str:
        share = f" (the workers decode {self.plan.cpu_share:.0%} of the samples on the CPU path)" \
            if self.plan.cpu_share else ""
        return f"{self.decoder.name} on {self.device}{share}: {self.plan.describe()}"

    def stage(self, delivery, env):
        """Both halves in the calling thread (``num_workers=0``):
        :meth:`decode_envelope`, then :meth:`stage_decoded`."""
        self.decode_envelope(delivery, env)
        return self.stage_decoded(delivery, env)

    def decode_envelope(self, delivery, env):
        """The first half on ``env``'s batch, on the delivery's copy stream
        (the decode thread with workers): :meth:`decode`."""
        st = delivery.streams
        with st.use(st.copy_stream()):
            env.batch = self.decode(env.batch, env.stats, env.step)
        return env

    def prepare_envelope(self, delivery, env):
        """:meth:`prepare` (the fetch thread with workers, a batch ahead of
        the decode thread)."""
        self.prepare(env.batch, env.stats)
        return env

    def prepare(self, batch, stats) -> None:
        """The host's work before the decoder's call, kept off the decode
        thread, which bounds delivery on a GPU: the records as lists, each
        chunk's streams (views of the batch's slot), and the rows the
        workers prepared gathered into one (page-locked, on CUDA) buffer,
        out of the slot; in ``stats.device_prepared`` for :meth:`decode`."""
        blob, _, offsets = stats.device_blob
        paths = tuple(stats.device_marks)
        records = [_get(batch, p).tolist() for p in paths]    # per path, per row: the RECORD fields
        n, m = len(records[0]), len(paths)
        noise = None
        if self.plan.noise:
            offsets, noise = self._noise_apart(blob, offsets, records, n, m)
        todo = [(r, k) for r in range(n) for k in range(m) if records[k][r][KIND] == ON_DEVICE]
        chunks = list(_chunks(todo, records))
        streams = [[_bytes(blob, offsets[r * m + k]) for r, k in chunk] for chunk in chunks]
        oh, ow = self.plan.size
        # prepared by the CPU path in the worker (counted there; uint8 (3, oh, ow) images, which
        # EncodedCompose checks): gathered here, moved to the device in one copy by decode(), not one per
        # image, into page-locked memory (torch's caching host allocator keeps the block until the copy
        # ran), so that the copy is queued, not waited for
        ready = [(k, r) for r in range(n) for k in range(m) if records[k][r][KIND] == ON_CPU]
        host = None
        if ready:
            host = torch.empty((len(ready), 3, oh, ow), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            torch.stack([_bytes(blob, offsets[r * m + k]).view(3, oh, ow) for k, r in ready], out=host)
        stats.device_prepared = _Prepared(paths, records, chunks, streams, ready, host, noise)

    def _noise_apart(self, blob, offsets, records: list, n: int, m: int):
        """An erasing of noise: each payload is its bytes (or image) then its
        rectangles' float32 noise (``EncodedCompose``).  Returns the offsets
        of the bytes alone, and ``(host, at)``: the batch's noise gathered
        into one (page-locked, on CUDA) float32 buffer, and per (path
        number, row) the offset of its noise there, or None when the batch
        erases nothing."""
        sizes = [[noise_sizes(rects_of(records[k][r]), self.plan.noise) for r in range(n)] for k in range(m)]
        total = sum(sum(s) for per in sizes for s in per)
        if not total:
            return offsets, None
        offsets = offsets.copy()
        host = torch.empty(total, dtype=torch.float32, pin_memory=self.device.type == "cuda")
        flat = host.numpy()
        at, o = {}, 0
        for r in range(n):
            for k in range(m):
                nb = 4 * sum(sizes[k][r])
                if not nb:
                    continue
                start, length = int(offsets[r * m + k, 0]), int(offsets[r * m + k, 1])
                offsets[r * m + k, 1] = length - nb
                flat[o:o + nb // 4] = blob[start + length - nb:start + length].view(np.float32)
                at[(k, r)] = o
                o += nb // 4
        return offsets, (host, at)

    def decode(self, batch, stats, step=None):
        """The first half (the decode thread with workers), on the current
        stream (the delivery's copy stream): decode the batch's JPEGs, fall
        back to the CPU for those the decoder rejects, resolve the samples
        neither can read (raise or skip), copy the rows the workers prepared
        (all of it from what :meth:`prepare` made, which runs here first
        where no fetch thread ran it).  Returns the batch (skipped rows
        removed; None when none is left) and leaves the decoded images in
        ``stats.device_pending`` for :meth:`stage_decoded`.  A batch of
        several chunks (``BUDGET``) has the geometry of all but its last
        chunk done here, so that no more than one chunk of full-size images
        waits."""
        if stats.device_prepared is None:
            self.prepare(batch, stats)
        prep, stats.device_prepared = stats.device_prepared, None
        stats.device_blob = None       # the slot goes back to its worker once the stage lets go of it
        paths, records, chunks = prep.paths, prep.records, prep.chunks
        n, m = len(records[0]), len(paths)
        out = [[None] * n for _ in range(m)]
        errors: dict = {}
        on_device = on_cpu = 0
        # the last chunk's geometry waits for the second half, with what the
        # decoder's images hold (see _Pending)
        raw: list = []
        held: list = []
        for c, chunk in enumerate(chunks):
            defer = c == len(chunks) - 1
            streams, prep.streams[c] = prep.streams[c], None
            t0 = time.perf_counter()
            got = self.decoder.decode(streams)
            stats.decode_s += time.perf_counter() - t0
            for (r, k), img, data in zip(chunk, got, streams):
                if isinstance(img, BaseException):
                    log.debug("device decode of sample %d failed (%s: %s): decoding it on the CPU",
                              records[k][r][INDEX], type(img).__name__, img)
                    try:
                        img = self._on_host(data)
                    except Exception as e:  # noqa: BLE001 - the sample's own error, as the CPU path's
                        errors.setdefault(r, e)
                        continue
                    on_cpu += 1
                else:
                    on_device += 1
                self._check(img, records[k][r])
                if defer:
                    raw.append((k, r, img))
                else:
                    t0 = time.perf_counter()
                    out[k][r] = self._geometry(img, records[k][r])
                    stats.geometry_s += time.perf_counter() - t0
            if defer:
                held = self.decoder.release()
            else:
                self.decoder.finish()
        # the workers' rows: one copy, queued on this stream (page-locked on CUDA); finish() puts them in
        cpu = ({kr: i for i, kr in enumerate(prep.ready)},
               prep.host.to(self.device, non_blocking=self.device.type == "cuda")) if prep.ready else ({}, None)
        # an erasing's noise: one copy, queued on this stream as the rows above
        noise = (prep.noise[0].to(self.device, non_blocking=self.device.type == "cuda"), prep.noise[1]) \
            if prep.noise is not None else None
        del prep
        keep = self._errors(errors, records[0], stats, step) if errors else list(range(n))
        stats.decoded_device += on_device
        stats.decoded_cpu += on_cpu
        if not keep:
            return None
        stats.device_pending = _Pending(paths, records, out, raw, held, keep, cpu, noise)
        return _rows(batch, keep, n) if len(keep) < n else batch

    def finish(self, pending: "_Pending") -> dict:
        """The second half's device work, on the current stream (the copy
        stream): the geometry of the images the first half left, each
        written straight into its row of the path's batch, then each path's
        batch rounded and converted: ``{path: images}``."""
        out, records, keep = pending.out, pending.records, pending.keep
        at, moved = pending.cpu
        left = {(k, r): img for k, r, img in pending.raw}
        images = {}
        for k, path in enumerate(pending.paths):
            channels = records[k][keep[0]][CHANNELS]
            geo = self._batched(left, records) if channels == 3 else False
            imgs = [left.pop((k, r), None) for r in keep]
            # rows already final: uint8 images the workers prepared on the CPU path (their flip applied)
            ready = [j for j, r in enumerate(keep) if (k, r) in at]
            cpu = _rows_of(moved, [at[(k, keep[j])] for j in ready]) if ready else None
            if len(ready) == len(keep):     # every row the CPU path's: the batch as it is, then the tail
                images[path] = self._erased(self.tail(cpu) if self.tail is not None else cpu, records[k], keep, k,
                                            pending.noise)
                continue
            kernel = sum(img is not None for img in imgs)
            # the rows' colour operations (ColorJitter), applied to the uint8 rows before the tail
            ops = [ops_of(records[k][r]) for r in keep] if self.jitter is not None else []
            ops = ops if any(ops) else None
            if geo and geo.fused and kernel and kernel + len(ready) == len(keep):
                # the rest the kernel's: it rounds, clamps and mirrors them itself, into the uint8 batch,
                # or on through ToTensor/Normalize where its arithmetic was found to be the tail's; the
                # ready rows go in as they are, or through the tail first (elementwise: the same values
                # as the tail of the whole batch)
                whole = self.tail is not None and geo.fused_tail and ops is None
                y = torch.empty((len(keep), 3, *self.plan.size), dtype=torch.float32 if whole else torch.uint8,
                                device=self.device)
                geo.run([(j, img, records[k][r]) for j, (r, img) in enumerate(zip(keep, imgs)) if img is not None],
                        y, final=True, tail=self.tail if whole else None)
                _place(y, ready, cpu, self.tail if whole else None)
                y = _upside_down(y, records[k], keep)
                if ops is not None:
                    y = self.jitter(y, ops)
                images[path] = self._erased(self.tail(y) if self.tail is not None and not whole else y, records[k],
                                            keep, k, pending.noise)
                continue
            y = torch.empty((len(keep), channels, *self.plan.size), dtype=torch.float32, device=self.device)
            batched = []
            for j, (r, img) in enumerate(zip(keep, imgs)):
                if img is None:
                    if out[k][r] is not None:       # an earlier chunk's geometry, not yet rounded
                        y[j].copy_(out[k][r])
                elif geo:
                    batched.append((j, img, records[k][r]))
                else:
                    self._geometry(img, records[k][r], into=y[j:j + 1])
            _place(y, ready, cpu)
            if batched:
                geo.run(batched, y)
            y = _upside_down(finished(y, [bool(records[k][r][FLIP]) for r in keep]), records[k], keep)
            if ops is not None:
                y = self.jitter(y, ops)
            images[path] = self._erased(self.tail(y) if self.tail is not None else y, records[k], keep, k,
                                        pending.noise)
        return images

    def _erased(self, y: torch.Tensor, records: list, keep: list, k: int = 0, noise=None) -> torch.Tensor:
        """``y`` (the path's final batch) with each row's ``RandomErasing``
        rectangles (its record's, :func:`.encoded.rects_of`) set to the
        erasing's value by the tail (``DeviceTail.erased``; the tail made
        ``y`` anew, so it is never the CPU rows themselves)."""
        if self.plan.erasing is None:
            return y
        rows = [rects_of(records[r]) for r in keep]
        if not self.plan.noise:
            return self.tail.erased(y, rows)
        if noise is None:               # no row of the batch erases
            return y
        flat, at = noise
        values = []
        for r, rects in zip(keep, rows):
            o, vs = at.get((k, r), 0), []
            for (_, _, h, w), size in zip(rects, noise_sizes(rects, self.plan.noise)):
                vs.append(flat[o:o + size].view(3, *((h, w) if self.plan.noise == "pixel" else (1, 1))))
                o += size
            values.append(vs)
        return self.tail.erased(y, rows, values)

    def stage_decoded(self, delivery, env):
        """The second half (the pin thread with workers): finish the images
        the first half decoded, on the delivery's copy stream, then start
        the copy of the rest through the ring: a ``Staged`` batch, or None
        when every sample of it was skipped.  What the decoder's images hold
        (nvImageCodec's own device memory) is kept until the staged batch's
        event says the work on them has run."""
        pending, env.stats.device_pending = env.stats.device_pending, None
        if env.batch is None or pending is None:
            return None
        st = delivery.streams
        t0 = time.perf_counter()
        with st.use(st.copy_stream()):
            images = self.finish(pending)
        env.stats.geometry_s += time.perf_counter() - t0
        staged = delivery.stage(env.batch, (), replace=images)
        if pending.held:
            self._retire(staged.event, pending.held)
        return staged

    def _retire(self, event, held: list) -> None:
        """Keep ``held`` until ``event`` completes; let go of what earlier
        events have covered (the ring bounds how many can be pending)."""
        self._retired.append((event, held))
        while self._retired and self._retired[0][0].query():
            self._retired.popleft()

    def _on_host(self, data: torch.Tensor) -> torch.Tensor:
        """A stream the device decoder rejected, decoded as the CPU path
        decodes a whole image (libjpeg-turbo, else PIL and its errors)."""
        from ..decode.jpeg import decode_rgb

        arr = decode_rgb(data.numpy().tobytes())
        return torch.from_numpy(arr).permute(2, 0, 1).to(self.device)

    @staticmethod
    def _check(img: torch.Tensor, rec: list) -> None:
        if tuple(img.shape[-2:]) != (rec[SRC_H], rec[SRC_W]):
            raise RuntimeError(f"the decoder gave a {tuple(img.shape)} image for a JPEG whose header says "
                               f"{rec[SRC_H]}x{rec[SRC_W]}")

    def _batched(self, left: dict, records: list):
        """The batch-geometry kernel, or False (one launch per image).  The
        first batch decides, by the pixels alone: the first kernel of
        :data:`~.geometry_kernel.KINDS` (separable, tiled, per-pixel; only
        the one ``COORDL_DEVICE_GEOMETRY`` names, where it names one) whose
        rows for a few of its images agree with :meth:`_geometry`'s
        (:func:`~.geometry_kernel.agrees`; a kernel that cannot compile here
        or differs gives way to the next); and whether that kernel's own
        rounding and mirror give exactly the rows the stage's would
        (:func:`~.geometry_kernel.fused_agrees`: then it writes the uint8
        batch itself), and its ``ToTensor``/``Normalize`` arithmetic exactly
        the tail's (then the float batch).  Never by timing, which differs
        between runs: two loaders, or a run and its resume, take the same
        path and give the same pixels.  On a GPU the kernel is also timed
        against the per-image launches; slower is a warning naming
        ``COORDL_DEVICE_GEOMETRY=per-image``."""
        if self.batch_geometry is None:
            from . import geometry_kernel as GK

            probe = [(img, records[k][r]) for (k, r), img in list(left.items())[:8]]
            if not probe:
                return False
            modes = tuple(m.value for m in self.plan.modes)
            # each image with each of the plan's modes (a mode drawn per sample: the first batch may lack one)
            probe = [(img, rec[:MODE] + [m] + rec[MODE + 1:]) for img, rec in probe for m in range(len(modes))] \
                if len(modes) > 1 else probe
            imgs, recs = [i for i, _ in probe], [r for _, r in probe]
            chosen, found = False, []
            for kind in self._kinds:
                try:
                    geo = GK.BatchGeometry(self.plan.size, kind, modes)
                    ok, what = GK.agrees(self, imgs, recs, geo)
                    if ok and geo.final_rows:
                        try:
                            what += "; " + GK.fused_agrees(geo, self.device, imgs, recs, self.tail)[1]
                        except Exception as e:  # noqa: BLE001 - its float rows stand; the stage rounds them
                            geo.fused = geo.fused_tail = False
                            what += f"; the kernel's own rounding could not run ({type(e).__name__}: {e})"
                    if ok and self.device.type == "cuda":
                        quicker, speed = GK.faster(self, imgs, recs, geo)
                        what += "; " + speed
                        if not quicker:
                            log.warning("decode='device': the %s batch-geometry kernel took longer than one launch "
                                        "per image on this GPU (%s); %s=per-image makes the stage launch per image "
                                        "(its pixels within %d level of the kernel's)", kind, speed, _GEOMETRY_ENV,
                                        GK.TOLERANCE)
                except Exception as e:  # noqa: BLE001 - a Triton that cannot compile or launch here
                    ok, what = False, f"{type(e).__name__}: {e}"
                found.append(f"{kind}: {what}")
                if ok:
                    chosen = geo
                    break
            log.info("decode='device': the batch-geometry kernel %s one launch per image (%s)",
                     "is used in place of" if chosen else "is not used: its pixels differ from", "; ".join(found))
            self.batch_geometry = chosen
        return self.batch_geometry

    def _geometry(self, img: torch.Tensor, rec: list, into: torch.Tensor | None = None) -> torch.Tensor:
        """One decoded (3, H, W) uint8 image through the record's crop,
        resize and padded crop: float32 (3, h, w), not yet rounded nor
        mirrored (:meth:`finish` mirrors the batch's flipped rows at once).
        With ``into`` (a (1, 3, h, w) row of the batch), written there: by
        the resize itself when nothing is cropped after it (the usual
        ``RandomResizedCrop``), else copied."""
        t, l, h, w = rec[T1:W1 + 1]
        x = img[None, :, t:t + h, l:l + w].to(torch.float32)
        rh, rw = rec[RH], rec[RW]
        t2, l2, h2, w2 = rec[T2:W2 + 1]
        if rh and (rh, rw) != (h, w):
            resize = self._resizes[rec[MODE]]
            if into is not None and t2 == 0 and l2 == 0 and (h2, w2) == (rh, rw):
                resize(x, (rh, rw), into)
                return into[0]
            x = resize(x, (rh, rw))
        x = _padded_crop(x[0], t2, l2, h2, w2)
        if into is not None:
            into[0].copy_(x)
        return x

    def _errors(self, errors: dict, records, stats, step) -> list:
        """Raise the first failed sample's error, or skip the failed samples:
        the rows that stay."""
        from ..errors import sample_error

        n = len(records)
        for r in sorted(errors):
            i = records[r][INDEX]
            err, where = errors[r], self.describe(i)
            if self.on_error == "raise" or not isinstance(err, Exception):
                e = sample_error("preparing", i, where, err)
                e.coordl_step = step   # the batch is used up, as a failed batch of the pipeline
                raise e from err
            stats.skips.append((i, where, f"preparing: {type(err).__name__}: {err}"))
            stats.samples -= 1
        return [r for r in range(n) if r not in errors]


def _upside_down(y: torch.Tensor, records: list, keep: list) -> torch.Tensor:
    """``y`` (a path's batch after its geometry) with the rows whose record
    says ``VFLIP`` mirrored top-bottom (a ``RandomVerticalFlip``'s; the
    rows the workers prepared on the CPU path carry none: theirs is
    applied).  Elementwise steps after it commute with it."""
    rows = [j for j, r in enumerate(keep) if records[r][VFLIP]]
    if rows:
        at = torch.tensor(rows, device=y.device)
        y[at] = y[at].flip(-2)
    return y


#: the tests run the batch-geometry kernel on the CPU (Triton's interpreter): True
BATCH_GEOMETRY_ON_CPU = False
_GEOMETRY_ENV = "COORDL_DEVICE_GEOMETRY"


def _geometry_kinds() -> tuple:
    """The batch-geometry kernels ``COORDL_DEVICE_GEOMETRY`` lets the stage
    try, in order: all of :data:`~.geometry_kernel.KINDS` (``auto``), the
    one it names, or none (``per-image``)."""
    from .geometry_kernel import KINDS

    want = os.environ.get(_GEOMETRY_ENV, "auto").strip().lower() or "auto"
    if want == "auto":
        return KINDS
    if want in KINDS:
        return (want,)
    if want == "per-image":
        return ()
    raise ValueError(f'{_GEOMETRY_ENV} should be "auto", "per-image" or one of the batch kernels '
                     f'({", ".join(repr(k) for k in KINDS)}), but got {_GEOMETRY_ENV}={want!r}')


def _batch_geometry_wanted(device: torch.device, plan) -> bool:
    """A batch-geometry kernel may run for ``plan`` on ``device``: the
    bilinear or bicubic antialiased resize (or none), a CUDA device (the
    CPU only for the tests) and Triton importable."""
    if device.type != "cuda" and not BATCH_GEOMETRY_ON_CPU:
        return False
    from . import geometry_kernel as GK

    if plan.resize is not None and (any(m.value not in GK.MODES for m in plan.modes) or not plan.antialias):
        return False

    return GK.available()


def _resizer(mode: str, antialias: bool, device: torch.device | None = None):
    """``f(x, (h, w), out=None)``: ``F.interpolate(x, size=(h, w), mode=mode,
    ...)`` for a float (1, C, H, W) batch, written into ``out`` (a
    contiguous (1, C, h, w) tensor) when given.  For the antialiased
    bilinear and bicubic filters, the operator ``F.interpolate`` itself
    calls, without its argument checks (called once per image) and writing
    ``out`` itself, where this torch has it and it gives ``F.interpolate``'s
    result on a probe on ``device``, both ways; else ``F.interpolate``."""
    kw = {"align_corners": False, "antialias": antialias} if mode in ("bilinear", "bicubic") else {}

    def interpolate(x, size, out=None):
        y = F.interpolate(x, size=size, mode=mode, **kw)
        return y if out is None else out.copy_(y)

    op = getattr(torch._C._nn, f"_upsample_{mode}2d_aa", None) if antialias and mode in ("bilinear", "bicubic") else None
    if op is None:
        return interpolate

    def direct(x, size, out=None):
        return op(x, size, False, None) if out is None else op(x, size, False, None, None, out=out)

    probe = torch.arange(2 * 13 * 11, dtype=torch.float32, device=device).view(1, 2, 13, 11).sin_().mul_(100)
    try:
        same = True
        for size in ((5, 4), (17, 9)):
            want = interpolate(probe, size)
            into = torch.full((3, 2, *size), -1.0, device=device)
            same = same and torch.equal(direct(probe, size), want) and \
                torch.equal(direct(probe, size, into[1:2]), want) and bool((into[0] == -1).all() and (into[2] == -1).all())
    except Exception:  # noqa: BLE001 - another signature: the public call
        same = False
    return direct if same else interpolate


class _Prepared:
    """A batch made ready for the decoder (:meth:`DecodeStage.prepare`):
    its records' paths and fields, the chunks of (row, path number) the
    device decodes with their streams, and the rows the workers prepared
    with their images (one tensor, a row each)."""

    __slots__ = ("paths", "records", "chunks", "streams", "ready", "host", "noise")

    def __init__(self, paths, records, chunks, streams, ready, host, noise=None) -> None:
        self.paths, self.records, self.chunks, self.streams = paths, records, chunks, streams
        self.ready, self.host, self.noise = ready, host, noise


class _Pending:
    """A batch between the two halves: the decoded images whose geometry
    is still to run (``raw``: (path number, row, image)), the images done
    (``out[path][row]``), the rows kept, what the decoder's images hold
    (``held``), and the rows the workers prepared (``cpu``: their place,
    ``{(path number, row): i}``, and their images on the device, row ``i``
    of one tensor)."""

    __slots__ = ("paths", "records", "out", "raw", "held", "keep", "cpu", "noise")

    def __init__(self, paths, records, out, raw, held, keep, cpu, noise=None) -> None:
        self.paths, self.records, self.out, self.raw, self.held, self.keep = paths, records, out, raw, held, keep
        self.cpu, self.noise = cpu, noise


def _rows_of(x: torch.Tensor, idx: list) -> torch.Tensor:
    """``x``'s rows ``idx``: ``x`` itself when they are all of them in order
    (one path, no row skipped: the usual batch), else gathered."""
    if idx == list(range(len(x))):
        return x
    return x.index_select(0, upload(np.asarray(idx, dtype=np.int64), x.device))


def _place(y: torch.Tensor, rows: list, x, tail=None) -> None:
    """The uint8 images ``x`` into ``y``'s ``rows`` in one copy (not one
    launch per row), through ``tail`` first when given."""
    if not rows:
        return
    if tail is not None:
        x = tail(x)
    y.index_copy_(0, upload(np.asarray(rows, dtype=np.int64), y.device), x.to(y.dtype))


def _chunks(todo: list, records: list):
    """``todo`` in runs whose decoded images take at most ``BUDGET`` bytes
    (at least one image each)."""
    chunk, size = [], 0
    for r, k in todo:
        nbytes = 3 * records[k][r][SRC_H] * records[k][r][SRC_W]
        if chunk and size + nbytes > BUDGET:
            yield chunk
            chunk, size = [], 0
        chunk.append((r, k))
        size += nbytes
    if chunk:
        yield chunk


def _bytes(blob: np.ndarray, entry) -> torch.Tensor:
    o, n = int(entry[0]), int(entry[1])
    return torch.from_numpy(blob[o:o + n])


def _padded_crop(x: torch.Tensor, top: int, left: int, h: int, w: int) -> torch.Tensor:
    """``x[..., top:top+h, left:left+w]``, zero where the box leaves ``x``
    (``CenterCrop`` larger than the image pads, as on the CPU path)."""
    H, W = x.shape[-2:]
    if top >= 0 and left >= 0 and top + h <= H and left + w <= W:
        return x[..., top:top + h, left:left + w]
    out = x.new_zeros((*x.shape[:-2], h, w))
    t0, l0, t1, l1 = max(top, 0), max(left, 0), min(top + h, H), min(left + w, W)
    if t1 > t0 and l1 > l0:
        out[..., t0 - top:t1 - top, l0 - left:l1 - left] = x[..., t0:t1, l0:l1]
    return out


def _get(batch, path: tuple):
    for key in path:
        batch = batch[key]
    return batch


def _rows(x, keep: list, n: int):
    """The batch ``x`` with only rows ``keep`` of ``n``: every tensor whose
    first dimension is the batch's, and every list of ``n`` plain values
    (default collation's strings), in containers as default collation
    builds them."""
    if isinstance(x, torch.Tensor):
        if x.dim() > 0 and x.shape[0] == n:
            return x[torch.tensor(keep, dtype=torch.long, device=x.device)]
        return x
    if isinstance(x, (str, bytes)):
        return x
    if isinstance(x, abc.Mapping):
        d = {k: _rows(v, keep, n) for k, v in x.items()}
        try:
            return type(x)(d)
        except TypeError:
            return d
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_rows(v, keep, n) for v in x))
    if isinstance(x, (list, tuple)):
        if len(x) == n and not any(isinstance(v, (torch.Tensor, abc.Mapping, list, tuple, np.ndarray)) for v in x):
            return type(x)(x[r] for r in keep)
        return type(x)(_rows(v, keep, n) for v in x)
    return x
