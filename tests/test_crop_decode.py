"""Crop-window JPEG decode (coordl.decode._jpegcrop) on the fused RandomResizedCrop path.

The window decode must give the same crop and flip draws as the whole-image
decode, and pixels inside the crop within rounding of it (on this machine they
are identical), for every size, DCT scale, colour space and layout; files it
declines must take today's path and give today's result exactly.
"""
import io
import os
import random
import shutil
import threading

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from coordl import _rng
from coordl.decode import jpeg as _decode
from coordl import transforms as T
from coordl.testing import run_in_child

try:
    from coordl.decode import _jpegcrop as crop_ext
except ImportError:
    if shutil.which("cc") and os.path.exists("/usr/include/jpeglib.h"):
        raise ImportError("coordl.decode._jpegcrop is not built although this machine can build it: "
                          "run `pip install -e .` (or `python setup.py build_ext --inplace`)") from None
    pytest.skip("coordl.decode._jpegcrop can't be built here (no C compiler or libjpeg headers)",
                allow_module_level=True)

# decoded pixels may differ by libjpeg rounding between the two libjpeg-turbo
# builds (system vs simplejpeg's); a crop box off by one pixel on these noisy
# images differs by far more
TOL_MAX = 2


def _jpeg(w, h, mode="RGB", seed=0, quality=90, **save):
    """A noisy photo-like JPEG: smooth colour plus per-pixel noise, so a box
    off by one pixel shows."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, h // 8), max(1, w // 8), 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC), dtype=np.uint16)
    noise = rng.integers(0, 64, (h, w, 3), dtype=np.uint16)
    img = Image.fromarray(((base * 3 + noise * 4) // 4).clip(0, 255).astype(np.uint8)).convert(mode)
    buf = io.BytesIO()
    old = ImageFile.MAXBLOCK
    ImageFile.MAXBLOCK = 1 << 24  # progressive saves need the whole image in one block
    try:
        img.save(buf, "JPEG", quality=quality, **save)
    finally:
        ImageFile.MAXBLOCK = old
    return buf.getvalue()


def _on_pil(pipe, raw):
    """The pipeline on PIL's decode of ``raw`` (the unfused path: torchvision's pixels)."""
    return pipe(_decode.pil_rgb(raw))


def _both(pipe, raw, key, monkeypatch):
    """(window-decode output, rng state after), (whole-decode output, rng state after)."""
    out = []
    for mod in (crop_ext, None):
        monkeypatch.setattr(_decode, "_crop", mod)
        with _rng.sample_rng(*key):
            x = pipe.from_bytes(raw)
            out.append((x, _rng.current().getstate()))
    monkeypatch.setattr(_decode, "_crop", crop_ext)
    return out


def _cover(arr, box):
    """The pixels of ``arr`` that ``box`` (top, left, h, w; fractions at a
    reduced scale) touches, as an int array."""
    t, l, h, w = box
    t0, l0 = int(t), int(l)
    t1, l1 = min(arr.shape[0], -int(-(t + h) // 1)), min(arr.shape[1], -int(-(l + w) // 1))
    return arr[t0:t1, l0:l1].astype(int)


def _whole_window(raw, box, scale=1):
    """The pixels of the whole decode (at the DCT scale) that ``box`` touches."""
    arr = _decode.decode_rgb(raw, scale=scale)
    t, l, h, w = box
    if scale > 1:
        t, l, h, w = t / scale, l / scale, h / scale, w / scale
    return _cover(arr, (t, l, h, w))


def _crop_window(raw, box, scale=1):
    arr, (t, l, h, w) = _decode.decode_rgb_crop(raw, box, scale=scale)
    assert 0 <= t and 0 <= l and t + h <= arr.shape[0] and l + w <= arr.shape[1]
    if scale == 1:
        assert all(isinstance(v, int) for v in (t, l, h, w))
    return arr, _cover(arr, (t, l, h, w))


# --------------------------------------------------------------------------
# the window decoder is used, and decodes less

def test_window_decode_decodes_only_rows_and_columns_near_the_box():
    raw = _jpeg(640, 480)
    arr, win = _crop_window(raw, (200, 300, 50, 40))
    assert arr.shape[0] <= 50 + 2 * _decode._CROP_MARGIN  # rows above and below never produced
    assert arr.shape[1] < 640  # columns cut (from an iMCU boundary on)
    assert np.abs(win - _whole_window(raw, (200, 300, 50, 40))).max() <= TOL_MAX


def test_fused_random_resized_crop_uses_the_window_decoder(monkeypatch):
    calls = []

    class Spy:
        def decode(self, *a):
            res = crop_ext.decode(*a)
            calls.append((a[1:], res[1:]))
            return res

    monkeypatch.setattr(_decode, "_crop", Spy())
    raw = _jpeg(500, 375)
    pipe = T.Compose([T.RandomResizedCrop(64, scale=(0.05, 0.3)), T.ToTensor()])
    for k in range(5):
        with _rng.sample_rng(0, 0, k):
            pipe.from_bytes(raw)
    assert len(calls) == 5
    # the decoded blocks are small: crops of <= 30% of the area, at most 8 margin rows/cols
    assert all(rows * cols < 0.6 * 375 * 500 for _, (rows, cols, *_rest) in calls)


def test_fused_decode_reads_the_header_once_and_draws_as_get_params(monkeypatch):
    """Per-sample work of the fused path: one JPEG header parse per sample
    (decode_rgb_crop is handed the size), and the crop drawn without
    get_params' argument checks still draws exactly get_params' numbers."""
    raw = _jpeg(500, 375)
    pipe = T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(), T.PILToTensor()])
    reads = []
    real = _decode.jpeg_size
    monkeypatch.setattr(_decode, "jpeg_size", lambda r: reads.append(1) or real(r))
    boxes = []
    real_crop = _decode.decode_rgb_crop
    monkeypatch.setattr(_decode, "decode_rgb_crop",
                        lambda r, box, *a, **k: boxes.append(box) or real_crop(r, box, *a, **k))
    for k in range(20):
        with _rng.sample_rng(5, 1, k):
            pipe.from_bytes(raw)
    assert len(reads) == 20
    rrc = pipe.transforms[0]
    want = [rrc.get_params((500, 375), rrc.scale, rrc.ratio, _rng.derive(5, 1, k)) for k in range(20)]
    assert boxes == want


def test_sample_rng_sets_and_restores_the_current_generator():
    outer = _rng.current()
    with _rng.sample_rng(1, 2, 3) as g:
        assert _rng.current() is g
        with _rng.sample_rng(1, 2, 4) as h:
            assert _rng.current() is h
        assert _rng.current() is g
        assert g.random() == _rng.derive(1, 2, 3).random()
    assert _rng.current() is outer
    with pytest.raises(KeyError):
        with _rng.sample_rng(0, 0, 0):
            raise KeyError
    assert _rng.current() is outer


# --------------------------------------------------------------------------
# same draws, same pixels (within rounding), today's path when disabled

SHAPES = [(1, 1), (7, 5), (37, 23), (500, 375), (375, 500), (1531, 1023)]


@pytest.mark.parametrize("wh", SHAPES, ids=[f"{w}x{h}" for w, h in SHAPES])
def test_same_draws_and_pixels_as_whole_decode(wh, monkeypatch):
    raw = _jpeg(*wh, seed=sum(wh))
    pipe = T.Compose([T.RandomResizedCrop(48), T.RandomHorizontalFlip(), T.PILToTensor()])
    for k in range(12 if wh[0] < 1000 else 4):
        (a, sa), (b, sb) = _both(pipe, raw, (7, 1, k), monkeypatch)
        assert sa == sb  # the same numbers were drawn
        assert a.shape == b.shape == (3, 48, 48) and a.dtype == b.dtype == torch.uint8
        assert a.is_contiguous()
        assert (a.int() - b.int()).abs().max() <= TOL_MAX


def test_disabled_gives_exactly_the_whole_decodes_pixels(monkeypatch):
    """Without the window decoder the fused path decodes the whole image;
    its result is then the pipeline's on PIL's decode, bit for bit."""
    monkeypatch.setattr(_decode, "_crop", None)
    raw = _jpeg(800, 600, seed=3)
    pipe = T.Compose([T.RandomResizedCrop(96, scale=(0.02, 1.0)), T.RandomHorizontalFlip(),
                      T.ToTensor(), T.Normalize([0.5] * 3, [0.25] * 3)])
    for k in range(10):
        with _rng.sample_rng(2, 0, k):
            got = pipe.from_bytes(raw)
        with _rng.sample_rng(2, 0, k):
            ref = _on_pil(pipe, raw)
        assert torch.equal(got, ref)


@pytest.mark.parametrize("d", [1, 2, 4, 8])
def test_every_dct_scale(d, monkeypatch):
    raw = _jpeg(1200, 900, seed=d)
    H, W = 900, 1200
    assert _decode.draft_scale((H, W), (H / d * 0.9, W / d * 0.9)) == d  # 1/d still covers it, 1/(2d) not
    rng = random.Random(d)
    for _ in range(8):
        h, w = rng.randint(1, H), rng.randint(1, W)
        box = (rng.randint(0, H - h), rng.randint(0, W - w), h, w)
        arr, win = _crop_window(raw, box, d)
        ref = _whole_window(raw, box, d)
        assert win.shape == ref.shape
        assert np.abs(win - ref).max() <= TOL_MAX
        assert arr.shape[0] <= -(-H // d) and arr.shape[1] <= -(-W // d)
    # and through the pipeline (draft=True): an output small enough for 1/d
    pipe = T.Compose([T.RandomResizedCrop(max(1, 900 // (2 * d) - 8), scale=(0.9, 1.0), draft=True),
                      T.PILToTensor()])
    for k in range(3):
        (a, sa), (b, sb) = _both(pipe, raw, (0, 0, k), monkeypatch)
        assert sa == sb and (a.int() - b.int()).abs().max() <= TOL_MAX


def test_boxes_at_the_image_edges():
    raw = _jpeg(333, 251, seed=9)
    H, W = 251, 333
    boxes = [(0, 0, H, W), (0, 0, 1, 1), (H - 1, W - 1, 1, 1), (0, W - 17, 40, 17), (H - 9, 0, 9, 100),
             (0, 0, H, 1), (0, W - 1, H, 1), (0, 0, 1, W), (H - 1, 0, 1, W), (100, 160, 51, 13)]
    for box in boxes:
        for scale in (1, 4):
            _, win = _crop_window(raw, box, scale)
            ref = _whole_window(raw, box, scale)
            assert win.shape == ref.shape and np.abs(win - ref).max() <= TOL_MAX, box


LAYOUTS = {
    "444": dict(subsampling=0), "422": dict(subsampling=1), "420": dict(subsampling=2),
    "progressive-420": dict(subsampling=2, progressive=True),
    "progressive-444": dict(subsampling=0, progressive=True),
    "restart-rows": dict(subsampling=2, restart_marker_rows=1),
    "restart-blocks": dict(subsampling=1, restart_marker_blocks=5),
    "grayscale": dict(mode="L"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_decode_the_window(name, monkeypatch):
    save = dict(LAYOUTS[name])
    raw = _jpeg(421, 317, seed=len(name), **save)
    if name.startswith("restart"):
        assert b"\xff\xdd" in raw  # a restart interval is defined
    if name.startswith("progressive"):
        assert Image.open(io.BytesIO(raw)).info.get("progressive")
    rng = random.Random(name)
    for _ in range(10):
        h, w = rng.randint(1, 317), rng.randint(1, 421)
        box = (rng.randint(0, 317 - h), rng.randint(0, 421 - w), h, w)
        arr, win = _crop_window(raw, box)
        assert arr.shape[0] <= h + 2 * _decode._CROP_MARGIN  # the window decoder did it
        ref = _whole_window(raw, box)
        assert np.abs(win - ref).max() <= TOL_MAX
    if name == "grayscale":
        assert (win[..., 0] == win[..., 1]).all() and (win[..., 1] == win[..., 2]).all()
    pipe = T.Compose([T.RandomResizedCrop(40), T.RandomHorizontalFlip(), T.PILToTensor()])
    for k in range(4):
        (a, sa), (b, sb) = _both(pipe, raw, (5, 5, k), monkeypatch)
        assert sa == sb and (a.int() - b.int()).abs().max() <= TOL_MAX


def _cmyk_jpeg(w, h):
    rng = np.random.default_rng(4)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "CMYK")
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_cmyk_falls_back_to_todays_path(monkeypatch):
    raw = _cmyk_jpeg(120, 90)
    with pytest.raises(ValueError, match="colour space"):
        crop_ext.decode(raw, 1, 0, 0, 10, 10)
    arr, box = _decode.decode_rgb_crop(raw, (10, 20, 30, 40))
    assert arr.shape == (90, 120, 3) and box == (10, 20, 30, 40)  # the whole image, by PIL
    pipe = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.PILToTensor()])
    for k in range(4):
        (a, sa), (b, sb) = _both(pipe, raw, (1, 1, k), monkeypatch)
        assert sa == sb and torch.equal(a, b)


def test_corrupt_data_below_the_window_fails_as_the_whole_decode():
    """A stray marker (an SOI) late in the entropy-coded data: PIL's whole
    decode fails on it ("broken data stream").  The window decode of rows
    above it must fail too (it reads the file to its end), not hand back an
    image of a file torchvision's loader rejects."""
    raw = _jpeg(64, 64, seed=3)
    sos = raw.find(b"\xff\xda")
    at = sos + (len(raw) - sos) * 4 // 5
    bad = raw[:at] + b"\xff\xd8" + raw[at:]
    with pytest.raises(OSError) as pil:
        _decode.pil_rgb(bad)
    for box in [(0, 0, 8, 8), (0, 40, 16, 24), (10, 5, 30, 30)]:
        with pytest.raises(ValueError, match="libjpeg"):
            crop_ext.decode(bad, 1, *box)
        with pytest.raises(type(pil.value)):
            _decode.decode_rgb_crop(bad, box)
    # the untouched file still decodes through the window path, as before
    buf, rows, cols, y0, x0, oh, ow = crop_ext.decode(raw, 1, 0, 0, 8, 8)
    assert (rows, oh, ow) == (8, 64, 64)


