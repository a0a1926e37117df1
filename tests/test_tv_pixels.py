"""coordl's pixels against torchvision's (PIL backend), value by value.

With only the DataLoader import changed, a torchvision pipeline must give
torchvision's output within the tolerance docs/guide/torchvision.md states for each fused
step (at most 1 uint8 level; the PIL-image resizes are exact), on small,
ImageNet-sized and large images whose sides are not multiples of 8: the eval
presets (Resize + CenterCrop, bilinear and bicubic, timm's crop_pct), and
training crops (RandomResizedCrop: the same draws give the same pixels).
The reduced-scale JPEG decode is an explicit option (``jpeg_draft``, or
``draft=True`` on coordl's transforms), never for nearest or unfiltered
resizes, with the geometry of the full-size image, and named in
``path_reason``.  torchvision is loaded through tests/_torchvision.py."""
import io
import math
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _torchvision import import_torchvision  # noqa: E402

tv = import_torchvision()
if tv is None:
    pytest.skip("torchvision is not installed (pip install coordl[test])", allow_module_level=True)

from torchvision import datasets as D  # noqa: E402
from torchvision import transforms as V1  # noqa: E402
from torchvision.transforms import functional as F1  # noqa: E402
from torchvision.transforms import v2 as V2  # noqa: E402
from torchvision.transforms.v2 import functional as F2  # noqa: E402

import coordl  # noqa: E402
import coordl.decode.jpeg  # noqa: E402
from coordl import _rng  # noqa: E402
from coordl import transforms as T  # noqa: E402
from coordl.decode import resample as R  # noqa: E402
from coordl.decode.ops import _draw_box  # noqa: E402
from coordl.synth import render_image  # noqa: E402
from coordl.tvcompat import translate  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
IM = V1.InterpolationMode
# (width, height): small, ImageNet-sized landscape and portrait, large; no side a multiple of 8
SIZES = [(67, 45), (499, 373), (373, 499), (2001, 1499)]


def _jpeg(w, h, k, quality=90):
    buf = io.BytesIO()
    render_image(7, k, w, h, 1.5).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An ImageFolder of one image per size (two classes)."""
    root = tmp_path_factory.mktemp("pixels") / "photos"
    for k, (w, h) in enumerate(SIZES):
        d = root / f"class_{k % 2}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"img_{k}_{w}x{h}.jpg").write_bytes(_jpeg(w, h, k))
    return str(root)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _pil(path):
    with Image.open(path) as img:
        return img.convert("RGB")


@pytest.fixture(scope="module")
def images(folder):
    return [D.ImageFolder(folder).samples[i][0] for i in range(len(SIZES))]


def _levels(a: torch.Tensor, b: torch.Tensor, normalized: bool) -> float:
    """The largest difference between two images in uint8 levels."""
    assert a.shape == b.shape, (a.shape, b.shape)
    d = (a.double() - b.double()).abs()
    if normalized:  # Normalize divided by std after ToTensor's 1/255
        d = d * torch.tensor(STD, dtype=torch.float64).view(-1, 1, 1) * 255
    elif a.is_floating_point():
        d = d * 255
    return float(d.max())


def _timm_eval(crop_pct, interpolation):
    """timm's eval transform for a 224 input (create_transform, is_training=False):
    Resize(floor(224 / crop_pct)), CenterCrop(224), ToTensor, Normalize."""
    return V1.Compose([V1.Resize(math.floor(224 / crop_pct), interpolation=interpolation), V1.CenterCrop(224),
                       V1.ToTensor(), V1.Normalize(MEAN, STD)])


EVAL = {
    "resize256-crop224-bilinear": V1.Compose([V1.Resize(256), V1.CenterCrop(224), V1.ToTensor(),
                                              V1.Normalize(MEAN, STD)]),
    "resize256-crop224-bicubic": V1.Compose([V1.Resize(256, interpolation=IM.BICUBIC), V1.CenterCrop(224),
                                             V1.ToTensor(), V1.Normalize(MEAN, STD)]),
    "timm-bilinear-0.875": _timm_eval(0.875, IM.BILINEAR),
    "timm-bicubic-0.95": _timm_eval(0.95, IM.BICUBIC),
    "v2-resize256-crop224-bicubic": V2.Compose([V2.Resize(256, interpolation=IM.BICUBIC), V2.CenterCrop(224),
                                                V2.ToImage(), V2.ToDtype(torch.float32, scale=True),
                                                V2.Normalize(MEAN, STD)]),
    # on a uint8 tensor (v2 as its docs write it): torch's kernels, as torchvision runs them
    "v2-tensor-resize256-crop224": V2.Compose([V2.ToImage(), V2.Resize(256), V2.CenterCrop(224),
                                               V2.ToDtype(torch.float32, scale=True), V2.Normalize(MEAN, STD)]),
    "v2-tensor-bicubic": V2.Compose([V2.ToImage(), V2.Resize(256, interpolation=IM.BICUBIC), V2.CenterCrop(224),
                                     V2.ToDtype(torch.uint8)]),
    "v2-tensor-bicubic-no-antialias": V2.Compose([V2.ToImage(), V2.Resize(256, interpolation=IM.BICUBIC,
                                                                          antialias=False),
                                                  V2.CenterCrop(224), V2.ToDtype(torch.uint8)]),
    "v1-tensor-bilinear": V1.Compose([V1.PILToTensor(), V1.Resize(256), V1.CenterCrop(224)]),
    # no filtering asked for: never a reduced-scale decode
    "v2-tensor-nearest": V2.Compose([V2.ToImage(), V2.Resize(256, interpolation=IM.NEAREST), V2.CenterCrop(224),
                                     V2.ToDtype(torch.uint8)]),
    "v2-tensor-nearest-exact": V2.Compose([V2.ToImage(), V2.Resize(256, interpolation=IM.NEAREST_EXACT),
                                           V2.CenterCrop(224), V2.ToDtype(torch.uint8)]),
    "v1-tensor-no-antialias": V1.Compose([V1.PILToTensor(), V1.Resize(256, antialias=False), V1.CenterCrop(224)]),
}


@pytest.mark.parametrize("name", list(EVAL))
def test_eval_pipelines_give_torchvisions_pixels(folder, name):
    """The loader's batches against torchvision's own ``dataset[i]``, value
    by value, on every image size."""
    ds = D.ImageFolder(folder, transform=EVAL[name])
    L = coordl.DataLoader(ds, batch_size=1, shuffle=False)
    assert L.stats().path == "coordl" and "reduced-scale" not in L.stats().path_reason
    normalized = "Normalize" in repr(EVAL[name])
    worst = {}
    for i, (x, y) in enumerate(L):
        ref, ry = ds[i]
        assert int(y) == ry
        worst[os.path.basename(ds.samples[i][0])] = _levels(x[0], ref, normalized)
    assert max(worst.values()) <= 1 + 1e-3, worst


def _rrc_reference(pil, box, flip, interpolation, kind):
    """torchvision's RandomResizedCrop + flip + conversion with the given draws."""
    if kind == "v1":
        x = F1.resized_crop(pil, *box, [224, 224], interpolation)
        x = F1.hflip(x) if flip else x
        return F1.normalize(F1.to_tensor(x), MEAN, STD)
    x = F2.to_image(pil)  # v2 as its docs write it: the crop on the uint8 tensor
    x = F2.resized_crop(x, *box, [224, 224], interpolation, antialias=True)
    x = F2.horizontal_flip(x) if flip else x
    return F2.normalize(F2.to_dtype(x, torch.float32, scale=True), MEAN, STD)


