"""torchvision pipelines that draw nothing, picked at random (a fixed seed per
case), through torch's loader and coordl's: the same tensors bit for bit,
or the same error.

Each case writes three images of random sizes (1 to 700 pixels a side) and
kinds (baseline and progressive JPEGs, gray and CMYK JPEGs, PNGs in RGB,
RGBA, P and L) and a Compose of one to three v1 or v2 steps among those
coordl fuses or runs on the decoded planes (resizes of every interpolation,
with max_size and antialias, size None in v2, crops smaller and larger
than the image, pads of every mode, grayscale, flips with p=1, a fixed
blur, a jitter of nothing, a tensor conversion in the middle), then a
tensor conversion and maybe a Normalize.  The two cases of odd
corners such a search found first are tests of their own in
test_torchvision.py (a one-channel image normalized by three means, a
resize to a side of 0)."""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _torchvision import import_torchvision  # noqa: E402

tv = import_torchvision()
if tv is None:
    pytest.skip("torchvision is not installed (pip install coordl[test])", allow_module_level=True)

import torchvision.transforms as V1  # noqa: E402
import torchvision.transforms.v2 as V2  # noqa: E402
from torchvision.datasets import ImageFolder  # noqa: E402

import coordl  # noqa: E402
from coordl.synth import render_image  # noqa: E402

IM = V1.InterpolationMode
KINDS = ["jpeg"] * 4 + ["jpeg_l", "jpeg_cmyk", "png", "png_rgba", "png_p", "png_l", "progressive"]


def _write(R: random.Random, path: str) -> None:
    def side():
        return R.choice([R.randint(1, 12), R.randint(13, 120), R.randint(120, 700)])

    im = render_image(R.randrange(1000), R.randrange(10), side(), side(), 1.5)
    kind = R.choice(KINDS)
    if kind == "jpeg":
        im.save(path + ".jpg", "JPEG", quality=R.choice([75, 90, 95]), subsampling=R.choice([0, 1, 2]))
    elif kind == "progressive":
        im.save(path + ".jpg", "JPEG", quality=90, progressive=True)
    elif kind in ("jpeg_l", "jpeg_cmyk"):
        im.convert("L" if kind == "jpeg_l" else "CMYK").save(path + ".jpg", "JPEG", quality=90)
    elif kind == "png_rgba":
        a = im.convert("RGBA")
        a.putalpha(128)
        a.save(path + ".png")
    else:
        im.convert({"png": "RGB", "png_p": "P", "png_l": "L"}[kind]).save(path + ".png")


def _interpolation(R):
    return R.choice([IM.NEAREST, IM.NEAREST_EXACT, IM.BILINEAR, IM.BICUBIC, IM.BOX, IM.HAMMING, IM.LANCZOS])


def _pipeline(R: random.Random):
    M = R.choice([V1, V2])
    v2 = M is V2
    steps = [M.ToImage()] if v2 and R.random() < 0.5 else []
    for _ in range(R.randint(1, 3)):
        c = R.choice(["resize", "resize", "center", "center_big", "pad", "pad4", "gray", "flip", "vflip", "blur",
                      "jitter", "rgray", "resize_none", "tensor_mid"])
        if c == "resize":
            size = R.choice([R.randint(1, 80), (R.randint(1, 80), R.randint(1, 80))])
            kw = {}
            if isinstance(size, int) and R.random() < 0.3:
                kw["max_size"] = size + R.randint(1, 40)
            if R.random() < 0.3:
                kw["antialias"] = R.choice([True, False])
            steps.append(M.Resize(size, interpolation=_interpolation(R), **kw))
        elif c == "center":
            steps.append(M.CenterCrop(R.choice([R.randint(1, 90), (R.randint(1, 90), R.randint(1, 90))])))
        elif c == "center_big":
            steps.append(M.CenterCrop(R.randint(100, 800)))
        elif c == "pad":
            steps.append(M.Pad(R.choice([R.randint(0, 5), [R.randint(0, 3), R.randint(0, 3)]]),
                               fill=R.choice([0, 7, 255]),
                               padding_mode=R.choice(["constant", "edge", "reflect", "symmetric"])))
        elif c == "pad4":
            steps.append(M.Pad([R.randint(0, 4) for _ in range(4)], fill=R.choice([0, (10, 20, 30)]),
                               padding_mode=R.choice(["constant", "edge", "reflect", "symmetric"])))
        elif c == "gray":
            steps.append(M.Grayscale(num_output_channels=R.choice([1, 3])))
        elif c == "flip":
            steps.append(M.RandomHorizontalFlip(p=1.0))
        elif c == "vflip":
            steps.append(M.RandomVerticalFlip(p=1.0))
        elif c == "blur":
            s = R.uniform(0.1, 2.0)
            steps.append(M.GaussianBlur(R.choice([3, 5]), sigma=(s, s)))
        elif c == "jitter":
            steps.append(M.ColorJitter(0, 0, 0, 0))
        elif c == "rgray":
            steps.append(M.RandomGrayscale(p=1.0))
        elif c == "resize_none" and v2:
            steps.append(M.Resize(None, max_size=R.randint(2, 90), interpolation=_interpolation(R)))
        elif c == "tensor_mid" and not v2 and not any(isinstance(s, (M.PILToTensor, M.ToTensor)) for s in steps):
            steps.append(M.PILToTensor())
    if v2:
        if not any(isinstance(s, M.ToImage) for s in steps):
            steps.append(M.ToImage())
        steps.append(M.ToDtype(torch.float32, scale=True))
    elif any(isinstance(s, M.PILToTensor) for s in steps):
        steps.append(M.ConvertImageDtype(torch.float32))
    else:
        steps.append(R.choice([M.ToTensor(), M.PILToTensor()]))
    if R.random() < 0.5 and not (not v2 and isinstance(steps[-1], M.PILToTensor)):
        steps.append(M.Normalize([0.485] * 3, [0.229] * 3))
    return M.Compose(steps)


def _through(cls, root, tf, **kw):
    try:
        return [x for x, _ in cls(ImageFolder(root, tf), batch_size=1, **kw)]
    except Exception as e:  # noqa: BLE001 - compared with the other loader's
        return e


@pytest.mark.parametrize("case", range(48))
def test_a_random_pipeline_that_draws_nothing_gives_torchs_tensors_or_its_error(tmp_path, case):
    R = random.Random(1000 + case)
    root = str(tmp_path / "photos")
    for k in range(3):
        os.makedirs(os.path.join(root, "ab"[k % 2]), exist_ok=True)
        _write(R, os.path.join(root, "ab"[k % 2], f"im{k}"))
    tf = _pipeline(R)
    want = _through(torch.utils.data.DataLoader, root, tf)
    got = _through(coordl.DataLoader, root, tf, num_workers=R.choice([0, 2]))
    if isinstance(want, Exception):
        # coordl's SampleError is the same class (a subclass of it) and carries torch's message
        assert isinstance(got, type(want)) and str(want).split("\n")[0] in str(got), (tf, want, got)
        return
    assert not isinstance(got, Exception), (tf, got)
    assert len(got) == len(want)
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (tf, a.shape, b.shape)
