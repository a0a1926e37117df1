"""Image transforms with torchvision's names, parameters and defaults.

``RandomResizedCrop``, ``RandomHorizontalFlip``, ``Resize``, ``CenterCrop``,
``PILToTensor``, ``ToTensor``, ``Normalize`` and ``Compose`` behave like their
torchvision namesakes on PIL images (and on tensors where documented), without
importing torchvision.

Randomness: a random transform asks ``coordl._rng.current()`` for its
generator each time it is called (never caching it).  Inside a coordl prep
stage that is the per-sample generator of ``(seed, epoch, index)``, so a
sample's augmentation is a pure function of those three numbers.  Anywhere
else it is a shim over torch's global RNG, drawn in the same order as
torchvision, so ``torch.manual_seed`` makes results reproducible.

Every transform has ``spec()``: a nested tuple of plain values (class name and
parameters) that is equal for equal pipelines in any process; ``==`` and
``hash`` use it.  :func:`spec_of` describes any callable the same way, which is
how ``Compose`` accepts arbitrary callables as children.
"""
from __future__ import annotations

import contextlib

import hashlib
import marshal
import re
import types
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image

from . import _rng
from .decode.ops import (  # noqa: F401 (InterpolationMode and resized_crop are public here)
    InterpolationMode,
    _PIL_FILTERS,
    _TENSOR_MODES,
    _bad,
    _check_antialias,
    _check_interp,
    _check_range,
    _check_size,
    _crop,
    _draw_box,
    _floats,
    _hw,
    _is_int,
    _is_num,
    _is_seq,
    _resize_tensor,
    _to_chw,
    resized_crop,
)

__all__ = [
    "InterpolationMode", "Transform", "Compose", "RandomResizedCrop", "RandomHorizontalFlip",
    "RandomVerticalFlip", "Resize", "CenterCrop", "RandomCrop", "Pad", "PILToTensor", "ToTensor", "ToDtype",
    "Normalize",
    "resized_crop", "spec_of",
]

_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")


def _qualname(obj: Any) -> str:
    mod, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None) or obj.__name__
    return f"{mod}.{name}" if mod and mod != "builtins" else name


