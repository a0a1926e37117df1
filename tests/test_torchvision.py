"""torchvision's ImageFolder and transforms on coordl's pipeline:
recognized, translated with the same parameters and draw distributions,
the rest run as written, fallbacks on torch's path, and the loader's other
features on such datasets.  torchvision is loaded through
tests/_torchvision.py (see there why it needs help beside CPU torch)."""
import math
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import PIL.Image as PImage
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _torchvision import import_torchvision  # noqa: E402

tv = import_torchvision()
if tv is None:
    pytest.skip("torchvision is not installed (pip install coordl[test])", allow_module_level=True)

from torchvision import datasets as D  # noqa: E402
from torchvision import transforms as V1  # noqa: E402
from torchvision.transforms import v2 as V2  # noqa: E402

import coordl  # noqa: E402
from coordl import _rng  # noqa: E402
from coordl import transforms as T  # noqa: E402
from coordl.testing import popen, run_in_child  # noqa: E402
from coordl.tvcompat import TorchvisionFolder, adapt, translate  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("tv", num_images=30, num_classes=3, mean_kb=3, image_size=(48, 64), seed=2)


def v1_pipeline(size=32):
    return V1.Compose([V1.RandomResizedCrop(size), V1.RandomHorizontalFlip(), V1.ToTensor(), V1.Normalize(MEAN, STD)])


def v2_pipeline(size=32):
    return V2.Compose([V2.ToImage(), V2.RandomResizedCrop(size), V2.RandomHorizontalFlip(),
                       V2.ToDtype(torch.float32, scale=True), V2.Normalize(MEAN, STD)])


def batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


# ------------------------------------------------------------ the dataset
@pytest.mark.parametrize("make", [
    lambda root: D.ImageFolder(root),
    lambda root: D.DatasetFolder(root, loader=D.folder.default_loader, extensions=(".jpg",)),
    lambda root: D.ImageFolder(root, is_valid_file=lambda p: not p.endswith("0.jpg")),
])
def test_same_samples_classes_targets_and_length_as_torchvision(photos, make):
    ds = make(photos)
    ds.transform = V1.Compose([V1.Resize((24, 24)), V1.PILToTensor()])
    L = coordl.DataLoader(ds, batch_size=4, shuffle=False)
    s = L.stats()
    assert s.path == "coordl" and "fused Resize, PILToTensor" in s.path_reason, s
    a = L.dataset
    assert isinstance(a, TorchvisionFolder)
    assert len(a) == len(ds) and len(L) == math.ceil(len(ds) / 4)
    assert list(a.samples) == ds.samples and a.targets == ds.targets
    assert a.classes == ds.classes and a.class_to_idx == ds.class_to_idx
    ref = batches(torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False))
    got = batches(L)
    assert len(got) == len(ref)
    for (x, y), (rx, ry) in zip(got, ref):
        assert torch.equal(y, ry)
        assert x.shape == rx.shape and x.dtype == rx.dtype == torch.uint8
        # a resize of the PIL image: PIL's arithmetic on the full-size decode, the same pixels
        assert torch.equal(x, rx)


def test_every_sample_once_per_epoch_with_torchvisions_targets(photos):
    ds = D.ImageFolder(photos, transform=v1_pipeline(16))
    L = coordl.DataLoader(ds, batch_size=7, shuffle=True, num_workers=2)
    for _ in range(2):
        ys = torch.cat([y for _, y in L])
        assert sorted(ys.tolist()) == sorted(ds.targets)
    assert L.stats().samples == 2 * len(ds)


# ------------------------------------------------------- the translation
def test_v1_and_v2_pipelines_translate_to_the_same_coordl_pipeline():
    for tf in (v1_pipeline(224), v2_pipeline(224)):
        out, fused, rest = translate(tf)
        assert type(out) is T.Compose and rest == ()
        assert [type(t) for t in out.transforms] == [T.RandomResizedCrop, T.RandomHorizontalFlip, T.ToTensor,
                                                     T.Normalize]
        rrc = out.transforms[0]
        assert rrc.size == (224, 224) and rrc.scale == (0.08, 1.0) and rrc.antialias is True
        assert rrc.ratio == pytest.approx((3 / 4, 4 / 3)) and rrc.interpolation.value == "bilinear"
        assert out.transforms[3].mean == tuple(MEAN) and out.transforms[3].std == tuple(STD)


@pytest.mark.parametrize("tf, kinds", [
    (V1.Compose([V1.Resize(40, interpolation=V1.InterpolationMode.BICUBIC, max_size=50), V1.CenterCrop(32),
                 V1.PILToTensor(), V1.ConvertImageDtype(torch.float32)]),
     [T.Resize, T.CenterCrop, T.ToTensor]),
    (V2.Compose([V2.RandomCrop(20), V2.RandomHorizontalFlip(0.25), V2.PILToTensor(),
                 V2.ToDtype(torch.float64, scale=True)]),
     [T.RandomCrop, T.RandomHorizontalFlip, T.PILToTensor, T.ToDtype]),
    (V2.Compose([V2.ToImage(), V2.ToDtype(torch.float32, scale=True), V2.RandomHorizontalFlip(),
                 V2.Normalize(MEAN, STD)]),
     [T.RandomHorizontalFlip, T.ToTensor, T.Normalize]),
])
def test_parameters_are_read_from_public_attributes(tf, kinds):
    out, fused, rest = translate(tf)
    assert [type(t) for t in out.transforms] == kinds and rest == ()
    first = out.transforms[0]
    if isinstance(first, T.Resize):
        assert first.size == 40 and first.max_size == 50 and first.interpolation.value == "bicubic"
    if isinstance(first, T.RandomCrop):
        assert first.size == (20, 20) and out.transforms[1].p == 0.25
        assert out.transforms[3].dtype == torch.float64 and out.transforms[3].scale


