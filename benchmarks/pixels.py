"""coordl's fused pixels against torchvision's, step by step, and what the
reduced-scale JPEG decode (``jpeg_draft``) costs in pixels and saves in time.

1. Tolerance of every fused step: torchvision pipelines ending in a uint8
   image (so differences are in uint8 levels), each translated by
   coordl.tvcompat and run on the fused decode path
   (``from_bytes``), against torchvision's own output on PIL's decode
   (random crops: the same box and flip drawn as coordl draws them).  Per
   step: the largest difference, and how many values differ by 1 and by 2
   or more.  The conversions after the uint8 image (ToTensor / ToDtype,
   Normalize) are compared as floats.
2. The reduced-scale decode, on the images it applies to (at least twice
   the output size): largest difference, share of values off by >= 2 levels,
   PSNR against torchvision.
3. Prep time per image (decode + transforms, one thread, CPU ms), default
   against ``jpeg_draft``, and against coordl from another source tree
   (``--old PATH``: the code before a change of the default), on
   ImageNet-sized and large images: each side in child processes, the sides
   alternating, the fastest pass counting, in the process's CPU time
   (robust to a loaded machine, where wall time is not).

    python benchmarks/pixels.py                  # 60 ImageNet-sized + 12 large (2000x1500) images
    python benchmarks/pixels.py --old /tmp/old   # with the earlier code's prep time
    python benchmarks/pixels.py --quick          # smoke run (tests use it)

Writes bench_out/pixels.json.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _tv():
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        raise SystemExit("torchvision is not installed: pip install 'coordl[test]'")
    from torchvision.transforms import v2 as V2
    from torchvision.transforms import functional as F1
    from torchvision.transforms import transforms as V1
    from torchvision.transforms.v2 import functional as F2

    return V1, V2, F1, F2


def step_cases(size: int):
    """name -> (torchvision pipeline ending in uint8 (or float for the
    conversions), how its random draws are reproduced: None, "rrc-v1", "rrc-v2")."""
    V1, V2, _, _ = _tv()
    IM = V1.InterpolationMode
    r = size * 256 // 224
    u8 = V2.ToDtype(torch.uint8)
    return {
        "PIL image: Resize bilinear": (V1.Compose([V1.Resize(r), V1.CenterCrop(size), V1.PILToTensor()]), None),
        "PIL image: Resize bicubic": (V1.Compose([V1.Resize(r, IM.BICUBIC), V1.CenterCrop(size), V1.PILToTensor()]),
                                      None),
        "PIL image: RandomResizedCrop bilinear + flip": (
            V1.Compose([V1.RandomResizedCrop(size), V1.RandomHorizontalFlip(), V1.PILToTensor()]), "rrc-v1"),
        "PIL image: RandomResizedCrop bicubic + flip": (
            V1.Compose([V1.RandomResizedCrop(size, interpolation=IM.BICUBIC), V1.RandomHorizontalFlip(),
                        V1.PILToTensor()]), "rrc-v1"),
        "uint8 tensor (v2): Resize bilinear": (
            V2.Compose([V2.ToImage(), V2.Resize(r), V2.CenterCrop(size), u8]), None),
        "uint8 tensor (v2): Resize bicubic": (
            V2.Compose([V2.ToImage(), V2.Resize(r, IM.BICUBIC), V2.CenterCrop(size), u8]), None),
        "uint8 tensor (v2): Resize bilinear, antialias=False": (
            V2.Compose([V2.ToImage(), V2.Resize(r, antialias=False), V2.CenterCrop(size), u8]), None),
        "uint8 tensor (v2): Resize bicubic, antialias=False": (
            V2.Compose([V2.ToImage(), V2.Resize(r, IM.BICUBIC, antialias=False), V2.CenterCrop(size), u8]), None),
        "uint8 tensor (v2): Resize nearest": (
            V2.Compose([V2.ToImage(), V2.Resize(r, IM.NEAREST), V2.CenterCrop(size), u8]), None),
        "uint8 tensor (v2): Resize nearest-exact": (
            V2.Compose([V2.ToImage(), V2.Resize(r, IM.NEAREST_EXACT), V2.CenterCrop(size), u8]), None),
        "uint8 tensor (v2): RandomResizedCrop bilinear + flip": (
            V2.Compose([V2.ToImage(), V2.RandomResizedCrop(size), V2.RandomHorizontalFlip(), u8]), "rrc-v2"),
        "uint8 tensor (v1): Resize bilinear": (
            V1.Compose([V1.PILToTensor(), V1.Resize(r), V1.CenterCrop(size)]), None),
        "uint8 tensor (v1): Resize bilinear, antialias=False": (
            V1.Compose([V1.PILToTensor(), V1.Resize(r, antialias=False), V1.CenterCrop(size)]), None),
        "uint8 tensor (v1): Resize nearest": (
            V1.Compose([V1.PILToTensor(), V1.Resize(r, IM.NEAREST), V1.CenterCrop(size)]), None),
        "ToTensor, Normalize (v1)": (
            V1.Compose([V1.Resize(r), V1.CenterCrop(size), V1.ToTensor(), V1.Normalize(MEAN, STD)]), None),
        "ToImage, ToDtype(float32, scale=True), Normalize (v2)": (
            V2.Compose([V2.Resize(r), V2.CenterCrop(size), V2.ToImage(), V2.ToDtype(torch.float32, scale=True),
                        V2.Normalize(MEAN, STD)]), None),
    }


def _reference(tf, how, pil, key):
    """torchvision's output for ``pil``, with coordl's draws for sample ``key``."""
    if how is None:
        return tf(pil)
    from coordl import _rng
    from coordl.decode.ops import _draw_box

    V1, V2, F1, F2 = _tv()
    rrc = next(t for t in tf.transforms if type(t).__name__ == "RandomResizedCrop")
    g = _rng.derive(*key)
    box = _draw_box(pil.height, pil.width, rrc.scale, rrc.ratio, g)
    flip = g.random() < 0.5
    size = list(rrc.size)
    if how == "rrc-v1":
        x = F1.resized_crop(pil, *box, size, rrc.interpolation)
        return F1.pil_to_tensor(F1.hflip(x) if flip else x)
    x = F2.resized_crop(F2.to_image(pil), *box, size, rrc.interpolation, antialias=True)
    return (F2.horizontal_flip(x) if flip else x).as_subclass(torch.Tensor)


def tolerance(files, size, draws):
    from coordl import _rng
    from coordl.tvcompat import translate

    rows = {}
    for name, (tf, how) in step_cases(size).items():
        fused, _names, rest = translate(tf)
        assert rest == (), (name, rest)
        worst, n1, n2, n, fl = 0, 0, 0, 0, None
        for path, raw, pil in files:
            for k in range(draws if how else 1):
                key = (5, 0, k)
                with _rng.sample_rng(*key):
                    got = fused.from_bytes(raw)
                ref = _reference(tf, how, pil, key)
                if got.is_floating_point():
                    fl = max(fl or 0.0, float((got.double() - ref.double()).abs().max()))
                    continue
                d = (got.int() - ref.int()).abs()
                worst = max(worst, int(d.max()))
                n1 += int((d == 1).sum())
                n2 += int((d >= 2).sum())
                n += d.numel()
        if fl is not None:
            rows[name] = {"max_abs_float": fl}
            print(f"  {name:<58} max |difference| {fl:.2e} (floats)", flush=True)
        else:
            rows[name] = {"max_levels": worst, "values": n, "off_by_1": n1, "off_by_2_or_more": n2}
            print(f"  {name:<58} max {worst} level(s); off by 1: {n1 / max(n, 1):.4%}, by >= 2: {n2}", flush=True)
    return rows


def _psnr(a, b) -> float:
    mse = float(((a.double() - b.double()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(255 ** 2 / mse)


def draft_difference(files, size, draws):
    """The reduced-scale decode against torchvision, on the images it applies to."""
    from coordl import _rng
    from coordl.decode import jpeg as _decode
    from coordl.tvcompat import translate

    V1, V2, F1, F2 = _tv()
    IM = V1.InterpolationMode
    r = size * 256 // 224
    cases = {
        "Resize(256) + CenterCrop(224), bilinear": (V1.Compose([V1.Resize(r), V1.CenterCrop(size),
                                                                V1.PILToTensor()]), None),
        "Resize(256) + CenterCrop(224), bicubic": (V1.Compose([V1.Resize(r, IM.BICUBIC), V1.CenterCrop(size),
                                                               V1.PILToTensor()]), None),
        "RandomResizedCrop(224) + flip, bilinear": (V1.Compose([V1.RandomResizedCrop(size),
                                                                V1.RandomHorizontalFlip(), V1.PILToTensor()]),
                                                    "rrc-v1"),
    }
    rows = {}
    for name, (tf, how) in cases.items():
        fused, _, _ = translate(tf, draft=True)
        first = fused.transforms[0]
        worst, n2, n, psnr, scaled, total = 0, 0, 0, [], 0, 0
        for path, raw, pil in files:
            for k in range(draws if how else 1):
                key = (6, 0, k)
                total += 1
                if how:
                    from coordl.decode.ops import _draw_box

                    box = _draw_box(pil.height, pil.width, first.scale, first.ratio, _rng.derive(*key))
                    d = _decode.draft_scale(box[2:], first.size)
                else:
                    d = _decode.draft_scale((pil.height, pil.width), first.output_size(pil.height, pil.width))
                if d == 1:
                    continue
                scaled += 1
                with _rng.sample_rng(*key):
                    got = fused.from_bytes(raw)
                ref = _reference(tf, how, pil, key)
                dd = (got.int() - ref.int()).abs()
                worst = max(worst, int(dd.max()))
                n2 += int((dd >= 2).sum())
                n += dd.numel()
                psnr.append(_psnr(got, ref))
        rows[name] = {"samples": total, "at_reduced_scale": scaled, "max_levels": worst,
                      "share_off_by_2_or_more": round(n2 / max(n, 1), 4),
                      "psnr_median_db": round(statistics.median(psnr), 1) if psnr else None,
                      "psnr_min_db": round(min(psnr), 1) if psnr else None}
        print(f"  {name:<42} {scaled}/{total} at a reduced scale: max {worst} levels, "
              f"{n2 / max(n, 1):.0%} of values off by >= 2, PSNR median "
              f"{rows[name]['psnr_median_db']} dB (min {rows[name]['psnr_min_db']})", flush=True)
    return rows


_TIMING_CHILD = """
import json, sys
sys.path.insert(0, {tree!r}); sys.path.insert(1, {here!r})
import torch
torch.set_num_threads(1)
import coordl
assert coordl.__file__.startswith({tree!r}), coordl.__file__
import pixels
print("RESULT " + json.dumps({{label: pixels.prep_times(files, {size!r}, {repeat!r}, draft={draft!r})
                              for label, files in {sets!r}.items()}}))
