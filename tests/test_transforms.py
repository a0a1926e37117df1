"""Tests for coordl.transforms (torchvision-compatible image transforms)."""
import functools
import math
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import coordl._rng as crng
from coordl import transforms as T
from coordl._rng import derive, sample_rng

REPO = Path(__file__).resolve().parents[1]


def rgb(w, h, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def grid(w, h):
    """An L-mode image whose pixel (y, x) is distinct: easy to locate crops."""
    return Image.fromarray((np.arange(h * w).reshape(h, w) % 251 + 1).astype(np.uint8))


class Scripted:
    """An rng that returns scripted values and records every call."""

    def __init__(self, uniforms=(), randoms=()):
        self.uniforms, self.randoms, self.calls = list(uniforms), list(randoms), []

    def uniform(self, a, b):
        self.calls.append(("uniform", a, b))
        return self.uniforms.pop(0)

    def randint(self, a, b):
        self.calls.append(("randint", a, b))
        return b

    def random(self):
        self.calls.append(("random",))
        return self.randoms.pop(0)


# ------------------------------------------------------------ RandomResizedCrop
@pytest.mark.parametrize("size,expected_wh", [(224, (224, 224)), ([64], (64, 64)), ((100, 50), (50, 100))])
def test_rrc_output_size_and_mode(size, expected_wh):
    out = T.RandomResizedCrop(size)(rgb(300, 200))
    assert out.size == expected_wh and out.mode == "RGB"


def test_rrc_draw_order_and_inclusive_bounds():
    rng = Scripted(uniforms=[0.25, 0.0])  # area fraction 0.25, log-ratio 0 -> square crop
    top, left, h, w = T.RandomResizedCrop.get_params((400, 300), (0.08, 1.0), (3 / 4, 4 / 3), rng)
    side = round(math.sqrt(0.25 * 400 * 300))
    assert (h, w) == (side, side)
    assert rng.calls == [("uniform", 0.08, 1.0), ("uniform", math.log(3 / 4), math.log(4 / 3)),
                         ("randint", 0, 300 - side), ("randint", 0, 400 - side)]
    assert (top, left) == (300 - side, 400 - side)  # randint's upper bound is reachable


def test_rrc_param_statistics():
    rng, W, H = random.Random(123), 1000, 1000
    scale, ratio = (0.08, 0.5), (3 / 4, 4 / 3)  # max side sqrt(0.5*4/3) < 1: never rejected
    params = [T.RandomResizedCrop.get_params((W, H), scale, ratio, rng) for _ in range(4000)]
    area = np.array([h * w / (W * H) for _, _, h, w in params])
    logr = np.array([math.log(w / h) for _, _, h, w in params])
    pos = np.array([t / (H - h) for t, _, h, _ in params])
    assert all(0 <= t <= H - h and 0 <= l <= W - w for t, l, h, w in params)
    assert area.min() >= 0.079 and area.max() <= 0.501
    assert abs(area.mean() - 0.29) < 0.01  # uniform on [0.08, 0.5]
    assert abs((area < 0.29).mean() - 0.5) < 0.04
    assert logr.min() >= math.log(3 / 4) - 0.01 and logr.max() <= math.log(4 / 3) + 0.01
    assert abs(logr.mean()) < 0.015  # log-ratio uniform, symmetric around 0
    assert logr.min() < math.log(3 / 4) + 0.02 and logr.max() > math.log(4 / 3) - 0.02
    assert abs(pos.mean() - 0.5) < 0.03


def test_rrc_full_scale_mean_area_below_unconditioned():
    # With scale up to 1 on a square, large non-square crops get rejected and redrawn.
    rng = random.Random(7)
    params = [T.RandomResizedCrop.get_params((500, 500), (0.08, 1.0), (3 / 4, 4 / 3), rng)
              for _ in range(3000)]
    area = np.array([h * w / 250000 for _, _, h, w in params])
    assert area.max() <= 1.0 and area.min() >= 0.079
    assert 0.45 < area.mean() < 0.54


@pytest.mark.parametrize("wh,expected", [
    ((1000, 10), (0, (1000 - 13) // 2, 10, 13)),   # too wide: h=H, w=round(H*4/3)
    ((10, 1000), ((1000 - 13) // 2, 0, 13, 10)),   # too tall: w=W, h=round(W/(3/4))
])
def test_rrc_fallback_extreme_aspect(wh, expected):
    rng = random.Random(0)
    for _ in range(50):
        assert T.RandomResizedCrop.get_params(wh, (0.08, 1.0), (3 / 4, 4 / 3), rng) == expected


def test_rrc_fallback_in_range_uses_whole_image_after_ten_attempts():
    rng = Scripted(uniforms=[0.0] * 20)
    assert T.RandomResizedCrop.get_params((40, 30), (2.0, 3.0), (3 / 4, 4 / 3), rng) == (0, 0, 30, 40)
    assert [c[0] for c in rng.calls] == ["uniform"] * 20


def test_rrc_is_single_crop_resize_of_get_params():
    img, t = rgb(320, 240), T.RandomResizedCrop(64, interpolation=T.InterpolationMode.BICUBIC)
    with sample_rng(3, 1, 4):
        top, left, h, w = t.get_params(img, t.scale, t.ratio)
    with sample_rng(3, 1, 4):
        out = t(img)
    ref = img.crop((left, top, left + w, top + h)).resize((64, 64), Image.BICUBIC)
    # One resize(box=...) call: only the outer ring (where PIL's filter reads pixels
    # beyond the box instead of clamping) may differ from crop-then-resize.
    diff = np.abs(np.asarray(out).astype(int) - np.asarray(ref).astype(int))
    assert out.size == (64, 64) and not diff[3:-3, 3:-3].any()
    full = T.resized_crop(img, 0, 0, 240, 320, (60, 80), Image.BILINEAR)
    assert np.array_equal(np.asarray(full), np.asarray(img.resize((80, 60), Image.BILINEAR)))


def test_rrc_drawing_its_mode_per_call():
    """``interpolation`` as a sequence (timm's "random"): one mode drawn
    per call after the box, ``rng.random()`` scaled to the modes; the fused
    decode (``from_bytes``) gives the call's pixels, bit for bit, with the
    same draws; one distinct mode is that mode; an empty sequence is refused."""
    import io

    M = T.InterpolationMode
    t = T.RandomResizedCrop(40, interpolation=[M.BILINEAR, "bicubic"])
    assert t.interpolation == (M.BILINEAR, M.BICUBIC) and "interpolation=(bilinear, bicubic)" in repr(t)
    assert T.RandomResizedCrop(40, interpolation=("bicubic", M.BICUBIC)).interpolation is M.BICUBIC
    assert t.spec() != T.RandomResizedCrop(40).spec() and t == pickle.loads(pickle.dumps(t))
    rng = Scripted(uniforms=[0.5, 0.0], randoms=[0.99])
    assert T.RandomResizedCrop.get_params((100, 80), t.scale, t.ratio, rng) and t.draw_mode(rng) == 1
    assert T.RandomResizedCrop(40).draw_mode(Scripted()) == 0      # one mode: no draw
    buf = io.BytesIO()
    rgb(173, 131, seed=2).save(buf, "JPEG", quality=90)
    raw = buf.getvalue()
    pipe = T.Compose([t, T.RandomHorizontalFlip(), T.PILToTensor()])
    seen = set()
    for i in range(24):
        with sample_rng(1, 0, i):
            fused = pipe.from_bytes(raw)
        with sample_rng(1, 0, i):
            called = pipe(Image.open(io.BytesIO(raw)).convert("RGB"))
        with sample_rng(1, 0, i) as g:
            T.RandomResizedCrop.get_params((173, 131), t.scale, t.ratio, g)
            seen.add(t.draw_mode(g))
        assert torch.equal(fused, called), i
    assert seen == {0, 1}
    with pytest.raises(ValueError, match="non-empty sequence of modes"):
        T.RandomResizedCrop(8, interpolation=())


def test_rrc_tensor_input():
    x = torch.randint(0, 256, (3, 120, 90), dtype=torch.uint8)
    out = T.RandomResizedCrop((32, 48))(x)
    assert out.shape == (3, 32, 48) and out.dtype == torch.uint8


# ------------------------------------------------------------------- randomness
def test_same_triple_same_output_different_epoch_differs():
    img = rgb(256, 192)
    pipe = T.Compose([T.RandomResizedCrop(48), T.RandomHorizontalFlip(), T.PILToTensor()])

    def run(seed, epoch, idx):
        with sample_rng(seed, epoch, idx):
            return pipe(img)

    assert torch.equal(run(1, 0, 5), run(1, 0, 5))
    outs = [run(1, e, 5) for e in range(6)]
    assert sum(not torch.equal(outs[0], o) for o in outs[1:]) >= 4
    params = {T.RandomResizedCrop.get_params(img, (0.08, 1.0), (3 / 4, 4 / 3), derive(1, e, 5))
              for e in range(20)}
    assert len(params) >= 15


def test_generator_looked_up_at_call_time(monkeypatch):
    t = T.RandomResizedCrop(16)
    with sample_rng(9, 2, 7):
        inside = t.get_params((100, 80), t.scale, t.ratio)
    assert inside == t.get_params((100, 80), t.scale, t.ratio, derive(9, 2, 7))
    flip = T.RandomHorizontalFlip(0.5)
    monkeypatch.setattr(crng, "current", lambda: Scripted(randoms=[0.49]))
    assert flip(torch.tensor([[[1, 2]]])).tolist() == [[[2, 1]]]
    monkeypatch.setattr(crng, "current", lambda: Scripted(randoms=[0.5]))
    assert flip(torch.tensor([[[1, 2]]])).tolist() == [[[1, 2]]]


def test_torch_manual_seed_reproducible_outside_loader():
    img = rgb(200, 150)
    pipe = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToTensor()])
    torch.manual_seed(0)
    a = pipe(img)
    after_a = torch.rand(1)
    torch.manual_seed(0)
    b = pipe(img)
    assert torch.equal(a, b) and torch.equal(after_a, torch.rand(1))
    torch.manual_seed(0)
    assert not torch.equal(after_a, torch.rand(1))  # the transforms drew from torch's RNG


# ------------------------------------------------------------------------- flip
def test_flip_p0_p1_pil_and_tensor():
    img = rgb(17, 9)
    arr = np.asarray(img)
    for _ in range(20):
        assert np.array_equal(np.asarray(T.RandomHorizontalFlip(0.0)(img)), arr)
        assert np.array_equal(np.asarray(T.RandomHorizontalFlip(1.0)(img)), arr[:, ::-1])
    x = torch.arange(24).reshape(2, 3, 4)
    assert torch.equal(T.RandomHorizontalFlip(p=1)(x), x.flip(-1))
    assert T.RandomHorizontalFlip(p=0)(x) is x


def test_vertical_flip_p0_p1_and_the_fused_decode():
    """RandomVerticalFlip mirrors top-bottom (PIL and tensors); wherever it
    stands among the fused steps, ``from_bytes`` gives the call's pixels
    bit for bit with the same draws; its spec is its own."""
    import io

    img = rgb(17, 9)
    arr = np.asarray(img)
    assert np.array_equal(np.asarray(T.RandomVerticalFlip(1.0)(img)), arr[::-1])
    assert np.array_equal(np.asarray(T.RandomVerticalFlip(0.0)(img)), arr)
    x = torch.arange(24).reshape(2, 3, 4)
    assert torch.equal(T.RandomVerticalFlip(p=1)(x), x.flip(-2)) and T.RandomVerticalFlip(p=0)(x) is x
    assert T.RandomVerticalFlip(0.5).spec() != T.RandomHorizontalFlip(0.5).spec()
    buf = io.BytesIO()
    rgb(151, 97, seed=4).save(buf, "JPEG", quality=90)
    raw = buf.getvalue()
    for steps in ([T.RandomVerticalFlip(), T.RandomResizedCrop(31), T.RandomVerticalFlip(), T.RandomHorizontalFlip()],
                  [T.Resize(40), T.RandomVerticalFlip(0.7), T.CenterCrop((30, 25)), T.RandomHorizontalFlip()],
                  [T.RandomResizedCrop(20), T.RandomHorizontalFlip(), T.RandomVerticalFlip(), T.RandomCrop(15)]):
        for head in (T.PILToTensor(), T.ToTensor()):
            pipe = T.Compose(steps + [head])
            for i in range(12):
                with sample_rng(2, 0, i):
                    fused = pipe.from_bytes(raw)
                with sample_rng(2, 0, i):
                    called = pipe(Image.open(io.BytesIO(raw)).convert("RGB"))
                assert torch.equal(fused, called), (steps, i)


def test_flip_frequency():
    flip, x = T.RandomHorizontalFlip(0.3), torch.tensor([[[0, 1]]])
    flips = 0
    for i in range(3000):
        with sample_rng(0, 0, i):
            flips += int(flip(x)[0, 0, 0] == 1)
    assert abs(flips / 3000 - 0.3) < 0.03


# ----------------------------------------------------------------------- Resize
@pytest.mark.parametrize("wh,kwargs,expected_wh", [
    ((300, 200), dict(size=100), (150, 100)),
    ((333, 200), dict(size=100), (166, 100)),          # long = int(100 * 333 / 200) = int(166.5)
    ((299, 200), dict(size=100), (149, 100)),          # int(149.5), not round()
    ((200, 333), dict(size=[100]), (100, 166)),
    ((333, 200), dict(size=100, max_size=150), (150, 90)),  # short = int(150 * 100 / 166)
    ((333, 200), dict(size=100, max_size=200), (166, 100)),  # cap not reached
    ((333, 200), dict(size=None, max_size=100), (100, 60)),
    ((333, 200), dict(size=(50, 80)), (80, 50)),
])
def test_resize_sizes(wh, kwargs, expected_wh):
    assert T.Resize(**kwargs)(rgb(*wh)).size == expected_wh
    h, w = T.Resize(**kwargs)(torch.zeros(3, wh[1], wh[0])).shape[-2:]
    assert (w, h) == expected_wh


def test_resize_same_size_is_identity_and_interpolation_aliases():
    img = rgb(100, 80)
    assert T.Resize(80)(img) is img
    assert T.Resize(40, interpolation=Image.BICUBIC).interpolation is T.InterpolationMode.BICUBIC
    assert T.Resize(40, interpolation="lanczos").interpolation is T.InterpolationMode.LANCZOS
    assert T.InterpolationMode.BILINEAR == "bilinear"
    near = T.Resize((4, 4), interpolation=T.InterpolationMode.NEAREST)(grid(8, 8))
    assert set(np.unique(np.asarray(near))) <= set(np.unique(np.asarray(grid(8, 8))))


def test_resize_tensor_matches_pil_and_keeps_dtype():
    yy, xx = np.mgrid[0:120, 0:160]
    arr = np.stack([(xx + yy) % 256, (2 * xx) % 256, yy * 2], -1).astype(np.uint8)
    img = Image.fromarray(arr)
    x = torch.from_numpy(arr.copy()).permute(2, 0, 1)
    out = T.Resize(60)(x)
    assert out.shape == (3, 60, 80) and out.dtype == torch.uint8
    ref = torch.from_numpy(np.asarray(T.Resize(60)(img)).copy()).permute(2, 0, 1)
    assert (out.int() - ref.int()).abs().float().mean() < 1.0
    batch = T.Resize(60)(torch.stack([x, x]).float())
    assert batch.shape == (2, 3, 60, 80) and batch.dtype == torch.float32
    noaa = T.Resize(30, antialias=False)(x.float())
    assert not torch.allclose(noaa, T.Resize(30)(x.float()))
    with pytest.raises(ValueError, match="interpolation should be"):
        T.Resize(30, interpolation=T.InterpolationMode.BOX)(x)


# ------------------------------------------------------------------- CenterCrop
def test_center_crop_offsets_use_round_half_even():
    img = grid(10, 7)
    arr = np.asarray(img)
    # top = round(1.5) = 2, left = round(2.5) = 2
    assert np.array_equal(np.asarray(T.CenterCrop((4, 5))(img)), arr[2:6, 2:7])
    # top = round(2.0) = 2, left = round(3.5) = 4
    assert np.array_equal(np.asarray(T.CenterCrop(3)(img)), arr[2:5, 4:7])
    x = torch.from_numpy(arr.copy())[None]
    assert torch.equal(T.CenterCrop(3)(x)[0], torch.from_numpy(arr[2:5, 4:7].copy()))


@pytest.mark.parametrize("as_tensor", [False, True])
def test_center_crop_pads_with_zeros(as_tensor):
    arr = np.asarray(grid(10, 7))
    img = torch.from_numpy(arr.copy())[None] if as_tensor else grid(10, 7)

    def crop(size):
        out = T.CenterCrop(size)(img)
        return out[0].numpy() if as_tensor else np.asarray(out)

    big = crop((9, 13))  # pad top 1, bottom 1, left 1, right 2
    assert big.shape == (9, 13)
    assert np.array_equal(big[1:8, 1:11], arr)
    assert big.sum() == arr.astype(np.int64).sum()
    tall = crop((10, 4))  # pad top 1, bottom 2; left = round(3.0) = 3
    assert tall.shape == (10, 4) and np.array_equal(tall[1:8], arr[:, 3:7])
    assert not tall[0].any() and not tall[8:].any()


# ------------------------------------------------------------ tensor conversion
def test_pil_to_tensor_exact():
    img = rgb(13, 7)
    t = T.PILToTensor()(img)
    assert t.dtype == torch.uint8 and t.shape == (3, 7, 13) and t.is_contiguous()
    assert np.array_equal(t.numpy(), np.asarray(img).transpose(2, 0, 1))
    t[0, 0, 0] = 0  # writable, owns its memory
    gray = grid(5, 4)
    assert np.array_equal(T.PILToTensor()(gray).numpy(), np.asarray(gray)[None])
    bw = T.PILToTensor()(gray.convert("1"))
    assert bw.shape == (1, 4, 5) and set(bw.unique().tolist()) <= {0, 255}
    i32 = T.PILToTensor()(Image.fromarray(np.arange(12, dtype=np.int32).reshape(3, 4)))
    assert i32.dtype == torch.int32 and i32.flatten().tolist() == list(range(12))
    with pytest.raises(TypeError, match="pic should be a PIL Image"):
        T.PILToTensor()(np.zeros((2, 2, 3), np.uint8))


def test_to_tensor_exact_values_and_range():
    img = rgb(11, 6)
    arr = np.asarray(img)
    expected = torch.from_numpy(arr.transpose(2, 0, 1).astype(np.float32) / np.float32(255))
    t = T.ToTensor()(img)
    assert t.dtype == torch.float32 and t.shape == (3, 6, 11)
    assert torch.equal(t, expected) and 0.0 <= t.min() and t.max() <= 1.0
    assert torch.equal(T.ToTensor()(arr.copy()), expected)
    assert T.ToTensor()(np.full((4, 5), 255, np.uint8)).shape == (1, 4, 5)
    assert torch.equal(T.ToTensor()(np.full((4, 5), 255, np.uint8)), torch.ones(1, 4, 5))
    floats = np.full((2, 2, 1), 7.5, np.float32)
    assert torch.equal(T.ToTensor()(floats), torch.full((1, 2, 2), 7.5))  # not rescaled
    with pytest.raises(ValueError, match="pic.ndim should be 2 or 3"):
        T.ToTensor()(np.zeros((1, 2, 2, 3), np.uint8))


# -------------------------------------------------------------------- Normalize
def test_normalize_math_and_inplace():
    x = torch.rand(3, 4, 5)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    out = T.Normalize(mean, std)(x)
    expected = (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    assert torch.allclose(out, expected) and out is not x
    assert not torch.allclose(x, out)  # input untouched
    batch = torch.rand(2, 3, 4, 5)
    assert torch.allclose(T.Normalize(mean, std)(batch), (batch - torch.tensor(mean)[:, None, None])
                          / torch.tensor(std)[:, None, None])
    y = x.clone()
    assert T.Normalize(mean, std, inplace=True)(y) is y and torch.allclose(y, expected)


def test_normalize_errors():
    with pytest.raises(ValueError, match="std evaluated to zero after conversion to torch.float32"):
        T.Normalize([0.5, 0.5], [1.0, 0.0])(torch.rand(2, 3, 3))
    with pytest.raises(ValueError, match="std evaluated to zero"):
        T.Normalize([0.0], [1e-50])(torch.rand(1, 3, 3))  # zero once cast to float32
    with pytest.raises(TypeError, match="float tensor"):
        T.Normalize([0.5], [0.5])(torch.zeros(1, 2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="tensor image of size"):
        T.Normalize([0.5], [0.5])(torch.zeros(2, 2))


# ------------------------------------------------------- Compose, spec, pickling
def test_compose_accepts_any_callable():
    pipe = T.Compose([T.CenterCrop(4), T.PILToTensor(), lambda t: t + 1])
    out = pipe(grid(6, 6))
    assert torch.equal(out, torch.from_numpy(np.asarray(grid(6, 6))[1:5, 1:5].copy())[None] + 1)
    lam = f"{__name__}.test_compose_accepts_any_callable.<locals>.<lambda>"
    assert pipe.spec()[1][2][:2] == ("function", lam)
    assert "Compose(\n    CenterCrop(size=(4, 4))\n    PILToTensor()\n" in repr(pipe)
    with pytest.raises(TypeError, match="transforms should be a sequence of callables, but got transforms="):
        T.Compose([T.ToTensor(), 3])


def _plain_values_only(spec):
    if isinstance(spec, tuple):
        return all(_plain_values_only(s) for s in spec)
    return spec is None or isinstance(spec, (str, int, float, bool))


def pipeline(size=224, p=0.5):
    return T.Compose([
        T.RandomResizedCrop(size, interpolation=T.InterpolationMode.BICUBIC), T.RandomHorizontalFlip(p),
        T.Resize(256, max_size=300), T.CenterCrop(224), T.ToTensor(), T.PILToTensor(),
        T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])


def test_spec_equality_and_inequality():
    a, b = pipeline(), pipeline()
    assert a is not b and a == b and hash(a) == hash(b) and a.spec() == b.spec()
    assert _plain_values_only(a.spec())
    assert a != pipeline(size=192) and a != pipeline(p=0.25)
    assert T.RandomResizedCrop(224) == T.RandomResizedCrop([224, 224]) == T.RandomResizedCrop((224,))
    assert T.RandomResizedCrop(224) != T.RandomResizedCrop(224, scale=(0.2, 1.0))
    assert T.RandomResizedCrop(224) != T.RandomResizedCrop(224, interpolation=Image.NEAREST)
    assert T.Resize(256) == T.Resize([256]) != T.Resize((256, 256))
    assert T.CenterCrop(4) != T.Resize(4) and T.ToTensor() != T.PILToTensor()
    assert len({T.RandomHorizontalFlip(), T.RandomHorizontalFlip(0.5), T.RandomHorizontalFlip(1.0)}) == 2
    assert T.RandomResizedCrop(224).spec() == ("RandomResizedCrop", (
        ("size", (224, 224)), ("scale", (0.08, 1.0)), ("ratio", (0.75, 4 / 3)),
        ("interpolation", "bilinear"), ("antialias", True)))
    assert repr(T.RandomResizedCrop(224)) == ("RandomResizedCrop(size=(224, 224), scale=(0.08, 1.0), "
                                              "ratio=(0.75, 1.3333), interpolation=bilinear, antialias=True)")


def test_spec_of_arbitrary_callables():
    assert T.spec_of(T.ToTensor()) == T.ToTensor().spec()
    assert T.spec_of(len) == ("callable", "len")
    assert T.spec_of(np.flipud) == ("callable", "numpy.flipud")
    assert T.spec_of(np.sqrt) == ("callable", "numpy.sqrt")
    this = T.spec_of(test_spec_of_arbitrary_callables)
    assert this == ("function", f"{__name__}.test_spec_of_arbitrary_callables")
    assert T.spec_of(T.Resize) == ("callable", "coordl.transforms.Resize")
    f, g = (lambda x: x + 1), (lambda x: x + 2)
    assert T.spec_of(f) != T.spec_of(g)
    mk = lambda k: (lambda x: x * k)  # noqa: E731
    assert T.spec_of(mk(2)) == T.spec_of(mk(2)) != T.spec_of(mk(3))
    part = T.spec_of(functools.partial(np.clip, a_min=0))
    assert part[:2] == ("callable", "functools.partial") and "0x" not in part[2]

    class Obj:
        def __call__(self, x):
            return x

    assert "0x" not in T.spec_of(Obj())[2] and T.spec_of(Obj()) == T.spec_of(Obj())
    hash(T.Compose([f, Obj(), np.sqrt, T.ToTensor()]))


def test_pickle_round_trip_preserves_spec():
    pipe = pipeline()
    back = pickle.loads(pickle.dumps(pipe))
    assert back == pipe and back.spec() == pipe.spec() and repr(back) == repr(pipe)
    for t in pipe.transforms:
        assert pickle.loads(pickle.dumps(t)) == t
    img = rgb(320, 240)
    with sample_rng(5, 0, 1):
        a = pipe.transforms[0](img)
    with sample_rng(5, 0, 1):
        b = back.transforms[0](img)
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_spec_equal_across_processes():
    code = ("import pickle, sys; sys.path.insert(0, 'tests'); from test_transforms import pipeline; "
            "sys.stdout.buffer.write(pickle.dumps(pipeline().spec()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, check=True, timeout=120)
    assert pickle.loads(out.stdout) == pipeline().spec()


# ------------------------------------------------------------------- validation
@pytest.mark.parametrize("make,exc,msg", [
    (lambda: T.RandomResizedCrop(-3), ValueError,
     "size should be a positive int or a sequence of 1 or 2 positive ints, but got size=-3"),
    (lambda: T.RandomResizedCrop((1, 2, 3)), ValueError, "but got size=(1, 2, 3)"),
    (lambda: T.RandomResizedCrop("224"), TypeError, "but got size='224'"),
    (lambda: T.CenterCrop(True), TypeError, "but got size=True"),
    (lambda: T.Resize(0), ValueError, "but got size=0"),
    (lambda: T.RandomResizedCrop(8, scale=(0.5,)), TypeError, "scale should be a sequence of 2"),
    (lambda: T.RandomResizedCrop(8, ratio=(0.0, 1.0)), ValueError,
     "ratio should be a sequence of 2 positive numbers (min, max), but got ratio=(0.0, 1.0)"),
    (lambda: T.RandomResizedCrop(8, interpolation=99), ValueError, "but got interpolation=99"),
    (lambda: T.RandomResizedCrop(8, antialias="yes"), TypeError, "antialias should be a bool or None"),
    (lambda: T.RandomHorizontalFlip(1.5), ValueError, "p should be a probability in [0, 1], but got p=1.5"),
    (lambda: T.Resize(256, max_size=256), ValueError,
     "max_size should be greater than size=256, but got max_size=256"),
    (lambda: T.Resize((256, 256), max_size=300), ValueError, "but got max_size=300"),
    (lambda: T.Resize(None), ValueError, "max_size should be a positive int when size is None"),
    (lambda: T.Normalize("abc", (1.0,)), TypeError, "mean should be a number or a non-empty sequence"),
])
def test_validation_messages(make, exc, msg):
    with pytest.raises(exc) as info:
        make()
    assert msg in str(info.value)


def test_min_max_warning_and_reversed_ranges_still_work():
    with pytest.warns(UserWarning, match=r"Scale and ratio should be of kind \(min, max\)"):
        t = T.RandomResizedCrop(8, scale=(1.0, 0.5))
    with pytest.warns(UserWarning, match="Scale and ratio"):
        T.RandomResizedCrop(8, ratio=(4 / 3, 3 / 4))
    assert t.scale == (1.0, 0.5)
    for _ in range(20):
        _, _, h, w = t.get_params((100, 100), t.scale, t.ratio)
        assert 0 < h <= 100 and 0 < w <= 100
    torch.manual_seed(0)
    assert t(rgb(50, 40)).size == (8, 8)


def test_random_crop_is_the_same_window_on_pil_and_tensor_and_refuses_small_images():
    img = rgb(50, 40)
    x = T.PILToTensor()(img)
    crop = T.RandomCrop((10, 20))
    for i in range(20):
        with sample_rng(1, 0, i):
            a = T.PILToTensor()(crop(img))
        with sample_rng(1, 0, i):
            b = crop(x)
        assert a.shape == b.shape == (3, 10, 20) and torch.equal(a, b)
    with pytest.raises(ValueError, match="larger than input image size"):
        T.RandomCrop(60)(img)


@pytest.mark.parametrize("kw", [dict(padding=4), dict(padding=(1, 2, 3, 4), fill=(9, 80, 200)),
                                dict(padding=(2, 5), padding_mode="reflect"), dict(pad_if_needed=True, fill=7.9),
                                dict(padding=3, pad_if_needed=True, padding_mode="symmetric"),
                                dict(pad_if_needed=True, padding_mode="edge")])
def test_a_padded_random_crop_is_the_same_window_on_pil_and_tensor(kw):
    """Padding (then padding where needed) before the draw: the same window
    of the same padded image on a PIL image and its tensor; an image
    smaller than the crop fits with ``pad_if_needed``; the fill truncated
    to an int, as PIL takes it; a spec that tells paddings apart."""
    img = rgb(30, 22)
    x = T.PILToTensor()(img)
    crop = T.RandomCrop((26, 34) if kw.get("pad_if_needed") else (12, 20), **kw)
    for i in range(20):
        with sample_rng(2, 0, i):
            a = T.PILToTensor()(crop(img))
        with sample_rng(2, 0, i):
            b = crop(x)
        assert a.shape == b.shape == (3, *crop.size) and torch.equal(a, b)
    if kw.get("fill") == 7.9:
        assert crop.fill == 7 and int(crop._padded(x)[:, 0, 0].unique()) == 7
    assert T.RandomCrop(12, **kw).spec() != T.RandomCrop(12).spec()
    assert T.RandomCrop(12, padding=None).spec() == T.RandomCrop(12).spec()


@pytest.mark.parametrize("kw", [dict(padding=3), dict(padding=(2, 5), padding_mode="reflect", fill=4),
                                dict(padding=(1, 0, 2, 3), fill=(9, 80, 200)), dict(padding=4, padding_mode="edge")])
def test_pad_is_the_same_on_pil_and_tensor(kw):
    img = rgb(17, 11)
    pad = T.Pad(**kw)
    a = T.PILToTensor()(pad(img))
    b = pad(T.PILToTensor()(img))
    left, top, right, bottom = pad.padding
    assert torch.equal(a, b) and a.shape == (3, 11 + top + bottom, 17 + left + right)
    assert torch.equal(b[:, top:top + 11, left:left + 17], T.PILToTensor()(img))
    assert pad.spec() != T.Pad(1).spec() and T.Pad(**kw).spec() == pad.spec()
    with pytest.raises(ValueError, match="padding_mode"):
        T.Pad(2, padding_mode="circular")


@pytest.mark.parametrize("kw,err", [(dict(padding=-1), ValueError), (dict(padding=(1, 2, 3)), ValueError),
                                    (dict(padding="4"), TypeError), (dict(fill=256), ValueError),
                                    (dict(fill=(1, None, 3)), ValueError), (dict(padding_mode="wrap"), ValueError),
                                    (dict(pad_if_needed=1), TypeError)])
def test_a_random_crops_padding_arguments_are_checked(kw, err):
    with pytest.raises(err, match=next(iter(kw))):
        T.RandomCrop(8, **kw)


def test_to_dtype_scales_integers_only():
    x = torch.tensor([[[0, 255, 51]]], dtype=torch.uint8)
    assert torch.equal(T.ToDtype(torch.float32, scale=True)(x), x.float() / 255)
    assert torch.equal(T.ToDtype(torch.float32)(x), x.float())
    f = torch.rand(1, 2, 2)
    assert torch.equal(T.ToDtype(torch.float64, scale=True)(f), f.double())
    with pytest.raises(TypeError, match="floating torch.dtype"):
        T.ToDtype(torch.uint8)
    # fused: decode + crop + ToDtype, as the torchvision translation builds it
    assert T._fusable([T.RandomCrop(8), T.PILToTensor(), T.ToDtype(torch.float32, scale=True)])
