"""Shared pieces of the image-loader benchmarks: the three loaders under test,
built over the same files with the same pipeline and the same parallelism.

* torch: ``torch.utils.data.DataLoader`` over a torchvision-style folder
  dataset with the PIL pipeline torchvision runs for
  ``RandomResizedCrop(224) + RandomHorizontalFlip() + PILToTensor()``
  (PIL open/convert, crop then bilinear resize, PIL flip, PIL -> CHW uint8).
  torchvision itself does not import beside torch 2.13 here, so the benchmark
  carries those few lines of PIL; the crop parameters come from the same
  algorithm and draw order.
* dali: NVIDIA DALI in CPU mode (``device_id=None``), ``fn.readers.file`` ->
  ``fn.decoders.image_random_crop`` -> ``fn.resize`` -> ``fn.crop_mirror_normalize``
  (uint8 CHW, random mirror), ``num_threads`` = workers.
* spdl: Meta's SPDL (``spdl.pipeline`` + ``spdl.io``, FFmpeg's decoder):
  a thread pipeline as SPDL's examples build it, ``num_threads`` = workers:
  each file read and demuxed, the crop and flip drawn as torchvision draws
  them from the header's size, then decoded through FFmpeg's filter graph
  (``crop``, bilinear ``scale``, ``hflip``, ``rgb24``); batches of frames
  converted to one array and made uint8 CHW in the pipeline's threads.
* coordl: ``coordl.DataLoader(coordl.ImageFolder(...))`` with
  ``coordl.transforms``, ``num_workers`` = workers.

And what the side-by-side scripts (recipes.py, torchvision_loop.py) share:
torchvision loaded as the tests load it, the generated folder in the page
cache, one epoch's images, seconds and labels with the every-sample-once
check, the ratios of two sides round by round, and the --quick sizes and
the JSON written at the end.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image

import coordl
from coordl import transforms as T

__all__ = ["TorchStyleFolder", "make_loader", "LOADERS", "dali_available", "spdl_available", "time_epochs",
           "single_core_rate", "warm_page_cache", "torchvision", "image_folder", "epoch", "every_sample_once",
           "round_ratios", "QUICK", "run_and_save"]

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


class TorchStyleFolder(torch.utils.data.Dataset):
    """What ``torchvision.datasets.ImageFolder`` + its PIL transforms do."""

    def __init__(self, root: str, size: int = 224):
        self.samples = []
        classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
        for c, name in enumerate(classes):
            for dirpath, _, files in sorted(os.walk(os.path.join(root, name))):
                for f in sorted(files):
                    if f.lower().endswith((".jpg", ".jpeg", ".png")):
                        self.samples.append((os.path.join(dirpath, f), c))
        self.size = size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, target = self.samples[i]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")
        return pil_pipeline(img, self.size), target


def pil_pipeline(img: Image.Image, size: int) -> torch.Tensor:
    """torchvision's RandomResizedCrop(size) + RandomHorizontalFlip() + PILToTensor() on PIL."""
    top, left, h, w = T.RandomResizedCrop.get_params(img, (0.08, 1.0), (3 / 4, 4 / 3))
    img = img.crop((left, top, left + w, top + h)).resize((size, size), Image.BILINEAR)
    if torch.rand(1).item() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.ascontiguousarray(np.asarray(img).transpose(2, 0, 1)))


def dali_prep(jpegs, size: int):
    """The DALI graph for the same pipeline: random-crop decode, resize, mirror, uint8 CHW."""
    from nvidia.dali import fn, types

    images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
    images = fn.resize(images, resize_x=size, resize_y=size)
    return fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW",
                                    mirror=fn.random.coin_flip())


def coordl_dataset(root: str, size: int = 224):
    tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.PILToTensor()])
    return coordl.ImageFolder(root, transform=tf)


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
        return True
    except Exception:
        return False


class DaliLoader:
    """DALI CPU pipeline yielding (images, labels) torch tensors per batch."""

    def __init__(self, root: str, batch_size: int, threads: int, size: int = 224, seed: int = 0):
        from nvidia.dali import fn, pipeline_def
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None, seed=seed,
                      prefetch_queue_depth=2)
        def pipe():
            jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True, name="reader")
            return dali_prep(jpegs, size), labels

        self.pipe = pipe()
        self.pipe.build()
        self.it = DALIGenericIterator([self.pipe], ["images", "labels"], reader_name="reader",
                                      last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)

    def __iter__(self):
        for out in self.it:
            yield out[0]["images"], out[0]["labels"]