def _entropy_start(raw) -> int:
    sos = raw.find(b"\xff\xda")
    return sos + 2 + int.from_bytes(raw[sos + 2:sos + 4], "big")


def _damaged_below(raw, frac, H, W):
    """``raw`` with a few bytes of its entropy-coded data overwritten after
    the fraction ``frac`` of it, without making a marker, such that libjpeg
    warns ("corrupt data") when it reads the bottom rows: a damage PIL
    decodes through (rows above it intact), not an error."""
    start = _entropy_start(raw)
    lo = start + int((len(raw) - 2 - start) * frac)
    r = random.Random(0)
    for _ in range(50):
        b = bytearray(raw)
        for _ in range(6):
            p = r.randrange(lo, len(b) - 2)
            if b[p] != 0xFF and b[p - 1] != 0xFF:
                b[p] = r.choice([v for v in range(255) if v != b[p]])
        bad = bytes(b)
        try:
            crop_ext.decode(bad, 1, H - 16, 0, 16, W)
        except ValueError:
            return bad
    raise AssertionError("no damage made libjpeg warn")


def test_damaged_data_below_the_window_is_not_read():
    """Entropy-coded data below the window that libjpeg only warns about (PIL
    decodes the file, rows above the damage intact) and nothing but restart
    markers and the final end-of-image marker after the window: the rows
    below are left unread, so the window decodes (the same pixels as the
    undamaged file) instead of falling back to a whole decode."""
    H, W = 256, 64
    raw = _jpeg(W, H, seed=5)
    bad = _damaged_below(raw, 0.75, H, W)
    pil = np.asarray(_decode.pil_rgb(bad)).astype(int)  # PIL reads through the damage
    for box in [(0, 0, 16, 64), (20, 8, 40, 30)]:
        got = crop_ext.decode(bad, 1, *box)
        assert got == crop_ext.decode(raw, 1, *box)
        arr, (t, l, h, w) = _decode.decode_rgb_crop(bad, box)
        assert arr.shape[0] < H  # the window path, not the whole decode
        assert np.abs(arr[t:t + h, l:l + w].astype(int) - pil[box[0]:box[0] + h, box[1]:box[1] + w]).max() <= TOL_MAX


