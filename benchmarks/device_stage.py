"""The main process's cost per image in ``decode="device"``'s stage.

With workers, ``decode="device"`` runs two threads in the main process: the
decode thread (the decoder's batched call, then the stage's bookkeeping)
and the pin thread (each image's crop and resize, the batch's rounding,
mirror and ``ToTensor``/``Normalize``: ``DecodeStage.finish``).  On a GPU
either can bound delivery (docs/benchmarks.md section 8); this measures
each apart, on the batches a real pass hands the stage:

* ``finish``: ``DecodeStage.finish`` per image (the pin thread's geometry),
  on the decoded images of the pass; where the batch-geometry kernel runs
  (a GPU with Triton), also with one launch per image, on the same batches;
  for a plan the kernel serves, also with the kernel's launch a no-op (the
  host's own work on its path: gathering the images, the parameters, the
  rounding, mirror and tail; on the CPU those run on the CPU too);
* on a GPU, ``finish`` on the GPU alone: its device time per image with
  each geometry path (the stage's choice; the other of the separable and
  tiled kernels, fused alike; each of the two writing uint8 rows, the tail
  after them, and with the stage's rounding and mirror after it; the
  per-pixel kernel; one launch per image), the work queued behind a GPU
  sleep so that the host's
  launches do not pace it: what the stage takes from a training step's
  GPU;
* ``decode bookkeeping``: ``DecodeStage.decode`` per image with a decoder
  that returns at once (what the decode thread spends outside the
  decoder's call);
* ``decoder``: the decoder's batched call per image (``--device cuda``:
  the GPU's decoder, synchronized; on the CPU, the stand-in, which decodes
  on the CPU and so says nothing of a GPU);
* ``ColorJitter``: ``ColorJitter(0.4, 0.4, 0.4, 0.1)``'s operations on a
  batch of the output size after the geometry (``coordl.device.jitter``),
  per image: the host's time, and on a GPU the device's own, in the
  kernel and in torch's operations;
* ``TrivialAugmentWide``: torchvision's ``TrivialAugmentWide()`` (the
  reference recipe's ``ta_wide``), each row's drawn operation on a batch of
  the output size after the geometry (``coordl.device.pil_ops``), per
  image: the host's time, and on a GPU the device's own; ``AugMix``: its
  ``AugMix()`` (``augmix``) the same way (torchvision's own tensor
  functions on the rows that drew each operation, then the mix), and how
  far 32 of its rows are from the CPU's mix of the same draws; and
  ``TrivialAugmentWide`` given a tensor (``--backend tensor``: its
  operations torchvision's tensor functions, the rows that drew the same
  one taken together), the same way;
* ``RandomErasing``: ``RandomErasing(0.5)``'s rectangles (torchvision's
  default draws: half the rows, 2-33% of the image) set on a float batch
  of the output size after the tail (``coordl.device.erase``), a copy
  per rectangle and through the batch's mask (the way on a GPU for more
  than ``FEW_RECTS``), per image: the host's time, and on a GPU the
  device's own.
* ``collate_fn``: with a ``collate_fn`` of the user's (a mixup over
  ``default_collate``'s batch, as torchvision's reference script's), the
  main process's added work per image: the samples it gets made from the
  staged batch (``coordl.pipeline.collate.samples_of``, the pin thread),
  and the ``collate_fn`` itself in its seeded scope (the training
  thread), with the seeding's share apart; on a GPU also the device's own
  time in the ``collate_fn``.

Every figure is the best of ``--repeats`` runs over all captured batches,
the GPU synchronized at both ends of each.  Run it on two checkouts in turn
to compare code (``--json`` keeps the figures).

    python benchmarks/device_stage.py                          # CPU stand-in, outputs 16, 32, 64, 224
    python benchmarks/device_stage.py --device cuda --sizes 224
    python benchmarks/device_stage.py --quick                  # tiny smoke run (tests use it)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import coordl  # noqa: E402
from coordl import transforms as T  # noqa: E402
from coordl.device import decode as DD  # noqa: E402
from coordl.device import delivery as D  # noqa: E402
from coordl.stats import BatchStats  # noqa: E402

NORM = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


class _Instant:
    """A decoder that returns each stream's decoded image at once (the
    stage's own work, without a decoder's): images by the address of the
    stream's bytes in the batch's buffer."""

    name = "instant"

    def __init__(self, images: dict) -> None:
        self._images = images

    def decode(self, streams: list) -> list:
        return [self._images[s.data_ptr()] for s in streams]

    def finish(self) -> None:
        pass

    def release(self) -> list:
        return []


class _NoLaunch:
    """Stands in for the compiled kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capture(root: str, size: int, batch: int, device: torch.device, batches: int) -> tuple:
    """Run a ``decode="device"`` pass over ``root`` with RandomResizedCrop
    (``size``) + flip + ToTensor + Normalize and keep, per batch, what the
    stage was given: (stage, [((batch, blob, marks), pending)])."""
    tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), NORM])
    ds = coordl.ImageFolder(root, tf)
    got: list = []
    real_decode = DD.DecodeStage.decode

    def decode(self, b, stats, step=None):
        seen = (b, stats.device_blob, stats.device_marks)
        out = real_decode(self, b, stats, step)
        got.append([self, seen, stats.device_pending])
        return out

    DD.DecodeStage.decode = decode
    try:
        L = coordl.DataLoader(ds, batch_size=batch, seed=1, shuffle=True, device=device, decode="device")
        for k, _ in enumerate(L):
            if k + 1 >= batches:
                break
        _sync(device)
    finally:
        DD.DecodeStage.decode = real_decode
    got = [g for g in got if g[2] is not None]
    if not got:
        raise SystemExit("no batch reached the stage")
    return got[0][0], [(seen, pending) for _, seen, pending in got]


