"""A dataset transform that makes several views of each image (MoCo's
``TwoCropsTransform``, SimCLR's view generator, DINO's global and local
crops) on coordl's pipeline: recognized by a probe of its ``__call__``, the
image decoded once and each view made from its planes by the view's own
translated pipeline, in the user's order; anything that does more runs as
written."""
import os
import random
import shutil
import sys

import numpy as np
import pytest
import torch
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _torchvision import import_torchvision  # noqa: E402

if import_torchvision() is None:
    pytest.skip("torchvision is not installed (pip install coordl[test])", allow_module_level=True)

from torchvision import datasets as D  # noqa: E402
from torchvision import transforms as V1  # noqa: E402
from torchvision.transforms import v2 as V2  # noqa: E402

import coordl  # noqa: E402
from coordl import _rng  # noqa: E402
from coordl.tvcompat import MultiViews, multi_views_of, translate  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class TwoCropsTransform:
    """MoCo's: two crops of one image as the query and the key."""

    def __init__(self, base_transform):
        self.base_transform = base_transform

    def __call__(self, x):
        q = self.base_transform(x)
        k = self.base_transform(x)
        return [q, k]


class ViewGenerator:
    """SimCLR's: ``n_views`` views of one image."""

    def __init__(self, base_transform, n_views=2):
        self.base_transform = base_transform
        self.n_views = n_views

    def __call__(self, x):
        return [self.base_transform(x) for i in range(self.n_views)]


class GlobalAndLocal:
    """DINO's: two global crops of their own transforms, then local crops."""

    def __init__(self, M, local_crops_number=3):
        color = M.Compose([M.RandomHorizontalFlip(p=0.5),
                           M.RandomApply([M.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1)], p=0.8),
                           M.RandomGrayscale(p=0.2)])
        normalize = M.Compose([*_to_tensor(M), M.Normalize(MEAN, STD)])
        self.global_transfo1 = M.Compose([M.RandomResizedCrop(48, scale=(0.4, 1.0)), color, normalize])
        self.global_transfo2 = M.Compose([M.RandomResizedCrop(48, scale=(0.4, 1.0)), color,
                                          M.RandomSolarize(128, p=0.2), normalize])
        self.local_crops_number = local_crops_number
        self.local_transfo = M.Compose([M.RandomResizedCrop(24, scale=(0.05, 0.4)), color, normalize])

    def __call__(self, image):
        crops = []
        crops.append(self.global_transfo1(image))
        crops.append(self.global_transfo2(image))
        for _ in range(self.local_crops_number):
            crops.append(self.local_transfo(image))
        return crops


class PairTuple:
    """Two transforms of its own, as a tuple (MoCo v3's two base transforms)."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __call__(self, x):
        return self.a(x), self.b(x)


class DrawsItself(TwoCropsTransform):
    def __call__(self, x):
        views = super().__call__(x)
        return views if random.random() < 2 else views[::-1]


class Stacks(TwoCropsTransform):
    def __call__(self, x):
        return torch.stack(super().__call__(x))


class Converts(TwoCropsTransform):
    def __call__(self, x):
        return super().__call__(x.convert("RGB"))


class Dict(TwoCropsTransform):
    def __call__(self, x):
        q, k = super().__call__(x)
        return {"q": q, "k": k}


def _to_tensor(M):
    return [M.ToTensor()] if M is V1 else [M.ToImage(), M.ToDtype(torch.float32, scale=True)]


def moco(M):
    return M.Compose([M.RandomResizedCrop(40, scale=(0.2, 1.0)),
                      M.RandomApply([M.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
                      M.RandomGrayscale(p=0.2), M.RandomHorizontalFlip(), *_to_tensor(M), M.Normalize(MEAN, STD)])


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("views", num_images=24, num_classes=2, mean_kb=4, image_size=(96, 72), seed=5)


@pytest.fixture(scope="module")
def mixed(photos, tmp_path_factory):
    """The same photos, two of them PNG files and one a gray JPEG."""
    root = tmp_path_factory.mktemp("views_mixed") / "photos"
    shutil.copytree(photos, root)
    files = sorted(str(p) for p in root.rglob("*.jpg"))
    for f in files[:2]:
        Image.open(f).convert("RGB").save(f[:-4] + ".png")
        os.remove(f)
    Image.open(files[2]).convert("L").save(files[2], quality=90)
    return str(root)


def _reference(ds, views: MultiViews, seed, indices):
    """Each sample's views made one after the other by each view's translated
    pipeline from the file's bytes (its own fused decode: a window for a
    crop), under the sample's generator, as (seed, 0, index) gives it."""
    out = []
    for i in indices:
        with open(ds.samples[i][0], "rb") as f:
            raw = f.read()
        with _rng.sample_rng(seed, 0, i):
            out.append([views.views[a].from_bytes(raw) for a in views.calls])
    return out


