"""Loaders feeding a GPU, side by side in one run: delivery, a ResNet-50
training step, and four training jobs sharing the GPU.

Data: photo-like JPEGs of ImageNet's sizes (~110 KB, ``coordl.synth``),
generated into a temporary folder by a process pool: ``--unique`` images are
rendered and hard-linked under ``--images`` names (the decode cost of a name
is that of its image; the page cache holds each image once).  Every loader
runs RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor + Normalize.

Loader variants (``VARIANTS``; a later variant is one more entry there, and
one more row in ``JOB_ROWS`` for part (c)):

* ``torch``: ``torch.utils.data.DataLoader`` over torchvision's
  ``ImageFolder`` and transforms, ``pin_memory=True``, and
  ``.cuda(non_blocking=True)`` in the loop, as a user's script does;
* ``coordl-import``: the same script with only the import changed
  (``coordl.DataLoader``);
* ``coordl-device``: ``coordl.DataLoader(coordl.ImageFolder(...),
  device="cuda")`` with coordl's transforms;
* ``dali``: NVIDIA DALI's GPU pipeline (``fn.readers.file`` ->
  ``fn.decoders.image_random_crop(device="mixed")`` -> ``fn.resize`` ->
  ``fn.crop_mirror_normalize`` on the GPU), ``num_threads`` = the worker
  count, when ``nvidia.dali`` imports (part (d)); otherwise a line says why
  it was skipped;
* ``coordl-decode-device``: ``coordl-device`` with ``decode="device"``
  (JPEG decode on the GPU, the default decoder: torchvision's nvJPEG);
* ``coordl-decode-block``: ``coordl-decode-device`` with the device's
  host waits blocking (``COORDL_CUDA_WAIT=block``: torchvision's call
  waits for the GPU asleep, not spinning), put back after the row;
* ``coordl-decode-level`` (part (b) only): ``coordl-decode-block`` with
  its copy stream (the batch's geometry, conversion and copies) at the
  training stream's priority, 0, where coordl makes it -1, above it: the
  third H200 run's step ran at 93% of its ceiling beside
  ``coordl-decode-block`` while waiting for batches 1% of its window, so
  the loader's kernels slowed the step's own;
* ``coordl-decode-cuda``: ``coordl-decode-block`` with nvImageCodec's CUDA
  decoder first (``COORDL_DEVICE_DECODER=nvimgcodec-cuda``: Huffman
  decoding too on the GPU's cores, where torchvision's call and the
  hardware decoder share the GPU's JPEG engines), part (a) only, where
  ``nvidia.nvimgcodec`` imports; ``coordl-decode-split-cuda`` (only when
  ``--loaders`` names it) shares each batch between torchvision's nvJPEG
  and that decoder (``torchvision:1+nvimgcodec-cuda:2``);
* ``coordl-decode-nvimgcodec`` (only when ``--loaders`` names it): the same
  with NVIDIA nvImageCodec decoding (``COORDL_DEVICE_DECODER=nvimgcodec``),
  at most 4 workers, where ``nvidia.nvimgcodec`` imports
  (``benchmarks/gpu_wheels.sh --nvimgcodec``);
* ``coordl-decode-workers``: ``coordl-decode-block`` with the workers
  decoding a share of the samples on the CPU path beside the GPU's decoder,
  each worker weighing 1 against its 39
  (``COORDL_DEVICE_DECODER=torchvision:39+workers:1``: 15/54 of the samples
  at 15 workers, 8/47 at 8, 4/43 at 4);
* ``coordl-decode-measured`` (part (a), from 4 workers, with
  ``--decoders-json``): the same, each decoder weighing the images/s it
  was measured to deliver on this machine: torchvision's call and, where
  it decoded every file, nvImageCodec's CUDA decoder (its cores beside the
  JPEG engines), each alone at one thread in the decoders step of
  ``gpu_check.sh``, and each worker what one worker of the
  ``coordl-device`` row delivered at that worker count, so that every
  decoder is busy for the same time (the spec it ran is printed);
* ``coordl-decode-split-hw``: ``coordl-decode-block`` with each batch
  shared by torchvision's nvJPEG and nvImageCodec's hardware decoder, half
  each, in two threads (``COORDL_DEVICE_DECODER=torchvision:1+nvimgcodec-hw:1``),
  where ``nvidia.nvimgcodec`` imports: whether two decoders feed the GPU's
  JPEG engines beyond torchvision's call alone;
* ``coordl-decode-split`` (only when ``--loaders`` names it: slower than
  nvJPEG alone at every worker count in the third H200 run, 8,709 images/s
  at 15 workers against 12,531): each batch shared by torchvision's nvJPEG (the
  hardware decoder) and nvImageCodec's hybrid decoder (Huffman decoding in
  its CPU threads, as many as the row's workers unless
  ``COORDL_DEVICE_DECODER_THREADS`` says), three fifths and two fifths, in
  two threads
  (``COORDL_DEVICE_DECODER=torchvision:3+nvimgcodec-hybrid:2``), where
  ``nvidia.nvimgcodec`` imports;
* ``coordl-decode-deep`` (part (b) only, when ``--loaders`` names it: the
  third H200 run measured no gain, 89% of the ceiling against 90%):
  ``coordl-decode-device`` with
  ``prefetch_factor=4``, four batches staged ahead of the training loop in
  place of two: whether the loop's waits in ``next()`` are the loader's
  bursts (its decoder calls slowed by the training kernels) rather than
  its rate;
* ``coordl-decode-split-nv`` (when ``--loaders`` names it, as the next
  row: both were slower than nvJPEG alone at every worker count in the
  third H200 run): the same split with nvImageCodec's hardware
  decoder in torchvision's place
  (``COORDL_DEVICE_DECODER=nvimgcodec-hw:3+nvimgcodec-hybrid:2``), part (a)
  only;
* ``coordl-decode-hw``: the same with nvImageCodec's hardware JPEG decoder
  first (``COORDL_DEVICE_DECODER=nvimgcodec-hw``), at most 4 workers.

The rows run in this order, the least telling last: ``--budget`` skips
from the end.

Parts:

(a) images/s delivered on the GPU at 1, 4, 8 and 15 workers, batch 128,
    and the machine's busy CPU time per image over the same window;
(b) a ResNet-50 training step (torchvision's ``resnet50``, bf16 autocast,
    channels_last, SGD, batch 256): images/s on synthetic data already on
    the GPU (the ceiling) and fed by each loader at 15 workers, as a
    fraction of the ceiling; the ceiling and the rows ``--profile-b`` names
    (``coordl-device`` and ``coordl-decode-block``) then run
    ``--profile-seconds`` more under torch.profiler: the device time per
    image on each CUDA stream (the step's, the loader's), its costliest
    kernels, and the share of the window any stream ran, so that a step
    below its ceiling shows whether its own kernels ran longer beside the
    loader's or the GPU sat idle;
(c) four ResNet-18 jobs training on the one GPU from the same folder,
    separate processes started together (3 workers each, batch 128):
    torch, coordl ``share=False``, coordl ``share=True``; images/s of each
    job against one job alone.  Each job warms up, waits until all are
    ready, then skips what its loader prefetched meanwhile (2 x workers + 1
    batches) before its window;
(d) whether DALI ran (its rows are in (a) and (b)).

Each measurement is time-boxed: one epoch, a warm-up of ``workers + 2``
batches (every worker has delivered), then a window of a few seconds
(``--seconds``, ``--train-seconds``, ``--job-seconds``) that closes early at
the end of the epoch (an epoch boundary's restart is not measured); the
device is synchronized at both ends of the window.  With ``--budget``, a
measurement that would not end within that many seconds of the start is
skipped, its row saying so (the GPU check runs it so that it ends in time).  A
variant that raises prints its error and the run goes on; the JSON
(``--out``) is rewritten after every measurement, with the machine's facts
(GPU, CPUs, versions, date).

    python benchmarks/gpu.py --out gpu.json            # ~5 minutes on an H100 with 16 vCPUs
    python benchmarks/gpu.py --parts a,b --workers 1,15 --seconds 2
    python benchmarks/gpu.py --smoke --out smoke.json  # tiny sizes; CPU when there is no CUDA

On the CPU (``--smoke`` only) the ``decode="device"`` rows run with the
CPU decoder standing in for the GPU's (``device="cpu"``), so that their
plumbing is checked before a GPU run; their figures say nothing of a GPU.

torchvision's PyPI wheel does not import beside a CPU build of torch; this
script then loads it the way the test suite does (tests/_torchvision.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import datetime
import gc
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

import psutil  # noqa: E402
import torch  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


# ---------------------------------------------------------------- settings

@dataclasses.dataclass
class Ctx:
    """What every loader and measurement of a run shares."""
    root: str
    device: torch.device
    size: int = 224            # crop size
    batch_timeout: float = 120.0  # DataLoader(timeout=) with workers: a stuck loader raises
    decoders: dict | None = None  # the decoders step's JSON (device_decoders.py), for coordl-decode-measured
    rates: dict = dataclasses.field(default_factory=dict)    # part (a): (row, workers) -> images/s measured

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def _torchvision():
    from _torchvision import import_torchvision

    tv = import_torchvision()
    if tv is None:
        raise RuntimeError("torchvision is not installed: pip install torchvision (or coordl[test])")
    import torchvision.datasets  # noqa: F401
    import torchvision.models  # noqa: F401
    import torchvision.transforms  # noqa: F401
    return tv


def tv_pipeline(size: int):
    T = _torchvision().transforms
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])


def coordl_pipeline(size: int):
    from coordl import transforms as T

    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])


# ---------------------------------------------------------------- loader variants

class Source:
    """One loader under test: ``epoch()`` yields ``(images, labels)`` on the
    device for one epoch; ``close()`` drops the loader (workers end)."""

    def __init__(self, loader: Any, device: torch.device | None = None):
        self.loader = loader
        self.device = device  # set: the loop moves each batch (`.cuda(non_blocking=True)`)
        self.decoders = None  # the COORDL_DEVICE_DECODER a row chose at run time (kept in its figures)

    def epoch(self) -> Iterator:
        if self.device is None:
            yield from self.loader
            return
        dev = self.device
        for images, labels in self.loader:
            yield images.to(dev, non_blocking=True), labels.to(dev, non_blocking=True)

    def close(self) -> None:
        self.loader = None


def _dl_kwargs(ctx: Ctx, workers: int) -> dict:
    return {"num_workers": workers, "shuffle": True, "drop_last": True,
            "timeout": ctx.batch_timeout if workers > 0 else 0}


def make_torch(ctx: Ctx, workers: int, batch_size: int, **extra) -> Source:
    tv = _torchvision()
    ds = tv.datasets.ImageFolder(ctx.root, transform=tv_pipeline(ctx.size))
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, pin_memory=ctx.cuda,
                                         **_dl_kwargs(ctx, workers), **extra)
    return Source(loader, ctx.device)


def make_coordl_import(ctx: Ctx, workers: int, batch_size: int, **extra) -> Source:
    import coordl

    tv = _torchvision()
    ds = tv.datasets.ImageFolder(ctx.root, transform=tv_pipeline(ctx.size))
    loader = coordl.DataLoader(ds, batch_size=batch_size, pin_memory=ctx.cuda, **_dl_kwargs(ctx, workers), **extra)
    return Source(loader, ctx.device)


def make_coordl_device(ctx: Ctx, workers: int, batch_size: int, **extra) -> Source:
    import coordl

    ds = coordl.ImageFolder(ctx.root, transform=coordl_pipeline(ctx.size))
    kw = {"seed": 0, "share": False, **extra}
    loader = coordl.DataLoader(ds, batch_size=batch_size, device=ctx.device, **_dl_kwargs(ctx, workers), **kw)
    return Source(loader)


class DaliSource(Source):
    def __init__(self, pipe, it):
        super().__init__(it)
        self.pipe = pipe

    def epoch(self) -> Iterator:
        for out in self.loader:
            yield out[0]["images"], out[0]["labels"].view(-1)

    def close(self) -> None:
        self.loader = self.pipe = None


def make_dali(ctx: Ctx, workers: int, batch_size: int, **extra) -> Source:
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(batch_size=batch_size, num_threads=max(1, workers), device_id=ctx.device.index or 0,
                  seed=1, prefetch_queue_depth=2)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=ctx.root, random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB,
                                               random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
        images = fn.resize(images, resize_x=ctx.size, resize_y=ctx.size)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                          mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD],
                                          mirror=fn.random.coin_flip(probability=0.5))
        return images, labels.gpu()

    p = pipe(**extra)
    p.build()
    it = DALIGenericIterator([p], ["images", "labels"], reader_name="reader",
                             last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)
    return DaliSource(p, it)


def dali_unavailable(ctx: Ctx) -> str | None:
    """Why DALI's GPU pipeline cannot run here, or None."""
    if not ctx.cuda:
        return f"DALI's GPU pipeline needs a CUDA device (device is {ctx.device})"
    try:
        import nvidia.dali  # noqa: F401
        import nvidia.dali.plugin.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import means: not here
        return f"nvidia.dali does not import: {type(e).__name__}: {e}"
    return None