def test_restart_markers_below_the_window_are_not_read():
    """Restart markers (in order, or out of order: a warning, which PIL
    decodes through) are entropy-coded data for this rule: the window
    decodes with the whole decode's pixels, the rows below unread."""
    H, W = 256, 64
    raw = _jpeg(W, H, seed=6, restart_marker_rows=1)
    start = _entropy_start(raw)
    rst = [i for i in range(start, len(raw) - 1) if raw[i] == 0xFF and 0xD0 <= raw[i + 1] <= 0xD7]
    assert len(rst) >= 10
    whole = _decode.decode_rgb(raw).astype(int)
    swapped = bytearray(raw)
    a, b = rst[-3], rst[-2]
    swapped[a + 1], swapped[b + 1] = raw[b + 1], raw[a + 1]
    swapped = bytes(swapped)
    with pytest.raises(ValueError, match="libjpeg"):  # out of sequence: libjpeg warns there
        crop_ext.decode(swapped, 1, H - 16, 0, 16, W)
    _decode.pil_rgb(swapped)  # and PIL reads through it
    for data in (raw, swapped):
        box = (0, 8, 16, 40)
        arr, (t, l, h, w) = _decode.decode_rgb_crop(data, box)
        assert arr.shape[0] < H
        assert np.abs(arr[t:t + h, l:l + w].astype(int) - whole[:16, 8:48]).max() <= TOL_MAX


