"""torchvision.io's ``decode_image``/``read_image`` as a folder's loader.

``ImageFolder(root, transform, loader=torchvision.io.decode_image)`` is how
torchvision's v2 transforms are fed tensors rather than PIL images: the
loader reads the file and decodes it to a uint8 ``(C, H, W)`` tensor, its
channels the file's (``mode=ImageReadMode.UNCHANGED``, the default: 1 for a
grey JPEG, 4 for a CMYK one or a PNG with alpha) or those asked for
(``mode=ImageReadMode.RGB`` through ``functools.partial``).

:class:`TorchvisionDecode` is that loader as a function of the file's bytes.
:meth:`TorchvisionDecode.fusable` tells the JPEGs that coordl's own decode
(libjpeg-turbo, whole or only the rows and columns of a crop) gives the
same RGB planes: three colour components (or grey where RGB is asked for),
ending with the end-of-image marker (a file cut short gets torchvision's
own error), within PIL's pixel limit (which coordl's decode applies and
torchvision's does not), and only where the two decoders agree on the probe
images of every layout, checked once per process (:func:`agrees`).  Every
other file is decoded by torchvision's function itself.
"""
from __future__ import annotations

import functools
import logging
import sys
import warnings
from typing import Any

import numpy as np
import torch
from PIL import Image

log = logging.getLogger(__name__)

__all__ = ["TorchvisionDecode", "torchvision_loader", "agrees"]

_MODULES = ("torchvision.io.image", "torchvision.io")
_NAMES = ("decode_image", "read_image")
_KEYWORDS = frozenset({"mode", "apply_exif_orientation"})
_AGREES: dict = {}          # id(decode function) -> (the function, whether coordl's decode gives its pixels)
_UNREAD = object()          # a header not read yet (None is a header that could not be read)


def torchvision_loader(loader: Any) -> "TorchvisionDecode | None":
    """:class:`TorchvisionDecode` of a folder's ``loader`` when it is
    torchvision.io's ``decode_image`` or ``read_image``, or a
    ``functools.partial`` of one with its ``mode`` and
    ``apply_exif_orientation`` given by keyword; else None.  Recognized by
    the function's module and name (coordl never imports torchvision)."""
    fn, kw = loader, {}
    if isinstance(loader, functools.partial):
        if loader.args or not set(loader.keywords) <= _KEYWORDS:
            return None
        fn, kw = loader.func, dict(loader.keywords)
    if getattr(fn, "__module__", None) not in _MODULES or getattr(fn, "__name__", None) not in _NAMES:
        return None
    decode = fn if fn.__name__ == "decode_image" else getattr(sys.modules.get(fn.__module__), "decode_image", None)
    if not callable(decode):
        return None
    return TorchvisionDecode(decode, kw.get("mode"), kw.get("apply_exif_orientation", False), fn.__name__)


class TorchvisionDecode:
    """torchvision.io's ``decode_image`` of a file's bytes, with the mode
    and EXIF handling of the folder's loader: what ``loader(path)`` returns
    for the file holding ``raw``.  Picklable (torchvision's function by
    name)."""

    def __init__(self, decode: Any, mode: Any = None, exif: Any = False, via: str = "decode_image") -> None:
        self.decode = decode        # torchvision.io's decode_image
        self.mode = mode            # as the loader gives it (None: torchvision's default, UNCHANGED)
        self.exif = exif
        self.via = via              # the loader's name

    def __call__(self, raw) -> Any:
        data = torch.frombuffer(raw if isinstance(raw, bytearray) else bytearray(raw), dtype=torch.uint8) \
            if len(raw) else torch.empty(0, dtype=torch.uint8)
        kw: dict = {}
        if self.mode is not None:
            kw["mode"] = self.mode
        if self.exif is not False:
            kw["apply_exif_orientation"] = self.exif
        return self.decode(data, **kw)

    @property
    def mode_name(self) -> str:
        """The mode's name: ``"UNCHANGED"``, ``"RGB"``, ``"GRAY"``..."""
        if self.mode is None:
            return "UNCHANGED"
        return str(getattr(self.mode, "name", self.mode)).upper()

    def fused_decode(self) -> bool:
        """Whether any file is decoded by coordl rather than by torchvision:
        the mode is UNCHANGED or RGB, no EXIF orientation is applied, and the
        two decoders agree here (:func:`agrees`)."""
        return self.mode_name in ("UNCHANGED", "RGB") and self.exif is False and agrees(self.decode)

    def fusable(self, raw, hdr: Any = _UNREAD) -> bool:
        """Whether coordl's decode of ``raw`` gives torchvision's uint8
        RGB planes for it (see the module docstring).  ``hdr``: its
        ``coordl.decode.jpeg._header``, where the caller has read it."""
        from . import jpeg

        if hdr is _UNREAD:
            hdr = jpeg._header(raw)
        if hdr is None or not jpeg._ends_with_eoi(raw):
            return False
        space = hdr[2]
        if space not in ("YCbCr", "RGB") and not (space == "Gray" and self.mode_name == "RGB"):
            return False
        limit = Image.MAX_IMAGE_PIXELS
        if limit is not None and hdr[0] * hdr[1] > limit:
            return False
        return self.fused_decode()

    def describe(self) -> str:
        """The loader in words, for ``path_reason``."""
        args = [f"mode={self.mode_name}"] if self.mode is not None else []
        if self.exif is not False:
            args.append(f"apply_exif_orientation={self.exif!r}")
        return f"torchvision.io.{self.via}" + (f"({', '.join(args)})" if args else "")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


def agrees(decode: Any) -> bool:
    """Whether coordl's JPEG decode (whole, and around a crop window) gives
    ``decode``'s (torchvision.io's ``decode_image``) RGB pixels exactly on
    the probe JPEGs of every layout (4:2:0, 4:2:2, 4:4:4, grey).  Checked
    once per process and function; any failure of ``decode`` (a torchvision
    whose image extension does not load) is a no, so that every file goes
    to ``decode`` and gets its own result or error."""
    got = _AGREES.get(id(decode))
    if got is not None and got[0] is decode:
        return got[1]
    ok = _check(decode)
    _AGREES[id(decode)] = (decode, ok)
    return ok


def _check(decode: Any) -> bool:
    from . import jpeg

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # torchvision's (a deprecation in 0.29): the probes are coordl's, not the user's
        return _compare(decode, jpeg)


def _compare(decode: Any, jpeg: Any) -> bool:
    try:
        rgb = sys.modules[decode.__module__].ImageReadMode.RGB
        for raw in jpeg._probe_jpegs():
            ref = decode(torch.frombuffer(bytearray(raw), dtype=torch.uint8), mode=rgb).permute(1, 2, 0).numpy()
            if not np.array_equal(jpeg.decode_rgb(raw), ref):
                raise ValueError("the whole image differs")
            H, W = ref.shape[:2]
            for box in ((0, 0, H, W), (5, 9, 20, 30), (H - 7, W - 13, 7, 13)):
                arr, (t, l, h, w) = jpeg.decode_rgb_crop(raw, box)
                if not np.array_equal(arr[t:t + h, l:l + w], ref[box[0]:box[0] + box[2], box[1]:box[1] + box[3]]):
                    raise ValueError(f"the window {box} differs")
    except Exception as e:  # noqa: BLE001 - any failure: torchvision decodes every file
        log.info("coordl's JPEG decode is not used for %s here (%s: %s): it decodes every file",
                 getattr(decode, "__qualname__", decode), type(e).__name__, e)
        return False
    return True
