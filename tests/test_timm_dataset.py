"""timm's ``ImageDataset`` (what ``timm.data.create_dataset`` makes of a
folder) on coordl's pipeline: read as raw bytes and decoded by coordl, its
transforms fused as torchvision's are, timm's skip of a file it cannot
open kept; other readers stay on torch's machinery."""
import logging
import os
import shutil
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _collate_helpers import written  # noqa: E402
from _torchvision import import_torchvision  # noqa: E402

if import_torchvision() is None:
    pytest.skip("torchvision is not installed (pip install coordl[test])", allow_module_level=True)
timm = pytest.importorskip("timm", reason="timm is not installed (pip install timm)")

from timm.data import create_dataset, create_loader, create_transform  # noqa: E402
from timm.data.dataset import ImageDataset  # noqa: E402
from timm.data.readers.reader import Reader  # noqa: E402
from torchvision import datasets as D  # noqa: E402

import coordl  # noqa: E402
from coordl.timmcompat import TimmImageFolder  # noqa: E402

# timm's own dataset, read here as the reference, leaves each file it opened to the garbage collector
pytestmark = [pytest.mark.filterwarnings("ignore:Exception ignored in. <_io.FileIO:pytest.PytestUnraisableExceptionWarning"),
              pytest.mark.filterwarnings("ignore:unclosed file:ResourceWarning")]


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("timm_ds", num_images=30, num_classes=3, mean_kb=3, image_size=(64, 48), seed=11)


def timm_folder(root, **kw):
    return create_dataset("", root=root, split="", **kw)


def same_samples_folder(ds, transform):
    """torchvision's ImageFolder over timm's dataset's samples, in timm's order."""
    tv = D.ImageFolder(ds.reader.root, transform=transform)
    tv.samples = tv.imgs = list(ds.reader.samples)
    tv.targets = [t for _, t in tv.samples]
    return tv


def batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def equal(a, b):
    return len(a) == len(b) and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_timms_eval_recipe_is_timms_own_batches_on_coordls_pipeline(photos, num_workers):
    ds = timm_folder(photos)
    ds.transform = create_transform(40, is_training=False)
    L = coordl.DataLoader(ds, batch_size=8, num_workers=num_workers)
    assert L.stats().path == "coordl", L.stats().path_reason
    assert L.stats().path_reason.startswith("timm's ImageDataset read as raw file bytes, decoded by coordl; fused")
    assert isinstance(L.dataset, TimmImageFolder)
    want = batches(torch.utils.data.DataLoader(ds, batch_size=8))
    assert equal(batches(L), want)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kw", [{}, {"auto_augment": "rand-m9-mstd0.5-inc1", "re_prob": 0.25},
                                {"interpolation": "random", "color_jitter": 0.4}], ids=["default", "ra", "jitter"])
def test_timms_train_recipe_draws_as_torchvisions_folder_of_the_same_samples(photos, num_workers, kw):
    """Training draws from (seed, epoch, index): coordl over timm's dataset
    gives what coordl gives over torchvision's folder of the same files in
    the same order (whose pixels tests/test_timm.py checks against timm's
    own transforms)."""
    ds = timm_folder(photos, is_training=True)
    ds.transform = create_transform(40, is_training=True, **kw)
    tv = same_samples_folder(ds, ds.transform)
    a = coordl.DataLoader(ds, batch_size=8, shuffle=True, seed=5, num_workers=num_workers, drop_last=True)
    b = coordl.DataLoader(tv, batch_size=8, shuffle=True, seed=5, num_workers=num_workers, drop_last=True)
    assert a.stats().path == "coordl"
    assert a.stats().path_reason.split("; ", 1)[1] == b.stats().path_reason.split("; ", 1)[1]
    for _ in range(2):
        assert equal(batches(a), batches(b))


