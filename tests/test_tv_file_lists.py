"""torchvision's datasets that list image files with class indices (Food101,
Flowers102, DTD, FGVCAircraft, SUN397, RenderedSST2, StanfordCars,
Imagenette, GTSRB: the fine-tuning sets of torchvision's and timm's
recipes) on coordl's pipeline, read as raw bytes as a folder is.  Each is
made as its constructor leaves it (its list over synthetic files), since
the real ones need downloads."""
import os
import sys

import numpy as np
import PIL.Image
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _torchvision import import_torchvision  # noqa: E402

if import_torchvision() is None:
    pytest.skip("torchvision is not installed (pip install coordl[test])", allow_module_level=True)

import torchvision  # noqa: E402
from torchvision import datasets as D  # noqa: E402
from torchvision import transforms as T  # noqa: E402
from torchvision.datasets.vision import VisionDataset  # noqa: E402

import coordl  # noqa: E402

NAMES = ["Food101", "Flowers102", "DTD", "FGVCAircraft", "SUN397", "RenderedSST2", "StanfordCars", "Imagenette",
         "GTSRB", "Places365", "OxfordIIITPet"]


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("tv_lists", num_images=20, num_classes=3, mean_kb=3, image_size=(56, 40), seed=3)


def listed(name, root, transform=None, target_transform=None, cls=None):
    """torchvision's ``name`` as its constructor leaves it, listing ``root``'s files."""
    cls = cls or getattr(D, name)
    ds = cls.__new__(cls)
    VisionDataset.__init__(ds, root, transform=transform, target_transform=target_transform)
    samples = D.ImageFolder(root).samples
    names = cls.__getitem__.__code__.co_names
    if "_image_files" in names:
        ds._image_files, ds._labels = [p for p, _ in samples], [t for _, t in samples]
    elif "imgs" in names:                                       # Places365
        ds.imgs, ds.targets = list(samples), [t for _, t in samples]
    elif "_images" in names:                                    # OxfordIIITPet
        ds._images, ds._labels = [p for p, _ in samples], [t for _, t in samples]
        ds._bin_labels, ds._segs, ds._target_types = [t % 2 for _, t in samples], [], ["category"]
    else:
        ds._samples = list(samples)
    if "loader" in names:
        ds.loader = torchvision.datasets.folder.default_loader
    return ds


def batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def equal(a, b):
    return len(a) == len(b) and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))


EVAL = T.Compose([T.Resize(40), T.CenterCrop(32), T.ToTensor(), T.Normalize([0.5] * 3, [0.25] * 3)])


@pytest.mark.parametrize("name", NAMES)
def test_each_is_read_as_raw_bytes_and_gives_torchs_batches(photos, name):
    ds = listed(name, photos, EVAL)
    L = coordl.DataLoader(ds, batch_size=8)
    s = L.stats()
    assert s.path == "coordl" and s.path_reason.startswith(f"torchvision's {name} read as raw file bytes"), s
    assert f"TorchvisionFolder(torchvision {name})" in repr(L.dataset)
    assert equal(batches(L), batches(torch.utils.data.DataLoader(ds, batch_size=8)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_training_draws_as_the_folder_of_the_same_files(photos, num_workers):
    tf = T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.ColorJitter(0.3, 0.3, 0.3), T.ToTensor()])
    kw = dict(batch_size=6, shuffle=True, seed=9, num_workers=num_workers)
    got = batches(coordl.DataLoader(listed("Food101", photos, tf), **kw))
    assert equal(got, batches(coordl.DataLoader(D.ImageFolder(photos, transform=tf), **kw)))


class _OtherDTD(VisionDataset):
    """A torchvision whose DTD reads more than the one coordl knows."""

    def __getitem__(self, idx):
        image = self.loader(self._image_files[idx]).crop((0, 0, 8, 8))
        return self.transform(image), self.target_transform(self._labels[idx])

    def __len__(self):
        return len(self._image_files)


_OtherDTD.__name__ = _OtherDTD.__qualname__ = "DTD"
_OtherDTD.__module__ = "torchvision.datasets.dtd"


class _OlderFood101(VisionDataset):
    """Food101 as torchvision wrote it before its loader argument: PIL's
    open and convert("RGB") (what ``default_loader`` does)."""

    def __getitem__(self, idx):
        image_file, label = self._image_files[idx], self._labels[idx]
        image = PIL.Image.open(image_file).convert("RGB")
        if self.transform:
            image = self.transform(image)
        if self.target_transform:
            label = self.target_transform(label)
        return image, label

    def __len__(self):
        return len(self._image_files)


_OlderFood101.__name__ = _OlderFood101.__qualname__ = "Food101"
_OlderFood101.__module__ = "torchvision.datasets.food101"