@pytest.mark.parametrize("kind", ["v1", "v2"])
@pytest.mark.parametrize("interpolation", [IM.BILINEAR, IM.BICUBIC], ids=["bilinear", "bicubic"])
def test_training_crops_same_draws_same_pixels(images, interpolation, kind):
    """RandomResizedCrop + flip + ToTensor + Normalize: coordl's fused decode
    of sample k draws its box and flip from the sample's generator; torchvision
    given the same box and flip gives the same pixels within 1 level."""
    if kind == "v1":
        tf = V1.Compose([V1.RandomResizedCrop(224, interpolation=interpolation), V1.RandomHorizontalFlip(),
                         V1.ToTensor(), V1.Normalize(MEAN, STD)])
    else:
        tf = V2.Compose([V2.ToImage(), V2.RandomResizedCrop(224, interpolation=interpolation),
                         V2.RandomHorizontalFlip(), V2.ToDtype(torch.float32, scale=True),
                         V2.Normalize(MEAN, STD)])
    fused, names, rest = translate(tf)
    assert rest == (), rest
    rrc = fused.transforms[0]
    worst = 0.0
    for path in images:
        raw = _read(path)
        pil = _pil(path)
        n = 4 if pil.width > 1000 else 10
        for k in range(n):
            with _rng.sample_rng(11, 0, k):
                got = fused.from_bytes(raw)
            g = _rng.derive(11, 0, k)
            box = _draw_box(pil.height, pil.width, rrc.scale, rrc.ratio, g)
            flip = g.random() < 0.5
            ref = _rrc_reference(pil, box, flip, interpolation, kind)
            worst = max(worst, _levels(got, ref, normalized=True))
            assert worst <= 1 + 1e-3, (path, k, box, flip, worst)


def test_coordl_transforms_fused_are_their_own_pil_result(images):
    """coordl's own Resize/RandomResizedCrop (bilinear and bicubic): the fused
    decode gives what the same transforms give on PIL's decode, which is
    torchvision's result (crop, then resize)."""
    for mode in ("bilinear", "bicubic"):
        pipes = [T.Compose([T.Resize(256, mode), T.CenterCrop(224), T.PILToTensor()]),
                 T.Compose([T.RandomResizedCrop(224, interpolation=mode), T.RandomHorizontalFlip(),
                            T.PILToTensor()])]
        for path in images:
            raw = _read(path)
            pil = _pil(path)
            for pipe in pipes:
                for k in range(3):
                    with _rng.sample_rng(2, 1, k):
                        got = pipe.from_bytes(raw)
                    with _rng.sample_rng(2, 1, k):
                        ref = pipe(pil)
                    assert torch.equal(got, ref), (path, pipe, k, _levels(got, ref, False))
        g = _rng.derive(0, 0, 0)
        box = _draw_box(pil.height, pil.width, (0.08, 1.0), (3 / 4, 4 / 3), g)
        want = F1.pil_to_tensor(F1.resized_crop(pil, *box, [224, 224], IM(mode)))
        assert torch.equal(F1.pil_to_tensor(T.resized_crop(pil, *box, (224, 224), mode)), want)