@pytest.mark.parametrize("tf, fused, rest", [
    # PIL's lanczos has no tensor kernel in coordl: nothing fuses, everything runs as written
    (V1.Compose([V1.Resize(20, interpolation=V1.InterpolationMode.LANCZOS), V1.ToTensor()]), (),
     ("Resize", "ToTensor")),
    # a padded crop fuses on a PIL image (as PIL pads it), not on a tensor (torch's padding)
    (V2.Compose([V2.RandomResizedCrop(20), V2.RandomCrop(16, padding=2), V2.PILToTensor()]),
     ("RandomResizedCrop", "RandomCrop", "PILToTensor"), ()),
    (V2.Compose([V2.PILToTensor(), V2.RandomResizedCrop(20), V2.RandomCrop(16, padding=2)]),
     ("PILToTensor", "RandomResizedCrop"), ("RandomCrop",)),
    # an unknown transform ends the fused prefix
    (V1.Compose([V1.RandomResizedCrop(20), V1.ColorJitter(0.3), V1.ToTensor(), V1.Normalize(MEAN, STD)]),
     ("RandomResizedCrop",), ("ColorJitter", "ToTensor", "Normalize")),
])
def test_what_cannot_be_expressed_is_not_fused(tf, fused, rest):
    _out, f, r = translate(tf)
    assert f == fused and r == rest


