"""torchvision steps on the fused path's planes (the uint8 tensor the PIL
image they expect stands for): ColorJitter, whose pixels coordl's kernel
(coordl.decode.color) computes with PIL's brightness, contrast, saturation
and hue arithmetic, and AugMix, given the tensor it makes of the PIL image.
Each gives what torchvision's own step (v1 and v2) gives on the PIL image for
the same torch generator state, leaving the generator where torchvision
leaves it.  Every comparison is value for value: a kernel one level off
anywhere fails."""
import os
import random
import re
import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageEnhance

from coordl.decode import augmix as AM
from coordl.decode import color as C

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _torchvision import import_torchvision  # noqa: E402

needs_ext = pytest.mark.skipif(C._ext is None, reason="coordl.decode._color is not built here")


def _planes(img):
    a = np.asarray(img)
    return np.ascontiguousarray(a[None] if a.ndim == 2 else a.transpose(2, 0, 1)).copy()


def _all_colours():
    """An RGB image holding each of the 2**24 colours once."""
    v = np.arange(1 << 24, dtype=np.uint32)
    rgb = np.stack([(v >> 16) & 255, (v >> 8) & 255, v & 255], -1).astype(np.uint8)
    return rgb.reshape(4096, 4096, 3)


def _f32(x):
    """x as torchvision hands a drawn factor to PIL: a float32 value as a Python float."""
    return float(np.float32(x))


@pytest.fixture(scope="module")
def all_colours():
    rgb = _all_colours()
    return Image.fromarray(rgb), np.ascontiguousarray(rgb.transpose(2, 0, 1))


# ------------------------------------------------------------------ the kernel
@needs_ext
def test_the_kernel_reproduces_this_pil():
    assert C.exact_kernel()


@needs_ext
@pytest.mark.parametrize("factor", [0.0, 0.6, _f32(0.7074914), 1.0, _f32(1.3999999), 1.4, 2.75])
def test_saturation_is_pils_on_every_colour(all_colours, factor):
    img, planes = all_colours
    want = _planes(ImageEnhance.Color(img).enhance(factor))
    assert np.array_equal(C.jitter(planes, [(C.SATURATION, factor)]), want)


@needs_ext
@pytest.mark.parametrize("shift", [1, 128, 255])
def test_hue_is_pils_hsv_round_trip_on_every_colour(all_colours, shift):
    img, planes = all_colours
    want = _planes(C.pil_jitter(img, [(C.HUE, shift)]))
    assert np.array_equal(C.jitter(planes, [(C.HUE, shift)]), want)


@needs_ext
def test_brightness_and_contrast_are_pils_on_every_value_and_mean():
    rnd = random.Random(3)
    for k in range(40):
        # images whose mean luma spans 0..255, each holding every value 0..255 in each channel
        lo = rnd.randrange(0, 256)
        base = np.full((16, 64, 3), lo, np.uint8)
        ramp = np.arange(256, dtype=np.uint8).reshape(4, 64)
        for c in range(3):
            base[c * 4:(c + 1) * 4, :, c] = np.roll(ramp, rnd.randrange(256))
        img = Image.fromarray(base)
        for factor in (0.0, _f32(rnd.uniform(0.6, 1.4)), 1.0, _f32(rnd.uniform(0.0, 3.0)), 5.0):
            for code, enh in ((C.BRIGHTNESS, ImageEnhance.Brightness), (C.CONTRAST, ImageEnhance.Contrast)):
                got = C.jitter(_planes(img), [(code, factor)])
                assert np.array_equal(got, _planes(enh(img).enhance(factor))), (k, code, factor)


@needs_ext
@pytest.mark.parametrize("hw", [(1, 1), (1, 37), (37, 1), (5, 3), (223, 225)])
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_any_sequence_on_any_size(hw, mode):
    rnd = random.Random(hash((hw, mode)) & 0xFFFF)
    shape = hw + ((3,) if mode == "RGB" else ())
    img = Image.fromarray(np.frombuffer(rnd.randbytes(int(np.prod(shape))), np.uint8).reshape(shape), mode)
    for _ in range(6):
        ops = [(code, _f32(rnd.uniform(0.0, 2.0))) for code in (C.BRIGHTNESS, C.CONTRAST, C.SATURATION)]
        ops.append((C.HUE, rnd.randrange(256)))
        rnd.shuffle(ops)
        got = C.jitter(_planes(img), ops)
        assert got.shape == _planes(img).shape and got.dtype == np.uint8
        assert np.array_equal(got, _planes(C.pil_jitter(img, ops))), ops


