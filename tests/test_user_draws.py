"""User code that draws from the global generators inside coordl's
pipeline: a collate_fn (mixup, cutmix: torchvision's reference recipes mix
in the collate_fn) draws from torch's, Python's and numpy's generators
seeded from (seed, epoch, step); a step of a coordl Compose that is not
coordl's (a torchvision transform, a callable of the user's), or a
torchvision pipeline's steps run as written, from torch's, Python's and
(where it may draw from it) numpy's seeded from (seed, epoch, index).  The same batches with any
number of workers, exactly the same after a resume mid-epoch, and the
caller's generators left as they were."""
import os
import random
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import coordl
from coordl import DataLoader
from toydata import TwoStageToy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _resume_check import whole_and_resumed  # noqa: E402

N, BS = 24, 4


def mixing_collate(batch):
    """A mixup-like collate drawing from all three global generators, as
    collate_fns written for torch's workers do."""
    x, y = default_collate(batch)
    lam = float(torch.distributions.Beta(torch.tensor([0.4]), torch.tensor([0.4])).sample())
    shift = random.randrange(1, len(y)) if len(y) > 1 else 0
    noise = float(np.random.uniform())
    return x, y, torch.tensor([lam, shift, noise], dtype=torch.float64)


def _make(num_workers, seed=5, **kw):
    return DataLoader(TwoStageToy(N), batch_size=BS, shuffle=True, seed=seed, num_workers=num_workers,
                      collate_fn=mixing_collate, **kw)


def _draws(batches):
    return [(b[0][:, 0].tolist(), b[2].tolist()) for b in batches]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_collate_draws_same_after_resume_mid_epoch(num_workers):
    full, got = whole_and_resumed(lambda seed=5: _make(num_workers, seed=seed), 2)
    assert _draws(got) == _draws(full)


def test_collate_draws_do_not_depend_on_the_workers():
    one, two = _draws(_make(0)), _draws(_make(2))
    assert one == two
    # they differ from batch to batch and from epoch to epoch
    loader = _make(2)
    e0, e1 = _draws(loader), _draws(loader)
    assert len({tuple(d) for _, d in e0}) == len(e0)
    assert [d for _, d in e0] != [d for _, d in e1]


def test_collate_draws_leave_the_main_generators_as_they_were():
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    want = (torch.rand(2), random.random(), np.random.uniform())
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    list(_make(0))
    got = (torch.rand(2), random.random(), np.random.uniform())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


# ------------------------------------------------------------ a Compose's foreign steps
@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("userdraws", num_images=16, num_classes=2, mean_kb=2, image_size=(40, 32), seed=3)


class ToPIL:
    """A step of the user's between coordl's, drawing from torch's and
    Python's generators (not coordl's per-sample one)."""

    def __call__(self, img):
        return img.rotate(90 * random.randrange(4)) if torch.rand(()) < 0.5 else img


def _pil_compose(photos):
    from coordl import transforms as T

    return coordl.ImageFolder(photos, transform=T.Compose([T.RandomResizedCrop(8), ToPIL(), T.RandomHorizontalFlip(),
                                                             T.ToTensor()]))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("draws_from", ["torch and Python", "numpy"])
def test_a_compose_steps_of_the_users_draw_the_same_after_resume(photos, num_workers, draws_from):
    ds = _pil_compose(photos) if draws_from == "torch and Python" else _numpy_compose(photos)

    def make(seed=5):
        return coordl.DataLoader(ds, batch_size=4, shuffle=True, seed=seed, num_workers=num_workers)

    full, got = whole_and_resumed(make, 2)
    assert len(got) == len(full) and all(torch.equal(x, y) for (x, _), (y, _) in zip(got, full))


def test_a_compose_steps_of_the_users_do_not_depend_on_the_workers_and_vary(photos):
    ds = _pil_compose(photos)
    one = [x for x, _ in coordl.DataLoader(ds, batch_size=4, seed=5, num_workers=0)]
    two = [x for x, _ in coordl.DataLoader(ds, batch_size=4, seed=5, num_workers=2)]
    assert all(torch.equal(x, y) for x, y in zip(one, two))
    L = coordl.DataLoader(ds, batch_size=16, seed=5)
    e0, e1 = next(iter(L))[0], next(iter(L))[0]
    assert not torch.equal(e0, e1)


def test_a_compose_steps_of_the_users_leave_the_callers_generators(photos):
    ds = _pil_compose(photos)
    torch.manual_seed(3)
    random.seed(3)
    want = (torch.rand(2), random.random())
    torch.manual_seed(3)
    random.seed(3)
    list(coordl.DataLoader(ds, batch_size=4, seed=5))
    got = (torch.rand(2), random.random())
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    # outside a loader the Compose draws from the generators as they are, as torchvision's does
    from PIL import Image

    img = Image.new("RGB", (20, 16))
    torch.manual_seed(1)
    random.seed(1)
    a = ds.transform(img)
    torch.manual_seed(1)
    random.seed(1)
    assert torch.equal(a, ds.transform(img))