# ---------------------------------------------------------------- the kernel
def test_resampling_is_pils_bit_for_bit():
    """pil_resize against PIL's own resize: both filters, up and down,
    either pass first, slices of a larger image, fractional boxes, 1 and 3
    channels."""
    rng = np.random.default_rng(5)
    for it in range(250):
        h, w = (int(v) for v in rng.integers(1, 160, 2))
        oh, ow = (int(v) for v in rng.integers(1, 160, 2))
        c = 1 if it % 5 == 0 else 3
        base = rng.integers(0, 256, (h + 9, w + 7, c), dtype=np.uint8)
        a = base[4:4 + h, 3:3 + w]  # a view, as the fused path hands it over
        img = Image.fromarray(np.ascontiguousarray(a[..., 0] if c == 1 else a))
        for mode, pil_filter in (("bilinear", Image.BILINEAR), ("bicubic", Image.BICUBIC)):
            ref = np.asarray(img.resize((ow, oh), pil_filter))
            got = R.pil_resize(a, (oh, ow), mode)
            assert got.shape == (oh, ow, c)
            assert np.array_equal(got[..., 0] if c == 1 else got, ref), (h, w, oh, ow, mode)
            if h > 2 and w > 2:
                box = tuple(float(np.float32(v)) for v in (
                    rng.uniform(0, w / 2), rng.uniform(0, h / 2), rng.uniform(w / 2 + 1, w), rng.uniform(h / 2 + 1, h)))
                ref = np.asarray(img.resize((ow, oh), pil_filter, box=box))
                got = R.pil_resize(a, (oh, ow), mode, box=box)
                assert np.array_equal(got[..., 0] if c == 1 else got, ref), (h, w, oh, ow, mode, box)


def test_the_extension_reproduces_this_pil():
    """The probe found the pass-order rule of the installed PIL (so the fast
    kernel is the one in use where the extension is built)."""
    if R._ext is None:
        pytest.skip("coordl.decode._resample is not built here")
    assert R.exact_kernel() is not None


def test_without_the_extension_pil_resizes(monkeypatch):
    monkeypatch.setattr(R, "_rule", [None])
    a = np.random.default_rng(1).integers(0, 256, (90, 70, 3), dtype=np.uint8)
    for mode, f in (("bilinear", Image.BILINEAR), ("bicubic", Image.BICUBIC)):
        assert np.array_equal(R.pil_resize(a, (40, 50), mode), np.asarray(Image.fromarray(a).resize((50, 40), f)))