@dataclasses.dataclass
class Variant:
    """A row of parts (a) and (b).  ``make(ctx, workers, batch_size, **extra)``
    returns a :class:`Source`; ``unavailable(ctx)`` says why it cannot run
    here (the row is skipped with that line), or None."""
    name: str
    make: Callable[..., Source]
    describe: str
    unavailable: Callable[[Ctx], str | None] = lambda ctx: None
    max_workers_b: int | None = None     # part (b) runs it with at most this many workers
    max_workers_a: int | None = None     # part (a) runs it only at worker counts up to this
    min_workers_a: int | None = None     # ... and from this (a split's CPU share at one worker tells little)
    in_b: bool = True                    # part (b) runs it
    in_a: bool = True                    # part (a) runs it
    default: bool = True                 # runs without --loaders (else only when named there)


def device_decode_unavailable(ctx: Ctx) -> str | None:
    """decode="device" needs a CUDA device; on the CPU (``--smoke`` only)
    the CPU stand-in runs the rows, so that their plumbing is checked
    before a GPU run (its figures say nothing of a GPU's)."""
    return None if ctx.device.type in ("cuda", "cpu") else f'decode="device" needs a CUDA device (device is {ctx.device})'


class _Restoring(Source):
    """``inner`` with ``undo`` run when it closes: a row that changed
    process-wide state for its loader (the device's host waits, the copy
    stream's priority) puts it back, so that the rows after it run as
    before.  ``ordinal``: the device whose waits the row set (its figures
    say which it ran with), kept through nesting."""

    def __init__(self, inner: Source, undo: Callable[[], None], ordinal: int | None = None):
        super().__init__(inner.loader, inner.device)
        self.inner, self.undo = inner, undo
        self.ordinal = ordinal if ordinal is not None else getattr(inner, "ordinal", None)

    def close(self) -> None:
        self.inner.close()
        super().close()
        self.undo()


def make_coordl_decoder(spec: str, wait: str | None = None, priority: int | None = None) -> Callable[..., Source]:
    """decode="device" with ``COORDL_DEVICE_DECODER=spec`` (a loader picks
    its decoder from the environment when it is made) and, with ``wait``,
    ``COORDL_CUDA_WAIT=wait`` (set by the loader's first pass, undone when
    the source closes); with ``priority``, its copy stream (where the
    geometry and the conversion run, made at the loader's first pass) at
    that priority in place of coordl's (``CudaStreams.PRIORITY``, put back
    when the source closes)."""

    def at(src: Source) -> Source:
        if priority is None:
            return src
        from coordl.device import delivery

        before = delivery.CudaStreams.PRIORITY
        delivery.CudaStreams.PRIORITY = priority
        return _Restoring(src, lambda: setattr(delivery.CudaStreams, "PRIORITY", before))

    def make(ctx: Ctx, workers: int, batch_size: int, **extra) -> Source:
        env = {"COORDL_DEVICE_DECODER": spec, **({"COORDL_CUDA_WAIT": wait} if wait else {})}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            before = None
            if wait and ctx.cuda:
                from coordl.device import waits
                torch.zeros(1, device=ctx.device)     # the context whose flags the loader will change
                before = waits.scheduling(cuda_index(ctx.device))
            src = make_coordl_device(ctx, workers, batch_size, decode="device", **extra)
            if before is not None:
                ordinal = cuda_index(ctx.device)
                src = _Restoring(src, lambda: waits.set_scheduling(ordinal, before), ordinal)
            return at(src)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return make


def nvimgcodec_unavailable(ctx: Ctx) -> str | None:
    """nvImageCodec's row: a CUDA device and ``nvidia.nvimgcodec`` importable."""
    why = device_decode_unavailable(ctx)
    if why:
        return why
    try:
        from nvidia import nvimgcodec  # noqa: F401
    except Exception as e:  # noqa: BLE001 - absent, or present without its libraries
        return (f"nvidia.nvimgcodec does not import ({type(e).__name__}: {e}); benchmarks/gpu_wheels.sh "
                "--nvimgcodec carries it")
    return None


#: the decoders of the coordl-decode-split row: torchvision's nvJPEG (the hardware decoder, one call
#: at a time) beside nvImageCodec's hybrid decoder (Huffman decoding in its CPU threads), three fifths
#: and two fifths of each batch
SPLIT = "torchvision:3+nvimgcodec-hybrid:2"
#: the same split with nvImageCodec's hardware decoder in torchvision's place: no process-wide lock, and
#: its work on the loader's own (higher-priority) stream
SPLIT_NV = "nvimgcodec-hw:3+nvimgcodec-hybrid:2"

