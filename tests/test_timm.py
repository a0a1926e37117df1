"""timm's transforms (``timm.data.create_transform``) on coordl's pipeline:
recognized where coordl's transforms compute the same thing, the rest run
as written; coordl never imports timm itself."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _torchvision import import_torchvision  # noqa: E402

if import_torchvision() is None:
    pytest.skip("torchvision is not installed (pip install coordl[test])", allow_module_level=True)
timm = pytest.importorskip("timm", reason="timm is not installed (pip install timm)")

from timm.data import create_transform  # noqa: E402
from timm.data import transforms as TT  # noqa: E402
from torchvision import datasets as D  # noqa: E402

import coordl  # noqa: E402
from coordl import _rng  # noqa: E402
from coordl.decode import color as C  # noqa: E402
from coordl import transforms as T  # noqa: E402
from coordl.tvcompat import ColorJitterOnPlanes, TorchvisionPipeline, translate  # noqa: E402


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("timm", num_images=24, num_classes=3, mean_kb=3, image_size=(64, 48), seed=5)


def test_timm_default_train_fuses_the_crop_and_flip():
    out, fused, rest = translate(create_transform(224, is_training=True))
    assert fused == ("RandomResizedCropAndInterpolation", "RandomHorizontalFlip")
    assert rest == ("ColorJitter", "MaybeToTensor", "Normalize")
    assert isinstance(out, TorchvisionPipeline) and out.to_pil
    rrc = out.fused.transforms[0]
    assert type(rrc) is T.RandomResizedCrop and rrc.size == (224, 224) and rrc.scale == (0.08, 1.0)
    assert rrc.ratio == pytest.approx((3 / 4, 4 / 3)) and rrc.interpolation.value == "bilinear"
    # the user's ColorJitter draws; coordl computes PIL's pixels on the planes (test_color_jitter.py)
    if C._ext is not None:
        assert [type(t) for t in out.tail] == [ColorJitterOnPlanes]
        assert type(out.tail[0].user).__name__ == "ColorJitter"
    else:
        assert [type(t).__name__ for t in out.tail] == ["ColorJitter"]
    assert [type(t).__name__ for t in out.post] == ["MaybeToTensor", "Normalize"]
    assert [type(t) for t in out.post_fused.transforms] == [T.ToTensor, T.Normalize]


@pytest.mark.parametrize("kw", [{}, {"interpolation": "bicubic", "crop_pct": 0.95}])
def test_timm_eval_fuses_whole(kw):
    out, fused, rest = translate(create_transform(224, is_training=False, **kw))
    assert fused == ("Resize", "CenterCrop", "MaybeToTensor", "Normalize") and rest == ()
    assert [type(t) for t in out.transforms] == [T.Resize, T.CenterCrop, T.ToTensor, T.Normalize]


def test_timm_random_interpolation_fuses_drawing_a_mode_per_sample():
    """timm's ``interpolation="random"`` (its train.py's default): coordl's
    RandomResizedCrop draws bilinear or bicubic per sample, uniformly."""
    out, fused, rest = translate(create_transform(32, is_training=True, interpolation="random"))
    assert fused == ("RandomResizedCropAndInterpolation", "RandomHorizontalFlip")
    rrc = out.fused.transforms[0]
    assert rrc.interpolation == (T.InterpolationMode.BILINEAR, T.InterpolationMode.BICUBIC)
    assert rrc.spec() != T.RandomResizedCrop(32, interpolation="bilinear").spec()
    picked = []
    for i in range(2000):
        with _rng.sample_rng(3, 0, i) as g:
            picked.append(rrc.draw_mode(g))
    assert set(picked) == {0, 1} and abs(sum(picked) - 1000) < 4 * math.sqrt(500)


def test_jpeg_draft_takes_timms_random_interpolation(photos):
    """``jpeg_draft=True`` with a mode drawn per sample (both filtered):
    the reduced-scale decode applies, and the loader runs."""
    ds = D.ImageFolder(photos, transform=create_transform(32, is_training=True, interpolation="random"))
    L = coordl.DataLoader(ds, batch_size=8, seed=1, jpeg_draft=True)
    assert "reduced-scale JPEG decode before RandomResizedCrop" in L.stats().path_reason, L.stats().path_reason
    x, _ = next(iter(L))
    assert x.shape == (8, 3, 32, 32)


def test_what_timm_draws_or_computes_differently_runs_as_written():
    from torchvision.transforms import InterpolationMode as M

    odd = TT.RandomResizedCropAndInterpolation(32, interpolation="random")
    odd.interpolation = (M.NEAREST, M.BILINEAR)    # PIL's nearest is not torch's
    out, fused, rest = translate(odd)
    assert fused == () and rest == ("RandomResizedCropAndInterpolation",)
    assert translate(TT.CenterCropOrPad(32, fill=(1, 2, 3)))[1] == ()
    assert translate(TT.ResizeKeepRatio(32))[1] == ()
    assert translate(TT.ToNumpy())[1] == ()
    out, fused, _ = translate(TT.ToTensor(torch.float64))
    assert fused == ("ToTensor",) and [type(t) for t in out.transforms] == [T.PILToTensor, T.ToDtype]
    assert out.transforms[1].dtype == torch.float64 and out.transforms[1].scale is False


@pytest.mark.parametrize("H, W, scale, ratio", [(375, 500, (0.08, 1.0), (3 / 4, 4 / 3)),
                                                (60, 400, (0.5, 1.0), (0.9, 1.1))])  # often the fallback
def test_timm_crop_draws_follow_timms_distributions(H, W, scale, ratio):
    import random

    t = TT.RandomResizedCropAndInterpolation(32, scale=scale, ratio=ratio)
    from PIL import Image

    img = Image.new("RGB", (W, H))
    random.seed(0)
    theirs = np.array([t.get_params(img, t.scale, t.ratio) for _ in range(3000)], dtype=float)
    rrc = translate(t)[0].fused.transforms[0]
    ours = []
    for i in range(3000):
        with _rng.sample_rng(5, 0, i) as g:
            ours.append(T.RandomResizedCrop.get_params((W, H), rrc.scale, rrc.ratio, rng=g))
    ours = np.array(ours, dtype=float)

    def ks(a, b):
        a, b = np.sort(a), np.sort(b)
        grid = np.concatenate([a, b])
        return float(np.max(np.abs(np.searchsorted(a, grid, "right") / len(a)
                                   - np.searchsorted(b, grid, "right") / len(b))))

    for f in (lambda p: p[:, 2] * p[:, 3], lambda p: np.log(p[:, 3] / p[:, 2]),
              lambda p: p[:, 0] / np.maximum(H - p[:, 2], 1), lambda p: p[:, 1] / np.maximum(W - p[:, 3], 1)):
        assert ks(f(ours), f(theirs)) < 1.95 * math.sqrt(2 / 3000)


def test_center_crop_or_pad_is_torchvisions_center_crop():
    from PIL import Image

    for size in ((20, 30), (50, 70), (40, 10)):
        img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (33, 41, 3), dtype=np.uint8))
        want = TT.MaybePILToTensor()(TT.CenterCropOrPad(size)(img))
        out, fused, _ = translate(_compose(TT.CenterCropOrPad(size), TT.MaybePILToTensor()))
        assert fused == ("CenterCropOrPad", "MaybePILToTensor")
        got = out(img)
        assert torch.equal(got, want), size


def _compose(*ts):
    from torchvision import transforms as V1

    return V1.Compose(list(ts))


@pytest.mark.parametrize("training", [True, False])
def test_timm_pipelines_on_the_loader(photos, training):
    tf = create_transform(32, is_training=training)
    ds = D.ImageFolder(photos, transform=tf)
    L = coordl.DataLoader(ds, batch_size=8, shuffle=True, seed=3, num_workers=2)
    s = L.stats()
    want = ("fused RandomResizedCropAndInterpolation, RandomHorizontalFlip" if training else
            "fused Resize, CenterCrop, MaybeToTensor, Normalize")
    assert s.path == "coordl" and want in s.path_reason, s.path_reason
    xs = [x for x, _ in L]
    again = [x for x, _ in coordl.DataLoader(ds, batch_size=8, shuffle=True, seed=3)]
    assert all(torch.equal(a, b) for a, b in zip(xs, again))   # every placement draws the same
    assert xs[0].shape == (8, 3, 32, 32) and xs[0].dtype == torch.float32
    if not training:
        ref = torch.utils.data.DataLoader(ds, batch_size=24)
        (rx, _), = list(ref)
        (x, _), = list(coordl.DataLoader(ds, batch_size=24))
        # fused Resize + CenterCrop vs timm's PIL run (pixels: see test_torchvision)
        assert (x - rx).abs().mean() < 0.1


def test_coordl_never_imports_timm():
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from _torchvision import import_torchvision; import_torchvision()\n"
            "from torchvision import datasets, transforms as V\n"
            "import coordl, coordl.tvcompat\n"
            "from coordl.synth import make_image_folder\n"
            "import tempfile; d = tempfile.mkdtemp()\n"
            "make_image_folder(d, num_images=4, num_classes=2, image_size=(32, 24))\n"
            "ds = datasets.ImageFolder(d, transform=V.Compose([V.RandomResizedCrop(8), V.ToTensor()]))\n"
            "list(coordl.DataLoader(ds, batch_size=2))\n"
            "print('timm' in sys.modules)\n" % HERE)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


# (width, height): odd sides, a single row and a single column
ODD_SIZES = [(67, 45), (1, 40), (40, 1), (3, 5), (301, 199)]


@pytest.fixture(scope="module")
def odd_photos(tmp_path_factory):
    from coordl.synth import render_image

    root = tmp_path_factory.mktemp("timm_odd") / "photos"
    for k, (w, h) in enumerate(ODD_SIZES * 2):
        d = root / f"class_{k % 2}"
        d.mkdir(parents=True, exist_ok=True)
        render_image(9, k, w, h, 1.5).save(d / f"img_{k}_{w}x{h}.jpg", "JPEG", quality=90)
    return str(root)


def _timms_geometry(path, g, ours, rrc, flip, vflip=None):
    """``(image, drawn)``: what timm's crop, flip and vertical flip (where
    given) make of PIL's decode of ``path`` for the draws coordl's sample
    generator ``g`` makes: the box (``ours``' scale and ratio), then the
    mode where ``rrc`` draws one, the flip, the vertical flip; ``drawn``
    the mode and whether it flipped top-bottom."""
    from torchvision.datasets.folder import pil_loader
    from torchvision.transforms import functional as F

    from coordl.decode.ops import _draw_box

    pil = pil_loader(path)
    box = _draw_box(pil.height, pil.width, ours.scale, ours.ratio, g)
    modes = rrc.interpolation
    mode = modes[int(g.random() * len(modes))] if isinstance(modes, (tuple, list)) else modes
    img = F.resized_crop(pil, *box, list(rrc.size), mode)
    if g.random() < flip.p:
        img = F.hflip(img)
    upside = vflip is not None and g.random() < vflip.p
    return (F.vflip(img) if upside else img), {"mode": mode, "upside": upside}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("jitter", [0.4, (0.4, 0.4, 0.4, 0.1)], ids=["default", "hue"])
def test_timm_train_through_the_loader_is_timms_own_result_for_the_same_draws(odd_photos, num_workers, jitter):
    """timm's default train transform on coordl.DataLoader: each sample is,
    tensor for tensor, what timm's and torchvision's own transforms give on
    PIL's decode for the draws coordl's sample generator makes (crop box and
    flip, then the seed of torch's generator under which ColorJitter draws)."""
    tf = create_transform(40, is_training=True, color_jitter=jitter)
    rrc, flip, cj, to_tensor, norm = tf.transforms
    assert type(cj).__name__ == "ColorJitter" and (cj.hue is None) == (jitter == 0.4)
    ds = D.ImageFolder(odd_photos, transform=tf)
    L = coordl.DataLoader(ds, batch_size=len(ds), shuffle=False, seed=7, num_workers=num_workers)
    if C._ext is not None:
        assert "ColorJitter with its own draws and PIL's arithmetic" in L.stats().path_reason, L.stats().path_reason
    out = translate(tf)[0]
    ours = out.fused.transforms[0]   # coordl's RandomResizedCrop: its scale and ratio
    if C._ext is not None:   # ColorJitter runs on coordl's kernel here, not as written
        assert isinstance(out.tail[0], ColorJitterOnPlanes) and out.tail[0].exact()
    for epoch in range(2):
        (x, y), = list(L)
        assert x.shape == (len(ds), 3, 40, 40) and x.dtype == torch.float32
        for i, (path, target) in enumerate(ds.samples):
            g = _rng.derive(7, epoch, i)
            img, _ = _timms_geometry(path, g, ours, rrc, flip)
            torch.manual_seed(g.getrandbits(63))   # the seed coordl gives the steps after the fused ones
            want = norm(to_tensor(cj(img)))
            assert torch.equal(x[i], want), (epoch, path, float((x[i] - want).abs().max()))
            assert y[i] == target


@pytest.mark.parametrize("num_workers", [0, 2])
def test_timm_train_scripts_random_interpolation_is_timms_own_result_for_the_same_draws(odd_photos, num_workers):
    """timm's train.py default (``--train-interpolation random``): each
    sample is what timm's and torchvision's own transforms give on PIL's
    decode for coordl's draws (the box, then the mode, then the flip, then
    torch's seed for ColorJitter); both modes occur."""
    tf = create_transform(40, is_training=True, interpolation="random")
    rrc, flip, cj, to_tensor, norm = tf.transforms
    assert isinstance(rrc.interpolation, (tuple, list)) and len(rrc.interpolation) == 2
    ds = D.ImageFolder(odd_photos, transform=tf)
    L = coordl.DataLoader(ds, batch_size=len(ds), shuffle=False, seed=5, num_workers=num_workers)
    assert "fused RandomResizedCropAndInterpolation" in L.stats().path_reason, L.stats().path_reason
    ours = translate(tf)[0].fused.transforms[0]
    (x, y), = list(L)
    modes = set()
    for i, (path, target) in enumerate(ds.samples):
        g = _rng.derive(5, 0, i)
        img, drawn = _timms_geometry(path, g, ours, rrc, flip)
        mode = drawn["mode"]
        modes.add(mode)
        torch.manual_seed(g.getrandbits(63))
        want = norm(to_tensor(cj(img)))
        assert torch.equal(x[i], want), (path, mode, float((x[i] - want).abs().max()))
        assert y[i] == target
    assert len(modes) == 2


def test_timm_vflip_fuses_and_is_timms_own_result_for_the_same_draws(odd_photos):
    """timm's ``vflip`` (torchvision's RandomVerticalFlip after the
    horizontal one) fuses; each sample is timm's and torchvision's own
    result for coordl's draws (box, mode, flip, vertical flip, then torch's
    seed for ColorJitter)."""
    tf = create_transform(40, is_training=True, vflip=0.5, interpolation="random")
    rrc, flip, vflip, cj, to_tensor, norm = tf.transforms
    assert type(vflip).__name__ == "RandomVerticalFlip"
    assert translate(tf)[1] == ("RandomResizedCropAndInterpolation", "RandomHorizontalFlip", "RandomVerticalFlip")
    ds = D.ImageFolder(odd_photos, transform=tf)
    (x, _), = list(coordl.DataLoader(ds, batch_size=len(ds), shuffle=False, seed=2))
    ours = translate(tf)[0].fused.transforms[0]
    upside = 0
    for i, (path, _) in enumerate(ds.samples):
        g = _rng.derive(2, 0, i)
        img, drawn = _timms_geometry(path, g, ours, rrc, flip, vflip)
        upside += drawn["upside"]
        torch.manual_seed(g.getrandbits(63))
        want = norm(to_tensor(cj(img)))
        assert torch.equal(x[i], want), (path, float((x[i] - want).abs().max()))
    assert 0 < upside < len(ds)


@pytest.mark.parametrize("kw,name,how,seed", [
    ({"color_jitter_prob": 0.5}, "RandomApply", "applied with probability 0.5, the ColorJitter", 6),
    ({"grayscale_prob": 0.5}, "RandomGrayscale", "RandomGrayscale with its own draw and PIL's luma", 8),
], ids=["color_jitter_prob", "grayscale_prob"])
def test_timms_colour_options_run_on_the_planes_as_timms_own_result_for_the_same_draws(odd_photos, kw, name, how,
                                                                                       seed):
    """timm's ``color_jitter_prob`` (a ``RandomApply`` around its
    ``ColorJitter``) and ``grayscale_prob`` (a ``RandomGrayscale`` after
    it): on the decoded planes, each sample what timm's and torchvision's
    own transforms give for coordl's draws; the step applied to some
    samples, not to others."""
    tf = create_transform(40, is_training=True, **kw)
    rrc, flip, *colour, to_tensor, norm = tf.transforms
    assert type(colour[-1]).__name__ == name
    ds = D.ImageFolder(odd_photos, transform=tf)
    L = coordl.DataLoader(ds, batch_size=len(ds), shuffle=False, seed=seed)
    if C._ext is not None:
        assert how in L.stats().path_reason, L.stats().path_reason
    (x, _), = list(L)
    ours = translate(tf)[0].fused.transforms[0]
    applied = 0
    for i, (path, _) in enumerate(ds.samples):
        g = _rng.derive(seed, 0, i)
        img, _ = _timms_geometry(path, g, ours, rrc, flip)
        torch.manual_seed(g.getrandbits(63))
        for t in colour[:-1]:            # the ColorJitter before the RandomGrayscale, drawing first
            img = t(img)
        want = norm(to_tensor(colour[-1](img)))
        assert torch.equal(x[i], want), (path, float((x[i] - want).abs().max()))
        applied += not torch.equal(want, norm(to_tensor(img)))
    assert 0 < applied < len(ds)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_timm_train_with_re_prob_is_timms_own_result_for_the_same_draws(odd_photos, num_workers):
    """timm's train transform with its RandomErasing (``re_prob``, up to two
    rectangles, after Normalize): the conversion before it stays coordl's,
    and each sample is what timm's and torchvision's own transforms give on
    PIL's decode for the same draws (crop box and flip, then torch's seed for
    ColorJitter and Python's for the erasing)."""
    import random

    tf = create_transform(40, is_training=True, re_prob=0.6, re_count=2)
    rrc, flip, cj, to_tensor, norm, erase = tf.transforms
    assert type(erase).__name__ == "RandomErasing"
    ds = D.ImageFolder(odd_photos, transform=tf)
    L = coordl.DataLoader(ds, batch_size=len(ds), shuffle=False, seed=3, num_workers=num_workers)
    out = translate(tf)[0]
    assert out.erase is not None and out.erase.user is erase and out.post_fused is not None
    ours = out.fused.transforms[0]
    (x, y), = list(L)
    erased = 0
    for i, (path, target) in enumerate(ds.samples):
        g = _rng.derive(3, 0, i)
        img, _ = _timms_geometry(path, g, ours, rrc, flip)
        torch.manual_seed(g.getrandbits(63))
        state = random.getstate()
        random.seed(g.getrandbits(63))
        try:
            want = erase(norm(to_tensor(cj(img))))
        finally:
            random.setstate(state)
        assert torch.equal(x[i], want), (path, float((x[i] - want).abs().max()))
        erased += bool((want == 0).all(0).any())
        assert y[i] == target
    assert 0 < erased < len(ds)
