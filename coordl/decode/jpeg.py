"""Image decoding for the prep stage: JPEG through libjpeg-turbo (simplejpeg)
straight into a numpy array, at full size, or, when the caller asks for it
(the ``draft`` option of the fused transforms), at a reduced DCT scale of
1/2, 1/4 or 1/8; anything else through PIL.

Measured on the development machine while building the path: simplejpeg
decodes a ~500x375 JPEG ~12% faster than PIL and hands back a writable array
without PIL's extra copy.

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

Geometry at a reduced scale: libjpeg's 1/d decode maps each d x d block of
the image onto one pixel, so pixel ``i`` of the scaled image covers
``[i * d, (i + 1) * d)`` of the original, and a side of ``n`` pixels becomes
``ceil(n / d)`` pixels whose last one, when ``d`` does not divide ``n``,
covers only ``n / d - floor(n / d)`` of a pixel of real image.  A box of the
original therefore maps onto the box divided by ``d`` exactly (in
fractions of a pixel, :func:`decode_rgb_crop`), never onto the whole scaled
image stretched.
"""
from __future__ import annotations

import io
import logging
import os
import warnings

import numpy as np
from PIL import Image

from . import extensions

try:  # a hard dependency in setup.cfg; PIL remains the fallback
    import simplejpeg as _sj
except ImportError:  # pragma: no cover
    _sj = None

log = logging.getLogger(__name__)

# coordl.decode._jpegcrop as built, or None: its to_float (the fused path's uint8 -> float table pass)
_ext = extensions.load("_jpegcrop", log, "RandomResizedCrop decodes whole JPEGs")


# rows/columns decoded beyond each side of a crop window: libjpeg's fancy
# chroma upsampling treats the edge of what it decodes as the image edge, so
# the outermost decoded pixel can differ from the whole-image decode (1 is
# enough on every layout measured; 2 for headroom)
_CROP_MARGIN = 2


def _probe_jpegs() -> list:
    """Small JPEGs of the usual layouts (4:2:0, 4:2:2, 4:4:4, grey), noisy,
    sides not multiples of 8, encoded by PIL."""
    rng = np.random.default_rng(8)
    out = []
    for sub, mode in ((2, "RGB"), (1, "RGB"), (0, "RGB"), (2, "L")):
        img = Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)).convert(mode)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=85, subsampling=sub)
        out.append(buf.getvalue())
    return out


def _pil_pixels(raw) -> np.ndarray:
    with Image.open(io.BytesIO(raw)) as img:
        return np.asarray(img.convert("RGB"))


def _fast_agrees() -> bool:
    """simplejpeg decodes the probe JPEGs to PIL's pixels exactly (both are
    libjpeg-turbo, same settings: measured identical).  Checked once at
    import; where it fails, every JPEG is decoded by PIL."""
    if _sj is None:
        return False
    try:
        return all(np.array_equal(_sj.decode_jpeg(r, colorspace="RGB"), _pil_pixels(r)) for r in _probe_jpegs())
    except Exception:  # noqa: BLE001 - any failure: PIL decodes
        return False