def test_an_older_torchvisions_pil_decode_is_read_as_raw_bytes_too(photos):
    ds = listed("Food101", photos, EVAL, cls=_OlderFood101)
    L = coordl.DataLoader(ds, batch_size=8, num_workers=2)
    assert L.stats().path == "coordl", L.stats().path_reason
    assert equal(batches(L), batches(torch.utils.data.DataLoader(ds, batch_size=8)))


@pytest.mark.parametrize("name", ["Places365", "OxfordIIITPet"])
def test_a_joint_transforms_is_read_as_the_standard_transform_it_is(photos, name):
    """Places365 and OxfordIIITPet apply ``self.transforms`` (the
    StandardTransform torchvision makes of transform and target_transform):
    a transform assigned to ``transform`` afterwards is not theirs, one
    assigned to ``transforms`` is, at the next pass."""
    ds = listed(name, photos, EVAL, target_transform=lambda t: t + 100)
    L = coordl.DataLoader(ds, batch_size=8)
    assert L.stats().path == "coordl"
    assert equal(batches(L), batches(torch.utils.data.DataLoader(ds, batch_size=8)))
    ds.transform = T.Compose([T.Resize(20), T.CenterCrop(16), T.ToTensor()])      # not applied by the dataset
    assert equal(batches(L), batches(torch.utils.data.DataLoader(ds, batch_size=8)))
    ds.transforms = torchvision.datasets.vision.StandardTransform(ds.transform, None)
    got = batches(L)
    assert got[0][0].shape[-1] == 16 and equal(got, batches(torch.utils.data.DataLoader(ds, batch_size=8)))


def test_pets_other_targets_and_joint_transforms_stay_on_torchs_machinery(photos):
    ds = listed("OxfordIIITPet", photos, EVAL)
    ds._target_types = ["binary-category"]
    L = coordl.DataLoader(ds, batch_size=8)
    assert L.stats().path == "coordl"
    assert equal(batches(L), batches(torch.utils.data.DataLoader(ds, batch_size=8)))
    ds._target_types = ["category", "segmentation"]
    s = coordl.DataLoader(ds, batch_size=8).stats()
    assert s.path == "torch" and "target_types ['category', 'segmentation'] are not one class index" in s.path_reason
    ds = listed("Places365", photos)
    ds.transforms = lambda image, target: (EVAL(image), target)
    s = coordl.DataLoader(ds, batch_size=8).stats()
    assert s.path == "torch" and "take the image and the target together" in s.path_reason


class _Falsy:
    """A transform that tests false (``len() == 0``): the datasets that test
    theirs by truth (``if self.transform:``) never call it."""

    def __len__(self):
        return 0

    def __call__(self, x):
        raise AssertionError("called")


def test_a_falsy_transform_is_not_run_where_torchvision_tests_it_by_truth(photos):
    ds = listed("Food101", photos, _Falsy(), _Falsy())
    L = coordl.DataLoader(ds, batch_size=None)
    assert L.stats().path == "coordl"
    for (a, ya), (b, yb) in zip(L, torch.utils.data.DataLoader(ds, batch_size=None)):
        assert np.array_equal(np.asarray(a), np.asarray(b)) and ya == yb


def test_what_coordl_cannot_prove_equivalent_stays_on_torchs_machinery(photos):
    class Own(D.Food101):
        def __getitem__(self, i):
            return super().__getitem__(i)

    s = coordl.DataLoader(listed("Food101", photos, EVAL, cls=Own), batch_size=4).stats()
    assert s.path == "torch" and "Own overrides __getitem__" in s.path_reason
    ds = listed("Flowers102", photos, EVAL)
    ds.loader = lambda path: torchvision.datasets.folder.pil_loader(path).convert("L")
    s = coordl.DataLoader(ds, batch_size=4).stats()
    assert s.path == "torch" and "is not torchvision's default_loader/pil_loader" in s.path_reason
    # another torchvision's, whose __getitem__ reads something else
    s = coordl.DataLoader(listed("DTD", photos, EVAL, cls=_OtherDTD), batch_size=4).stats()
    assert s.path == "torch" and "DTD.__getitem__ reads loader, _image_files, crop" in s.path_reason
    # a Subset of one that reads on coordl's pipeline reads on it too (coordl.subsets); of one that does not, not
    part = torch.utils.data.Subset(listed("GTSRB", photos, EVAL), [1, 2, 3])
    s = coordl.DataLoader(part, batch_size=4).stats()
    assert s.path == "coordl" and s.path_reason.startswith("a Subset of torchvision's GTSRB read as raw file bytes")
    part = torch.utils.data.Subset(listed("Food101", photos, EVAL, cls=Own), [1, 2, 3])
    s = coordl.DataLoader(part, batch_size=4).stats()
    assert s.path == "torch" and "a Subset of Own, which runs on torch's machinery: " in s.path_reason
    assert "Own overrides __getitem__" in s.path_reason