# ------------------------------------------------- same draw distributions
def _ks(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    fa, fb = np.searchsorted(a, grid, "right") / len(a), np.searchsorted(b, grid, "right") / len(b)
    return float(np.max(np.abs(fa - fb)))


def _ks_ok(a, b) -> bool:
    n, m = len(a), len(b)
    return _ks(a, b) < 1.95 * math.sqrt((n + m) / (n * m))  # alpha = 0.001


N_DRAWS = 3000


@pytest.mark.parametrize("H, W, scale, ratio", [(375, 500, (0.08, 1.0), (3 / 4, 4 / 3)),
                                                (60, 400, (0.5, 1.0), (0.9, 1.1))])  # often the fallback
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_random_resized_crop_draws_follow_torchvisions_distributions(H, W, scale, ratio, version):
    if version == "v1":
        t = V1.RandomResizedCrop(32, scale=scale, ratio=ratio)
        img = torch.zeros(3, H, W)
        torch.manual_seed(0)
        theirs = np.array([t.get_params(img, t.scale, t.ratio) for _ in range(N_DRAWS)], dtype=float)
    else:
        t = V2.RandomResizedCrop(32, scale=scale, ratio=ratio)
        img = tv.tv_tensors.Image(torch.zeros(3, H, W, dtype=torch.uint8))
        torch.manual_seed(0)
        theirs = np.array([list(t.make_params([img]).values()) for _ in range(N_DRAWS)], dtype=float)
    rrc = translate(V1.Compose([t, V1.PILToTensor()]) if version == "v1" else t)[0]
    rrc = rrc.transforms[0] if isinstance(rrc, T.Compose) else rrc.fused.transforms[0]
    # coordl's draws: the per-sample generators of (seed, epoch, index), as in its prep stage
    ours = []
    for i in range(N_DRAWS):
        with _rng.sample_rng(11, 0, i) as g:
            ours.append(T.RandomResizedCrop.get_params((W, H), rrc.scale, rrc.ratio, rng=g))
    ours = np.array(ours, dtype=float)
    for name, f in [("area", lambda p: p[:, 2] * p[:, 3] / (H * W)), ("log ratio", lambda p: np.log(p[:, 3] / p[:, 2])),
                    ("top", lambda p: p[:, 0] / np.maximum(H - p[:, 2], 1)),
                    ("left", lambda p: p[:, 1] / np.maximum(W - p[:, 3], 1))]:
        assert _ks_ok(f(ours), f(theirs)), (name, _ks(f(ours), f(theirs)))
    # the fallback (central crop) is taken as often
    fb_ours = np.mean((ours[:, 0] == (H - ours[:, 2]) // 2) & (ours[:, 1] == (W - ours[:, 3]) // 2))
    fb_theirs = np.mean((theirs[:, 0] == (H - theirs[:, 2]) // 2) & (theirs[:, 1] == (W - theirs[:, 3]) // 2))
    assert abs(fb_ours - fb_theirs) < 4 * math.sqrt(0.25 / N_DRAWS) * math.sqrt(2)


def test_random_crop_and_flip_draws_follow_torchvisions_distributions():
    H, W = 50, 70
    t = V1.RandomCrop((20, 30))
    torch.manual_seed(1)
    theirs = np.array([t.get_params(torch.zeros(3, H, W), t.size) for _ in range(N_DRAWS)], dtype=float)
    crop = translate(V1.Compose([t, V1.PILToTensor()]))[0].transforms[0]
    ours = []
    img = torch.arange(H * W).reshape(1, H, W)
    for i in range(N_DRAWS):
        with _rng.sample_rng(5, 1, i):
            out = crop(img)
        k = int(out[0, 0, 0])
        ours.append((k // W, k % W))
    ours = np.array(ours, dtype=float)
    for col in (0, 1):  # chi-square over the offsets, against uniform, for both
        for draws, hi in ((ours[:, col], (H - 20, W - 30)[col]), (theirs[:, col], (H - 20, W - 30)[col])):
            counts = np.bincount(draws.astype(int), minlength=hi + 1)
            exp = len(draws) / (hi + 1)
            chi2 = float(((counts - exp) ** 2 / exp).sum())
            dof = hi
            assert chi2 < dof + 4.5 * math.sqrt(2 * dof), (col, chi2, dof)
    # flips: the same Bernoulli(p)
    for p in (0.5, 0.2):
        v1f, v2f = V1.RandomHorizontalFlip(p), V2.RandomHorizontalFlip(p)
        for tf in (v1f, v2f):
            flip = translate(V1.Compose([tf, V1.PILToTensor()]) if tf is v1f else
                             V2.Compose([tf, V2.PILToTensor()]))[0].transforms[0]
            x = torch.tensor([[[0, 1]]])
            n = 0
            for i in range(N_DRAWS):
                with _rng.sample_rng(3, 0, i):
                    n += int(flip(x)[0, 0, 0] == 1)
            torch.manual_seed(2)
            m = sum(int(tf(x)[0, 0, 0] == 1) for _ in range(N_DRAWS))
            sd = math.sqrt(p * (1 - p) / N_DRAWS)
            assert abs(n / N_DRAWS - p) < 4.5 * sd and abs(m / N_DRAWS - p) < 4.5 * sd, (p, n, m)


def test_pixel_statistics_match_torchs(photos):
    """Per-channel mean and std of normalized batches over several epochs: the same as
    under torch's DataLoader within sampling noise."""
    for make in (v1_pipeline, v2_pipeline):
        ds = D.ImageFolder(photos, transform=make(24))
        torch.manual_seed(0)
        ref = torch.cat([x for _ in range(6) for x, _ in torch.utils.data.DataLoader(ds, batch_size=10, shuffle=True)])
        L = coordl.DataLoader(ds, batch_size=10, shuffle=True, seed=0)
        got = torch.cat([x for _ in range(6) for x, _ in L])
        assert got.shape == ref.shape
        for dims in ((0, 2, 3),):
            assert torch.allclose(got.mean(dims), ref.mean(dims), atol=0.08), (got.mean(dims), ref.mean(dims))
            assert torch.allclose(got.std(dims), ref.std(dims), rtol=0.08)


# ----------------------------------------------------- run as written
class Spy:
    """Records what it was given (picklable: module level)."""
    seen = []

    def __call__(self, x):
        Spy.seen.append(type(x))
        return x


def test_the_part_after_the_fused_prefix_runs_as_written_on_what_it_expects(photos):
    Spy.seen.clear()
    tf = V1.Compose([V1.RandomResizedCrop(20), Spy(), V1.ToTensor(), Spy(), V1.Normalize(MEAN, STD)])
    L = coordl.DataLoader(D.ImageFolder(photos, transform=tf), batch_size=5, seed=1)
    assert [x.shape for x, _ in L][0] == (5, 3, 20, 20)
    assert set(Spy.seen[0::2]) == {Image.Image} and set(Spy.seen[1::2]) == {torch.Tensor}
    Spy.seen.clear()
    tf2 = V2.Compose([V2.ToImage(), V2.RandomResizedCrop(20), Spy(), V2.ToDtype(torch.float32, scale=True)])
    L2 = coordl.DataLoader(D.ImageFolder(photos, transform=tf2), batch_size=5, seed=1)
    next(iter(L2))
    assert set(Spy.seen) == {tv.tv_tensors.Image}


def test_a_transform_coordl_cannot_express_runs_exactly_as_written(photos):
    tf = V1.Compose([V1.Resize((20, 20), interpolation=V1.InterpolationMode.LANCZOS), V1.CenterCrop(16),
                     V1.PILToTensor()])
    ds = D.ImageFolder(photos, transform=tf)
    L = coordl.DataLoader(ds, batch_size=6, shuffle=False)
    assert "as written: Resize, CenterCrop, PILToTensor" in L.stats().path_reason
    for (x, y), (rx, ry) in zip(L, torch.utils.data.DataLoader(ds, batch_size=6, shuffle=False)):
        assert torch.equal(x, rx) and torch.equal(y, ry)


@pytest.mark.parametrize("first", [[], ["flip"]], ids=["gray-first", "gray-then-flip"])
def test_a_one_channel_image_normalized_by_three_means_is_torchvisions(photos, first):
    """v2's Normalize subtracts out of place, so a one-channel image (after
    Grayscale) normalized by three means comes out with three channels; v1's
    subtracts in place and raises.  coordl's conversion gives the same."""
    steps = [V2.Grayscale(1)] + [V2.RandomHorizontalFlip(p=1.0) for _ in first]
    tf = V2.Compose(steps + [V2.ToImage(), V2.ToDtype(torch.float32, scale=True), V2.Normalize(MEAN, STD)])
    ds = D.ImageFolder(photos, transform=tf)
    want = batches(torch.utils.data.DataLoader(ds, batch_size=6))
    got = batches(coordl.DataLoader(D.ImageFolder(photos, transform=tf), batch_size=6))
    assert want[0][0].shape[1] == 3 and len(got) == len(want)
    assert all(torch.equal(x, rx) and torch.equal(y, ry) for (x, y), (rx, ry) in zip(got, want))
    v1 = V1.Compose([V1.Grayscale(1)] + [V1.RandomHorizontalFlip(p=1.0) for _ in first]
                    + [V1.ToTensor(), V1.Normalize(MEAN, STD)])
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape") as theirs:
        D.ImageFolder(photos, transform=v1)[0]
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape") as ours:
        next(iter(coordl.DataLoader(D.ImageFolder(photos, transform=v1), batch_size=6)))
    assert str(theirs.value) in str(ours.value)       # torch's message, of the image's own shape


@pytest.fixture(scope="module")
def sliver(tmp_path_factory):
    """A folder of one 9x523 JPEG: Resize(26, max_size=54) makes its short side 0."""
    root = tmp_path_factory.mktemp("sliver") / "photos"
    (root / "a").mkdir(parents=True)
    Image.new("RGB", (9, 523), (100, 50, 20)).save(root / "a" / "x.jpg")
    return str(root)


@pytest.mark.parametrize("kind", ["v1-pil", "v2-pil", "v1-tensor", "v2-tensor", "device"])
def test_a_resize_to_nothing_fails_as_torchvisions_does(sliver, kind):
    """torchvision computes a side of 0 (the short side scaled to keep the
    long one within max_size) and fails there: PIL's error for a PIL image,
    torch's for a tensor.  coordl fails with the same error, not a 1-pixel
    image."""
    M = V1 if kind.startswith("v1") or kind == "device" else V2
    resize = M.Resize(26, max_size=54)
    if kind.endswith("tensor"):
        steps = [V1.PILToTensor(), resize] if M is V1 else [V2.ToImage(), resize, V2.ToDtype(torch.float32, scale=True)]
    else:
        steps = [resize, V1.ToTensor()] if M is V1 else [resize, V2.ToImage(), V2.ToDtype(torch.float32, scale=True)]
    if kind == "device":        # (decode="device" takes a fixed output size)
        steps.insert(1, V1.CenterCrop(20))
    tf = M.Compose(steps)
    with pytest.raises((ValueError, RuntimeError)) as theirs:
        D.ImageFolder(sliver, transform=tf)[0]
    kw = {"device": "cpu", "decode": "device"} if kind == "device" else {}
    with pytest.raises(type(theirs.value)) as ours:
        next(iter(coordl.DataLoader(D.ImageFolder(sliver, transform=tf), batch_size=1, **kw)))
    assert str(theirs.value) in str(ours.value)


def test_random_transforms_run_as_written_are_reproducible_too(photos):
    tf = V1.Compose([V1.RandomResizedCrop(16), V1.ColorJitter(0.5, 0.5, 0.5), V1.ToTensor()])
    ds = D.ImageFolder(photos, transform=tf)
    a = batches(coordl.DataLoader(ds, batch_size=6, shuffle=True, seed=4))
    b = batches(coordl.DataLoader(ds, batch_size=6, shuffle=True, seed=4, num_workers=2))
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_a_subset_or_concat_of_a_torchvision_folder_reads_on_coordls_pipeline_and_a_subclass_says_why(photos):
    ds = D.ImageFolder(photos, transform=v1_pipeline(16))
    sub = torch.utils.data.Subset(ds, list(range(0, 30, 2)))
    s = coordl.DataLoader(sub, batch_size=4).stats()
    assert s.path == "coordl" and s.path_reason.startswith("a Subset of torchvision's ImageFolder read as raw file "
                                                           "bytes, decoded by coordl; fused RandomResizedCrop"), s
    cat = torch.utils.data.ConcatDataset([ds, ds])
    s = coordl.DataLoader(cat, batch_size=4).stats()
    assert s.path == "coordl" and s.path_reason.startswith("a ConcatDataset of 2: torchvision's ImageFolder read as "
                                                           "raw file bytes"), s

    class Mine(torch.utils.data.ConcatDataset):
        pass

    s = coordl.DataLoader(Mine([ds, ds]), batch_size=4).stats()
    assert s.path == "torch" and "a subclass of torch's ConcatDataset, of torchvision's ImageFolder, ImageFolder: " \
        "coordl reads torch's own ConcatDataset" in s.path_reason, s
    s = coordl.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)), batch_size=2).stats()
    assert "TensorDataset" in s.path_reason and "mode" not in s.path_reason, s


# --------------------------------------------------------- fallbacks
class OwnGetItem(D.ImageFolder):
    """Its own read, not torchvision's __getitem__ (one that calls it reads on coordl's pipeline: WithPaths)."""

    def __getitem__(self, i):
        path, y = self.samples[i]
        return self.transform(self.loader(path)), y + 100


def _own_loader(path):
    return Image.open(path).convert("L").convert("RGB")


@pytest.mark.parametrize("make, why", [
    (lambda r: OwnGetItem(r, transform=V1.Compose([V1.Resize((8, 8)), V1.PILToTensor()])), "overrides __getitem__"),
    (lambda r: D.ImageFolder(r, transform=V1.Compose([V1.Resize((8, 8)), V1.PILToTensor()]), loader=_own_loader),
     "loader"),
    (lambda r: D.ImageFolder(r, transform=V1.Compose([V1.Resize((8, 8)), V1.PILToTensor()]),
                             target_transform="not callable"), "target_transform"),
    (lambda r: D.FakeData(12, image_size=(3, 8, 8), transform=V1.PILToTensor()), "not a DatasetFolder"),
])
def test_what_coordl_cannot_prove_equivalent_stays_on_torchs_path_and_says_so(photos, make, why, caplog):
    ds = make(photos)
    with caplog.at_level("DEBUG", logger="coordl.tvcompat"):
        L = coordl.DataLoader(ds, batch_size=4, shuffle=False)
    s = L.stats()
    assert s.path == "torch" and why in s.path_reason, s
    assert L.dataset is ds
    lines = [r.getMessage() for r in caplog.records if r.name == "coordl.tvcompat"]
    assert len(lines) == 1 and "torch's machinery" in lines[0] and why in lines[0]
    if why == "target_transform":
        with pytest.raises(TypeError):  # torch's own error, as without coordl
            next(iter(L))
        return
    for (x, y), (rx, ry) in zip(L, torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_target_transform_runs_as_written(photos):
    ds = D.ImageFolder(photos, transform=V1.Compose([V1.Resize((8, 8)), V1.PILToTensor()]),
                       target_transform=lambda y: 10 * y + 1)
    L = coordl.DataLoader(ds, batch_size=30, shuffle=False, num_workers=2)
    assert L.stats().path == "coordl"
    (_, y), = list(L)
    assert y.tolist() == [10 * t + 1 for t in ds.targets]


def test_coordl_objects_and_other_datasets_are_untouched():
    ds = torch.utils.data.TensorDataset(torch.arange(10))
    assert adapt(ds) == (ds, None)
    L = coordl.DataLoader(ds, batch_size=5)
    assert L.stats().path == "torch"


# ------------------------------------------ resume, cache, device, share
@pytest.mark.parametrize("make", [v1_pipeline, v2_pipeline])
def test_resume_is_exact(photos, make):
    ds = D.ImageFolder(photos, transform=make(16))
    ref = batches(coordl.DataLoader(ds, batch_size=4, shuffle=True, seed=9, num_workers=2))
    L = coordl.DataLoader(ds, batch_size=4, shuffle=True, seed=9, num_workers=2)
    it = iter(L)
    head = [tuple(t.clone() for t in next(it)) for _ in range(3)]
    state = L.state_dict()
    del it
    L2 = coordl.DataLoader(D.ImageFolder(photos, transform=make(16)), batch_size=4, shuffle=True, seed=9)
    L2.load_state_dict(state)
    tail = batches(L2)
    got = head + tail
    assert len(got) == len(ref)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, ref))


def test_node_cache_serves_the_second_epoch(photos):
    ds = D.ImageFolder(photos, transform=v1_pipeline(16))
    L = coordl.DataLoader(ds, batch_size=8, shuffle=True, cache_size="4MiB", num_workers=1)
    for _ in range(2):
        list(L)
    e0, e1 = L.stats().epochs
    assert e0.samples_from_storage == len(ds) and e1.samples_from_cache == len(ds) and e1.bytes_from_storage == 0


def test_device_delivery_moves_totensor_and_normalize_to_the_device(photos, monkeypatch):
    from coordl.device import delivery as Dev

    for make in (v1_pipeline, v2_pipeline):
        ds = D.ImageFolder(photos, transform=make(16))
        plain = batches(coordl.DataLoader(ds, batch_size=5, seed=4, shuffle=True))
        monkeypatch.setattr(Dev, "CPU_TEST_DEVICE", True)
        L = coordl.DataLoader(ds, batch_size=5, seed=4, shuffle=True, device="cpu")
        got = batches(L)
        st = L.stats()  # uint8 travels, ToTensor + Normalize run on the device
        assert st.device_split.startswith("split") and st.device_split_cpu_samples == 0, st.device_split
        monkeypatch.setattr(Dev, "CPU_TEST_DEVICE", False)
        assert len(got) == len(plain)
        for a, b in zip(got, plain):
            assert a[0].dtype == torch.float32 and torch.equal(a[0], b[0])  # bit-identical to the CPU path
            assert torch.equal(a[1], b[1])


def test_adapter_pickles_without_torchvision_when_fully_translated(photos):
    ds = D.ImageFolder(photos, transform=v2_pipeline(16))
    a, decision = adapt(ds)
    blob = pickle.dumps(a)
    assert b"torchvision" not in blob  # the node daemon and spawned workers need no torchvision
    code = textwrap.dedent(f"""
        import pickle, sys
        a = pickle.loads({blob!r})
        assert "torchvision" not in sys.modules
        x, y = a[0]
        print(tuple(x.shape), y)
    """)
    r = run_in_child(code, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split()[-1] == str(ds.targets[0])


def test_share_prepares_once_for_two_jobs(photos, daemon_env):
    ref = batches(coordl.DataLoader(D.ImageFolder(photos, transform=v1_pipeline(16)), batch_size=6, seed=7))
    a = coordl.DataLoader(D.ImageFolder(photos, transform=v1_pipeline(16)), batch_size=6, seed=7, share=True)
    b = coordl.DataLoader(D.ImageFolder(photos, transform=v1_pipeline(16)), batch_size=6, seed=7, share=True)
    got_a, got_b = [], []
    for x, y in zip(a, b):
        got_a.append(x)
        got_b.append(y)
    for got in (got_a, got_b):
        assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(got, ref))
    assert a.stats().samples_shared > 0 and b.stats().samples_shared > 0
    del a, b


def test_analyze_reads_a_torchvision_dataset(photos, tmp_path):
    script = tmp_path / "tvds.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {HERE!r})
        from _torchvision import import_torchvision
        tv = import_torchvision()
        from torchvision import datasets, transforms as V1

        def make():
            return datasets.ImageFolder({photos!r}, transform=V1.Compose([V1.RandomResizedCrop(16), V1.ToTensor()]))
    """))
    out = tmp_path / "r.json"
    spec = str(script) + ":make"
    code = (f"import sys; from coordl.cli import main; sys.exit(main(['analyze', '--dataset', {spec!r}, "
            f"'--rate', '1e6', '--batch-size', '6', '--workers', '1', '--scaling-workers', '1', '--evict', 'fadvise', "
            f"'--json', {str(out)!r}, '--plot', '']))")
    r = run_in_child(code, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    rep = json.loads(out.read_text())
    assert rep["dataset"]["samples"] == 30 and rep["dataset"]["files"] == 30


def test_peers_serve_what_the_other_node_cached(photos, tmp_path):
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    total = sum(os.path.getsize(p) for p, _ in D.ImageFolder(photos).samples)
    job = os.path.join(HERE, "_tv_peers_job.py")
    procs = [popen([sys.executable, job, photos, str(r), "2", port, str(total + 65536)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-3000:]
            outs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    targets = sorted(D.ImageFolder(photos).targets)
    for epoch in range(2):
        assert sorted(outs[0][epoch]["got"] + outs[1][epoch]["got"]) == targets  # every sample once
    assert all(o[0]["path"] == "coordl" for o in outs)
    second = [o[1]["stats"] for o in outs]
    assert sum(s["samples_from_storage"] for s in second) == 0          # epoch 1: nothing from storage
    assert sum(s["samples_from_peers"] for s in second) > 0             # the other node's half from it


def test_demo_compares_the_torchvision_loop_and_says_what_coordl_did():
    # (without torchvision the demo's hand-written PIL pipeline runs: tests/test_demo.py)
    code = (f"import sys; sys.path.insert(0, {HERE!r}); from _torchvision import import_torchvision; "
            "import_torchvision(); from coordl.demo import run_demo; "
            "r = run_demo(images=24, epochs=1, workers=1, batch_size=8); sys.exit(0 if r['resume_exact'] else 1)")
    r = run_in_child(code, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "torchvision.datasets.ImageFolder + torchvision.transforms" in out
    assert ("path: coordl (torchvision's ImageFolder read as raw file bytes, decoded by coordl; fused "
            "RandomResizedCrop, RandomHorizontalFlip, ToTensor, Normalize)") in out
    assert "coordl / torch throughput:" in out and "identical to an uninterrupted epoch" in out


def test_pil_nearest_is_run_as_written_and_tensor_nearest_is_fused():
    _, f, r = translate(V1.Compose([V1.Resize(20, interpolation=V1.InterpolationMode.NEAREST), V1.PILToTensor()]))
    assert f == () and r == ("Resize", "PILToTensor")
    out, f, r = translate(V2.Compose([V2.PILToTensor(), V2.Resize(20, interpolation=V2.InterpolationMode.NEAREST)]))
    assert f == ("PILToTensor", "Resize") and r == ()
    assert out.transforms[0].interpolation.value == "nearest"
    x = torch.randint(0, 256, (3, 37, 53), dtype=torch.uint8)
    for interp in (V2.InterpolationMode.NEAREST, V2.InterpolationMode.BILINEAR):
        theirs = V2.Resize(20, interpolation=interp)
        ours = translate(V2.Compose([V2.PILToTensor(), theirs]))[0].transforms[0]
        assert torch.equal(ours(x), theirs(x))  # on a tensor: torchvision's pixels exactly


class KeepsGetItem(D.ImageFolder):
    """A subclass that changes how classes are found but keeps __getitem__ and the loader."""

    def find_classes(self, directory):
        classes, _ = super().find_classes(directory)
        classes = classes[::-1]
        return classes, {c: i for i, c in enumerate(classes)}


def test_a_subclass_that_keeps_getitem_and_loader_runs_on_coordls_path(photos):
    ds = KeepsGetItem(photos, transform=V1.Compose([V1.Resize((8, 8)), V1.PILToTensor()]))
    L = coordl.DataLoader(ds, batch_size=30, shuffle=False)
    assert L.stats().path == "coordl"
    (_, y), = list(L)
    assert y.tolist() == ds.targets and ds.targets[0] == len(ds.classes) - 1


def test_coordl_never_imports_torchvision_for_its_own_objects(photos):
    code = textwrap.dedent(f"""
        import sys, torch, coordl
        from coordl import transforms as T
        ds = coordl.ImageFolder({photos!r}, transform=T.Compose([T.RandomResizedCrop(8), T.PILToTensor()]))
        for d in (ds, torch.utils.data.TensorDataset(torch.arange(6))):
            L = coordl.DataLoader(d, batch_size=3, num_workers=1)
            list(L)
            print(L.stats().path)
        from coordl.analyze import measure
        print("LOADED", sorted(m for m in sys.modules if m.split(".")[0] == "torchvision"))
    """)
    r = run_in_child(code, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LOADED []" in r.stdout and r.stdout.split()[:2] == ["coordl", "torch"]


class OddTargets(D.ImageFolder):
    """make_dataset gives targets that are not class indices (torch passes them through)."""

    @staticmethod
    def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        out = D.ImageFolder.make_dataset(directory, class_to_idx, extensions, is_valid_file, allow_empty)
        return [(p, f"label-{t}") for p, t in out]


def test_samples_that_are_not_class_indices_stay_on_torchs_path(photos):
    ds = OddTargets(photos, transform=V1.Compose([V1.Resize((8, 8)), V1.PILToTensor()]))
    L = coordl.DataLoader(ds, batch_size=30, shuffle=False)
    assert L.stats().path == "torch" and "not (path, class index) pairs" in L.stats().path_reason
    (_, y), = list(L)
    assert list(y) == [t for _, t in ds.samples]


def test_a_user_sampler_keeps_coordls_pipeline_and_says_so(photos):
    ds = D.ImageFolder(photos, transform=v1_pipeline(16))
    sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(0))
    L = coordl.DataLoader(ds, batch_size=8, sampler=sampler, num_workers=1)
    s = L.stats()
    assert s.path == "coordl" and "fused RandomResizedCrop" in s.path_reason, s
    assert "order of the loader's sampler" in s.path_reason, s
    ys = torch.cat([y for _, y in L])
    want = [ds.targets[i] for i in torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()]
    assert ys.tolist() == want


def test_a_copy_with_a_subset_of_samples_is_recognized(photos):
    import copy

    ds = D.ImageFolder(photos, transform=V1.Compose([V1.Resize((8, 8)), V1.PILToTensor()]))
    part = copy.copy(ds)
    part.samples = [ds.samples[i] for i in range(0, len(ds), 3)]
    L = coordl.DataLoader(part, batch_size=len(part.samples), shuffle=False)
    assert L.stats().path == "coordl" and len(L.dataset) == len(part)
    (_, y), = list(L)
    assert y.tolist() == [t for _, t in part.samples]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_assigned_to_torchvisions_dataset_takes_effect_at_the_next_pass(photos, workers):
    """As under torch: a transform (or target_transform) assigned to the
    user's torchvision dataset between passes is what the next pass runs
    (progressive resizing), and path_reason says what runs now."""
    ds = D.ImageFolder(photos, transform=V1.Compose([V1.Resize((16, 16)), V1.ToTensor()]))
    kw = dict(batch_size=5, num_workers=workers)
    T_ = torch.utils.data.DataLoader(ds, **kw)
    L = coordl.DataLoader(ds, **kw)
    assert next(iter(T_))[0].shape == next(iter(L))[0].shape == (5, 3, 16, 16)
    ds.transform = V1.Compose([V1.Resize((8, 12)), V1.ToTensor()])
    ds.target_transform = lambda t: t + 100
    want, got = next(iter(T_)), next(iter(L))
    assert want[0].shape == got[0].shape == (5, 3, 8, 12) and torch.equal(want[1], got[1]) and int(got[1][0]) >= 100
    assert "Resize" in L.stats().path_reason
    ds.transform = V1.Compose([V1.Resize((8, 12)), V1.ColorJitter(0.3), V1.ToTensor()])
    assert next(iter(L))[0].shape == (5, 3, 8, 12)
    assert "as written: ColorJitter" in L.stats().path_reason


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_assigned_to_the_loaders_dataset_is_translated_at_the_next_pass(photos, workers):
    """Under torch ``loader.dataset`` is the user's dataset, and progressive
    resizing may assign its transform there: on coordl's copy a torchvision
    transform assigned so is translated as the dataset's own (it fuses),
    gives torch's batches, and path_reason says what runs now; one of
    coordl's own runs as assigned."""
    ds = D.ImageFolder(photos, transform=V1.Compose([V1.Resize((16, 16)), V1.ToTensor()]))
    L = coordl.DataLoader(ds, batch_size=5, num_workers=workers)
    assert next(iter(L))[0].shape == (5, 3, 16, 16)
    new = V1.Compose([V1.Resize(14), V1.CenterCrop((10, 12)), V1.ToTensor()])
    L.dataset.transform = new
    got = [x for x, _ in L]
    want = [x for x, _ in torch.utils.data.DataLoader(D.ImageFolder(photos, transform=new), batch_size=5)]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    reason = L.stats().path_reason
    assert "the transform assigned to loader.dataset: fused Resize, CenterCrop, ToTensor" in reason, reason
    assert type(L.dataset.transform) is coordl.transforms.Compose
    mine = coordl.transforms.Compose([coordl.transforms.CenterCrop(8), coordl.transforms.PILToTensor()])
    L.dataset.transform = mine
    assert next(iter(L))[0].shape == (5, 3, 8, 8) and L.dataset.transform is mine
    assert "the transform assigned to loader.dataset: Compose, coordl's, run as assigned" in L.stats().path_reason
    ds.transform = V1.Compose([V1.Resize((6, 6)), V1.ToTensor()])     # the user's own dataset's, again
    assert next(iter(L))[0].shape == (5, 3, 6, 6) and "assigned to loader.dataset" not in L.stats().path_reason


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_assigned_to_the_loaders_dataset_then_changed_in_place_is_followed(photos, workers):
    """Progressive resizing on a transform the user assigned to
    ``loader.dataset``, then changed in place (its crop's size set anew):
    under torch the next pass runs it as changed; coordl's translation of
    it, made when it was assigned, is made again from the changed object."""
    ds = D.ImageFolder(photos, transform=V1.Compose([V1.Resize((16, 16)), V1.ToTensor()]))
    L = coordl.DataLoader(ds, batch_size=5, num_workers=workers)
    T_ = torch.utils.data.DataLoader(D.ImageFolder(photos, transform=ds.transform), batch_size=5,
                                     num_workers=workers)
    for loader in (T_, L):
        assert next(iter(loader))[0].shape == (5, 3, 16, 16)
    rrc = V1.RandomResizedCrop(20)
    new = V1.Compose([rrc, V1.ToTensor()])
    shapes = []
    for loader in (T_, L):
        rrc.size = (20, 20)
        loader.dataset.transform = new
        s = [next(iter(loader))[0].shape[-2:]]
        rrc.size = (12, 14)
        s.append(next(iter(loader))[0].shape[-2:])
        new.transforms.insert(1, V1.CenterCrop((8, 6)))
        s.append(next(iter(loader))[0].shape[-2:])
        del new.transforms[1]
        shapes.append(s)
    assert shapes[0] == [(20, 20), (12, 14), (8, 6)] and shapes[1] == shapes[0], shapes
    assert "the transform assigned to loader.dataset: fused RandomResizedCrop" in L.stats().path_reason


def test_a_transform_changed_in_place_takes_effect_at_the_next_pass(photos):
    """Progressive resizing by changing the user's crop in place, as under
    torch: the next pass translates the transform again."""
    rrc = V1.RandomResizedCrop(16)
    ds = D.ImageFolder(photos, transform=V1.Compose([rrc, V1.ToTensor()]))
    L = coordl.DataLoader(ds, batch_size=5)
    assert next(iter(L))[0].shape == (5, 3, 16, 16)
    rrc.size = (24, 20)
    assert next(iter(torch.utils.data.DataLoader(ds, batch_size=5)))[0].shape == next(iter(L))[0].shape \
        == (5, 3, 24, 20)


@pytest.mark.parametrize("version,first,pure", [("v1", "PILToTensor", False), ("v2", "PILToTensor", True),
                                                ("v2", "ToImage", True), ("v2", "ToImage", False)])
def test_the_conversion_after_steps_given_a_tensor_is_coordls_with_torchvisions_values(version, first, pure):
    """The reference presets with ``--backend tensor``: after the steps run
    as written on the crop's tensor, ``ConvertImageDtype``/``ToDtype`` and
    the ``Normalize``s run as coordl's one pass: torchvision's values bit for
    bit (every uint8 value, contiguous or not) and its class (a
    ``tv_tensors.Image`` unless ``ToPureTensor`` follows)."""
    M = V2 if version == "v2" else V1
    conv = M.ToDtype(torch.float, scale=True) if version == "v2" else M.ConvertImageDtype(torch.float)
    steps = [getattr(M, first)(), M.RandomResizedCrop(24, antialias=True), M.TrivialAugmentWide(), conv,
             M.Normalize(MEAN, STD), M.Normalize([0.1, 0.2, 0.3], [1.5, 2.0, 0.7])]
    out = translate(M.Compose(steps + ([M.ToPureTensor()] if pure else [])))[0]
    assert out._post_for_tensor() is not None
    g = torch.Generator().manual_seed(1)
    x = torch.arange(256, dtype=torch.uint8).repeat(3, 4, 8)[:, :, :240]
    for y in (x, torch.randint(0, 256, (3, 40, 30), dtype=torch.uint8, generator=g).transpose(1, 2)):
        if first == "ToImage":
            y = y.as_subclass(tv.tv_tensors.Image)
        want = y
        for t in out.post:
            want = t(want)
        got = out._run_post(y)
        assert type(got) is type(want) and got.dtype == want.dtype
        assert torch.equal(got.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor))
    # something else after the steps: as written
    other = translate(M.Compose(steps[:4] + [M.Normalize(MEAN, STD), M.ConvertImageDtype(torch.float64)]))[0]
    assert other._post_for_tensor() is None


# ------------------------------------------------- loaders of the user's own, read by their code


def _tv_copy(path):
    # open path as file to avoid ResourceWarning (https://github.com/python-pillow/Pillow/issues/835)
    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("RGB")


def _nested(p):
    with open(p, 'rb') as fh:
        with Image.open(fh) as im:
            return im.convert('RGB')


def _after_with(path):
    with open(path, 'rb') as f:
        img: PImage.Image = PImage.open(f).convert('RGB')
    return img


def _gray(path):
    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("L")


def _mode(path, mode="RGB"):
    return Image.open(path).convert(mode)


@pytest.mark.parametrize("loader", [_tv_copy, _nested, _after_with, lambda p: Image.open(p).convert("RGB")],
                         ids=["torchvision's, copied", "nested with", "after the with", "lambda"])
def test_a_loader_written_as_torchvisions_pil_loader_runs_on_coordls_pipeline(photos, loader):
    tf = V1.Compose([V1.Resize(16), V1.CenterCrop(16), V1.ToTensor()])
    ds = D.ImageFolder(photos, tf, loader=loader)
    L = coordl.DataLoader(ds, batch_size=5)
    s = L.stats()
    assert s.path == "coordl" and "fused Resize, CenterCrop, ToTensor" in s.path_reason, s
    got, want = list(L), list(torch.utils.data.DataLoader(ds, batch_size=5))
    assert len(got) == len(want) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                         for a, b in zip(got, want))


@pytest.mark.parametrize("loader", [_gray, _mode], ids=["gray", "mode as an argument"])
def test_other_loaders_stay_on_torchs_machinery(photos, loader):
    ds = D.ImageFolder(photos, V1.Compose([V1.Resize(16), V1.CenterCrop(16), V1.ToTensor()]), loader=loader)
    L = coordl.DataLoader(ds, batch_size=5)
    s = L.stats()
    assert s.path == "torch" and "is not torchvision's default_loader/pil_loader" in s.path_reason, s
    got, want = list(L), list(torch.utils.data.DataLoader(ds, batch_size=5))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, want))


