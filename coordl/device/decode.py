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
   (``ON_CPU``) are copied as they are.  For a bilinear antialiased plan
   on a GPU with Triton, one kernel launch does this for the whole batch
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

Decoders (``COORDL_DEVICE_DECODER``): ``torchvision`` (default where it
imports: ``torchvision.io.decode_jpeg`` on a list, nvJPEG, batched: on
the GPU's hardware JPEG decoder where it has one (A100, H100, H200) for
baseline JPEGs, the others one by one with their Huffman decoding on the
CPU; one call at a time in the process, each waiting for its stream),
``nvimgcodec`` (NVIDIA nvImageCodec, ``nvidia-nvimgcodec-cu12``/``-cu13``,
libjpeg's chroma upsampling; used by default only where torchvision's is
missing), ``nvimgcodec-hw`` (nvImageCodec, the hardware decoder first),
``nvimgcodec-hybrid`` (nvImageCodec's hybrid decoder: Huffman decoding in
its CPU threads, the rest on the GPU); several joined by ``+`` share each
batch by weight, each in a thread of its own (:class:`DecoderSplit`).  On
the CPU test device, :class:`HostDecoder` stands in for each
(libjpeg-turbo with nvJPEG's plain chroma upsampling), so the same stage,
inputs and parameters run in CI.
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import time
from collections import abc

import numpy as np
import torch
import torch.nn.functional as F

from .encoded import (CHANNELS, FLIP, INDEX, KIND, ON_CPU, ON_DEVICE, RH, RW, SRC_H, SRC_W, T1, T2, W1, W2,
                      DecodePlan)
from .geometry_kernel import upload
from .split import DeviceTail

__all__ = ["DecodeStage", "HostDecoder", "TorchvisionDecoder", "NvImageCodecDecoder", "DecoderSplit", "decoder_for",
           "decoder_spec", "BUDGET"]

log = logging.getLogger("coordl.device")

#: decoded bytes per decoder call (a batch is decoded in chunks of at most this)
BUDGET = 256 << 20

_ENV = "COORDL_DEVICE_DECODER"


# ---------------------------------------------------------------- decoders
class HostDecoder:
    """The CPU standing in for the device decoder (tests, CI): libjpeg-turbo
    through simplejpeg, full size, with plain ("fast") chroma upsampling, as
    nvJPEG upsamples by default (DALI's ``jpeg_fancy_upsampling`` and
    nvImageCodec's ``fancy_upsampling`` options exist to make the GPU do
    libjpeg's interpolation instead).  Same inputs, same outputs as a device
    decoder: (3, H, W) uint8 per stream, or the exception for it."""

    name = "CPU stand-in (libjpeg-turbo, plain chroma upsampling)"

    def __init__(self, device: torch.device | None = None, fancy_upsampling: bool = False) -> None:
        import simplejpeg

        self.device = device if device is not None else torch.device("cpu")
        self._sj = simplejpeg
        self._fast = not fancy_upsampling

    def decode(self, streams: list) -> list:
        out = []
        for s in streams:
            try:
                arr = self._sj.decode_jpeg(s.numpy(), colorspace="RGB", fastupsample=self._fast)
            except Exception as e:  # noqa: BLE001 - the stage decides (the CPU path's decoder, then the error)
                out.append(e)
                continue
            out.append(torch.from_numpy(arr).permute(2, 0, 1).to(self.device))
        return out

    def finish(self) -> None:
        pass

    def release(self) -> list:
        return []     # its images are torch's: the caching allocator orders their reuse


class TorchvisionDecoder:
    """``torchvision.io.decode_jpeg(list, mode=RGB, device=...)``: one
    batched nvJPEG call (torchvision decodes on a stream of its own, waits
    for it, and makes the caller's current stream wait too).  A call that
    fails for one stream fails for all: the streams are then decoded one by
    one, so only the bad one falls back."""

    name = "torchvision.io.decode_jpeg (nvJPEG)"

    def __init__(self, device: torch.device) -> None:
        from torchvision.io import ImageReadMode, decode_jpeg

        self.device = device
        self._decode = decode_jpeg
        self._mode = ImageReadMode.RGB

    def decode(self, streams: list) -> list:
        try:
            return list(self._decode(streams, mode=self._mode, device=self.device))
        except RuntimeError as e:
            if len(streams) == 1:
                return [e]
        out = []
        for s in streams:
            try:
                out.append(self._decode([s], mode=self._mode, device=self.device)[0])
            except RuntimeError as e:
                out.append(e)
        return out

    def finish(self) -> None:
        pass

    def release(self) -> list:
        return []     # torch's tensors, made on the caller's stream: their reuse is stream-ordered


class NvImageCodecDecoder:
    """NVIDIA nvImageCodec's batched decode (``nvidia.nvimgcodec``): sRGB,
    interleaved RGB, 8 bits, no EXIF rotation (PIL's decode does not rotate
    either), libjpeg's interpolated chroma upsampling; a stream it cannot
    decode comes back as None.  Its images own device memory of their own:
    the stage's work on them is queued on the current stream, which is
    waited for (:meth:`finish`) before they are released.  On a CPU device
    it runs nvImageCodec's CPU backend (libjpeg-turbo): the same calls,
    so that they are checked where nvImageCodec is installed without a GPU."""

    name = "nvImageCodec"

    #: ``COORDL_DEVICE_DECODER`` names of nvImageCodec's configurations: (backends in order, or None for
    #: the library's choice with libjpeg's interpolated chroma; label).  The others upsample chroma
    #: plainly, as nvJPEG and DALI's ``mixed`` decoder do.
    VARIANTS = {
        "nvimgcodec": (None, ""),
        # the GPU's hardware JPEG decoder (A100, H100, H200), CUDA and hybrid decoding for what it does not take
        "nvimgcodec-hw": (("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU"), " (hardware decoder first)"),
        # Huffman decoding in nvImageCodec's CPU threads, the rest on the GPU: beside the hardware decoder,
        # the capacity the hardware decoder does not have (DALI's split)
        "nvimgcodec-hybrid": (("HYBRID_CPU_GPU", "GPU_ONLY"), " (hybrid: Huffman in its CPU threads)"),
    }

    def __init__(self, device: torch.device, variant: str = "nvimgcodec") -> None:
        """``variant``: a key of :attr:`VARIANTS` (the backends, in order)."""
        from nvidia import nvimgcodec

        kinds, label = self.VARIANTS[variant]
        self.device = device
        self._cuda = device.type == "cuda"
        if self._cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            if kinds:
                self.name = "nvImageCodec" + label
                self._dec = nvimgcodec.Decoder(
                    device_id=index, options="",
                    backends=[nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, k)) for k in kinds])
            else:
                self._dec = nvimgcodec.Decoder(device_id=index, options=":fancy_upsampling=1")
        else:
            self._dec = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                                           backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)],
                                           options=":fancy_upsampling=1")
        self._params = _rgb_params(nvimgcodec)
        self._held: list = []

    def decode(self, streams: list) -> list:
        kw = {"cuda_stream": torch.cuda.current_stream(self.device).cuda_stream} if self._cuda else {}
        images = self._dec.decode([s.numpy() for s in streams], params=self._params, **kw)
        self._held.extend(images)
        out = []
        for img in images:
            if img is None:
                out.append(RuntimeError("nvImageCodec could not decode this image"))
            elif self._cuda:
                out.append(torch.as_tensor(img, device=self.device).permute(2, 0, 1))
            else:
                out.append(torch.from_numpy(np.asarray(img)).permute(2, 0, 1))
        return out

    def finish(self) -> None:
        """Wait for the work queued on the current stream, then let go of
        the images decoded since the last call."""
        if self._held:
            if self._cuda:    # a blocking event: the thread sleeps until the GPU is done, it does not poll
                done = torch.cuda.Event(blocking=True)
                done.record(torch.cuda.current_stream(self.device))
                done.synchronize()
            self._held = []

    def release(self) -> list:
        """Hand over the images decoded since the last call, without
        waiting: the caller keeps them until the work queued on them has run
        (:meth:`DecodeStage.stage_decoded`)."""
        held, self._held = self._held, []
        return held