#: torchvision's nvJPEG beside nvImageCodec's hardware decoder, half each: two decoders feeding the GPU's
#: JPEG engines at once (torchvision's call, one at a time in the process, alone delivered 15,800
#: images/s on the H200, under the 18,400-21,700 that 1.2x DALI at 8-15 threads asks)
SPLIT_HW = "torchvision:1+nvimgcodec-hw:1"
#: torchvision's nvJPEG (the GPU's JPEG engines) beside nvImageCodec's CUDA decoder (its cores), one third
#: and two thirds of each batch: whether the two kinds of decoding add up
SPLIT_CUDA = "torchvision:1+nvimgcodec-cuda:2"
#: torchvision's nvJPEG beside the loader's workers decoding a share on the CPU path, each worker
#: weighing 1 against the GPU decoder's 39: the third H200 run's torchvision call alone (15,800
#: images/s, the decoders step) over one worker's CPU-path images/s (6,077 from 15 workers, part (a)),
#: so both are busy when the decode thread is the call; 15/54 of the samples at 15 workers, 8/47 at 8,
#: 4/43 at 4 (28:1 before, from the second run's 9,279 images/s of the whole stage: 35% at 15 workers,
#: more than 15 workers' CPU could prepare at the rate the GPU's share asked)
WORKERS_SPLIT = "torchvision:39+workers:1"

#: the decoders step's rows (device_decoders.py) whose images/s weigh coordl-decode-measured's decoders
#: (torchvision's: with blocking waits, as the row runs, else with CUDA's own)
TV_ROWS = ("torchvision.io.decode_jpeg batched (nvJPEG), blocking waits", "torchvision.io.decode_jpeg batched (nvJPEG)")
CUDA_ROW = "nvImageCodec CUDA decoder, plain upsampling"


def measured_spec(ctx: Ctx, workers: int) -> tuple[str, str]:
    """``(COORDL_DEVICE_DECODER, how)`` with each decoder weighing what it
    was measured to deliver on this machine: torchvision's call and, where
    it decoded every file, nvImageCodec's CUDA decoder at one thread in the
    decoders step (each alone), and each worker what one worker of part
    (a)'s ``coordl-device`` row delivered at this worker count (the CPU
    path, every core used).  Raises when a figure is missing."""
    rows = (ctx.decoders or {}).get("rows") or {}

    def rate(name):
        r = rows.get(name) or {}
        one = r.get("1 threads") or {}
        if (r.get("pixels") or {}).get("undecoded") or one.get("undecoded"):
            return None         # decoded only some of the files: not a decoder for them
        return one.get("images_per_s")

    tv = next((x for x in map(rate, TV_ROWS) if x), None)
    if not tv:
        raise RuntimeError(f"the decoders step has no images/s for {TV_ROWS[-1]!r}")
    per_worker = (ctx.rates.get(("coordl-device", workers)) or 0) / workers
    if not per_worker:
        raise RuntimeError(f"coordl-device was not measured at {workers} workers")
    cu = rate(CUDA_ROW)
    spec = f"torchvision:{tv:.0f}" + (f"+nvimgcodec-cuda:{cu:.0f}" if cu else "") + f"+workers:{per_worker:.0f}"
    how = (f"torchvision {tv:,.0f}" + (f", nvImageCodec's CUDA decoder {cu:,.0f}" if cu else
                                       ", nvImageCodec's CUDA decoder not measured decoding every file")
           + f", one worker {per_worker:,.0f} images/s")
    return spec, how


def make_measured(ctx: Ctx, workers: int, batch_size: int, **extra) -> Source:
    spec, how = measured_spec(ctx, workers)
    src = make_coordl_decoder(spec, wait="block")(ctx, workers, batch_size, **extra)
    src.decoders = f"COORDL_DEVICE_DECODER={spec} ({how})"
    return src


def _read_decoders(path: str | None) -> dict | None:
    """The decoders step's JSON, or None (no path, or no file: the step was
    skipped or cut before it wrote one)."""
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def measured_unavailable(ctx: Ctx) -> str | None:
    why = device_decode_unavailable(ctx)
    if why:
        return why
    if ctx.decoders is None:
        return "no decoders step's JSON (--decoders-json: gpu_check.sh passes device_decoders.py's)"
    return None


# Rows of parts (a) and (b), in order: the least telling last, as --budget skips from the end.  A coordl
# option is one more entry (make_coordl_device passes keyword arguments on to coordl.DataLoader).
VARIANTS: list[Variant] = [
    Variant("torch", make_torch, "torch DataLoader, pin_memory=True, .cuda(non_blocking=True)"),
    Variant("coordl-import", make_coordl_import, "coordl, only the import changed"),
    Variant("coordl-device", make_coordl_device, 'coordl.ImageFolder, device="cuda"'),
    Variant("dali", make_dali, "DALI GPU pipeline (mixed decode)", dali_unavailable),
    Variant("coordl-decode-device", functools.partial(make_coordl_device, decode="device"),
            'coordl.ImageFolder, device="cuda", decode="device" (JPEG decode on the GPU)',
            device_decode_unavailable, max_workers_b=4),
    Variant("coordl-decode-block", make_coordl_decoder("torchvision", wait="block"),
            'the same as coordl-decode-device, the host waits blocking (COORDL_CUDA_WAIT=block)',
            device_decode_unavailable, max_workers_b=4),
    Variant("coordl-decode-level", make_coordl_decoder("torchvision", wait="block", priority=0),
            "the same as coordl-decode-block, its copy stream (the geometry, the conversion, the copies) at the "
            "training stream's priority (0) in place of above it (-1): whether the batch kernels scheduled ahead "
            "of the training step's cost it more than they save (part (b) only)",
            device_decode_unavailable, max_workers_b=4, in_a=False),
    Variant("coordl-decode-cuda", make_coordl_decoder("nvimgcodec-cuda", wait="block"),
            "the same as coordl-decode-block, nvImageCodec's CUDA decoder first (Huffman decoding too on the GPU's "
            "cores, not its JPEG engines; COORDL_DEVICE_DECODER=nvimgcodec-cuda)",
            nvimgcodec_unavailable, in_b=False),
    Variant("coordl-decode-nvimgcodec", make_coordl_decoder("nvimgcodec"),
            'the same, NVIDIA nvImageCodec decoding (COORDL_DEVICE_DECODER=nvimgcodec)',
            nvimgcodec_unavailable, max_workers_a=4, in_b=False, default=False),
    Variant("coordl-decode-workers", make_coordl_decoder(WORKERS_SPLIT, wait="block"),
            f"the same as coordl-decode-block, the workers decoding a share of the samples on the CPU path, "
            f"which grows with them (COORDL_DEVICE_DECODER={WORKERS_SPLIT})",
            device_decode_unavailable, max_workers_b=4, min_workers_a=4),
    Variant("coordl-decode-measured", make_measured,
            "the same as coordl-decode-block, each decoder weighing the images/s it was measured to deliver on "
            "this machine: torchvision's call and nvImageCodec's CUDA decoder (the decoders step, where it decoded "
            "every file), each worker one coordl-device worker's at that worker count (part (a))",
            measured_unavailable, in_b=False, min_workers_a=4),
    Variant("coordl-decode-split-hw", make_coordl_decoder(SPLIT_HW, wait="block"),
            f"the same as coordl-decode-block, each batch shared by torchvision's nvJPEG and nvImageCodec's "
            f"hardware decoder, each in a thread of its own (COORDL_DEVICE_DECODER={SPLIT_HW})",
            nvimgcodec_unavailable, max_workers_b=4, min_workers_a=4),
    Variant("coordl-decode-split", make_coordl_decoder(SPLIT),
            f"the same, each batch shared by torchvision's nvJPEG (the hardware decoder) and nvImageCodec's "
            f"hybrid decoder, each in a thread of its own (COORDL_DEVICE_DECODER={SPLIT})",
            nvimgcodec_unavailable, max_workers_b=4, min_workers_a=4, default=False),
    Variant("coordl-decode-deep", functools.partial(make_coordl_device, decode="device", prefetch_factor=4),
            "the same as coordl-decode-device with prefetch_factor=4: four batches staged ahead of the training "
            "loop in place of two (whether the loop's waits are the loader's bursts)",
            device_decode_unavailable, max_workers_b=4, in_a=False, default=False),
    Variant("coordl-decode-split-cuda", make_coordl_decoder(SPLIT_CUDA, wait="block"),
            f"the same as coordl-decode-block, each batch shared by torchvision's nvJPEG (the JPEG engines) and "
            f"nvImageCodec's CUDA decoder (the GPU's cores), each in a thread of its own "
            f"(COORDL_DEVICE_DECODER={SPLIT_CUDA})",
            nvimgcodec_unavailable, in_b=False, min_workers_a=4, default=False),
    Variant("coordl-decode-split-nv", make_coordl_decoder(SPLIT_NV),
            f"the same, each batch shared by nvImageCodec's hardware decoder and its hybrid decoder, each in a "
            f"thread of its own (COORDL_DEVICE_DECODER={SPLIT_NV})",
            nvimgcodec_unavailable, in_b=False, min_workers_a=4, default=False),
    Variant("coordl-decode-hw", make_coordl_decoder("nvimgcodec-hw"),
            "the same, nvImageCodec with the GPU's hardware JPEG decoder first "
            "(COORDL_DEVICE_DECODER=nvimgcodec-hw)",
            nvimgcodec_unavailable, max_workers_a=4, in_b=False, default=False),
]

