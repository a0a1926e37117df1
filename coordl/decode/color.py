"""PIL's colour adjustments of uint8 images, on numpy planes: brightness,
contrast and saturation as ``PIL.ImageEnhance`` computes them
(``Brightness``, ``Contrast``, ``Color``: a blend with a black image, a grey
image at the mean luma, the image's own luma), and a hue rotation through
PIL's HSV conversion.  torchvision's ``ColorJitter`` on a PIL image is these
operations (coordl.tvcompat runs it so on the fused path's planes).

:func:`jitter` runs them through the C extension ``coordl.decode._color``
(built by ``pip install`` where a C compiler is; optional).  The first call
checks, once per process, that the extension gives the installed PIL's
bytes on probe images for every operation and a spread of factors
(:func:`exact_kernel`); where it is not built or differs (another PIL's
arithmetic, a build that fuses multiply-adds), :func:`exact_kernel` is
False and callers run PIL itself.

:func:`apply_ops` runs the other operations of the auto-augment policies
as PIL does (sharpness, posterize, solarize, autocontrast, equalize,
invert, timm's solarize-add, and ``Image.transform``'s affine and
perspective maps with PIL's nearest, bilinear and bicubic filters) through
the same extension, checked the same way (:func:`exact_ops`); the CPU path
runs a policy's drawn operations with it on the fused decode's planes.
"""
from __future__ import annotations

import logging
import random
import threading

import numpy as np
from PIL import Image, ImageEnhance

from . import extensions
from ..base import forks as _forks

__all__ = ["BRIGHTNESS", "CONTRAST", "SATURATION", "HUE", "SHARPNESS", "POSTERIZE", "SOLARIZE", "AUTOCONTRAST",
           "EQUALIZE", "INVERT", "AFFINE", "TRANSPOSE", "SOLARIZE_ADD", "BLUR", "AUGMIX", "PERSPECTIVE", "PIL_BLUR",
           "TIMM_AUGMIX", "PERMUTE", "permutation",
           "KERNEL_CODES", "OP_CODES", "jitter", "apply_ops", "pil_jitter", "exact_kernel", "exact_ops",
           "probe_ops"]

log = logging.getLogger(__name__)

# the operation codes of jitter's ops: (code, factor), or (HUE, shift of the 8-bit hue, 0..255)
BRIGHTNESS, CONTRAST, SATURATION, HUE = 0, 1, 2, 3
# the other operations of torchvision's auto-augment policies on a PIL image, as PIL runs them
# (pil_jitter; the C extension runs KERNEL_CODES only): (SHARPNESS, factor): ImageEnhance.Sharpness;
# (POSTERIZE, bits), (SOLARIZE, threshold), (AUTOCONTRAST, 0), (EQUALIZE, 0), (INVERT, 0): ImageOps';
# (AFFINE, (a0, a1, a2, a3, a4, a5, fill, resample)): Image.transform(size, AFFINE, a, resample,
# fillcolor=fill), the image's own size, fill a tuple of one value per band (or None: zeros), resample
# PIL's NEAREST, BILINEAR or BICUBIC; (TRANSPOSE, method): Image.transpose; (SOLARIZE_ADD, add): timm's
# solarize_add, add to the values under 128 (clipped at 255); (BLUR, (kx, ky, sigma_x, sigma_y, v2)):
# torchvision's gaussian_blur of a PIL image (its v2 functional's where v2), which blurs the tensor of it;
# (AUGMIX, (v2, mode, m0, weights, chains)): torchvision's AugMix of a PIL image with those draws
# (coordl.decode.augmix); (PERSPECTIVE, (a0, ..., a7, fill, resample)): Image.transform(size, PERSPECTIVE, a,
# resample, fillcolor=fill), as AFFINE; (PIL_BLUR, radius): PIL's own ImageFilter.GaussianBlur(radius) (three
# box blurs each way, in integers: timm's GaussianBlur and GaussianBlurRand operations); (TIMM_AUGMIX, (m,
# weights, chains)): timm's AugMixAugment with those draws: each chain (its operations, (code, value)s of
# these codes) applied to the image, the results summed with the weights in single precision, clipped,
# truncated, and PIL's blend of the image with that at m; (PERMUTE, p0 * 100 + p1 * 10 + p2): the
# image's bands in the order p0, p1, p2 (torchvision v2's permute_channels)
SHARPNESS, POSTERIZE, SOLARIZE, AUTOCONTRAST, EQUALIZE, INVERT, AFFINE, TRANSPOSE, SOLARIZE_ADD, BLUR, AUGMIX, \
    PERSPECTIVE, PIL_BLUR, TIMM_AUGMIX, PERMUTE = range(4, 19)


