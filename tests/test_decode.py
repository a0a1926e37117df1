"""The fused decode path: bytes -> tensor with the same random draws as PIL."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

import coordl
from coordl import _rng
from coordl.decode import jpeg as _decode
from coordl import transforms as T


def _jpeg(w, h, mode="RGB", seed=0, quality=92):
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, h // 8), max(1, w // 8), 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.BICUBIC).convert(mode)
    buf = io.BytesIO()
    img.save(buf, "JPEG" if mode != "RGBA" else "PNG", quality=quality)
    return buf.getvalue()


def _png(w, h):
    buf = io.BytesIO()
    Image.fromarray(np.arange(w * h * 3, dtype=np.uint8).reshape(h, w, 3)).save(buf, "PNG")
    return buf.getvalue()


PIPE = T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(), T.PILToTensor()])


@pytest.mark.parametrize("raw", [_jpeg(200, 150), _jpeg(150, 200, seed=1), _png(120, 90)],
                         ids=["jpeg-landscape", "jpeg-portrait", "png"])
def test_fused_equals_pil_path_up_to_resampling(raw):
    """Output 100 px from images <= 200 px: no DCT scaling can apply, so only
    resampling rounding differs."""
    pipe = T.Compose([T.RandomResizedCrop(100), T.RandomHorizontalFlip(), T.PILToTensor()])
    for k in range(10):
        with _rng.sample_rng(3, 0, k):
            fused = pipe.from_bytes(raw)
        with _rng.sample_rng(3, 0, k):
            ref = pipe(_decode.pil_rgb(raw))
        assert fused.dtype == ref.dtype == torch.uint8 and fused.shape == ref.shape == (3, 100, 100)
        assert fused.is_contiguous()
        inner = (fused.float() - ref.float()).abs()[:, 2:-2, 2:-2]
        assert inner.mean() < 3.0  # same crop and flip; resampling rounding only


def test_fused_same_draws_as_pil_path():
    """A flip decision or crop that differed would give a large difference."""
    raw = _jpeg(300, 200, seed=5)
    pipe = T.Compose([T.RandomResizedCrop(48, scale=(0.05, 0.1)), T.RandomHorizontalFlip(), T.ToTensor()])
    for k in range(20):
        with _rng.sample_rng(1, 2, k):
            a = pipe.from_bytes(raw)
        with _rng.sample_rng(1, 2, k):
            b = pipe(_decode.pil_rgb(raw))
        assert a.dtype == torch.float32 and (a - b).abs()[:, 2:-2, 2:-2].mean() < 0.02


def test_power_of_two_dct_scale_only():
    assert _decode.draft_scale((600, 800), (100, 100)) == 4
    assert _decode.draft_scale((600, 800), (300, 300)) == 2
    assert _decode.draft_scale((600, 800), (100, 500)) == 1
    assert _decode.draft_scale((6000, 8000), (10, 10)) == 8
    raw = _jpeg(801, 603)
    assert _decode.decode_rgb(raw, scale=4).shape == (151, 201, 3)  # ceil: the last pixel is part padding
    assert _decode.decode_rgb(raw).shape == (603, 801, 3)


def test_grayscale_jpeg_gives_three_channels():
    raw = _jpeg(80, 60, mode="L")
    out = PIPE.from_bytes(raw)
    assert out.shape == (3, 64, 64)


def test_truncated_jpeg_raises_oserror():
    raw = _jpeg(200, 150)
    with pytest.raises(OSError):
        _decode.decode_rgb(raw[: len(raw) // 2])


def test_non_fusable_pipelines_decline():
    assert T.Compose([T.RandomResizedCrop(32), lambda x: x]).from_bytes(_jpeg(50, 50)) is NotImplemented
    assert T.Compose([T.RandomResizedCrop(32)]).from_bytes(_jpeg(50, 50)) is NotImplemented  # ends in PIL


def test_image_folder_uses_fused_path_and_getitem_agrees(tmp_path):
    from coordl.synth import make_image_folder

    make_image_folder(str(tmp_path / "d"), num_images=6, num_classes=2, image_size=(96, 72), seed=0)
    ds = coordl.ImageFolder(str(tmp_path / "d"), transform=PIPE)
    with _rng.sample_rng(0, 0, 2):
        a, ya = ds[2]
    with _rng.sample_rng(0, 0, 2):
        b, yb = ds.prep(ds.raw(2), 2)
    assert torch.equal(a, b) and ya == yb
    # a custom callable in the pipeline: plain PIL path, still works
    ds2 = coordl.ImageFolder(str(tmp_path / "d"), transform=T.Compose([T.CenterCrop(32), T.PILToTensor(),
                                                                       lambda t: t.float()]))
    assert ds2[0][0].dtype == torch.float32 and ds2[0][0].shape == (3, 32, 32)


# ------------------------------------------------------------------- PIL's switches
def _flat_jpeg(w, h, fmt="JPEG"):
    """A flat-colour image: a few hundred KiB on disk for tens of megapixels."""
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (120, 30, 200)).save(buf, fmt)
    return buf.getvalue()


FUSED = {
    "rrc": T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(), T.PILToTensor()]),
    "resize": T.Compose([T.Resize(64), T.CenterCrop(64), T.ToTensor()]),
    "plain": T.Compose([T.PILToTensor()]),
}


def _every_decode_path():
    """(name, bytes -> decoded) for each way coordl decodes an image."""
    from coordl.datasets import pil_decode

    paths = [("simplejpeg", _decode.decode_rgb),
             ("simplejpeg-dct-scaled", lambda raw: _decode.decode_rgb(raw, scale=8)),
             ("pil_rgb", _decode.pil_rgb), ("pil_decode", pil_decode)]
    for name, pipe in FUSED.items():
        paths.append((f"fused-{name}", lambda raw, pipe=pipe: _rng_call(pipe.from_bytes, raw)))
    return paths


def _rng_call(f, raw):
    with _rng.sample_rng(0, 0, 1):
        return f(raw)


@pytest.mark.parametrize("name,decode", _every_decode_path(), ids=[n for n, _ in _every_decode_path()])
def test_truncated_jpeg_honours_load_truncated_images(name, decode, monkeypatch):
    from PIL import ImageFile

    raw = _jpeg(200, 150, seed=4)
    cut = raw[: len(raw) * 2 // 3]
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", False)
    with pytest.raises(OSError, match="truncated"):
        decode(cut)
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    out = decode(cut)
    # decoded as PIL decodes it (what torchvision's loader gives)
    ref_img = _decode.pil_rgb(cut)
    if name == "simplejpeg":
        assert np.array_equal(out, np.asarray(ref_img))
    elif name.startswith("fused"):
        pipe = FUSED[name.split("-", 1)[1]]
        ref = _rng_call(pipe, ref_img)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        scale = 255.0 if out.dtype == torch.float32 else 1.0
        assert ((out.float() - ref.float()) * scale).abs()[:, 2:-2, 2:-2].mean() < 3.0
    elif name == "simplejpeg-dct-scaled":  # PIL at the same DCT scale (its draft mode)
        img = Image.open(io.BytesIO(cut))
        img.draft("RGB", (16, 16))
        ref = np.asarray(img.convert("RGB"))
        assert out.shape[0] < 150 and np.array_equal(out, ref)
    else:
        assert np.array_equal(np.asarray(out), np.asarray(ref_img))


BOMB_WH = (4000, 3000)  # 12 Mpx, 36 MB decoded, ~190 KB as a flat JPEG


@pytest.fixture(scope="module")
def bomb():
    return {"jpeg": _flat_jpeg(*BOMB_WH), "png": _flat_jpeg(*BOMB_WH, fmt="PNG")}


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
@pytest.mark.parametrize("name,decode", _every_decode_path(), ids=[n for n, _ in _every_decode_path()])
def test_decompression_bomb_refused_before_decoding(name, decode, fmt, bomb, monkeypatch):
    import tracemalloc

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5_000_000)  # 12 Mpx is > 2x the limit
    tracemalloc.start()
    try:
        with pytest.raises(Image.DecompressionBombError, match="MAX_IMAGE_PIXELS|decompression bomb"):
            decode(bomb[fmt])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{name} allocated {peak} bytes before refusing"  # decoding is 36 MB


@pytest.mark.parametrize("name,decode", _every_decode_path(), ids=[n for n, _ in _every_decode_path()])
def test_decompression_bomb_warns_between_limit_and_twice(name, decode, bomb, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 8_000_000)  # 12 Mpx: in (limit, 2x limit]
    with pytest.warns(Image.DecompressionBombWarning):
        out = decode(bomb["jpeg"])
    assert out is not None
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # disabled: no warning (warnings are errors here)
    decode(bomb["jpeg"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_image_folder_bomb_skipped_or_raised(num_workers, tmp_path, monkeypatch, bomb):
    from coordl.synth import make_image_folder

    root = make_image_folder(str(tmp_path / "d"), num_images=6, num_classes=2, image_size=(96, 72), seed=0)
    with open(f"{root}/class_00/zz_bomb.jpg", "wb") as f:
        f.write(bomb["jpeg"])
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5_000_000)  # forked workers inherit it
    for transform in (PIPE, T.Compose([T.RandomResizedCrop(32), T.PILToTensor(), lambda t: t + 0])):
        ds = coordl.ImageFolder(root, transform=transform)
        bad = [i for i in range(len(ds)) if ds.describe(i).endswith("zz_bomb.jpg")]
        assert len(bad) == 1
        L = coordl.DataLoader(ds, batch_size=3, num_workers=num_workers, on_error="skip", seed=0,
                              timeout=60 if num_workers else 0)
        with pytest.warns(coordl.SkippedSampleWarning, match="DecompressionBombError"):
            n = sum(len(y) for _, y in L)
        assert n == 6
        L = coordl.DataLoader(ds, batch_size=3, num_workers=num_workers, seed=0,
                              timeout=60 if num_workers else 0)
        with pytest.raises(Image.DecompressionBombError) as info:
            for _ in L:
                pass
        assert isinstance(info.value, coordl.SampleError)
        assert f"sample {bad[0]}" in str(info.value) and "zz_bomb.jpg" in str(info.value)


# ---------------------------------------- what the fast path can't read goes to PIL
# A 4:4:1 JPEG (chroma sampled 1x4: luma h1v4), 24x40, made with libjpeg-turbo's
# `cjpeg -sample 1x4 -quality 75 -optimize` (PIL cannot write this layout).
# simplejpeg's header read has no name for it and raised KeyError: 6.
JPEG_441 = __import__("base64").b64decode(
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAgGBgcGBQgHBwcJCQgKDBQNDAsLDBkSEw8UHRofHh0aHBwgJC4nICIsIxwcKDcp"
    "LDAxNDQ0Hyc5PTgyPC4zNDL/2wBDAQkJCQwLDBgNDRgyIRwhMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIy"
    "MjIyMjIyMjIyMjIyMjL/wAARCAAoABgDARQAAhEBAxEB/8QAFwABAQEBAAAAAAAAAAAAAAAAAAQFB//EACYQAAICAQIDCQAA"
    "AAAAAAAAAAACBTIDAQQRMUESFCEiQlFTkdH/xAAYAQEBAAMAAAAAAAAAAAAAAAAFBwMEBv/EACIRAAAFAwQDAAAAAAAAAAAA"
    "AAABAgMEBQZhETFRcRMhM//aAAwDAQACEQMRAD8A5xFJUoikqUxSVKYpKnXSLhyFnaHgbkUlSmKSpTFJUoikqCSLgyC3aHgb"
    "kUlSmKSpTFJUpikqCSLhyDHaHgcbikqAAiQpXItLyU8DewT+z2vBcWveMnsmvl05er84gAwkkj3IS64ZT7evjWZdGZcDQwSm"
    "8kOGmXJ2cfxp4L0++XUAGo962E9kuuOfRRn2eo//2Q==")


def _cmyk(w, h, seed=4):
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, h // 8), max(1, w // 8), 4), dtype=np.uint8)
    img = Image.fromarray(small, "CMYK").resize((w, h), Image.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _window(raw, box):
    arr, (t, l, h, w) = _decode.decode_rgb_crop(raw, box)
    return arr[t:t + h, l:l + w]


@pytest.mark.parametrize("raw", [JPEG_441, _cmyk(48, 40)], ids=["4:4:1", "cmyk"])
def test_jpeg_layouts_the_fast_path_cannot_match_decode_as_pil(raw):
    """4:4:1 raised KeyError from the header read; CMYK came out 1 off from
    PIL in most values.  Both must give PIL's pixels exactly, on every path."""
    assert Image.open(io.BytesIO(raw)).format == "JPEG"
    ref = np.asarray(_decode.pil_rgb(raw))
    H, W = ref.shape[:2]
    assert np.array_equal(_decode.decode_rgb(raw), ref)
    assert np.array_equal(_window(raw, (3, 2, H - 6, W - 5)), ref[3:H - 3, 2:W - 3])
    plain = T.Compose([T.PILToTensor()])
    assert torch.equal(plain.from_bytes(raw), torch.from_numpy(ref.copy()).permute(2, 0, 1))
    # output >= the image: no DCT scaling, so same draws and resampling rounding only
    rrc = T.Compose([T.RandomResizedCrop(max(H, W)), T.RandomHorizontalFlip(), T.PILToTensor()])
    for k in range(3):
        with _rng.sample_rng(0, 0, k):
            a = rrc.from_bytes(raw)
        with _rng.sample_rng(0, 0, k):
            b = rrc(_decode.pil_rgb(raw))
        assert a.shape == b.shape and (a.float() - b.float()).abs()[:, 2:-2, 2:-2].mean() < 3.0