# Part (c): (row label, variant name, extra keyword arguments of its make()), the most telling first: the
# check's budget skips from the end (the third H200 run measured only the first row of torch, coordl,
# coordl share=True)
JOB_ROWS: list[tuple[str, str, dict]] = [
    ("coordl share=True", "coordl-device", {"share": True}),
    ("coordl", "coordl-device", {"share": False}),
    ("torch", "torch", {}),
]


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"variant should be one of {[v.name for v in VARIANTS]}, but got {name!r}")


# ---------------------------------------------------------------- measuring

def _sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)


def _busy(t) -> float:
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)


def _children(me) -> dict:
    """pid -> (CPU seconds, voluntary, involuntary context switches) of the
    processes below this one (the loader's workers)."""
    out = {}
    for p in me.children(recursive=True):
        try:
            with p.oneshot():
                t, c = p.cpu_times(), p.num_ctx_switches()
            out[p.pid] = (t.user + t.system, c.voluntary, c.involuntary)
        except psutil.Error:
            pass
    return out


def measure(ctx: Ctx, batches: Iterator, warmup: int, seconds: float, step: Callable | None = None,
            on_ready: Callable[[], int] | None = None, loader_stats: Callable | None = None) -> dict:
    """Images/s over a window of ``seconds`` after ``warmup`` batches, within
    the epoch ``batches`` yields (the window closes early at its end).
    ``step(images, labels)`` runs on each batch (a training step), or
    nothing.  ``on_ready()`` (jobs of part (c)) is called after the warm-up,
    blocks until every job is ready, and returns further batches to skip.
    ``loader_stats()`` (a coordl loader's ``stats``) adds, for
    ``decode="device"``, the shares of the window its decoder's calls and
    the geometry after them took."""
    t_start = time.perf_counter()
    first = None

    waited = [0.0]

    def pull():
        w0 = time.perf_counter()
        x, y = next(batches)
        waited[0] += time.perf_counter() - w0
        if step is not None:
            step(x, y)
        return x

    try:
        for i in range(warmup):
            pull()
            if first is None:
                first = time.perf_counter() - t_start
        if on_ready is not None:
            _sync(ctx)
            for _ in range(on_ready()):
                pull()
    except StopIteration:
        raise RuntimeError(f"the epoch ended within the {warmup}-batch warm-up: use more --images") from None
    _sync(ctx)
    me = psutil.Process()
    dec0 = _decode_seconds(loader_stats)
    kids0 = _children(me)
    threads0 = _thread_cpu(me)
    cpu0, me0, t0 = psutil.cpu_times(), me.cpu_times(), time.perf_counter()
    waited[0] = 0.0
    images = n_batches = 0
    cut = False
    while time.perf_counter() - t0 < seconds:
        try:
            x = pull()
        except StopIteration:
            cut = True
            break
        images += int(x.shape[0])
        n_batches += 1
    _sync(ctx)
    t1 = time.perf_counter()
    cpu1, me1 = psutil.cpu_times(), me.cpu_times()
    threads1 = _thread_cpu(me)
    kids1 = _children(me)
    dec1 = _decode_seconds(loader_stats)
    win = t1 - t0
    busy = _busy(cpu1) - _busy(cpu0)
    # a window cut at the epoch's end may have lost workers that exited: their share is unknown
    both = kids0.keys() & kids1.keys() if not cut else set()
    kid = [sum(kids1[p][i] - kids0[p][i] for p in both) for i in range(3)]
    per = (lambda v, scale=1.0: round(scale * v / images, 3)) if images and both else (lambda v, scale=1.0: None)
    return {"images_per_s": round(images / win, 1) if win > 0 else 0.0, "images": images, "batches": n_batches,
            "window_s": round(win, 3), "cut_at_epoch_end": cut, "first_batch_s": round(first or 0.0, 3),
            "cpu_ms_per_image": round(1000 * busy / images, 3) if images else None,
            "main_process_cpu": round(((me1.user + me1.system) - (me0.user + me0.system)) / win, 3) if win else None,
            # where the machine's CPU went (the bound on scaling workers): busy vCPUs over the
            # window, the worker processes' CPU per image, their context switches per image
            "cores_busy": round(busy / win, 2) if win else None,
            "worker_processes": len(both), "workers_cpu_ms_per_image": per(kid[0], 1000.0),
            "workers_switches_per_image": {"voluntary": per(kid[1]), "involuntary": per(kid[2])},
            # the loop's share of the window spent waiting in next() (the loader behind), and
            # the main process's threads by name, in cores (which of its threads is the bound)
            "data_wait_share": round(waited[0] / win, 3) if win else None,
            "main_threads_cores": {k: round((threads1.get(k, 0.0) - v) / win, 3)
                                   for k, v in threads0.items() if win and threads1.get(k, 0.0) - v > 0.01 * win},
            # decode="device": the window's share spent in the decoder's calls (the decode thread)
            # and in the geometry after them (the pin thread); near 1: that thread is the bound
            "decode_call_share": round((dec1[0] - dec0[0]) / win, 3) if win and dec0[0] is not None else None,
            "geometry_share": round((dec1[1] - dec0[1]) / win, 3) if win and dec0[1] is not None else None}


def _decode_seconds(loader_stats: Callable | None) -> tuple:
    """(device_decode_seconds, device_geometry_seconds) of a coordl loader
    with decode="device", else (None, None)."""
    try:
        st = loader_stats() if loader_stats is not None else None
    except Exception:  # noqa: BLE001 - figures only
        st = None
    if st is None or not getattr(st, "device_decode", ""):
        return None, None
    return st.device_decode_seconds, st.device_geometry_seconds


def device_time_by_stream(events: list, window_s: float, images: int) -> dict:
    """What the GPU ran over a profiled window, from a Chrome trace's events
    (torch.profiler's): per CUDA stream, its kernels', copies' and fills'
    device time per image and as a share of the window, and its three
    costliest kernels; the busiest stream is named (a training step's); and
    the share of the window in which any stream ran.  A step slowed beside a
    loader shows here as more device time per image on the training stream
    than alone (its kernels contend), or as the loader's streams' time."""
    spans: dict = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        args = e.get("args") or {}
        sid = args.get("stream")
        if sid is None:
            continue
        spans.setdefault(str(sid), []).append((float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("name", "?"))))
    out: dict = {"window_s": round(window_s, 3), "images": images, "streams": {}}
    if not spans or window_s <= 0 or not images:
        return out
    every = []
    for sid, ev in spans.items():
        total = sum(d for _, d, _ in ev)
        by_name: dict = {}
        for _, d, n in ev:
            by_name[n] = by_name.get(n, 0.0) + d
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:3]
        out["streams"][sid] = {"us_per_image": round(total / images, 2),
                               "share_of_window": round(total / 1e6 / window_s, 3), "ops": len(ev),
                               "top": [[n[:80], round(d / images, 2)] for n, d in top]}
        every.extend((t, t + d) for t, d, _ in ev)
    out["busiest"] = max(out["streams"], key=lambda k: out["streams"][k]["us_per_image"])
    every.sort()
    busy, end = 0.0, None
    for a, b in every:              # the union of every stream's intervals
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    out["any_stream_busy_share"] = round(busy / 1e6 / window_s, 3)
    return out


def profile_steps(ctx: Ctx, batches: Iterator, step: Callable, seconds: float) -> dict:
    """Training steps on ``batches`` for ``seconds`` under torch.profiler
    (the device's activity where it is CUDA), summarized by
    :func:`device_time_by_stream`."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    _sync(ctx)
    images = 0
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            try:
                x, y = next(batches)
            except StopIteration:
                break
            step(x, y)
            images += int(x.shape[0])
        _sync(ctx)
        win = time.perf_counter() - t0
    fd, path = tempfile.mkstemp(suffix=".json", prefix="coordl-gpu-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return device_time_by_stream(events, win, images)


def _profile_line(p: dict | None) -> str:
    if not p or not p.get("streams"):
        return ""
    busiest = p["busiest"]
    parts = []
    for sid, s in sorted(p["streams"].items(), key=lambda kv: -kv[1]["us_per_image"]):
        tag = "the step's" if sid == busiest else "other"
        top = "; ".join(f"{n} {us:.1f}" for n, us in s["top"][:2])
        parts.append(f"stream {sid} ({tag}) {s['us_per_image']:.1f} us/image, {s['share_of_window']:.0%} "
                     f"[{top}]")
        if len(parts) == 4:
            break
    return (f"\n{'':22}GPU time (profiled {p['window_s']:.1f} s, any stream busy "
            f"{p.get('any_stream_busy_share', 0):.0%}): " + " | ".join(parts))


def _threads(r: dict) -> str:
    t = r.get("main_threads_cores") or {}
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(t.items(), key=lambda kv: -kv[1])) or "-"


def _where(r: dict) -> str:
    """decode="device": the main process's threads and the window's shares
    in the decoder's calls and in the geometry (empty for other loaders)."""
    if r.get("decode_call_share") is None:
        return ""
    kernel = {True: f" ({r.get('geometry_kernel_kind') or 'a'} kernel per batch)",
              False: " (one launch per image)"}.get(r.get("geometry_kernel"), "")
    waits = f"; waits {r['waits']}" if r.get("waits") else ""
    cpu = f"; prepared on the CPU path {r['on_cpu_share']:.0%}" if r.get("on_cpu_share") else ""
    chosen = f"\n{'':22}{r['decoders']}" if r.get("decoders") else ""
    return (f"\n{'':22}decoder calls {r['decode_call_share']:.0%} of the window, geometry{kernel} "
            f"{r['geometry_share']:.0%}; main process's threads, cores: {_threads(r)}{waits}{cpu}{chosen}")