def permutation(value) -> tuple[int, int, int]:
    """The band order a PERMUTE operation's value stands for."""
    v = int(value)
    return v // 100 % 10, v // 10 % 10, v % 10
KERNEL_CODES = frozenset((BRIGHTNESS, CONTRAST, SATURATION, HUE))
# the other operations the extension runs (:func:`apply_ops`; the affine and perspective maps with PIL's
# nearest, bilinear and bicubic filters)
OP_CODES = frozenset((SHARPNESS, POSTERIZE, SOLARIZE, AUTOCONTRAST, EQUALIZE, INVERT, SOLARIZE_ADD, AFFINE,
                      PERSPECTIVE))


_ext = extensions.load("_color", log, "colour adjustments run through PIL")


def jitter(x: np.ndarray, ops) -> np.ndarray:
    """``x`` (a uint8 (C, H, W) array, C 1 or 3: the planes of a mode L or
    RGB image) through ``ops`` in order, as a new C-contiguous array: the
    bytes :func:`pil_jitter` gives (see :func:`exact_kernel`).  Needs the
    extension."""
    src = np.ascontiguousarray(x)
    out = np.empty_like(src)
    _ext.jitter(src, out, tuple((int(c), float(v)) for c, v in ops))
    return out


def apply_ops(x: np.ndarray, ops) -> np.ndarray:
    """``x`` (a uint8 (C, H, W) array, C 1 or 3) through ``ops`` in order,
    any of this module's codes, as a new C-contiguous array: the bytes
    :func:`pil_jitter` gives.  The colour operations, sharpness, the
    tables and the affine and perspective maps run in the extension (see
    :func:`exact_ops`), the flips, turns and band orders in numpy; an
    operation's value the extension does not take (posterize to 0 bits,
    which this PIL may refuse) and the other codes run through PIL on
    an image of the planes, its errors PIL's."""
    out = np.ascontiguousarray(x)
    k = 0
    while k < len(ops):
        code, value = ops[k]
        if code in KERNEL_CODES:       # a run of colour operations in one call
            j = k
            while j < len(ops) and ops[j][0] in KERNEL_CODES:
                j += 1
            out = jitter(out, ops[k:j])
            k = j
            continue
        small = out.shape[1] * out.shape[2] < 1 << 31      # the extension's offsets are 32-bit
        if code in (AFFINE, PERSPECTIVE) and small and _takes(value, out.shape[0]):
            n = 6 if code == AFFINE else 8
            dst = np.empty_like(out)
            _ext.transform(out, dst, tuple(float(v) for v in value[:n]), int(value[n + 1]), value[n])
            out = dst
        elif code in OP_CODES and code not in (AFFINE, PERSPECTIVE) and small and _value_ok(code, value):
            dst = np.empty_like(out)
            _ext.pil_op(out, dst, int(code), float(value))
            out = dst
        elif code == TRANSPOSE and 0 <= int(value) <= 6:
            out = _transposed(out, int(value))
        elif code == PERMUTE and out.shape[0] == 3:
            out = np.ascontiguousarray(out[list(permutation(value))])
        elif code == TIMM_AUGMIX and 0.0 <= float(value[0]) <= 1.0:
            out = _timm_mix(out, *value)
        else:
            out = _planes(pil_jitter(_image(out), [(code, value)]))
        k += 1
    return out if out is not x else out.copy()