def _pending_copy(p):
    return DD._Pending(p.paths, p.records, [list(o) for o in p.out], list(p.raw), [], p.keep, p.cpu)


def _streams(blob, pending) -> list:
    """The batch's JPEG streams the decoder was given, with (path, row)."""
    buf, _, offsets = blob
    m = len(pending.paths)
    return [((k, r), DD._bytes(buf, offsets[r * m + k])) for k, r, _ in pending.raw]


def _finish_us(stage, captured: list, device: torch.device, images: int) -> float:
    """``DecodeStage.finish`` over every captured batch, per image, the device synchronized at both ends."""
    _sync(device)
    t = time.perf_counter()
    for _, p in captured:
        stage.finish(_pending_copy(p))
    _sync(device)
    return (time.perf_counter() - t) / images * 1e6


def measure(stage, captured: list, device: torch.device, repeats: int) -> dict:
    images = sum(len(p.keep) for _, p in captured)
    best = {"finish_us": float("inf"), "decode_bookkeeping_us": float("inf"), "decoder_us": float("inf")}
    decoded = {}
    for (_, blob, _), p in captured:
        imgs = {(k, r): img for k, r, img in p.raw}
        for kr, s in _streams(blob, p):
            decoded[s.data_ptr()] = imgs[kr]
    instant = DD.DecodeStage(stage.device, stage.plan, _Instant(decoded), stage.on_error, stage.describe)
    for _ in range(repeats):
        best["finish_us"] = min(best["finish_us"], _finish_us(stage, captured, device, images))
        t = time.perf_counter()
        for (b, blob, marks), _ in captured:
            st = BatchStats()
            st.device_blob, st.device_marks = blob, marks
            instant.decode(b, st)
        _sync(device)
        best["decode_bookkeeping_us"] = min(best["decode_bookkeeping_us"], (time.perf_counter() - t) / images * 1e6)
        t = time.perf_counter()
        for (_, blob, _), p in captured:
            stage.decoder.decode([s for _, s in _streams(blob, p)])
            stage.decoder.finish()
        _sync(device)
        best["decoder_us"] = min(best["decoder_us"], (time.perf_counter() - t) / images * 1e6)
    def finish_with(geometry) -> float:
        """The best ``finish`` per image with ``geometry`` in the stage's place (put back after)."""
        kept, stage.batch_geometry = stage.batch_geometry, geometry
        try:
            return min(_finish_us(stage, captured, device, images) for _ in range(repeats))
        finally:
            stage.batch_geometry = kept

    kernel = stage.batch_geometry
    modes = tuple(m.value for m in stage.plan.modes)
    if stage.plan.resize is None or (set(modes) <= {"bilinear", "bicubic"} and stage.plan.antialias):
        # the batch-geometry kernel's path with its launch a no-op: the host's own work per image
        # (gathering the images, the parameters, their upload; the rounding and mirror where the kernel
        # does not do them; the tail)
        from coordl.device import geometry_kernel as GK
        kind = kernel.kind if kernel else GK.KINDS[0]
        no_launch = GK.BatchGeometry(stage.plan.size, kind, modes)
        no_launch.kernel = (_NoLaunch(), _NoLaunch()) if kind == "separable" else _NoLaunch()
        no_launch.fused = bool(kernel and kernel.fused)
        no_launch.fused_tail = bool(kernel and kernel.fused_tail)
        best["finish_no_launch_us"] = finish_with(no_launch)
    if kernel:      # the same batches with one launch per image, for the comparison
        best["finish_per_image_us"] = finish_with(False)
    out = {k: round(v, 2) for k, v in best.items()} | {
        "images": images, "geometry_kernel": bool(kernel),
        "kernel": (kernel.kind + (", its own rounding" if kernel.fused else "") +
                   (" and tail" if kernel.fused_tail else "")) if kernel else None}
    if device.type == "cuda":
        try:
            out["device_us"] = device_time(stage, captured, device, images)
        except Exception as e:  # noqa: BLE001 - the host figures stand without it
            out["device_us_error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"  finish on the GPU alone: not measured ({out['device_us_error']})", flush=True)
    return out


def device_time(stage, captured: list, device: torch.device, images: int) -> dict:
    """The GPU's own time per image in ``finish``, each geometry path on the
    same batches: the work is queued behind a GPU sleep longer than the
    host takes to queue it, so that the events around it time the device's
    work alone (the host's launches do not pace it).  ``host_behind`` says
    where the host took longer than the sleep (the figure then holds idle
    time).  Paths: the stage's own choice, the other of the separable and
    tiled kernels fused as far as the stage's choice, each of those two
    writing uint8 rows with the tail after them and leaving the rounding
    and mirror to the stage, the per-pixel kernel, one launch per
    image."""
    from coordl.device import geometry_kernel as GK

    paths = {}
    modes = tuple(m.value for m in stage.plan.modes)
    chosen = stage.batch_geometry
    if chosen:
        paths[f"stage's choice ({chosen.kind})"] = chosen
        for kind in ("separable", "tiled"):
            if kind != chosen.kind:
                same = GK.BatchGeometry(stage.plan.size, kind, modes)
                same.fused, same.fused_tail = chosen.fused, chosen.fused_tail
                paths[f"{kind}, fused as the stage's choice"] = same
        for kind in ("separable", "tiled"):
            no_tail = GK.BatchGeometry(stage.plan.size, kind, modes)
            no_tail.fused = True                       # the kernel's uint8 rows, the tail after them
            paths[f"{kind}, uint8 rows, the tail after"] = no_tail
            paths[f"{kind}, the stage rounding"] = GK.BatchGeometry(stage.plan.size, kind, modes)
        paths["per-pixel kernel"] = GK.BatchGeometry(stage.plan.size, "per-pixel", modes)
    paths["one launch per image"] = False
    out = {}
    kept = stage.batch_geometry
    try:
        for name, geo in paths.items():
            stage.batch_geometry = geo
            for _, p in captured:                  # compiled, allocated
                stage.finish(_pending_copy(p))
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(2e8))            # about 0.1 s at 2 GHz
            t = time.perf_counter()
            start.record()
            for _, p in captured:
                stage.finish(_pending_copy(p))
            end.record()
            host = time.perf_counter() - t
            end.synchronize()
            gpu_ms = start.elapsed_time(end)
            out[name] = {"us_per_image": round(gpu_ms * 1e3 / images, 2), "host_ms": round(host * 1e3, 2),
                         "host_behind": None}
        # whether the sleep outlasted the host's queueing: a sleep's own length, measured
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(int(2e8))
        end.record()
        end.synchronize()
        sleep_ms = start.elapsed_time(end)
        for r in out.values():
            r["host_behind"] = r["host_ms"] > sleep_ms
    finally:
        stage.batch_geometry = kept
    return out


