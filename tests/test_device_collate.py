"""decode="device" with a collate_fn of the user's (torchvision's reference
recipes mix batches there: ``v2.MixUp``/``v2.CutMix`` over
``default_collate``'s batch): the collate_fn gets the samples as the
dataset returns them, their images already on the device, and draws what
it would draw on the CPU path (the same seeded generators), so the batches
are the CPU path's up to the decode's tolerance.  The CPU stands in for the
device (see tests/test_device_decode.py); tests/test_cuda.py runs it on a
GPU."""
import collections
import os
import random
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import coordl
from coordl import transforms as T

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _datasets_for_tests import FolderTwoStage  # noqa: E402
from _resume_check import whole_and_resumed  # noqa: E402

NORM = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
STD255 = torch.tensor(NORM.std).view(1, 3, 1, 1) * 255
Pair = collections.namedtuple("Pair", "image label")


def _rrc(size=16):
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), NORM])


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("dcollate", num_images=20, num_classes=3, mean_kb=5, image_size=(80, 64), seed=6)


def mix(batch, num_classes=3):
    """Mixup as torchvision's v2.MixUp does it (one Beta draw per batch,
    the batch rolled by one), written with torch alone."""
    x, y = default_collate(batch)
    lam = float(torch.distributions.Beta(torch.tensor([0.5]), torch.tensor([0.5])).sample())
    y = torch.nn.functional.one_hot(y, num_classes).float()
    return x.roll(1, 0).mul(1 - lam).add(x.mul(lam)), y.roll(1, 0).mul(1 - lam).add(y.mul(lam))


def cut(batch, num_classes=3):
    """Cutmix with the box drawn from numpy's and Python's generators (the
    classic implementations draw there)."""
    x, y = default_collate(batch)
    lam = float(np.random.beta(1.0, 1.0))
    h, w = x.shape[-2:]
    ch, cw = int(h * (1 - lam) ** 0.5), int(w * (1 - lam) ** 0.5)
    top, left = random.randint(0, h - ch), random.randint(0, w - cw)
    x = x.clone()
    x[..., top:top + ch, left:left + cw] = x.roll(1, 0)[..., top:top + ch, left:left + cw]
    lam = 1 - ch * cw / (h * w)
    y = torch.nn.functional.one_hot(y, num_classes).float()
    return x, y.roll(1, 0).mul(1 - lam).add(y.mul(lam))


def _levels(a, b):
    return (a - b).abs() * STD255


def _both(ds, collate_fn, workers, **kw):
    kw = {"batch_size": 4, "seed": 7, "shuffle": True, "num_workers": workers, "collate_fn": collate_fn, **kw}
    cpu = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cpu", decode="device", **kw)
    return cpu, list(L), L


@pytest.mark.parametrize("collate_fn", [mix, cut])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixing_collate_gives_the_cpu_paths_batches(photos, cpu_device, exact, collate_fn, workers):
    """The same draws on both paths (labels equal bit for bit; images to the
    resize's rounding, 1 level, as without the collate_fn)."""
    ds = coordl.ImageFolder(photos, _rrc())
    cpu, dev, L = _both(ds, collate_fn, workers)
    assert len(cpu) == len(dev) == 5
    for (a, y), (b, y2) in zip(cpu, dev):
        assert torch.equal(y, y2) and a.shape == b.shape
        assert float(_levels(a, b).max()) <= 1.0 + 1e-3
    # mixed: the soft labels are not one-hot
    assert any(float(y.max()) < 1.0 for _, y in dev)
    assert L.stats().device_decode_images == len(ds)


class Shaped(FolderTwoStage):
    """A two-stage dataset returning samples of several structures."""

    def __init__(self, root, kind):
        super().__init__(root, _rrc(), kind)

    def prep(self, raw, i):
        img = self.transform.from_bytes(raw)
        if self.kind == "tuple":
            return img, i % 3
        if self.kind == "namedtuple":
            return Pair(img, np.float32(i) * np.ones(2, np.float32))
        if self.kind == "dict":
            return {"image": img, "weight": i / 2, "name": f"s{i}"}    # a string: gathered as default_collate does
        if self.kind == "dict_order":   # keys in another order every other sample: the copy path
            d = {"image": img, "weight": i / 2, "name": f"s{i}"}
            return d if i % 2 == 0 else dict(reversed(d.items()))
        raise AssertionError(self.kind)


def _record(batch):
    """A collate that returns what it was given, described."""
    return [(type(s).__name__, [(type(v).__name__, getattr(v, "device", None)) for v in
                                (s.values() if isinstance(s, dict) else s)]) for s in batch], default_collate(batch)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_collate_gets_the_samples_the_dataset_returned(photos, cpu_device, exact, workers):
    for kind, want in (("tuple", ("tuple", ["Tensor", "int"])),
                       ("namedtuple", ("Pair", ["Tensor", "ndarray"])),
                       ("dict", ("dict", ["Tensor", "float", "str"])),
                       # the copy path (samples of two structures): default collation's, split by row
                       ("dict_order", ("dict", ["Tensor", "Tensor", "str"]))):
        ds = Shaped(photos, kind)
        # (in order for dict_order, so that every batch holds both structures)
        cpu, dev, _ = _both(ds, _record, workers, shuffle=kind != "dict_order")
        for (_, a), (seen, b) in zip(cpu, dev):
            order = sorted if kind == "dict_order" else list    # (the batch's first sample gives the keys' order)
            assert all((name, order(t for t, _ in leaves)) == want for name, leaves in seen), (kind, seen)
            assert len(seen) == 4
            if kind.startswith("dict"):
                assert a["name"] == b["name"] and torch.equal(a["weight"], b["weight"])
                a, b = a["image"], b["image"]
            elif kind == "namedtuple":
                assert torch.equal(a.label, b.label)
                a, b = a.image, b.image
            else:
                assert torch.equal(a[1], b[1])
                a, b = a[0], b[0]
            assert float(_levels(a, b).max()) <= 1.0 + 1e-3