def spdl_available() -> bool:
    try:
        import spdl.pipeline  # noqa: F401
        from spdl.io.lib import _libspdl

        _libspdl.make_demuxer   # loads FFmpeg's shared libraries: fails where they are missing
        return True
    except Exception:
        return False


class SpdlLoader:
    """SPDL's thread pipeline yielding (images, labels) torch tensors per batch:
    read + demux + draw + decode with FFmpeg's filter graph in ``threads``
    threads, then batches converted to uint8 NCHW in the pipeline's own thread."""

    def __init__(self, root: str, batch_size: int, threads: int, size: int = 224, seed: int = 0):
        self.samples = TorchStyleFolder(root, size).samples
        self.batch_size, self.threads, self.size, self.seed = batch_size, threads, size, seed
        self.epoch = 0

    def _load(self, item):
        import spdl.io
        from coordl._rng import current, sample_rng

        epoch, i, (path, label) = item
        with open(path, "rb") as f:
            data = f.read()
        packets = spdl.io.demux_image(data)
        with sample_rng(self.seed, epoch, i):       # torchvision's draws, from the sample's own generator
            top, left, ch, cw = T.RandomResizedCrop.get_params((packets.width, packets.height), (0.08, 1.0),
                                                               (3 / 4, 4 / 3))
            flip = ",hflip" if current().random() < 0.5 else ""
        desc = f"crop={cw}:{ch}:{left}:{top},scale={self.size}:{self.size}:flags=bilinear{flip},format=rgb24"
        return spdl.io.decode_packets(packets, filter_desc=desc), label

    @staticmethod
    def _collate(items):
        import spdl.io

        frames = [f for f, _ in items]
        hwc = spdl.io.to_torch(spdl.io.convert_frames(frames))
        return hwc.permute(0, 3, 1, 2).contiguous(), torch.tensor([l for _, l in items])

    def __iter__(self):
        from spdl.pipeline import PipelineBuilder

        epoch, self.epoch = self.epoch, self.epoch + 1
        order = np.random.default_rng(self.seed + epoch).permutation(len(self.samples)).tolist()
        pipeline = (PipelineBuilder()
                    .add_source([(epoch, i, self.samples[i]) for i in order])
                    .pipe(self._load, concurrency=self.threads)
                    .aggregate(self.batch_size)
                    .pipe(self._collate)
                    .add_sink(2)
                    .build(num_threads=self.threads))
        with pipeline.auto_stop():
            yield from pipeline.get_iterator(timeout=600)


def make_loader(kind: str, root: str, workers: int, batch_size: int, seed: int = 0, **extra):
    if kind == "torch":
        return torch.utils.data.DataLoader(TorchStyleFolder(root), batch_size=batch_size, shuffle=True,
                                           num_workers=workers, persistent_workers=workers > 0)
    if kind == "torch+coordl-dataset":
        return torch.utils.data.DataLoader(coordl_dataset(root), batch_size=batch_size, shuffle=True,
                                           num_workers=workers, persistent_workers=workers > 0)
    if kind == "coordl":
        return coordl.DataLoader(coordl_dataset(root), batch_size=batch_size, shuffle=True,
                                 num_workers=workers, persistent_workers=workers > 0, seed=seed, **extra)
    if kind == "dali":
        return DaliLoader(root, batch_size, max(1, workers), seed=seed + 1)
    if kind == "spdl":
        return SpdlLoader(root, batch_size, max(1, workers), seed=seed + 1)
    raise ValueError(f"loader should be one of {LOADERS}, but got loader={kind!r}")


LOADERS = ("torch", "dali", "spdl", "coordl")


def time_epochs(loader, epochs: int) -> list[tuple[int, float]]:
    """(images, seconds) per epoch."""
    out = []
    for _ in range(epochs):
        n = 0
        t0 = time.perf_counter()
        for images, _labels in loader:
            n += int(images.shape[0])
        out.append((n, time.perf_counter() - t0))
    return out