def jitter_ops(n: int, seed: int = 0) -> list:
    """Each of ``n`` rows' operations as torchvision's ``ColorJitter(0.4,
    0.4, 0.4, 0.1)`` draws them (factors in [0.6, 1.4], a hue shift within
    +-0.1 of a turn, the four in a random order), in
    ``coordl.decode.color``'s terms."""
    import random

    import numpy as np

    from coordl.decode import color as C

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ops = [(C.BRIGHTNESS, rng.uniform(0.6, 1.4)), (C.CONTRAST, rng.uniform(0.6, 1.4)),
               (C.SATURATION, rng.uniform(0.6, 1.4)),
               (C.HUE, int(np.int32(rng.uniform(-0.1, 0.1) * 255).astype(np.uint8)))]
        rng.shuffle(ops)
        out.append(ops)
    return out


def jitter_time(device: torch.device, size: int, batch: int, repeats: int) -> dict:
    """``ColorJitter(0.4, 0.4, 0.4, 0.1)`` on the device (coordl.device.jitter)
    per image, on a uint8 batch of ``size`` x ``size`` images: the host's
    time (best of ``repeats``, synchronized) and, on a GPU, the device's
    own time behind a GPU sleep (as :func:`device_time`); on a GPU for the
    kernel (where Triton runs it) and for torch's operations alike."""
    from coordl.device.jitter import DeviceJitter

    g = torch.Generator().manual_seed(size)
    y = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=g).to(device)
    ops = jitter_ops(batch)
    out = {}
    for path in ("kernel", "torch operations"):
        dj = DeviceJitter(device)
        if path == "torch operations":
            dj._kernel_ok = None                 # the kernel off
        dj(y.clone(), ops)                       # the first use: the checks, the hue tables
        if path == "kernel" and not (dj._kernel_ok and all(dj._kernel_ok.values())):
            continue                             # no kernel here (the CPU, no Triton, or it differed)
        out[path] = _ops_time(dj, y, ops, device, repeats)
    return out


