"""torch's ``Subset`` and ``random_split``'s parts of a two-stage dataset
(coordl's folders, torchvision's read as one) run on coordl's pipeline:
torch's batches where the transforms draw nothing, the same draws with any
number of workers, resume, the node cache, the device stages, sharing, and
a transform changed on the dataset inside followed, as under torch."""
import os
import sys

import pytest
import torch
from torch.utils.data import Subset, random_split

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _resume_check import whole_and_resumed  # noqa: E402
from _torchvision import import_torchvision  # noqa: E402

import coordl  # noqa: E402
from coordl import transforms as T  # noqa: E402
from coordl.subsets import TwoStageSubset  # noqa: E402

tv = import_torchvision()


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("subsets", num_images=30, num_classes=3, mean_kb=3, image_size=(48, 64), seed=5)


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def _random(size=16):
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.PILToTensor()])


@pytest.mark.skipif(tv is None, reason="torchvision is not installed")
@pytest.mark.parametrize("workers", [0, 2])
def test_random_split_parts_of_torchvisions_folder_give_torchs_batches(photos, workers):
    from torchvision import datasets as D
    from torchvision import transforms as V1

    ds = D.ImageFolder(photos, transform=V1.Compose([V1.Resize(20), V1.CenterCrop((16, 18)), V1.ToTensor()]))
    parts = random_split(ds, [0.7, 0.3], generator=torch.Generator().manual_seed(0))
    for part in parts:
        L = coordl.DataLoader(part, batch_size=4, num_workers=workers)
        want = list(torch.utils.data.DataLoader(part, batch_size=4))
        assert _same(list(L), want)
        assert isinstance(L.dataset, Subset) and L.dataset.indices is part.indices and len(L.dataset) == len(part)
        reason = L.stats().path_reason
        assert L.stats().path == "coordl" and reason.startswith("a Subset of torchvision's ImageFolder read as raw "
                                                                "file bytes"), reason
        assert L.dataset[1][1] == part[1][1] and torch.equal(L.dataset[1][0], part[1][0])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_subset_of_coordls_folder_draws_the_same_with_any_workers_and_resumes(photos, workers):
    ds = coordl.ImageFolder(photos, transform=_random())
    idx = [3, 0, 29, -1, 7, 12, 12, 5, 20, 1, 2]
    sub = Subset(ds, idx)
    ref = coordl.DataLoader(sub, batch_size=3, shuffle=True, seed=4)
    want = list(ref)
    assert isinstance(ref.dataset, TwoStageSubset) and ref.stats().path == "coordl"
    assert sorted(torch.cat([y for _, y in want]).tolist()) == sorted(ds.targets[i] for i in idx)
    whole, resumed = whole_and_resumed(lambda seed=4: coordl.DataLoader(sub, batch_size=3, shuffle=True, seed=seed,
                                                                        num_workers=workers), 2)
    assert _same(whole, want) and _same(resumed, want)
    assert ref.dataset.describe(3) == ds.describe(29)


def test_a_subset_of_a_subset_and_its_errors(photos):
    ds = coordl.ImageFolder(photos, transform=_random())
    by_tensor = coordl.DataLoader(Subset(ds, torch.tensor([5, 2, 9])), batch_size=3, seed=1)   # indices as a tensor
    assert isinstance(by_tensor.dataset, TwoStageSubset) and next(iter(by_tensor))[1].tolist() == \
        [ds.targets[5], ds.targets[2], ds.targets[9]]
    assert len(list(by_tensor)) == 1        # the next pass's check reads the tensor too
    inner = Subset(ds, list(range(10, 30)))
    L = coordl.DataLoader(Subset(inner, [0, 19, 5]), batch_size=3, seed=1)
    (x, y), = list(L)
    assert y.tolist() == [ds.targets[10], ds.targets[29], ds.targets[15]]
    assert L.dataset.describe(1) == ds.describe(29)
    # indices out of range are torch's error when the sample is read, as under torch
    bad = coordl.DataLoader(Subset(ds, [0, 30]), batch_size=2)
    assert bad.stats().path == "torch" and "indices" in bad.stats().path_reason
    with pytest.raises(IndexError):
        list(bad)


