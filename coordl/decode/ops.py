"""The image operations coordl's transforms and its fused decode run, on
PIL images and CHW uint8 tensors: resize (torch's antialiased kernels),
crop, RandomResizedCrop's box draw, HWC -> CHW, the resampling filters
(:class:`InterpolationMode`, public through :mod:`coordl.transforms`), and
the argument checks whose errors name the parameter."""
from __future__ import annotations

import enum
import math
import numbers
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

__all__ = ["InterpolationMode", "resized_crop"]


class InterpolationMode(str, enum.Enum):
    """Resampling filter (a str Enum); PIL's integer filters are accepted too."""
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


_R = Image.Resampling
_PIL_FILTERS = {
    InterpolationMode.NEAREST: _R.NEAREST, InterpolationMode.NEAREST_EXACT: _R.NEAREST,
    InterpolationMode.BILINEAR: _R.BILINEAR, InterpolationMode.BICUBIC: _R.BICUBIC,
    InterpolationMode.BOX: _R.BOX, InterpolationMode.HAMMING: _R.HAMMING,
    InterpolationMode.LANCZOS: _R.LANCZOS,
}
_FROM_PIL = {int(f): m for m, f in _PIL_FILTERS.items() if m is not InterpolationMode.NEAREST_EXACT}
_TENSOR_MODES = ("nearest", "nearest-exact", "bilinear", "bicubic")