def test_any_other_marker_below_the_window_is_read_as_before():
    """A comment marker inside the entropy-coded data below the window (PIL
    decodes through it): not plain data, so the rest is read as before; the
    decode warns and the file takes the whole-image path, with PIL's result."""
    H, W = 256, 64
    raw = _jpeg(W, H, seed=7)
    start = _entropy_start(raw)
    at = start + (len(raw) - start) * 4 // 5
    while raw[at - 1] == 0xFF:
        at += 1
    bad = raw[:at] + b"\xff\xfe\x00\x06note" + raw[at:]
    pil = np.asarray(_decode.pil_rgb(bad))
    with pytest.raises(ValueError, match="libjpeg"):
        crop_ext.decode(bad, 1, 0, 0, 16, 64)
    arr, box = _decode.decode_rgb_crop(bad, (0, 0, 16, 64))
    assert arr.shape == (H, W, 3) and box == (0, 0, 16, 64) and np.array_equal(arr, pil)


def test_float_conversion_in_one_pass_is_the_step_by_step_one_bit_for_bit():
    """ToTensor (+ ToDtype/Normalize) after the uint8 image, done by
    ``to_float`` through a per-channel table (with the flip folded in): the
    very values of the steps run one by one, on any strides."""
    g = torch.Generator().manual_seed(0)
    chains = [[T.ToTensor()],
              [T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])],
              [T.ToTensor(), T.Normalize([0.5], [0.25]), T.ToDtype(torch.float32)],
              [T.ToTensor(), T.ToDtype(torch.float32, scale=True), T.Normalize([0.1, 0.2, 0.3], [1, 2, 3])]]
    base = torch.randint(0, 256, (37, 53, 3), dtype=torch.uint8, generator=g)
    views = [base.permute(2, 0, 1), base.permute(2, 0, 1).contiguous(), base.permute(2, 0, 1)[:, 3:30, 5:40]]
    for steps in chains:
        for flip in (False, True):
            for x in views:
                got = T._convert(x, steps, flip, crop_ext)
                want = (x.flip(-1) if flip else x).to(torch.float32).div(255)
                for t in steps[1:]:
                    want = t(want)
                assert got.dtype == torch.float32 and got.is_contiguous() and torch.equal(got, want)
    # a result that is not float32 takes the steps one by one
    x = views[0]
    assert T._convert(x, [T.ToTensor(), T.ToDtype(torch.float64)], True, crop_ext).dtype == torch.float64
    with pytest.raises(ValueError, match="uint8"):
        crop_ext.to_float(np.zeros((3, 4), np.uint8), np.zeros(768, np.float32), np.zeros(12, np.float32), False)
    with pytest.raises(ValueError, match="out"):
        crop_ext.to_float(np.zeros((3, 4, 5), np.uint8), np.zeros(768, np.float32), np.zeros(59, np.float32), False)