def _rgb_params(nvimgcodec):
    """DecodeParams for interleaved 8-bit RGB without EXIF rotation.  The
    0.5+ API names the colour space sRGB and the layout apart
    (``sample_format=I_RGB``); older releases had ``ColorSpec.RGB``."""
    srgb = getattr(nvimgcodec.ColorSpec, "SRGB", None)
    if srgb is not None and hasattr(nvimgcodec, "SampleFormat"):
        return nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=srgb, allow_any_depth=False,
                                       sample_format=nvimgcodec.SampleFormat.I_RGB)
    return nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.RGB,
                                   allow_any_depth=False)


#: the decoders COORDL_DEVICE_DECODER names (``auto``: torchvision's where it imports, else nvImageCodec's)
DECODERS = ("auto", "torchvision", "nvimgcodec", "nvimgcodec-hw", "nvimgcodec-hybrid")


def decoder_spec(text: str | None = None) -> list:
    """``COORDL_DEVICE_DECODER`` (or ``text``) read as ``[(name, weight)]``:
    one decoder, or several joined by ``+``, each with an optional
    ``:weight`` (its share of each batch; default 1), e.g.
    ``torchvision:3+nvimgcodec-hybrid:2``.  ValueError naming the grammar."""
    raw = os.environ.get(_ENV, "auto") if text is None else text
    raw = raw.strip().lower() or "auto"
    parts = []
    for item in raw.split("+"):
        name, _, weight = item.strip().partition(":")
        name = name.strip()
        try:
            w = float(weight) if weight.strip() else 1.0
        except ValueError:
            w = -1.0
        if name not in DECODERS or not (0 < w < float("inf")):
            raise ValueError(
                f'{_ENV} should be one of "auto", "torchvision", "nvimgcodec", "nvimgcodec-hw" or '
                f'"nvimgcodec-hybrid", or several of them joined by "+", each with an optional ":weight" above 0 '
                f'(its share of each batch, decoded in a thread of its own), e.g. '
                f'"torchvision:3+nvimgcodec-hybrid:2"; but got {_ENV}={raw!r}')
        parts.append((name, w))
    return parts


