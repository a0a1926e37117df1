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
a file libjpeg-turbo refuses or whose header it cannot parse (truncated,
corrupt, a sampling layout such as 4:4:1) and every CMYK/YCCK JPEG (which
PIL converts to RGB its own way) is handed to PIL, which decodes it as torchvision would, honouring
``PIL.ImageFile.LOAD_TRUNCATED_IMAGES``, or raises its own error.

:func:`decode_rgb_crop` decodes only a crop window, through coordl's own C
extension ``coordl.decode._jpegcrop`` over the system libjpeg-turbo (built by
``pip install`` when a compiler and the libjpeg headers are there; optional).
Its pixels are the same as the whole-image decode's, sliced.  Without the
extension, with ``COORDL_CROP_DECODE=0`` in the environment when coordl is
imported, or for any file it declines (CMYK, unusual chroma sampling, a
libjpeg warning or error, no end-of-image marker), the whole image is
decoded by :func:`decode_rgb` exactly as before.
"""
from __future__ import annotations

import io
import logging
import math
import os
import warnings

import numpy as np
from PIL import Image

try:  # a hard dependency in setup.cfg; PIL remains the fallback
    import simplejpeg as _sj
except ImportError:  # pragma: no cover
    _sj = None


def _load_ext():
    try:
        from . import _jpegcrop
    except ImportError as e:  # not built here (no compiler or libjpeg headers at install)
        logging.getLogger(__name__).debug(
            "coordl.decode._jpegcrop is not available (%s): RandomResizedCrop decodes whole JPEGs", e)
        return None
    return _jpegcrop


# coordl.decode._jpegcrop as built, or None: its to_float (the fused path's uint8 -> float table pass)
_ext = _load_ext()


def _load_crop():
    if os.environ.get("COORDL_CROP_DECODE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return _ext


# coordl.decode._jpegcrop, or None: whole-image decodes only (tests set it to None)
_crop = _load_crop()

# rows/columns decoded beyond each side of a crop window: libjpeg's fancy
# chroma upsampling treats the edge of what it decodes as the image edge, so
# the outermost decoded pixel can differ from the whole-image decode (1 is
# enough on every layout measured; 2 for headroom)
_CROP_MARGIN = 2

__all__ = ["is_jpeg", "jpeg_size", "check_pixels", "decode_rgb", "decode_rgb_crop", "pil_rgb",
           "scaled_box"]


def is_jpeg(raw) -> bool:
    return len(raw) > 3 and raw[0] == 0xFF and raw[1] == 0xD8


# JPEG colour spaces whose libjpeg-turbo decode (simplejpeg) gives PIL's
# pixels exactly (measured: YCbCr at every sampling simplejpeg names, RGB,
# grey).  CMYK and YCCK (Adobe) are converted to RGB differently by PIL
# (1 off in most values), so they are decoded by PIL.
_FAST_COLORSPACES = frozenset({"YCbCr", "RGB", "Gray"})


def _header(raw):
    """simplejpeg's (height, width, colorspace, subsampling) of a JPEG header,
    or None for anything it cannot parse (not a JPEG, a corrupt header, a
    layout it has no name for, such as 4:4:1, which raises KeyError inside
    simplejpeg): PIL then reads the file, and raises its own error."""
    if _sj is None or not is_jpeg(raw):
        return None
    try:
        return _sj.decode_jpeg_header(raw)
    except Exception:  # noqa: BLE001 - any failure here means "PIL decides"
        return None


def jpeg_size(raw) -> tuple[int, int] | None:
    """(height, width) from a JPEG header, or None if it can't be read cheaply."""
    hdr = _header(raw)
    return None if hdr is None else (hdr[0], hdr[1])


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
    hdr = _header(raw)
    if hdr is not None:  # else PIL reads the file, and its header, itself
        check_pixels(hdr[:2])  # before a single pixel is allocated
    return _decode_whole(raw, hdr, min_hw)