def _load_crop():
    if os.environ.get("COORDL_CROP_DECODE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if _ext is None:
        return None
    # the window decoder runs the system libjpeg: its pixels must be PIL's (checked once, at import)
    try:
        for raw in _probe_jpegs():
            ref = _pil_pixels(raw)
            for t, l, h, w in ((0, 0, 37, 53), (5, 9, 20, 30), (30, 40, 7, 13)):
                m = _CROP_MARGIN  # decoded around the window, as decode_rgb_crop does
                t0, l0 = max(0, t - m), max(0, l - m)
                buf, rows, cols, y0, x0, _, _ = _ext.decode(raw, 1, t0, l0, min(37, t + h + m) - t0,
                                                            min(53, l + w + m) - l0)
                got = np.frombuffer(buf, np.uint8).reshape(rows, cols, 3)[t - y0:t - y0 + h, l - x0:l - x0 + w]
                if not np.array_equal(got, ref[t:t + h, l:l + w]):
                    raise ValueError(f"window ({t}, {l}, {h}, {w}) differs from PIL's decode")
    except ValueError as e:
        log.warning("coordl.decode._jpegcrop does not decode as PIL does here (%s): JPEGs are decoded whole", e)
        return None
    return _ext


# simplejpeg gives PIL's pixels here (else PIL decodes every JPEG)
_FAST_OK = _fast_agrees()

# coordl.decode._jpegcrop, or None: whole-image decodes only (tests set it to None)
_crop = _load_crop()


__all__ = ["is_jpeg", "jpeg_size", "check_pixels", "decode_rgb", "decode_rgb_crop", "pil_rgb",
           "draft_scale"]


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


def draft_scale(extent: tuple[float, float], out: tuple[int, int]) -> int:
    """The DCT scale denominator for a region of ``extent`` (h, w) pixels
    resized to ``out`` (h, w): the largest d in (1, 2, 4, 8) with the region
    at 1/d still at least ``out`` on both axes (so 1 unless the region is at
    least twice the output).

    Only power-of-two DCT scales: libjpeg-turbo's other M/8 scales have no
    SIMD IDCT and measured slower here than a full-size decode.
    """
    d = 1
    while d < 8 and extent[0] >= 2 * d * out[0] and extent[1] >= 2 * d * out[1]:
        d *= 2
    return d


def pil_rgb(raw) -> Image.Image:
    """PIL decode + RGB conversion, fully loaded (truncated files raise here)."""
    img = Image.open(io.BytesIO(raw))
    img.draft("RGB", img.size)
    img = img.convert("RGB")
    return img


def decode_rgb(raw, scale: int = 1) -> np.ndarray:
    """Decode to an RGB uint8 HWC array (writable, C-contiguous).

    ``scale``: a DCT scale denominator (1, 2, 4 or 8): a JPEG of h x w comes
    out ``ceil(h / scale)`` x ``ceil(w / scale)`` (libjpeg's 1/scale decode,
    PIL's ``draft`` for the files PIL decodes); other formats at full size.
    """
    hdr = _header(raw)
    if hdr is not None:  # else PIL reads the file, and its header, itself
        check_pixels(hdr[:2])  # before a single pixel is allocated
    return _decode_whole(raw, hdr, scale)


def _decode_whole(raw, hdr, scale) -> np.ndarray:
    """decode_rgb after its pixel-limit check (``hdr``: :func:`_header`'s, or None).

    libjpeg-turbo (simplejpeg) decodes the JPEGs whose pixels it gives as PIL
    does; everything else, and anything it fails on for any reason, is
    decoded by PIL, which raises its own error (an ``OSError`` such as
    ``UnidentifiedImageError`` for a file it cannot read)."""
    if hdr is not None and hdr[2] in _FAST_COLORSPACES and _FAST_OK:
        kw = {}
        if scale > 1:  # simplejpeg picks the smallest scale that is at least this: exactly 1/scale
            H, W = hdr[:2]
            kw = {"min_height": -(-H // scale), "min_width": -(-W // scale)}
        try:
            return _sj.decode_jpeg(raw, colorspace="RGB", **kw)
        except Exception:  # noqa: BLE001 - PIL decides: truncated files under LOAD_TRUNCATED_IMAGES, or its own error
            pass
    img = Image.open(io.BytesIO(raw))  # applies MAX_IMAGE_PIXELS itself
    if scale > 1 and img.format == "JPEG":
        W, H = img.size  # PIL picks the largest scale s with W // s and H // s at least the size asked
        img.draft("RGB", (max(1, W // scale), max(1, H // scale)))
    img = img.convert("RGB")
    return np.array(img)


def _ends_with_eoi(raw) -> bool:
    """The file ends with the end-of-image marker: a crop decode never reads
    past its window, so a file cut short must be seen here to be handed to the
    whole-image path (and PIL's truncation rules) as before."""
    return len(raw) >= 4 and raw[-2] == 0xFF and raw[-1] == 0xD9


def entropy_data_complete(raw, height: int, width: int) -> bool:
    """libjpeg-turbo reads the whole of the file's entropy-coded data
    without an error or a corrupt-data warning (data that ends early, a bad
    Huffman code, a stray marker).  It makes no pixels but one row at 1/8
    scale: the rows above are skipped (Huffman decoding alone, about 70% of
    a whole decode's CPU).  False also for what libjpeg-turbo's window
    decoder does not take (CMYK, unusual sampling): the CPU path then
    decides.  A GPU decoder given such data leaves the pixels it could not
    decode as they were in memory, where libjpeg fills them gray."""
    if _ext is not None:
        rows = -(-int(height) // 8)
        try:
            _ext.decode(raw, 8, rows - 1, 0, 1, 1)
        except Exception:  # noqa: BLE001 - libjpeg's error or anything else: the CPU path decides, with its errors
            return False
        return True
    if _sj is not None:
        try:
            _sj.decode_jpeg(raw, colorspace="RGB", min_height=-(-int(height) // 8),
                            min_width=-(-int(width) // 8))
        except Exception:  # noqa: BLE001 - simplejpeg raises on libjpeg's corrupt-data warnings too
            return False
        return True
    return False


def decode_rgb_crop(raw, box: tuple[int, int, int, int], scale: int = 1,
                    size: tuple[int, int] | None = None) -> tuple[np.ndarray, tuple]:
    """Decode what is needed of ``box`` = (top, left, h, w), a box of the full-size
    image: ``(array, box in it)``.

    At full size (``scale`` 1, or a file decoded at full size whatever
    ``scale``: not a JPEG) the box in the array is ints, and
    ``array[top:top + h, left:left + w]`` is the whole decode's crop.  At 1/d
    (``scale`` d, a JPEG) it is ``box / d`` in the array's coordinates, in
    floats (a fraction of a decoded pixel where d does not divide the box),
    and the array covers every decoded pixel that box touches.  With
    ``coordl.decode._jpegcrop`` only rows and columns near the box are
    decoded (their pixels are the whole decode's); otherwise the array is the
    whole image from :func:`decode_rgb`.  ``size``: the header's (h, w),
    i.e. ``jpeg_size(raw)``, when the caller has read it.
    """
    if size is None:
        size = jpeg_size(raw)
    if size is not None:
        check_pixels(size)  # before a single pixel is allocated, on either path
    if size is not None and _crop is not None and _ends_with_eoi(raw):
        H, W = size
        d = scale
        H2, W2 = -(-H // d), -(-W // d)
        top, left, h, w = box
        # the decoded pixels the box touches: [floor(top / d), ceil((top + h) / d))
        t, l = top // d, left // d
        b, r = min(H2, -(-(top + h) // d)), min(W2, -(-(left + w) // d))
        m = _CROP_MARGIN
        t0, l0 = max(0, t - m), max(0, l - m)
        t1, l1 = min(H2, b + m), min(W2, r + m)
        try:
            buf, rows, cols, y0, x0, oh, ow = _crop.decode(raw, d, t0, l0, t1 - t0, l1 - l0)
        except ValueError:
            pass  # the whole-image path decides, exactly as before
        else:
            if (oh, ow) == (H2, W2):
                arr = np.frombuffer(buf, np.uint8).reshape(rows, cols, 3)
                return arr, _in_array(box, d, y0, x0)
    arr = _decode_whole(raw, _header(raw) if size is not None else None, scale)
    if size is not None and arr.shape[:2] != tuple(size):
        H, W = size
        d = next((d for d in (2, 4, 8) if arr.shape[:2] == (-(-H // d), -(-W // d))), None)
        if d is None:
            raise AssertionError(f"a {W}x{H} JPEG decoded to {arr.shape[1]}x{arr.shape[0]}, "
                                 f"which is no DCT scale of it")  # pragma: no cover
        return arr, _in_array(box, d, 0, 0)
    return arr, tuple(box)


def _in_array(box, d: int, y0: int, x0: int) -> tuple:
    """``box`` of the full-size image in an array of the image at 1/d whose
    first row and column are the scaled image's ``y0`` and ``x0``."""
    top, left, h, w = box
    if d == 1:
        return top - y0, left - x0, h, w
    return top / d - y0, left / d - x0, h / d, w / d