def test_a_window_of_a_resize_is_the_whole_resizes_pixels_there():
    """The extension's windows (what Resize + CenterCrop resamples): any
    window of any resize (boxes with fractions, up and down, either pass
    first, a pass skipped), computed from a part of the image holding what
    ``span`` says it needs (plus a margin), equals that window of the whole
    resize; a part without those pixels is refused, never read past."""
    if R._ext is None or not hasattr(R._ext, "resample_window"):
        pytest.skip("coordl.decode._resample (with windows) is not built here")
    ext = R._ext
    rng = np.random.default_rng(11)
    for it in range(600):
        h, w = (int(v) for v in rng.integers(1, 70, 2))
        oh, ow = (h, w) if it % 7 == 0 else tuple(int(v) for v in rng.integers(1, 80, 2))
        c = 1 if it % 5 == 0 else 3
        a = rng.integers(0, 256, (h, w, c), dtype=np.uint8)
        if it % 2 or h < 2 or w < 2:
            box = (0.0, 0.0, float(w), float(h))
        else:
            x0, y0 = rng.uniform(0, w - 1), rng.uniform(0, h - 1)
            box = tuple(float(np.float32(v)) for v in (x0, y0, rng.uniform(x0 + 0.5, w), rng.uniform(y0 + 0.5, h)))
        f, vfirst = int(rng.integers(0, 2)), int(rng.integers(0, 2))
        whole = np.empty((oh, ow, c), np.uint8)
        ext.resample(a, whole, *box, f, vfirst)
        wh, ww = int(rng.integers(1, oh + 1)), int(rng.integers(1, ow + 1))
        wy, wx = int(rng.integers(0, oh - wh + 1)), int(rng.integers(0, ow - ww + 1))
        skip_x = (ow, box[0], box[2]) == (w, 0.0, float(w))
        skip_y = (oh, box[1], box[3]) == (h, 0.0, float(h))
        xs = (wx, wx + ww) if skip_x else ext.span(w, box[0], box[2], ow, f, wx, wx + ww)
        ys = (wy, wy + wh) if skip_y else ext.span(h, box[1], box[3], oh, f, wy, wy + wh)
        m = int(rng.integers(0, 3))
        y0, x0 = max(0, ys[0] - m), max(0, xs[0] - m)
        part = a[y0:min(h, ys[1] + m), x0:min(w, xs[1] + m)]
        out = np.empty((wh, ww, c), np.uint8)
        ext.resample_window(part, out, *box, f, vfirst, (h, w), (y0, x0), (oh, ow), (wy, wx))
        assert np.array_equal(out, whole[wy:wy + wh, wx:wx + ww]), (h, w, oh, ow, box, f, vfirst, wy, wx, wh, ww)
    a = rng.integers(0, 256, (50, 50, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="outside src"):
        ext.resample_window(a[10:20, 10:20], np.empty((5, 5, 3), np.uint8), 0.0, 0.0, 50.0, 50.0, 0, 0,
                            (50, 50), (10, 10), (30, 30), (0, 0))


@pytest.mark.parametrize("interpolation", [IM.BILINEAR, IM.BICUBIC], ids=["bilinear", "bicubic"])
def test_resize_then_center_crop_resamples_and_decodes_only_the_crop(images, monkeypatch, interpolation):
    """Resize + CenterCrop decodes only the rows and columns the crop
    depends on and resamples only the crop, with the pixels of the whole
    resize then the crop (the same as with windows turned off, and PIL's)."""
    if R.window_kernel() is None:
        pytest.skip("coordl.decode._resample (with windows) is not built here")
    steps = [T.Resize(256, interpolation=interpolation.value), T.CenterCrop(224), T.PILToTensor()]
    boxes = []
    real = coordl.decode.jpeg.decode_rgb_crop
    monkeypatch.setattr(coordl.decode.jpeg, "decode_rgb_crop", lambda raw, box, **kw: (boxes.append(box), real(raw, box, **kw))[1])
    for path in images:
        raw = _read(path)
        boxes.clear()
        got = T.decode_and_apply(steps, raw)
        with _pil(path) as img:
            oh, ow = steps[0].output_size(img.height, img.width)
            ref = np.asarray(img.resize((ow, oh), getattr(Image, interpolation.name)))
            top, left = int(round((oh - 224) / 2.0)), int(round((ow - 224) / 2.0))
            ref = torch.from_numpy(ref[top:top + 224, left:left + 224].copy()).permute(2, 0, 1)
            H, W = img.height, img.width
        assert torch.equal(got, ref), path
        if (oh, ow) != (224, 224):   # a crop smaller than the resize: part of the image is not read
            assert len(boxes) == 1 and boxes[0][2] * boxes[0][3] < H * W, (path, boxes)
        with monkeypatch.context() as m:
            m.setattr(R, "window_kernel", lambda: None)
            assert torch.equal(T.decode_and_apply(steps, raw), got)


@pytest.mark.parametrize("kind", ["v1", "v2"])
@pytest.mark.parametrize("interpolation", [IM.BILINEAR, IM.BICUBIC], ids=["bilinear", "bicubic"])
def test_resize_then_random_crop_resamples_and_decodes_only_the_crop(images, monkeypatch, interpolation, kind):
    """Resize + RandomCrop (the older ImageNet training recipe, ``Resize(256),
    RandomCrop(224)``) draws its window from the sample's generator as the
    crop draws it, decodes only the rows and columns the window depends on
    and resamples only the window: torchvision's pixels for those draws
    (the whole resize, then the crop, then the flip), bit for bit, and the
    same as with windows turned off."""
    if R.window_kernel() is None:
        pytest.skip("coordl.decode._resample (with windows) is not built here")
    M = V1 if kind == "v1" else V2
    fused, names, rest = translate(M.Compose([M.Resize(256, interpolation=interpolation), M.RandomCrop(224),
                                              M.RandomHorizontalFlip(), M.PILToTensor()]))
    assert rest == () and names[:2] == ("Resize", "RandomCrop"), (names, rest)
    boxes = []
    real = coordl.decode.jpeg.decode_rgb_crop
    monkeypatch.setattr(coordl.decode.jpeg, "decode_rgb_crop", lambda raw, box, **kw: (boxes.append(box), real(raw, box, **kw))[1])
    for path in images[1:]:
        raw = _read(path)
        with _pil(path) as img:
            oh, ow = fused.transforms[0].output_size(img.height, img.width)
            resized = img.resize((ow, oh), getattr(Image, interpolation.name))
            H, W = img.height, img.width
        for k in range(4):
            boxes.clear()
            with _rng.sample_rng(5, 0, k):
                got = fused.from_bytes(raw)
            g = _rng.derive(5, 0, k)
            top, left = g.randint(0, oh - 224), g.randint(0, ow - 224)
            want = F1.pil_to_tensor(F1.crop(resized, top, left, 224, 224))
            want = want.flip(-1) if g.random() < 0.5 else want
            assert torch.equal(got, want), (path, k)
            assert len(boxes) == 1 and boxes[0][2] * boxes[0][3] < H * W, (path, boxes)
            with monkeypatch.context() as m, _rng.sample_rng(5, 0, k):
                m.setattr(R, "window_kernel", lambda: None)
                assert torch.equal(fused.from_bytes(raw), got)


@pytest.mark.parametrize("crop", ["center", "random", "random_padding_0", "random_too_large"])
def test_a_crop_first_decodes_only_the_crop(images, monkeypatch, crop):
    """A CenterCrop or an unpadded RandomCrop as the first step of a JPEG's
    pipeline decodes only the rows and columns around its window: the whole
    decode's pixels there, the crop's own draws; a crop larger than the
    image draws nothing and fails as torchvision's does."""
    size = 2100 if crop == "random_too_large" else 96
    step = V1.CenterCrop(size) if crop == "center" else \
        V1.RandomCrop(size, padding=0 if crop == "random_padding_0" else None)
    fused, names, rest = translate(V1.Compose([step, V1.RandomHorizontalFlip(), V1.PILToTensor()]))
    assert rest == () and names[0] == type(step).__name__, (names, rest)
    boxes = []
    real = coordl.decode.jpeg.decode_rgb_crop
    monkeypatch.setattr(coordl.decode.jpeg, "decode_rgb_crop", lambda raw, box, **kw: (boxes.append(box), real(raw, box, **kw))[1])
    for path in images[1:]:
        raw, pil = _read(path), _pil(path)
        for k in range(3):
            boxes.clear()
            if crop == "random_too_large":
                with _rng.sample_rng(5, 0, k), pytest.raises(ValueError, match="larger than input image size"):
                    fused.from_bytes(raw)
                assert not boxes
                continue
            with _rng.sample_rng(5, 0, k):
                got = fused.from_bytes(raw)
            g = _rng.derive(5, 0, k)
            if crop == "center":
                want = F1.pil_to_tensor(F1.center_crop(pil, [size]))
            else:
                top, left = g.randint(0, pil.height - size), g.randint(0, pil.width - size)
                want = F1.pil_to_tensor(F1.crop(pil, top, left, size, size))
            want = want.flip(-1) if g.random() < 0.5 else want
            assert torch.equal(got, want), (path, k)
            assert len(boxes) == 1 and boxes[0][2:] == (size, size), (path, boxes)


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_a_crop_first_of_a_gray_or_cmyk_jpeg_is_pils_rgb_crop(images, mode):
    """The window decode of a crop first converts a gray or CMYK JPEG as
    PIL's ``convert("RGB")`` does: the same pixels as torchvision's crop of
    the folder's RGB image."""
    with Image.open(images[1]) as im:
        buf = io.BytesIO()
        im.convert("RGB").convert(mode).save(buf, "JPEG", quality=90)
    raw = buf.getvalue()
    with Image.open(io.BytesIO(raw)) as im:
        pil = im.convert("RGB")
    for step in (V1.CenterCrop(40), V1.RandomCrop(40)):
        fused = translate(V1.Compose([step, V1.PILToTensor()]))[0]
        with _rng.sample_rng(1, 0, 3):
            got = fused.from_bytes(raw)
        if type(step) is V1.CenterCrop:
            want = F1.pil_to_tensor(F1.center_crop(pil, [40]))
        else:
            g = _rng.derive(1, 0, 3)
            top, left = g.randint(0, pil.height - 40), g.randint(0, pil.width - 40)
            want = F1.pil_to_tensor(F1.crop(pil, top, left, 40, 40))
        assert torch.equal(got, want), (mode, step)


# ---------------------------------------------------------- the draft option
def test_draft_is_an_explicit_option_named_in_path_reason(folder):
    tf = EVAL["resize256-crop224-bilinear"]
    ds = D.ImageFolder(folder, transform=tf)
    plain = coordl.DataLoader(ds, batch_size=1)
    draft = coordl.DataLoader(ds, batch_size=1, jpeg_draft=True)
    assert "reduced-scale" not in plain.stats().path_reason
    assert "reduced-scale JPEG decode before Resize" in draft.stats().path_reason, draft.stats().path_reason
    a, b = [x for x, _ in plain], [x for x, _ in draft]
    sizes = [_pil(p).size for p, _ in ds.samples]
    for (w, h), x, y in zip(sizes, a, b):
        if min(w, h) >= 512:  # at least twice the 256 of Resize: decoded at a reduced scale
            assert _levels(x[0], y[0], normalized=True) > 2
        else:  # decoded at full size either way
            assert torch.equal(x, y)
    # coordl's own transforms: the same option, and the same note
    ours = coordl.ImageFolder(folder, transform=T.Compose([T.Resize(256, draft=True), T.CenterCrop(224),
                                                           T.ToTensor()]))
    assert "reduced-scale JPEG decode before Resize" in coordl.DataLoader(ours, batch_size=1).stats().path_reason


@pytest.mark.parametrize("tf", [
    V2.Compose([V2.ToImage(), V2.Resize(256, interpolation=IM.NEAREST), V2.CenterCrop(224),
                V2.ToDtype(torch.uint8)]),
    V1.Compose([V1.PILToTensor(), V1.Resize(256, antialias=False), V1.CenterCrop(224)]),
], ids=["nearest", "no-antialias"])
def test_draft_never_for_unfiltered_resizes(folder, tf):
    ds = D.ImageFolder(folder, transform=tf)
    L = coordl.DataLoader(ds, batch_size=1, jpeg_draft=True)
    assert "jpeg_draft=True has no effect" in L.stats().path_reason, L.stats().path_reason
    for i, (x, _) in enumerate(L):
        assert _levels(x[0], ds[i][0], normalized=False) <= 1
    for kw in (dict(interpolation="nearest"), dict(interpolation="nearest-exact"), dict(antialias=False),
               dict(antialias=None)):
        with pytest.raises(ValueError, match="draft should be False"):
            T.Resize(64, draft=True, **kw)
        with pytest.raises(ValueError, match="draft should be False"):
            T.RandomResizedCrop(64, draft=True, **kw)
    with pytest.raises(TypeError, match="jpeg_draft should be a bool"):
        coordl.DataLoader(ds, jpeg_draft="yes")


def _edge_jpeg(w, h, x_edge, y_edge):
    """Black, with white right of column ``x_edge`` and below row ``y_edge``
    (a 4:4:4 JPEG of high quality: the edges stay where they are)."""
    a = np.zeros((h, w, 3), np.uint8)
    a[:, x_edge:] = 255
    a[y_edge:, :] = 255
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=98, subsampling=0)
    return buf.getvalue()