def test_timms_create_loader_runs_on_coordl_when_torchs_dataloader_is_coordls(photos, monkeypatch):
    """timm's own ``create_loader`` (its prefetcher's ``fast_collate`` and
    uint8 samples) looks ``torch.utils.data.DataLoader`` up when called."""
    ds = timm_folder(photos)
    want = [x for x, _ in create_loader(ds, input_size=(3, 32, 32), batch_size=8, device=torch.device("cpu"))]
    monkeypatch.setattr(torch.utils.data, "DataLoader", coordl.DataLoader)
    loader = create_loader(ds, input_size=(3, 32, 32), batch_size=8, num_workers=2, device=torch.device("cpu"))
    assert isinstance(loader.loader, coordl.DataLoader) and loader.loader.stats().path == "coordl"
    got = [x for x, _ in loader]
    assert len(got) == len(want) and all(torch.equal(p, q) for p, q in zip(got, want))


def _same_batch(a, b):
    assert type(a) is type(b) and len(a) == len(b), (type(a), type(b))
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (x.dtype, y.dtype)


def test_fast_collates_batch_of_uint8_images_and_class_indices_is_laid_out_in_place():
    """timm's ``fast_collate`` of (uint8 image, class index) samples is a
    tuple of the images stacked and the indices as int64: the in-place
    layout builds that tuple; other samples have no such layout."""
    from timm.data.loader import fast_collate

    from coordl.pipeline import collate as C

    assert C.is_fast_collate(fast_collate) and not C.is_fast_collate(None) and not C.is_fast_collate(lambda b: b)
    rng = np.random.default_rng(0)
    for img, label in ((lambda r: rng.integers(0, 256, (3, 5, 4), dtype=np.uint8), lambda r: r),
                       (lambda r: torch.randint(0, 256, (3, 5, 4), dtype=torch.uint8), lambda r: np.int64(r))):
        samples = [(img(r), label(r)) for r in range(3)]
        lay, _, targets = written(samples, (1, 2, 0), pair=True)
        _same_batch(C.build(lay.template, targets), fast_collate(samples))
        assert lay.leaves_of([samples[0][0], 1]) is None            # a list: fast_collate asserts a tuple
    img = np.zeros((3, 5, 4), np.uint8)
    for other in ((img.astype(np.float32), 1), ((img, img), 1), (img, True), (img, 1.0), (img, np.int32(1)),
                  [img, 1], (img, 1, "path"), (torch.zeros(2, dtype=torch.uint8), torch.tensor(1))):
        assert C.layout_of(other, 3, pair=True) is None, other


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fast_collate_batches_are_timms_own_and_collated_in_place(photos, num_workers, monkeypatch):
    """``coordl.DataLoader(ds, collate_fn=fast_collate)`` over timm's
    dataset with its prefetcher's transform (uint8 arrays): the eval
    batches are what timm's own loader collates, bit for bit, each built
    from a slot in the main process (no second copy of the images)."""
    from timm.data.loader import fast_collate

    from coordl.pipeline import collate as C

    tf = create_transform(32, is_training=False, use_prefetcher=True)
    want = list(torch.utils.data.DataLoader(timm_folder(photos, transform=tf), batch_size=8,
                                            collate_fn=fast_collate))
    built = []
    monkeypatch.setattr(C, "build", lambda *a, _b=C.build: built.append(1) or _b(*a))
    got = list(coordl.DataLoader(timm_folder(photos, transform=tf), batch_size=8, num_workers=num_workers,
                                 collate_fn=fast_collate))
    assert len(got) == len(want) == len(built) == 4
    for a, b in zip(got, want):
        _same_batch(a, b)


def _half(t):
    return t / 2