def _timm_mix(x: np.ndarray, m: float, weights, chains) -> np.ndarray:
    """timm's AugMix of the planes ``x``: each chain's operations on ``x``
    (:func:`apply_ops`), the results summed with the weights in single
    precision, clipped and truncated, then PIL's blend of ``x`` with that at
    ``m`` (``a + m * (b - a)`` in single precision, truncated; ``m`` in
    0..1)."""
    mixed = np.zeros(x.shape, dtype=np.float32)
    for weight, chain in zip(weights, chains):
        mixed += np.float32(weight) * apply_ops(x, chain).astype(np.float32)
    np.clip(mixed, 0, 255.0, out=mixed)
    a = x.astype(np.float32)
    b = mixed.astype(np.uint8).astype(np.float32)
    out = a + np.float32(m) * (b - a)
    return out.astype(np.uint8)


def _takes(value, c: int) -> bool:
    """An affine or perspective value the extension takes: a filter it runs
    and a fill of one value per plane (or None)."""
    fill, f = value[-2], value[-1]
    return f in (0, 2, 3) and (fill is None or len(fill) == c)


def _value_ok(code: int, value) -> bool:
    if code == POSTERIZE:
        return 1 <= int(value) <= 8 and int(value) == value
    if code == SOLARIZE_ADD:
        return 0 <= int(value) <= 255 and int(value) == value
    return not np.isnan(float(value))


def _transposed(x: np.ndarray, method: int) -> np.ndarray:
    """PIL's ``Image.transpose(method)`` of the (C, H, W) planes ``x``."""
    turns = {0: lambda a: a[:, :, ::-1], 1: lambda a: a[:, ::-1], 2: lambda a: np.rot90(a, 1, (1, 2)),
             3: lambda a: a[:, ::-1, ::-1], 4: lambda a: np.rot90(a, -1, (1, 2)),
             5: lambda a: a.transpose(0, 2, 1), 6: lambda a: np.rot90(a, 2, (1, 2)).transpose(0, 2, 1)}
    return np.ascontiguousarray(turns[method](x))


def _image(x: np.ndarray) -> Image.Image:
    """The PIL image (mode L or RGB) whose planes ``x`` are."""
    return Image.fromarray(x[0] if x.shape[0] == 1 else np.ascontiguousarray(x.transpose(1, 2, 0)))


def pil_jitter(img: Image.Image, ops) -> Image.Image:
    """The same operations on a PIL image (mode L or RGB) with PIL itself."""
    from PIL import ImageOps

    for code, value in ops:
        if code == BRIGHTNESS:
            img = ImageEnhance.Brightness(img).enhance(value)
        elif code == CONTRAST:
            img = ImageEnhance.Contrast(img).enhance(value)
        elif code == SATURATION:
            img = ImageEnhance.Color(img).enhance(value)
        elif code == HUE and img.mode == "RGB":
            h, s, v = img.convert("HSV").split()
            a = np.array(h, dtype=np.uint8)
            a += np.uint8(int(value) & 255)
            img = Image.merge("HSV", (Image.fromarray(a, "L"), s, v)).convert("RGB")
        elif code == SHARPNESS:
            img = ImageEnhance.Sharpness(img).enhance(value)
        elif code == POSTERIZE:
            img = ImageOps.posterize(img, int(value))
        elif code == SOLARIZE:
            img = ImageOps.solarize(img, value)
        elif code == AUTOCONTRAST:
            img = ImageOps.autocontrast(img)
        elif code == EQUALIZE:
            img = ImageOps.equalize(img)
        elif code == INVERT:
            img = ImageOps.invert(img)
        elif code == AFFINE:
            img = img.transform(img.size, Image.Transform.AFFINE, list(value[:6]), Image.Resampling(value[7]),
                                fillcolor=value[6])
        elif code == SOLARIZE_ADD:
            add = int(value)
            img = img.point([min(255, i + add) if i < 128 else i for i in range(256)] * len(img.getbands()))
        elif code == BLUR:
            import importlib

            kx, ky, sx, sy, v2 = value
            F = importlib.import_module("torchvision.transforms.v2.functional" if v2 else
                                        "torchvision.transforms.functional")
            img = F.gaussian_blur(img, [int(kx), int(ky)], [float(sx), float(sy)])
        elif code == TRANSPOSE:
            img = img.transpose(Image.Transpose(int(value)))
        elif code == TIMM_AUGMIX:
            m, weights, chains = value
            mixed = np.zeros((img.height, img.width, len(img.getbands())), dtype=np.float32)
            for weight, chain in zip(weights, chains):
                mixed += np.float32(weight) * np.asarray(pil_jitter(img, chain), dtype=np.float32)
            np.clip(mixed, 0, 255.0, out=mixed)
            img = Image.blend(img, Image.fromarray(mixed.astype(np.uint8), img.mode), float(np.float32(m)))
        elif code == PERMUTE:
            bands = img.split()
            img = Image.merge(img.mode, [bands[i] for i in permutation(value)])
        elif code == PIL_BLUR:
            from PIL import ImageFilter

            img = img.filter(ImageFilter.GaussianBlur(radius=float(value)))
        elif code == PERSPECTIVE:
            img = img.transform(img.size, Image.Transform.PERSPECTIVE, list(value[:8]), Image.Resampling(value[9]),
                                fillcolor=value[8])
        elif code == AUGMIX:
            import torch

            from . import augmix

            x = torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1)   # pil_to_tensor's layout
            img = Image.fromarray(augmix.on_planes(x, value).permute(1, 2, 0).numpy(), img.mode)
        elif code not in KERNEL_CODES:
            raise ValueError(f"unknown colour operation code {code}")
    return img


