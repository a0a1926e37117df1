"""Image decoding for the prep stage: JPEG through libjpeg-turbo (simplejpeg)
straight into a numpy array, at the smallest DCT scale that still covers the
size the pipeline needs; anything else through PIL.

Measured on this machine while building the path (docs/benchmarks.md): simplejpeg
decodes a ~500x375 JPEG ~12% faster than PIL and hands back a writable array
without PIL's extra copy; with the resize done by torch's uint8 antialiased
kernel the whole RandomResizedCrop path is ~1.7x faster than PIL's.

The fast path keeps PIL's rules, read at call time as PIL reads them:
``PIL.Image.MAX_IMAGE_PIXELS`` is checked from the JPEG header before any
pixel is decoded (more pixels warn ``DecompressionBombWarning``, more than
twice as many raise ``DecompressionBombError``, None disables the check), and
a file libjpeg-turbo refuses (truncated, corrupt, an unsupported colour space)
is handed to PIL, which decodes it as torchvision would, honouring
``PIL.ImageFile.LOAD_TRUNCATED_IMAGES``, or raises its own error.
"""
from __future__ import annotations

import io
import math
import warnings

import numpy as np
from PIL import Image

try:  # a hard dependency in setup.cfg; PIL remains the fallback
    import simplejpeg as _sj
except ImportError:  # pragma: no cover
    _sj = None

__all__ = ["is_jpeg", "jpeg_size", "check_pixels", "decode_rgb", "pil_rgb"]


def is_jpeg(raw) -> bool:
    return len(raw) > 3 and raw[0] == 0xFF and raw[1] == 0xD8


def jpeg_size(raw) -> tuple[int, int] | None:
    """(height, width) from a JPEG header, or None if it can't be read cheaply."""
    if _sj is None or not is_jpeg(raw):
        return None
    try:
        h, w, _, _ = _sj.decode_jpeg_header(raw)
    except ValueError:
        return None
    return h, w


def check_pixels(size: tuple[int, int]) -> None:
    """Apply ``PIL.Image.MAX_IMAGE_PIXELS`` to an image of ``size`` (h, w), as
    ``PIL.Image.open`` does: above it warn ``DecompressionBombWarning``, above
    twice it raise ``DecompressionBombError``; None disables the check."""
    limit = Image.MAX_IMAGE_PIXELS
    if limit is None:
        return
    H, W = size
    pixels = max(1, H) * max(1, W)
    if pixels > 2 * limit:
        raise Image.DecompressionBombError(
            f"Image size ({pixels} pixels, {W}x{H}) exceeds twice PIL.Image.MAX_IMAGE_PIXELS "
            f"({limit} pixels): refused before decoding, as a possible decompression bomb. "
            "Raise or disable (None) PIL.Image.MAX_IMAGE_PIXELS if the image is trusted.")
    if pixels > limit:
        warnings.warn(
            f"Image size ({pixels} pixels, {W}x{H}) exceeds PIL.Image.MAX_IMAGE_PIXELS "
            f"({limit} pixels), could be a decompression bomb.", Image.DecompressionBombWarning)


def _pow2_scale(size: tuple[int, int], min_hw: tuple[float, float]) -> int:
    """Largest d in (1, 2, 4, 8) with the image at 1/d still >= ``min_hw``.

    Only power-of-two DCT scales: libjpeg-turbo's other M/8 scales have no
    SIMD IDCT and measured slower here than a full-size decode.
    """
    H, W = size
    d = 1
    while d < 8 and -(-H // (2 * d)) >= min_hw[0] and -(-W // (2 * d)) >= min_hw[1]:
        d *= 2
    return d


def pil_rgb(raw) -> Image.Image:
    """PIL decode + RGB conversion, fully loaded (truncated files raise here)."""
    img = Image.open(io.BytesIO(raw))
    img.draft("RGB", img.size)
    img = img.convert("RGB")
    return img


def decode_rgb(raw, min_hw: tuple[int, int] | None = None) -> np.ndarray:
    """Decode to an RGB uint8 HWC array (writable, C-contiguous).

    ``min_hw``: the decoded image may be smaller than the original, by a DCT
    scale of 1/2, 1/4 or 1/8, as long as it stays at least this (h, w).
    (PIL's ``draft`` picks among the same power-of-two scales.)
    """
    size = jpeg_size(raw)
    if size is not None:  # else PIL reads the file, and its header, itself
        check_pixels(size)  # before a single pixel is allocated
        kw = {}
        if min_hw is not None:
            d = _pow2_scale(size, min_hw)
            if d > 1:
                H, W = size
                kw = {"min_height": -(-H // d), "min_width": -(-W // d)}
        try:
            return _sj.decode_jpeg(raw, colorspace="RGB", **kw)
        except ValueError:
            pass  # PIL decides: truncated files under LOAD_TRUNCATED_IMAGES, CMYK, or its own error
    img = Image.open(io.BytesIO(raw))  # applies MAX_IMAGE_PIXELS itself
    if min_hw is not None and img.format == "JPEG":
        W, H = img.size
        img.draft("RGB", (max(1, int(math.ceil(min_hw[1]))), max(1, int(math.ceil(min_hw[0])))))
    img = img.convert("RGB")
    return np.array(img)