@needs_ext
def test_the_kernel_takes_only_what_it_computes():
    x = np.zeros((3, 4, 5), np.uint8)
    with pytest.raises(ValueError, match="C 1 or 3"):
        C._ext.jitter(np.zeros((4, 4, 5), np.uint8), np.zeros((4, 4, 5), np.uint8), [])
    with pytest.raises(ValueError, match="src's shape"):
        C._ext.jitter(x, np.zeros((3, 5, 4), np.uint8), [])
    with pytest.raises(ValueError, match="code 0..3"):
        C._ext.jitter(x, np.empty_like(x), [(4, 1.0)])
    with pytest.raises(ValueError, match="finite"):
        C._ext.jitter(x, np.empty_like(x), [(0, float("nan"))])
    base = np.zeros(61, np.uint8)
    with pytest.raises(ValueError, match="not overlap"):
        C._ext.jitter(base[:60].reshape(3, 4, 5), base[1:].reshape(3, 4, 5), [])
    y = np.full((3, 4, 5), 100, np.uint8)
    C._ext.jitter(y, y, [(C.BRIGHTNESS, 0.5)])  # in place
    assert (y == 50).all()


@needs_ext
def test_a_kernel_one_level_off_is_not_used(monkeypatch, caplog):
    """The first use checks the kernel against the installed PIL: one value
    one level off anywhere in a probe and colour adjustments run through PIL."""
    real = C._ext

    class OffByOne:
        def jitter(self, src, out, ops):
            real.jitter(src, out, ops)
            if any(code == C.SATURATION for code, _ in ops):
                _one_level_off(out)

    _assert_refused(monkeypatch, caplog, OffByOne(), "_checked", C.exact_kernel)