def test_a_subsets_node_cache_is_its_own(photos):
    ds = coordl.ImageFolder(photos, transform=_random())
    sub = TwoStageSubset(ds, [4, 5, 6, 7, 8, 9])
    assert sub.fingerprint() != ds.fingerprint() and sub.fingerprint() == TwoStageSubset(ds, range(4, 10)).fingerprint()
    assert sub.fingerprint() != TwoStageSubset(ds, [5, 4, 6, 7, 8, 9]).fingerprint()
    assert list(sub.sizes) == list(ds.sizes[4:10])
    L = coordl.DataLoader(Subset(ds, [4, 5, 6, 7, 8, 9]), batch_size=2, seed=0, cache_size="8MiB")
    first = list(L)
    list(L)
    st = L.stats()
    assert st.epochs[0].samples_from_cache == 0 and st.epochs[1].samples_from_cache == 6
    assert _same(first, list(coordl.DataLoader(sub, batch_size=2, seed=0)))
    del L


@pytest.mark.parametrize("workers", [0, 2])
def test_the_device_stages_run_over_a_subset(photos, cpu_device, exact, workers):
    norm = T.Normalize([0.5] * 3, [0.25] * 3)
    ds = coordl.ImageFolder(photos, transform=T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(),
                                                         T.ToTensor(), norm]))
    sub = Subset(ds, list(range(0, 30, 3)))
    kw = dict(batch_size=4, seed=2, num_workers=workers)
    host = list(coordl.DataLoader(sub, **kw))
    split = coordl.DataLoader(sub, device="cpu", **kw)
    assert _same(list(split), host) and split.stats().device_split.startswith("split")
    dev = coordl.DataLoader(sub, device="cpu", decode="device", **kw)
    got = list(dev)
    assert len(got) == len(host) and dev.stats().device_decode_images == len(sub)
    for (a, y), (b, y2) in zip(got, host):
        assert torch.equal(y, y2) and float(((a - b) * 0.25 * 255).abs().max()) <= 1 + 1e-3
    assert ds.transform.transforms[-1] is norm    # the user's dataset is never modified


@pytest.mark.skipif(tv is None, reason="torchvision is not installed")
@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_changed_on_the_dataset_inside_is_followed(photos, workers):
    from torchvision import datasets as D
    from torchvision import transforms as V1

    ds = D.ImageFolder(photos, transform=V1.Compose([V1.Resize((16, 16)), V1.ToTensor()]))
    part = Subset(ds, list(range(1, 30, 2)))
    L = coordl.DataLoader(part, batch_size=5, num_workers=workers)
    T_ = torch.utils.data.DataLoader(part, batch_size=5, num_workers=workers)
    shapes = []
    for loader in (T_, L):
        ds.transform = V1.Compose([V1.Resize((16, 16)), V1.ToTensor()])
        s = [next(iter(loader))[0].shape[-2:]]
        ds.transform = V1.Compose([V1.Resize((10, 12)), V1.ToTensor()])
        s.append(next(iter(loader))[0].shape[-2:])
        ds.transform.transforms[0].size = (8, 6)
        s.append(next(iter(loader))[0].shape[-2:])
        shapes.append(s)
    assert shapes[0] == [(16, 16), (10, 12), (8, 6)] and shapes[1] == shapes[0], shapes
    assert _same(list(L), list(T_))
    assert L.stats().path_reason.startswith("a Subset of torchvision's ImageFolder read as raw file bytes"), \
        L.stats().path_reason