def _thread_cpu(proc) -> dict:
    """CPU seconds of this process's threads, summed by thread name
    (threads Python does not know, such as torch's, as "other")."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict = {}
    try:
        for t in proc.threads():
            k = names.get(t.id, "other")
            out[k] = out.get(k, 0.0) + t.user_time + t.system_time
    except psutil.Error:
        pass
    return out


def run_variant(ctx: Ctx, v: Variant, workers: int, batch_size: int, warmup: int, seconds: float,
                step: Callable | None = None, profile_seconds: float = 0.0) -> dict:
    """One measurement of one variant; an error is printed and returned as
    ``{"error": ...}`` so that the other figures are kept.  With
    ``profile_seconds`` (and a ``step``), the same pass then runs that long
    under the profiler (``row["profile"]``, :func:`profile_steps`)."""
    why = v.unavailable(ctx)
    if why:
        return {"skipped": why}
    src = gen = None
    try:
        src = v.make(ctx, workers, batch_size)
        gen = src.epoch()
        stats = getattr(src.loader, "stats", None)
        row = measure(ctx, gen, warmup, seconds, step, loader_stats=stats if callable(stats) else None)
        stage = getattr(src.loader, "_decode_stage", None)
        if stage is not None:   # decode="device": whether the batch's geometry ran in a batch kernel, which
            row["geometry_kernel"] = bool(stage.batch_geometry)
            row["geometry_kernel_kind"] = stage.batch_geometry.kind if stage.batch_geometry else None
            st = src.loader.stats()     # and the share of its images the workers prepared on the CPU path
            done = st.device_decode_images + st.device_decode_cpu_images
            row["on_cpu_share"] = round(st.device_decode_cpu_images / done, 3) if done else None
        if src.decoders:
            row["decoders"] = src.decoders
        if getattr(src, "ordinal", None) is not None:   # the waits the row ran with (a driver may refuse them)
            from coordl.device import waits
            row["waits"] = waits.scheduling(src.ordinal)
        if profile_seconds > 0 and step is not None:
            try:
                row["profile"] = profile_steps(ctx, gen, step, profile_seconds)
            except Exception as e:  # noqa: BLE001 - the row's figures stand without it
                row["profile"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        return row
    except Exception as e:  # noqa: BLE001 - one failing loader must not lose the other figures
        print(f"  {v.name} at {workers} worker(s) failed:\n" + _indent(traceback.format_exc()), flush=True)
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    finally:
        if gen is not None:
            gen.close()
        if src is not None:
            src.close()
        del gen, src
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()


def _indent(s: str) -> str:
    return "".join("    " + line for line in s.splitlines(True))


# ---------------------------------------------------------------- models

class Tiny(torch.nn.Module):
    """Stands in for a ResNet where there is no GPU (--smoke on a CPU)."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
                                        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, classes))

    def forward(self, x):
        return self.body(x)


def make_step(ctx: Ctx, model_name: str) -> Callable:
    """One SGD step of ``model_name`` (a torchvision model, or ``tiny``)
    under bf16 autocast, channels_last."""
    model = Tiny() if model_name == "tiny" else getattr(_torchvision().models, model_name)()
    model = model.to(ctx.device, memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x, y):
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            loss = loss_fn(model(x), y.long().view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def synthetic(ctx: Ctx, batch_size: int) -> Iterator:
    x = torch.randn(batch_size, 3, ctx.size, ctx.size, device=ctx.device)
    y = torch.randint(0, 1000, (batch_size,), device=ctx.device)
    while True:
        yield x, y


# ---------------------------------------------------------------- data

def _render_calibration(args: tuple) -> Any:
    from coordl import synth

    seed, k, size = args
    return synth.render_image(seed, k, *synth.image_spec(seed, k, size))


def _write_unique(args: tuple) -> int:
    from coordl import synth

    seed, k, size, quality, path = args
    data = synth._encode(synth.render_image(seed, k, *synth.image_spec(seed, k, size)), quality)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def make_dataset(root: str, images: int, unique: int, classes: int, mean_kb: float,
                 size: tuple[int, int] | None, procs: int, seed: int = 0) -> dict:
    """An ImageFolder of ``images`` names over ``unique`` rendered JPEGs
    (name ``k`` is a hard link to image ``k % unique``), JPEG quality
    calibrated as ``coordl.synth.make_image_folder`` does.  Uses fork (no
    CUDA state exists yet)."""
    import multiprocessing as mp

    from coordl import synth

    t0 = time.perf_counter()
    unique = max(1, min(unique, images))
    store = os.path.join(os.path.dirname(root), os.path.basename(root) + "-unique")
    os.makedirs(store, exist_ok=True)
    with ProcessPoolExecutor(max_workers=procs, mp_context=mp.get_context("fork")) as pool:
        cal = list(pool.map(_render_calibration, [(seed, k, size) for k in range(min(unique, 48))]))
        mean_pixels = sum(w * h for w, h, _ in (synth.image_spec(seed, k, size) for k in range(unique))) / unique
        calibrate = getattr(synth, "_calibrate", None)
        quality = calibrate(cal, mean_pixels, mean_kb) if calibrate else 90
        paths = [os.path.join(store, f"u{k:06d}.jpg") for k in range(unique)]
        sizes = list(pool.map(_write_unique, [(seed, k, size, quality, p) for k, p in enumerate(paths)],
                              chunksize=8))
    width = max(2, len(str(classes - 1)))
    dirs = [os.path.join(root, f"class_{c:0{width}d}") for c in range(classes)]
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    for k in range(images):
        dst = os.path.join(dirs[k % classes], f"img_{k:06d}.jpg")
        try:
            os.link(paths[k % unique], dst)
        except OSError:
            shutil.copyfile(paths[k % unique], dst)
    return {"images": images, "unique": unique, "classes": classes, "quality": quality,
            "mean_kb": round(sum(sizes) / len(sizes) / 1024, 1), "unique_mb": round(sum(sizes) / 2**20, 1),
            "seconds": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------- parts

def _cell(r: dict | None, key: str = "images_per_s", fmt: str = "{:,.0f}") -> str:
    if not r:
        return "-"
    if "error" in r:
        return "error"
    if "skipped" in r:
        return "skipped"
    v = r.get(key)
    return "-" if v is None else fmt.format(v)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    for i, row in enumerate([header] + rows):
        print("  " + "  ".join(str(c).ljust(w) if j == 0 else str(c).rjust(w) for j, (c, w) in
                               enumerate(zip(row, widths))))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))
    sys.stdout.flush()


OUT_OF_TIME = "not enough of the run's time left (--budget)"


def out_of_time(args, need: float, end: float | None = None) -> bool:
    """Whether a measurement of about ``need`` seconds would pass ``end``
    (default: the end of ``--budget``; a run that must finish in time skips
    what does not fit, saying so in its row, instead of being cut)."""
    end = getattr(args, "deadline", None) if end is None else end
    return end is not None and time.monotonic() + need > end


def _in_range(v: "Variant", workers: int) -> bool:
    """Whether part (a) measures row ``v`` at ``workers``."""
    return not ((v.max_workers_a and workers > v.max_workers_a) or (v.min_workers_a and workers < v.min_workers_a))


def _cost_a(seconds: float, workers: int) -> float:
    """About how long one part (a) measurement takes: its window, the
    loader's start and warm-up, growing with its workers (the H200 runs:
    3.6 s on average at 2 s windows over 1-15 workers)."""
    return seconds + 1.0 + 0.12 * workers


def _cost_b(args) -> float:
    """About how long part (b) takes: the ceiling and each of its rows (the
    H200 runs: 66 s for seven at 4 s windows), and each profiled window
    with its trace's export (a few seconds)."""
    rows = sum(1 for v in chosen(args) if v.in_b)
    profiled = len(profiled_b(args))
    return (rows + 1) * (args.train_seconds + 5.5) + 5 + \
        (profiled + 1 if profiled else 0) * (getattr(args, "profile_seconds", 0.0) + 4)


#: part (b)'s rows profiled by default: the loader that feeds the step at 99% (the CPU decoding) and
#: decode="device" at 93% (third H200 run): where the step's time goes beside each
PROFILE_B = "coordl-device,coordl-decode-block"


def profiled_b(args) -> list:
    """The part (b) rows ``--profile-b`` names that run (none without a value)."""
    names = _named(getattr(args, "profile_b", ""))
    return [v.name for v in chosen(args) if v.in_b and v.name in names]