def _ops_time(dj, y: torch.Tensor, ops: list, device: torch.device, repeats: int) -> dict:
    """``dj(y, ops)`` per image (checked already): the host's time (best of
    ``repeats``, synchronized) and on a GPU the device's own behind a GPU
    sleep; with which kinds ran on the CPU path's code."""
    batch = y.shape[0]
    best = float("inf")
    for _ in range(repeats):
        x = y.clone()
        _sync(device)
        t = time.perf_counter()
        dj(x, ops)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    row = {"host_us": round(best * 1e6 / batch, 2), "exact": dict(dj._exact)}
    if device.type == "cuda":
        x = y.clone()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2e8))
        start.record()
        dj(x, ops)
        end.record()
        end.synchronize()
        row["device_us"] = round(start.elapsed_time(end) * 1e3 / batch, 2)
    return row


def policy_time(device: torch.device, size: int, batch: int, repeats: int,
                name: str = "TrivialAugmentWide", on_tensor: bool = False) -> dict | None:
    """torchvision's ``TrivialAugmentWide()`` (v1, the reference recipe's
    ``ta_wide``), or its ``AugMix()`` (``augmix``), on the device
    (``coordl.device.pil_ops`` through ``coordl.device.jitter``) per image,
    each row with the operations the step draws for it, on a uint8 batch of
    ``size`` x ``size`` photos' worth of noise: as :func:`jitter_time`
    (None without torchvision).  ``on_tensor``: the step given a tensor
    (``--backend tensor``; bilinear, the preset's default), its operations
    torchvision's tensor functions, compared with the CPU's as AugMix's."""
    import common

    from coordl import tvcompat
    from coordl.device.jitter import DeviceJitter

    tv = common.torchvision()
    if tv is None:
        return None
    if on_tensor:
        t = getattr(tv.transforms, name)(interpolation=tv.transforms.InterpolationMode.BILINEAR)
        policy = tvcompat.tensor_step_of(t)
    else:
        t = getattr(tv.transforms, name)()
        policy = tvcompat.device_step_of(t)
    g = torch.Generator().manual_seed(size + 1)
    y = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=g).to(device)
    state = torch.get_rng_state()
    torch.manual_seed(size)
    ops = [policy.draw((size, size)) for _ in range(batch)]
    torch.set_rng_state(state)
    dj = DeviceJitter(device)
    got = dj(y.clone(), ops)                     # the first use of each kind: its check
    row = _ops_time(dj, y, ops, device, repeats)
    if name == "AugMix" or on_tensor:     # torchvision's functions on this device against the CPU's, 32 rows
        from coordl.decode import augmix

        def on_cpu(x, row_ops):
            for _, value in row_ops:
                x = augmix.on_planes(x, value)
            return x

        d = torch.stack([(got[r].cpu().int() - on_cpu(y[r].cpu(), ops[r]).int()).abs()
                         for r in range(min(32, batch))])
        row["vs_cpu"] = {"max": int(d.max()), "share": float((d > 0).float().mean())}
    return row