def _planes(img: Image.Image) -> np.ndarray:
    a = np.asarray(img)
    return (a[None] if a.ndim == 2 else a.transpose(2, 0, 1)).copy()


# the factors and hue turns the checks against PIL probe with: the ends, factors either side of 1
# whose products land near rounding boundaries, extrapolation past 2
PROBE_FACTORS = (0.0, 0.6, 0.8537, 1.4, 2.75)
PROBE_SHIFTS = (0, 1, 128, 201, 255)


# the other operations' probes: posterize's bits, solarize's thresholds (either side of integers, past
# the ends), affine maps (shears either way, translations, rotations as torchvision makes them, a fill),
# transpositions (the quarter turns)
_PROBE_VALUES = {
    POSTERIZE: (1, 2, 4, 7, 8),
    SOLARIZE: (0.0, 8.5, 128.0, 200.3, 255.0, 256.0),
    AUTOCONTRAST: (0,), EQUALIZE: (0,), INVERT: (0,),
    AFFINE: tuple((*a, r) for r in (0, 2, 3) for a in (
        (1.0, 0.3, 0.0, 0.0, 1.0, 0.0, None), (1.0, -0.99, 0.0, 0.0, 1.0, 0.0, (0, 0, 0)),
        (1.0, 0.0, 0.0, 0.45, 1.0, 0.0, (9, 80, 200)), (1.0, 0.0, -5.0, 0.0, 1.0, 3.0, None),
        (1.0, 0.0, 7.0, 0.0, 1.0, -2.0, (0, 0, 0)), (0.707107, 0.707107, -4.3, -0.707107, 0.707107, 6.1, (1, 2, 3)),
        (0.95, -0.3, 1.5, 0.3, 0.95, -2.25, None), (1.0, 0.0, 2.7, 0.0, 1.0, -1.3, (128, 128, 128)))),
    TRANSPOSE: (0, 1, 2, 3, 4, 5, 6),
    SOLARIZE_ADD: (0, 1, 50, 110, 200),
    BLUR: ((3, 3, 0.5, 0.5, 0), (5, 3, 0.7, 1.3, 0), (7, 7, 2.0, 2.0, 0), (3, 5, 0.1, 0.9, 1), (7, 7, 1.1, 1.1, 1)),
}