def test_shared_prep_serves_a_subset(photos, daemon_env):
    import warnings

    ds = coordl.ImageFolder(photos, transform=_random())
    sub = Subset(ds, list(range(2, 30)))
    want = [list(coordl.DataLoader(sub, batch_size=4, seed=9)) for _ in range(1)][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        L = coordl.DataLoader(sub, batch_size=4, seed=9, share=True)
        got = list(L)
    assert _same(got, want) and L.stats().samples_shared >= len(sub) - 1


# ---------------------------------------------------------------- ConcatDataset
@pytest.fixture(scope="module")
def more_photos(photo_folder):
    return photo_folder("subsets2", num_images=12, num_classes=3, mean_kb=3, image_size=(40, 56), seed=6)


@pytest.mark.skipif(tv is None, reason="torchvision is not installed")
@pytest.mark.parametrize("workers", [0, 2])
def test_a_concat_of_folders_gives_torchs_batches_and_follows_each_parts_transform(photos, more_photos, workers):
    from torch.utils.data import ConcatDataset
    from torchvision import datasets as D
    from torchvision import transforms as V1

    a = D.ImageFolder(photos, transform=V1.Compose([V1.Resize((16, 16)), V1.ToTensor()]))
    b = coordl.ImageFolder(more_photos, transform=T.Compose([T.Resize((16, 16)), T.ToTensor()]))
    cat = ConcatDataset([a, Subset(b, [0, 11, 3, 4])])
    L = coordl.DataLoader(cat, batch_size=5, num_workers=workers)
    T_ = torch.utils.data.DataLoader(cat, batch_size=5, num_workers=workers)
    assert _same(list(L), list(T_)) and len(L.dataset) == 34 and L.dataset.describe(31) == b.describe(11)
    assert isinstance(L.dataset, ConcatDataset) and L.stats().path == "coordl"
    a.transform = V1.Compose([V1.Resize((10, 12)), V1.ToTensor()])     # the first part's, as under torch
    b.transform = T.Compose([T.Resize((10, 12)), T.ToTensor()])
    assert _same(list(L), list(T_))
    a.transform.transforms[0].size = (8, 6)
    b.transform.transforms[0].size = (8, 6)
    got = list(L)
    assert _same(got, list(T_)) and got[0][0].shape[-2:] == (8, 6)


def test_a_concat_draws_resumes_and_caches_as_one_dataset(photos, more_photos, cpu_device):
    from torch.utils.data import ConcatDataset

    a = coordl.ImageFolder(photos, transform=_random())
    b = coordl.ImageFolder(more_photos, transform=_random(12))
    cat = ConcatDataset([a, b, a])
    kw = dict(batch_size=8, shuffle=True, seed=5, collate_fn=lambda s: s)     # the parts' sizes differ
    want = list(coordl.DataLoader(cat, **kw))
    assert sorted(y for batch in want for _, y in batch) == sorted(a.targets * 2 + b.targets)
    _, got = whole_and_resumed(lambda seed=5: coordl.DataLoader(cat, num_workers=2, **{**kw, "seed": seed}), 3)
    assert len(got) == len(want) and all(
        len(x) == len(y) and all(torch.equal(p[0], q[0]) and p[1] == q[1] for p, q in zip(x, y)) for x, y in zip(got, want))
    C = coordl.DataLoader(cat, batch_size=8, seed=5, collate_fn=lambda s: s, cache_size="8MiB")
    list(C)
    list(C)
    assert C.stats().epochs[1].samples_from_cache == len(cat)
    assert C.dataset.fingerprint() != coordl.DataLoader(ConcatDataset([a, b]), batch_size=8).dataset.fingerprint()
    assert list(C.dataset.sizes) == list(a.sizes) + list(b.sizes) + list(a.sizes)
    del C
    D = coordl.DataLoader(ConcatDataset([a, a]), batch_size=4, seed=5, device="cpu")
    assert _same(list(D), list(coordl.DataLoader(ConcatDataset([a, a]), batch_size=4, seed=5)))
    assert D.stats().device_split.startswith("not split (a ConcatDataset")
    with pytest.raises(ValueError, match="a ConcatDataset, whose parts each run their own"):
        coordl.DataLoader(cat, batch_size=4, device="cpu", decode="device")
    bad = coordl.DataLoader(ConcatDataset([a, torch.utils.data.TensorDataset(torch.arange(3))]), batch_size=4)
    assert bad.stats().path == "torch"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_subset_or_folder_changed_after_the_loader_was_made_is_an_error_not_a_stale_pass(photos, workers):
    """Under torch the next pass reads a Subset's indices (or a folder's
    samples) as they are then; coordl read them when the loader was made,
    so a change says so instead of delivering what no longer is."""
    ds = coordl.ImageFolder(photos, transform=_random())
    labeled = Subset(ds, [0, 1, 2, 3])
    L = coordl.DataLoader(labeled, batch_size=2, seed=1, num_workers=workers)
    assert len(list(L)) == 2
    labeled.indices[0] = 0          # the same indices: fine
    assert len(list(L)) == 2
    labeled.indices.extend([7, 8])  # an active-learning round grows its labeled set in place
    with pytest.raises(ValueError, match=r"indices of the Subset given to this DataLoader changed .*\(4 samples then, "
                                         r"6 now\).*make a new DataLoader"):
        iter(L)
    assert len(list(coordl.DataLoader(labeled, batch_size=2, seed=1, num_workers=workers))) == 3
    if tv is not None:
        from torchvision import datasets as D

        folder = D.ImageFolder(photos)
        L = coordl.DataLoader(folder, batch_size=4, collate_fn=lambda s: s)
        folder.samples = folder.samples[:10]
        with pytest.raises(ValueError, match="ImageFolder given to this DataLoader has 10 samples now, 30 when"):
            iter(L)
