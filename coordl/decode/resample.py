"""PIL's resampling of uint8 images, on numpy arrays: what the fused decode
path runs for a Resize or RandomResizedCrop that torchvision would run on a
PIL image (bilinear or bicubic, always antialiased), so that the fused
result is PIL's.

:func:`pil_resize` is ``Image.fromarray(a).resize(size, filter, box=box)``
without the PIL image: through the C extension ``coordl.decode._resample``
(PIL's arithmetic, bit for bit; built by ``pip install`` where a C compiler
is, optional) when it reproduces the installed PIL, else through PIL itself.

PIL resamples in two passes with an 8-bit image between them, so the order
of the passes changes the result (by up to 8 levels with bicubic, whose
negative lobes clip between the passes).  Pillow before 13 always ran the
horizontal pass first; Pillow 13 runs the vertical one first when the
height shrinks by more than twice as many pixels as the width.  The first
call checks which rule the installed PIL follows, by resizing a few small
images both ways and comparing with PIL's own result; if the extension
matches PIL under none of the known rules (a future Pillow, a build of the
extension that differs), every resize goes through PIL, which is exact by
construction and about 2x slower.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np
from PIL import Image

from . import extensions
from ..base import forks as _forks

__all__ = ["FILTERS", "pil_resize", "exact_kernel", "window_kernel"]

log = logging.getLogger(__name__)

# the filters pil_resize takes: name -> (extension's code, PIL's filter)
FILTERS = {"bilinear": (0, Image.Resampling.BILINEAR), "bicubic": (1, Image.Resampling.BICUBIC)}


_ext = extensions.load("_resample", log, "the fused path resizes through PIL")


def _horizontal_first(h: int, w: int, oh: int, ow: int) -> bool:
    return False


def _vertical_when_height_shrinks_more(h: int, w: int, oh: int, ow: int) -> bool:
    return oh < h and h - oh > 2 * (w - ow)


# the pass orders of the Pillow releases known, oldest first: (h, w, out_h, out_w) -> vertical first
_RULES: tuple[Callable[[int, int, int, int], bool], ...] = (_horizontal_first,
                                                              _vertical_when_height_shrinks_more)

# (h, w, out_h, out_w) probes on which the known rules disagree, and some on which they agree
_PROBES = ((40, 24, 16, 22), (36, 20, 12, 30), (24, 40, 22, 16), (30, 30, 20, 20), (12, 10, 30, 25),
           (50, 9, 20, 7))

_lock = _forks.worker_safe(threading.Lock())
_rule: list = []  # [] until checked, then [rule or None]


def _run_ext(a: np.ndarray, out_hw, code: int, box, vertical_first: bool) -> np.ndarray:
    if box is None:
        box = (0.0, 0.0, float(a.shape[1]), float(a.shape[0]))
    out = np.empty((out_hw[0], out_hw[1], a.shape[2]), np.uint8)
    _ext.resample(a, out, box[0], box[1], box[2], box[3], code, vertical_first)
    return out


def _pil(a: np.ndarray, out_hw, pil_filter, box) -> np.ndarray:
    img = Image.fromarray(np.ascontiguousarray(a) if a.shape[2] != 1 else np.ascontiguousarray(a[..., 0]))
    out = np.array(img.resize((out_hw[1], out_hw[0]), pil_filter, box=box))
    return out if out.ndim == 3 else out[..., None]


def _check() -> Callable | None:
    """The pass-order rule under which the extension gives the installed
    PIL's results on every probe, or None (no extension, or no rule does)."""
    if _ext is None:
        return None
    rng = np.random.default_rng(20240613)
    cases = []
    for h, w, oh, ow in _PROBES:
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        for code, pil_filter in FILTERS.values():
            cases.append((a, (oh, ow), code, pil_filter))
    for rule in _RULES:
        if all(np.array_equal(_run_ext(a, out, code, box, rule(a.shape[0], a.shape[1], *out)),
                              _pil(a, out, pil_filter, box))
               for a, out, code, pil_filter in cases for box in (None, (1.5, 2.25, a.shape[1] - 0.5, a.shape[0] - 1))):
            return rule
    log.warning("coordl.decode._resample does not reproduce this PIL's resize under any known pass "
                "order: the fused path resizes through PIL (the same pixels, slower)")
    return None


def exact_kernel() -> Callable | None:
    """The installed PIL's pass-order rule when the extension reproduces it
    (checked once per process), else None."""
    return extensions.once(_rule, _lock, _check)


def pil_resize(a: np.ndarray, out_hw: tuple[int, int], mode: str,
               box: tuple[float, float, float, float] | None = None) -> np.ndarray:
    """``a`` (a uint8 (H, W, C) array whose pixels lie side by side in each
    row, e.g. a slice of a decoded image) resized as PIL resizes it to
    ``out_hw`` (h, w) with ``mode`` (``"bilinear"`` or ``"bicubic"``), of
    ``box`` = (x0, y0, x1, y1) (PIL's order; fractions allowed) or the whole
    array: a new C-contiguous (h, w, C) uint8 array, PIL's pixels exactly."""
    code, pil_filter = FILTERS[mode]
    H, W = a.shape[:2]
    if box is None:
        box = (0.0, 0.0, float(W), float(H))
    rule = exact_kernel()
    if rule is None or a.strides[1] != a.shape[2] or a.strides[2] != 1:
        return _pil(a, out_hw, pil_filter, box)
    # PIL decides the order from the image's size, whatever the box
    return _run_ext(a, out_hw, code, box, rule(H, W, *out_hw))


def window_kernel() -> Callable | None:
    """``resize_window`` when the extension reproduces the installed PIL and
    has windows (a build older than them has not), else None."""
    if _ext is None or not hasattr(_ext, "resample_window") or exact_kernel() is None:
        return None
    return resize_window


def resize_window(full_hw: tuple[int, int], out_hw: tuple[int, int], window: tuple[int, int, int, int],
                  mode: str, read: Callable[[tuple[int, int, int, int]], tuple[np.ndarray, int, int]]) -> np.ndarray:
    """The ``window`` = (top, left, h, w) of an image of ``full_hw`` (H, W)
    resized as PIL resizes it (the whole image) to ``out_hw``, with
    ``mode`` (``"bilinear"`` or ``"bicubic"``): PIL's pixels there, computed
    from only the input pixels they depend on.  ``read(box)`` gives the
    image's pixels of ``box`` = (top, left, h, w) (at least): ``(array,
    its first row, its first column)`` in the whole image.  Only with
    :func:`window_kernel` (not None)."""
    code = FILTERS[mode][0]
    H, W = full_hw
    oh, ow = out_hw
    top, left, h, w = window
    # an axis that keeps its size has no pass (PIL skips it): the window's own rows or columns
    ys = _ext.span(H, 0.0, float(H), oh, code, top, top + h) if oh != H else (top, top + h)
    xs = _ext.span(W, 0.0, float(W), ow, code, left, left + w) if ow != W else (left, left + w)
    arr, y0, x0 = read((ys[0], xs[0], max(1, ys[1] - ys[0]), max(1, xs[1] - xs[0])))
    out = np.empty((h, w, arr.shape[2]), np.uint8)
    _ext.resample_window(arr, out, 0.0, 0.0, float(W), float(H), code, exact_kernel()(H, W, oh, ow),
                         (H, W), (y0, x0), (oh, ow), (top, left))
    return out