@pytest.mark.parametrize("workers", [0, 2])
def test_exact_mid_epoch_resume_with_a_mixing_collate(photos, cpu_device, workers):
    ds = coordl.ImageFolder(photos, _rrc())
    kw = dict(batch_size=3, shuffle=True, num_workers=workers, device="cpu", decode="device", collate_fn=mix)
    want, got = whole_and_resumed(lambda seed=11: coordl.DataLoader(ds, seed=seed, **kw), 3)
    assert len(got) == len(want) == 7
    for (a, y), (b, y2) in zip(got, want):
        assert torch.equal(a, b) and torch.equal(y, y2)


class Fails:
    """A collate_fn that fails on the batch holding sample ``bad``'s image."""

    def __init__(self, bad_label):
        self.bad_label = bad_label

    def __call__(self, batch):
        x, y = default_collate(batch)
        if (y == self.bad_label).any():
            raise KeyError("no such class")
        return x, y


def test_an_error_of_the_collate_fails_its_batch_and_the_pass_goes_on(photos, cpu_device):
    """As under torch: that batch raises (its own error type, a note saying
    where it ran), the next ones come."""
    ds = coordl.ImageFolder(photos, _rrc())
    L = coordl.DataLoader(ds, batch_size=4, shuffle=False, device="cpu", decode="device", collate_fn=Fails(2))
    it = iter(L)
    got, failed = [], 0
    while True:
        try:
            got.append(next(it))
        except StopIteration:
            break
        except KeyError as e:
            failed += 1
            assert "decode='device'" in "".join(getattr(e, "__notes__", []))
    labels = [y for _, y in got]
    assert failed >= 1 and failed + len(got) == 5
    assert all(2 not in y.tolist() for y in labels)


def test_an_empty_step_and_skipped_samples(photos, cpu_device, tmp_path):
    """A batch sampler's empty step is collate_fn([]), as under torch; a
    sample skipped under on_error="skip" is not among the collate's."""
    import shutil

    root = tmp_path / "data"
    shutil.copytree(photos, root)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
    with open(files[1], "r+b") as f:         # header intact, no image data
        f.truncate(300)
    ds = coordl.ImageFolder(str(root), _rrc())
    seen = []

    def count(batch):
        seen.append(len(batch))
        return len(batch), (default_collate(batch) if batch else None)

    L = coordl.DataLoader(ds, batch_sampler=[[0, 1, 2], [], [3, 4]], device="cpu", decode="device",
                          collate_fn=count, on_error="skip")
    with pytest.warns(coordl.SkippedSampleWarning):
        out = list(L)
    assert [n for n, _ in out] == [2, 0, 2]
    assert out[1][1] is None and out[0][1][0].shape[0] == 2


def test_batch_size_none_is_refused_with_the_remedy(photos, cpu_device):
    with pytest.raises(ValueError, match=r"decode='device' needs batches.*pass a batch_size"):
        coordl.DataLoader(coordl.ImageFolder(photos, _rrc()), batch_size=None, device="cpu", decode="device")


# ---------------------------------------------------------------- torchvision's reference recipe
def test_torchvisions_reference_mixup_cutmix_collate(photos, cpu_device, exact, tv):
    """references/classification/train.py's collate: RandomChoice of MixUp
    and CutMix over default_collate's batch, with its ImageFolder."""
    from torchvision import datasets
    from torchvision.transforms import v2

    tf = v2.Compose([v2.RandomResizedCrop(16, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor(),
                     v2.ToDtype(torch.float, scale=True), v2.Normalize(NORM.mean, NORM.std)])
    mixup_cutmix = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=3), v2.CutMix(alpha=1.0, num_classes=3)])

    def collate_fn(batch):
        return mixup_cutmix(*default_collate(batch))

    ds = datasets.ImageFolder(photos, transform=tf)
    cpu, dev, L = _both(ds, collate_fn, 2)
    for (a, y), (b, y2) in zip(cpu, dev):
        assert torch.equal(y, y2) and float(_levels(a, b).max()) <= 1.0 + 1e-3
    assert L.stats().device_decode_images == len(ds) and L.stats().path == "coordl"


class _WithPathAndId(Shaped):
    def prep(self, raw, i):
        return self.transform.from_bytes(raw), i % 3, f"/data/{i}.jpg", np.int64(i)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_path_and_a_numpy_id_beside_the_image_reach_the_device_batch(photos, cpu_device, exact, workers):
    """Without a collate_fn: the batch collated in place (strings in their
    tuple, numpy scalars as a tensor) goes through the device stage and the
    device split as default_collate's batch does on the CPU path."""
    ds = _WithPathAndId(photos, "tuple")
    kw = {"batch_size": 4, "seed": 7, "shuffle": True, "num_workers": workers}
    cpu = list(coordl.DataLoader(ds, **kw))
    dev = list(coordl.DataLoader(ds, device="cpu", decode="device", **kw))
    split = list(coordl.DataLoader(ds, device="cpu", **kw))
    assert len(cpu) == len(dev) == len(split) == 5
    for a, b, c in zip(cpu, dev, split):
        assert type(a[2]) is tuple and a[2] == b[2] == c[2]
        assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in (1, 3)) and a[3].dtype == torch.int64
        assert float(_levels(a[0], b[0]).max()) <= 1.0 + 1e-3 and torch.equal(a[0], c[0])