"""


def prep_times(paths, size, repeat, draft=False):
    """CPU ms per image of the fused path (decode + transforms, one thread,
    the fastest of ``repeat`` passes over ``paths``): {pipeline: ms}."""
    from coordl import _rng
    from coordl.tvcompat import translate

    V1, _, _, _ = _tv()
    r = size * 256 // 224
    pipes = {
        "train (RandomResizedCrop, flip, ToTensor, Normalize)": V1.Compose([
            V1.RandomResizedCrop(size), V1.RandomHorizontalFlip(), V1.ToTensor(), V1.Normalize(MEAN, STD)]),
        "eval (Resize, CenterCrop, ToTensor, Normalize)": V1.Compose([
            V1.Resize(r), V1.CenterCrop(size), V1.ToTensor(), V1.Normalize(MEAN, STD)]),
        "timm eval (bicubic, crop_pct 0.95)": V1.Compose([
            V1.Resize(int(size / 0.95), V1.InterpolationMode.BICUBIC), V1.CenterCrop(size), V1.ToTensor(),
            V1.Normalize(MEAN, STD)]),
    }
    raws = []
    for p in paths:
        with open(p, "rb") as f:
            raws.append(f.read())
    out = {}
    for name, tf in pipes.items():
        fused = translate(tf, draft=True)[0] if draft else translate(tf)[0]
        for i, raw in enumerate(raws[:3]):  # warm up (imports, the kernel check, allocations)
            with _rng.sample_rng(1, 0, i):
                fused.from_bytes(raw)
        best = []
        for rep in range(repeat):
            t0 = time.process_time()  # this process's CPU time: what the machine's other load leaves alone
            for i, raw in enumerate(raws):
                with _rng.sample_rng(0, rep, i):
                    fused.from_bytes(raw)
            best.append((time.process_time() - t0) / len(raws) * 1e3)
        out[name] = round(min(best), 3)
    return out


def timing(sets, size, repeat, rounds, old):
    """Each side in a child process of its own (one per side and round, timing
    every set of images), the sides alternating over ``rounds`` (order
    rotated), the fastest pass of all counting: what the machine's other load
    leaves alone."""
    tree = os.path.dirname(HERE)
    sides = {"default": (tree, False), "jpeg_draft": (tree, True)}
    if old:
        sides["old"] = (os.path.abspath(old), False)
    names = list(sides)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    rows: dict = {label: {} for label in sets}
    for rnd in range(rounds):
        for side in names[rnd % len(names):] + names[:rnd % len(names)]:
            t, draft = sides[side]
            code = _TIMING_CHILD.format(tree=t, here=HERE, sets={k: list(v) for k, v in sets.items()}, size=size,
                                        repeat=repeat, draft=draft)
            res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                 timeout=3600)
            line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
            if res.returncode != 0 or line is None:
                raise SystemExit(f"the timing of {side} ({t}) failed:\n{res.stderr[-3000:]}")
            for label, per_pipeline in json.loads(line[len("RESULT "):]).items():
                for name, ms in per_pipeline.items():
                    best = rows[label].setdefault(name, {})
                    best[side] = min(ms, best.get(side, float("inf")))
    for label, best in rows.items():
        for name, v in best.items():
            extra = ""
            if "old" in v:
                extra = f", old {v['old']:.2f} ms: default / old time {v['default'] / v['old']:.2f}x"
            print(f"  {label:<16} {name:<52} default {v['default']:.2f} ms, jpeg_draft {v['jpeg_draft']:.2f} ms "
                  f"(default / draft time {v['default'] / v['jpeg_draft']:.2f}x){extra}", flush=True)
    return rows


def _images(tmp, n, size, seed, quality=90):
    from coordl.synth import render_image, image_spec

    paths = []
    for k in range(n):
        w, h, detail = image_spec(seed, k, size)
        p = os.path.join(tmp, f"img_{seed}_{k}.jpg")
        buf = io.BytesIO()
        render_image(seed, k, w, h, detail).save(buf, "JPEG", quality=quality)
        with open(p, "wb") as f:
            f.write(buf.getvalue())
        paths.append(p)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=60, help="ImageNet-sized images")
    ap.add_argument("--large", type=int, default=12, help="large images")
    ap.add_argument("--large-size", default="2000x1500", metavar="WxH")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--draws", type=int, default=4, help="random crops per image")
    ap.add_argument("--repeat", type=int, default=3, help="timing passes per child (the fastest counts)")
    ap.add_argument("--rounds", type=int, default=3, help="children per side, alternating")
    ap.add_argument("--old", default=None, metavar="PATH", help="coordl source tree to time against")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--parts", default="1,2,3", help="which of the three parts to run")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    args.parts = args.parts.split(",")
    if args.quick:
        args.images, args.large, args.large_size, args.size, args.draws, args.repeat = 3, 1, "301x203", 64, 1, 1
        args.rounds = 1
    lw, lh = (int(v) for v in args.large_size.lower().split("x"))
    from PIL import Image

    tmp = tempfile.mkdtemp(prefix="pixels-")
    try:
        imagenet = _images(tmp, args.images, None, 3)
        large = _images(tmp, args.large, (lw, lh), 4)

        def load(paths):
            out = []
            for p in paths:
                with open(p, "rb") as f:
                    raw = f.read()
                with Image.open(p) as img:
                    out.append((p, raw, img.convert("RGB")))
            return out

        tol = draft = times = None
        if {"1", "2"} & set(args.parts):
            files = load(imagenet) + load(large)
        if "1" in args.parts:
            print(f"1. tolerance of each fused step ({len(imagenet)} ImageNet-sized and {len(large)} {lw}x{lh} "
                  f"images, {args.draws} crops each for random crops)", flush=True)
            tol = tolerance(files, args.size, args.draws)
        if "2" in args.parts:
            print("2. the reduced-scale decode (jpeg_draft=True) against torchvision", flush=True)
            draft = draft_difference(files, args.size, args.draws)
        if "3" in args.parts:
            print("3. prep time per image, one thread, CPU time (fastest of the passes)", flush=True)
            times = timing({"ImageNet-sized": imagenet, f"{lw}x{lh}": large}, args.size, args.repeat, args.rounds,
                           args.old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pixels.json"), "w") as f:
        json.dump({"tolerance": tol, "draft": draft, "prep_ms": times,
                   "settings": {"images": args.images, "large": args.large, "large_size": [lw, lh],
                                "size": args.size, "draws": args.draws, "repeat": args.repeat,
                                "rounds": args.rounds, "old": args.old,
                                "cpus": os.cpu_count(), "torch": torch.__version__}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