class WithPaths(D.ImageFolder):
    """The widespread subclass returning the file's path beside the image."""

    def __getitem__(self, index):
        original_tuple = super().__getitem__(index)
        path = self.imgs[index][0]
        return original_tuple + (path,)


class WithIndex(D.ImageFolder):
    def __getitem__(self, index):
        img, target = super(WithIndex, self).__getitem__(index)
        return img, target, index


class TwoViews(D.ImageFolder):
    """Two calls of torchvision's __getitem__: the second runs as written."""

    def __getitem__(self, index):
        a, t = super().__getitem__(index)
        b, _ = super().__getitem__(index)
        c, _ = super().__getitem__((index + 1) % len(self))
        return torch.stack([a, b, c]), t


class OwnLoad(D.ImageFolder):
    """Its own read of the file with self.loader, and torchvision's __getitem__ too."""

    def __getitem__(self, index):
        img, t = super().__getitem__(index)
        again = self.transform(self.loader(self.samples[index][0]))
        return img, t, again


@pytest.mark.parametrize("workers", [0, 2])
def test_a_subclass_adding_to_torchvisions_getitem_reads_on_coordls_pipeline(photos, workers):
    """``ImageFolderWithPaths`` and its kin: the image prepared on coordl's
    pipeline, then the subclass's own ``__getitem__`` as written; torch's
    batches where nothing draws."""
    eval_tf = V1.Compose([V1.Resize(20), V1.CenterCrop((16, 18)), V1.ToTensor()])
    for cls in (WithPaths, WithIndex, TwoViews, OwnLoad):
        ds = cls(photos, transform=eval_tf)
        L = coordl.DataLoader(ds, batch_size=4, num_workers=workers)
        want = list(torch.utils.data.DataLoader(ds, batch_size=4))
        got = list(L)
        s = L.stats()
        assert s.path == "coordl" and f"then {cls.__qualname__}.__getitem__ as written" in s.path_reason, s
        assert len(got) == len(want)
        again = pickle.loads(pickle.dumps(L.dataset))     # as spawn's workers and the node daemon get it
        assert str(again.prep(again.raw(5), 5)) == str(L.dataset.prep(L.dataset.raw(5), 5))
        for a, b in zip(got, want):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, cls