def single_core_rate(kind: str, root: str, n: int) -> float:
    """Images/s of one process on one core preparing samples in-process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _single_core_rate(kind, root, n)
    finally:
        torch.set_num_threads(threads)


def _single_core_rate(kind: str, root: str, n: int) -> float:
    if kind in ("dali", "spdl"):
        loader = make_loader(kind, root, 1, 32)
        res = time_epochs(loader, 2)[1:]
        return sum(r[0] for r in res) / sum(r[1] for r in res)
    ds = TorchStyleFolder(root) if kind == "torch" else coordl_dataset(root)
    n = min(n, len(ds))
    idx = np.random.default_rng(0).permutation(len(ds))[:n].tolist()
    ds[idx[0]]
    t0 = time.perf_counter()
    if kind == "torch":
        for i in idx:
            ds[i]
    else:
        from coordl._rng import sample_rng
        for i in idx:
            with sample_rng(0, 0, i):
                ds.prep(ds.raw(i), i)
    return n / (time.perf_counter() - t0)


def warm_page_cache(root: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                total += len(fh.read())
    return total



def torchvision():
    """torchvision, imported as the test suite imports it (tests/_torchvision.py:
    its PyPI wheel does not import as it is beside a CPU build of torch), or
    SystemExit saying how to install it."""
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    from _torchvision import import_torchvision

    tv = import_torchvision()
    if tv is None:
        raise SystemExit("torchvision is not installed: pip install 'coordl[test]'")
    return tv


def image_folder(args, prefix: str, **make) -> str:
    """``args.root``, or else a folder of ``args.images`` generated images
    (10 classes, seed 0, ``make``: :func:`coordl.synth.make_image_folder`'s
    sizes) in a temporary directory, ``args.tmp`` (:func:`run_and_save`
    removes it); its files read once, so that every side finds them in the
    page cache."""
    root = args.root
    if root is None:
        from coordl.synth import make_image_folder

        args.tmp = tempfile.mkdtemp(prefix=prefix)
        root = os.path.join(args.tmp, "photos")
        make_image_folder(root, num_images=args.images, num_classes=10, seed=0, **make)
    warm_page_cache(root)
    return root


def epoch(loader, per_batch=None) -> tuple[int, float, torch.Tensor]:
    """One pass over ``loader`` (batches of images and targets, and anything
    after them): (images, seconds, the targets in the order delivered);
    ``per_batch(images)`` runs on each batch, inside the timing."""
    n, labels = 0, []
    t0 = time.perf_counter()
    for batch in loader:
        images, targets = batch[0], batch[1]
        n += (images[0] if isinstance(images, (list, tuple)) else images).shape[0]   # several views: samples
        labels.append(targets)
        if per_batch is not None:
            per_batch(images)
    return n, time.perf_counter() - t0, torch.cat(labels)


def every_sample_once(ds, labels: torch.Tensor) -> bool:
    """An epoch's ``labels`` are the dataset's targets, each sample once (in any order)."""
    return len(labels) == len(ds) and sorted(labels.tolist()) == sorted(ds.targets)


def round_ratios(rows: list[dict], key: str, case: str, num: str, den: str,
                 field: str = "images_per_s") -> list[float]:
    """Round by round, ``field`` of the side (``loader``) ``num`` over that
    of ``den``, in the rows whose ``key`` is ``case``."""
    by_round: dict = {}
    for x in rows:
        if x[key] == case:
            by_round.setdefault(x["round"], {})[x["loader"]] = x
    return [r[num][field] / r[den][field] for _, r in sorted(by_round.items())]


# --quick: tiny sizes, a smoke run
QUICK = {"images": 48, "epochs": 1, "rounds": 1, "size": 32, "batch_size": 16}


def run_and_save(run, args, name: str) -> dict:
    """``run(args)``, the folder it generated (``args.tmp``) removed
    afterwards whatever happens, and its result written to
    ``args.out``/``name``.json."""
    args.tmp = None
    try:
        res = run(args)
    finally:
        if args.tmp is not None:
            shutil.rmtree(args.tmp, ignore_errors=True)
    write_json(os.path.join(args.out, f"{name}.json"), res)
    return res


def write_json(path: str, obj) -> None:
    """``obj`` as JSON at ``path`` (its folder made), whole or not at all:
    written beside it, then renamed over it, so that a run cut off while
    writing (a time limit) leaves the figures written before."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)
