"""The JPEG decoders of ``decode="device"`` (``COORDL_DEVICE_DECODER``):
what :class:`~.decode.DecodeStage` calls with a batch's compressed streams.

Every decoder has the same face: ``name``; ``decode(streams)`` (a list of
1-D uint8 CPU tensors) returns, in order, a (3, H, W) uint8 image on the
device or the exception for that stream; ``finish()`` waits for the work
queued on the decoder's images and lets them go; ``release()`` hands them
over without waiting (the stage keeps them until the staged batch's event).

Decoders (``COORDL_DEVICE_DECODER``): ``torchvision`` (default where it
imports: ``torchvision.io.decode_jpeg`` on a list, nvJPEG, batched: on
the GPU's hardware JPEG decoder where it has one (A100, H100, H200) for
baseline JPEGs, the others one by one with their Huffman decoding on the
CPU; one call at a time in the process, each waiting for its stream),
``nvimgcodec`` (NVIDIA nvImageCodec, ``nvidia-nvimgcodec-cu12``/``-cu13``,
libjpeg's chroma upsampling; used by default only where torchvision's is
missing), ``nvimgcodec-hw`` (nvImageCodec, the hardware decoder first),
``nvimgcodec-hybrid`` (nvImageCodec's hybrid decoder: Huffman decoding in
its CPU threads, the rest on the GPU), ``nvimgcodec-cuda`` (nvImageCodec's
CUDA decoder first: Huffman decoding too on the GPU's cores, beside its
hardware decoder's engines; plain chroma upsampling); several joined by ``+`` share each
batch by weight, each in a thread of its own (:class:`DecoderSplit`).  On
the CPU test device, :class:`HostDecoder` stands in for each
(libjpeg-turbo with nvJPEG's plain chroma upsampling), so the same stage,
inputs and parameters run in CI.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import torch

__all__ = ["HostDecoder", "TorchvisionDecoder", "NvImageCodecDecoder", "DecoderSplit", "decoder_for",
           "decoder_spec", "decoder_threads", "cpu_share", "DECODERS", "WORKERS"]

_ENV = "COORDL_DEVICE_DECODER"
_THREADS_ENV = "COORDL_DEVICE_DECODER_THREADS"
_CHECK_ENV = "COORDL_DEVICE_CHECK_DATA"


class HostDecoder:
    """The CPU standing in for the device decoder (tests, CI): libjpeg-turbo
    through simplejpeg, full size, with plain ("fast") chroma upsampling, as
    nvJPEG upsamples by default (DALI's ``jpeg_fancy_upsampling`` and
    nvImageCodec's ``fancy_upsampling`` options exist to make the GPU do
    libjpeg's interpolation instead), or with libjpeg's interpolation where
    it stands in for nvImageCodec (``fancy_upsampling``).  Same inputs, same
    outputs as a device decoder: (3, H, W) uint8 per stream, or the
    exception for it."""

    def __init__(self, device: torch.device | None = None, fancy_upsampling: bool = False) -> None:
        import simplejpeg

        self.device = device if device is not None else torch.device("cpu")
        self._sj = simplejpeg
        self._fast = not fancy_upsampling
        self.name = f"CPU stand-in (libjpeg-turbo, {'plain' if self._fast else 'interpolated'} chroma upsampling)"

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
        self._stream = None     # made at the first call on CUDA (nothing initializes CUDA at construction)

    def decode(self, streams: list) -> list:
        """The images of ``streams`` (or the exception for one), usable on
        the caller's current stream.  torchvision allocates its images on
        the current stream and writes them on a stream of its own, without
        waiting for the current stream's queued work: a block freed there
        by images whose geometry is still queued (the stage runs a batch
        ahead; a training step can hold the copy stream's kernels back)
        could be handed to the decoder and overwritten under them.  So the
        call runs with a stream of this decoder's own current, which only
        the decoder allocates from; the caller's stream waits for it, and
        each image is recorded on the caller's stream, so that its block
        is reused only after the caller's work on it ran."""
        if self.device.type != "cuda":
            return self._decode_all(streams)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        cur = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            out = self._decode_all(streams)
        cur.wait_stream(self._stream)
        for img in out:
            if isinstance(img, torch.Tensor):
                img.record_stream(cur)
        return out

    def _decode_all(self, streams: list) -> list:
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
        return []     # torch's tensors, recorded on the caller's stream: reused after the work on them ran


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
    #: the library's choice; label).  All of them but ``nvimgcodec-cuda`` interpolate chroma as libjpeg's
    #: "fancy" upsampling does (measured on nvImageCodec 0.9 with an H200's hardware decoder: within 1
    #: level of libjpeg's), where torchvision's nvJPEG call upsamples plainly.
    VARIANTS = {
        "nvimgcodec": (None, ""),
        # the GPU's hardware JPEG decoder (A100, H100, H200), CUDA and hybrid decoding for what it does not take
        "nvimgcodec-hw": (("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU"), " (hardware decoder first)"),
        # Huffman decoding in nvImageCodec's CPU threads, the rest on the GPU: beside the hardware decoder,
        # the capacity the hardware decoder does not have (DALI's split)
        "nvimgcodec-hybrid": (("HYBRID_CPU_GPU", "GPU_ONLY"), " (hybrid: Huffman in its CPU threads)"),
        # CUDA decoding first, Huffman codes included: the GPU's cores, not its JPEG engines, which the
        # hardware decoder and torchvision's call keep busy (the third H200 run: about 15,800 images/s from
        # them however many threads call); asked for plain chroma upsampling, as nvJPEG's CUDA decoder does
        # (with libjpeg's interpolation the third run's CUDA decoder decoded none of its files)
        "nvimgcodec-cuda": (("GPU_ONLY", "HW_GPU_ONLY", "HYBRID_CPU_GPU"), " (CUDA decoding first)"),
    }
    #: the decoder options of a configuration (default: the library's chroma upsampling)
    OPTIONS = {"nvimgcodec-cuda": ":fancy_upsampling=0"}

    def __init__(self, device: torch.device, variant: str = "nvimgcodec", cpu_threads: int = 0) -> None:
        """``variant``: a key of :attr:`VARIANTS` (the backends, in order);
        ``cpu_threads``: the most CPU threads nvImageCodec's decoding may
        use (its ``max_num_cpu_threads``; 0: its own choice, one per
        core)."""
        from nvidia import nvimgcodec

        kinds, label = self.VARIANTS[variant]
        self.device = device
        self._cuda = device.type == "cuda"
        threads = {"max_num_cpu_threads": int(cpu_threads)} if cpu_threads else {}
        self.name = "nvImageCodec" + (label if self._cuda else "") + \
            (f", {int(cpu_threads)} CPU threads" if cpu_threads else "")
        if self._cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            if kinds:
                self._dec = nvimgcodec.Decoder(
                    device_id=index, options=self.OPTIONS.get(variant, ""),
                    backends=[nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, k)) for k in kinds], **threads)
            else:
                self._dec = nvimgcodec.Decoder(device_id=index, options=":fancy_upsampling=1", **threads)
        else:
            self._dec = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                                           backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)],
                                           options=":fancy_upsampling=1", **threads)
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