def erase_rects(n: int, size: int, seed: int = 0) -> list:
    """Each of ``n`` rows' rectangles as torchvision's ``RandomErasing(0.5)``
    draws them on a ``size`` x ``size`` image (an area fraction uniform in
    [0.02, 0.33], a log-uniform aspect ratio in [0.3, 3.3], 10 tries)."""
    import math
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rects = []
        if rng.random() < 0.5:
            for _ in range(10):
                area = size * size * rng.uniform(0.02, 0.33)
                ratio = math.exp(rng.uniform(math.log(0.3), math.log(3.3)))
                h, w = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
                if h < size and w < size:
                    rects.append((rng.randint(0, size - h), rng.randint(0, size - w), h, w))
                    break
        out.append(rects)
    return out


def erase_time(device: torch.device, size: int, batch: int, repeats: int) -> dict:
    """``RandomErasing(0.5)``'s rectangles set on a float batch of ``size``
    x ``size`` images on the device (``coordl.device.erase``), a copy per
    rectangle and through the mask: ``{way: figures}``, per image: the
    host's time (best of ``repeats``, synchronized) and, on a GPU, the
    device's own behind a GPU sleep (as :func:`device_time`)."""
    from coordl.device import erase as ER

    rows = erase_rects(batch, size)
    y = torch.zeros(batch, 3, size, size, device=device)
    value = ER.value_on((0.0,), device)
    out = {}
    kept = ER.FEW_RECTS, ER.MASK_DEVICES
    try:
        for way, few, on in (("a copy per rectangle", 10 ** 9, ()), ("the mask", 0, (device.type,))):
            ER.FEW_RECTS, ER.MASK_DEVICES = few, on
            ER.erase_rows(y, rows, value)        # warm
            best = float("inf")
            for _ in range(repeats):
                _sync(device)
                t = time.perf_counter()
                ER.erase_rows(y, rows, value)
                _sync(device)
                best = min(best, time.perf_counter() - t)
            row = out[way] = {"host_us": round(best * 1e6 / batch, 2), "rectangles": sum(map(len, rows))}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(int(2e8))
                start.record()
                ER.erase_rows(y, rows, value)
                end.record()
                end.synchronize()
                row["device_us"] = round(start.elapsed_time(end) * 1e3 / batch, 2)
    finally:
        ER.FEW_RECTS, ER.MASK_DEVICES = kept
    return out


