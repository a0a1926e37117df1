"""The workers' CPU per image in ``decode="device"``, by where the bytes come from.

With ``decode="device"`` a worker reads each sample's bytes, parses its
JPEG header, draws its crop and flip, and places the bytes in the batch's
shared slot; the main process decodes.  On a GPU those workers are part of
what the 2-core target counts.  This measures them apart from any decoder:
the main process's decoder and geometry are replaced by ones that return at
once (on the CPU device, ``coordl.device.delivery.CPU_TEST_DEVICE``), so
the figures are the workers' own path, per image, in these settings:

* ``files``: read from the files (warm page cache), no node cache: what
  ``gpu.py``'s rows do (only the import changed);
* ``node cache``: ``cache_size`` given, after an epoch that filled it;
* ``in memory``: ``raw()`` returns bytes held in a list (no read; a
  dataset with its own ``raw`` takes the per-sample path);
* ``workers' share``: from the files, every sample the workers' share
  (``COORDL_DEVICE_DECODER``'s ``workers``), prepared whole on the CPU
  path, against ``the CPU path``: the same loader with ``decode="cpu"``:
  what a sample of the share costs a worker beside what it costs with the
  CPU path;
* ``data checked``: ``files`` with ``COORDL_DEVICE_CHECK_DATA=1``: each
  JPEG's entropy-coded data read through libjpeg-turbo before it goes to
  the device (what the check costs a worker);
* ``ColorJitter``: ``files`` with timm's default training recipe
  (``RandomResizedCrop``, flip, ``ColorJitter(0.4, 0.4, 0.4)``,
  ``ToTensor``, ``Normalize``) in torchvision's ``ImageFolder``: the
  worker draws the jitter too (the device applies it), against
  ``ColorJitter on the CPU path``: the same loader with ``decode="cpu"``;
* ``RandomErasing``: the same recipe with ``RandomErasing(0.25)`` after
  ``Normalize`` (timm's ``re_prob=0.25``, torchvision's presets'
  ``random_erase``): the worker draws the rectangles too (the device
  erases), against ``RandomErasing on the CPU path``;
* ``ColorJitter to the device``: the ``ColorJitter`` recipe with
  ``decode="cpu"`` and ``device="cpu"`` (the CPU standing in for the
  device): the device split, the workers stopping at the uint8 image
  after the jitter, against ``ColorJitter on the CPU path`` (float32 made
  in the worker); ``RandomErasing to the device``: the same with the
  ``RandomErasing`` recipe (the rectangles drawn in the worker, erased on
  the device), against ``RandomErasing on the CPU path``;
* ``TrivialAugmentWide``: torchvision's reference training preset with
  ``--auto-augment ta_wide`` (``RandomResizedCrop``, flip,
  ``TrivialAugmentWide``, ``PILToTensor``, ``ConvertImageDtype``,
  ``Normalize``): the worker draws the policy's operation too (the device
  computes it), against ``TrivialAugmentWide on the CPU path`` and
  ``TrivialAugmentWide to the device`` (the device split: the worker
  decodes and crops, draws the operation, the device computes it);
* ``AugMix``: the same preset with ``--auto-augment augmix``: the worker
  draws the mix's weights and operations (the device mixes), against
  ``AugMix on the CPU path``;
* ``TrivialAugmentWide given a tensor``: the preset with
  ``--backend tensor`` too (``PILToTensor`` before the crop; the policy
  interpolating bilinearly, the preset's default): the worker draws the
  policy's operation (the device runs torchvision's tensor function for
  it), against ``TrivialAugmentWide given a tensor on the CPU path`` and
  ``TrivialAugmentWide given a tensor to the device`` (the device split:
  the worker decodes and crops the tensor and draws the operation);
* ``GaussianBlur``: ``RandomResizedCrop``, flip, ``RandomApply([GaussianBlur(23,
  sigma=(0.1, 2.0))], p=0.5)`` (timm's ``gaussian_blur_prob=0.5``),
  ``ToTensor``, ``Normalize``: the worker draws whether and which sigma
  (the device blurs), against ``GaussianBlur on the CPU path``;
* ``RandomErasing noise``: the ``RandomErasing`` recipe erasing with noise
  (``value="random"``): the worker draws the noise too and packs it after
  the bytes (the per-sample path), against ``RandomErasing noise on the
  CPU path``.

* ``decode_image`` (only when ``--settings`` names it: torchvision's
  decoders must load): ``files`` through torchvision's ``ImageFolder``
  with ``loader=functools.partial(decode_image, mode=ImageReadMode.RGB)``
  and v2's ``RandomResizedCrop``, flip, ``ToDtype``, ``Normalize`` on the
  tensor (coordl decodes its JPEGs as torchvision's function does).

``files``, ``node cache`` and ``decode_image`` run twice: with the batch path (a plain
folder's batch read and recorded at once, ``coordl.pipeline.device_batches``,
what such a dataset gets) and with the per-sample path (the same engine
with the batch path off), side by side.

Each: one worker, ``persistent_workers``, an epoch to warm up, then the
workers' CPU (their processes' user + system time) over ``--images``
images.  ``--repeats`` interleaved rounds; the median.

    python -m coordl.synth bench_data/photos --images 2000
    python benchmarks/device_workers.py --root bench_data/photos
    python benchmarks/device_workers.py --quick        # tiny smoke run (tests use it)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = ("files", "files, per sample", "node cache", "node cache, per sample", "in memory", "workers' share",
            "the CPU path", "data checked", "ColorJitter", "ColorJitter on the CPU path", "RandomErasing",
            "RandomErasing on the CPU path", "ColorJitter to the device", "RandomErasing to the device",
            "RandomErasing noise", "RandomErasing noise on the CPU path", "TrivialAugmentWide",
            "TrivialAugmentWide on the CPU path", "TrivialAugmentWide to the device", "GaussianBlur",
            "GaussianBlur on the CPU path", "AugMix", "AugMix on the CPU path", "TrivialAugmentWide given a tensor",
            "TrivialAugmentWide given a tensor on the CPU path", "TrivialAugmentWide given a tensor to the device")
# selected by --settings only: torchvision's decoders must load (not beside torch's CPU build)
EXTRA = ("decode_image", "decode_image, per sample")
CPU_PATH = ("the CPU path", "ColorJitter on the CPU path", "RandomErasing on the CPU path",
            "RandomErasing noise on the CPU path", "TrivialAugmentWide on the CPU path", "GaussianBlur on the CPU path",
            "AugMix on the CPU path", "TrivialAugmentWide given a tensor on the CPU path")

_CHILD = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
import psutil, torch
import coordl
from coordl import transforms as T
from coordl.device import decode as DD, delivery as D
from coordl.pipeline import device_batches as BR

D.CPU_TEST_DEVICE = True
BR.ENABLED = {batch_reads!r}


class Instant:   # the main process's decoder: returns at once
    name = "instant"

    def __init__(self, device):
        self.device = device

    def decode(self, streams):
        return [torch.zeros(3, 1, 1, dtype=torch.uint8)] * len(streams)

    def finish(self):
        pass

    def release(self):
        return []


DD.decoder_for = lambda device, **kw: Instant(device)
DD.DecodeStage._check = staticmethod(lambda img, rec: None)
DD.DecodeStage.finish = lambda self, p: {{path: torch.zeros(len(p.keep), 3, 2, 2) for path in p.paths}}
tf = T.Compose([T.RandomResizedCrop({crop}), T.RandomHorizontalFlip(), T.ToTensor(),
                T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
ds = coordl.ImageFolder({root!r}, tf)
setting, images, batch = {where!r}, {images}, {batch}
if setting == "in memory":
    raws = [ds.raw(i) for i in range(len(ds))]

    class InMemory(type(ds)):
        raw_uncached = None

        def raw(self, i):
            return raws[i]
    ds.__class__ = InMemory
if setting == "workers' share":        # (nearly) every sample the workers': prepared whole on the CPU path
    import os
    os.environ["COORDL_DEVICE_DECODER"] = "auto:0.000001+workers:1"
if setting == "data checked":         # COORDL_DEVICE_CHECK_DATA: the entropy-coded data read first
    import os
    os.environ["COORDL_DEVICE_CHECK_DATA"] = "1"
if setting.startswith(("ColorJitter", "RandomErasing")):  # timm's default training recipe [+ re_prob=0.25],
    sys.path.insert(0, {benchmarks!r})                      # through torchvision's ImageFolder
    import common
    common.torchvision()
    from torchvision import datasets, transforms as V
    ds = datasets.ImageFolder({root!r}, transform=V.Compose([
        V.RandomResizedCrop({crop}), V.RandomHorizontalFlip(), V.ColorJitter(0.4, 0.4, 0.4), V.ToTensor(),
        V.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]
        + ([V.RandomErasing(0.25, value="random" if "noise" in setting else 0)]
           if setting.startswith("RandomErasing") else [])))
if setting.startswith("GaussianBlur"):   # timm's gaussian_blur_prob=0.5: RandomApply([GaussianBlur(23, (0.1, 2))])
    sys.path.insert(0, {benchmarks!r})
    import common
    common.torchvision()
    from torchvision import datasets, transforms as V
    ds = datasets.ImageFolder({root!r}, transform=V.Compose([
        V.RandomResizedCrop({crop}), V.RandomHorizontalFlip(),
        V.RandomApply([V.GaussianBlur(23, sigma=(0.1, 2.0))], p=0.5), V.ToTensor(),
        V.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
if setting.startswith(("TrivialAugmentWide", "AugMix")):   # the reference training preset, --auto-augment
    sys.path.insert(0, {benchmarks!r})                     # ta_wide or augmix
    import common
    common.torchvision()
    from torchvision import datasets, transforms as V
    ds = datasets.ImageFolder({root!r}, transform=V.Compose([
        V.RandomResizedCrop({crop}), V.RandomHorizontalFlip(),
        V.AugMix() if setting.startswith("AugMix") else V.TrivialAugmentWide(), V.PILToTensor(),
        V.ConvertImageDtype(torch.float), V.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
    if "given a tensor" in setting:       # the preset's backend="tensor": PILToTensor before the crop
        ds = datasets.ImageFolder({root!r}, transform=V.Compose([
            V.PILToTensor(), V.RandomResizedCrop({crop}, antialias=True), V.RandomHorizontalFlip(),
            V.TrivialAugmentWide(interpolation=V.InterpolationMode.BILINEAR), V.ConvertImageDtype(torch.float),
            V.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
if setting == "decode_image":      # a v2 script's folder: loader=partial(decode_image, mode=RGB), v2 on the tensor
    sys.path.insert(0, {benchmarks!r})
    import functools
    import common
    common.torchvision()
    from torchvision import datasets
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms import v2
    ds = datasets.ImageFolder({root!r}, loader=functools.partial(decode_image, mode=ImageReadMode.RGB),
                              transform=v2.Compose([v2.RandomResizedCrop({crop}, antialias=True),
                                                    v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True),
                                                    v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
on_device = dict(device="cpu", decode="device") if setting not in {cpu_path!r} else {{}}
if setting.endswith("to the device"):     # decode="cpu", the device split (the CPU standing in)
    on_device = dict(device="cpu")
L = coordl.DataLoader(ds, batch_size=batch, seed=1, shuffle=True, num_workers=1, persistent_workers=True,
                      cache_size="4GiB" if setting == "node cache" else 0, **on_device)
for _ in L:      # an epoch: the worker warm, the node cache filled
    pass
me = psutil.Process()


def workers_cpu():
    return sum(sum(p.cpu_times()[:2]) for p in me.children(recursive=True))


it = iter(L)
next(it)
k0, t0, n = workers_cpu(), time.perf_counter(), 0
for b in it:
    n += len(b[1])
    if n >= images:
        break
k1, t1 = workers_cpu(), time.perf_counter()
st = L.stats().epochs[-1]
print("RESULT", json.dumps({{"us_per_image": (k1 - k0) / n * 1e6, "images_per_s": n / (t1 - t0), "images": n,
                            "from_cache": st.samples_from_cache, "from_storage": st.samples_from_storage,
                            "batch_reads": L._mode.pool.worker_stats()[0].get("batch_reads", 0),
                            "on_cpu": L.stats().device_decode_cpu_images, "device_split": L.stats().device_split}}))
"""