#: the decoders COORDL_DEVICE_DECODER names (``auto``: torchvision's where it imports, else nvImageCodec's;
#: ``workers``: the loader's worker processes, on the CPU path, beside a device decoder)
WORKERS = "workers"
DECODERS = ("auto", "torchvision", "nvimgcodec", "nvimgcodec-hw", "nvimgcodec-hybrid", "nvimgcodec-cuda", WORKERS)


def decoder_spec(text: str | None = None) -> list:
    """``COORDL_DEVICE_DECODER`` (or ``text``) read as ``[(name, weight)]``:
    one decoder, or several joined by ``+``, each with an optional
    ``:weight`` (its share of each batch; default 1), e.g.
    ``torchvision:3+nvimgcodec-hybrid:2``; ``workers`` (at most once,
    beside a device decoder) weighs each of the loader's workers
    (:func:`cpu_share`).  ValueError naming the grammar."""
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
                f'{_ENV} should be one of "auto", "torchvision", "nvimgcodec", "nvimgcodec-hw", '
                f'"nvimgcodec-hybrid" or "nvimgcodec-cuda", or several of them joined by "+", each with an '
                f'optional ":weight" above 0 (its share of each batch, decoded in a thread of its own), e.g. '
                f'"torchvision:3+nvimgcodec-hybrid:2", and "workers:weight" (each worker\'s weight) beside them '
                f'for the workers to decode a share on the CPU; but got {_ENV}={raw!r}')
        parts.append((name, w))
    named = [n for n, _ in parts]
    if WORKERS in named and (named.count(WORKERS) > 1 or len(named) == 1):
        raise ValueError(
            f'{_ENV}: "workers" (the loader\'s workers decoding a share of the samples on the CPU) comes once, '
            f'beside a device decoder, e.g. "torchvision:39+workers:1"; for the workers to decode every sample '
            f'use decode="cpu"; but got {_ENV}={raw!r}')
    return parts


