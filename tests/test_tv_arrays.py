"""torchvision's CIFAR10 and CIFAR100 (images held in memory) on coordl's
pipeline: each image's row of the array is its raw bytes, the translated
transform runs on its planes without a PIL image.  Each dataset is made as
its constructor leaves it, over random pixels (the real ones need their
download)."""
import os
import random
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _torchvision import import_torchvision  # noqa: E402

if import_torchvision() is None:
    pytest.skip("torchvision is not installed (pip install coordl[test])", allow_module_level=True)

import torchvision  # noqa: E402
from PIL import Image  # noqa: E402
from torchvision import transforms as T  # noqa: E402
from torchvision.transforms import v2 as V2  # noqa: E402
from torchvision.datasets.vision import VisionDataset  # noqa: E402

import coordl  # noqa: E402
from coordl import _rng  # noqa: E402
from coordl.tvcompat import TorchvisionArrays, translate  # noqa: E402

MEAN, STD = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
TRAIN = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
EVAL = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])


def cifar(transform=None, n=40, cls=torchvision.datasets.CIFAR10, size=(32, 32), target_transform=None):
    """``cls`` as its constructor leaves it over ``n`` random images: CIFAR's
    (N, H, W, 3) rows and target list, SVHN's and STL10's (N, 3, H, W) rows
    and label array."""
    ds = cls.__new__(cls)
    VisionDataset.__init__(ds, "/nonexistent", transform=transform, target_transform=target_transform)
    rng = np.random.default_rng(n)
    if issubclass(cls, torchvision.datasets.MNIST):          # a uint8 tensor of gray images, a tensor of targets
        g = torch.Generator().manual_seed(n)
        ds.data = torch.randint(0, 256, (n, *size), dtype=torch.uint8, generator=g)
        ds.targets = torch.randint(0, 10, (n,), generator=g)
        ds.train = True
    elif issubclass(cls, torchvision.datasets.CIFAR10):
        ds.data = rng.integers(0, 256, (n, *size, 3), dtype=np.uint8)
        ds.targets = [int(t) for t in rng.integers(0, 10, n)]
        ds.train = True
    else:
        ds.data = rng.integers(0, 256, (n, 3, *size), dtype=np.uint8)
        ds.labels = rng.integers(0, 10, n).astype(np.int64 if cls is torchvision.datasets.SVHN else np.uint8)
        ds.split = "train"
    return ds


def targets_of(ds):
    return ds.targets if hasattr(ds, "targets") else ds.labels


def row_image(ds, i):
    """The PIL image torchvision's ``__getitem__`` makes of row ``i``."""
    if isinstance(ds, torchvision.datasets.MNIST):
        return Image.fromarray(ds.data[i].numpy()).convert("L")
    if isinstance(ds, torchvision.datasets.CIFAR10):
        return Image.fromarray(ds.data[i])
    return Image.fromarray(np.transpose(ds.data[i], (1, 2, 0)))


GRAY = [torchvision.datasets.MNIST, torchvision.datasets.FashionMNIST, torchvision.datasets.KMNIST]


@pytest.mark.parametrize("cls", GRAY, ids=lambda c: c.__name__)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_mnists_gray_images_are_torchs_batches_read_from_the_tensor(cls, num_workers):
    ds = cifar(T.Compose([T.ToTensor(), T.Normalize((0.1307,), (0.3081,))]), cls=cls, size=(28, 28))
    L = coordl.DataLoader(ds, batch_size=8, num_workers=num_workers)
    assert L.stats().path == "coordl", L.stats().path_reason
    assert equal(batches(L), batches(torch.utils.data.DataLoader(ds, batch_size=8)))


@pytest.mark.parametrize("tf", [T.Compose([T.RandomCrop(28, padding=2), T.ToTensor()]),
                                T.Compose([T.RandomRotation(10), T.ToTensor(), T.Normalize((0.5,), (0.5,))])],
                         ids=["padded-crop", "rotation-as-written"])
def test_mnists_training_draws_and_pixels_are_those_of_the_l_image_of_each_row(tf):
    ds = cifar(tf, cls=torchvision.datasets.MNIST, size=(28, 28))
    (x, y), = batches(coordl.DataLoader(ds, batch_size=len(ds), seed=8, num_workers=2))
    out = translate(tf)[0]
    for i in range(len(ds)):
        with _rng.sample_rng(8, 0, i):
            want = out(row_image(ds, i))
        assert torch.equal(x[i], want), i
        assert y[i] == ds.targets[i]


def batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def equal(a, b):
    return len(a) == len(b) and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))


CLASSES = [torchvision.datasets.CIFAR10, torchvision.datasets.CIFAR100, torchvision.datasets.SVHN,
           torchvision.datasets.STL10]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_eval_recipe_is_torchs_batches_read_from_the_array(cls, num_workers):
    ds = cifar(EVAL, cls=cls)
    L = coordl.DataLoader(ds, batch_size=8, num_workers=num_workers)
    s = L.stats()
    assert s.path == "coordl" and s.path_reason.startswith(f"torchvision's {cls.__name__} read from its array"), s
    assert isinstance(L.dataset, TorchvisionArrays) and L.dataset.data is ds.data      # shared, not copied
    assert equal(batches(L), batches(torch.utils.data.DataLoader(ds, batch_size=8)))


@pytest.mark.parametrize("tf", [TRAIN, T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.ToTensor()]),
                                V2.Compose([V2.RandomCrop(32, padding=4, padding_mode="reflect"),
                                            V2.RandomHorizontalFlip(), V2.ToImage(),
                                            V2.ToDtype(torch.float32, scale=True), V2.Normalize(MEAN, STD)])],
                         ids=["cifar", "rrc", "v2-reflect"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("cls", [torchvision.datasets.CIFAR10, torchvision.datasets.SVHN], ids=lambda c: c.__name__)
def test_training_draws_and_pixels_are_those_of_the_pil_image_of_each_row(tf, num_workers, cls):
    """The planes path gives what the translated transform gives on
    ``Image.fromarray`` of the row (what torchvision's CIFAR10 hands its
    transform; SVHN's row transposed to (H, W, 3)) for the sample's (seed,
    epoch, index)."""
    ds = cifar(tf, cls=cls)
    L = coordl.DataLoader(ds, batch_size=len(ds), seed=4, num_workers=num_workers)
    out = translate(tf)[0]
    for epoch in range(2):
        (x, y), = batches(L)
        for i in range(len(ds)):
            with _rng.sample_rng(4, epoch, i):
                want = out(row_image(ds, i))
            assert torch.equal(x[i], want), (epoch, i)
            assert y[i] == targets_of(ds)[i]


@pytest.mark.parametrize("cls", [torchvision.datasets.CIFAR10, torchvision.datasets.MNIST], ids=lambda c: c.__name__)
def test_no_transform_gives_torchvisions_pil_images_and_the_target_transform_runs(cls):
    ds = cifar(None, cls=cls, target_transform=lambda t: t * 10)
    for (a, ya), (b, yb) in zip(coordl.DataLoader(ds, batch_size=None),
                                torch.utils.data.DataLoader(ds, batch_size=None)):
        assert isinstance(a, Image.Image) and a.mode == b.mode and np.array_equal(np.asarray(a), np.asarray(b))
        assert ya == yb


def test_a_step_of_the_users_draws_from_the_samples_seeded_generators():
    def noisy(img):
        return img + random.random()

    ds = cifar(T.Compose([T.ToTensor(), noisy]))
    a = batches(coordl.DataLoader(ds, batch_size=8, seed=2))
    b = batches(coordl.DataLoader(ds, batch_size=8, seed=2, num_workers=2))
    assert equal(a, b)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pass_resumed_mid_epoch_delivers_the_rest_exactly(num_workers):
    def make():
        return coordl.DataLoader(cifar(TRAIN), batch_size=4, shuffle=True, seed=3, num_workers=num_workers)

    whole = batches(make())
    a = make()
    it = iter(a)
    head = [(x.clone(), y.clone()) for x, y in (next(it), next(it))]
    state = a.state_dict()
    del it
    b = make()
    b.load_state_dict(state)
    assert equal(head + batches(b), whole)


def test_the_device_split_gives_the_cpu_paths_batches(cpu_device):
    tf = T.Compose([T.RandomCrop(28), T.RandomHorizontalFlip(), T.ColorJitter(0.3, 0.3), T.ToTensor(),
                    T.Normalize(MEAN, STD)])
    want = batches(coordl.DataLoader(cifar(tf), batch_size=8, seed=5))
    L = coordl.DataLoader(cifar(tf), batch_size=8, seed=5, device="cpu", num_workers=2)
    assert equal(batches(L), want)
    assert L.stats().device_split.startswith("split: uint8 images travel"), L.stats().device_split


class _OtherCIFAR10(VisionDataset):
    """A torchvision whose CIFAR10 reads more than the one coordl knows."""

    def __getitem__(self, index):
        img = Image.fromarray(self.data[index]).rotate(90)
        return self.transform(img), self.target_transform(self.targets[index])

    def __len__(self):
        return len(self.data)


_OtherCIFAR10.__name__ = _OtherCIFAR10.__qualname__ = "CIFAR10"
_OtherCIFAR10.__module__ = "torchvision.datasets.cifar"


def test_what_coordl_cannot_prove_equivalent_stays_on_torchs_machinery():
    class Own(torchvision.datasets.CIFAR10):
        def __getitem__(self, i):
            return super().__getitem__(i)

    s = coordl.DataLoader(cifar(EVAL, cls=Own), batch_size=4).stats()
    assert s.path == "torch" and "Own overrides __getitem__" in s.path_reason
    s = coordl.DataLoader(cifar(EVAL, cls=_OtherCIFAR10), batch_size=4).stats()
    assert s.path == "torch" and "CIFAR10.__getitem__ reads Image, fromarray, data, rotate" in s.path_reason
    ds = cifar(EVAL)
    ds.data = ds.data.astype(np.float32)
    s = coordl.DataLoader(ds, batch_size=4).stats()
    assert s.path == "torch" and "not an (N, H, W, 3) uint8 array" in s.path_reason
    with pytest.raises(ValueError, match="fingerprint"):
        coordl.DataLoader(cifar(EVAL), batch_size=4, cache_size="1MiB")
    with pytest.raises(ValueError, match="already decoded, in an array in memory.*Pass device= without"):
        coordl.DataLoader(cifar(EVAL), batch_size=4, device="cpu", decode="device")
    unlabeled = cifar(EVAL, cls=torchvision.datasets.STL10)
    unlabeled.labels = None
    s = coordl.DataLoader(unlabeled, batch_size=4).stats()
    assert s.path == "torch" and "it has no labels (an unlabeled split)" in s.path_reason


def test_a_random_split_part_reads_on_coordls_pipeline(cpu_device):
    part, _ = torch.utils.data.random_split(cifar(EVAL), [30, 10], generator=torch.Generator().manual_seed(0))
    L = coordl.DataLoader(part, batch_size=4)
    s = L.stats()
    assert s.path == "coordl" and s.path_reason.startswith("a Subset of torchvision's CIFAR10 read from its array"), s
    want = list(torch.utils.data.DataLoader(part, batch_size=4))
    got = list(L)
    assert len(got) == len(want) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
    split = coordl.DataLoader(part, batch_size=4, device="cpu", num_workers=2)
    got = list(split)
    assert split.stats().device_split.startswith("split")
    assert len(got) == len(want) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="CIFAR10's images are already decoded, in an array in memory"):
        coordl.DataLoader(part, batch_size=4, device="cpu", decode="device")
    with pytest.raises(ValueError, match="fingerprint"):
        coordl.DataLoader(part, batch_size=4, cache_size="1MiB")