def test_fused_pipeline_without_to_float_gives_the_same_batches(monkeypatch):
    """An extension built before ``to_float`` existed: the same pixels and
    draws, the conversion done step by step."""
    from types import SimpleNamespace

    pipe = T.Compose([T.RandomResizedCrop(40), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    raws = [_jpeg(120, 90, seed=s) for s in range(3)]
    out = {}
    for name, ext in [("new", crop_ext), ("old", SimpleNamespace(decode=crop_ext.decode))]:
        monkeypatch.setattr(_decode, "_crop", ext)
        monkeypatch.setattr(_decode, "_ext", ext)
        res = []
        for i, raw in enumerate(raws):
            for e in range(4):
                with _rng.sample_rng(0, e, i):
                    res.append((pipe.from_bytes(raw), _rng.current().random()))
        out[name] = res
    for (a, ra), (b, rb) in zip(out["new"], out["old"]):
        assert ra == rb and torch.equal(a, b)


def test_exif_orientation_is_ignored_as_on_the_pil_path(monkeypatch):
    """coordl's PIL path does not apply EXIF orientation; nor does the window decode."""
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to view"
    raw = _jpeg(300, 200, seed=11, exif=exif.tobytes())
    assert Image.open(io.BytesIO(raw)).getexif().get(0x0112) == 6
    pil = np.asarray(_decode.pil_rgb(raw)).astype(int)
    assert pil.shape == (200, 300, 3)  # not transposed
    for box in [(0, 0, 200, 300), (20, 150, 100, 120), (199, 0, 1, 300)]:
        arr, win = _crop_window(raw, box)
        assert arr.shape[0] < 200 or box[2] == 200
        t, l, h, w = box
        assert np.abs(win - pil[t:t + h, l:l + w]).max() <= TOL_MAX

def test_exif_orientation_through_the_pipeline(monkeypatch):
    exif = Image.Exif()
    exif[0x0112] = 8
    raw = _jpeg(300, 200, seed=12, exif=exif.tobytes())
    pipe = T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(), T.PILToTensor()])
    for k in range(5):
        (a, sa), (b, sb) = _both(pipe, raw, (0, 3, k), monkeypatch)
        assert sa == sb and (a.int() - b.int()).abs().max() <= TOL_MAX