class Switch(D.ImageFolder):
    def __getitem__(self, index):
        img, target = super().__getitem__(index)
        return (img, target, index) if self.with_index else (img, target)


@pytest.mark.parametrize("workers", [0, 2])
def test_what_a_subclass_getitem_reads_of_the_dataset_is_as_it_is_at_each_pass(photos, workers):
    ds = Switch(photos, transform=V1.Compose([V1.Resize((8, 8)), V1.PILToTensor()]))
    ds.with_index = True
    L = coordl.DataLoader(ds, batch_size=4, num_workers=workers)
    assert len(next(iter(L))) == 3
    ds.with_index = False     # as torch's workers of the next pass see it
    assert len(next(iter(L))) == 2 == len(next(iter(torch.utils.data.DataLoader(ds, batch_size=4))))


def test_a_subclass_getitem_draws_the_same_with_any_workers_and_resumes(photos):
    from _resume_check import whole_and_resumed

    ds = WithPaths(photos, transform=v1_pipeline(16))
    want = list(coordl.DataLoader(ds, batch_size=4, shuffle=True, seed=3))
    assert sorted(p for b in want for p in b[2]) == sorted(p for p, _ in ds.imgs)
    _, got = whole_and_resumed(lambda seed=3: coordl.DataLoader(ds, batch_size=4, shuffle=True, seed=seed,
                                                                num_workers=2), 3)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]
    # the path is the image's: the label of each path is its folder's
    for x, y, paths in want:
        assert [ds.class_to_idx[os.path.basename(os.path.dirname(p))] for p in paths] == y.tolist()


