"""torchvision's ``AugMix`` as data: one sample's draws, and the mix they make.

On a PIL image torchvision's ``AugMix`` (v1 or v2) makes a uint8 tensor of
it, draws the mixing weights (two Dirichlet draws of torch's generator:
the original image's share, then the chains'), then for each chain its
depth and each operation's name, magnitude and sign, applies the chain's
operations with its version's tensor functions (shears, translations and
rotations through ``grid_sample``, the colour operations as float blends,
posterize, solarize, autocontrast, equalize), sums the weighted images in
single precision, truncates to uint8 and makes a PIL image of the result.

Here a call's draws are a value (``coordl.tvcompat.AugMixOnDevice`` makes
them in the worker, in the user's object's order)::

    (v2, mode, m0, (w_0, ..., w_{n-1}), ((op, magnitude), ...) per chain)

``v2``: 1 for torchvision v2's functions; ``mode``: 0 nearest, 1 bilinear;
``m0``: the original image's weight; ``w_i``: chain ``i``'s weight (the
products torchvision computes, float32); ``op``: an index into
:data:`NAMES`; ``magnitude``: the signed magnitude the operation is called
with.  :func:`pack` and :func:`unpack` carry it in :data:`FIELDS` int64
fields of a record (every number a float32, which each is: torchvision's
magnitudes are float32 or integer tensors' elements), and :func:`apply`
computes the result on a batch of rows, each with its own value, on any
device (an auto-augment policy given a tensor is such a value too: its
operations one chain of weight 1 over the image's weight 0, whose mix is
the chain's result exactly): the operations with torchvision's own
functions (the rows drawing the same operation at the same step taken
together), the mix with the same single-precision products and sums as
torchvision's, row by row.  On
the CPU its values are torchvision's own (five of its colour operations
computed through tables of torchvision's values, and its shears, translations
and rotations with their sampling grids kept: :func:`quick_ops`); on a GPU torchvision's functions
run there (their sampling and convolution round as the GPU does), within a
stated tolerance (``coordl.device.pil_ops.TOLERANCE``, checked on probe
images at first use).
"""
from __future__ import annotations

import functools
import importlib
import logging
import math
import threading

import numpy as np
import torch

from ..base import forks as _forks
from ..base import memo as _memo
from . import extensions

__all__ = ["NAMES", "MODES", "FIELDS", "fits", "pack", "unpack", "apply", "on_planes", "quick_ops"]

log = logging.getLogger("coordl")

# the operations of AugMix's augmentation space (v1 and v2 alike), by index; then AutoAugment's Invert, which
# the policies given a tensor draw (coordl.tvcompat's _PolicyOnTensor: their operations travel as a value here)
NAMES = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast", "Sharpness",
         "Posterize", "Solarize", "AutoContrast", "Equalize", "Invert")
INDEX = {name: i for i, name in enumerate(NAMES)}
MODES = ("nearest", "bilinear")
# the record fields a value takes: a header (version, mode, chains, each chain's depth), the weights two to a
# field, an operation a field
FIELDS = 14
MAX_WIDTH, MAX_DEPTH = 4, 15


def fits(width: int, depth: int) -> bool:
    """Whether ``width`` chains of at most ``depth`` operations each fit in
    :data:`FIELDS` fields."""
    return 1 <= width <= MAX_WIDTH and 1 <= depth <= MAX_DEPTH \
        and 1 + (width + 2) // 2 + width * depth <= FIELDS


def _f32_bits(values: list) -> list:
    """The float32 bits of each of ``values`` (each must be a float32)."""
    d = np.array(values, dtype=np.float64)
    f = d.astype(np.float32)
    bad = f.astype(np.float64) != d
    if bad.any():
        raise ValueError(f"AugMix's value {values[int(np.argmax(bad))]!r} is not a float32")
    return f.view(np.uint32).tolist()


