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
the CPU its values are torchvision's own; on a GPU torchvision's functions
run there (their sampling and convolution round as the GPU does), within a
stated tolerance (``coordl.device.pil_ops.TOLERANCE``, checked on probe
images at first use).
"""
from __future__ import annotations

import functools
import importlib

import numpy as np
import torch

__all__ = ["NAMES", "MODES", "FIELDS", "fits", "pack", "unpack", "apply", "on_planes"]

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
        mixed = _mix(xs, [values[r] for r in rows], _op(v2, mode), width, upload)
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

