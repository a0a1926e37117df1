"""``decode="device"``: the operations of torchvision's auto-augment
policies on a PIL image (``TrivialAugmentWide``, ``RandAugment``,
``AutoAugment``), computed on the device as PIL computes them.

On the CPU path an auto-augment policy gets the planes of the fused crop
(``coordl.tvcompat.PolicyOnDevice.on_planes``), and each operation it
draws is PIL's, computed by ``coordl.decode.color.apply_ops``: ``ImageEnhance`` (brightness,
colour, contrast: :mod:`.jitter`'s blends; sharpness here), ``ImageOps``
(posterize, solarize, autocontrast, equalize, invert) or
``Image.transform``/``Image.transpose`` (shears, translations, rotations).
Here each one is computed on a batch's uint8 (k, 3, H, W) rows, each row
with its own value, by torch's operations, with PIL's arithmetic:

- sharpness: PIL's 3x3 ``SMOOTH`` filter in single precision, its sums
  taken in PIL's order (the row below first, each row's three products left
  to right, from 0.5), clipped and truncated, the image's border copied;
  then PIL's blend of the image with it (:func:`_blend`, the colour
  operations' too);
- posterize, solarize, invert: their tables, on each value;
- autocontrast: each channel's table from its lowest and highest values,
  ``int(v * scale + offset)`` in double precision (a multiply, then an add:
  nothing fused), clipped to 0..255;
- equalize: each channel's table from its histogram (integers: the
  histogram's running sum, PIL's step), clipped to 0..255 as PIL's
  ``point`` stores it;
- affine, nearest neighbour (a fill outside): PIL's three ways for the
  matrix it is given: a scale without rotation or shear by tables of source
  columns and rows accumulated in double precision as PIL accumulates
  them; otherwise, where the corners' coordinates fit, PIL's 16.16 fixed
  point (integers: exact on any device); else PIL's double-precision
  accumulation along each row (made on the host);
- affine, bilinear or bicubic (timm's policies draw one of the two per
  operation; torchvision's with ``interpolation=``): PIL's generic
  transform, each pixel's source point and its filter's weighted
  neighbours in double precision as PIL's macros compute them;
- perspective (torchvision's ``RandomPerspective``): PIL's generic
  transform too, each pixel's source point its perspective map's, in double
  precision (a quotient of two sums); nearest neighbours by PIL's COORD
  of it;
- timm's solarize-add: its table;
- torchvision's ``GaussianBlur`` (timm's ``gaussian_blur_prob``), which
  blurs the tensor of a PIL image with torch's convolution: on the CPU
  torchvision's own kernel; on a GPU its float32 weights in one grouped
  convolution in double precision, within a level of the CPU path on a
  few values in a million (:data:`TOLERANCE`);
- PIL's own Gaussian blur (timm's ``GaussianBlur`` operations: its
  ``3a`` policy, DeiT III's three augmentations): its three box blurs each
  way, in integers (:func:`box_radius`), exact on any device;
- transpose: PIL's flips and quarter turns; a permutation of the bands
  (torchvision v2's ``RandomChannelPermutation``, ``RandomPhotometricDistort``);
- torchvision's ``AugMix``, which mixes the tensor of a PIL image: its own
  tensor functions for the operations, the rows that drew the same one at a
  step taken together, and its single-precision mix (:mod:`coordl.decode.augmix`):
  on the CPU its very values, on a GPU within :data:`TOLERANCE`.

:class:`.jitter.DeviceJitter` runs them with the colour operations, and
checks each kind against the installed PIL on probe images at its first
use on a device (where one differs, the CPU path's code runs its rows).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..decode import augmix
from ..decode.color import (AFFINE, AUGMIX, AUTOCONTRAST, BLUR, EQUALIZE, INVERT, PERMUTE, PERSPECTIVE, PIL_BLUR,
                            POSTERIZE, SHARPNESS, SOLARIZE, SOLARIZE_ADD, TRANSPOSE, permutation)
from .launch import upload

__all__ = ["CODES", "apply"]

CODES = frozenset((SHARPNESS, POSTERIZE, SOLARIZE, AUTOCONTRAST, EQUALIZE, INVERT, AFFINE, TRANSPOSE, SOLARIZE_ADD,
                   BLUR, AUGMIX, PERSPECTIVE, PIL_BLUR, PERMUTE))
# the kinds the device computes within a stated tolerance of the CPU path, not bit for bit: code -> (the most
# levels a value may differ by, the largest share of values that may differ) on the probes.  On the CPU both
# are the CPU path's values; on a GPU the blur sums in another order, and AugMix runs torchvision's own
# functions there (their sampling and convolution rounding as the GPU does)
TOLERANCE = {BLUR: (1, 1e-3), AUGMIX: (1, 1e-3)}
NEAREST, BILINEAR, BICUBIC = 0, 2, 3          # PIL's resampling filters

# ImageFilter.SMOOTH: its weights over its scale, in single precision as PIL divides them
_SMOOTH = np.array([1, 1, 1, 1, 5, 1, 1, 1, 1], dtype=np.float32) / np.float32(13)


def apply(x: torch.Tensor, code: int, values: list) -> torch.Tensor:
    """The uint8 (k, 3, H, W) rows ``x`` each through the operation ``code``
    with its value ``values[r]`` (``coordl.decode.color``'s terms): new
    rows, ``x`` untouched."""
    if code == SHARPNESS:
        return _sharpness(x, values)
    if code == POSTERIZE:
        masks = [(~((1 << (8 - int(b))) - 1)) & 255 if int(b) < 8 else 255 for b in values]
        return x & upload(np.array(masks, dtype=np.uint8), x.device).view(-1, 1, 1, 1)
    if code == SOLARIZE:
        # PIL's table: i where i < threshold, else 255 - i; for an integer i, i < t is i < ceil(t)
        t = upload(np.array([min(max(math.ceil(v), -1), 256) for v in values], dtype=np.int16), x.device)
        return torch.where(x.to(torch.int16) < t.view(-1, 1, 1, 1), x, 255 - x)
    if code == INVERT:
        return 255 - x
    if code == SOLARIZE_ADD:
        # timm's table: min(255, i + add) under 128, else i
        add = upload(np.array([int(v) for v in values], dtype=np.int16), x.device).view(-1, 1, 1, 1)
        return torch.where(x < 128, (x.to(torch.int16) + add).clamp_(max=255).to(torch.uint8), x)
    if code == AUTOCONTRAST:
        return _lookup(x, _autocontrast_tables(x))
    if code == EQUALIZE:
        return _lookup(x, _equalize_tables(x))
    if code == AFFINE:
        return _affine(x, values)
    if code == PERSPECTIVE:
        return _affine(x, values, perspective=True)
    if code == TRANSPOSE:
        return torch.stack([_transpose(x[r], int(v)) for r, v in enumerate(values)])
    if code == BLUR:
        return _blur(x, values)
    if code == PIL_BLUR:
        return _pil_blur(x, values)
    if code == PERMUTE:        # each row's bands in its order: one gather
        k, c, h, w = x.shape
        order = upload(np.array([permutation(v) for v in values], dtype=np.int64), x.device)
        return torch.gather(x, 1, order.view(k, c, 1, 1).expand(k, c, h, w))
    if code == AUGMIX:
        return augmix.apply(x, values, lambda a: upload(a, x.device))
    raise ValueError(f"not an operation of coordl.device.pil_ops: {code}")


def _blend(a: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """PIL's blend of the uint8 values ``x`` with the float32 integers ``a``
    (broadcast; the other image's values) by the float32 ``alpha``
    (broadcast): ``a + alpha * (x - a)``, each operation rounded to single
    precision (``x - a`` is exact), clipped, truncated: uint8."""
    t = x.to(torch.float32)
    t.sub_(a).mul_(alpha).add_(a)
    return t.clamp_(0.0, 255.0).floor_().to(torch.uint8)


def _lookup(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``x`` (k, C, H, W) through per-row, per-channel ``tables`` (k, C,
    256), uint8."""
    k, c, h, w = x.shape
    idx = x.reshape(k, c, h * w).to(torch.int64)
    return torch.gather(tables, 2, idx).reshape(k, c, h, w)


def _autocontrast_tables(x: torch.Tensor) -> torch.Tensor:
    k, c = x.shape[:2]
    flat = x.reshape(k, c, -1)
    lo = flat.amin(dim=2).to(torch.float64).unsqueeze(2)
    hi = flat.amax(dim=2).to(torch.float64).unsqueeze(2)
    span = hi - lo
    # a true division (a Python number over a tensor is computed as its reciprocal times the number)
    scale = torch.full_like(span, 255.0).div_(span.clamp(min=1.0))
    offset = (-lo) * scale
    ix = torch.arange(256, dtype=torch.float64, device=x.device).view(1, 1, 256)
    v = (ix * scale).add_(offset).trunc_().clamp_(0.0, 255.0)
    return torch.where(span > 0, v, ix.expand_as(v)).to(torch.uint8)


def _equalize_tables(x: torch.Tensor) -> torch.Tensor:
    k, c = x.shape[:2]
    flat = x.reshape(k * c, -1).to(torch.int64)
    n = flat.shape[1]
    hist = torch.zeros(k * c, 256, dtype=torch.int64, device=x.device)
    hist.scatter_add_(1, flat, torch.ones_like(flat))
    top = flat.amax(dim=1, keepdim=True)
    step = (n - hist.gather(1, top)) // 255                        # PIL's: all but the last nonzero bin, over 255
    before = hist.cumsum(1) - hist                                 # the running sum before each value
    safe = step.clamp(min=1)
    lut = (safe // 2 + before) // safe
    ix = torch.arange(256, dtype=torch.int64, device=x.device).view(1, 256)
    lut = torch.where(step > 0, lut, ix.expand_as(lut)).clamp_(0, 255)
    return lut.to(torch.uint8).view(k, c, 256)


def _sharpness(x: torch.Tensor, factors: list) -> torch.Tensor:
    k, c, h, w = x.shape
    if h < 3 or w < 3:                  # PIL copies an image smaller than its kernel
        degenerate = x
    else:
        f = x.to(torch.float32)
        kern = [torch.tensor(float(v), dtype=torch.float32, device=x.device) for v in _SMOOTH]

        def row(r, k3):                 # one row's three products, left to right
            s = r[..., :-2] * k3[0]
            s = s + r[..., 1:-1] * k3[1]
            return s + r[..., 2:] * k3[2]

        ss = torch.full((k, c, h - 2, w - 2), 0.5, dtype=torch.float32, device=x.device)
        ss = ss + row(f[:, :, 2:], kern[0:3])       # the row below first, as PIL sums
        ss = ss + row(f[:, :, 1:-1], kern[3:6])
        ss = ss + row(f[:, :, :-2], kern[6:9])
        degenerate = x.clone()
        degenerate[:, :, 1:-1, 1:-1] = ss.clamp_(0.0, 255.0).to(torch.uint8)
    alpha = upload(np.array(factors, dtype=np.float64).astype(np.float32), x.device).view(-1, 1, 1, 1)
    return _blend(degenerate.to(torch.float32), x, alpha)


def _blur(x: torch.Tensor, values: list, grouped: bool | None = None) -> torch.Tensor:
    """torchvision's ``gaussian_blur`` of each row (its kernel sizes and
    sigmas, its version's kernel), as its tensor kernel computes it: the
    float32 kernel its own function makes, reflect padding, a depthwise
    convolution, rounded to uint8.  On the CPU by torchvision's own tensor
    kernel, a row at a time: its very values.  On a GPU the rows' kernels
    (the same float32 weights) in one grouped convolution in double
    precision: where the CPU path sums in single precision (in an order its
    convolution picks) a value that lands on a rounding boundary can come
    out one level apart (measured: 13 values in a million,
    docs/guide/gpu.md).  ``grouped``: the GPU's way on any device (the
    tests run it on the CPU)."""
    import importlib

    k, c, h, w = x.shape
    if not (grouped if grouped is not None else x.device.type != "cpu"):
        out = torch.empty_like(x)
        for r, (kx, ky, sx, sy, v2) in enumerate(values):
            if v2:
                F = importlib.import_module("torchvision.transforms.v2.functional")
                out[r] = F.gaussian_blur_image(x[r], [int(kx), int(ky)], [float(sx), float(sy)])
            else:
                F = importlib.import_module("torchvision.transforms._functional_tensor")
                out[r] = F.gaussian_blur(x[r], [int(kx), int(ky)], [float(sx), float(sy)])
        return out
    out = torch.empty_like(x)
    by: dict = {}
    for r, v in enumerate(values):
        by.setdefault((int(v[0]), int(v[1])), []).append(r)
    for (kx, ky), rows in by.items():
        kernels = []
        for r in rows:
            _, _, sx, sy, v2 = values[r]
            mod = importlib.import_module("torchvision.transforms.v2.functional._misc" if v2 else
                                          "torchvision.transforms._functional_tensor")
            kernels.append(mod._get_gaussian_kernel2d([kx, ky], [float(sx), float(sy)], dtype=torch.float32,
                                                      device=torch.device("cpu")))
        weight = torch.stack(kernels).to(torch.float64).repeat_interleave(c, 0).unsqueeze(1)
        idx = upload(np.array(rows, dtype=np.int64), x.device)
        part = x.index_select(0, idx).to(torch.float64).reshape(1, len(rows) * c, h, w)
        part = torch.nn.functional.pad(part, [kx // 2, kx // 2, ky // 2, ky // 2], mode="reflect")
        got = torch.nn.functional.conv2d(part, upload(weight.numpy(), x.device), groups=len(rows) * c)
        out.index_copy_(0, idx, got.round_().to(torch.uint8).reshape(len(rows), c, h, w))
    return out


def box_radius(radius: float, passes: int = 3) -> tuple[int, int, int]:
    """PIL's box blur of each pass for its Gaussian blur of ``radius``:
    ``(integer radius, ww, fw)``, the box's whole pixels' weight and its
    two fractional end pixels' in 8.24 fixed point, computed as PIL's C
    computes them (single precision, its sums' double-precision steps where
    the C has double constants)."""
    f32 = np.float32
    r = f32(radius)
    sigma2 = f32(r * r / f32(passes))
    big = f32(math.sqrt(12.0 * float(sigma2) + 1.0))
    whole = f32(math.floor((float(big) - 1.0) / 2.0))
    a = f32(f32(f32(2) * whole + f32(1)) * f32(whole * f32(whole + f32(1)) - f32(3) * sigma2))
    a = f32(a / f32(f32(6) * f32(sigma2 - f32(whole + f32(1)) * f32(whole + f32(1)))))
    box = f32(whole + a)
    ww = int(f32(f32(1 << 24) / f32(box * f32(2) + f32(1))))
    n = int(box)
    return n, ww, ((1 << 24) - (n * 2 + 1) * ww) // 2


def _pil_blur(x: torch.Tensor, values: list) -> torch.Tensor:
    """PIL's ``ImageFilter.GaussianBlur(radius)`` of each row: three box
    blurs along the rows, then three down the columns, each value of each
    pass ``(window sum * ww + the two pixels past it * fw + 2**23) >> 24``
    in integers over the edge-repeated line, stored as uint8 between
    passes: exact on any device."""
    out = torch.empty_like(x)
    by: dict = {}
    for r, v in enumerate(values):
        by.setdefault(box_radius(float(v)) if float(v) > 0 else None, []).append(r)
    for box, rows in by.items():
        idx = upload(np.array(rows, dtype=np.int64), x.device)
        part = x.index_select(0, idx)
        if box is not None:
            for _ in range(3):                      # along the rows
                part = _box_pass(part, *box)
            part = part.transpose(2, 3)             # the columns as rows: each pass reads its line from this view
            for _ in range(3):
                part = _box_pass(part, *box)
            part = part.transpose(2, 3)
        out.index_copy_(0, idx, part)
    return out


def _box_pass(x: torch.Tensor, n: int, ww: int, fw: int) -> torch.Tensor:
    """One of PIL's box-blur passes along the last dimension of a uint8
    (k, c, h, w) batch (or a view of one with its columns as rows: the
    line is gathered into a new tensor either way)."""
    size = x.shape[3]
    at = torch.arange(-n - 1, size + n + 1, device=x.device).clamp_(0, size - 1)
    line = x.index_select(3, at).to(torch.int64)                   # the line, n + 1 pixels repeated each side
    sums = torch.nn.functional.pad(line.cumsum(3), (1, 0))
    window = sums[..., 2 * n + 2:2 * n + 2 + size] - sums[..., 1:1 + size]     # x - n .. x + n
    past = line[..., :size] + line[..., 2 * n + 2:2 * n + 2 + size]          # x - n - 1 and x + n + 1
    return ((window * ww + past * fw + (1 << 23)) >> 24).to(torch.uint8)


def _coord(v: float) -> int:
    """PIL's COORD: -1 below zero, else truncated."""
    return -1 if v < 0.0 else int(v)


def _fix(v: float) -> int:
    """PIL's 16.16 fixed point of ``v``: floor(v * 65536 + 0.5)."""
    return math.floor(v * 65536.0 + 0.5)


def _fits(a, x: int, y: int) -> bool:
    return abs(x * a[0] + y * a[1] + a[2]) < 32768.0 and abs(x * a[3] + y * a[4] + a[5]) < 32768.0


def source_index(a, h: int, w: int) -> tuple[str, tuple]:
    """How PIL maps each output pixel of an ``h`` x ``w`` image through the
    affine ``a`` (six doubles) to a source pixel: ``("scale", (columns,
    rows))``, ``("fixed", (a0, a1, a2, a3, a4, a5))`` (16.16 integers), or
    ``("map", (ys, xs))`` (int64 (h, w) arrays); source coordinates outside
    the image are filled."""
    if a[1] == 0 and a[3] == 0:
        xo, cols = a[2] + a[0] * 0.5, []
        for _ in range(w):
            cols.append(_coord(xo))
            xo += a[0]
        yo, rows = a[5] + a[4] * 0.5, []
        for _ in range(h):
            rows.append(_coord(yo))
            yo += a[4]
        return "scale", (cols, rows)
    if _fits(a, 0, 0) and _fits(a, w, h) and _fits(a, 0, h) and _fits(a, w, 0):
        return "fixed", (_fix(a[0]), _fix(a[1]), _fix(a[2] + a[0] * 0.5 + a[1] * 0.5), _fix(a[3]), _fix(a[4]),
                         _fix(a[5] + a[3] * 0.5 + a[4] * 0.5))
    xs, ys = np.empty((h, w), np.int64), np.empty((h, w), np.int64)
    xo, yo = a[2] + a[1] * 0.5 + a[0] * 0.5, a[5] + a[4] * 0.5 + a[3] * 0.5
    for y in range(h):
        xx, yy = xo, yo
        for x in range(w):
            xs[y, x], ys[y, x] = _coord(xx), _coord(yy)
            xx += a[0]
            yy += a[3]
        xo += a[1]
        yo += a[4]
    return "map", (ys, xs)


def _affine(x: torch.Tensor, values: list, perspective: bool = False) -> torch.Tensor:
    """Each row of ``x`` through its affine map (``perspective``: its
    perspective map, eight coefficients): the rows by PIL's filter, each
    group in a few launches for the batch."""
    k = x.shape[0]
    by = {}
    for r, v in enumerate(values):
        by.setdefault(int(v[-1]), []).append(r)

    def run(part, vals, f):
        if perspective:
            return _filtered(part, vals, f, _perspective_points) if f != NEAREST else _nearest_perspective(part, vals)
        return _nearest(part, vals) if f == NEAREST else _filtered(part, vals, f)

    if len(by) == 1 and (NEAREST in by or k <= _FILTER_ROWS):
        return run(x, values, next(iter(by)))
    out = torch.empty_like(x)
    for f, rows in by.items():
        # the filters' double-precision neighbours take 8 bytes a value each: a few rows at a time
        step = len(rows) if f == NEAREST else _FILTER_ROWS
        for at in range(0, len(rows), step):
            part_rows = rows[at:at + step]
            idx = upload(np.array(part_rows, dtype=np.int64), x.device)
            part = x.index_select(0, idx)
            out.index_copy_(0, idx, run(part, [values[r] for r in part_rows], f))
    return out if k else x


# rows a bilinear or bicubic affine map takes at a time (its temporaries: about 20 float64 copies of them)
_FILTER_ROWS = 8


def _fills(values: list, c: int, dev) -> torch.Tensor:
    """The rows' fill values, uint8 (k, c, 1, 1) (None: zeros): a value's
    next-to-last element."""
    fills = np.array([v[-2] if v[-2] is not None else (0,) * c for v in values], dtype=np.uint8).reshape(-1, c)
    return upload(fills, dev).view(-1, c, 1, 1)


def _points(values: list, n: int, h: int, w: int, dev) -> tuple:
    """``(columns, X, Y)``: each row's first ``n`` coefficients as (k, 1, 1)
    doubles, and the pixels' centres ``x + .5``, ``y + .5`` as PIL's
    generic transform takes them."""
    f64 = torch.float64
    a = upload(np.array([v[:n] for v in values], dtype=np.float64), dev)
    X = (torch.arange(w, dtype=f64, device=dev) + 0.5).view(1, 1, w)
    Y = (torch.arange(h, dtype=f64, device=dev) + 0.5).view(1, h, 1)
    return [a[:, j].view(-1, 1, 1) for j in range(n)], X, Y


def _affine_points(values: list, h: int, w: int, dev) -> tuple:
    """Each output pixel's source point through an affine map, double
    precision, as PIL's ``affine_transform``: ``a0 x + a1 y + a2``."""
    col, X, Y = _points(values, 6, h, w, dev)
    return (col[0] * X + col[1] * Y) + col[2], (col[3] * X + col[4] * Y) + col[5]


def _perspective_points(values: list, h: int, w: int, dev) -> tuple:
    """The same through a perspective map, as PIL's
    ``perspective_transform``: ``(a0 x + a1 y + a2) / (a6 x + a7 y + 1)``
    (each operation rounded to double precision: nothing fused)."""
    col, X, Y = _points(values, 8, h, w, dev)
    den = (col[6] * X + col[7] * Y) + 1.0
    return ((col[0] * X + col[1] * Y) + col[2]) / den, ((col[3] * X + col[4] * Y) + col[5]) / den


def _coords(v: torch.Tensor) -> torch.Tensor:
    """PIL's COORD of double coordinates: -1 below zero, else truncated; -1
    too for what is not a number or past 2**31 (outside the image either way,
    where C's conversion and a GPU's differ)."""
    ok = (v >= 0.0) & (v < 2.0 ** 31)
    return torch.where(ok, v, torch.full_like(v, -1.0)).trunc().to(torch.int64)


def _nearest_perspective(x: torch.Tensor, values: list) -> torch.Tensor:
    """PIL's nearest-neighbour perspective transform (its generic
    transform: each pixel's source point in double precision, COORD)."""
    k, c, h, w = x.shape
    xin, yin = _perspective_points(values, h, w, x.device)
    return _gathered(x, values, _coords(xin), _coords(yin))


def _filtered(x: torch.Tensor, values: list, f: int, points=_affine_points) -> torch.Tensor:
    """PIL's generic transform with its bilinear or bicubic filter: each
    output pixel's source point (``points``: an affine map's ``a0 (x + .5) +
    a1 (y + .5) + a2`` and the other coordinate alike, or a perspective
    map's) in double precision, outside the image the fill; inside, the
    filter's weighted neighbours in double precision as PIL's macros
    compute them (rows outside repeat the last row inside, columns are
    clipped), truncated to uint8 (bicubic clipped first)."""
    k, c, h, w = x.shape
    dev, f64 = x.device, torch.float64
    xin, yin = points(values, h, w, dev)
    inside = ((xin >= 0) & (xin < w) & (yin >= 0) & (yin < h)).unsqueeze(1)
    xin, yin = xin - 0.5, yin - 0.5
    x0, y0 = torch.floor(xin), torch.floor(yin)
    dx, dy = (xin - x0).unsqueeze(1), (yin - y0).unsqueeze(1)
    xi, yi = x0.to(torch.int64), y0.to(torch.int64)
    src = x.reshape(k, c, h * w)

    def at(yy, xx):      # the (k, c, h, w) values at rows yy (in range) and columns xx (clipped), double
        flat = (yy.clamp(0, h - 1) * w + xx.clamp(0, w - 1)).view(k, 1, h * w).expand(k, c, h * w)
        return torch.gather(src, 2, flat).view(k, c, h, w).to(f64)

    if f == BILINEAR:
        def line(yy):
            p, q = at(yy, xi), at(yy, xi + 1)
            return p + (q - p) * dx

        v1 = line(yi)
        below = ((yi + 1 >= 0) & (yi + 1 < h)).unsqueeze(1)
        v2 = torch.where(below, line(yi + 1), v1)
        v = v1 + (v2 - v1) * dy
        out = v.trunc()
    else:
        xi, yi = xi - 1, yi - 1

        def cubic(v1, v2, v3, v4, d):
            p1 = v2
            p2 = -v1 + v3
            p3 = 2 * (v1 - v2) + v3 - v4
            p4 = -v1 + v2 - v3 + v4
            return p1 + d * (p2 + d * (p3 + d * p4))

        def line(yy):
            return cubic(at(yy, xi), at(yy, xi + 1), at(yy, xi + 2), at(yy, xi + 3), dx)

        rows = [line(yi)]
        for j in (1, 2, 3):
            ok = ((yi + j >= 0) & (yi + j < h)).unsqueeze(1)
            rows.append(torch.where(ok, line(yi + j), rows[-1]))
        v = cubic(*rows, dy)
        out = v.clamp(0.0, 255.0).trunc()
    return torch.where(inside, out.to(torch.uint8), _fills(values, c, dev))


def _nearest(x: torch.Tensor, values: list) -> torch.Tensor:
    """PIL's nearest-neighbour affine transform of each row (the rows'
    source indices made together, one gather)."""
    k, c, h, w = x.shape
    dev = x.device
    ways = [source_index(v[:6], h, w) for v in values]
    xs = torch.empty((k, h, w), dtype=torch.int64, device=dev)
    ys = torch.empty((k, h, w), dtype=torch.int64, device=dev)
    fixed = [r for r, (how, _) in enumerate(ways) if how == "fixed"]
    if fixed:
        a = upload(np.array([ways[r][1] for r in fixed], dtype=np.int64), dev)       # (n, 6) 16.16 integers
        ix = torch.arange(w, dtype=torch.int64, device=dev).view(1, 1, w)
        iy = torch.arange(h, dtype=torch.int64, device=dev).view(1, h, 1)
        col = [a[:, j].view(-1, 1, 1) for j in range(6)]
        rows = upload(np.array(fixed, dtype=np.int64), dev)
        xs.index_copy_(0, rows, (iy * col[1] + col[2] + ix * col[0]).bitwise_right_shift_(16))
        ys.index_copy_(0, rows, (iy * col[4] + col[5] + ix * col[3]).bitwise_right_shift_(16))
    scale = [r for r, (how, _) in enumerate(ways) if how == "scale"]
    if scale:
        cols = upload(np.array([ways[r][1][0] for r in scale], dtype=np.int64), dev).view(-1, 1, w)
        rws = upload(np.array([ways[r][1][1] for r in scale], dtype=np.int64), dev).view(-1, h, 1)
        rows = upload(np.array(scale, dtype=np.int64), dev)
        xs.index_copy_(0, rows, cols.expand(-1, h, w))
        ys.index_copy_(0, rows, rws.expand(-1, h, w))
    for r, (how, p) in enumerate(ways):
        if how == "map":
            ys[r].copy_(upload(np.ascontiguousarray(p[0]), dev))
            xs[r].copy_(upload(np.ascontiguousarray(p[1]), dev))
    return _gathered(x, values, xs, ys)


def _gathered(x: torch.Tensor, values: list, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Each output pixel from its source pixel (``xs``, ``ys``: int64 (k, h,
    w)), the fill where that lies outside the image."""
    k, c, h, w = x.shape
    dev = x.device
    inside = ((xs >= 0) & (xs < w) & (ys >= 0) & (ys < h)).unsqueeze(1)
    flat = (ys.clamp_(0, h - 1).mul_(w).add_(xs.clamp_(0, w - 1))).view(k, 1, h * w).expand(k, c, h * w)
    got = torch.gather(x.reshape(k, c, h * w), 2, flat).view(k, c, h, w)
    return torch.where(inside, got, _fills(values, c, dev))


def _transpose(x: torch.Tensor, method: int) -> torch.Tensor:
    """PIL's ``Image.transpose(method)`` of the (C, H, W) image ``x``."""
    if method == 0:                     # FLIP_LEFT_RIGHT
        return x.flip(-1)
    if method == 1:                     # FLIP_TOP_BOTTOM
        return x.flip(-2)
    if method == 2:                     # ROTATE_90 (counter-clockwise)
        return x.rot90(1, (-2, -1))
    if method == 3:                     # ROTATE_180
        return x.flip(-2, -1)
    if method == 4:                     # ROTATE_270
        return x.rot90(-1, (-2, -1))
    if method == 5:                     # TRANSPOSE
        return x.transpose(-2, -1)
    if method == 6:                     # TRANSVERSE
        return x.rot90(2, (-2, -1)).transpose(-2, -1)
    raise ValueError(f"not a PIL transpose method: {method}")