def _mutations(n: int, seed: int = 21):
    """``n`` deterministic mutations of a few small JPEGs (4:2:0, 4:4:4, 4:2:2,
    4:4:1, CMYK): random bytes anywhere, bytes in the header, the sampling
    factors of the frame header, cut-off ends and deleted runs."""
    import random

    bases = [_jpeg(64, 48, seed=0), _jpeg(48, 40, seed=1), JPEG_441, _cmyk(40, 32)]
    buf = io.BytesIO()
    Image.fromarray(np.asarray(_decode.pil_rgb(bases[0]))).save(buf, "JPEG", subsampling=0)
    bases.append(buf.getvalue())
    buf = io.BytesIO()
    Image.fromarray(np.asarray(_decode.pil_rgb(bases[1]))).save(buf, "JPEG", subsampling=1)
    bases.append(buf.getvalue())
    r = random.Random(seed)
    for i in range(n):
        b = bytearray(bases[i % len(bases)])
        sos = b.find(b"\xff\xda")
        kind = i // len(bases) % 5
        if kind == 0:
            for _ in range(r.randint(1, 4)):
                b[r.randrange(2, len(b))] = r.randrange(256)
        elif kind == 1:
            b[r.randrange(2, sos + 2)] = r.randrange(256)
        elif kind == 2:
            sof = b.find(b"\xff\xc0") if b.find(b"\xff\xc0") > 0 else b.find(b"\xff\xc2")
            ncomp = b[sof + 9]
            b[sof + 11 + 3 * r.randrange(ncomp)] = r.choice(
                [0x11, 0x12, 0x21, 0x22, 0x14, 0x41, 0x24, 0x42, 0x44, r.randrange(256)])
        elif kind == 3:
            b = b[:r.randrange(4, len(b))]
        else:
            at = r.randrange(2, len(b))
            del b[at:at + r.randint(1, 16)]
        yield bytes(b)


