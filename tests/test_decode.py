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