def _augmix_probes() -> tuple:
    """AugMix's probes: each operation both ways, both versions, both
    modes, chains of one to three operations; and a policy's operations
    given a tensor (one chain weighted 1 over the image weighted 0, Invert
    among them)."""
    from .augmix import INDEX

    def value(v2, mode, m0, weights, chains):
        f = lambda v: float(np.float32(v))    # noqa: E731 - every number a float32, as drawn
        return (v2, mode, f(m0), tuple(f(w) for w in weights),
                tuple(tuple((INDEX[n], f(m)) for n, m in c) for c in chains))

    out = []
    for v2 in (0, 1):
        sol = 0.4 if v2 else 100.0
        out.append(value(v2, 1, 0.3, (0.2, 0.35, 0.15), (
            (("ShearX", 0.1), ("Brightness", -0.3), ("Posterize", 3)), (("TranslateY", -2.5), ("Contrast", 0.6)),
            (("Rotate", -12.0), ("Sharpness", 0.9), ("Equalize", 0.0)))))
        out.append(value(v2, 0, 0.55, (0.3, 0.15), (
            (("ShearY", -0.2), ("Color", 0.45), ("Solarize", sol)), (("TranslateX", 3.0), ("AutoContrast", 0.0)))))
        out.append(value(v2, v2, 0.1, (0.6, 0.2, 0.1), (
            (("Rotate", 25.0),), (("Contrast", -0.7), ("ShearX", -0.05)), (("Sharpness", -0.8), ("Color", 0.9),
                                                                          ("TranslateX", -1.0)))))
        out.append(value(v2, 1 - v2, 0.0, (1.0,), ((("Invert", 0.0), ("ShearY", 0.25), ("Solarize", sol),
                                                    ("Equalize", 0.0)),)))
    return tuple(out)


_PROBE_VALUES[AUGMIX] = _augmix_probes()
# perspective maps as torchvision's RandomPerspective makes them (corners moved in by up to half the
# distance to the centre), one that sends a corner outside, a near-affine one; each filter, with and without a fill
_PROBE_VALUES[PERSPECTIVE] = tuple((*a, fill, r) for r in (0, 2, 3) for a, fill in (
    ((1.21, 0.12, -2.3, 0.05, 1.33, -1.7, 0.0061, 0.0094), None),
    ((0.82, -0.21, 3.9, 0.11, 0.77, 2.2, -0.0123, 0.0071), (9, 80, 200)),
    ((1.0, 0.25, -4.0, -0.1, 0.9, 6.5, 0.021, -0.017), (0, 0, 0)),
    ((1.0, 0.0, 1.5, 0.0, 1.0, -0.5, 1e-9, 0.0), None)))
# PIL's Gaussian blur: radii whose boxes are under a pixel, one, two and more than the probes' width
_PROBE_VALUES[PIL_BLUR] = (0.1, 0.37, 0.5, 1.0, 1.7, 2.0, 3.3, 9.5)


def _timm_augmix_probes() -> tuple:
    """timm's AugMix: chains of its operations (colour, tables, affine maps
    with each filter, and a fill), the weights and the blend."""
    f = lambda v: float(np.float32(v))    # noqa: E731 - drawn as float32
    shear = (1.0, 0.21, 0.0, 0.0, 1.0, 0.0, (128, 128, 128), 2)
    rot = (0.96, -0.28, 3.1, 0.28, 0.96, -2.2, (128, 128, 128), 3)
    move = (1.0, 0.0, -2.5, 0.0, 1.0, 1.5, None, 0)
    return ((f(0.63), (f(0.2), f(0.5), f(0.3)), (((AUTOCONTRAST, 0), (AFFINE, shear)),
                                                ((SATURATION, 1.7), (POSTERIZE, 5), (AFFINE, rot)),
                                                ((EQUALIZE, 0),))),
            (f(0.08), (f(0.71), f(0.29)), (((SOLARIZE, 171), (SHARPNESS, 0.4)), ((CONTRAST, 1.9), (AFFINE, move)))),
            (f(1.0), (f(1.0),), (((BRIGHTNESS, 0.3),),)), (f(0.0), (f(0.4), f(0.6)), ((), ((INVERT, 0),))))