def _bad(name: str, expected: str, value: Any, exc: type = ValueError) -> Exception:
    return exc(f"{name} should be {expected}, but got {name}={value!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _is_seq(v: Any) -> bool:
    return isinstance(v, Sequence) and not isinstance(v, (str, bytes))


def _check_size(size: Any, pair: bool = True) -> Any:
    """An int or a 1/2-sequence of positive ints -> (h, w); or, with ``pair=False``,
    an int (smaller edge) or (h, w)."""
    vals = [size] if _is_int(size) else list(size) if _is_seq(size) else None
    if vals is None or not 1 <= len(vals) <= 2 or not all(_is_int(v) and v > 0 for v in vals):
        exc = TypeError if vals is None else ValueError
        raise _bad("size", "a positive int or a sequence of 1 or 2 positive ints", size, exc)
    vals = [int(v) for v in vals]
    return vals[0] if len(vals) == 1 and not pair else (vals[0], vals[-1])


def _check_range(value: Any, name: str, positive: bool) -> tuple[float, float]:
    kind = "positive" if positive else "non-negative"
    if not (_is_seq(value) and len(value) == 2 and all(_is_num(v) for v in value)):
        raise _bad(name, f"a sequence of 2 {kind} numbers (min, max)", value, TypeError)
    if any(v < 0 or (positive and v == 0) for v in value):
        raise _bad(name, f"a sequence of 2 {kind} numbers (min, max)", value)
    return float(value[0]), float(value[1])


def _floats(v: Any, name: str) -> tuple[float, ...]:
    vals = list(v) if _is_seq(v) else [v]
    if not vals or not all(_is_num(x) for x in vals):
        raise _bad(name, "a number or a non-empty sequence of numbers", v, TypeError)
    return tuple(float(x) for x in vals)


def _check_interp(value: Any) -> InterpolationMode:
    if _is_int(value) and int(value) in _FROM_PIL:
        return _FROM_PIL[int(value)]
    try:
        return InterpolationMode(value)
    except ValueError:
        raise _bad("interpolation", "an InterpolationMode, its value or a PIL resampling filter "
                   "(NEAREST, BOX, BILINEAR, HAMMING, BICUBIC, LANCZOS)", value) from None


def _check_antialias(value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise _bad("antialias", "a bool or None", value, TypeError)
    return value


def _hw(img: Any) -> tuple[int, int]:
    """(height, width) of a PIL image or a [..., H, W] tensor."""
    if isinstance(img, Image.Image):
        return img.height, img.width
    if isinstance(img, torch.Tensor) and img.ndim >= 2:
        return int(img.shape[-2]), int(img.shape[-1])
    raise _bad("img", "a PIL Image or a tensor of shape [..., H, W]", type(img), TypeError)


def _resize_tensor(x: torch.Tensor, h: int, w: int, mode: InterpolationMode,
                   antialias: bool | None, in_float: bool = False) -> torch.Tensor:
    """``x`` resized to (h, w) by torch's kernels: a uint8 image by torch's
    uint8 kernel (v2's arithmetic), or with ``in_float`` in float32, clipped
    and rounded once (v1's tensor resize, whose bicubic passes are not
    clipped between them)."""
    if mode.value not in _TENSOR_MODES:
        raise _bad("interpolation", f"one of {_TENSOR_MODES} for tensors", mode.value)
    if tuple(x.shape[-2:]) == (h, w):
        return x
    smooth = mode.value in ("bilinear", "bicubic")
    kw = {"align_corners": False, "antialias": bool(antialias)} if smooth else {}
    if x.dtype == torch.uint8 and x.ndim == 3 and mode.value in ("bilinear", "bicubic", "nearest") and not in_float:
        # torch's native uint8 kernels (vectorized, PIL-like rounding): no float round trip
        y = F.interpolate(x.unsqueeze(0), size=(h, w), mode=mode.value, **kw)
        return y[0]
    y = x.reshape(1, -1, *x.shape[-2:])
    if not y.is_floating_point():
        y = y.float()
    y = F.interpolate(y, size=(h, w), mode=mode.value, **kw)
    if not x.is_floating_point():
        info = torch.iinfo(x.dtype)
        y = y.round_().clamp_(info.min, info.max).to(x.dtype)
    return y.reshape(*x.shape[:-2], h, w)


def _draw_box(height: int, width: int, scale: Sequence[float], ratio: Sequence[float], rng: Any
              ) -> tuple[int, int, int, int]:
    """RandomResizedCrop's (top, left, h, w) for a ``height`` x ``width`` image
    (ints), drawn from ``rng``: the body of ``get_params``, which the fused
    decode calls directly (no argument checks per sample)."""
    area = height * width
    s_lo, s_hi = min(scale), max(scale)
    lr_lo, lr_hi = math.log(min(ratio)), math.log(max(ratio))
    for _ in range(10):
        target_area = area * rng.uniform(s_lo, s_hi)
        aspect = math.exp(rng.uniform(lr_lo, lr_hi))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height  # fallback: the largest central crop with a ratio in range
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def resized_crop(img: Any, top: int, left: int, height: int, width: int, size: Sequence[int],
                 interpolation: Any = InterpolationMode.BILINEAR, antialias: bool | None = True) -> Any:
    """Crop the in-bounds box (top, left, height, width), then resize it to ``size`` (h, w):
    torchvision's ``resized_crop``, the same pixels (the filter stops at the crop's edge)."""
    (out_h, out_w), mode = _check_size(size), _check_interp(interpolation)
    if isinstance(img, torch.Tensor):
        return _resize_tensor(img[..., top:top + height, left:left + width], out_h, out_w, mode, antialias)
    box = (left, top, left + width, top + height)
    crop = img if box == (0, 0, *img.size) else img.crop(box)
    return crop if (width, height) == (out_w, out_h) else crop.resize((out_w, out_h), _PIL_FILTERS[mode])


def _crop(img: Any, top: int, left: int, h: int, w: int) -> Any:
    """Crop that may reach outside the image; the outside is zero."""
    if isinstance(img, Image.Image):
        return img.crop((left, top, left + w, top + h))
    H, W = _hw(img)
    if top >= 0 and left >= 0 and top + h <= H and left + w <= W:
        return img[..., top:top + h, left:left + w]
    out = img.new_zeros((*img.shape[:-2], h, w))
    t0, l0, t1, l1 = max(top, 0), max(left, 0), min(top + h, H), min(left + w, W)
    if t1 > t0 and l1 > l0:
        out[..., t0 - top:t1 - top, l0 - left:l1 - left] = img[..., t0:t1, l0:l1]
    return out


def _to_chw(pic: Any) -> torch.Tensor:
    """PIL image or HWC/HW array -> CHW tensor in one copy, which also makes it writable
    and native-endian (``torch.from_numpy(np.asarray(pil_image))`` warns: read-only)."""
    if not isinstance(pic, (Image.Image, np.ndarray)):
        raise _bad("pic", "a PIL Image or a numpy.ndarray", type(pic), TypeError)
    arr = np.asarray(pic)
    if arr.dtype == np.bool_:  # PIL mode "1"
        arr = arr.astype(np.uint8) * np.uint8(255)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    out = np.empty((arr.shape[2], arr.shape[0], arr.shape[1]), dtype=arr.dtype.newbyteorder("="))
    np.copyto(out.transpose(1, 2, 0), arr)
    return torch.from_numpy(out)
