"""torchvision.io's ``decode_image`` for the tests, where it decodes.

The torchvision wheel beside torch's CPU build loads without its image
extension (tests/_torchvision.py), so its ``decode_image`` raises there.
:func:`standin_decode_image` keeps that function's contract (the file's
own channels under ``ImageReadMode.UNCHANGED``, ``RGB`` or ``GRAY`` when
asked; a ``RuntimeError`` for what it cannot decode), computed with PIL,
whose JPEG pixels are libjpeg-turbo's as torchvision's are, and carries
its module and name, by which coordl recognizes the loader.  It is not
picklable by reference: fork workers only.  :func:`decoders` gives the
real function where it decodes and the stand-in everywhere.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
import torch
from PIL import Image


def standin_decode_image(input, mode=None, apply_exif_orientation=False):
    if isinstance(input, torch.Tensor):
        data = bytes(input.numpy())
    else:
        with open(input, "rb") as f:
            data = f.read()
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as e:  # noqa: BLE001 - torchvision's decoders raise RuntimeError
        raise RuntimeError(f"decode_image: {type(e).__name__}: {e}") from None
    name = "UNCHANGED" if mode is None else str(getattr(mode, "name", mode)).upper()
    if name == "RGB":
        img = img.convert("RGB")
    elif name == "GRAY":
        img = img.convert("L")
    elif img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    elif img.mode not in ("L", "RGB", "RGBA", "CMYK"):
        img = img.convert("RGB")
    a = np.asarray(img)
    if a.ndim == 2:
        a = a[:, :, None]
    return torch.from_numpy(a.copy()).permute(2, 0, 1)


standin_decode_image.__module__ = "torchvision.io.image"
standin_decode_image.__name__ = standin_decode_image.__qualname__ = "decode_image"


def real_decodes(tv) -> bool:
    """Whether torchvision's own ``decode_image`` decodes here."""
    from torchvision.io import decode_image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "JPEG")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # torchvision 0.29's deprecation of its decoders
            decode_image(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    except RuntimeError:
        return False
    return True