def _crossing(profile: np.ndarray) -> float:
    """Where a rising edge profile crosses half its height (linear between samples)."""
    lo, hi = profile.min(), profile.max()
    mid = (lo + hi) / 2
    i = int(np.argmax(profile >= mid))
    return i - 1 + (mid - profile[i - 1]) / (profile[i] - profile[i - 1])


@pytest.mark.parametrize("pipe", ["resize", "random-resized-crop"])
def test_draft_keeps_the_full_size_geometry(pipe):
    """An image whose sides are not multiples of the DCT scale (1001 x 745),
    decoded at 1/8: edges near the right and
    bottom come out where torchvision puts them (the scaled image is not
    stretched over its padding pixels)."""
    W, H, xe, ye = 1001, 745, 930, 700
    raw = _edge_jpeg(W, H, xe, ye)
    pil = Image.open(io.BytesIO(raw)).convert("RGB")
    if pipe == "resize":
        ours = T.Compose([T.Resize((93, 124), draft=True), T.PILToTensor()])
        assert coordl.decode.jpeg.draft_scale((H, W), (93, 124)) == 8
        got = ours.from_bytes(raw)
        ref = F1.pil_to_tensor(F1.resize(pil, [93, 124]))
    else:
        rrc = T.RandomResizedCrop((36, 36), scale=(0.5, 0.5), ratio=(1.0, 1.0), draft=True)
        ours = T.Compose([rrc, T.PILToTensor()])
        k = next(k for k in range(200) if (lambda b: b[0] + b[2] > ye + 20 and b[1] + b[3] > xe + 20)(
            _draw_box(H, W, rrc.scale, rrc.ratio, _rng.derive(0, 0, k))))
        box = _draw_box(H, W, rrc.scale, rrc.ratio, _rng.derive(0, 0, k))
        assert coordl.decode.jpeg.draft_scale(box[2:], (36, 36)) == 8
        with _rng.sample_rng(0, 0, k):
            got = ours.from_bytes(raw)
        ref = F1.pil_to_tensor(F1.resized_crop(pil, *box, [36, 36]))
    g, r = got[0].double().numpy(), ref[0].double().numpy()
    # along a row above the bottom edge and a column left of the right one
    for a, b in ((g[2, :], r[2, :]), (g[:, 2], r[:, 2])):
        assert abs(_crossing(a) - _crossing(b)) < 0.15, (_crossing(a), _crossing(b))