def test_prep_takes_the_rows_bytes_in_any_form():
    """Shared staging hands prep a read-only view of the bytes: the same
    sample, without torch's warning about memory it cannot write."""
    L = coordl.DataLoader(cifar(EVAL), batch_size=4)
    ds = L.dataset
    raw = ds.raw(3)
    want = ds.prep(raw, 3)
    for form in (bytes(raw), memoryview(bytes(raw))):
        got = ds.prep(form, 3)
        assert torch.equal(got[0], want[0]) and got[1] == want[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_labels_and_images_changed_between_passes_are_the_next_passs(workers):
    """Label correction between epochs (in place, or a list assigned anew)
    and an array assigned anew: torch's next pass reads them as they are
    then, and so does coordl's; a different number of images is an error
    that says to make a new loader."""
    ds = cifar(EVAL, n=24)
    T_ = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=workers)
    L = coordl.DataLoader(ds, batch_size=8, num_workers=workers)

    def both_equal():
        a, b = list(T_), list(L)
        return len(a) == len(b) == 3 and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))

    assert both_equal()
    ds.targets[3] = (ds.targets[3] + 1) % 10            # in place
    assert both_equal()
    ds.targets = [(t + 2) % 10 for t in ds.targets]     # assigned anew
    assert both_equal()
    ds.data = np.ascontiguousarray(ds.data[::-1])       # images assigned anew
    assert both_equal()
    ds.data = ds.data[:16]
    ds.targets = ds.targets[:16]
    with pytest.raises(ValueError, match="CIFAR10 given to this DataLoader has 16 samples now, 24 when"):
        iter(L)