def _half_odd(t):
    return t / 2 if t % 2 else t


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fast_collate_of_other_samples_runs_as_written(photos, num_workers):
    """Samples whose layout is not fast_collate's (a label that is a float,
    in every sample or from one sample on) are collated by timm's function
    itself: its batches, as under torch."""
    from timm.data.loader import fast_collate

    tf = create_transform(32, is_training=False, use_prefetcher=True)
    for target in (_half, _half_odd):
        want = list(torch.utils.data.DataLoader(timm_folder(photos, transform=tf, target_transform=target),
                                                batch_size=8, collate_fn=fast_collate))
        L = coordl.DataLoader(timm_folder(photos, transform=tf, target_transform=target), batch_size=8,
                              num_workers=num_workers, collate_fn=fast_collate)
        got = list(L)
        assert L.stats().path == "coordl" and len(got) == len(want) == 4
        for a, b in zip(got, want):
            _same_batch(a, b)


def test_filenames_classes_and_repr_are_timms(photos):
    ds = timm_folder(photos)
    mine = coordl.DataLoader(ds, batch_size=4).dataset
    assert len(mine) == len(ds)
    for kw in ({}, {"basename": True}, {"absolute": True}):
        assert mine.filenames(**kw) == ds.filenames(**kw)
        assert mine.filename(7, **kw) == ds.filename(7, **kw)
    assert mine.class_to_idx == ds.reader.class_to_idx
    assert [mine.class_to_idx[c] for c in mine.classes] == list(range(len(mine.classes)))
    assert "TimmImageFolder(timm ImageDataset)" in repr(mine)


@pytest.mark.parametrize("kw", [{"input_img_mode": "L"}, {"input_img_mode": None}, {"load_bytes": True}],
                         ids=["gray", "no-mode", "bytes"])
def test_other_modes_run_the_transform_as_written_on_what_timm_gives_it(photos, kw):
    seen = []

    def tf(x):
        seen.append(type(x).__name__)
        if isinstance(x, bytes):
            return torch.tensor(len(x))
        return torch.tensor(np.asarray(x.resize((4, 3))), dtype=torch.int64)

    ds = ImageDataset(photos, transform=tf, **kw)
    L = coordl.DataLoader(ds, batch_size=5)
    assert L.stats().path == "coordl" and "its transform as written" in L.stats().path_reason
    want = batches(torch.utils.data.DataLoader(ds, batch_size=5))
    assert equal(batches(L), want)
    assert set(seen) == {"bytes"} if kw.get("load_bytes") else {"Image", "JpegImageFile"} >= set(seen)


def _spoil(root, names, how):
    for name in names:
        path = os.path.join(root, name)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 3] if how == "truncated" else b"not an image at all")