# ------------------------------------------------------ the decoders' checks
def test_a_window_decoder_that_differs_from_pil_is_not_used(monkeypatch, caplog):
    """The window decoder runs the system libjpeg, not PIL's: checked against
    PIL's decode when coordl is imported, and not used where it differs."""
    from coordl.decode import jpeg as J

    if J._ext is None:
        pytest.skip("coordl.decode._jpegcrop is not built here")
    assert J._load_crop() is J._ext  # it agrees here
    real = J._ext

    class OffByOne:
        def decode(self, *a):
            buf, *rest = real.decode(*a)
            buf = bytearray(buf)
            buf[len(buf) // 2] ^= 1
            return (buf, *rest)

    monkeypatch.setattr(J, "_ext", OffByOne())
    with caplog.at_level("WARNING", logger=J.__name__):
        assert J._load_crop() is None
    assert "does not decode as PIL does" in caplog.text
    assert J._fast_agrees()  # and simplejpeg gives PIL's pixels here


def test_jpeg_draft_on_another_dataset_warns(folder):
    ds = coordl.ImageFolder(folder, transform=T.Compose([T.Resize(64), T.PILToTensor()]))
    with pytest.warns(UserWarning, match="jpeg_draft=True applies to torchvision's"):
        L = coordl.DataLoader(ds, batch_size=1, jpeg_draft=True)
    assert "reduced-scale" not in L.stats().path_reason


V2_CONVERSIONS = {
    "ToImage+ToDtype": [V2.ToImage(), V2.ToDtype(torch.float32, scale=True)],
    "ToImage+ToDtype+Normalize": [V2.ToImage(), V2.ToDtype(torch.float32, scale=True), V2.Normalize(MEAN, STD)],
    "PILToTensor+ToDtype+Normalize": [V2.PILToTensor(), V2.ToDtype(torch.float32, scale=True),
                                      V2.Normalize(MEAN, STD)],
    "ToImage+ConvertImageDtype": [V2.ToImage(), V2.ConvertImageDtype(torch.float32)],
    "v1 PILToTensor+ConvertImageDtype+Normalize": [V1.PILToTensor(), V1.ConvertImageDtype(torch.float32),
                                                   V1.Normalize(MEAN, STD)],
}


@pytest.mark.parametrize("name", list(V2_CONVERSIONS))
def test_conversions_to_float_are_torchvisions_bit_for_bit(folder, name):
    """v2's ToDtype(scale=True) multiplies by 1/255 where ToTensor and v1's
    ConvertImageDtype divide by 255 (126 of the 256 values differ in
    float32): each conversion is torchvision's own arithmetic, bit for bit,
    after a PIL-exact crop."""
    M = V1 if name.startswith("v1") else V2
    ds = D.ImageFolder(folder, transform=M.Compose([M.CenterCrop(48)] + V2_CONVERSIONS[name]))
    L = coordl.DataLoader(ds, batch_size=1, shuffle=False)
    assert L.stats().path == "coordl"
    for i, (x, _) in enumerate(L):
        ref, _ = ds[i]
        assert x[0].dtype == ref.dtype and torch.equal(x[0], ref.as_subclass(torch.Tensor)), (name, i)


def test_the_device_tail_of_a_v2_conversion_is_torchvisions_bit_for_bit():
    """The device split's and decode="device"'s tail for v2's ToImage +
    ToDtype(scale=True) + Normalize (a multiply by 1/255 with a float32
    tensor) against torchvision's own, for every uint8 value; ToTensor's
    tail divides, as v1 does.  tests/test_cuda.py runs it on a GPU."""
    from coordl.device.split import DeviceTail

    x = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(3, 16, 16).contiguous()
    v2 = V2.Normalize(MEAN, STD)(V2.ToDtype(torch.float32, scale=True)(V2.ToImage()(x)))
    v1 = V1.Normalize(MEAN, STD)(V1.ConvertImageDtype(torch.float32)(x))
    norm = [T.Normalize(MEAN, STD)]
    assert torch.equal(DeviceTail(norm, reciprocal=True)(x), v2.as_subclass(torch.Tensor))
    assert torch.equal(DeviceTail(norm)(x), v1)
    assert not torch.equal(v1, v2.as_subclass(torch.Tensor))      # the two arithmetics do differ


PADDED = {"cifar": dict(padding=4), "reflect": dict(padding=(3, 7), padding_mode="reflect"),
          "edge_needed": dict(padding=2, pad_if_needed=True, padding_mode="edge"),
          "fill_needed": dict(padding=(1, 2, 3, 4), pad_if_needed=True, fill=(255, 128.7, 3)),
          "symmetric_needed": dict(padding=5, pad_if_needed=True, padding_mode="symmetric")}


# v2 pads once by padding and what is needed, which a reflection tells apart: not fused (the test below)
@pytest.mark.parametrize("case,kind", [(c, k) for c in PADDED for k in ("v1", "v2")
                                       if (c, k) != ("symmetric_needed", "v2")])
def test_a_padded_random_crop_fuses_with_torchvisions_pixels(images, case, kind):
    """``RandomCrop(size, padding=4)`` (the CIFAR-style recipe) and its
    other paddings on a PIL image fuse: coordl's decode of sample k draws
    its window from the sample's generator, and torchvision's own pad of
    the PIL image (then, where needed, its pads of the width and the
    height), cropped at that window, flipped and converted, gives the same
    values bit for bit; a crop larger than the image pads where
    ``pad_if_needed`` asks."""
    kw = PADDED[case]
    M, F = (V1, F1) if kind == "v1" else (V2, F2)
    size = 600 if "needed" in case else 40
    tf = M.Compose([M.RandomCrop(size, **kw), M.RandomHorizontalFlip(), M.PILToTensor()])
    fused, names, rest = translate(tf)
    assert rest == () and names[0] == "RandomCrop", (names, rest)
    for path in images[:3]:
        raw, pil = _read(path), _pil(path)
        mode = kw.get("padding_mode", "constant")
        padded = F1.pad(pil, list(kw["padding"]) if isinstance(kw["padding"], tuple) else kw["padding"],
                        kw.get("fill", 0), mode)
        if kw.get("pad_if_needed") and padded.width < size:
            padded = F1.pad(padded, [size - padded.width, 0], kw.get("fill", 0), mode)
        if kw.get("pad_if_needed") and padded.height < size:
            padded = F1.pad(padded, [0, size - padded.height], kw.get("fill", 0), mode)
        for k in range(4):
            with _rng.sample_rng(5, 0, k):
                got = fused.from_bytes(raw)
            g = _rng.derive(5, 0, k)
            top, left = g.randint(0, padded.height - size), g.randint(0, padded.width - size)
            want = F1.pil_to_tensor(F1.crop(padded, top, left, size, size))
            want = want.flip(-1) if g.random() < 0.5 else want
            assert torch.equal(got, want), (path, k)


def test_what_a_padded_crop_cannot_fuse_runs_as_written():
    """v2 padding by ``padding`` and where needed with a reflection (one pad
    by the sum), a fill by type, and a padded crop of a tensor: run as
    written; ``decode="device"`` refuses a padded crop, naming it."""
    assert translate(V2.Compose([V2.RandomCrop(50, padding=2, pad_if_needed=True, padding_mode="reflect"),
                                 V2.PILToTensor()]))[2][0] == "RandomCrop"
    assert translate(V2.Compose([V2.RandomCrop(50, padding=2, fill={Image.Image: 3}),
                                 V2.PILToTensor()]))[2][0] == "RandomCrop"
    assert translate(V1.Compose([V1.PILToTensor(), V1.RandomCrop(50, padding=2)]))[2] == ("RandomCrop",)
    assert translate(V1.Compose([V1.RandomCrop(50, padding=2, fill=300), V1.PILToTensor()]))[2][0] == "RandomCrop"
    from coordl.device.encoded import plan_for

    with pytest.raises(ValueError, match=r"pads the image"):
        plan_for(T.Compose([T.RandomCrop(32, padding=4), T.ToTensor()]))


@pytest.mark.parametrize("step", ["v1_rrc_bicubic", "v1_resize_bicubic", "timm_rrc_bilinear", "timm_rrc_bicubic"])
def test_a_v1_resize_of_a_tensor_fuses_in_float_with_torchvisions_pixels(images, step):
    """torchvision's v1 resizes a uint8 tensor in float32, clipped and
    rounded once (its bicubic passes are not clipped between them, up to
    ~26 levels from a uint8 kernel), and timm's RandomResizedCropAndInterpolation
    on a tensor calls v1's resized_crop: the fused decode computes the same,
    bit for bit (the same window, its generator's draws); decode="device"
    refuses it, naming it."""
    if step.startswith("timm"):
        pytest.importorskip("timm", reason="timm is not installed (pip install timm)")
    cubic = IM.BICUBIC if step.endswith("bicubic") else IM.BILINEAR
    if step.startswith("timm"):
        from timm.data.transforms import RandomResizedCropAndInterpolation

        resize = RandomResizedCropAndInterpolation(48, interpolation="bicubic" if cubic is IM.BICUBIC else "bilinear")
    elif step == "v1_rrc_bicubic":
        resize = V1.RandomResizedCrop(48, interpolation=cubic, antialias=True)
    else:
        resize = V1.Resize((41, 52), interpolation=cubic, antialias=True)
    tf = V1.Compose([V1.PILToTensor(), resize])
    fused, names, rest = translate(tf)
    assert rest == () and fused.transforms[0]._in_float, (names, rest)
    rrc = fused.transforms[0]
    for path in images[:3]:
        raw, x = _read(path), F1.pil_to_tensor(_pil(path))
        for k in range(4):
            with _rng.sample_rng(3, 0, k):
                got = fused.from_bytes(raw)
            if type(rrc) is T.Resize:
                want = F1.resize(x, [41, 52], cubic, antialias=True)
            else:
                g = _rng.derive(3, 0, k)
                box = _draw_box(x.shape[1], x.shape[2], rrc.scale, rrc.ratio, g)
                want = F1.resized_crop(x, *box, [48, 48], cubic, antialias=True)
            assert got.dtype == torch.uint8 and torch.equal(got, want), (path, k, _levels(got, want, False))
    from coordl.device.encoded import plan_for

    with pytest.raises(ValueError, match=r"resizes a tensor in float32"):
        plan_for(fused)


@pytest.mark.parametrize("kind", ["v1", "v2"])
@pytest.mark.parametrize("kw", [dict(padding=4), dict(padding=(3, 1), padding_mode="reflect"),
                                dict(padding=[1, 2, 3, 4], fill=(200, 7, 90)), dict(padding=5, padding_mode="edge"),
                                dict(padding=2, padding_mode="symmetric", fill=9)])
def test_a_pad_fuses_with_torchvisions_pixels(images, kw, kind):
    """``Pad`` on a PIL image, then a ``RandomCrop`` (the other CIFAR-style
    recipe, ``Pad(4, padding_mode="reflect")`` first): fused, the planes
    padded as torchvision's PIL pad pads, bit for bit; decode="device"
    refuses it, naming it."""
    M = V1 if kind == "v1" else V2
    tf = M.Compose([M.Pad(**kw), M.RandomCrop(40), M.PILToTensor()])
    fused, names, rest = translate(tf)
    assert rest == () and names[:2] == ("Pad", "RandomCrop"), (names, rest)
    for path in images[:2]:
        raw, pil = _read(path), _pil(path)
        padded = F1.pad(pil, kw["padding"], kw.get("fill", 0), kw.get("padding_mode", "constant"))
        for k in range(3):
            with _rng.sample_rng(9, 0, k):
                got = fused.from_bytes(raw)
            g = _rng.derive(9, 0, k)
            top, left = g.randint(0, padded.height - 40), g.randint(0, padded.width - 40)
            assert torch.equal(got, F1.pil_to_tensor(F1.crop(padded, top, left, 40, 40))), (path, k)
    from coordl.device.encoded import plan_for

    with pytest.raises(ValueError, match=r"Pad\(.*pads the image"):
        plan_for(T.Compose([T.Resize(48), T.Pad(4), T.CenterCrop(32), T.ToTensor()]))