def test_a_subclass_getitem_that_does_not_reach_torchvisions_or_overrides_len_stays_on_torch(photos, cpu_device):
    class OwnRead(D.ImageFolder):
        def __getitem__(self, index):
            path, target = self.samples[index]
            return self.transform(Image.open(path).convert("RGB")), target

    class Shorter(WithPaths):
        def __len__(self):
            return 5

    for cls, why in ((OwnRead, "OwnRead overrides __getitem__"), (Shorter, "Shorter overrides __len__")):
        s = coordl.DataLoader(cls(photos, transform=v1_pipeline(16)), batch_size=4).stats()
        assert s.path == "torch" and why in s.path_reason, s
    with pytest.raises(ValueError, match="a subclass's own __getitem__"):
        coordl.DataLoader(WithPaths(photos, transform=v1_pipeline(16)), batch_size=4, device="cpu", decode="device")
    L = coordl.DataLoader(WithPaths(photos, transform=v1_pipeline(16)), batch_size=4, device="cpu")
    x, y, p = next(iter(L))
    assert L.stats().device_split.startswith("not split (TorchvisionSubclassFolder's samples are made after")
    assert x.shape == (4, 3, 16, 16) and len(p) == 4


@pytest.mark.parametrize("workers", [0, 2])
def test_a_folder_relabelled_between_passes_gives_the_new_labels(photos, workers):
    """Its ``samples`` assigned anew with other labels (label noise or
    correction between epochs): torch's next pass reads them, and so does
    coordl's; other files are an error that says to make a new loader."""
    for cls in (D.ImageFolder, WithPaths):
        ds = cls(photos, transform=V1.Compose([V1.Resize((8, 8)), V1.PILToTensor()]))
        T_ = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=workers)
        L = coordl.DataLoader(ds, batch_size=8, num_workers=workers)
        assert [b[1].tolist() for b in L] == [b[1].tolist() for b in T_]
        ds.samples = [(p, (t + 1) % 3) for p, t in ds.samples]
        got, want = [b[1].tolist() for b in L], [b[1].tolist() for b in T_]
        assert got == want and got != [b[1].tolist() for b in coordl.DataLoader(cls(photos), batch_size=8,
                                                                               collate_fn=_labels_only)]
        ds.samples = ds.samples[1:] + ds.samples[:1]
        with pytest.raises(ValueError, match="changed since the last pass \\(assigned anew or in place\\) to other files"):
            iter(L)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_folder_relabelled_in_place_gives_the_new_labels(photos, workers):
    """Labels changed in the ``samples`` list itself (``ds.samples[i] =
    (path, label)``): torch's next pass reads them, and so does coordl's."""
    ds = D.ImageFolder(photos, transform=V1.Compose([V1.Resize((8, 8)), V1.PILToTensor()]))
    T_ = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=workers)
    L = coordl.DataLoader(ds, batch_size=8, num_workers=workers)
    before = [b[1].tolist() for b in L]
    for i in (0, 5, len(ds) - 1):
        ds.samples[i] = (ds.samples[i][0], (ds.samples[i][1] + 1) % 3)
    got, want = [b[1].tolist() for b in L], [b[1].tolist() for b in T_]
    assert got == want and got != before
    ds.samples[2] = (ds.samples[2][0], "cat")           # not a class index: the error of a list assigned anew
    with pytest.raises(ValueError, match="are not \\(path, class index\\) pairs"):
        iter(L)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_swapped_in_place_under_its_label_is_an_error_not_the_old_file(photos, workers):
    """``ds.samples[i] = (other_path, same_label)``: torch's next pass reads
    the other file.  coordl read the folder's files when the loader was
    made, so it says so, rather than deliver the old file's pixels."""
    ds = D.ImageFolder(photos, transform=V1.Compose([V1.Resize((8, 8)), V1.PILToTensor()]))
    L = coordl.DataLoader(ds, batch_size=8, num_workers=workers)
    assert sum(len(b[1]) for b in L) == len(ds)
    i = next(k for k in range(1, len(ds)) if ds.samples[k][1] == ds.samples[0][1])
    ds.samples[0] = (ds.samples[i][0], ds.samples[0][1])     # the same label, another file
    with pytest.raises(ValueError, match="changed since the last pass \\(assigned anew or in place\\) to other files"):
        iter(L)


def _labels_only(batch):
    return None, torch.tensor([t for _, t, *_ in batch])
