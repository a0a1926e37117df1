"""Synthetic photo-like ImageFolder datasets, for tests and benchmarks.

:func:`make_image_folder` writes ``root/class_XX/img_XXXXXX.jpg``.  The
images are neither flat colour nor white noise, either of which gives JPEG
sizes and decode costs unlike photos': each one is a smooth colour gradient
with blurred shapes at two scales, a grain of band-limited and fine noise, and
ImageNet-like dimensions (most around 500x375, aspect ratios from 3:4 to 4:3,
some portrait).  The JPEG quality is calibrated on the first images so that
the mean file size comes near ``mean_kb`` (ImageNet's training set averages
about 110 KB).

Images are drawn at low resolution with PIL and numpy and scaled up, and
share one tile of grain: 2,000 images take about ten seconds on one core.
The output depends on the arguments other than ``workers`` only: image ``k``
comes from generators seeded by ``(seed, k)``.

Command line::

    python -m coordl.synth ROOT --images 2000 --classes 10 --mean-kb 110
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

__all__ = ["make_image_folder", "image_spec", "render_image", "main"]

_Q_MIN, _Q_MAX = 30, 97
_CALIBRATION_IMAGES = 48
_FINE_GAIN = 0.8      # amplitude of per-pixel grain (times a +-16 uniform)
_TEXTURE_GAIN = 24.0  # amplitude of band-limited grain


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, index])


def image_spec(seed: int, index: int, image_size: tuple[int, int] | None = None
               ) -> tuple[int, int, float]:
    """``(width, height, detail)`` of image ``index``.

    Without ``image_size``: ImageNet-like dimensions, the long side 500 for
    70% of the images and 300..800 otherwise, aspect ratio 4:3 (55%), square
    (10%) or between, portrait for one image in five.  ``detail`` (a
    log-normal factor around 1) varies the amount of texture, hence the file
    size, from image to image.
    """
    rng = _rng(seed, index)
    detail = float(np.clip(rng.lognormal(0.0, 0.45), 0.3, 3.0))
    if image_size is not None:
        w, h = image_size
        return int(w), int(h), detail
    long_side = 500 if rng.random() < 0.7 else int(rng.integers(300, 801))
    r = rng.random()
    aspect = 4 / 3 if r < 0.55 else 1.0 if r < 0.65 else float(rng.uniform(1.0, 4 / 3))
    short_side = max(1, int(round(long_side / aspect)))
    if rng.random() < 0.2:
        return short_side, long_side, detail
    return long_side, short_side, detail


_TILE = 1024
_TILES: dict[int, np.ndarray] = {}


def _grain_tile(seed: int) -> np.ndarray:
    """A float32 tile of film-grain-like luminance noise for ``seed``:
    band-limited noise (white noise at half resolution, upscaled) plus
    per-pixel noise.  Images take it at a random offset, so no image pays
    for drawing its own noise."""
    tile = _TILES.get(seed)
    if tile is None:
        rng = _rng(seed, 1 << 41)
        coarse = rng.standard_normal((_TILE // 2, _TILE // 2), dtype=np.float32)
        band = np.asarray(Image.fromarray(coarse).resize((_TILE, _TILE), Image.BICUBIC))
        fine = rng.integers(-16, 17, (_TILE, _TILE)).astype(np.float32)
        tile = band * np.float32(_TEXTURE_GAIN) + fine * np.float32(_FINE_GAIN)
        _TILES[seed] = tile
    return tile


def _draw_shapes(rng: np.random.Generator, img: Image.Image, count: int, max_frac: float) -> None:
    draw = ImageDraw.Draw(img)
    w, h = img.size
    for _ in range(count):
        x0, y0 = rng.uniform(-0.1, 1.0, 2) * (w, h)
        sw, sh = rng.uniform(0.03, max_frac, 2) * (w, h)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        box = [float(x0), float(y0), float(x0 + sw), float(y0 + sh)]
        kind = rng.random()
        if kind < 0.45:
            draw.ellipse(box, fill=colour)
        elif kind < 0.8:
            draw.rectangle(box, fill=colour)
        else:
            pts = rng.uniform(0.0, 1.0, (3, 2)) * (sw, sh) + (x0, y0)
            draw.polygon([(float(x), float(y)) for x, y in pts], fill=colour)


def render_image(seed: int, index: int, width: int, height: int, detail: float = 1.0) -> Image.Image:
    """The RGB image ``index`` of a dataset generated with ``seed``."""
    rng = _rng(seed, index + (1 << 40))  # a stream apart from image_spec's
    w, h = int(width), int(height)
    # Gradient between four random corner colours, with large soft shapes.
    corners = rng.integers(0, 256, (2, 2, 3), dtype=np.uint8)
    img = Image.fromarray(corners).resize((max(4, w // 8), max(4, h // 8)), Image.BILINEAR)
    _draw_shapes(rng, img, int(rng.integers(3, 9)), 0.6)
    img = img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.5, 1.5))))
    # Smaller, sharper shapes at quarter resolution.
    img = img.resize((max(4, w // 4), max(4, h // 4)), Image.BILINEAR)
    _draw_shapes(rng, img, int(rng.integers(6, 20)), 0.25)
    img = img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 0.9))))
    img = img.resize((w, h), Image.BICUBIC)
    # Grain from the dataset's shared tile, at a random offset.
    tile = _grain_tile(seed)
    y0 = int(rng.integers(0, _TILE - h + 1)) if h < _TILE else 0
    x0 = int(rng.integers(0, _TILE - w + 1)) if w < _TILE else 0
    tile = tile[y0:, x0:]
    grain = np.empty((h, w), dtype=np.int16)
    gain = np.float32(detail)
    for ys in range(0, h, _TILE):  # repeat the tile over bigger images
        for xs in range(0, w, _TILE):
            blk = grain[ys:ys + _TILE, xs:xs + _TILE]
            np.multiply(tile[:blk.shape[0], :blk.shape[1]], gain, out=blk, casting="unsafe")
    out = np.asarray(img, dtype=np.int16)
    out += grain[:, :, None]
    np.clip(out, 0, 255, out=out)
    return Image.fromarray(out.astype(np.uint8))


def _encode(img: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=int(quality))
    return buf.getvalue()


def _calibrate(images: list[Image.Image], mean_pixels: float, mean_kb: float) -> int:
    """The quality whose mean size over ``images``, scaled to
    ``mean_pixels`` per image, is nearest ``mean_kb``."""
    pixels = sum(im.width * im.height for im in images)
    target = mean_kb * 1024.0
    cache: dict[int, float] = {}

    def estimate(q: int) -> float:
        if q not in cache:
            total = sum(len(_encode(im, q)) for im in images)
            cache[q] = total / pixels * mean_pixels
        return cache[q]

    lo, hi = _Q_MIN, _Q_MAX
    while lo < hi:  # smallest quality reaching the target
        mid = (lo + hi) // 2
        if estimate(mid) < target:
            lo = mid + 1
        else:
            hi = mid
    if lo > _Q_MIN and abs(estimate(lo - 1) - target) < abs(estimate(lo) - target):
        return lo - 1
    return lo


def make_image_folder(root: str | os.PathLike, num_images: int = 2000, num_classes: int = 10,
                      mean_kb: float = 110.0, image_size: tuple[int, int] | None = None,
                      seed: int = 0, quality: int | None = None, workers: int = 1) -> str:
    """Write a synthetic ImageFolder dataset of JPEGs under ``root``.

    Args:
        root: output directory (created; existing files of the same names
            are overwritten).
        num_images: number of images, spread evenly over the classes
            (image ``k`` goes to class ``k % num_classes``).
        num_classes: number of class folders ``class_00``, ``class_01``...
        mean_kb: target mean file size in KB, reached by calibrating the JPEG
            quality on the first images (unless ``quality`` is given).  Small
            ``image_size`` values cannot reach large targets: the quality then
            stops at its maximum (97).
        image_size: ``(width, height)`` of every image instead of the
            ImageNet-like distribution, e.g. ``(64, 48)`` for tests.
        seed: everything written is a function of the arguments (not of
            ``workers``).
        quality: a fixed JPEG quality (1..100).
        workers: threads generating images (PIL and numpy release the GIL).

    Returns:
        ``root`` as a string path.
    """
    root = os.fspath(root)
    if num_images < 0 or num_classes < 1:
        raise ValueError(f"need num_images >= 0 and num_classes >= 1, got {num_images} and {num_classes}")
    if image_size is not None and (len(image_size) != 2 or min(image_size) < 1):
        raise ValueError(f"image_size should be (width, height) of positive ints, got {image_size!r}")
    width = max(2, len(str(num_classes - 1)))
    class_dirs = [os.path.join(root, f"class_{c:0{width}d}") for c in range(num_classes)]
    for d in class_dirs:
        os.makedirs(d, exist_ok=True)
    specs = [image_spec(seed, k, image_size) for k in range(num_images)]

    rendered: dict[int, Image.Image] = {}
    if quality is None:
        if num_images:
            k_cal = min(num_images, _CALIBRATION_IMAGES)
            for k in range(k_cal):
                rendered[k] = render_image(seed, k, *specs[k])
            mean_pixels = float(np.mean([w * h for w, h, _ in specs]))
            quality = _calibrate([rendered[k] for k in range(k_cal)], mean_pixels, mean_kb)
        else:
            quality = 90
    elif not 1 <= int(quality) <= 100:
        raise ValueError(f"quality should be in 1..100, got {quality}")

    def write(k: int) -> int:
        img = rendered.pop(k, None)
        if img is None:
            img = render_image(seed, k, *specs[k])
        data = _encode(img, quality)
        path = os.path.join(class_dirs[k % num_classes], f"img_{k:06d}.jpg")
        with open(path, "wb") as f:
            f.write(data)
        return len(data)

    if workers <= 1:
        for k in range(num_images):
            write(k)
    else:
        with ThreadPoolExecutor(max_workers=int(workers)) as pool:
            for _ in pool.map(write, range(num_images), chunksize=1):
                pass
    return root


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m coordl.synth ROOT [options]``: :func:`make_image_folder` from
    the command line; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m coordl.synth",
                                description="Write a synthetic photo-like ImageFolder dataset of JPEGs.")
    p.add_argument("root", help="output directory")
    p.add_argument("--images", type=int, default=2000, help="number of images (default 2000)")
    p.add_argument("--classes", type=int, default=10, help="number of classes (default 10)")
    p.add_argument("--mean-kb", type=float, default=110.0, help="target mean JPEG size in KB (default 110)")
    p.add_argument("--size", default=None, metavar="WxH",
                   help="fixed image size instead of ImageNet-like sizes, e.g. 64x48")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quality", type=int, default=None, help="fixed JPEG quality (default: calibrated)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="generating threads")
    args = p.parse_args(argv)
    size = None
    if args.size:
        try:
            w, h = (int(v) for v in args.size.lower().split("x"))
        except ValueError:
            p.error(f"--size should look like 64x48, got {args.size!r}")
        size = (w, h)
    t0 = time.perf_counter()
    make_image_folder(args.root, num_images=args.images, num_classes=args.classes, mean_kb=args.mean_kb,
                      image_size=size, seed=args.seed, quality=args.quality, workers=args.workers)
    secs = time.perf_counter() - t0
    sizes = [e.stat().st_size for d in os.scandir(args.root) if d.is_dir()
             for e in os.scandir(d.path) if e.name.endswith(".jpg")]
    total = sum(sizes)
    mean = total / len(sizes) / 1024 if sizes else 0.0
    print(f"{args.root}: {len(sizes)} JPEGs in {args.classes} classes, {total / 2**20:.1f} MB, "
          f"mean {mean:.1f} KB, {secs:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