def _samples(batches):
    """Each sample's views, in the order of ``batches`` (a loader's pass, or its batches)."""
    out = []
    for x, _ in batches:
        n = x[0].shape[0]
        out.extend([v[j].clone() for v in x] for j in range(n))
    return out


@pytest.mark.parametrize("kind", ["moco_v1", "moco_v2", "simclr_3", "dino_v1", "dino_v2", "tuple"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_transform_of_several_views_is_made_of_its_views_pipelines(photos, kind, num_workers):
    """Recognized, named in ``path_reason``, and each sample's views are its
    views' translated pipelines run one after the other under the sample's
    generator (each view's draws continue the one before's), in the user's
    order and container, whatever the workers."""
    tf = {"moco_v1": lambda: TwoCropsTransform(moco(V1)), "moco_v2": lambda: TwoCropsTransform(moco(V2)),
          "simclr_3": lambda: ViewGenerator(moco(V1), n_views=3), "dino_v1": lambda: GlobalAndLocal(V1),
          "dino_v2": lambda: GlobalAndLocal(V2),
          "tuple": lambda: PairTuple(moco(V1), V1.Compose([V1.RandomResizedCrop(32), V1.ToTensor()]))}[kind]()
    ds = D.ImageFolder(photos, tf)
    idx = list(range(0, len(ds), 2))
    L = coordl.DataLoader(ds, batch_size=4, sampler=idx, num_workers=num_workers, seed=3)
    s = L.stats()
    views = L.dataset.transform
    assert s.path == "coordl" and isinstance(views, MultiViews), s.path_reason
    n = {"simclr_3": 3, "dino_v1": 5, "dino_v2": 5}.get(kind, 2)
    assert f"{n} views of each image, made as {type(tf).__name__}.__call__ makes them" in s.path_reason, s.path_reason
    assert "fused RandomResizedCrop" in s.path_reason
    if kind.startswith("dino"):
        assert "(global_transfo1, global_transfo2, local_transfo x 3)" in s.path_reason, s.path_reason
    batches = list(L)
    assert all(type(x) is list and len(x) == n for x, _ in batches)      # (torch collates a tuple as a list)
    with open(ds.samples[0][0], "rb") as f:
        assert type(views.from_bytes(f.read())) is (tuple if kind == "tuple" else list)
    got = _samples(batches)
    want = _reference(ds, views, 3, idx)
    assert len(got) == len(want) == len(idx)
    for g, w in zip(got, want):
        assert [v.shape for v in g] == [v.shape for v in w]
        assert all(torch.equal(a, b) for a, b in zip(g, w))
    assert not torch.equal(got[0][0], got[0][1])        # each view drawn apart
    # the user's object untouched by the probe: its transforms are still its own
    assert all(type(v).__module__.startswith("torchvision.") or not callable(v) for v in vars(tf).values()), vars(tf)


def test_each_view_is_torchvisions_pipeline_on_the_same_draws(photos):
    """A view's pixels are its pipeline's as coordl runs it for a
    single-view dataset of the same images: the first view of each sample
    is that dataset's sample (the same generator's first draws)."""
    tf = TwoCropsTransform(moco(V1))
    first = coordl.DataLoader(D.ImageFolder(photos, tf), batch_size=6, seed=9)
    single = coordl.DataLoader(D.ImageFolder(photos, tf.base_transform), batch_size=6, seed=9)
    for (x, y), (s, sy) in zip(first, single):
        assert torch.equal(y, sy) and torch.equal(x[0], s)


def test_png_and_gray_files_make_their_views_the_same_way(mixed):
    ds = D.ImageFolder(mixed, TwoCropsTransform(moco(V1)))
    idx = list(range(len(ds)))
    L = coordl.DataLoader(ds, batch_size=5, sampler=idx, seed=2)
    got, want = _samples(L), _reference(ds, L.dataset.transform, 2, idx)
    assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
    assert any(p.endswith(".png") for p, _ in ds.samples)


def test_a_resumed_pass_delivers_the_rest_exactly(photos):
    def make():
        return coordl.DataLoader(D.ImageFolder(photos, GlobalAndLocal(V1, 2)), batch_size=4, shuffle=True, seed=6)

    whole = [[v.clone() for v in x] for x, _ in make()]
    a = make()
    it = iter(a)
    head = [[v.clone() for v in next(it)[0]] for _ in range(2)]
    state = a.state_dict()
    del it
    b = make()
    b.load_state_dict(state)
    rest = [[v.clone() for v in x] for x, _ in b]
    assert len(head + rest) == len(whole)
    assert all(torch.equal(u, v) for p, q in zip(head + rest, whole) for u, v in zip(p, q))


@pytest.mark.parametrize("cls", [DrawsItself, Stacks, Converts, Dict])
def test_a_call_that_does_more_than_collect_its_views_runs_as_written(photos, cls):
    """A ``__call__`` that draws random numbers itself, does something with
    the views, or gives its transforms another image runs as written; the
    probe leaves every generator where it was."""
    tf = cls(moco(V1))
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    assert multi_views_of(tf) is None
    after = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and torch.equal(before[2], after[2])
    L = coordl.DataLoader(D.ImageFolder(photos, tf), batch_size=4, seed=1)
    assert f"as written: {cls.__name__}" in L.stats().path_reason, L.stats().path_reason
    x, _ = next(iter(L))
    assert (x.shape[:2] == (4, 2)) if cls is Stacks else x is not None


def test_a_single_view_or_a_view_with_nothing_to_fuse(photos):
    """One view is not several (a holder of one transform is read through as
    before); views of which nothing fuses run as written."""
    class One:
        def __init__(self, t):
            self.t = t

        def __call__(self, x):
            return [self.t(x)]

    assert multi_views_of(One(moco(V1))) is None
    nothing = TwoCropsTransform(V1.Compose([V1.Lambda(lambda im: im), V1.ToTensor()]))
    assert multi_views_of(nothing) is None
    assert multi_views_of(moco(V1)) is None and multi_views_of(None) is None and multi_views_of(len) is None


def test_a_view_that_runs_partly_as_written_takes_the_planes(photos):
    """A view whose pipeline starts with a step coordl cannot fuse is given a
    PIL image of the decoded planes and runs as written, beside a view that
    fuses; the views are its pipelines' results in order."""
    odd = V1.Compose([V1.Lambda(lambda im: im.rotate(90)), V1.CenterCrop(40), V1.ToTensor()])
    tf = PairTuple(moco(V1), odd)
    views = multi_views_of(tf)
    assert views is not None and views.names["b"][0] == ()
    ds = D.ImageFolder(photos, tf)
    L = coordl.DataLoader(ds, batch_size=4, seed=4)
    idx = list(range(len(ds)))
    got, want = _samples(L), _reference(ds, L.dataset.transform, 4, idx)
    assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
    with Image.open(ds.samples[0][0]) as im:
        assert torch.equal(got[0][1], odd(im.convert("RGB")))     # no draws: torchvision's own result


def test_decode_on_the_device_refuses_it_and_the_device_split_says_why(photos, cpu_device):
    ds = D.ImageFolder(photos, TwoCropsTransform(moco(V1)))
    with pytest.raises(ValueError, match=r"makes 2 views of each image \(TwoCropsTransform\).*pass device= without "
                                         r"decode='device'"):
        coordl.DataLoader(ds, batch_size=4, device="cpu", decode="device")
    L = coordl.DataLoader(ds, batch_size=4, device="cpu", seed=1)
    x, _ = next(iter(L))
    assert len(x) == 2 and L.stats().device_split.startswith("not split (TwoCropsTransform makes 2 views"), \
        L.stats().device_split
    alone = coordl.DataLoader(D.ImageFolder(photos, TwoCropsTransform(moco(V1))), batch_size=4, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(x, next(iter(alone))[0]))


def test_jobs_sharing_prep_get_what_they_get_alone(photos, daemon_env):
    """The node daemon's workers prepare the views as the job would: the
    batches are bit for bit the job's alone (where torchvision imports in a
    plain interpreter, as the daemon's workers import it)."""
    import subprocess

    if subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode != 0:
        pytest.skip("torchvision does not import in a plain interpreter here, as the daemon's workers import it")

    def make(**kw):
        return coordl.DataLoader(D.ImageFolder(photos, GlobalAndLocal(V1, 2)), batch_size=4, seed=4, **kw)

    alone = [[v.clone() for v in x] for x, _ in make()]
    L = make(share=True)
    shared = [[v.clone() for v in x] for x, _ in L]
    assert L.stats().samples_shared > 0, L.stats()
    assert len(shared) == len(alone) and all(torch.equal(u, v) for p, q in zip(shared, alone) for u, v in zip(p, q))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_multi_view_transform_changed_in_place_is_followed_at_the_next_pass(photos, num_workers):
    """As under torch (the workers of a pass get the dataset as it is then):
    the number of views and a view's crop size set anew on the user's
    object take effect at the next pass."""
    tf = ViewGenerator(moco(V1), n_views=2)
    L = coordl.DataLoader(D.ImageFolder(photos, tf), batch_size=4, seed=1, num_workers=num_workers)
    x, _ = next(iter(L))
    assert len(x) == 2 and x[0].shape[-1] == 40
    tf.n_views = 3
    tf.base_transform.transforms[0].size = (32, 32)     # progressive resizing
    x, _ = next(iter(L))
    assert len(x) == 3 and all(v.shape[-2:] == (32, 32) for v in x)
    assert "3 views of each image" in L.stats().path_reason, L.stats().path_reason


def test_translate_of_one_view_is_unchanged():
    """``translate`` (one pipeline) never returns several views: only a
    dataset's transform is probed."""
    out, fused, _ = translate(moco(V1))
    assert not isinstance(out, MultiViews) and fused == ("RandomResizedCrop",)
