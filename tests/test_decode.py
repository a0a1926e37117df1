"""The fused decode path: bytes -> tensor with the same random draws as PIL."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

import coordl
from coordl import _decode, _rng
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
    assert _decode._pow2_scale((800, 600), (100, 100)) == 4
    assert _decode._pow2_scale((800, 600), (300, 300)) == 2
    assert _decode._pow2_scale((800, 600), (500, 100)) == 1
    raw = _jpeg(800, 600)
    assert _decode.decode_rgb(raw, min_hw=(100, 100)).shape == (150, 200, 3)
    assert _decode.decode_rgb(raw).shape == (600, 800, 3)


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


# ------------------------------------------------ PIL's switches (issue 7 16b, 17)
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
             ("simplejpeg-dct-scaled", lambda raw: _decode.decode_rgb(raw, min_hw=(16, 16))),
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