def _f32(bits: int) -> float:
    return float(np.array([bits & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0])


def f32_fields(values: list) -> list:
    """float32 numbers (each must be one) two to an int64 field, the first
    in the low half: a record's fields."""
    bits = _f32_bits(values)
    bits += [0] * (len(bits) % 2)
    return [_signed(lo | (hi << 32)) for lo, hi in zip(bits[::2], bits[1::2])]


def f32_values(fields, n: int) -> list:
    """The first ``n`` float32 numbers of :func:`f32_fields`'s fields."""
    return [_f32(int(f) >> s) for f in fields[:(n + 1) // 2] for s in (0, 32)][:n]


def _signed(f: int) -> int:
    """A 64-bit field as the int64 a record holds."""
    return f - (1 << 64) if f >= 1 << 63 else f


def pack(value) -> list:
    """A value's :data:`FIELDS` int64 fields."""
    v2, mode, m0, weights, chains = value
    width = len(weights)
    if len(chains) != width or not fits(width, max((len(c) for c in chains), default=1) or 1):
        raise ValueError(f"AugMix with {width} chains of depths {[len(c) for c in chains]}: more than a record "
                         f"carries ({FIELDS} fields)")
    head = int(bool(v2)) | (int(mode) << 1) | (width << 4)
    for i, c in enumerate(chains):
        head |= len(c) << (8 + 4 * i)
    ops = [(int(op), m) for c in chains for op, m in c]
    fields = [head] + f32_fields([m0, *weights])
    fields += [_signed((op << 32) | b) for (op, _), b in zip(ops, _f32_bits([m for _, m in ops]))]
    return fields + [0] * (FIELDS - len(fields))


def unpack(fields) -> tuple:
    """The value of :func:`pack`'s fields."""
    fields = [int(f) & ((1 << 64) - 1) for f in fields]
    head = fields[0]
    v2, mode, width = head & 1, (head >> 1) & 7, (head >> 4) & 15
    depths = [(head >> (8 + 4 * i)) & 15 for i in range(width)]
    n = (width + 2) // 2
    floats = f32_values(fields[1:], width + 1)
    at, chains = 1 + n, []
    for d in depths:
        chains.append(tuple((f >> 32, _f32(f)) for f in fields[at:at + d]))
        at += d
    return v2, mode, floats[0], tuple(floats[1:1 + width]), tuple(chains)


@functools.lru_cache(maxsize=None)
def _op(v2: int, mode: int):
    """torchvision's function that applies one of AugMix's operations to a
    uint8 (k, C, H, W) tensor: ``fn(x, name, magnitude)``."""
    if v2:
        V = importlib.import_module("torchvision.transforms.v2")
        t = V.AugMix(interpolation=V.InterpolationMode(MODES[mode]))

        def fn(x, name, magnitude):
            return t._apply_image_or_video_transform(x, name, magnitude, interpolation=t.interpolation, fill=t._fill)
        return fn
    A = importlib.import_module("torchvision.transforms.autoaugment")
    interpolation = importlib.import_module("torchvision.transforms").InterpolationMode(MODES[mode])

    def fn(x, name, magnitude):
        return A._apply_op(x, name, magnitude, interpolation=interpolation, fill=None)
    return fn


# ------------------------------------------------------- the CPU's tables and kept grids
# On the CPU the colour operations below are computed through tables of torchvision's own values rather than
# by its functions over the whole image (its sharpness is a float convolution, 4-5 ms on a 224x224 image in one
# thread; equalize, solarize, autocontrast and brightness several passes of float or int64 tensors), and the
# shears, translations and rotations by torchvision's own functions with their sampling grids kept
# (:func:`_geometric`):
#
# - Brightness, Solarize: a function of each value alone, so the table is torchvision's function of an image
#   holding every value 0..255 once;
# - AutoContrast: a function of each value and its channel's minimum and maximum, so the table of a channel is
#   torchvision's function of an image whose channel holds every value between that minimum and maximum (and
#   those alone: the same minimum and maximum, the same arithmetic for each value);
# - Equalize: torchvision's integer arithmetic (each channel's histogram, PIL's step, its table), as numpy's;
# - Sharpness: torchvision's blurred image is its 3x3 kernel (1s around a 5, over 13) in single precision,
#   rounded to the nearest integer.  The exact value S/13 (S the weighted integer sum) is never within 1/26 of
#   a half, and single precision errs by under 1e-3 on sums of at most 13 * 255, in any order of the sums: so
#   the rounded value is round(S/13), computed here in integers.  The blend of each value with its blurred
#   one is then a function of the pair, tabled (65,536 pairs) with the version's own arithmetic.
#
# Each is checked once per process against torchvision's function, on probe images of several sizes with
# every magnitude AugMix draws there (:func:`quick_ops`); an operation that differs is computed by torchvision's.
_QUICK = ("Brightness", "Solarize", "AutoContrast", "Equalize", "Sharpness", "ShearX", "ShearY", "TranslateX",
          "TranslateY", "Rotate")
_KEEP = 256                  # tables kept per process (AugMix draws a few dozen magnitudes; a blend one: 64 KiB)
_tables: dict = {}
_quick: dict = {}
_quick_lock = _forks.worker_safe(threading.Lock())


def _kept(key, make):
    return _memo.kept(_tables, key, make, _KEEP)


def _every_value() -> torch.Tensor:
    """A uint8 (1, 1, 16, 16) image holding each value 0..255 once."""
    return torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16)


_color = extensions.load("_color", log, "AugMix's CPU tables applied by numpy")


def _ext(name: str):
    """The colour extension's function ``name`` (None where not built)."""
    return getattr(_color, name, None) if _color is not None else None


def _by_table(a: np.ndarray, luts: np.ndarray) -> torch.Tensor:
    """``a`` (k, C, H, W) uint8 through ``luts``: one table of 256 (every
    plane) or one per plane, (k, C, 256)."""
    a = np.ascontiguousarray(a)
    out = np.empty_like(a)
    fn = _ext("tables")
    if fn is not None:
        fn(a, out, np.ascontiguousarray(luts))
    elif luts.ndim == 1:
        np.take(luts, a, out=out)
    else:
        for i in range(a.shape[0]):
            for c in range(a.shape[1]):
                np.take(luts[i, c], a[i, c], out=out[i, c])
    return torch.from_numpy(out)


def _histograms(a: np.ndarray) -> np.ndarray:
    """Each plane's histogram: (k, C, 256) int64 of (k, C, H, W) uint8."""
    k, c = a.shape[:2]
    fn = _ext("histograms")
    if fn is not None:
        hist = np.empty((k, c, 256), dtype=np.int64)
        fn(np.ascontiguousarray(a), hist)
        return hist
    return np.stack([np.bincount(p, minlength=256) for p in a.reshape(k * c, -1)]).reshape(k, c, 256)


def _extremes(hist: np.ndarray) -> tuple:
    """Each plane's smallest and largest value, from its histogram."""
    seen = hist > 0
    return seen.argmax(axis=2), 255 - seen[..., ::-1].argmax(axis=2)


def _pointwise(slow, v2: int, mode: int, name: str, magnitude: float, x: torch.Tensor) -> torch.Tensor:
    lut = _kept((v2, name, magnitude), lambda: slow(_every_value(), name, magnitude).numpy().reshape(256))
    return _by_table(x.numpy(), lut)


def _autocontrast(slow, v2: int, mode: int, name: str, magnitude: float, x: torch.Tensor) -> torch.Tensor:
    a = x.numpy()
    k, c = a.shape[:2]
    if a.size == 0:
        return slow(x, name, magnitude)
    lo, hi = _extremes(_histograms(a))
    probe = np.clip(np.arange(256)[None, None], lo[..., None], hi[..., None]).astype(np.uint8)
    luts = slow(torch.from_numpy(probe.reshape(k, c, 16, 16)), name, magnitude).numpy().reshape(k, c, 256)
    return _by_table(a, luts)


def _equalize(slow, v2: int, mode: int, name: str, magnitude: float, x: torch.Tensor) -> torch.Tensor:
    a = x.numpy()
    if a.size == 0:
        return slow(x, name, magnitude)
    hist = _histograms(a)
    n = a.shape[2] * a.shape[3]
    _, hi = _extremes(hist)
    # PIL's step: the pixels below the plane's largest value over 255; 0 leaves the plane as it is
    step = (n - np.take_along_axis(hist, hi[..., None], axis=2)[..., 0]) // 255
    luts = np.zeros(hist.shape, dtype=np.uint8)
    luts[..., 1:] = np.clip((np.cumsum(hist[..., :-1], axis=2) + (step // 2)[..., None])
                            // np.maximum(step, 1)[..., None], 0, 255)
    luts[step == 0] = np.arange(256, dtype=np.uint8)
    return _by_table(a, luts)


def _blend_table(v2: int, factor: float) -> np.ndarray:
    """The version's sharpness blend of each value with each blurred value:
    a (65536,) uint8 table, the value in the high byte of the index.  Made
    by the version's operations on tensors laid out as in its function (v2
    blends the inside of a (258, 258) image in place), so that torch takes
    the same kernels over them."""
    d = torch.arange(256, dtype=torch.uint8).repeat(256, 1)       # the blurred value: the column
    x = d.t().contiguous()                                          # the image's value: the row
    if v2:         # v2: the image in single precision, plus (1 - factor) times the rounded blurred minus it
        out = torch.zeros((1, 1, 258, 258), dtype=torch.float32)
        view = out[..., 1:-1, 1:-1]
        view.copy_(x)
        view.add_(d.to(torch.float32).view(1, 1, 256, 256).sub_(view), alpha=1.0 - factor)
        return out.clamp_(0, 255).to(torch.uint8)[0, 0, 1:-1, 1:-1].contiguous().numpy().reshape(-1)
    return (factor * x + (1.0 - factor) * d).clamp(0, 255).to(torch.uint8).numpy().reshape(-1)


def _sharpness(slow, v2: int, mode: int, name: str, magnitude: float, x: torch.Tensor) -> torch.Tensor:
    a = x.numpy()
    if a.shape[2] <= 2 or a.shape[3] <= 2:
        return slow(x, name, magnitude)
    factor = 1.0 + magnitude
    lut = _kept((v2, name, magnitude), lambda: _blend_table(v2, factor))
    s = a.astype(np.int16)              # at most 13 * 255 * 2 + 13 below
    rows = s[..., :-2] + s[..., 1:-1] + s[..., 2:]
    inner = s[..., 1:-1, 1:-1]
    total = rows[..., :-2, :] + rows[..., 1:-1, :] + rows[..., 2:, :] + 4 * inner
    blurred = (2 * total + 13) // 26     # round(total / 13): never a half
    # v1 blends the border with itself (its blurred image is the image there), v2 leaves it
    out = a.copy() if v2 else np.take(lut, a.astype(np.uint16) * 257)
    out[..., 1:-1, 1:-1] = np.take(lut, inner.astype(np.uint16) * 256 + blurred.astype(np.uint16))
    return torch.from_numpy(out)


@functools.lru_cache(maxsize=None)
def _geometry(v2: int) -> tuple:
    """The version's own ``(_get_inverse_affine_matrix, its affine grid
    function, _apply_grid_transform)``."""
    if v2:
        G = importlib.import_module("torchvision.transforms.v2.functional._geometry")
        return G._get_inverse_affine_matrix, G._affine_grid, G._apply_grid_transform
    F = importlib.import_module("torchvision.transforms.functional")
    FT = importlib.import_module("torchvision.transforms._functional_tensor")
    return F._get_inverse_affine_matrix, FT._gen_affine_grid, FT._apply_grid_transform


def _matrix(v2: int, name: str, magnitude: float, h: int, w: int) -> "list | int":
    """The inverse affine matrix torchvision's ``F.affine``/``F.rotate``
    compute for AugMix's shear, translation or rotation ``name`` of an
    (h, w) tensor (its arguments as ``_apply_op`` gives them, through the
    version's own conversions and ``_get_inverse_affine_matrix``); for a v2
    rotation it takes a shortcut for, the quarter turns' number instead."""
    inverse = _geometry(v2)[0]
    if name == "Rotate":
        angle = magnitude
        if v2:               # rotate_image: the angle in [0, 360), and its shortcuts
            angle = magnitude % 360
            if angle == 0 or angle == 180 or (h == w and angle in (90, 270)):
                return int(angle // 90)
        return inverse([0.0, 0.0], -angle, [0.0, 0.0], 1.0, [0.0, 0.0])
    shear = {"ShearX": [math.degrees(math.atan(magnitude)), 0.0],
             "ShearY": [0.0, math.degrees(math.atan(magnitude))]}.get(name, [0.0, 0.0])
    translate = {"TranslateX": [int(magnitude), 0], "TranslateY": [0, int(magnitude)]}.get(name, [0, 0])
    # the shears turn about the corner (center=[0, 0]), the translations about the middle (center=None)
    centre = [float(c - s * 0.5) for c, s in zip([0, 0], [w, h])] if name.startswith("Shear") else [0.0, 0.0]
    return inverse(centre, 0.0, [float(t) for t in translate], 1.0, shear)


_grids: dict = {}
# sampling grids kept per process, the first made (a 224x224 one: 392 KiB; AugMix's default severity draws 30
# of them; TrivialAugmentWide up to 310, some of which are then made each time, as torchvision makes them)
_GRID_BYTES = 32 << 20
_grid_bytes = [0]


def _geometric(slow, v2: int, mode: int, name: str, magnitude: float, x: torch.Tensor) -> torch.Tensor:
    """The shear, translation or rotation as torchvision's tensor functions
    compute it (the same matrix, its own grid function and its own
    sampling), the sampling grid kept per (operation, magnitude, size): its
    making (a (H*W, 3) by (3, 2) product) is most of the operation's cost
    on the CPU, and AugMix draws few magnitudes."""
    h, w = int(x.shape[-2]), int(x.shape[-1])
    key = (v2, name, magnitude, h, w)
    grid = _grids.get(key)
    if grid is None:
        matrix = _matrix(v2, name, magnitude, h, w)
        if isinstance(matrix, int):
            return x.clone() if matrix == 0 else torch.rot90(x, k=matrix, dims=(-2, -1))
        theta = torch.tensor(matrix, dtype=torch.float32).reshape(1, 2, 3)
        grid = _geometry(v2)[1](theta, w=w, h=h, ow=w, oh=h)
        size = grid.numel() * grid.element_size()
        if _grid_bytes[0] + size <= _GRID_BYTES:      # kept while they fit (no churn past the budget)
            _grids[key] = grid
            _grid_bytes[0] += size
    return _geometry(v2)[2](x, grid, MODES[mode], fill=None)


_FAST = {"Brightness": _pointwise, "Solarize": _pointwise, "AutoContrast": _autocontrast,
         "Equalize": _equalize, "Sharpness": _sharpness, "ShearX": _geometric, "ShearY": _geometric,
         "TranslateX": _geometric, "TranslateY": _geometric, "Rotate": _geometric}


def _magnitudes(v2: int, name: str, h: int = 32, w: int = 32) -> list:
    """Every magnitude torchvision's AugMix (of the version) may call the
    operation ``name`` with on an (h, w) image (its bins, both signs where
    signed)."""
    if v2:
        V = importlib.import_module("torchvision.transforms.v2")
        t = V.AugMix()
        fn, signed = t._AUGMENTATION_SPACE[name]
        mags = fn(t._PARAMETER_MAX, h, w)
    else:
        A = importlib.import_module("torchvision.transforms.autoaugment")
        t = A.AugMix()
        mags, signed = t._augmentation_space(t._PARAMETER_MAX, (h, w))[name]
    values = [float(v) for v in mags.reshape(-1).tolist()] if mags is not None and mags.ndim > 0 else [0.0]
    return sorted(set(values + ([-v for v in values] if signed else [])))


def _probes() -> list:
    """uint8 (k, C, H, W) probe images: noise, smooth ramps, flat, two-valued
    and dark ones, of odd and tiny sizes, one and three channels, a batch of
    two."""
    rs = np.random.RandomState(3)
    out = [rs.randint(0, 256, shape) for shape in ((1, 3, 17, 23), (1, 1, 9, 7), (2, 3, 6, 5), (1, 3, 3, 3))]
    out += [np.cumsum(rs.randint(-9, 10, shape), axis=-1) + 90 for shape in ((1, 3, 19, 21), (1, 3, 2, 5), (1, 3, 9, 1))]
    out += [np.full((1, 3, 8, 9), 77), np.where(rs.rand(1, 3, 8, 9) < 0.5, 3, 250), rs.randint(0, 12, (1, 3, 12, 13)),
            rs.randint(0, 256, (1, 3, 10, 10))]
    return [torch.from_numpy(np.clip(x, 0, 255).astype(np.uint8)) for x in out]


def quick_ops(v2: int) -> frozenset:
    """The operations the CPU computes here by tables or with kept sampling
    grids for torchvision's version ``v2`` (checked once per process: their
    values are torchvision's functions' on probe images, for every magnitude
    AugMix draws there, and the geometric ones with each interpolation)."""
    key = int(v2)
    return extensions.once(_quick.setdefault(key, []), _quick_lock, lambda: _check_quick(key))


def _check_quick(v2: int) -> frozenset:
    ok = []
    images = _probes()
    for name in _QUICK:
        # the grids' images: odd, square, one channel, a batch, bilinear; odd and a batch, nearest too
        cases = [(1, x) for x in images]
        if _FAST[name] is _geometric:
            cases = [(1, x) for x in images[:3] + images[-1:]] + [(0, images[0]), (0, images[2])]
        try:
            good = all(torch.equal(_FAST[name](_op(v2, mode), v2, mode, name, m, x), _op(v2, mode)(x, name, m))
                       for mode, x in cases for m in _magnitudes(v2, name, int(x.shape[2]), int(x.shape[3])))
        except Exception as e:  # noqa: BLE001 - another torchvision's API: its own function then
            log.warning("coordl's AugMix %s cannot run here (%s: %s): torchvision's function computes it",
                        name, type(e).__name__, e)
            good = False
        else:
            if not good:
                log.warning("coordl's AugMix %s differs from torchvision's function here: torchvision's computes it",
                            name)
        if good:
            ok.append(name)
    return frozenset(ok)


@functools.lru_cache(maxsize=None)
def _op_on_cpu(v2: int, mode: int):
    """:func:`_op`'s function, with the operations of :func:`quick_ops` computed
    by tables on CPU tensors."""
    slow = _op(v2, mode)

    def fn(x, name, magnitude):
        if name in _FAST and x.device.type == "cpu" and x.dtype == torch.uint8 and x.ndim == 4 \
                and name in quick_ops(v2):
            return _FAST[name](slow, v2, mode, name, magnitude, x)
        return slow(x, name, magnitude)
    return fn


def _sends(dev: torch.device):
    return lambda a: torch.from_numpy(a).to(dev)


def apply(x: torch.Tensor, values: list, upload=None) -> torch.Tensor:
    """The uint8 (k, 3, H, W) rows ``x``, row ``r`` mixed as ``values[r]``
    says: new rows, ``x`` untouched.  ``upload(array)``: a small host array
    on ``x``'s device (default: a plain copy)."""
    upload = upload or _sends(x.device)
    out = torch.empty_like(x)
    groups: dict = {}
    for r, v in enumerate(values):
        groups.setdefault((int(v[0]), int(v[1]), len(v[3])), []).append(r)
    for (v2, mode, width), rows in groups.items():
        whole = len(rows) == len(values)
        idx = None if whole else upload(np.array(rows, dtype=np.int64))
        xs = x if whole else x.index_select(0, idx)
        op = _op_on_cpu(v2, mode) if x.device.type == "cpu" else _op(v2, mode)
        mixed = _mix(xs, [values[r] for r in rows], op, width, upload)
        if whole:
            return mixed
        out.index_copy_(0, idx, mixed)
    return out


def _column(values: list, upload) -> torch.Tensor:
    return upload(np.array(values, dtype=np.float32)).view(-1, 1, 1, 1)


def _mix(xs: torch.Tensor, values: list, fn, width: int, upload) -> torch.Tensor:
    """torchvision's sum for each row: its weight times the row, plus each
    chain's weight times the chain's result, in single precision, in that
    order, truncated to uint8."""
    k, _, h, w = xs.shape
    # the contrast's mean of an image's grey values is exact in single precision in any order while their sum
    # stays under 2**24; past that a row at a time, as torchvision takes one image
    rowwise = h * w * 255 >= 1 << 24
    mix = _column([v[2] for v in values], upload) * xs
    for i in range(width):
        chains = [v[4][i] for v in values]
        aug = xs
        for d in range(max(len(c) for c in chains)):
            by: dict = {}
            for j, c in enumerate(chains):
                if len(c) > d:
                    by.setdefault(c[d], []).append(j)
            if len(by) == 1 and len(next(iter(by.values()))) == k and not (rowwise and _contrast(by)):
                (op, m), = by
                aug = fn(aug, NAMES[int(op)], float(m))
                continue
            nxt = aug.clone()
            for (op, m), js in by.items():
                parts = [[j] for j in js] if rowwise and NAMES[int(op)] == "Contrast" else [js]
                for part in parts:
                    sel = upload(np.array(part, dtype=np.int64))
                    nxt.index_copy_(0, sel, fn(aug.index_select(0, sel), NAMES[int(op)], float(m)))
            aug = nxt
        mix.add_(_column([v[3][i] for v in values], upload) * aug)
    return mix.to(torch.uint8)


def _contrast(by: dict) -> bool:
    return any(NAMES[int(op)] == "Contrast" for op, _ in by)


def on_planes(x: torch.Tensor, value) -> torch.Tensor:
    """One image's uint8 (C, H, W) planes mixed as ``value`` says, on the
    CPU: what the user's ``AugMix`` gives for those draws."""
    return apply(x[None], [value])[0]