def _class_name(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == __name__ else _qualname(cls)


def spec_of(obj: Any) -> Any:
    """A plain, hashable, process-independent description of a transform.

    ``obj.spec()`` when it has one; the qualified name for classes and named
    functions (plus a digest of the code for lambdas and local functions);
    otherwise the qualified class name and ``repr`` without memory addresses.
    """
    spec = getattr(obj, "spec", None)
    if callable(spec) and not isinstance(obj, type):
        return spec()
    if isinstance(obj, types.FunctionType):
        name = _qualname(obj)
        if "<" not in name:  # a module-level or class-level function: the name identifies it
            return ("function", name)
        cells = tuple(c.cell_contents for c in obj.__closure__ or ())
        extra = _ADDR.sub("", repr((obj.__defaults__, obj.__kwdefaults__, cells))).encode()
        digest = hashlib.sha1(marshal.dumps(obj.__code__) + extra).hexdigest()[:16]
        return ("function", name, digest)
    if isinstance(getattr(obj, "__qualname__", None), str) and not isinstance(obj, types.MethodType):
        return ("callable", _qualname(obj))  # classes, builtins, numpy functions and ufuncs
    return ("callable", _qualname(type(obj)), _ADDR.sub("", repr(obj)))


def _plain(v: Any) -> Any:
    if isinstance(v, InterpolationMode):
        return v.value
    return tuple(_plain(x) for x in v) if isinstance(v, (tuple, list)) else v


def _fmt(v: Any) -> str:
    if isinstance(v, InterpolationMode):
        return v.value
    if isinstance(v, float):
        return repr(round(v, 4))
    if isinstance(v, tuple):
        return "(" + ", ".join(map(_fmt, v)) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


class Transform:
    """Base class: ``spec()``, ``==``, ``hash`` and ``repr`` from ``_params()``."""

    def _params(self) -> dict[str, Any]:
        return {}

    def spec(self) -> tuple:
        """What decides this transform's output, as plain hashable data (its
        class and parameters): part of the key under which jobs share prep."""
        return (_class_name(type(self)), tuple((k, _plain(v)) for k, v in self._params().items()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Transform):
            return NotImplemented
        return self.spec() == other.spec()

    def __hash__(self) -> int:
        return hash(self.spec())

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={_fmt(v)}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"


class Compose(Transform):
    """Apply ``transforms`` in order; any callable works as a child."""

    def __init__(self, transforms: Sequence[Callable]):
        if not (_is_seq(transforms) and all(callable(t) for t in transforms)):
            raise _bad("transforms", "a sequence of callables", transforms, TypeError)
        self.transforms = list(transforms)

    def __call__(self, img: Any) -> Any:
        return run_steps(self.transforms, img)

    def spec(self) -> tuple:
        """The class and the spec of every step, in order (see :func:`spec_of`)."""
        return (_class_name(type(self)), tuple(spec_of(t) for t in self.transforms))

    def from_bytes(self, raw) -> Any:
        """Decode ``raw`` (an encoded image) and apply this pipeline without
        PIL images in between, or NotImplemented when the pipeline can't be
        fused (see ``decode_and_apply``)."""
        return decode_and_apply(self.transforms, raw)

    def from_planes(self, x: torch.Tensor) -> Any:
        """Apply this pipeline to a decoded image's uint8 ``(C, H, W)``
        planes (3 for RGB, 1 for L) without a PIL image, or NotImplemented
        when the pipeline can't be fused (see ``apply_to_planes``)."""
        return apply_to_planes(self.transforms, x)

    def __repr__(self) -> str:
        return type(self).__name__ + "(" + "".join(f"\n    {t!r}" for t in self.transforms) + "\n)"


def foreign(t) -> bool:
    """``t`` (a transform, or None) is a callable that is not coordl's: it
    may draw from torch's or Python's global generator."""
    return t is not None and not type(t).__module__.startswith("coordl.") and \
        not getattr(t, "__module__", "").startswith("coordl.")


_NUMPY_DRAWS: dict = {}     # id(transform) -> (the transform, its steps' count, draws_numpy's answer)


def draws_numpy(t) -> bool:
    """``t`` (a transform, or None) may draw from numpy's global generator:
    a callable neither coordl's nor torchvision's (timm's ``RandAugment``
    draws from it; torchvision's transforms draw from torch's generator
    alone), or one of theirs holding such a callable (a ``Compose``,
    ``RandomApply``, ``RandomChoice``, ``RandomOrder``, ``Lambda``; coordl's
    wrapper of a user's step).  Kept per object (asked for every sample;
    a walk of a recipe's steps costs about 14 us)."""
    if t is None:
        return False
    steps = getattr(t, "transforms", None)
    n = len(steps) if isinstance(steps, (list, tuple)) else -1
    got = _NUMPY_DRAWS.get(id(t))
    if got is not None and got[0] is t and got[1] == n:
        return got[2]
    ans = _draws_numpy(t)
    if len(_NUMPY_DRAWS) > 4096:
        _NUMPY_DRAWS.clear()
    _NUMPY_DRAWS[id(t)] = (t, n, ans)
    return ans


def _draws_numpy(t) -> bool:
    mod = type(t).__module__
    if mod.startswith("coordl."):
        inner = getattr(t, "user", None)
        return draws_numpy(inner) if inner is not None else any(
            draws_numpy(s) for s in getattr(t, "transforms", None) or () if s is not t)
    if mod.startswith("torchvision."):
        inner = getattr(t, "transforms", None)
        steps = list(inner) if isinstance(inner, (list, tuple)) else []
        lambd = getattr(t, "lambd", None)
        return any(draws_numpy(s) for s in steps) or (lambd is not None and draws_numpy(lambd))
    return True


def seeded_for(*fns) -> Any:
    """The scope a sample's ``fns`` (a dataset's transform,
    target_transform, decode; None for one it has not) run in: where one of
    them is not coordl's, :class:`coordl._rng.seeded_user_steps` (their
    draws from the global generators seeded once by the sample; numpy's
    where one may draw from it), else nothing."""
    for fn in fns:          # (a loop: asked once per sample)
        if foreign(fn):
            return _rng.seeded_user_steps(any(draws_numpy(f) for f in fns))
    return _NO_SCOPE


_NO_SCOPE = contextlib.nullcontext()     # reusable: it holds nothing


def run_steps(steps, img: Any) -> Any:
    """``img`` through ``steps`` in order; where one of them is not
    coordl's, all of them inside :class:`coordl._rng.seeded_user_steps`
    (inside a loader: their global draws seeded from the sample's (seed,
    epoch, index); numpy's where one may draw from it)."""
    if any(foreign(t) for t in steps):
        with _rng.seeded_user_steps(any(draws_numpy(t) for t in steps)):
            for t in steps:
                img = t(img)
        return img
    for t in steps:
        img = t(img)
    return img


class _Resampling(Transform):
    """What Resize and RandomResizedCrop share: the ``draft`` option of the
    fused decode, and which kernel the fused decode runs for them.

    ``_on_tensor``: the step stands for one that torchvision runs on a uint8
    tensor (set by coordl.tvcompat for steps after ``ToImage``/``PILToTensor``),
    so the fused decode resizes with torch's kernel, as torchvision does
    there, rather than with PIL's arithmetic.  ``_in_float``: moreover
    torchvision resizes that tensor as its v1 functions do, in float32,
    clipped (bicubic) and rounded once (v1's bicubic, timm's steps on a
    tensor), so the fused decode does too, rather than with torch's uint8
    kernel, which clips between its passes."""

    _on_tensor = False
    _in_float = False
    draft = False

    def _set_draft(self, draft: Any) -> None:
        if not isinstance(draft, bool):
            raise _bad("draft", "a bool", draft, TypeError)
        if draft and not all(_filtered(m, self.antialias) for m in modes_of(self)):
            raise ValueError(
                "draft should be False with interpolation=" + _fmt(self.interpolation) +
                f" and antialias={self.antialias!r}: the reduced-scale JPEG decode filters the image, "
                "and this resize asks for no filtering (draft needs bilinear or bicubic with "
                f"antialias=True), but got draft={draft!r}")
        self.draft = draft

    def spec(self) -> tuple:
        base = super().spec()
        base = base + (("on_tensor", True),) if self._on_tensor else base
        return base + (("in_float", True),) if self._in_float else base


def modes_of(t: Any) -> tuple:
    """The interpolation modes of a ``Resize`` or ``RandomResizedCrop``:
    its one mode, or the modes a ``RandomResizedCrop`` draws from."""
    m = t.interpolation
    return m if isinstance(m, tuple) else (m,)


def _check_interps(value: Any) -> Any:
    """One InterpolationMode, or a tuple of two or more to draw from."""
    if isinstance(value, (tuple, list)):
        if not value:
            raise _bad("interpolation", "a mode or a non-empty sequence of modes", value)
        modes = tuple(_check_interp(v) for v in value)
        return modes[0] if len(set(modes)) == 1 else modes
    return _check_interp(value)


def _filtered(mode: InterpolationMode, antialias: bool | None) -> bool:
    """The resize is an antialiased bilinear or bicubic one (PIL's, on a PIL image)."""
    return mode.value in ("bilinear", "bicubic") and antialias is True


class RandomResizedCrop(_Resampling):
    """Crop a random area fraction and aspect ratio, then resize to ``size`` (h, w).

    ``draft=True``: where the fused decode path (``Compose.from_bytes``)
    runs this step first on a JPEG whose crop is at least twice ``size``
    on both axes, decode the JPEG at a reduced DCT scale (1/2, 1/4 or 1/8)
    that still covers ``size``, then resize from there: faster on large
    images, but not torchvision's pixels (blurrier; :doc:`/guide/torchvision`
    gives the measured difference).  Bilinear or bicubic
    with ``antialias=True`` only.  It changes nothing else: an image already
    decoded is cropped and resized as with ``draft=False``.

    ``interpolation`` may be a sequence of modes (timm's
    ``interpolation="random"``: bilinear and bicubic): each call draws one,
    uniformly, after the box (:meth:`draw_mode`)."""

    def __init__(self, size: Any, scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3.0 / 4.0, 4.0 / 3.0),
                 interpolation: Any = InterpolationMode.BILINEAR, antialias: bool | None = True,
                 *, draft: bool = False):
        self.size = _check_size(size)
        self.scale = _check_range(scale, "scale", positive=False)
        self.ratio = _check_range(ratio, "ratio", positive=True)
        if self.scale[0] > self.scale[1] or self.ratio[0] > self.ratio[1]:
            warnings.warn("Scale and ratio should be of kind (min, max)", stacklevel=2)
        self.interpolation = _check_interps(interpolation)
        self.antialias = _check_antialias(antialias)
        self._set_draft(draft)

    @staticmethod
    def get_params(img: Any, scale: Sequence[float], ratio: Sequence[float], rng: Any = None
                   ) -> tuple[int, int, int, int]:
        """(top, left, h, w) of a random crop of ``img`` (a PIL image, a tensor,
        or a PIL-style ``(width, height)`` pair), drawn from ``rng`` or
        ``coordl._rng.current()``: torchvision's algorithm and draw order."""
        if _is_seq(img) and len(img) == 2 and all(_is_int(v) for v in img):
            width, height = int(img[0]), int(img[1])
        else:
            height, width = _hw(img)
        return _draw_box(height, width, scale, ratio, _rng.current() if rng is None else rng)

    def draw_mode(self, rng: Any = None) -> int:
        """The index in ``modes_of(self)`` of the mode one call resamples
        with: 0 without drawing for one mode, else drawn uniformly from
        ``rng`` (or ``coordl._rng.current()``), right after the box."""
        m = self.interpolation
        if not isinstance(m, tuple):
            return 0
        return int((_rng.current() if rng is None else rng).random() * len(m))

    def __call__(self, img: Any) -> Any:
        top, left, h, w = self.get_params(img, self.scale, self.ratio)
        mode = modes_of(self)[self.draw_mode()]
        return resized_crop(img, top, left, h, w, self.size, mode, self.antialias)

    def _params(self) -> dict[str, Any]:
        p = {"size": self.size, "scale": self.scale, "ratio": self.ratio,
             "interpolation": self.interpolation, "antialias": self.antialias}
        return {**p, "draft": True} if self.draft else p


class RandomHorizontalFlip(Transform):
    """Mirror left-right with probability ``p`` (PIL images and [..., H, W] tensors)."""

    def __init__(self, p: float = 0.5):
        if not (_is_num(p) and 0.0 <= p <= 1.0):
            raise _bad("p", "a probability in [0, 1]", p)
        self.p = float(p)

    _dim, _transpose = -1, Image.Transpose.FLIP_LEFT_RIGHT    # the axis mirrored, on a tensor and by PIL

    def __call__(self, img: Any) -> Any:
        if _rng.current().random() < self.p:
            if isinstance(img, torch.Tensor):
                return img.flip(self._dim)
            return img.transpose(self._transpose)
        return img

    def _params(self) -> dict[str, Any]:
        return {"p": self.p}


class RandomVerticalFlip(RandomHorizontalFlip):
    """Mirror top-bottom with probability ``p`` (PIL images and [..., H, W] tensors)."""

    _dim, _transpose = -2, Image.Transpose.FLIP_TOP_BOTTOM


class Resize(_Resampling):
    """Resize to ``size`` (h, w), or match the smaller edge to an int ``size``
    keeping the aspect ratio, with the longer edge capped at ``max_size``.

    ``draft=True``: as for :class:`RandomResizedCrop`, the fused decode of a
    JPEG at least twice the output size on both axes decodes it at a
    reduced DCT scale first (faster, not torchvision's pixels)."""

    def __init__(self, size: Any, interpolation: Any = InterpolationMode.BILINEAR,
                 max_size: int | None = None, antialias: bool | None = True, *, draft: bool = False):
        if size is None:
            if max_size is None:
                raise _bad("max_size", "a positive int when size is None", max_size)
            self.size = None
        else:
            self.size = _check_size(size, pair=False)
        if max_size is not None:
            if not (_is_int(max_size) and max_size > 0):
                raise _bad("max_size", "None or a positive int", max_size)
            if isinstance(self.size, tuple):
                raise _bad("max_size", "None when size is a sequence (h, w)", max_size)
            if self.size is not None and max_size <= self.size:
                raise _bad("max_size", f"greater than size={self.size}", max_size)
            max_size = int(max_size)
        self.max_size = max_size
        self.interpolation = _check_interp(interpolation)
        self.antialias = _check_antialias(antialias)
        self._set_draft(draft)

    def output_size(self, height: int, width: int, check: bool = True) -> tuple[int, int]:
        """(h, w) of the output for an input of ``height`` x ``width``,
        torchvision's.  Where a side comes out 0 (the short side scaled down
        to keep the long one within ``max_size``) it raises, with
        ``check``, what resizing to it raises in torchvision: PIL's error
        for a PIL image, torch's for a tensor."""
        if isinstance(self.size, tuple):
            return self.size
        short, long = (width, height) if width <= height else (height, width)
        if self.size is None:
            new_short, new_long = int(self.max_size * short / long), self.max_size
        else:
            new_short, new_long = self.size, int(self.size * long / short)
            if self.max_size is not None and new_long > self.max_size:
                new_short, new_long = int(self.max_size * new_short / new_long), self.max_size
        out = (new_long, new_short) if width <= height else (new_short, new_long)
        if check and new_short <= 0:
            if self._on_tensor:
                raise RuntimeError(f"Input and output sizes should be greater than 0, but got input (H: {height}, "
                                   f"W: {width}) output (H: {out[0]}, W: {out[1]})")
            raise ValueError("height and width must be > 0")
        return out

    def __call__(self, img: Any) -> Any:
        # a side of 0: torch's or PIL's own error, whichever the image is
        (h, w), mode = self.output_size(*_hw(img), check=False), self.interpolation
        if isinstance(img, torch.Tensor):
            return _resize_tensor(img, h, w, mode, self.antialias)
        return img if img.size == (w, h) else img.resize((w, h), _PIL_FILTERS[mode])

    def _params(self) -> dict[str, Any]:
        p = {"size": self.size, "interpolation": self.interpolation,
             "max_size": self.max_size, "antialias": self.antialias}
        return {**p, "draft": True} if self.draft else p


class CenterCrop(Transform):
    """Central crop of ``size`` (h, w); zero padding where it exceeds the image."""

    def __init__(self, size: Any):
        self.size = _check_size(size)

    def offsets(self, H: int, W: int) -> tuple[int, int]:
        """(top, left) of the crop in an H x W image, torchvision's rounding
        (negative where the crop pads)."""
        h, w = self.size
        top = -((h - H) // 2) if h > H else int(round((H - h) / 2.0))
        left = -((w - W) // 2) if w > W else int(round((W - w) / 2.0))
        return top, left

    def __call__(self, img: Any) -> Any:
        top, left = self.offsets(*_hw(img))
        return _crop(img, top, left, *self.size)

    def _params(self) -> dict[str, Any]:
        return {"size": self.size}


class RandomCrop(Transform):
    """Crop a uniformly random (h, w) window of the image.  As torchvision's
    on a PIL image: ``padding`` (an int, or 2 or 4 non-negative ints: left
    and right then top and bottom, or left, top, right, bottom) pads the
    image first, then ``pad_if_needed`` pads each side of a dimension
    smaller than the crop by the difference (width first, then height),
    with ``padding_mode`` ``"constant"`` (``fill``: a number, or one per
    channel, each truncated to an int as PIL takes it), ``"edge"``,
    ``"reflect"`` or ``"symmetric"``; an image still smaller than ``size``
    is an error."""

    MODES = ("constant", "edge", "reflect", "symmetric")

    def __init__(self, size: Any, padding: Any = None, pad_if_needed: bool = False, fill: Any = 0,
                 padding_mode: str = "constant"):
        self.size = _check_size(size)
        self.padding = _check_padding(padding)
        if not isinstance(pad_if_needed, bool):
            raise _bad("pad_if_needed", "a bool", pad_if_needed, TypeError)
        self.pad_if_needed = pad_if_needed
        self.fill, self.padding_mode = _check_fill(fill), _check_padding_mode(padding_mode)

    def __call__(self, img: Any) -> Any:
        if self.padding is not None or self.pad_if_needed:
            img = self._padded(img)
        (H, W), (h, w) = _hw(img), self.size
        if H < h or W < w:
            raise ValueError(f"Required crop size {(h, w)} is larger than input image size {(H, W)}")
        rng = _rng.current()
        top, left = rng.randint(0, H - h), rng.randint(0, W - w)
        return _crop(img, top, left, h, w)

    def _padded(self, img: Any) -> Any:
        """``img`` padded as torchvision pads it before drawing the crop:
        ``padding``, then the width, then the height where ``pad_if_needed``."""
        def pads(x):
            if self.padding is not None:
                x = _pad(x, self.padding, self.fill, self.padding_mode)
            h, w = self.size
            if self.pad_if_needed and x.shape[-1] < w:
                d = w - x.shape[-1]
                x = _pad(x, (d, 0, d, 0), self.fill, self.padding_mode)
            if self.pad_if_needed and x.shape[-2] < h:
                d = h - x.shape[-2]
                x = _pad(x, (0, d, 0, d), self.fill, self.padding_mode)
            return x
        return _on_planes(img, pads)

    def _params(self) -> dict[str, Any]:
        if self.padding is None and not self.pad_if_needed:
            return {"size": self.size}
        return {"size": self.size, "padding": self.padding, "pad_if_needed": self.pad_if_needed,
                "fill": self.fill, "padding_mode": self.padding_mode}


class Pad(Transform):
    """Pad the image by ``padding`` (an int, or 2 or 4 non-negative ints:
    left and right then top and bottom, or left, top, right, bottom) with
    ``padding_mode`` ``"constant"`` (``fill``: a number or one per channel,
    truncated to an int), ``"edge"``, ``"reflect"`` or ``"symmetric"``: as
    torchvision pads a PIL image."""

    def __init__(self, padding: Any, fill: Any = 0, padding_mode: str = "constant"):
        self.padding = _check_padding(padding)
        self.fill, self.padding_mode = _check_fill(fill), _check_padding_mode(padding_mode)

    def __call__(self, img: Any) -> Any:
        return _on_planes(img, lambda x: _pad(x, self.padding, self.fill, self.padding_mode))

    def _params(self) -> dict[str, Any]:
        return {"padding": self.padding, "fill": self.fill, "padding_mode": self.padding_mode}


def _on_planes(img: Any, fn: Callable) -> Any:
    """``fn`` of the (C, H, W) planes of ``img`` (a PIL image, whose result
    is made a PIL image of its mode, or a tensor)."""
    if not isinstance(img, Image.Image):
        return fn(img)
    x = np.asarray(img)
    x = fn(x[None] if x.ndim == 2 else x.transpose(2, 0, 1))
    a = np.ascontiguousarray(np.asarray(x).transpose(1, 2, 0))
    return Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a, img.mode)


def _check_fill(fill: Any) -> Any:
    """A padding's fill: an int, or a tuple of ints (each truncated, as PIL
    takes it), in 0..255."""
    vals = list(fill) if _is_seq(fill) else [fill]
    if not vals or not all(_is_num(v) and 0 <= int(v) <= 255 for v in vals):
        raise _bad("fill", "a number or a sequence of numbers in 0..255", fill)
    return tuple(int(v) for v in vals) if _is_seq(fill) else int(fill)


def _check_padding_mode(mode: Any) -> str:
    if mode not in RandomCrop.MODES:
        raise _bad("padding_mode", f"one of {RandomCrop.MODES}", mode)
    return mode


def _check_padding(padding: Any) -> tuple[int, int, int, int] | None:
    """None, or (left, top, right, bottom) of an int or 1, 2 or 4 non-negative ints."""
    if padding is None:
        return None
    vals = [padding] if _is_int(padding) else list(padding) if _is_seq(padding) else None
    if vals is None or len(vals) not in (1, 2, 4) or not all(_is_int(v) and v >= 0 for v in vals):
        raise _bad("padding", "a non-negative int or a sequence of 1, 2 or 4 of them", padding,
                   TypeError if vals is None else ValueError)
    vals = [int(v) for v in vals]
    if len(vals) == 1:
        return (vals[0],) * 4
    if len(vals) == 2:
        return vals[0], vals[1], vals[0], vals[1]
    return tuple(vals)


def _pad(x: Any, padding: tuple, fill: Any, mode: str) -> Any:
    """The (C, H, W) array or tensor ``x`` padded by (left, top, right,
    bottom) with ``mode``; ``constant``: each channel its ``fill`` value (or
    the one ``fill``).  numpy's edge, reflect and symmetric modes, as PIL's
    torchvision pads a PIL image."""
    left, top, right, bottom = padding
    tensor = isinstance(x, torch.Tensor)
    a = x.numpy() if tensor else x
    if mode == "constant":
        c = a.shape[0]
        vals = fill if isinstance(fill, tuple) else (fill,) * c
        if len(vals) == 1:
            vals = vals * c
        if len(vals) != c:
            raise ValueError(f"fill has {len(vals)} values for an image of {c} channels")
        out = np.empty((c, a.shape[1] + top + bottom, a.shape[2] + left + right), dtype=a.dtype)
        out[...] = np.array(vals, dtype=a.dtype).reshape(c, 1, 1)
        out[:, top:top + a.shape[1], left:left + a.shape[2]] = a
    else:
        out = np.pad(a, ((0, 0), (top, bottom), (left, right)), mode=mode)
    return torch.from_numpy(out) if tensor else out


class PILToTensor(Transform):
    """PIL image -> CHW tensor of the image's own dtype (uint8 for L/RGB/RGBA...)."""

    def __call__(self, pic: Any) -> torch.Tensor:
        if not isinstance(pic, Image.Image):
            raise _bad("pic", "a PIL Image", type(pic), TypeError)
        return _to_chw(pic)


class ToTensor(Transform):
    """PIL image or HWC ndarray -> CHW tensor; uint8 becomes float in [0, 1]
    (other dtypes are returned unscaled, as torchvision does): divided by
    255, as torchvision's ``ToTensor`` and v1 ``ConvertImageDtype`` do, or
    with ``reciprocal=True`` multiplied by 1/255, as v2's ``ToImage`` +
    ``ToDtype(scale=True)`` do (126 of the 256 values differ by an ulp)."""

    def __init__(self, *, reciprocal: bool = False):
        if not isinstance(reciprocal, bool):
            raise _bad("reciprocal", "a bool", reciprocal, TypeError)
        self.reciprocal = reciprocal

    def __call__(self, pic: Any) -> torch.Tensor:
        t = self.unscaled(pic)
        return self.scaled(t) if t.dtype == torch.uint8 else t

    def scaled(self, t: torch.Tensor) -> torch.Tensor:
        """The uint8 tensor ``t`` as floats in [0, 1], with this step's arithmetic."""
        x = t.to(torch.get_default_dtype())
        return x.mul_(1.0 / 255) if getattr(self, "reciprocal", False) else x.div_(255)

    def _params(self) -> dict[str, Any]:
        return {"reciprocal": True} if getattr(self, "reciprocal", False) else {}

    @staticmethod
    def unscaled(pic: Any) -> torch.Tensor:
        """The CHW tensor before the uint8 scaling (what the device split of
        ``coordl.device`` sends to the device, which then divides there)."""
        if isinstance(pic, np.ndarray) and pic.ndim not in (2, 3):
            raise _bad("pic.ndim", "2 or 3", pic.ndim)
        return _to_chw(pic)


class ToDtype(Transform):
    """Convert a tensor to ``dtype``; with ``scale``, integer images become
    floats in [0, 1] (divided by their dtype's maximum, 255 for uint8; with
    ``reciprocal=True`` multiplied by its reciprocal, as torchvision v2's
    ``ToDtype`` does).  Only the conversions that cannot lose values are
    offered: to a floating dtype, or to the tensor's own dtype."""

    def __init__(self, dtype: torch.dtype, scale: bool = False, *, reciprocal: bool = False):
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise _bad("dtype", "a floating torch.dtype", dtype, TypeError)
        if not isinstance(scale, bool):
            raise _bad("scale", "a bool", scale, TypeError)
        if not isinstance(reciprocal, bool):
            raise _bad("reciprocal", "a bool", reciprocal, TypeError)
        self.dtype, self.scale, self.reciprocal = dtype, scale, reciprocal

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise _bad("tensor", "a torch.Tensor", type(tensor), TypeError)
        if tensor.dtype == self.dtype:
            return tensor
        out = tensor.to(self.dtype)
        if self.scale and not tensor.is_floating_point() and tensor.dtype != torch.bool:
            top = torch.iinfo(tensor.dtype).max
            out = out.mul_(1.0 / top) if getattr(self, "reciprocal", False) else out.div_(top)
        return out

    def _params(self) -> dict[str, Any]:
        p = {"dtype": str(self.dtype), "scale": self.scale}
        return {**p, "reciprocal": True} if getattr(self, "reciprocal", False) else p


class Normalize(Transform):
    """``(x - mean) / std`` per channel on float tensors [..., C, H, W].

    ``broadcast=True`` subtracts out of place where ``inplace`` is false, as
    ``torchvision.transforms.v2.Normalize`` does: a one-channel image
    normalized by several means comes out with that many channels (v1's
    ``Normalize``, and the default, subtract in place and raise there)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], inplace: bool = False, *,
                 broadcast: bool = False):
        self.mean, self.std = _floats(mean, "mean"), _floats(std, "std")
        if not isinstance(inplace, bool):
            raise _bad("inplace", "a bool", inplace, TypeError)
        if not isinstance(broadcast, bool):
            raise _bad("broadcast", "a bool", broadcast, TypeError)
        self.inplace, self.broadcast = inplace, broadcast

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise _bad("tensor", "a torch.Tensor", type(tensor), TypeError)
        if not tensor.is_floating_point():
            raise TypeError(f"Input tensor should be a float tensor. Got {tensor.dtype}.")
        if tensor.ndim < 3:
            raise ValueError("Expected tensor to be a tensor image of size (..., C, H, W). "
                             f"Got tensor.size() = {tuple(tensor.shape)}")
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
        if (std == 0).any():
            raise ValueError(f"std evaluated to zero after conversion to {tensor.dtype}, "
                             "leading to division by zero.")
        if self.broadcast and not self.inplace:
            return tensor.sub(mean).div_(std)
        out = tensor if self.inplace else tensor.clone()
        return out.sub_(mean).div_(std)

    def _params(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "inplace": self.inplace,
                **({"broadcast": True} if self.broadcast else {})}


# --------------------------------------------------------------------------
# Fused decode: bytes -> tensor without PIL images in between.

_GEOMETRIC = (RandomResizedCrop, Resize, CenterCrop, RandomCrop, Pad, RandomHorizontalFlip, RandomVerticalFlip)


def _fusable(ts: list) -> bool:
    """[geometric ops]* + PILToTensor|ToTensor + [ToDtype|Normalize]*, coordl's own classes only."""
    i = 0
    while i < len(ts) and type(ts[i]) in _GEOMETRIC:
        if hasattr(ts[i], "interpolation") and any(m.value not in _TENSOR_MODES for m in modes_of(ts[i])):
            return False
        i += 1
    if i == len(ts) or type(ts[i]) not in (PILToTensor, ToTensor):
        return False
    return all(type(t) in (Normalize, ToDtype) for t in ts[i + 1:])


def decode_and_apply(transforms: list, raw) -> Any:
    """Run a fusable pipeline on encoded image bytes; NotImplemented if it isn't.

    Same random draws, in the same order, as decoding with PIL and calling the
    transforms, and the same pixels: a Resize or RandomResizedCrop that would
    run on the PIL image (bilinear or bicubic, antialiased) resamples with
    PIL's arithmetic (:func:`coordl.decode.resample.pil_resize`), after the
    crop that torchvision makes first; one that runs on a uint8 tensor
    (nearest, ``antialias=False``, or a step coordl.tvcompat marks as
    torchvision's tensor step) with torch's kernel, as torchvision does.
    RandomResizedCrop decodes only the rows and columns around its crop
    when it can (``decode_rgb_crop``), with the same pixels there as the
    whole decode.  With ``draft=True`` on the first step, a JPEG at least
    twice the output size is decoded at a reduced DCT scale and resampled
    from there (the box mapped exactly, in fractions of a decoded pixel).
    The result is a CHW tensor, as from PILToTensor/ToTensor.
    """
    if not _fusable(transforms):
        return NotImplemented
    from .decode import jpeg as _decode

    first, rest = transforms[0], transforms[1:]
    hw = _decode.jpeg_size(raw)
    if type(first) is RandomResizedCrop and hw is not None:
        H, W = hw
        box = _draw_box(H, W, first.scale, first.ratio, _rng.current())
        mode = modes_of(first)[first.draw_mode()]
        d = _decode.draft_scale(box[2:], first.size) if _drafts(first) else 1
        # only the rows and columns near the crop are decoded, where coordl.decode._jpegcrop is built
        arr, abox = _decode.decode_rgb_crop(raw, box, scale=d, size=hw)
        x = _resample(arr, abox, first.size, first, mode)
    elif type(first) is Resize and hw is not None and rest and type(rest[0]) in (CenterCrop, RandomCrop) and (
            x := _resize_window(first, rest[0], hw, raw)) is not None:
        rest = rest[1:]
    elif type(first) is Resize and hw is not None:
        out = first.output_size(*hw)
        d = _decode.draft_scale(hw, out) if _drafts(first) else 1
        arr, abox = _decode.decode_rgb_crop(raw, (0, 0, *hw), scale=d, size=hw) if d > 1 else (
            _decode.decode_rgb(raw), (0, 0, *hw))
        x = _resample(arr, abox, out, first)
    elif type(first) in (CenterCrop, RandomCrop) and hw is not None and (
            at := _crop_offsets(first, *hw)) is not None:
        # only the rows and columns near the crop are decoded, where coordl.decode._jpegcrop is built
        box = (*at, *first.size)
        arr, (top, left, h, w) = _decode.decode_rgb_crop(raw, box, scale=1, size=hw)
        x = torch.from_numpy(arr[top:top + h, left:left + w]).permute(2, 0, 1)
    else:
        x = torch.from_numpy(_decode.decode_rgb(raw)).permute(2, 0, 1)
        rest = transforms
    return _apply_to_planes(rest, x)


def apply_to_planes(transforms: list, x: torch.Tensor) -> Any:
    """Run a fusable pipeline on a decoded image's planes (a uint8
    ``(C, H, W)`` tensor, 3 planes for RGB as ``decode_and_apply`` holds the
    image after decoding it, 1 for a gray L image); NotImplemented if the
    pipeline isn't fusable.  The same draws and pixels as the pipeline
    called on the PIL image of those planes (``Image.fromarray``)."""
    if not _fusable(transforms):
        return NotImplemented
    return _apply_to_planes(transforms, x)


def _apply_to_planes(rest: list, x: torch.Tensor) -> Any:
    """The steps of a fusable pipeline after its decode (and the resize or
    crop the decode made), on the planes ``x``."""
    from .decode import jpeg as _decode

    flip = False  # a drawn flip not yet applied: it is folded into the conversion below when it can be
    for k, t in enumerate(rest):
        tt = type(t)
        if tt is RandomHorizontalFlip:
            if _rng.current().random() < t.p:  # the draw RandomHorizontalFlip makes, in its place
                flip = not flip
            continue
        if tt is RandomVerticalFlip:   # commutes with a pending mirror: applied now
            if _rng.current().random() < t.p:
                x = x.flip(-2)
            continue
        if tt is PILToTensor or tt is ToTensor:
            return _convert(x, rest[k:], flip, _decode._ext)
        if flip:  # a flip does not commute with the crops that may follow it
            x, flip = x.flip(-1), False
        if tt is RandomResizedCrop:
            box = t.get_params(x, t.scale, t.ratio)
            x = _resample(x.permute(1, 2, 0).numpy(), box, t.size, t, modes_of(t)[t.draw_mode()])
        elif tt is Resize:
            out = t.output_size(*x.shape[-2:])
            x = _resample(x.permute(1, 2, 0).numpy(), (0, 0, *x.shape[-2:]), out, t)
        else:
            x = t(x)
    raise AssertionError("a fusable pipeline has a tensor conversion")  # pragma: no cover


def _crop_offsets(crop: Any, H: int, W: int) -> tuple[int, int] | None:
    """(top, left) of a CenterCrop, or of a RandomCrop that pads nothing,
    inside an H x W image (a RandomCrop draws them here, as its call would:
    its only draws), or None where the crop pads or does not fit, before
    any draw (the step then runs on the whole image, as written)."""
    h, w = crop.size
    if h > H or w > W:
        return None
    if type(crop) is CenterCrop:
        return crop.offsets(H, W)
    if crop.padding is not None and any(crop.padding):   # (pad_if_needed pads nothing where the crop fits)
        return None
    rng = _rng.current()
    return rng.randint(0, H - h), rng.randint(0, W - w)


def _resize_window(resize: Resize, crop: Any, hw: tuple[int, int], raw) -> torch.Tensor | None:
    """``crop(resize(image))`` for a Resize that resamples as PIL does and a
    CenterCrop, or a RandomCrop that pads nothing, inside its output: only
    the cropped pixels are resampled, from only the rows and columns of the
    image they depend on (decoded alone where ``coordl.decode._jpegcrop`` is
    built), the same pixels as the whole resize then the crop.  None where
    that does not apply (a reduced decode, a resize on the tensor, a crop
    that pads, no extension), before a RandomCrop draws."""
    from .decode import jpeg as _decode
    from .decode import resample as _rs

    if resize._on_tensor or not _filtered(resize.interpolation, resize.antialias) or _drafts(resize):
        return None
    window = _rs.window_kernel()
    if window is None:
        return None
    oh, ow = resize.output_size(*hw)
    ch, cw = crop.size
    at = _crop_offsets(crop, oh, ow)
    if at is None:
        return None
    top, left = at

    def read(box):
        arr, abox = _decode.decode_rgb_crop(raw, box, scale=1, size=hw)
        return arr, box[0] - abox[0], box[1] - abox[1]

    y = window(hw, (oh, ow), (top, left, ch, cw), resize.interpolation.value, read)
    return torch.from_numpy(y).permute(2, 0, 1)


def _drafts(t: Any) -> bool:
    """The step asks for the reduced-scale decode and is a filtered resize."""
    return bool(getattr(t, "draft", False)) and all(_filtered(m, t.antialias) for m in modes_of(t))


def _resample(arr: np.ndarray, box: tuple, out: tuple[int, int], t: Any, mode: Any = None) -> torch.Tensor:
    """The CHW uint8 image ``t`` (a Resize or RandomResizedCrop) makes of the
    ``box`` = (top, left, h, w) of ``arr`` (HWC uint8): cropped, then resized
    to ``out`` (h, w) with ``mode`` (``t``'s one mode when None).  A box in
    fractions of a pixel (a reduced-scale decode) is resampled from the
    pixels it touches, as PIL's ``resize(box=...)`` maps it."""
    from .decode import resample as _rs

    mode = t.interpolation if mode is None else mode
    top, left, h, w = box
    oh, ow = out
    if all(isinstance(v, int) for v in box):
        crop = arr[top:top + h, left:left + w]
        if (h, w) == (oh, ow):
            return torch.from_numpy(crop).permute(2, 0, 1)
        if t._on_tensor or not _filtered(mode, t.antialias):
            return _resize_tensor(torch.from_numpy(crop).permute(2, 0, 1), oh, ow, mode, t.antialias,
                                  t._in_float)
        y = _rs.pil_resize(crop, out, mode.value)
        return torch.from_numpy(y).permute(2, 0, 1)
    # a reduced-scale decode (only for filtered resizes): the decoded pixels the box touches
    r0, c0 = int(top), int(left)
    r1, c1 = min(arr.shape[0], -int(-(top + h) // 1)), min(arr.shape[1], -int(-(left + w) // 1))
    crop = arr[r0:r1, c0:c1]
    pbox = (left - c0, top - r0, min(left + w - c0, c1 - c0), min(top + h - r0, r1 - r0))
    y = _rs.pil_resize(crop, out, mode.value, box=pbox)
    return torch.from_numpy(y).permute(2, 0, 1)


# (default dtype, channels, conversion steps) -> (channels, 256) float32 table, see _float_lut
_LUTS: dict = {}


def _lut_key(t: Any) -> tuple | None:
    tt = type(t)
    if tt is ToTensor:
        return ("ToTensor", getattr(t, "reciprocal", False))
    if tt is ToDtype:
        return ("ToDtype", t.dtype, t.scale, getattr(t, "reciprocal", False))
    if tt is Normalize:
        return ("Normalize", t.mean, t.std, t.inplace, getattr(t, "broadcast", False))
    return None


def _float_lut(steps: list, channels: int) -> torch.Tensor | None:
    """The values ``steps`` (``ToTensor`` then ``ToDtype``/``Normalize``)
    give each uint8 value of each channel, as a (channels, 256) float32
    table, or None (a ``PILToTensor`` first, or a result that is not
    float32).  The table is made by running the very same steps on a
    (channels, 1, 256) image of all uint8 values: every step is elementwise,
    so a pixel's value is its table entry, bit for bit."""
    key = (torch.get_default_dtype(), channels, tuple(_lut_key(t) for t in steps))
    try:
        lut = _LUTS.get(key, False)
    except TypeError:  # parameters changed after construction into something unhashable (a list)
        return None
    if lut is not False:
        return lut
    lut = None
    if type(steps[0]) is ToTensor:
        x = steps[0].scaled(torch.arange(256, dtype=torch.uint8).expand(channels, 1, 256).contiguous())
        try:
            for t in steps[1:]:
                x = t(x)
        except RuntimeError:    # (v1's Normalize of one channel by three means): raised on the image itself
            x = None
        if x is not None and x.dtype == torch.float32 and x.shape == (channels, 1, 256):
            lut = x.reshape(channels, 256).contiguous()
    if len(_LUTS) < 64:
        _LUTS[key] = lut
    return lut


def _convert(x: torch.Tensor, steps: list, flip: bool, ext: Any) -> torch.Tensor:
    """The uint8 CHW image ``x`` (mirrored first when ``flip``) through
    ``steps``: ``PILToTensor``/``ToTensor`` and the ``ToDtype``/``Normalize``
    after it.  A float32 result is made in one pass through a table
    (``coordl.decode._jpegcrop.to_float``, where it is built), with the values the
    steps one by one give."""
    if ext is not None and x.dtype == torch.uint8 and x.ndim == 3 and type(steps[0]) is ToTensor:
        to_float = getattr(ext, "to_float", None)  # None: an extension built before it existed
        lut = _float_lut(steps, x.shape[0]) if to_float is not None else None
        if lut is not None:
            out = torch.empty(x.shape, dtype=torch.float32)
            to_float(x.numpy(), lut.numpy(), out.numpy(), flip)
            return out
    if flip:
        x = x.flip(-1)
    if type(steps[0]) is PILToTensor:
        x = x.contiguous()
    else:
        x = steps[0].scaled(x).contiguous()
    for t in steps[1:]:
        x = t(x)
    return x