@pytest.mark.parametrize("how", ["garbage", "truncated"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_file_timm_cannot_open_is_skipped_for_the_next_as_timm_does(photos, tmp_path, how, num_workers, caplog):
    root = str(tmp_path / "photos")
    shutil.copytree(photos, root)
    ds = timm_folder(root)
    ds.transform = create_transform(32, is_training=False)
    bad = [3, 4, len(ds) - 1]             # two in a row, and the last one (whose next is the first)
    _spoil(root, [ds.filename(i) for i in bad], how)
    def skipped():
        return [r.getMessage().split(".")[0] for r in caplog.records if r.name == "timm.data.dataset"]

    with caplog.at_level(logging.WARNING, logger="timm.data.dataset"):
        want = batches(torch.utils.data.DataLoader(ds, batch_size=6))
        timms = skipped()
        caplog.clear()
        got = batches(coordl.DataLoader(ds, batch_size=6, num_workers=num_workers))
    assert torch.equal(want[0][0][3], want[0][0][5]) and torch.equal(want[-1][0][-1], want[0][0][0])
    assert equal(got, want)
    # sample 3 tried 3 and 4, sample 4 tried 4, sample 29 tried 29: each logged, as timm logs it
    assert timms == ["Skipped sample (index 3)", "Skipped sample (index 4)", "Skipped sample (index 4)",
                     "Skipped sample (index 29)"]
    if num_workers == 0:     # (workers log in their own processes)
        # the same records; their order is that of the prep, which takes samples as their reads complete (a
        # read that finishes late, under load, puts its sample's records after those of the samples behind it)
        assert sorted(skipped()) == sorted(timms)


def test_more_bad_files_in_a_row_than_timm_retries_fail_as_timms(photos, tmp_path):
    root = str(tmp_path / "photos")
    shutil.copytree(photos, root)
    ds = timm_folder(root)
    ds.transform = create_transform(32, is_training=False)
    ds._max_retries = 3
    _spoil(root, [ds.filename(i) for i in (6, 7, 8)], "garbage")
    with pytest.raises(RuntimeError, match="Failed to load 3 consecutive samples"):
        ds[6]
    with pytest.raises(RuntimeError, match="Failed to load 3 consecutive samples"):
        list(coordl.DataLoader(ds, batch_size=4))
    ds._max_retries = 4       # the fourth try opens sample 9
    assert equal(batches(coordl.DataLoader(ds, batch_size=4)), batches(torch.utils.data.DataLoader(ds, batch_size=4)))


def test_decode_on_the_device_takes_timms_dataset(photos, cpu_device):
    ds = timm_folder(photos, is_training=True)
    ds.transform = create_transform(32, is_training=True)
    tv = same_samples_folder(ds, ds.transform)
    kw = dict(batch_size=8, seed=2, device="cpu", decode="device")
    a = coordl.DataLoader(ds, **kw)
    assert equal(batches(a), batches(coordl.DataLoader(tv, **kw)))
    assert a.stats().device_decode_images == len(ds)


def test_what_coordl_cannot_read_as_files_stays_on_torchs_machinery(photos, tmp_path):
    class Own(ImageDataset):
        def __getitem__(self, i):
            return super().__getitem__(i)

    L = coordl.DataLoader(Own(photos), batch_size=4)
    assert L.stats().path == "torch" and "Own overrides __getitem__" in L.stats().path_reason
    class Listed(Reader):          # not a folder of files: a tar file, Hugging Face, TFDS, WebDataset...
        def __init__(self, samples):
            super().__init__()
            self.samples = samples

        def __getitem__(self, i):
            return open(self.samples[i][0], "rb"), self.samples[i][1]

        def __len__(self):
            return len(self.samples)

    listed = ImageDataset(photos, reader=Listed(timm_folder(photos).reader.samples[:8]), transform=lambda x: 0)
    L = coordl.DataLoader(listed, batch_size=4)
    assert L.stats().path == "torch" and "reads through Listed, not a folder" in L.stats().path_reason
    assert [b[0].tolist() for b in L] == [[0] * 4] * 2
    old = ImageDataset(photos)
    del old._max_retries
    L = coordl.DataLoader(old, batch_size=4)
    assert L.stats().path == "torch" and "_max_retries" in L.stats().path_reason


def test_a_transform_assigned_after_the_loader_is_made_runs_at_the_next_pass(photos):
    ds = timm_folder(photos)
    ds.transform = create_transform(32, is_training=False)
    L = coordl.DataLoader(ds, batch_size=10)
    assert next(iter(L))[0].shape[-1] == 32
    ds.transform = create_transform(24, is_training=False)
    assert equal(batches(L), batches(torch.utils.data.DataLoader(ds, batch_size=10)))


def test_jobs_sharing_prep_get_what_they_get_alone(photos, daemon_env):
    # a transform coordl translates whole: the daemon's workers then unpickle it without torchvision, whose
    # wheel imports only beside torch's CUDA build (tests/_torchvision.py)
    def make():
        ds = timm_folder(photos)
        ds.transform = create_transform(32, is_training=False)
        return ds

    alone = batches(coordl.DataLoader(make(), batch_size=8, seed=4))
    L = coordl.DataLoader(make(), batch_size=8, seed=4, share=True)
    assert equal(batches(L), alone)
    assert L.stats().samples_shared > 0, L.stats()


def test_jobs_sharing_prep_with_fast_collate_get_timms_batches_in_place(photos, daemon_env, monkeypatch):
    """timm's prefetcher recipe with share=True: the staged samples are
    collated in place as fast_collate collates them (a tuple of uint8
    images and int64 indices), the batches those of share=False."""
    from timm.data.loader import fast_collate

    from coordl.pipeline import collate as C

    def make():
        return timm_folder(photos, transform=create_transform(32, is_training=False, use_prefetcher=True))

    alone = list(coordl.DataLoader(make(), batch_size=8, seed=4, collate_fn=fast_collate))
    built = []
    monkeypatch.setattr(C, "build", lambda *a, _b=C.build: built.append(1) or _b(*a))
    L = coordl.DataLoader(make(), batch_size=8, seed=4, share=True, collate_fn=fast_collate)
    got = list(L)
    assert len(got) == len(alone) == len(built) == 4 and L.stats().samples_shared > 0, L.stats()
    for a, b in zip(got, alone):
        _same_batch(a, b)


def test_a_subset_of_timms_dataset_reads_on_coordls_pipeline(photos):
    ds = timm_folder(photos, transform=create_transform(16, is_training=False))
    part, _ = torch.utils.data.random_split(ds, [10, len(ds) - 10], generator=torch.Generator().manual_seed(0))
    L = coordl.DataLoader(part, batch_size=4)
    s = L.stats()
    assert s.path == "coordl" and s.path_reason.startswith("a Subset of timm's ImageDataset"), s
    assert equal(batches(L), batches(torch.utils.data.DataLoader(part, batch_size=4)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pass_resumed_mid_epoch_delivers_the_rest_exactly(photos, num_workers):
    def make():
        ds = timm_folder(photos, is_training=True)
        ds.transform = create_transform(32, is_training=True, color_jitter=0.4)
        return coordl.DataLoader(ds, batch_size=4, shuffle=True, seed=6, num_workers=num_workers)

    whole = batches(make())
    a = make()
    it = iter(a)
    head = [(x.clone(), y.clone()) for x, y in (next(it), next(it), next(it))]
    state = a.state_dict()
    del it
    b = make()
    b.load_state_dict(state)
    assert equal(head + batches(b), whole)


# -- timm's AugMixDataset (train.py --aug-splits N): several views of each sample ----------------------------

def augmix_folder(root, splits=3, size=32, **kw):
    from timm.data import AugMixDataset

    mix = AugMixDataset(timm_folder(root, is_training=True), num_splits=splits)
    mix.transform = create_transform(size, is_training=True, separate=True, **kw)
    return mix


def view_batches(loader):
    return [([v.clone() for v in x], y.clone()) for x, y in loader]


def views_equal(a, b):
    return len(a) == len(b) and all(len(p[0]) == len(q[0]) and all(torch.equal(u, v) for u, v in zip(p[0], q[0]))
                                    and torch.equal(p[1], q[1]) for p, q in zip(a, b))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_timms_augmix_dataset_runs_on_coordls_pipeline_with_torchs_batch_structure(photos, num_workers):
    mix = augmix_folder(photos, auto_augment="augmix-m3-w3")
    L = coordl.DataLoader(mix, batch_size=8, num_workers=num_workers, seed=3)
    s = L.stats()
    assert s.path == "coordl", s.path_reason
    assert s.path_reason.startswith("timm's AugMixDataset over timm's ImageDataset read as raw file bytes"), s.path_reason
    assert "fused RandomResizedCropAndInterpolation, RandomHorizontalFlip" in s.path_reason
    assert "the clean view and 2 through Compose(AugMixAugment), each through Compose(MaybeToTensor, Normalize)" \
        in s.path_reason, s.path_reason
    got = view_batches(L)
    want = view_batches(torch.utils.data.DataLoader(mix, batch_size=8))
    assert len(got) == len(want)
    for (gx, gy), (wx, wy) in zip(got, want):
        assert type(gx) is type(wx) and len(gx) == len(wx) == 3
        assert [(v.shape, v.dtype) for v in gx] == [(v.shape, v.dtype) for v in wx]
        assert torch.equal(gy, wy)
        assert not torch.equal(gx[0], gx[1]) and not torch.equal(gx[1], gx[2])    # each view drawn apart
    again = coordl.DataLoader(augmix_folder(photos, auto_augment="augmix-m3-w3"), batch_size=8, seed=3,
                              num_workers=2 - num_workers)
    assert views_equal(view_batches(again), got)        # (seed, epoch, index), whatever the workers


def test_timms_augmix_views_are_the_folders_sample_then_its_augmentation(photos):
    """The clean view is what coordl's folder gives with the first transform
    then normalize; a view through an augmentation that draws nothing is
    that folder's sample with the augmentation between them."""
    from torchvision import transforms as V

    mix = augmix_folder(photos)
    first, _, last = create_transform(32, is_training=True, separate=True)
    mix.augmentation = V.Compose([V.Grayscale(3), V.RandomVerticalFlip(1.0)])   # draws nothing
    got = view_batches(coordl.DataLoader(mix, batch_size=6, shuffle=True, seed=8))
    clean = timm_folder(photos, is_training=True)
    clean.transform = V.Compose(list(first.transforms) + list(last.transforms))
    through = timm_folder(photos, is_training=True)
    through.transform = V.Compose(list(first.transforms) + list(mix.augmentation.transforms) + list(last.transforms))
    want0 = batches(coordl.DataLoader(clean, batch_size=6, shuffle=True, seed=8))
    want1 = batches(coordl.DataLoader(through, batch_size=6, shuffle=True, seed=8))
    assert len(got) == len(want0) == len(want1)
    for (x, y), (c, cy), (t, ty) in zip(got, want0, want1):
        assert torch.equal(y, cy) and torch.equal(y, ty)
        assert torch.equal(x[0], c) and torch.equal(x[1], t) and torch.equal(x[2], t)


@pytest.mark.parametrize("aa,splits,uint8", [("augmix-m3-w3", 3, False), ("augmix-m5-w4-d2", 2, True),
                                             ("rand-m9-mstd0.5", 3, False)])
def test_timms_augmix_views_made_from_the_planes_are_its_own_views_of_the_pil_image(photos, aa, splits, uint8):
    """Where its augmentation runs after the fused crop and its normalize is
    a conversion, the views are made from the fused crop's planes (the
    augmentation's steps with coordl's kernels, the conversions coordl's):
    every view of every batch is what the wrapper's own ``__getitem__``
    gives of the PIL image (the same draws in the same order), float or
    uint8 (timm's prefetcher: ``MaybePILToTensor``), with workers or not."""
    from timm.data.transforms import MaybePILToTensor
    from torchvision import transforms as V

    def make(num_workers, planes):
        mix = augmix_folder(photos, splits=splits, auto_augment=aa)
        if uint8:
            mix.normalize = V.Compose([MaybePILToTensor()])
        L = coordl.DataLoader(mix, batch_size=4, shuffle=True, seed=5, num_workers=num_workers)
        assert (L.dataset.views is not None) and "made as it makes them of the fused crop's planes" in \
            L.stats().path_reason, L.stats().path_reason
        if not planes:
            L.dataset.views = None      # the wrapper's __getitem__ as written, on the PIL image
        return L

    want = view_batches(make(0, False))
    assert want[0][0][0].dtype == (torch.uint8 if uint8 else torch.float32)
    assert views_equal(view_batches(make(0, True)), want)
    assert views_equal(view_batches(make(2, True)), want)


def test_a_wrapper_that_makes_its_views_otherwise_runs_as_written(photos):
    """A subclass of timm's ``AugMixDataset`` whose ``_normalize`` does
    more than timm's is checked (once per class) and its ``__getitem__``
    runs as written on the PIL image."""
    from timm.data import AugMixDataset

    from coordl.timmcompat import makes_views_as_timm

    class Brighter(AugMixDataset):
        def _normalize(self, x):
            return super()._normalize(x) + 1.0

    mix = Brighter(timm_folder(photos, is_training=True), num_splits=3)
    mix.transform = create_transform(32, is_training=True, separate=True, auto_augment="augmix-m3-w3")
    assert not makes_views_as_timm(mix) and makes_views_as_timm(augmix_folder(photos))
    L = coordl.DataLoader(mix, batch_size=4, seed=5)
    assert L.stats().path == "coordl" and L.dataset.views is None
    assert "then its own __getitem__ as written" in L.stats().path_reason, L.stats().path_reason
    plain = coordl.DataLoader(augmix_folder(photos, auto_augment="augmix-m3-w3"), batch_size=4, seed=5)
    got, want = view_batches(L), view_batches(plain)
    assert all(torch.equal(x[0], w[0] + 1.0) for (x, _), (w, _) in zip(got, want))    # the clean views


def test_timms_augmix_dataset_in_timms_create_loader_with_its_prefetcher(photos, monkeypatch):
    """timm's train.py with --aug-splits: ``create_loader`` sets the three
    transforms and collates the views with ``fast_collate`` (one batch, the
    views one after another)."""
    from timm.data import AugMixDataset

    monkeypatch.setattr(torch.utils.data, "DataLoader", coordl.DataLoader)
    mix = AugMixDataset(timm_folder(photos, is_training=True), num_splits=2)
    loader = create_loader(mix, input_size=(3, 32, 32), batch_size=6, is_training=True, num_aug_splits=2,
                           num_workers=2, device=torch.device("cpu"))
    assert isinstance(loader.loader, coordl.DataLoader) and loader.loader.stats().path == "coordl", \
        loader.loader.stats().path_reason
    x, y = next(iter(loader))
    assert x.shape == (12, 3, 32, 32) and y.shape == (12,) and torch.equal(y[:6], y[6:])


def test_timms_augmix_dataset_on_the_device(photos, cpu_device):
    mix = augmix_folder(photos)
    with pytest.raises(ValueError, match="runs code of its own on each image after its transform, on the CPU "
                                         "\\(several views"):
        coordl.DataLoader(mix, batch_size=8, device="cpu", decode="device")
    L = coordl.DataLoader(mix, batch_size=8, device="cpu", seed=1)
    got = view_batches(L)
    assert L.stats().device_split.startswith("not split (TimmAugMixFolder's samples are made after its transform, "
                                             "on the CPU (several views")
    assert views_equal(got, view_batches(coordl.DataLoader(augmix_folder(photos), batch_size=8, seed=1)))


def test_timms_augmix_dataset_over_what_coordl_cannot_read_stays_on_torchs_machinery(photos):
    from timm.data import AugMixDataset

    mix = AugMixDataset(D.ImageFolder(photos), num_splits=2)
    mix.transform = create_transform(32, is_training=True, separate=True)
    s = coordl.DataLoader(mix, batch_size=4).stats()
    assert s.path == "torch" and "AugMixDataset: it wraps ImageFolder, not timm's ImageDataset" in s.path_reason

    class Own(AugMixDataset):
        def __getitem__(self, i):
            return super().__getitem__(i)

    s = coordl.DataLoader(Own(timm_folder(photos), num_splits=2), batch_size=4).stats()
    assert s.path == "torch" and "Own overrides __getitem__" in s.path_reason


@pytest.mark.parametrize("num_workers", [0, 2])
def test_timms_augmix_pass_resumed_mid_epoch_delivers_the_rest_exactly(photos, num_workers):
    def make():
        return coordl.DataLoader(augmix_folder(photos, auto_augment="augmix-m3-w3"), batch_size=4, shuffle=True,
                                 seed=6, num_workers=num_workers)

    whole = view_batches(make())
    a = make()
    it = iter(a)
    head = [([v.clone() for v in x], y.clone()) for x, y in (next(it), next(it), next(it))]
    state = a.state_dict()
    del it
    b = make()
    b.load_state_dict(state)
    assert views_equal(head + view_batches(b), whole)


def test_timms_augmix_jobs_sharing_prep_get_what_they_get_alone(photos, daemon_env):
    """The node daemon's workers unpickle timm's augmentation and
    normalize, which import torchvision as a plain interpreter does: where
    that fails (torchvision's wheel beside torch's CPU build,
    tests/_torchvision.py) the job warns and prepares for itself."""
    import subprocess

    if subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode != 0:
        pytest.skip("torchvision does not import in a plain interpreter here, as the daemon's workers import it")
    alone = view_batches(coordl.DataLoader(augmix_folder(photos), batch_size=8, seed=4))
    L = coordl.DataLoader(augmix_folder(photos), batch_size=8, seed=4, share=True)
    assert views_equal(view_batches(L), alone)
    assert L.stats().samples_shared > 0, L.stats()


def test_timms_augmix_transforms_assigned_after_the_loader_is_made_run_at_the_next_pass(photos):
    from torchvision import transforms as V

    mix = augmix_folder(photos, splits=2)
    L = coordl.DataLoader(mix, batch_size=10, seed=2)
    assert [v.shape[-1] for v in next(iter(L))[0]] == [32, 32]
    mix.transform = create_transform(24, is_training=True, separate=True)     # as create_loader sets them
    assert [v.shape[-1] for v in next(iter(L))[0]] == [24, 24]
    mix.augmentation = V.Compose([V.Grayscale(3)])
    x, _ = next(iter(L))
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])    # timm's normalize
    pixels = [v * std[:, None, None] + mean[:, None, None] for v in x]
    assert torch.allclose(pixels[1][:, 0], pixels[1][:, 1], atol=1e-5)        # gray: every channel the same
    assert not torch.allclose(pixels[0][:, 0], pixels[0][:, 1], atol=1e-5)
    assert "the clean view and 1 through Compose(Grayscale)" in L.stats().path_reason, L.stats().path_reason


_MULTI_EPOCHS = r"""
import sys
import torch, torch.utils.data
import coordl
torch.utils.data.DataLoader = coordl.DataLoader      # before timm is imported, as a script patching the import does
from _torchvision import import_torchvision
import_torchvision()
from timm.data import create_dataset, create_loader
from timm.data.loader import MultiEpochsDataLoader
ds = create_dataset("", root=sys.argv[1], split="", is_training=True)
loader = create_loader(ds, input_size=(3, 32, 32), batch_size=4, is_training=True, num_workers=2,
                       use_multi_epochs_loader=True, device=torch.device("cpu"), use_prefetcher=False)
assert isinstance(loader, MultiEpochsDataLoader) and isinstance(loader, coordl.DataLoader)
assert loader.stats().path == "coordl", loader.stats().path_reason
import collections
want = collections.Counter(t for _, t in ds.reader.samples)
for epoch in range(3):
    labels = torch.cat([y for _, y in loader]).tolist()
    assert len(labels) == len(loader) * 4 == len(ds) // 4 * 4, (epoch, len(labels), len(loader))
    assert not collections.Counter(labels) - want, (epoch, labels)     # each sample at most once (drop_last)
print("epochs", loader.stats().epochs[-1].epoch)
"""


def test_timms_multi_epochs_loader_over_coordls_serves_every_epoch(photos, tmp_path):
    """timm's ``--use-multi-epochs-loader``: its ``MultiEpochsDataLoader``,
    built over coordl's loader (the import patched before timm's), wraps the
    index sampler in an endless repeat and keeps one iterator for every
    epoch: each epoch delivers its batches (it stopped after the first)."""
    import subprocess

    script = tmp_path / "multi_epochs.py"
    script.write_text(_MULTI_EPOCHS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    r = subprocess.run([sys.executable, str(script), photos], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0 and "epochs 2" in r.stdout, r.stdout + r.stderr