def decoder_for(device: torch.device):
    """The decoder for ``device``, as ``COORDL_DEVICE_DECODER`` names it
    (:func:`decoder_spec`): for CUDA, ``torchvision``, ``nvimgcodec``,
    ``nvimgcodec-hw`` (nvImageCodec with the hardware decoder first),
    ``nvimgcodec-hybrid`` (nvImageCodec's hybrid decoder: Huffman codes in
    its CPU threads) or ``auto`` (torchvision's where it imports, else
    nvImageCodec's); several make a :class:`DecoderSplit`.  On the CPU (the
    test device) each named decoder is a :class:`HostDecoder`, so that a
    split runs the same path in CI.  ValueError saying what to install when
    one cannot be made."""
    spec = decoder_spec()
    if device.type != "cuda":
        parts = [(HostDecoder(device), w) for _, w in spec]
    else:
        parts = [(_one_decoder(name, device), w) for name, w in spec]
    return parts[0][0] if len(parts) == 1 else DecoderSplit(parts, device)


def _one_decoder(want: str, device: torch.device):
    errors = []
    makers = [("torchvision", TorchvisionDecoder)] + [
        (name, functools.partial(NvImageCodecDecoder, variant=name)) for name in NvImageCodecDecoder.VARIANTS]
    for name, make in makers:
        if want != name and not (want == "auto" and name in ("torchvision", "nvimgcodec")):
            continue
        try:
            return make(device)
        except Exception as e:  # noqa: BLE001 - ImportError, or a library that cannot start here
            errors.append(f"{name}: {type(e).__name__}: {e}")
    raise ValueError(
        "decode='device' needs a JPEG decoder for the GPU: torchvision's (a CUDA build of torchvision, "
        "torchvision.io.decode_jpeg with device='cuda') or NVIDIA nvImageCodec (pip install "
        f"nvidia-nvimgcodec-cu12, or -cu13); none could be used ({'; '.join(errors)}). Install one, or "
        "use decode='cpu'")