def plan_a(args, rows: list, start: float) -> tuple:
    """Part (a)'s end, leaving part (b) its time, and the measurements it
    leaves out so that it ends there: the least telling first (the rows'
    order, all of a row's worker counts together), so that a short budget
    drops whole rows at the end of the list rather than every row's
    largest worker count, which the targets read."""
    end = getattr(args, "deadline", None)
    if end is None:
        return None, set()
    if "b" in args.parts:
        end -= _cost_b(args)
    left, keep, skip = end - start, True, set()
    for v in rows:
        for w in args.workers:
            if not _in_range(v, w):
                continue
            left -= _cost_a(args.seconds, w)
            keep = keep and left >= 0
            if not keep:
                skip.add((v.name, w))
    return end, skip


def chosen(args) -> list:
    """The variants ``--loaders`` names (all without it), in VARIANTS' order."""
    if not getattr(args, "loaders", None):
        return [v for v in VARIANTS if v.default]
    names = _named(args.loaders)
    return [v for v in VARIANTS if v.name in names]


def _named(text: str | None) -> list:
    """The variant names of a comma-separated option; an unknown name fails
    here, naming the known ones."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    for n in names:
        variant(n)
    return names


def part_a(args, ctx: Ctx, res: dict, save: Callable) -> None:
    part = res["parts"]["a"] = {"batch_size": args.batch_size, "workers": args.workers, "seconds": args.seconds,
                                "rows": {}}
    print(f"\n(a) images/s delivered on {ctx.device}, batch {args.batch_size}, workers {args.workers}", flush=True)
    rows = [v for v in chosen(args) if v.in_a]
    end, planned = plan_a(args, [v for v in rows if not v.unavailable(ctx)], time.monotonic())
    # the plan's costs are estimates: a part (a) that runs long may take a third of part (b)'s time, whose
    # rows are then skipped from its end (the least telling), not the largest worker counts here
    slack_end = None if end is None else end + (_cost_b(args) / 3 if "b" in args.parts else 0)
    if planned:
        part["left_out"] = sorted(f"{n} at {w}" for n, w in planned)
        print(f"  left out to fit the budget, part (b) keeping its time: {', '.join(part['left_out'])}", flush=True)
    for w in args.workers:
        for v in rows:
            if not _in_range(v, w) and not v.unavailable(ctx):
                r = {"skipped": f"measured at {v.min_workers_a or 1} to {v.max_workers_a or 'any number of'} workers"}
            elif (v.name, w) in planned or out_of_time(args, args.seconds + 8, slack_end):
                r = {"skipped": OUT_OF_TIME}
            else:
                r = run_variant(ctx, v, w, args.batch_size, args.warmup or w + 2, args.seconds)
            if r.get("images_per_s"):
                ctx.rates[(v.name, w)] = r["images_per_s"]
            part["rows"].setdefault(v.name, {})[str(w)] = r
            why = r.get("error") or r.get("skipped")
            print(f"  {v.name:<16} {w:>2} workers  " + (why.splitlines()[0] if why else
                  f"{_cell(r):>8} images/s  {_cell(r, 'cpu_ms_per_image', '{:.2f}'):>6} CPU ms/image  "
                  f"(window {r['window_s']:.1f} s){_where(r)}"), flush=True)
            save()
    hdr = ["loader"] + [str(w) for w in args.workers]
    print_table(f"(a) images/s on {ctx.device}, batch {args.batch_size}", hdr,
                [[n] + [_cell(rs.get(str(w))) for w in args.workers] for n, rs in part["rows"].items()])
    print_table("(a) machine CPU ms per image (all processes)", hdr,
                [[n] + [_cell(rs.get(str(w)), "cpu_ms_per_image", "{:.2f}") for w in args.workers]
                 for n, rs in part["rows"].items()])
    print_table("(a) where the CPU goes: busy vCPUs / main process's cores / workers' CPU ms per image / "
                "workers' involuntary switches per image", hdr,
                [[n] + [_split(rs.get(str(w))) for w in args.workers] for n, rs in part["rows"].items()])


def _split(r: dict | None) -> str:
    if not r or r.get("cores_busy") is None:
        return "-"
    wc = r.get("workers_cpu_ms_per_image")
    sw = (r.get("workers_switches_per_image") or {}).get("involuntary")
    return (f"{r['cores_busy']:.1f}/{r['main_process_cpu']:.2f}/"
            f"{'-' if wc is None else f'{wc:.2f}'}/{'-' if sw is None else f'{sw:.2f}'}")


def part_b(args, ctx: Ctx, res: dict, save: Callable) -> None:
    w = args.train_workers
    part = res["parts"]["b"] = {"model": args.model_b, "batch_size": args.train_batch_size, "workers": w,
                                "seconds": args.train_seconds, "rows": {}}
    print(f"\n(b) {args.model_b} training step, bf16 autocast, channels_last, batch {args.train_batch_size}, "
          f"{w} workers", flush=True)
    if ctx.cuda:
        torch.backends.cudnn.benchmark = True
    try:
        step = make_step(ctx, args.model_b)
        ceiling = measure(ctx, synthetic(ctx, args.train_batch_size), args.warmup or 10, args.train_seconds, step)
    except Exception as e:  # noqa: BLE001
        print("  the synthetic ceiling failed:\n" + _indent(traceback.format_exc()), flush=True)
        part["ceiling"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        save()
        return
    part["ceiling"] = ceiling
    profiled = profiled_b(args)
    if profiled:
        try:
            ceiling["profile"] = profile_steps(ctx, synthetic(ctx, args.train_batch_size), step, args.profile_seconds)
        except Exception as e:  # noqa: BLE001 - the ceiling stands without it
            ceiling["profile"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    print(f"  synthetic (ceiling)  {ceiling['images_per_s']:,.0f} images/s{_profile_line(ceiling.get('profile'))}",
          flush=True)
    save()
    for v in chosen(args):
        if not v.in_b:
            continue
        wv = min(w, v.max_workers_b) if v.max_workers_b else w
        if out_of_time(args, args.train_seconds + 12):
            r = {"skipped": OUT_OF_TIME}
        else:
            r = run_variant(ctx, v, wv, args.train_batch_size, args.warmup or wv + 2, args.train_seconds, step,
                            profile_seconds=args.profile_seconds if v.name in profiled else 0.0)
        r["workers"] = wv
        if "images_per_s" in r and ceiling["images_per_s"] > 0:
            r["of_ceiling"] = round(r["images_per_s"] / ceiling["images_per_s"], 3)
        part["rows"][v.name] = r
        why = r.get("error") or r.get("skipped")
        print(f"  {v.name:<16} " + (why.splitlines()[0] if why else
              f"{_cell(r):>8} images/s  {_cell(r, 'of_ceiling', '{:.0%}'):>5} of the ceiling  "
              f"(waiting for batches {_cell(r, 'data_wait_share', '{:.0%}')} of the window; main process's "
              f"threads, cores: {_threads(r)}){_where(r)}{_profile_line(r.get('profile'))}"), flush=True)
        save()
    print_table(f"(b) {args.model_b}, batch {args.train_batch_size}, {w} workers", ["source", "images/s", "of ceiling"],
                [["synthetic (ceiling)", _cell(ceiling), "100%"]]
                + [[f"{n} ({r.get('workers', w)} workers)", _cell(r), _cell(r, "of_ceiling", "{:.0%}")]
                   for n, r in part["rows"].items()])


def _pipe_lines(p: subprocess.Popen, q: queue.Queue, tag: int) -> None:
    for line in p.stdout:
        q.put((tag, line.rstrip("\n")))
    q.put((tag, None))


def run_jobs(args, label: str, vname: str, extra: dict, k: int, logdir: str) -> dict:
    """``k`` job processes started together; each warms up, says ``ready``,
    waits for ``go`` and prints its images/s as ``result {json}``."""
    env = _child_env()
    jobs, logs = [], []
    q: queue.Queue = queue.Queue()
    deadline = time.monotonic() + args.job_timeout
    try:
        for i in range(k):
            log = open(os.path.join(logdir, f"job-{vname}-{'share' if extra.get('share') else 'noshare'}-{k}-{i}.log"),
                       "w+")
            logs.append(log)
            cmd = [sys.executable, os.path.abspath(__file__), "--job", "--root", args.root, "--variant", vname,
                   "--extra", json.dumps(extra), "--job-workers", str(args.job_workers),
                   "--job-batch-size", str(args.job_batch_size), "--job-seconds", str(args.job_seconds),
                   "--size", str(args.size), "--model", args.model_c, "--device", str(args.device)]
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                 cwd=logdir, start_new_session=True)
            jobs.append(p)
            threading.Thread(target=_pipe_lines, args=(p, q, i), daemon=True).start()
        ready, results, ended = set(), {}, set()
        while len(results) + len(ended - set(results)) < k:
            try:
                i, line = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{k} {label} job(s) not done within {args.job_timeout:g} s (--job-timeout)")
            if line is None:
                ended.add(i)
                if i not in results:
                    jobs[i].wait(timeout=10)
                    logs[i].seek(0)
                    raise RuntimeError(f"job {i} exited with status {jobs[i].returncode} before its result:\n"
                                       + logs[i].read()[-3000:])
            elif line == "ready":
                ready.add(i)
                if len(ready) == k:
                    for p in jobs:
                        p.stdin.write("go\n")
                        p.stdin.flush()
            elif line.startswith("result "):
                results[i] = json.loads(line[len("result "):])
            if time.monotonic() > deadline:
                raise TimeoutError(f"{k} {label} job(s) not done within {args.job_timeout:g} s (--job-timeout)")
        for p in jobs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        return {"per_job": [results[i] for i in range(k)]}
    finally:
        for p in jobs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the job and its workers (its own process group)
                except ProcessLookupError:
                    pass
                p.wait()
        for log in logs:
            log.close()
        if extra.get("share"):
            from coordl.daemon import server
            try:
                server.stop(timeout=30)
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                print(f"  stopping the node daemon failed: {e!r}", flush=True)


def part_c(args, ctx: Ctx, res: dict, save: Callable) -> None:
    part = res["parts"]["c"] = {"model": args.model_c, "jobs": args.jobs, "workers_per_job": args.job_workers,
                                "batch_size": args.job_batch_size, "seconds": args.job_seconds, "rows": {}}
    print(f"\n(c) {args.jobs} {args.model_c} jobs on one {ctx.device}, {args.job_workers} workers each, "
          f"batch {args.job_batch_size}, against one job alone", flush=True)
    logdir = tempfile.mkdtemp(prefix="jobs-", dir=args.tmp)
    # --smoke checks the script: the shared row alone.  The other rows run the same job code
    # (run_jobs, job_main) with another loader, and the torch loader itself runs in (a) and (b);
    # each of their job processes costs the smoke run seconds of imports.
    rows = [r for r in JOB_ROWS if not (args.smoke and r[0] != "coordl share=True")]
    for label, vname, extra in rows:
        row = part["rows"][label] = {"variant": vname, "extra": extra}
        try:
            why = variant(vname).unavailable(ctx)
            if not why and out_of_time(args, 12 * args.job_seconds + 25):
                why = OUT_OF_TIME
            if why:
                row["skipped"] = why
                print(f"  {label:<18} skipped: {why}", flush=True)
                continue
            alone = run_jobs(args, label, vname, extra, 1, logdir)["per_job"][0]
            row["alone"] = alone["images_per_s"]
            save()
            together = run_jobs(args, label, vname, extra, args.jobs, logdir)["per_job"]
            rates = [j["images_per_s"] for j in together]
            row.update({"per_job": rates, "mean": round(sum(rates) / len(rates), 1), "min": min(rates),
                        "total": round(sum(rates), 1),
                        "mean_over_alone": round(sum(rates) / len(rates) / alone["images_per_s"], 3)
                        if alone["images_per_s"] else None,
                        "shared_samples": [j.get("samples_shared") for j in together]})
            print(f"  {label:<18} alone {alone['images_per_s']:>8,.0f}  {args.jobs} jobs: "
                  + " / ".join(f"{x:,.0f}" for x in rates) + f" images/s each, mean {row['mean_over_alone']:.2f}x alone",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - one failing loader must not lose the other figures
            print(f"  {label} failed:\n" + _indent(traceback.format_exc()), flush=True)
            row["error"] = f"{type(e).__name__}: {e}"[:3000]
        save()
    print_table(f"(c) {args.jobs} {args.model_c} jobs, {args.job_workers} workers each, batch {args.job_batch_size}",
                ["loader", "alone", "per job (mean)", "min", "mean / alone"],
                [[n, _cell(r, "alone"), _cell(r, "mean"), _cell(r, "min"), _cell(r, "mean_over_alone", "{:.2f}")]
                 for n, r in part["rows"].items()])


#: issue targets read from parts (a) and (b): decode="device" against DALI at the same thread count,
#: images/s on at most this many busy vCPUs, and the share of the ResNet-50 ceiling with at most 4 workers
TARGET_DALI_RATIO, TARGET_RATE, TARGET_CORES, TARGET_CEILING, TARGET_CEILING_WORKERS = 1.2, 8000.0, 2.0, 0.95, 4


def targets(res: dict) -> dict:
    """The targets of ``decode="device"`` read from the run's figures: for
    each ``coordl-decode-*`` row, its images/s over DALI's at each worker
    count both ran, whether it delivered ``TARGET_RATE`` images/s with at
    most ``TARGET_CORES`` busy vCPUs (at which worker counts), and its
    share of part (b)'s ceiling with at most 4 workers; each with whether
    it is met."""
    out: dict = {}
    a = (res.get("parts", {}).get("a") or {}).get("rows", {})
    b = (res.get("parts", {}).get("b") or {}).get("rows", {})
    dali = a.get("dali", {})
    for name, by_w in a.items():
        if not name.startswith("coordl-decode-"):
            continue
        row: dict = {"vs_dali": {}, "rate_on_few_cores": []}
        for w, r in by_w.items():
            rate = r.get("images_per_s")
            d = (dali.get(w) or {}).get("images_per_s")
            if rate and d:
                row["vs_dali"][w] = round(rate / d, 3)
            if rate and rate >= TARGET_RATE and (r.get("cores_busy") or 1e9) <= TARGET_CORES:
                row["rate_on_few_cores"].append(w)
        rb = b.get(name) or {}
        if rb.get("of_ceiling") is not None and rb.get("workers", 1e9) <= TARGET_CEILING_WORKERS:
            row["of_ceiling"] = rb["of_ceiling"]
        row["met"] = {
            "vs_dali_at_8_and_15": all(row["vs_dali"].get(w, 0) >= TARGET_DALI_RATIO for w in ("8", "15"))
            if {"8", "15"} <= row["vs_dali"].keys() else None,
            "rate_on_few_cores": bool(row["rate_on_few_cores"])
            if any(r.get("images_per_s") for r in by_w.values()) else None,
            "of_ceiling": row["of_ceiling"] >= TARGET_CEILING if "of_ceiling" in row else None,
        }
        out[name] = row
    return out


def print_targets(found: dict) -> None:
    if not found:
        return
    print(f"\ntargets: >= {TARGET_DALI_RATIO}x DALI at 8 and 15 workers/threads; >= {TARGET_RATE:,.0f} images/s "
          f"on <= {TARGET_CORES:g} busy vCPUs; >= {TARGET_CEILING:.0%} of the ResNet-50 ceiling with <= "
          f"{TARGET_CEILING_WORKERS} workers")
    for name, r in found.items():
        ratios = ", ".join(f"{w}: {x:.2f}x" for w, x in r["vs_dali"].items()) or "-"
        few = ", ".join(r["rate_on_few_cores"]) or "none"
        ceil = f"{r['of_ceiling']:.0%}" if "of_ceiling" in r else "-"
        print(f"  {name:<22} vs DALI {ratios}; {TARGET_RATE:,.0f}/s on <= {TARGET_CORES:g} vCPUs at workers: "
              f"{few}; ResNet-50 {ceil}; met: "
              + ", ".join(f"{k} {'-' if v is None else ('yes' if v else 'no')}" for k, v in r["met"].items()),
              flush=True)


def part_d(args, ctx: Ctx, res: dict, save: Callable) -> None:
    why = dali_unavailable(ctx)
    if why:
        res["parts"]["d"] = {"ran": False, "skipped": why}
        print(f"\n(d) DALI: skipped: {why}", flush=True)
    else:
        import nvidia.dali

        res["parts"]["d"] = {"ran": True, "version": nvidia.dali.__version__,
                             "rows": "the 'dali' rows of parts (a) and (b)"}
        print(f"\n(d) DALI {nvidia.dali.__version__}: its GPU pipeline runs as the 'dali' rows of (a) and (b)",
              flush=True)
    save()


# ---------------------------------------------------------------- one job of part (c)

def job_main(args) -> int:
    ctx = Ctx(root=args.root, device=torch.device(args.device), size=args.size)
    if ctx.cuda:
        torch.cuda.set_device(cuda_index(ctx.device))
        torch.backends.cudnn.benchmark = True
    step = make_step(ctx, args.model)
    workers = args.job_workers
    src = variant(args.variant).make(ctx, workers, args.job_batch_size, **json.loads(args.extra))

    def on_ready() -> int:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("no 'go' from the benchmark")
        return 2 * workers + 1  # what the loader prefetched while waiting is not measured

    gen = src.epoch()
    r = measure(ctx, gen, workers + 2, args.job_seconds, step, on_ready)
    stats = getattr(src.loader, "stats", None)
    if callable(stats):
        r["samples_shared"] = getattr(stats(), "samples_shared", None)
    print("result " + json.dumps(r), flush=True)
    gen.close()
    src.close()
    return 0


def _child_env() -> dict:
    """The jobs import the coordl this script imported."""
    import coordl

    env = dict(os.environ)
    env.pop("COORDL_SHARE", None)
    env["PYTHONUNBUFFERED"] = "1"
    top = os.path.dirname(os.path.dirname(os.path.abspath(coordl.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([top] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


# ---------------------------------------------------------------- machine facts

def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001
        return None


def cuda_index(device: torch.device) -> int:
    """The index `torch.cuda.set_device` needs: it refuses a device without
    one ("cuda"), which means the first device here."""
    return 0 if device.index is None else device.index


def machine_facts(ctx: Ctx) -> dict:
    import coordl

    facts: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "coordl": coordl.__version__,
        "coordl_from": os.path.dirname(coordl.__file__),
        "torchvision": None, "numpy": _version("numpy"), "pillow": _version("pillow"),
        "simplejpeg": _version("simplejpeg"), "nvidia-dali": None,
        "cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "device": str(ctx.device),
        "gpu": None, "gpu_memory_gib": None, "driver": None, "git_commit": None, "cpu_model": None}
    try:
        facts["torchvision"] = _torchvision().__version__
    except Exception as e:  # noqa: BLE001
        facts["torchvision"] = f"not importable: {e}"
    try:
        import nvidia.dali

        facts["nvidia-dali"] = nvidia.dali.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        with open("/proc/cpuinfo") as f:
            facts["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    if ctx.cuda:
        p = torch.cuda.get_device_properties(ctx.device)
        facts["gpu"], facts["gpu_memory_gib"] = p.name, round(p.total_memory / 2**30, 1)
        try:
            facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        r = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        facts["git_commit"] = r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return facts


def wait_probe(ctx: Ctx, cycles: int = 100_000_000) -> dict:
    """What a host wait for the GPU costs the waiting thread: the thread's
    CPU ms against the wall ms of one ``torch.cuda.synchronize()`` behind a
    GPU sleep of ``cycles`` clocks, under CUDA's own choice and under
    ``COORDL_CUDA_WAIT=block`` (set on the live context, then put back).
    Says whether the blocking setting takes on this driver: the
    ``coordl-decode-block`` row's figures mean something only if it does."""
    from coordl.device import waits

    ordinal = cuda_index(ctx.device)
    out: dict = {}

    def once() -> dict:
        torch.cuda.synchronize()
        w0, c0 = time.perf_counter(), time.thread_time()
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        wall, cpu = (time.perf_counter() - w0) * 1e3, (time.thread_time() - c0) * 1e3
        return {"wall_ms": round(wall, 1), "cpu_ms": round(cpu, 1), "cpu_share": round(cpu / wall, 2) if wall else None}

    try:
        before = waits.scheduling(ordinal)
        once()                                      # the sleep kernel loaded
        out[f"default ({before})"] = once()
        try:
            waits.set_scheduling(ordinal, "block")
            out["block"] = once()
        finally:
            waits.set_scheduling(ordinal, before)
    except Exception as e:  # noqa: BLE001 - a probe: its failure is a fact, not the run's end
        out["error"] = f"{type(e).__name__}: {e}"[:500]
    return out