def cpu_share(num_workers: int, spec: list | None = None) -> float:
    """The share of the samples the loader's workers decode on the CPU path
    (``COORDL_DEVICE_DECODER``'s ``workers:w``): each worker weighs ``w``
    against the device decoders' weights, so that the share grows with the
    workers, as the CPU's capacity does: ``torchvision:39+workers:1`` gives
    15 workers 15/54 of the samples and 4 workers 4/43.  0 without
    ``workers`` or without workers (``num_workers=0``: the main process's
    time is the device stage's)."""
    spec = decoder_spec() if spec is None else spec
    per_worker = sum(w for n, w in spec if n == WORKERS)
    device = sum(w for n, w in spec if n != WORKERS)
    cpu = max(0, int(num_workers)) * per_worker
    return cpu / (cpu + device) if cpu else 0.0


def decoder_threads(num_workers: int) -> int:
    """The most CPU threads each nvImageCodec decoder of a loader may use:
    ``COORDL_DEVICE_DECODER_THREADS`` where it is set (0: nvImageCodec's own
    choice, one per core), else the loader's ``num_workers`` (at least 1),
    so that a loader's CPU is what its ``num_workers`` says, as DALI's
    ``num_threads``, and the loaders of a node's GPUs do not each start a
    thread per core.  ValueError naming the setting."""
    raw = os.environ.get(_THREADS_ENV, "").strip()
    if not raw:
        return max(1, int(num_workers))
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{_THREADS_ENV} should be a whole number of CPU threads for nvImageCodec's decoding, "
                         f"or 0 for one per core; but got {_THREADS_ENV}={raw!r}")
    return n


def check_data() -> bool:
    """``COORDL_DEVICE_CHECK_DATA``: whether the workers read each JPEG's
    entropy-coded data through libjpeg-turbo before the device decodes it
    (:func:`coordl.decode.jpeg.entropy_data_complete`), so that a file
    whose data ends early or is corrupt, which a GPU decoder decodes only
    in part (the rest of its pixels are what the memory held), is prepared
    on the CPU path instead, with the CPU path's pixels.  Off by default:
    it costs the workers about 0.8 ms of CPU per ImageNet-sized image.
    ValueError naming the setting."""
    raw = os.environ.get(_CHECK_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{_CHECK_ENV} should be 1 (or true, yes, on) for the workers to check each JPEG's data "
                     f"before the device decodes it, or 0 (false, no, off); but got {_CHECK_ENV}={raw!r}")


def decoder_for(device: torch.device, cpu_threads: int = 0):
    """The decoder for ``device``, as ``COORDL_DEVICE_DECODER`` names it
    (:func:`decoder_spec`): for CUDA, ``torchvision``, ``nvimgcodec``,
    ``nvimgcodec-hw`` (nvImageCodec with the hardware decoder first),
    ``nvimgcodec-hybrid`` (nvImageCodec's hybrid decoder: Huffman codes in
    its CPU threads), ``nvimgcodec-cuda`` (its CUDA decoder first) or
    ``auto`` (torchvision's where it imports, else
    nvImageCodec's); several make a :class:`DecoderSplit`.  nvImageCodec's
    decoders use at most ``cpu_threads`` CPU threads each (0: one per
    core; :func:`decoder_threads`).  On the CPU (the test device) each named
    decoder is a :class:`HostDecoder`, so that a split runs the same path in
    CI.  ValueError saying what to install when one cannot be made."""
    spec = [(n, w) for n, w in decoder_spec() if n != WORKERS]    # the workers' share never reaches the stage
    if device.type != "cuda":
        parts = [(HostDecoder(device, fancy_upsampling=upsamples_fancy(name)), w) for name, w in spec]
    else:
        parts = [(_one_decoder(name, device, cpu_threads), w) for name, w in spec]
    return parts[0][0] if len(parts) == 1 else DecoderSplit(parts, device)


def upsamples_fancy(name: str) -> bool:
    """Whether the decoder ``COORDL_DEVICE_DECODER`` names interpolates
    chroma as libjpeg's "fancy" upsampling (nvImageCodec's, every variant
    but ``nvimgcodec-cuda``, which asks for plain upsampling) rather than
    plainly (torchvision's nvJPEG call, and ``auto``, which is torchvision's
    wherever a CUDA build of torchvision is): what the CPU stand-in does in
    its place, so that a stand-in run gives the decoder's pixels up to its
    arithmetic."""
    return name.startswith("nvimgcodec") and "fancy_upsampling=0" not in NvImageCodecDecoder.OPTIONS.get(name, "")


def _one_decoder(want: str, device: torch.device, cpu_threads: int = 0):
    errors = []
    makers = [("torchvision", TorchvisionDecoder)] + [
        (name, functools.partial(NvImageCodecDecoder, variant=name, cpu_threads=cpu_threads))
        for name in NvImageCodecDecoder.VARIANTS]
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