_PROBE_VALUES[TIMM_AUGMIX] = _timm_augmix_probes()
_PROBE_VALUES[PERMUTE] = (12, 21, 102, 120, 201, 210)      # every order of three bands


def probe_ops(codes) -> list:
    """The single operations of ``codes`` that a check against PIL runs:
    each factor of :data:`PROBE_FACTORS` for a blend (and sharpness), each
    turn of :data:`PROBE_SHIFTS` for the hue, a spread of values for the
    others."""
    def values(code):
        if code == HUE:
            return PROBE_SHIFTS
        return _PROBE_VALUES.get(code, PROBE_FACTORS)

    return [[(code, v)] for code in codes for v in values(code)]


def _probe_images(seed: int, *shapes: tuple) -> list:
    """Noise images of ``shapes`` (H, W, 3 for RGB, H, W for L) from
    ``seed``, in order; a shape ``(h, w, 3, k)`` is noise divided by ``k``
    (a dark image)."""
    rng = random.Random(seed)
    out = []
    for shape in shapes:
        dims, k = (shape[:3], shape[3]) if len(shape) == 4 else (shape, 1)
        a = np.frombuffer(rng.randbytes(int(np.prod(dims))), np.uint8).reshape(dims)
        out.append(Image.fromarray(a // k if k != 1 else a))
    return out


def _reproduces(images, cases, run, skip, what: str) -> bool:
    """Whether ``run(planes, ops)`` gives PIL's bytes (:func:`pil_jitter`)
    for each of ``cases`` on each image (but the cases ``skip(ops, planes)``
    leaves out); else False, with a warning that says ``what`` runs
    through PIL instead."""
    for img in images:
        planes = _planes(img)
        for ops in cases:
            if skip(ops, planes):
                continue
            if not np.array_equal(run(planes, ops), _planes(pil_jitter(img, ops))):
                log.warning("coordl.decode._color does not reproduce this PIL's %s on a %s image: %s (the same "
                            "pixels, slower)", ops, img.mode, what)
                return False
    return True


def _check() -> bool:
    """True when the extension gives PIL's bytes on every probe."""
    if _ext is None:
        return False
    cases = probe_ops((BRIGHTNESS, CONTRAST, SATURATION, HUE))
    cases += [[(SATURATION, 1.3), (BRIGHTNESS, 0.7), (HUE, 250), (CONTRAST, 1.25)]]
    return _reproduces(_probe_images(20241127, (48, 64, 3), (17, 19, 3, 4), (13, 11)), cases, jitter,
                       lambda ops, planes: False, "colour adjustments run through PIL")


_lock = _forks.worker_safe(threading.Lock())
_checked: list = []  # [] until checked, then [bool]


def _check_ops() -> bool:
    """True when :func:`apply_ops` gives PIL's bytes for the operations the
    extension runs (:data:`OP_CODES`), and timm's AugMix of them, on every
    probe."""
    if _ext is None or not hasattr(_ext, "pil_op"):
        return False

    def skip(ops, planes) -> bool:      # a fill of three values for an L image: PIL refuses it either way
        (code, value), = ops
        return (code in (AFFINE, PERSPECTIVE) and not _takes(value, planes.shape[0])) or (
            code == TIMM_AUGMIX and planes.shape[0] != 3)

    images = _probe_images(20261129, (48, 64, 3), (17, 19, 3, 4), (13, 11), (2, 5, 3))
    return _reproduces(images, probe_ops(sorted(OP_CODES | {TIMM_AUGMIX})), apply_ops, skip,
                       "auto-augment policies run as written")


_checked_ops: list = []


def exact_ops() -> bool:
    """Whether :func:`apply_ops`'s kernels reproduce the installed PIL
    (checked once per process)."""
    return extensions.once(_checked_ops, _lock, _check_ops)


def exact_kernel() -> bool:
    """Whether :func:`jitter` reproduces the installed PIL (checked once per process)."""
    return extensions.once(_checked, _lock, _check)