def _mixup(batch, num_classes: int = 1000):
    """A mixup over default_collate's batch written with torch alone, as
    torchvision's ``v2.MixUp`` computes it (one Beta draw, the batch rolled
    by one, one-hot labels mixed alike)."""
    from torch.utils.data import default_collate

    x, y = default_collate(batch)
    lam = float(torch.distributions.Beta(torch.tensor([0.2]), torch.tensor([0.2])).sample())
    y = torch.nn.functional.one_hot(y, num_classes).float()
    return x.roll(1, 0).mul_(1 - lam).add_(x.mul(lam)), y.roll(1, 0).mul_(1 - lam).add_(y.mul(lam))


def collate_time(device: torch.device, size: int, batch: int, repeats: int) -> dict:
    """decode="device" with a ``collate_fn``: per image, the host's time to
    make its samples from a staged batch of ``size`` x ``size`` float
    images with int labels (``samples_of``), to run the mixup in its seeded
    scope, and the seeding alone; on a GPU, the device's own time in the
    mixup behind a GPU sleep (as :func:`device_time`)."""
    from coordl import _rng
    from coordl.pipeline import collate as C

    images = torch.randn(batch, 3, size, size, device=device)
    labels = torch.randint(0, 1000, (batch,))
    layout = C.layout_of((torch.zeros(3, size, size), 0), batch)
    host = [torch.zeros(batch, 50, dtype=torch.int64), labels]      # records in the images' place, labels
    staged = [images, labels.to(device)]

    def best(fn) -> float:
        fn()
        b = float("inf")
        for _ in range(repeats):
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            b = min(b, time.perf_counter() - t)
        return round(b * 1e6 / batch, 2)

    samples = C.samples_of(staged, host, layout, [(0,)])

    def seeded_mixup():
        with _rng.seeded_collate(1, 0, 3):
            _mixup(samples)

    def seeding():
        with _rng.seeded_collate(1, 0, 3):
            pass

    out = {"samples_of_us": best(lambda: C.samples_of(staged, host, layout, [(0,)])),
           "collate_us": best(seeded_mixup), "seeding_us": best(seeding)}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2e8))
        start.record()
        seeded_mixup()
        end.record()
        end.synchronize()
        out["device_us"] = round(start.elapsed_time(end) * 1e3 / batch, 2)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=None, help="an ImageFolder of JPEGs (default: generated, ImageNet-like)")
    ap.add_argument("--images", type=int, default=512, help="generated images")
    ap.add_argument("--sizes", default="16,32,64,224", help="output sizes (RandomResizedCrop)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--batches", type=int, default=4, help="batches captured per size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu (the stand-in) or cuda")
    ap.add_argument("--json", default=None, help="write the figures there")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the script")
    args = ap.parse_args(argv)
    if args.quick:
        args.images, args.sizes, args.batch_size, args.batches, args.repeats = 24, "16", 8, 2, 2
    device = torch.device(args.device)
    if device.type == "cpu":
        D.CPU_TEST_DEVICE = True
        torch.set_num_threads(1)    # one thread's work, as in the pin thread; not torch's pool on tiny images
    elif device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root
        if root is None:
            from coordl.synth import make_image_folder

            root = os.path.join(tmp, "photos")
            kw = {"image_size": (96, 72), "mean_kb": 4} if args.quick else {}
            make_image_folder(root, num_images=args.images, num_classes=2, seed=3, **kw)
        rows = {}
        for size in (int(s) for s in args.sizes.split(",")):
            stage, captured = capture(root, size, args.batch_size, device, args.batches)
            rows[size] = measure(stage, captured, device, args.repeats)
            r = rows[size]
            per_image = (f" (one launch per image: {r['finish_per_image_us']:.1f})" if r["geometry_kernel"]
                         else " (one launch per image)")
            no_launch = (f", with the batch kernel's launch a no-op {r['finish_no_launch_us']:.1f}"
                         if "finish_no_launch_us" in r else "")
            print(f"{size:>4}x{size:<4} {stage.decoder.name}: finish {r['finish_us']:8.1f} us/image{per_image}"
                  f"{no_launch}, decode bookkeeping {r['decode_bookkeeping_us']:6.1f}, decoder "
                  f"{r['decoder_us']:8.1f} ({r['images']} images, best of {args.repeats}; geometry: "
                  f"{r['kernel'] or 'one launch per image'})", flush=True)
            if "device_us" in r:        # the GPU's own time in finish, per path
                print("          finish on the GPU alone, us/image: " + "; ".join(
                    f"{k} {v['us_per_image']:.2f}" + (" (host behind)" if v["host_behind"] else "")
                    for k, v in r["device_us"].items()), flush=True)
            r["jitter"] = jitter_time(device, size, args.batch_size, args.repeats)
            for path, j in r["jitter"].items():
                print(f"          ColorJitter(0.4, 0.4, 0.4, 0.1) after the geometry, {path}: {j['host_us']:.2f} "
                      "us/image on the host" + (f", {j['device_us']:.2f} on the GPU alone" if "device_us" in j else "")
                      + ("" if all(j["exact"].values()) else f" (kinds on the CPU path's code: {j['exact']})"),
                      flush=True)
            for key, name, tensor in (("policy", "TrivialAugmentWide", False), ("augmix", "AugMix", False),
                                      ("policy_tensor", "TrivialAugmentWide", True)):
                r[key] = j = policy_time(device, size, args.batch_size, args.repeats, name, tensor)
                if j is not None:
                    print(f"          {name}(){' given a tensor' if tensor else ''} after the geometry: "
                          f"{j['host_us']:.2f} us/image on the host"
                          + (f", {j['device_us']:.2f} on the GPU alone" if "device_us" in j else "")
                          + (f"; against the CPU's mix: {j['vs_cpu']['share']:.2e} of the values differ, by at "
                             f"most {j['vs_cpu']['max']}" if "vs_cpu" in j else "")
                          + ("" if all(j["exact"].values()) else f" (kinds on the CPU path's code: {j['exact']})"),
                          flush=True)
            r["erasing"] = erase_time(device, size, args.batch_size, args.repeats)
            for way, e in r["erasing"].items():
                print(f"          RandomErasing(0.5) after the tail ({e['rectangles']} rectangles in "
                      f"{args.batch_size} rows), {way}: {e['host_us']:.2f} us/image on the host"
                      + (f", {e['device_us']:.2f} on the GPU alone" if "device_us" in e else ""), flush=True)
            r["collate"] = c = collate_time(device, size, args.batch_size, args.repeats)
            print(f"          a mixup collate_fn on the device's batch: its samples {c['samples_of_us']:.2f} "
                  f"us/image (pin thread), the collate_fn {c['collate_us']:.2f} (training thread; the seeding "
                  f"{c['seeding_us']:.2f} of it)" + (f", {c['device_us']:.2f} on the GPU alone"
                                                     if "device_us" in c else ""), flush=True)
    facts = {"device": str(device), "torch": torch.__version__, "cpus": os.cpu_count(),
             "batch_size": args.batch_size, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"facts": facts, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