def measure(root: str, setting: str, images: int, batch: int, crop: int = 224) -> dict:
    where, _, per_sample = setting.partition(", ")
    code = _CHILD.format(repo=os.path.dirname(HERE), benchmarks=HERE, root=root, where=where,
                         batch_reads=not per_sample, images=images, batch=batch, cpu_path=CPU_PATH, crop=crop)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"{setting}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="an ImageFolder of JPEGs (default: 2,000 synthetic ones)")
    ap.add_argument("--images", type=int, default=1536, help="images measured after the warm-up epoch")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--settings", default=";".join(SETTINGS),
                    help="the settings to run, separated by semicolons (default: all)")
    args = ap.parse_args(argv)
    settings = [s for s in SETTINGS + EXTRA if s in args.settings.split(";")]
    if not settings:
        ap.error(f"--settings names none of {', '.join(SETTINGS + EXTRA)}")
    tmp = None
    crop = 224
    if args.quick:       # a smoke run: every setting's path, little of its arithmetic
        args.images, args.batch, args.repeats, crop = 32, 4, 1, 32
    if args.root is None:
        sys.path.insert(0, os.path.dirname(HERE))
        from coordl.synth import make_image_folder
        tmp = tempfile.TemporaryDirectory(prefix="coordl-device-workers-")
        args.root = make_image_folder(os.path.join(tmp.name, "photos"), num_images=48 if args.quick else 2000,
                                      image_size=(64, 48) if args.quick else None, workers=2)
    runs: dict = {s: [] for s in settings}
    try:
        for _ in range(args.repeats):           # interleaved: the machine's drift falls on every setting
            for s in settings:
                runs[s].append(measure(args.root, s, args.images, args.batch, crop))
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(f"decode=\"device\", one worker, batch {args.batch}, {args.images} images after a warm-up epoch, "
          f"median of {args.repeats}: the worker's CPU per image (the main process's decoder returns at once)")
    rows = {}
    for s in settings:
        us = statistics.median(r["us_per_image"] for r in runs[s])
        rows[s] = {"us_per_image": round(us, 1), "runs": runs[s]}
        print(f"  {s:<27} {us:7.1f} us per image   (runs: "
              + ", ".join(f"{r['us_per_image']:.0f}" for r in runs[s]) + ")")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "images": args.images, "repeats": args.repeats, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