class DecoderSplit:
    """Several decoders sharing each call: the streams are cut into
    contiguous shares by weight (the same rows of a batch always go to the
    same decoder, so a sample's pixels do not depend on timing), the first
    share decoded in the calling thread and each other in a thread of its
    own (``coordl-device-decode-partJ``), at the same time.  On CUDA each
    other share runs on a stream of its own; the caller's stream waits for
    it, and the tensors it made are recorded on the caller's stream.  This
    is how the GPU's hardware JPEG decoder (torchvision's call, one at a
    time in the process) and Huffman decoding in CPU threads
    (``nvimgcodec-hybrid``) work on one batch at once, as DALI splits a
    batch between them.  Same interface as one decoder."""

    def __init__(self, parts: list, device: torch.device) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.parts = [d for d, _ in parts]
        self.weights = [float(w) for _, w in parts]
        self.device = device
        self.name = " + ".join(f"{d.name} ({w:g})" for d, w in parts)
        self._cuda = device.type == "cuda"
        self._streams = [None] + [torch.cuda.Stream(device, priority=-1) if self._cuda else None for _ in parts[1:]]
        # one thread per share: a decoder is always called from the same thread, and shares never queue
        # behind each other
        self._threads = [None] + [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"coordl-device-decode-part{j}")
                                  for j in range(1, len(parts))]
        self.images = [0] * len(parts)      # streams handed to each decoder

    def shares(self, n: int) -> list:
        """The (start, stop) of each decoder's share of ``n`` streams."""
        total, acc, bounds, start = sum(self.weights), 0.0, [], 0
        for w in self.weights:
            acc += w
            stop = int(round(n * acc / total))
            bounds.append((start, stop))
            start = stop
        return bounds

    def decode(self, streams: list) -> list:
        bounds = self.shares(len(streams))
        cur = torch.cuda.current_stream(self.device) if self._cuda else None
        futures = [(j, self._threads[j].submit(self._side, j, streams[a:b]))
                   for j, (a, b) in enumerate(bounds) if j and b > a]
        results: dict = {}
        try:
            a, b = bounds[0]
            results[0] = self.parts[0].decode(streams[a:b]) if b > a else []
        finally:    # every share is waited for, even when one failed: no thread outlives the call's inputs
            for j, f in futures:
                try:
                    results[j] = f.result()
                except BaseException as e:  # noqa: BLE001 - raised below, after every share has returned
                    results[j] = e
        out = []
        for j, (a, b) in enumerate(bounds):
            got = results.get(j, [])
            if isinstance(got, BaseException):
                raise got
            if j and self._cuda and b > a:
                got, event = got
                cur.wait_event(event)
                for img in got:
                    if isinstance(img, torch.Tensor):   # freed later on the caller's stream, not the share's
                        img.record_stream(cur)
            if len(got) != b - a:
                raise RuntimeError(f"{self.parts[j].name} returned {len(got)} images for {b - a} streams")
            self.images[j] += b - a
            out.extend(got)
        return out

    def _side(self, j: int, streams: list):
        if not self._cuda:
            return self.parts[j].decode(streams)
        s = self._streams[j]
        with torch.cuda.stream(s):
            got = self.parts[j].decode(streams)
            event = torch.cuda.Event()
            event.record(s)
        return got, event

    def finish(self) -> None:
        for d in self.parts:
            d.finish()

    def release(self) -> list:
        return [x for d in self.parts for x in d.release()]


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
        self.tail = DeviceTail(plan.normalizes) if plan.to_float else None
        self._retired: collections.deque = collections.deque()   # (event, what the decoder's images hold)
        self._resize = _resizer(plan.mode.value, plan.antialias, device)
        # the geometry of a batch in one kernel launch (coordl.device.geometry_kernel): None until the
        # first batch decides (then the kernel, or False: one launch per image)
        self.batch_geometry = None if _batch_geometry_wanted(device, plan) else False

    def note(self) -> str:
        return f"{self.decoder.name} on {self.device}: {self.plan.describe()}"

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

    def decode(self, batch, stats, step=None):
        """The first half (the decode thread with workers), on the current
        stream (the delivery's copy stream): decode the batch's JPEGs, fall
        back to the CPU for those the decoder rejects, resolve the samples
        neither can read (raise or skip), copy the rows the workers prepared.
        Returns the batch (skipped rows removed; None when none is left) and
        leaves the decoded images in ``stats.device_pending`` for
        :meth:`stage_decoded`.  A batch of several chunks (``BUDGET``) has
        the geometry of all but its last chunk done here, so that no more
        than one chunk of full-size images waits."""
        blob, _, offsets = stats.device_blob
        stats.device_blob = None       # the slot goes back to its worker once the stage lets go of it
        paths = tuple(stats.device_marks)
        records = [_get(batch, p).tolist() for p in paths]    # per path, per row: the RECORD fields
        n, m = len(records[0]), len(paths)
        out = [[None] * n for _ in range(m)]
        errors: dict = {}
        on_device = on_cpu = 0
        todo = [(r, k) for r in range(n) for k in range(m) if records[k][r][KIND] == ON_DEVICE]
        chunks = list(_chunks(todo, records))
        # the last chunk's geometry waits for the second half, with what the
        # decoder's images hold (see _Pending)
        raw: list = []
        held: list = []
        for c, chunk in enumerate(chunks):
            defer = c == len(chunks) - 1
            streams = [_bytes(blob, offsets[r * m + k]) for r, k in chunk]
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
        oh, ow = self.plan.size
        for r in range(n):
            for k in range(m):
                if records[k][r][KIND] == ON_CPU:   # prepared by the CPU path in the worker (counted there)
                    x = _bytes(blob, offsets[r * m + k]).view(records[k][r][CHANNELS], oh, ow)
                    out[k][r] = x.to(self.device).to(torch.float32)
        del blob
        keep = self._errors(errors, records[0], stats, step) if errors else list(range(n))
        stats.decoded_device += on_device
        stats.decoded_cpu += on_cpu
        if not keep:
            return None
        stats.device_pending = _Pending(paths, records, out, raw, held, keep)
        return _rows(batch, keep, n) if len(keep) < n else batch

    def finish(self, pending: "_Pending") -> dict:
        """The second half's device work, on the current stream (the copy
        stream): the geometry of the images the first half left, each
        written straight into its row of the path's batch, then each path's
        batch rounded and converted: ``{path: images}``."""
        out, records, keep = pending.out, pending.records, pending.keep
        left = {(k, r): img for k, r, img in pending.raw}
        images = {}
        for k, path in enumerate(pending.paths):
            y = torch.empty((len(keep), records[k][keep[0]][CHANNELS], *self.plan.size), dtype=torch.float32,
                            device=self.device)
            batched = []
            geo = self._batched(left, records) if y.shape[1] == 3 else False
            for j, r in enumerate(keep):
                img = left.pop((k, r), None)
                if img is None:
                    y[j].copy_(out[k][r])
                elif geo:
                    batched.append((j, img, records[k][r]))
                else:
                    self._geometry(img, records[k][r], into=y[j:j + 1])
            if batched:
                geo.run(batched, y)
            y = y.round_().clamp_(0, 255).to(torch.uint8)
            flips = [bool(records[k][r][FLIP]) for r in keep]
            if all(flips):
                y = y.flip(-1)
            elif any(flips):     # one mirror for the batch: a few launches, not one per image
                mask = upload(np.asarray(flips), y.device).view(-1, 1, 1, 1)
                y = torch.where(mask, y.flip(-1), y)
            images[path] = self.tail(y) if self.tail is not None else y
        return images

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
        first batch decides, by the pixels alone: the kernel's rows for a
        few of its images against :meth:`_geometry`'s
        (:func:`~.geometry_kernel.agrees`).  Never by timing, which differs
        between runs: two loaders, or a run and its resume, take the same
        path and give the same pixels.  On a GPU the two are also timed;
        a kernel slower than the launches it replaces is a warning naming
        ``COORDL_DEVICE_GEOMETRY=per-image``."""
        if self.batch_geometry is None:
            from . import geometry_kernel as GK

            probe = [(img, records[k][r]) for (k, r), img in list(left.items())[:8]]
            if not probe:
                return False
            imgs, recs = [i for i, _ in probe], [r for _, r in probe]
            try:
                ok, what = GK.agrees(self, imgs, recs)
                if ok and self.device.type == "cuda":
                    quicker, speed = GK.faster(self, imgs, recs)
                    what += "; " + speed
                    if not quicker:
                        log.warning("decode='device': the batch-geometry kernel took longer than one launch per "
                                    "image on this GPU (%s); %s=per-image makes the stage launch per image (its "
                                    "pixels within %d level of the kernel's)", speed, _GEOMETRY_ENV, GK.TOLERANCE)
            except Exception as e:  # noqa: BLE001 - a Triton that cannot compile or launch here
                ok, what = False, f"{type(e).__name__}: {e}"
            log.info("decode='device': the batch-geometry kernel %s one launch per image (%s)",
                     "is used in place of" if ok else "is not used: its pixels differ from", what)
            self.batch_geometry = GK.BatchGeometry(self.plan.size) if ok else False
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
            if into is not None and t2 == 0 and l2 == 0 and (h2, w2) == (rh, rw):
                self._resize(x, (rh, rw), into)
                return into[0]
            x = self._resize(x, (rh, rw))
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


#: the tests run the batch-geometry kernel on the CPU (Triton's interpreter): True
BATCH_GEOMETRY_ON_CPU = False
_GEOMETRY_ENV = "COORDL_DEVICE_GEOMETRY"


def _batch_geometry_wanted(device: torch.device, plan) -> bool:
    """The batch-geometry kernel may run for ``plan`` on ``device``: the
    bilinear antialiased resize (or none), a CUDA device (the CPU only for
    the tests), Triton importable, and ``COORDL_DEVICE_GEOMETRY`` not
    ``per-image``."""
    want = os.environ.get(_GEOMETRY_ENV, "auto").strip().lower() or "auto"
    if want not in ("auto", "per-image"):
        raise ValueError(f'{_GEOMETRY_ENV} should be "auto" or "per-image", but got {_GEOMETRY_ENV}={want!r}')
    if want == "per-image" or (device.type != "cuda" and not BATCH_GEOMETRY_ON_CPU):
        return False
    if plan.resize is not None and (plan.mode.value != "bilinear" or not plan.antialias):
        return False
    from . import geometry_kernel as GK

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


class _Pending:
    """A batch between the two halves: the decoded images whose geometry
    is still to run (``raw``: (path number, row, image)), the images done
    (``out[path][row]``), the rows kept, and what the decoder's images
    hold (``held``)."""

    __slots__ = ("paths", "records", "out", "raw", "held", "keep")

    def __init__(self, paths, records, out, raw, held, keep) -> None:
        self.paths, self.records, self.out, self.raw, self.held, self.keep = paths, records, out, raw, held, keep


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