class Draw:
    """A whole transform (or target_transform) of the user's: its draw of
    torch's generator."""

    def __call__(self, x):
        return float(torch.rand(()))


def test_a_transform_and_target_transform_of_the_users_are_seeded_once_per_sample(photos):
    ds = coordl.ImageFolder(photos, transform=Draw(), target_transform=Draw())

    def draws(L):
        return [(float(a), float(b)) for xs, ys in L for a, b in zip(xs, ys)]

    one = draws(coordl.DataLoader(ds, batch_size=4, seed=5, num_workers=0))
    two = draws(coordl.DataLoader(ds, batch_size=4, seed=5, num_workers=2))
    assert one == two
    # the two callables of a sample do not draw the same values (one seeding for both)
    assert all(a != b for a, b in one) and len({a for a, _ in one}) == len(one)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_device_split_draws_a_users_step_as_the_cpu_path(photos, cpu_device, num_workers):
    """The split runs the Compose's steps before the conversion itself: its
    user's step draws what the CPU path's draws, bit for bit."""
    from coordl import transforms as T

    tf = T.Compose([T.RandomResizedCrop(8), ToPIL(), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize([0.5, 0.4, 0.3], [0.2, 0.3, 0.4])])
    ds = coordl.ImageFolder(photos, transform=tf)
    kw = dict(batch_size=4, seed=5, shuffle=True, num_workers=num_workers)
    cpu = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cpu", **kw)
    dev = list(L)
    assert L.stats().device_split.startswith("split")
    assert all(torch.equal(a, b) and torch.equal(y, z) for (a, y), (b, z) in zip(cpu, dev))


class NumpyTurn:
    """A step of the user's drawing from numpy's global generator (as
    timm's RandAugment does, ``np.random.choice``)."""

    def __call__(self, img):
        return img.rotate(90 * int(np.random.randint(4)))


def _numpy_compose(photos):
    from coordl import transforms as T

    return coordl.ImageFolder(photos, transform=T.Compose([T.RandomResizedCrop(8), NumpyTurn(), T.ToTensor()]))


def test_a_users_step_drawing_from_numpy_does_not_depend_on_the_workers(photos):
    """numpy's global generator is seeded per sample too: the same batches
    with 0 and 2 workers, samples differing from each other, and the
    caller's numpy state as it was."""
    ds = _numpy_compose(photos)
    np.random.seed(3)
    want = np.random.uniform()
    np.random.seed(3)
    one = [x for x, _ in coordl.DataLoader(ds, batch_size=4, seed=5, num_workers=0)]
    assert np.random.uniform() == want
    two = [x for x, _ in coordl.DataLoader(ds, batch_size=4, seed=5, num_workers=2)]
    assert all(torch.equal(x, y) for x, y in zip(one, two))


def test_timms_randaugment_as_written_does_not_depend_on_the_workers(photos):
    """timm's RandAugment (``rand-m9-mstd0.5-inc1``, its training recipes'
    ``--aa``) picks its operations with numpy's global generator: run as
    written in torchvision's ImageFolder, the same batches with 0 and 2
    workers."""
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed (pip install coordl[test])")
    timm = pytest.importorskip("timm", reason="timm is not installed (pip install timm)")
    from torchvision import datasets
    from torchvision import transforms as V
    from timm.data.auto_augment import rand_augment_transform

    tf = V.Compose([V.RandomResizedCrop(24), rand_augment_transform("rand-m9-mstd0.5-inc1", {}), V.ToTensor()])
    ds = datasets.ImageFolder(photos, transform=tf)
    one = [x for x, _ in coordl.DataLoader(ds, batch_size=4, seed=5, num_workers=0)]
    two = [x for x, _ in coordl.DataLoader(ds, batch_size=4, seed=5, num_workers=2)]
    assert all(torch.equal(x, y) for x, y in zip(one, two)), timm.__version__


def test_only_steps_that_may_draw_from_numpy_pay_for_its_seeding():
    """torchvision's transforms draw from torch's generator alone, so their
    scope leaves numpy's alone (its state costs about 60 us a sample to
    save and restore); a callable of the user's, a ``Lambda`` of one, or
    one inside a torchvision container may draw from it."""
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed (pip install coordl[test])")
    from torchvision import transforms as V
    from torchvision.transforms import v2 as V2

    from coordl.transforms import draws_numpy

    assert not draws_numpy(V.Compose([V.RandomResizedCrop(8), V.TrivialAugmentWide(), V.ColorJitter(0.2)]))
    assert not draws_numpy(V2.RandomApply([V2.ColorJitter(0.2)])) and not draws_numpy(None)
    assert draws_numpy(NumpyTurn()) and draws_numpy(V.Lambda(lambda x: x))
    assert draws_numpy(V.RandomApply([NumpyTurn()])) and draws_numpy(V2.Compose([V2.RandomChoice([NumpyTurn()])]))