def _outcome(f, raw):
    try:
        return f(raw), None
    except Exception as e:  # noqa: BLE001 - the point is which
        return None, e


def test_mutated_jpegs_decode_as_pil_or_raise_pils_error():
    """Every outcome of a mutated JPEG on coordl's decode paths is PIL's: the
    same pixels (a crop window: the same pixels there, within libjpeg
    rounding), or an error of the type PIL raises (never a KeyError or a
    ValueError from the fast path; never an image where PIL fails)."""
    rrc = T.Compose([T.RandomResizedCrop(8), T.PILToTensor()])
    seen = set()
    for n, raw in enumerate(_mutations(600)):
        ref, ref_err = _outcome(lambda x: np.asarray(_decode.pil_rgb(x)), raw)
        seen.add("pil-ok" if ref_err is None else type(ref_err).__name__)
        H, W = (1, 1) if ref is None else ref.shape[:2]
        box = (H // 3, W // 4, max(1, H // 3), max(1, W // 2))
        paths = {"whole": _decode.decode_rgb,
                 "window": lambda x: _window(x, box),
                 "fused": lambda x: _rng_call(rrc.from_bytes, x)}
        for name, f in paths.items():
            out, err = _outcome(f, raw)
            where = f"mutation {n}, {name}: PIL gave {ref_err!r}, coordl {err!r}"
            if ref_err is not None:
                assert err is not None and type(err) is type(ref_err), where
            elif name == "whole":
                assert err is None and np.array_equal(out, ref), where
            elif name == "window":
                t, l, h, w = box
                assert err is None and out.shape == (h, w, 3), where
                assert np.abs(out.astype(int) - ref[t:t + h, l:l + w]).max() <= 2, where
            else:
                assert err is None and out.shape == (3, 8, 8), where
    assert {"pil-ok", "OSError", "UnidentifiedImageError"} <= seen  # the mix did exercise both sides


def test_mutated_jpegs_in_a_dataset_raise_pils_error_naming_the_file(tmp_path):
    """Through the loader: a file PIL cannot read raises PIL's error type
    (also a SampleError) naming the file; the rest decode."""
    bad, good = [], 0
    root = tmp_path / "d" / "c"
    root.mkdir(parents=True)
    for n, raw in enumerate(_mutations(60, seed=5)):
        (root / f"m{n:03d}.jpg").write_bytes(raw)
        try:
            _decode.pil_rgb(raw)
            good += 1
        except Exception as e:  # noqa: BLE001
            bad.append((f"m{n:03d}.jpg", type(e)))
    assert bad and good
    ds = coordl.ImageFolder(str(tmp_path / "d"), transform=T.Compose([T.RandomResizedCrop(8), T.PILToTensor()]))
    it = iter(coordl.DataLoader(ds, batch_size=1, seed=0))
    errors, ok = {}, 0
    for _ in range(len(ds)):
        try:
            next(it)
            ok += 1
        except coordl.SampleError as e:
            name = [p for p, _ in bad if p in str(e)]
            assert len(name) == 1, str(e)
            errors[name[0]] = e
    assert ok == good and sorted(errors) == sorted(p for p, _ in bad)
    for p, t in bad:
        assert isinstance(errors[p], t), (p, type(errors[p]).__mro__)


def test_a_file_pil_cannot_identify_is_named_by_path_when_indexed(tmp_path):
    """``ds[i]`` (no loader) raises PIL's ``UnidentifiedImageError`` naming
    the file, as torchvision's ``Image.open(path)`` does, not a BytesIO
    object; on the fused path, the PIL path and through a path loader."""
    from PIL import UnidentifiedImageError

    from coordl.datasets import default_loader, pil_loader

    (tmp_path / "d" / "c").mkdir(parents=True)
    bad = tmp_path / "d" / "c" / "x.jpg"
    bad.write_bytes(b"\xff\xd8 not really a JPEG" * 4)
    for transform in (None, T.Compose([T.RandomResizedCrop(8), T.PILToTensor()])):
        ds = coordl.ImageFolder(str(tmp_path / "d"), transform=transform)
        with pytest.raises(UnidentifiedImageError, match=f"cannot identify image file '{bad}'"):
            ds[0]
    for load in (default_loader, pil_loader):
        with pytest.raises(UnidentifiedImageError, match=f"cannot identify image file '{bad}'"):
            load(str(bad))


def test_an_extension_not_built_is_none_and_the_log_says_what_runs_instead(caplog):
    """The optional C extensions load through one helper: one that is not
    there is None (its front module runs PIL), logged with what runs
    instead; a built one is the very module its front module uses."""
    import logging

    from coordl.decode import color, extensions, jpeg, resample

    log = logging.getLogger("coordl.decode.loading-test")
    with caplog.at_level("DEBUG", logger=log.name):
        assert extensions.load("_not_built", log, "PIL runs instead") is None
    assert "coordl.decode._not_built is not available (" in caplog.text, caplog.text
    assert caplog.text.rstrip().endswith("): PIL runs instead"), caplog.text
    for front, name in ((jpeg, "_jpegcrop"), (resample, "_resample"), (color, "_color")):
        assert extensions.load(name, log, "-") is front._ext, name


def test_a_check_against_pil_runs_once_whichever_threads_ask():
    """:func:`extensions.once` runs the check in the first caller only (the
    others wait for its result), and again once its list is emptied."""
    import threading
    import time

    from coordl.decode import extensions

    calls, results = [], []

    def check():
        calls.append(threading.get_ident())
        time.sleep(0.05)  # the other threads arrive meanwhile
        return "rule"

    memo, lock = [], threading.Lock()
    threads = [threading.Thread(target=lambda: results.append(extensions.once(memo, lock, check)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert len(calls) == 1 and results == ["rule"] * 8 and memo == ["rule"]
    memo.clear()
    assert extensions.once(memo, lock, check) == "rule" and len(calls) == 2