def _decode_whole(raw, hdr, min_hw) -> np.ndarray:
    """decode_rgb after its pixel-limit check (``hdr``: :func:`_header`'s, or None).

    libjpeg-turbo (simplejpeg) decodes the JPEGs whose pixels it gives as PIL
    does; everything else, and anything it fails on for any reason, is
    decoded by PIL, which raises its own error (an ``OSError`` such as
    ``UnidentifiedImageError`` for a file it cannot read)."""
    if hdr is not None and hdr[2] in _FAST_COLORSPACES:
        kw = {}
        if min_hw is not None:
            size = hdr[:2]
            d = _pow2_scale(size, min_hw)
            if d > 1:
                H, W = size
                kw = {"min_height": -(-H // d), "min_width": -(-W // d)}
        try:
            return _sj.decode_jpeg(raw, colorspace="RGB", **kw)
        except Exception:  # noqa: BLE001 - PIL decides: truncated files under LOAD_TRUNCATED_IMAGES, or its own error
            pass
    img = Image.open(io.BytesIO(raw))  # applies MAX_IMAGE_PIXELS itself
    if min_hw is not None and img.format == "JPEG":
        W, H = img.size
        img.draft("RGB", (max(1, int(math.ceil(min_hw[1]))), max(1, int(math.ceil(min_hw[0])))))
    img = img.convert("RGB")
    return np.array(img)


def scaled_box(top: int, left: int, h: int, w: int, fy: float, fx: float, H2: int, W2: int
               ) -> tuple[int, int, int, int]:
    """The box (top, left, h, w) of an image, mapped onto that image scaled by
    (fy, fx) to H2 x W2: rounded, at least 1 pixel, inside the scaled image."""
    t, l = int(round(top * fy)), int(round(left * fx))
    hh, ww = max(1, int(round(h * fy))), max(1, int(round(w * fx)))
    t, l = min(t, H2 - hh), min(l, W2 - ww)
    return max(t, 0), max(l, 0), min(hh, H2), min(ww, W2)


def _ends_with_eoi(raw) -> bool:
    """The file ends with the end-of-image marker: a crop decode never reads
    past its window, so a file cut short must be seen here to be handed to the
    whole-image path (and PIL's truncation rules) as before."""
    return len(raw) >= 4 and raw[-2] == 0xFF and raw[-1] == 0xD9


def decode_rgb_crop(raw, box: tuple[int, int, int, int], min_hw: tuple[float, float] | None = None,
                    size: tuple[int, int] | None = None) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """Decode what is needed of ``box`` = (top, left, h, w), a box of the full-size
    image, as ``decode_rgb(raw, min_hw)`` would, then slice: (array, box in it).

    The array is RGB uint8 HWC; the returned box, in the array's coordinates,
    is ``box`` mapped onto the decoded size (:func:`scaled_box`) when the
    decode used a DCT scale.  With ``coordl.decode._jpegcrop`` only rows and columns
    near the box are decoded (their pixels are the whole decode's); otherwise
    the array is the whole image from :func:`decode_rgb`.  ``size``: the
    header's (h, w), i.e. ``jpeg_size(raw)``, when the caller has read it.
    """
    if size is None:
        size = jpeg_size(raw)
    if size is not None:
        check_pixels(size)  # before a single pixel is allocated, on either path
    if size is not None and _crop is not None and _ends_with_eoi(raw):
        H, W = size
        d = 1 if min_hw is None else _pow2_scale(size, min_hw)
        H2, W2 = -(-H // d), -(-W // d)
        t, l, h, w = box if d == 1 else scaled_box(*box, H2 / H, W2 / W, H2, W2)
        m = _CROP_MARGIN
        t0, l0 = max(0, t - m), max(0, l - m)
        t1, l1 = min(H2, t + h + m), min(W2, l + w + m)
        try:
            buf, rows, cols, y0, x0, oh, ow = _crop.decode(raw, d, t0, l0, t1 - t0, l1 - l0)
        except ValueError:
            pass  # the whole-image path decides, exactly as before
        else:
            if (oh, ow) == (H2, W2):
                arr = np.frombuffer(buf, np.uint8).reshape(rows, cols, 3)
                return arr, (t - y0, l - x0, h, w)
    arr = _decode_whole(raw, _header(raw) if size is not None else None, min_hw)
    H2, W2 = arr.shape[:2]
    if size is not None and (H2, W2) != size:
        H, W = size
        box = scaled_box(*box, H2 / H, W2 / W, H2, W2)
    return arr, box