# --------------------------------------------------------------------------
# broken files: today's outcome

def _outcome(pipe, raw, key):
    with _rng.sample_rng(*key):
        try:
            return "ok", pipe.from_bytes(raw)
        except Exception as e:  # noqa: BLE001 - the outcome is what's compared
            return "error", (type(e), str(e))


@pytest.mark.parametrize("load_truncated", [False, True])
def test_truncated_files_behave_as_today(load_truncated, monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", load_truncated)
    full = _jpeg(400, 300, seed=12)
    pipe = T.Compose([T.RandomResizedCrop(32, scale=(0.01, 0.05)), T.PILToTensor()])
    for cut in (0.3, 0.6, 0.9, 0.99):
        raw = full[: int(len(full) * cut)]
        for k in range(6):  # small crops: many lie entirely above the cut
            monkeypatch.setattr(_decode, "_crop", crop_ext)
            got = _outcome(pipe, raw, (0, 0, k))
            monkeypatch.setattr(_decode, "_crop", None)
            ref = _outcome(pipe, raw, (0, 0, k))
            assert got[0] == ref[0]
            if got[0] == "error":
                assert got[1] == ref[1]
                assert issubclass(got[1][0], OSError) and "truncated" in got[1][1]
            else:
                assert torch.equal(got[1], ref[1])


def test_corrupt_files_behave_as_today(monkeypatch, capfd):
    full = _jpeg(400, 300, seed=13)
    start = full.index(b"\xff\xda") + 20  # inside the entropy-coded data
    rng = random.Random(13)
    pipe = T.Compose([T.RandomResizedCrop(32, scale=(0.01, 0.3)), T.PILToTensor()])
    for trial in range(12):
        raw = bytearray(full)
        for _ in range(3):
            raw[rng.randrange(start, len(full) - 2)] = rng.randrange(256)
        raw = bytes(raw)
        for k in range(3):
            monkeypatch.setattr(_decode, "_crop", crop_ext)
            got = _outcome(pipe, raw, (trial, 0, k))
            monkeypatch.setattr(_decode, "_crop", None)
            ref = _outcome(pipe, raw, (trial, 0, k))
            assert got[0] == ref[0], (trial, k, got, ref)
            if got[0] == "error":
                assert got[1] == ref[1]
            else:  # corrupt rows below the window aren't read: same rows above it
                assert got[1].shape == ref[1].shape
                assert (got[1].float() - ref[1].float()).abs().mean() < 1.0
    # and libjpeg's corrupt-data warnings are never printed by the window decoder
    capfd.readouterr()
    bad = bytearray(full)
    bad[start + 50:start + 60] = b"\xff\x00" * 5
    for args in [(bytes(bad), 1, 250, 0, 50, 400), (full[:len(full) // 2], 1, 250, 0, 50, 400),
                 (b"\xff\xd8\xff\xe0garbage", 1, 0, 0, 1, 1)]:
        try:
            crop_ext.decode(*args)
        except ValueError:
            pass
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_extension_argument_errors():
    raw = _jpeg(64, 48)
    with pytest.raises(ValueError, match="denom should be 1, 2, 4 or 8, but got denom=3"):
        crop_ext.decode(raw, 3, 0, 0, 1, 1)
    with pytest.raises(ValueError, match="outside the 64x48 image"):
        crop_ext.decode(raw, 1, 40, 0, 9, 1)
    with pytest.raises(ValueError, match="outside the 32x24 image decoded at scale 1/2"):
        crop_ext.decode(raw, 2, 0, 30, 1, 3)
    with pytest.raises(ValueError, match="libjpeg"):
        crop_ext.decode(b"not a jpeg at all", 1, 0, 0, 1, 1)
    buf, rows, cols, y0, x0, oh, ow = crop_ext.decode(bytearray(raw), 1, 0, 0, 48, 64)
    assert (rows, cols, y0, x0, oh, ow) == (48, 64, 0, 0, 48, 64) and len(buf) == 48 * 64 * 3


def test_threads_decode_concurrently_and_correctly():
    """The GIL is released around libjpeg; results stay per call."""
    raws = [_jpeg(300 + 7 * i, 200 + 5 * i, seed=i) for i in range(4)]
    refs = [_decode.decode_rgb(r) for r in raws]
    errors = []

    def work(i):
        try:
            for k in range(10):
                box = (k * 7, k * 11, 50, 60)
                _, win = _crop_window(raws[i], box)
                t, l, h, w = box
                assert np.abs(win - refs[i][t:t + h, l:l + w].astype(int)).max() <= TOL_MAX
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads) and errors == []


def test_env_var_disables_the_window_decode():
    code = "from coordl.decode import jpeg as _decode; print(_decode._crop is None)"
    for value, disabled in (("0", "True"), ("1", "False")):
        res = run_in_child(code, timeout=120, env={**os.environ, "COORDL_CROP_DECODE": value})
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == disabled


def test_benchmark_script_runs(tmp_path, capsys):
    import importlib.util
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(_jpeg(300 + 20 * i, 200, seed=i))
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "crop_decode.py")
    spec = importlib.util.spec_from_file_location("crop_decode_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    assert bench.main([str(tmp_path), "--rounds", "1", "--size", "64"]) == 0
    out = capsys.readouterr().out
    assert "3 images" in out and "identical in 3/3 samples" in out
    assert _decode._crop is crop_ext  # restored
    assert torch.get_num_threads() == threads


def test_normalize_parameters_changed_into_lists_still_convert(monkeypatch):
    """A Normalize whose mean/std were replaced by lists after construction
    (unhashable: no table for it) converts step by step, with the same values."""
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    norm.mean, norm.std = [0.5, 0.4, 0.3], [0.2, 0.3, 0.4]
    x = torch.randint(0, 256, (3, 9, 11), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    got = T._convert(x, [T.ToTensor(), norm], True, crop_ext)
    want = T.Normalize([0.5, 0.4, 0.3], [0.2, 0.3, 0.4])(x.flip(-1).float().div(255))
    assert torch.equal(got, want)