# ---------------------------------------------------------------- main

def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_out/gpu.json", help="JSON of every figure and the machine's facts")
    ap.add_argument("--parts", default="a,b,c,d", help="which parts to run (default a,b,c,d)")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke where CUDA is absent)")
    ap.add_argument("--root", default=None, help="an ImageFolder to read instead of generating one")
    ap.add_argument("--images", type=int, default=32000,
                    help="file names in the generated folder (one epoch holds part (b)'s warm-up of 15 workers, its "
                         "window and its profile)")
    ap.add_argument("--unique", type=int, default=3000, help="distinct images rendered (names are hard links)")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--mean-kb", type=float, default=110.0)
    ap.add_argument("--size", type=int, default=224, help="crop size")
    ap.add_argument("--workers", type=_ints, default=[1, 4, 8, 15], help="part (a): worker counts")
    ap.add_argument("--loaders", default=None,
                    help="parts (a) and (b): the loader variants to run, comma-separated (default: all)")
    ap.add_argument("--batch-size", type=int, default=128, help="part (a)")
    ap.add_argument("--seconds", type=float, default=3.0, help="part (a): window of each measurement")
    ap.add_argument("--warmup", type=int, default=None, help="batches before the window (default workers + 2)")
    ap.add_argument("--model-b", default="resnet50", help="part (b): a torchvision model (tiny: a small conv net)")
    ap.add_argument("--train-workers", type=int, default=15, help="part (b)")
    ap.add_argument("--train-batch-size", type=int, default=256, help="part (b)")
    ap.add_argument("--train-seconds", type=float, default=5.0, help="part (b)")
    ap.add_argument("--profile-b", default=PROFILE_B,
                    help="part (b): rows run again under torch.profiler after their window, with the ceiling, "
                         "comma-separated ('' for none): the device time per image on each CUDA stream")
    ap.add_argument("--profile-seconds", type=float, default=1.0, help="part (b): each profiled window")
    ap.add_argument("--model-c", default="resnet18", help="part (c)")
    ap.add_argument("--jobs", type=int, default=4, help="part (c): jobs started together")
    ap.add_argument("--job-workers", type=int, default=3, help="part (c): workers per job")
    ap.add_argument("--job-batch-size", type=int, default=128, help="part (c)")
    ap.add_argument("--job-seconds", type=float, default=5.0, help="part (c)")
    ap.add_argument("--job-timeout", type=float, default=150.0, help="part (c): limit of one configuration")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds the whole run may take: a measurement that would not fit is skipped, saying so")
    ap.add_argument("--decoders-json", default=None,
                    help="the decoders step's JSON (device_decoders.py --json): coordl-decode-measured's weights")
    ap.add_argument("--tmp", default=None, help="where the data goes (default: the system's temporary folder)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds a part: checks the script")
    # internal: one job of part (c)
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.smoke:
        args.images, args.unique, args.classes, args.mean_kb, args.size = 2400, 16, 4, 6.0, 32
        args.workers, args.batch_size, args.seconds = [1, 2], 8, 0.3
        args.train_workers, args.train_batch_size, args.train_seconds = 2, 8, 0.3
        args.profile_seconds = 0.2
        args.jobs, args.job_workers, args.job_batch_size, args.job_seconds = 2, 1, 8, 0.3
        args.job_timeout = 120.0
        if not cuda:
            args.model_b = args.model_c = "tiny"
    if args.device is None:
        args.device = "cuda" if cuda or not args.smoke else "cpu"
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    args.deadline = time.monotonic() + args.budget if args.budget else None
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.job:
        return job_main(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available here: this benchmark needs a GPU (or --smoke, which falls back to the CPU)",
              file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="coordl-gpu-", dir=args.tmp)
    args.tmp = tmp
    # a node daemon of this run only (share=True): another one of this user is neither used nor stopped
    os.environ["COORDL_RUN_DIR"] = os.path.join(tmp, "run")
    os.mkdir(os.environ["COORDL_RUN_DIR"], 0o700)
    os.environ.pop("COORDL_SHARE", None)
    hidden = ("job", "variant", "extra", "deadline", "model")
    res: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k not in hidden},
                           "variants": {v.name: v.describe for v in chosen(args)}, "parts": {}}

    def save() -> None:
        from common import write_json

        write_json(args.out, res)

    try:
        t0 = time.perf_counter()
        if args.root is None:
            args.root = os.path.join(tmp, "photos")
            size = (96, 72) if args.smoke else None
            res["data"] = make_dataset(args.root, args.images, args.unique, args.classes, args.mean_kb, size,
                                       procs=min(32, os.cpu_count() or 1))
            print(f"data: {res['data']['images']} names over {res['data']['unique']} JPEGs "
                  f"(mean {res['data']['mean_kb']} KB, quality {res['data']['quality']}) "
                  f"in {res['data']['seconds']} s", flush=True)
        else:
            res["data"] = {"root": args.root}
        ctx = Ctx(root=args.root, device=device, size=args.size, decoders=_read_decoders(args.decoders_json))
        if ctx.cuda:
            torch.cuda.set_device(cuda_index(device))
        res["machine"] = machine_facts(ctx)
        print("machine: " + ", ".join(f"{k} {v}" for k, v in res["machine"].items()), flush=True)
        if ctx.cuda:
            res["machine"]["host_waits"] = wait_probe(ctx)
            print("host waits (the waiting thread's CPU ms / wall ms of one synchronize behind a GPU sleep): " +
                  "; ".join(f"{k} {v}" for k, v in res["machine"]["host_waits"].items()), flush=True)
        save()
        for name, fn in (("a", part_a), ("b", part_b), ("c", part_c), ("d", part_d)):
            if name not in args.parts:
                continue
            tp = time.perf_counter()
            try:
                fn(args, ctx, res, save)
            except Exception as e:  # noqa: BLE001 - a part's failure must not lose the others
                print(f"part ({name}) failed:\n" + _indent(traceback.format_exc()), flush=True)
                res["parts"][name] = {**res["parts"].get(name, {}), "error": f"{type(e).__name__}: {e}"[:3000]}
            res["parts"][name]["part_seconds"] = round(time.perf_counter() - tp, 1)
            print(f"part ({name}): {res['parts'][name]['part_seconds']:.0f} s", flush=True)
            save()
        res["targets"] = targets(res)
        print_targets(res["targets"])
        res["seconds"] = round(time.perf_counter() - t0, 1)
        save()
        print(f"\n{res['seconds']:.0f} s; figures in {args.out}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