def _one_level_off(out):
    """One value of ``out``, in the middle, one level off."""
    flat = out.reshape(-1)
    flat[len(flat) // 2] ^= 1


def _assert_refused(monkeypatch, caplog, fake, memo, check):
    """With ``fake`` as the extension, ``check`` (its memo ``memo``
    emptied) says the kernels are not this PIL's, and warns so."""
    monkeypatch.setattr(C, "_ext", fake)
    monkeypatch.setattr(C, memo, [])
    with caplog.at_level("WARNING", logger=C.__name__):
        assert not check()
    assert "does not reproduce this PIL" in caplog.text


def _assert_as_written(out, sizes, jpeg_seed, samples, seed):
    """The translated pipeline ``out`` (steps on the planes, then the
    conversion) against the same pipeline with the user's steps run as
    written, through the fused decode of a JPEG of each size, for the same
    sample draws; the tensors ``out`` gives."""
    import io

    from coordl import _rng
    from coordl.synth import render_image
    from coordl.tvcompat import TorchvisionPipeline

    as_written = TorchvisionPipeline(out.fused, out.to_pil, out.image_type, [t.user for t in out.tail] + out.post)
    got = []
    for k, (w, h) in enumerate(sizes):
        buf = io.BytesIO()
        render_image(jpeg_seed, k, w, h, 1.5).save(buf, "JPEG", quality=90)
        raw = buf.getvalue()
        for i in range(samples):
            with _rng.sample_rng(seed, 0, i):
                a = out.from_bytes(raw)
            with _rng.sample_rng(seed, 0, i):
                b = as_written.from_bytes(raw)
            assert type(a) is torch.Tensor and torch.equal(a, b), (w, h, i)
            got.append(a)
    return got


# ------------------------------------------------- against torchvision's own
@pytest.fixture(scope="module")
def tv():
    if import_torchvision() is None:
        pytest.skip("torchvision is not installed (pip install coordl[test])")
    from torchvision import transforms as V1
    from torchvision.transforms import v2 as V2

    return V1, V2


PARAMS = [
    {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4},           # timm's default
    {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1},
    {"brightness": (0.0, 0.0), "contrast": (0.0, 0.0), "saturation": (0.0, 0.0), "hue": (-0.5, -0.5)},
    {"brightness": (5.0, 5.0), "contrast": (3.0, 7.0), "saturation": (4.0, 4.0), "hue": (0.5, 0.5)},
    {"brightness": 1.0, "hue": 0.5},
    {"contrast": (0.0, 2.0)},
    {"saturation": 0.9, "hue": (-0.01, 0.01)},
    {},
]


def _image(rnd, h, w, mode):
    shape = (h, w, 3) if mode == "RGB" else (h, w)
    a = np.frombuffer(rnd.randbytes(h * w * (3 if mode == "RGB" else 1)), np.uint8).reshape(shape)
    if rnd.random() < 0.5:   # a smooth image too: large runs of similar colours, means away from 127
        yy, xx = np.mgrid[0:h, 0:w]
        smooth = (yy * 7 + xx * 3 + rnd.randrange(256)) % 256
        a = np.stack([smooth, smooth // 2 + 60, 255 - smooth], -1)[..., :a.shape[-1] if a.ndim == 3 else 1]
        a = (a if mode == "RGB" else a[..., 0]).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(a), mode)


@needs_ext
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("params", PARAMS, ids=[str(i) for i in range(len(PARAMS))])
def test_on_planes_is_torchvisions_colorjitter_for_the_same_generator(tv, version, params):
    from coordl.tvcompat import ColorJitterOnPlanes, _on_planes

    M = tv[0] if version == "v1" else tv[1]
    t = M.ColorJitter(**params)
    mine = _on_planes(t)
    assert isinstance(mine, ColorJitterOnPlanes) and mine.user is t and mine.exact()
    rnd = random.Random(len(str(params)))
    sizes = [(1, 1), (1, 29), (31, 1), (2, 3), (17, 23), (224, 224), (225, 131)]
    for seed in range(40):
        h, w = sizes[seed % len(sizes)]
        img = _image(rnd, h, w, "RGB" if seed % 3 else "L")
        torch.manual_seed(seed)
        want = t(img)
        after = torch.get_rng_state()
        torch.manual_seed(seed)
        got = mine.on_planes(torch.from_numpy(_planes(img)))
        assert torch.equal(torch.get_rng_state(), after), seed     # the same draws, no more, no less
        assert want.mode == img.mode and got.dtype == torch.uint8
        assert np.array_equal(got.numpy(), _planes(want)), (seed, h, w, img.mode)


def test_what_the_planes_do_not_stand_for_runs_as_written(tv):
    from coordl.tvcompat import ColorJitterOnPlanes, _on_planes

    V1, V2 = tv
    t = V1.ColorJitter(0.4, 0.4, 0.4, 0.1)
    rgba = Image.fromarray(np.random.default_rng(0).integers(0, 256, (9, 11, 4), dtype=np.uint8), "RGBA")
    for img in (rgba, torch.rand(3, 9, 11)):
        torch.manual_seed(1)
        want = t(img)
        torch.manual_seed(1)
        got = _on_planes(t)(img)   # a PIL image or a tensor: the user's object runs
        assert np.array_equal(np.asarray(got), np.asarray(want))
    # ranges that are not as the constructor makes them: not taken over
    odd = V1.ColorJitter(0.4)
    odd.brightness = 0.4
    assert _on_planes(odd) is odd
    wide = V2.ColorJitter(hue=0.2)
    wide.hue = (-0.7, 0.2)
    assert _on_planes(wide) is wide
    assert not isinstance(_on_planes(V2.RandomPhotometricDistort()), ColorJitterOnPlanes)


@needs_ext
def test_where_the_user_pipeline_has_a_tensor_colorjitter_runs_as_written(tv):
    from coordl.tvcompat import ColorJitterOnPlanes, translate

    V1, V2 = tv
    out, fused, rest = translate(V1.Compose([V1.RandomResizedCrop(32), V1.ToTensor(), V1.ColorJitter(0.4)]))
    assert rest == ("ColorJitter",) and not any(isinstance(t, ColorJitterOnPlanes) for t in out.tail)
    out, fused, rest = translate(V1.Compose([V1.RandomResizedCrop(32), V1.ColorJitter(0.4), V1.ToTensor()]))
    assert rest == ("ColorJitter", "ToTensor") and isinstance(out.tail[0], ColorJitterOnPlanes)


@needs_ext
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_pipeline_with_colorjitter_gives_its_as_written_result(tv, version, tmp_path):
    """Through the fused decode: the translated pipeline (ColorJitter on the
    planes, then the conversion) against the same pipeline with the user's
    ColorJitter and conversion run as written, for the same sample draws."""
    from coordl.tvcompat import ColorJitterOnPlanes, translate

    M = tv[0] if version == "v1" else tv[1]
    steps = [M.RandomResizedCrop(48), M.RandomHorizontalFlip(), M.ColorJitter(0.4, 0.4, 0.4, 0.1),
             M.ColorJitter(brightness=(0.2, 0.3)), M.PILToTensor()]
    if version == "v1":   # (v2's ToDtype scales by a product, coordl's conversion divides: float rounding apart)
        steps += [M.ConvertImageDtype(torch.float32), M.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
    out = translate(M.Compose(steps))[0]
    assert [type(t) for t in out.tail] == [ColorJitterOnPlanes, ColorJitterOnPlanes]
    for a in _assert_as_written(out, [(67, 45), (1, 40), (40, 1), (301, 199)], 4, 6, 8):
        assert a.dtype == (torch.float32 if version == "v1" else torch.uint8)


def test_where_the_kernel_is_not_exact_colorjitter_runs_as_written(tv, monkeypatch, tmp_path):
    """No extension, or one that does not reproduce this PIL: the user's
    ColorJitter stays in the pipeline as written, and path_reason says so."""
    import coordl
    from coordl.synth import make_image_folder
    from coordl.tvcompat import ColorJitterOnPlanes, translate

    V1 = tv[0]
    monkeypatch.setattr(C, "_checked", [False])
    tf = V1.Compose([V1.RandomResizedCrop(16), V1.ColorJitter(0.4, 0.4, 0.4), V1.ToTensor()])
    out = translate(tf)[0]
    assert type(out.tail[0]) is V1.ColorJitter
    root = make_image_folder(str(tmp_path / "p"), num_images=4, num_classes=2, image_size=(24, 20), mean_kb=2)
    from torchvision import datasets as D

    L = coordl.DataLoader(D.ImageFolder(root, transform=tf), batch_size=4)
    reason = L.stats().path_reason
    assert "as written: ColorJitter, ToTensor" in reason and "PIL's arithmetic" not in reason, reason
    assert next(iter(L))[0].shape == (4, 3, 16, 16)
    assert not any(isinstance(t, ColorJitterOnPlanes) for t in out.tail)


# ---------------------------------------------------------------------- AugMix
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("params", [{}, {"severity": 10, "mixture_width": 2, "chain_depth": 3, "alpha": 0.5},
                                    {"all_ops": False}], ids=["default", "strong", "partial"])
def test_augmix_on_planes_is_torchvisions_for_the_same_generator(tv, version, params):
    from coordl.tvcompat import AugMixOnPlanes, _on_planes

    M = tv[0] if version == "v1" else tv[1]
    t = M.AugMix(**params)
    mine = _on_planes(t)
    assert isinstance(mine, AugMixOnPlanes) and mine.user is t and mine.exact()
    assert mine.drawn is not None and "coordl's tables" in mine.how     # RGB images: drawn apart, tabled
    rnd = random.Random(7)
    sizes = [(1, 29), (31, 1), (2, 3), (17, 23), (64, 80)]
    for seed in range(10):
        h, w = sizes[seed % len(sizes)]
        _assert_same_call(t, mine, _image(rnd, h, w, "RGB" if seed % 3 else "L"), seed)


def _assert_same_call(t, mine, img, seed):
    """The user's step ``t`` on the PIL image and coordl's ``mine`` on its
    planes, each from torch's generator seeded with ``seed``: the same
    planes and the generator left in the same state; where ``t`` refuses
    the image (a fill of three values for an L image, a perspective of a
    tiny one), ``mine`` refuses it with the same error."""
    torch.manual_seed(seed)
    try:
        want = t(img)
    except (ValueError, RuntimeError) as e:
        torch.manual_seed(seed)
        with pytest.raises(type(e), match=re.escape(str(e))):
            mine.on_planes(torch.from_numpy(_planes(img)))
        return
    after = torch.get_rng_state()
    torch.manual_seed(seed)
    got = mine.on_planes(torch.from_numpy(_planes(img)))
    assert torch.equal(torch.get_rng_state(), after), seed
    assert type(got) is torch.Tensor and got.dtype == torch.uint8
    assert np.array_equal(got.numpy(), _planes(want)), (seed, img.size, img.mode)


@needs_ext
def test_the_table_and_histogram_kernels():
    """``tables``: each plane through its own table (or one for all), apart
    or in place; ``histograms``: each plane's counts; wrong shapes refused."""
    rs = np.random.RandomState(2)
    a = rs.randint(0, 256, (2, 3, 5, 7)).astype(np.uint8)
    luts = rs.randint(0, 256, (2, 3, 256)).astype(np.uint8)
    out = np.empty_like(a)
    C._ext.tables(a, out, luts)
    assert np.array_equal(out, np.take_along_axis(luts, a.reshape(2, 3, -1).astype(np.int64), 2).reshape(a.shape))
    b = a.copy()
    C._ext.tables(b, b, luts[0, 0])
    assert np.array_equal(b, luts[0, 0][a])
    hist = np.zeros((2, 3, 256), dtype=np.int64)
    C._ext.histograms(a, hist)
    assert np.array_equal(hist.reshape(6, 256), [np.bincount(p.ravel(), minlength=256) for p in a.reshape(6, -1)])
    with pytest.raises(ValueError, match="256 values for each"):
        C._ext.tables(a, out, luts.reshape(-1, 256)[:4].copy())     # 210 values in 4 planes
    with pytest.raises(ValueError, match="src itself or not overlap"):
        C._ext.tables(a.reshape(-1)[:-1], a.reshape(-1)[1:], luts[0, 0])
    with pytest.raises(ValueError, match="int64"):
        C._ext.histograms(a, np.zeros((6, 256), dtype=np.int32))


def _sharpness_blocks() -> np.ndarray:
    """A uint8 (1, 1, H, W) image of 3x3 blocks, each block's centre weighed
    with its own block alone (1s around a 5) to a sum S of its own: every S
    from 0 to 13 * 255 once, so every S/13 (the blurred value) and all those
    nearest a half (S/13 = k + 6/13, k + 7/13)."""
    sums = np.arange(13 * 255 + 1)
    n = int(np.ceil(np.sqrt(len(sums))))
    img = np.zeros((3 * n, 3 * n), dtype=np.uint8)
    for i, s in enumerate(sums):
        centre = min(255, s // 5)
        rest = s - 5 * centre                      # spread over the eight neighbours, each at most 255
        ring = [rest // 8 + (1 if k < rest % 8 else 0) for k in range(8)]
        r, c = 3 * (i // n), 3 * (i % n)
        block = np.array([ring[:3], [ring[3], centre, ring[4]], ring[5:]], dtype=np.int64)
        assert block.max() <= 255 and int(block.sum()) + 4 * centre == s
        img[r:r + 3, c:c + 3] = block
    return img[None, None]


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("mode", [0, 1], ids=["nearest", "bilinear"])
def test_augmix_tables_and_kept_grids_give_torchvisions_values(tv, version, mode):
    """On the CPU, AugMix's brightness, solarize, autocontrast, equalize and
    sharpness computed by tables, and its shears, translations and rotations
    with kept sampling grids, are torchvision's functions' values, for every
    magnitude AugMix draws on each image: photo-sized and tiny images, one
    and three channels, a batch, flat ones, square ones, and sharpness on
    every weighted sum its blur rounds (those nearest a half included); the
    grids again from the memo give the same."""
    v2 = int(version == "v2")
    assert AM.quick_ops(v2) == frozenset(AM._QUICK)
    slow, fast = AM._op(v2, mode), AM._op_on_cpu(v2, mode)
    rnd = random.Random(17)
    images = [torch.from_numpy(_planes(_image(rnd, h, w, mode)))[None]
              for h, w, mode in ((224, 199, "RGB"), (61, 80, "L"), (5, 4, "RGB"), (3, 250, "RGB"), (2, 2, "RGB"))]
    images += [torch.from_numpy(np.random.RandomState(5).randint(0, 256, (3, 3, 31, 29)).astype(np.uint8)),
               torch.full((1, 3, 7, 9), 201, dtype=torch.uint8), torch.from_numpy(_sharpness_blocks())]
    for name in AM._QUICK:
        for x in images:
            for m in AM._magnitudes(v2, name, x.shape[2], x.shape[3]):
                want = slow(x, name, m)
                for _ in range(2):           # the second: the grid kept
                    got = fast(x, name, m)
                    assert got.dtype == torch.uint8 and torch.equal(got, want), (name, m, tuple(x.shape))


def test_an_augmix_table_that_differs_is_not_used(tv, monkeypatch, caplog):
    """A sharpness blend table one level off on one pair in a hundred (an
    arithmetic that rounds otherwise now and then) fails its check: that
    operation is computed by torchvision's function (the right values), the
    others by their tables."""
    real = AM._blend_table

    def off(v2, factor):
        t = real(v2, factor).copy()
        pairs = np.arange(65536)
        t[(pairs // 256 + pairs % 256) % 97 == 0] ^= 1
        return t

    monkeypatch.setattr(AM, "_blend_table", off)
    monkeypatch.setattr(AM, "_quick", {})
    monkeypatch.setattr(AM, "_tables", {})
    with caplog.at_level("WARNING", logger="coordl"):
        assert AM.quick_ops(0) == frozenset(AM._QUICK) - {"Sharpness"}
    assert "AugMix Sharpness differs" in caplog.text
    x = torch.from_numpy(_sharpness_blocks())
    assert torch.equal(AM._op_on_cpu(0, 1)(x, "Sharpness", 0.3), AM._op(0, 1)(x, "Sharpness", 0.3))


def test_augmix_drawn_apart_where_its_check_fails_runs_on_the_tensor(tv, monkeypatch):
    """Draws that would not be the user's (the weights doubled) fail the
    drawn class's check: AugMix still runs on the planes, as the user's call
    on the tensor, its result torchvision's."""
    import coordl.tvcompat as tc
    from coordl.tvcompat import AugMixOnPlanes, _on_planes

    real = AM._column
    monkeypatch.setattr(tc, "_agree", {})
    monkeypatch.setattr(AM, "_column", lambda values, upload: real([2 * v for v in values], upload))
    t = tv[0].AugMix()
    mine = _on_planes(t)
    assert isinstance(mine, AugMixOnPlanes) and mine.exact() and mine.drawn is None
    assert "no conversion to PIL" in mine.how
    _assert_same_call(t, mine, _image(random.Random(3), 30, 41, "RGB"), 5)


def test_augmix_with_a_fill_runs_as_written(tv):
    from coordl.tvcompat import _on_planes

    for M in tv:
        for fill in (0, 128, [1, 2, 3]):
            t = M.AugMix(fill=fill)
            assert _on_planes(t) is t


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_pipeline_with_augmix_gives_its_as_written_result(tv, version):
    from coordl.tvcompat import AugMixOnPlanes, translate

    M = tv[0] if version == "v1" else tv[1]
    steps = [M.RandomResizedCrop(40), M.RandomHorizontalFlip(), M.AugMix(), M.PILToTensor()]
    if version == "v1":
        steps += [M.ConvertImageDtype(torch.float32), M.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
    out = translate(M.Compose(steps))[0]
    assert [type(t) for t in out.tail] == [AugMixOnPlanes]
    _assert_as_written(out, [(67, 45), (1, 40), (301, 199)], 6, 3, 2)


TENSOR_POLICIES = {"ta": lambda M: M.TrivialAugmentWide(interpolation=M.InterpolationMode.BILINEAR),
                   "ra": lambda M: M.RandAugment(), "aa": lambda M: M.AutoAugment(),
                   "augmix": lambda M: M.AugMix(), "augmix_nearest": lambda M: M.AugMix(
                       interpolation=M.InterpolationMode.NEAREST, severity=7, chain_depth=2)}


@pytest.mark.parametrize("policy", list(TENSOR_POLICIES))
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_policy_given_the_fused_tensor_gives_its_as_written_result(tv, version, policy):
    """The reference presets' ``--backend tensor``: AugMix given the fused
    path's plain uint8 tensor runs drawn apart, its operations by
    coordl.decode.augmix (tables, kept grids); the auto-augment policies run
    as written; the user's call's bytes either way."""
    from coordl.tvcompat import AugMixOnTensor, translate

    M = tv[0] if version == "v1" else tv[1]
    step = TENSOR_POLICIES[policy](M)
    steps = [M.PILToTensor(), M.RandomResizedCrop(40), M.RandomHorizontalFlip(), step,
             M.ConvertImageDtype(torch.float32), M.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
    out = translate(M.Compose(steps))[0]
    if policy.startswith("augmix"):
        assert len(out.tail) == 1 and isinstance(out.tail[0], AugMixOnTensor) and "its own draws" in out.tail[0].how
        _assert_as_written(out, [(67, 45), (1, 40), (301, 199)], 7, 3, 4)
    else:
        assert out.tail == [step]


def test_a_policy_given_a_tv_tensors_image_runs_as_written(tv):
    """After ``ToImage`` (a ``tv_tensors.Image``) the policy is the user's
    own object, called as written."""
    from coordl.tvcompat import translate

    V2 = tv[1]
    t = V2.TrivialAugmentWide()
    out = translate(V2.Compose([V2.ToImage(), V2.RandomResizedCrop(40), t, V2.ToDtype(torch.float32, scale=True)]))[0]
    assert out.tail == [t]


def test_messages_name_the_users_steps(tv):
    from coordl.device.encoded import plan_for
    from coordl.tvcompat import translate

    V1 = tv[0]
    # an AugMix on the planes for the CPU path, more chains than the device's record carries
    out = translate(V1.Compose([V1.RandomResizedCrop(16), V1.ColorJitter(0.4), V1.AugMix(mixture_width=5),
                                V1.ToTensor()]))[0]
    with pytest.raises(ValueError, match=r"the steps AugMix run as written") as e:
        plan_for(out)
    assert "OnPlanes" not in str(e.value) and "OnPlanes" not in repr(out).split("(on the planes")[0]


@needs_ext
def test_the_first_use_checks_leave_the_generators_as_they_were(tv, monkeypatch):
    import coordl.tvcompat as tc

    V1, V2 = tv
    monkeypatch.setattr(tc, "_agree", {})
    monkeypatch.setattr(C, "_checked", [])
    monkeypatch.setattr(AM, "_quick", {})
    torch.manual_seed(11)
    random.seed(11)
    before = torch.get_rng_state(), random.getstate()
    out = tc.translate(V2.Compose([V2.RandomResizedCrop(16), V2.ColorJitter(0.4, 0.4, 0.4, 0.2), V2.AugMix(),
                                   V2.PILToTensor()]))[0]
    assert [type(t) for t in out.tail] == [tc.ColorJitterOnPlanes, tc.AugMixOnPlanes]
    # the checks ran, here: the jitter's, AugMix's as written on the tensor and drawn apart, its tables
    assert len(tc._agree) == 3 and C._checked == [True] and list(AM._quick) == [1]
    assert out.tail[1].drawn is not None
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]


# --------------------------------------------------------- auto-augment policies
def _noise_image(rnd, h, w, mode="RGB"):
    c = 3 if mode == "RGB" else 1
    a = np.frombuffer(rnd.randbytes(h * w * c), np.uint8).reshape((h, w, c) if c == 3 else (h, w))
    return Image.fromarray(np.ascontiguousarray(a), mode)


@needs_ext
def test_the_policy_kernels_reproduce_this_pil():
    """Sharpness, the ImageOps tables and the affine and perspective maps
    (each of PIL's filters, with and without a fill) give PIL's bytes on
    noise, flat, dark and tiny images, RGB and L; maps drawn at random too."""
    assert C.exact_ops()
    rnd = random.Random(3)
    images = [_noise_image(rnd, 31, 47), _noise_image(rnd, 23, 9, "L"), _noise_image(rnd, 1, 13),
              _noise_image(rnd, 2, 2), _noise_image(rnd, 3, 3), Image.new("RGB", (9, 7), (7, 200, 30)),
              Image.fromarray(np.asarray(_noise_image(rnd, 20, 20)) // 16)]
    values = {C.SHARPNESS: (0.0, 0.1, 1.0, 1.9, 2.75), C.POSTERIZE: (1, 3, 8), C.SOLARIZE: (0.0, 99.5, 128.0, 256.0),
              C.AUTOCONTRAST: (0,), C.EQUALIZE: (0,), C.INVERT: (0,), C.SOLARIZE_ADD: (0, 40, 255)}
    for img in images:
        planes = _planes(img)
        fill = (5, 6, 7) if img.mode == "RGB" else (9,)
        cases = [[(code, v)] for code, vs in values.items() for v in vs]
        for _ in range(30):
            a = [rnd.uniform(0.5, 1.5), rnd.uniform(-0.7, 0.7), rnd.uniform(-9, 9), rnd.uniform(-0.7, 0.7),
                 rnd.uniform(0.5, 1.5), rnd.uniform(-9, 9)]
            cases.append([(C.AFFINE, (*a, rnd.choice([None, fill]), rnd.choice([0, 2, 3])))])
            cases.append([(C.PERSPECTIVE, (*a, rnd.uniform(-0.02, 0.02), rnd.uniform(-0.02, 0.02),
                                           rnd.choice([None, fill]), rnd.choice([0, 2, 3])))])
        cases.append([(C.AFFINE, (2.0, 0.0, -3.0, 0.0, 0.5, 1.0, None, 0))])          # a scale: PIL's tables
        cases.append([(C.AFFINE, (1.0, 0.2, 40000.0, 0.0, 1.0, 0.0, fill, 0))])     # past 16.16: PIL's doubles
        cases.append([(C.SHARPNESS, 1.7), (C.AFFINE, (0.9, 0.1, 1.0, -0.1, 0.9, 2.0, None, 2)), (C.EQUALIZE, 0),
                      (C.SATURATION, 0.4), (C.TRANSPOSE, 2), (C.SOLARIZE, 77.0)])
        for ops in cases:
            got = C.apply_ops(planes, ops)
            assert got.flags.c_contiguous and got is not planes
            assert np.array_equal(got, _planes(C.pil_jitter(img, ops))), (img.mode, img.size, ops)
    # what the extension does not take goes through PIL, its errors PIL's
    img = images[0]
    try:
        want = _planes(C.pil_jitter(img, [(C.POSTERIZE, 0)]))
    except Exception as e:   # noqa: BLE001 - Pillow 13 refuses 0 bits
        with pytest.raises(type(e)):
            C.apply_ops(_planes(img), [(C.POSTERIZE, 0)])
    else:
        assert np.array_equal(C.apply_ops(_planes(img), [(C.POSTERIZE, 0)]), want)
    with pytest.raises(ValueError, match="pil_op takes"):
        C._ext.pil_op(_planes(img), _planes(img), C.POSTERIZE, 0.0)
    with pytest.raises(ValueError, match="filter should be"):
        C._ext.transform(_planes(img), _planes(img), (1.0, 0, 0, 0, 1.0, 0), 1, None)
    with pytest.raises(ValueError, match="not overlap"):
        p = _planes(img)
        C._ext.pil_op(p, p, C.INVERT, 0.0)


@needs_ext
def test_a_policy_kernel_one_level_off_keeps_the_policy_as_written(tv, monkeypatch, caplog):
    from coordl.tvcompat import _on_planes

    real = C._ext

    class OffByOne:
        jitter = staticmethod(real.jitter)
        pil_op = staticmethod(real.pil_op)

        @staticmethod
        def transform(src, out, coeffs, f, fill):
            real.transform(src, out, coeffs, f, fill)
            if f == 2:
                _one_level_off(out)

    _assert_refused(monkeypatch, caplog, OffByOne(), "_checked_ops", C.exact_ops)
    t = tv[0].RandAugment()
    assert _on_planes(t) is t


POLICIES = [("TrivialAugmentWide", {}), ("TrivialAugmentWide", {"interpolation": "bilinear", "fill": [1, 2, 3]}),
            ("RandAugment", {}), ("RandAugment", {"interpolation": "bilinear", "num_ops": 3, "magnitude": 15}),
            ("RandAugment", {"interpolation": "bicubic"}), ("AutoAugment", {}),
            ("AutoAugment", {"policy": "SVHN", "interpolation": "bilinear", "fill": 100})]


@needs_ext
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("name,kw", POLICIES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(POLICIES)])
def test_a_policy_on_planes_is_torchvisions_for_the_same_generator(tv, version, name, kw):
    """Each policy's draws (torch's generator, left where its own call
    leaves it) and each drawn operation's pixels are the user's object's on
    the PIL image; an L image goes through the user's object as written."""
    from coordl.tvcompat import PolicyOnDevice, _on_planes

    M = tv[0] if version == "v1" else tv[1]
    kw = dict(kw)
    if "interpolation" in kw:
        kw["interpolation"] = tv[0].InterpolationMode(kw["interpolation"])
    if "policy" in kw:
        kw["policy"] = tv[0].AutoAugmentPolicy[kw["policy"]]
    t = getattr(M, name)(**kw)
    mine = _on_planes(t)
    assert isinstance(mine, PolicyOnDevice) and mine.user is t and mine.exact()
    assert "by coordl on the decoded planes" in repr(mine)
    rnd = random.Random(11)
    sizes = [(1, 29), (31, 1), (2, 3), (17, 23), (64, 80), (224, 224)]
    for seed in range(60):
        h, w = sizes[seed % len(sizes)]
        # (a fill of three values for an L image: torchvision refuses it, and so does coordl)
        _assert_same_call(t, mine, _image(rnd, h, w, "RGB" if seed % 5 else "L"), seed)


@needs_ext
@pytest.mark.parametrize("version", ["v1", "v2", "timm", "timm_augmix", "rotation", "solarize"])
def test_a_pipeline_with_a_policy_gives_its_as_written_result(tv, version):
    """The reference recipe's training preset with ``--auto-augment`` (and
    timm's ``rand-m9-mstd0.5-inc1``) through the fused decode: the policy on
    the planes, then the conversion, against the same steps run as written,
    for the same sample draws, and the loader's path_reason says so."""
    from coordl.tvcompat import _OpsOnPlanes, translate

    M = tv[1] if version == "v2" else tv[0]
    bilinear = tv[0].InterpolationMode.BILINEAR
    if version == "timm":
        policy = pytest.importorskip("timm.data.auto_augment").rand_augment_transform("rand-m9-mstd0.5-inc1", {})
    elif version == "rotation":       # a random rotation, bilinear, filled
        policy = M.RandomRotation(15, interpolation=bilinear, fill=[0, 128, 255])
    elif version == "solarize":       # the self-supervised recipes' solarization
        policy = M.RandomSolarize(threshold=128, p=0.5)
    elif version == "timm_augmix":    # timm's AugMixAugment: its chains on the planes, then its mix
        policy = pytest.importorskip("timm.data.auto_augment").augment_and_mix_transform(
            "augmix-m5-w4-d2", {"translate_const": 20, "img_mean": (124, 116, 104)})
    else:
        policy = M.RandAugment(interpolation=bilinear)
    steps = [M.RandomResizedCrop(48), M.RandomHorizontalFlip(), policy, M.PILToTensor()]
    if version != "v2":
        steps += [M.ConvertImageDtype(torch.float32), M.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
    out = translate(M.Compose(steps))[0]
    assert len(out.tail) == 1 and isinstance(out.tail[0], _OpsOnPlanes)
    _assert_as_written(out, [(67, 45), (1, 40), (301, 199)], 3, 12, 8)


@needs_ext
def test_the_loader_says_the_policy_runs_on_the_planes(tv, tmp_path):
    import coordl
    from coordl.synth import make_image_folder
    from torchvision import datasets as D

    V1 = tv[0]
    root = make_image_folder(str(tmp_path / "p"), num_images=6, num_classes=2, image_size=(40, 30), mean_kb=2)
    tf = V1.Compose([V1.RandomResizedCrop(16), V1.TrivialAugmentWide(), V1.ToTensor()])
    L = coordl.DataLoader(D.ImageFolder(root, transform=tf), batch_size=3, num_workers=2, seed=1)
    reason = L.stats().path_reason
    assert ("TrivialAugmentWide with its own draws, each drawn operation computed with PIL's arithmetic by coordl "
            "on the decoded planes") in reason, reason
    assert [x.shape for x, _ in L] == [(3, 3, 16, 16)] * 2


@needs_ext
def test_a_policy_given_images_of_many_sizes_keeps_a_bounded_memo(tv, monkeypatch):
    """No crop before the policy: what depends on the image's size (its
    magnitudes, its geometric calls) is kept for a bounded number of sizes,
    and the results stay the user's object's."""
    import coordl.tvcompat as tc

    monkeypatch.setattr(tc, "_KEEP", 8)
    t = tv[0].TrivialAugmentWide()
    mine = tc._on_planes(t)
    rnd = random.Random(2)
    for seed in range(40):
        img = _image(rnd, 5 + seed, 9 + 2 * seed, "RGB")
        torch.manual_seed(seed)
        want = t(img)
        torch.manual_seed(seed)
        got = mine.on_planes(torch.from_numpy(_planes(img)))
        assert np.array_equal(got.numpy(), _planes(want)), seed
        assert len(mine._calls) <= 8 and len(mine._spaces) <= 8


RANDOM_STEPS = [("RandomRotation", {"degrees": 30}),
                ("RandomRotation", {"degrees": (-10, 40), "interpolation": "bilinear", "fill": [9, 80, 200]}),
                ("RandomAffine", {"degrees": 20, "translate": (0.1, 0.2), "scale": (0.8, 1.2), "shear": 10,
                                  "interpolation": "bicubic"}),
                ("RandomPerspective", {"p": 0.7, "interpolation": "bilinear"}),
                ("RandomPosterize", {"bits": 3}), ("RandomSolarize", {"threshold": 100.5}),
                ("RandomAdjustSharpness", {"sharpness_factor": 1.7}), ("RandomAutocontrast", {}),
                ("RandomEqualize", {}), ("RandomInvert", {})]


@needs_ext
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("name,kw", RANDOM_STEPS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(RANDOM_STEPS)])
def test_a_random_step_on_planes_is_torchvisions_for_the_same_generator(tv, version, name, kw):
    """torchvision's rotations, affine and perspective maps and one-operation
    random steps on the planes: their own draws, PIL's pixels, torch's
    generator left as their call leaves it; an L image as written."""
    from coordl.tvcompat import _on_planes

    M = tv[0] if version == "v1" else tv[1]
    kw = dict(kw)
    if "interpolation" in kw:
        kw["interpolation"] = tv[0].InterpolationMode(kw["interpolation"])
    t = getattr(M, name)(**kw)
    mine = _on_planes(t)
    assert mine is not t and mine.user is t and mine.exact()
    assert "by coordl on the decoded planes" in repr(mine)
    rnd = random.Random(5)
    sizes = [(1, 29), (31, 1), (2, 3), (17, 23), (64, 80)]
    for seed in range(30):
        h, w = sizes[seed % len(sizes)]
        _assert_same_call(t, mine, _image(rnd, h, w, "RGB" if seed % 5 else "L"), seed)
