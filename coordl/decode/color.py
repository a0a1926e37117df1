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
"""
from __future__ import annotations

import logging
import random
import threading

import numpy as np
from PIL import Image, ImageEnhance

from . import extensions

__all__ = ["BRIGHTNESS", "CONTRAST", "SATURATION", "HUE", "jitter", "pil_jitter", "exact_kernel", "probe_ops"]

log = logging.getLogger(__name__)

# the operation codes of jitter's ops: (code, factor), or (HUE, shift of the 8-bit hue, 0..255)
BRIGHTNESS, CONTRAST, SATURATION, HUE = 0, 1, 2, 3


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


def pil_jitter(img: Image.Image, ops) -> Image.Image:
    """The same operations on a PIL image (mode L or RGB) with PIL itself."""
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
    return img


def _planes(img: Image.Image) -> np.ndarray:
    a = np.asarray(img)
    return (a[None] if a.ndim == 2 else a.transpose(2, 0, 1)).copy()


# the factors and hue turns the checks against PIL probe with: the ends, factors either side of 1
# whose products land near rounding boundaries, extrapolation past 2
PROBE_FACTORS = (0.0, 0.6, 0.8537, 1.4, 2.75)
PROBE_SHIFTS = (0, 1, 128, 201, 255)


def probe_ops(codes) -> list:
    """The single operations of ``codes`` that a check against PIL runs:
    each factor of :data:`PROBE_FACTORS` for a blend, each turn of
    :data:`PROBE_SHIFTS` for the hue."""
    return [[(code, v)] for code in codes for v in (PROBE_SHIFTS if code == HUE else PROBE_FACTORS)]


def _check() -> bool:
    """True when the extension gives PIL's bytes on every probe."""
    if _ext is None:
        return False
    rng = random.Random(20241127)

    def noise(*shape):
        return np.frombuffer(rng.randbytes(int(np.prod(shape))), np.uint8).reshape(shape)

    rgb = Image.fromarray(noise(48, 64, 3))
    dark = Image.fromarray(noise(17, 19, 3) // 4)
    gray = Image.fromarray(noise(13, 11))
    cases = probe_ops((BRIGHTNESS, CONTRAST, SATURATION, HUE))
    cases += [[(SATURATION, 1.3), (BRIGHTNESS, 0.7), (HUE, 250), (CONTRAST, 1.25)]]
    for img in (rgb, dark, gray):
        planes = _planes(img)
        for ops in cases:
            if not np.array_equal(jitter(planes, ops), _planes(pil_jitter(img, ops))):
                log.warning("coordl.decode._color does not reproduce this PIL's %s on a %s image: colour "
                            "adjustments run through PIL (the same pixels, slower)", ops, img.mode)
                return False
    return True


_lock = threading.Lock()
_checked: list = []  # [] until checked, then [bool]


def exact_kernel() -> bool:
    """Whether :func:`jitter` reproduces the installed PIL (checked once per process)."""
    return extensions.once(_checked, _lock, _check)
