"""The device split, on a machine without an
accelerator: the CPU stands in for the device (``CPU_TEST_DEVICE``), so the
whole path runs (split, marks, ring, tail) and its batches are compared with
the plain CPU path, bit for bit."""
import collections
import dataclasses
import io
import threading
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import coordl
from coordl.device import delivery as D
from coordl import transforms as T

NORM = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
Pair = collections.namedtuple("Pair", "image label")


class Frozen(collections.abc.Mapping):
    """A Mapping that is not a dict (default_collate keeps its type)."""

    def __init__(self, d):
        self._d = dict(d)

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


class Structured(torch.utils.data.Dataset):
    """A two-stage dataset whose ``prep`` puts ``self.transform``'s output
    into samples of many shapes (what a user's own dataset does)."""

    def __init__(self, root, transform, kind, n=None):
        self.base = coordl.ImageFolder(root)
        self.transform = transform
        self.kind = kind
        self.n = len(self.base) if n is None else n

    def __len__(self):
        return self.n

    def raw(self, i):
        return self.base.raw(i)

    def prep(self, raw, i):
        img = Image.open(io.BytesIO(raw)).convert("RGB")
        tf, y, k = self.transform, i % 3, self.kind
        if k == "bare":
            return tf(img)
        if k == "dict":
            return {"image": tf(img), "label": y}
        if k == "label_first":
            return (y, tf(img))
        if k == "two_views":
            return tf(img), tf(img)
        if k == "nested":
            return [y, (tf(img), [tf(img), float(y)])]
        if k == "namedtuple":
            return Pair(tf(img), y)
        if k == "mapping":
            return Frozen({"x": tf(img), "y": y})
        if k == "mixed":                      # strings and arrays beside the image (the copy path)
            return {"name": f"s{i}", "arr": np.array([i, y]), "image": tf(img), "scale": 0.5 * i}
        if k == "numpy":                      # ToTensor receives an ndarray
            return tf(np.asarray(img)), y
        if k == "float_numpy":                # ... of floats: ToTensor does not scale, Normalize must run
            return tf(np.asarray(img).astype(np.float32) / 7), y
        if k == "stat":                       # the prep code reads the image's values
            x = tf(img)
            return x, x.mean()
        if k == "cat":                        # ... or builds a new tensor from it
            return torch.cat([tf(img), tf(img)]), y
        if k == "some_touched":               # rows of one batch disagree
            x = tf(img)
            return (x, x.sum()) if i % 4 == 1 else (x, torch.tensor(0.0))
        if k == "odd_one":                    # same layout, but one row's image is not the transform's
            x = tf(img)
            return (x, y) if i % 4 else (torch.zeros(x.shape, dtype=torch.uint8), y)
        raise AssertionError(k)


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("split", num_images=12, num_classes=2, mean_kb=2, image_size=(40, 32), seed=3)


def _tf(size=16):
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), NORM])


def _same(a, b):
    """Equal structure, types, dtypes and values (bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, collections.abc.Mapping):
        return list(a.keys()) == list(b.keys()) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _both(ds, **kw):
    kw = dict(batch_size=4, seed=5, shuffle=True, **kw)
    plain = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cpu", **kw)
    return plain, list(L), L


# ------------------------------------------- where the images sit in the sample
@pytest.mark.parametrize("kind", ["bare", "dict", "label_first", "two_views", "nested", "namedtuple", "mapping",
                                  "mixed"])
@pytest.mark.parametrize("workers", [0, 2])
def test_images_anywhere_in_the_sample_are_converted_on_the_device(photos, cpu_device, kind, workers):
    ds = Structured(photos, _tf(), kind)
    plain, got, L = _both(ds, num_workers=workers)
    assert len(got) == len(plain) == 3
    for a, b in zip(got, plain):
        assert _same(a, b), kind
    st = L.stats()
    assert st.device_split.startswith("split") and st.device_split_cpu_samples == 0
    # uint8 travelled: the images were marked in every batch
    assert L._delivery is not None and L._delivery.k == 3


@pytest.mark.parametrize("kind", ["stat", "cat", "some_touched", "odd_one"])
def test_what_the_split_cannot_carry_is_converted_on_the_cpu(photos, cpu_device, kind):
    """The prep code reads the image's values or builds a new tensor from
    it: that sample is prepared again, unsplit, under the same random
    state, and the batch is the CPU path's; stats() counts it."""
    ds = Structured(photos, _tf(), kind)
    plain, got, L = _both(ds, num_workers=0)
    assert len(got) == len(plain)
    for a, b in zip(got, plain):
        assert _same(a, b), kind
    assert L.stats().device_split_cpu_samples > 0


def test_stats_say_when_the_transform_is_not_split(photos, cpu_device):
    ds = Structured(photos, T.Compose([T.RandomResizedCrop(16), T.PILToTensor()]), "dict")
    plain, got, L = _both(ds)
    assert all(_same(a, b) for a, b in zip(got, plain))
    assert L.stats().device_split.startswith("not split")
    ds = Structured(photos, _tf(), "dict")
    L = coordl.DataLoader(ds, batch_size=4, seed=5, device="cpu", collate_fn=lambda b: b)
    list(L)
    assert L.stats().device_split.startswith("not split (a collate_fn")
    assert coordl.DataLoader(ds, batch_size=4, seed=5).stats().device_split == ""


# --------------------------------------------------- a transform assigned later
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_a_transform_assigned_later_takes_effect_at_the_next_pass(photos, cpu_device, workers, persistent):
    """As without device=: at the next pass; persistent workers keep the
    dataset they started with (as under torch), and the tail stays theirs."""
    ds = coordl.ImageFolder(photos, transform=_tf(16))
    kw = dict(batch_size=4, seed=5, num_workers=workers, persistent_workers=persistent)
    L = coordl.DataLoader(ds, device="cpu", **kw)
    plain = coordl.DataLoader(ds, **kw)
    assert next(iter(L))[0].shape[-1] == 16 and next(iter(plain))[0].shape[-1] == 16
    ds.transform = T.Compose([T.RandomResizedCrop(24), T.ToTensor(), T.Normalize([0.5] * 3, [0.2] * 3)])
    L.set_epoch(1)
    plain.set_epoch(1)
    got, want = list(L), list(plain)
    assert got[0][0].shape[-1] == (16 if persistent else 24)
    assert all(_same(a, b) for a, b in zip(got, want)) and len(got) == len(want)


# ---------------------------------------------------- numpy and non-uint8 input
@pytest.mark.parametrize("kind", ["numpy", "float_numpy"])
def test_numpy_and_non_uint8_input_are_what_the_cpu_path_gives(photos, cpu_device, kind):
    ds = Structured(photos, T.Compose([T.ToTensor(), NORM]), kind)
    plain, got, L = _both(ds)
    assert len(got) == len(plain)
    for a, b in zip(got, plain):
        assert _same(a, b), kind
    if kind == "float_numpy":       # not scaled by ToTensor, but normalized
        assert L.stats().device_split_cpu_samples == len(ds)


# ------------------------------------------ the tail's arithmetic on the device
class _Calls(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def test_the_tail_divides_by_a_tensor_on_the_images_device_bit_identically():
    """On CUDA a division by a CPU scalar is a multiply by a rounded
    reciprocal; the tail divides by a 0-dim tensor on the images' device
    (true division there), which on the CPU is exactly ToTensor's result."""
    tail = D.DeviceTail([])
    every = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16)
    with _Calls() as m:
        got = tail(every)
    divs = [(f, a) for f, a, _ in m.calls if getattr(f, "__name__", "") in ("div_", "div", "true_divide")]
    assert divs, m.calls
    for _f, args in divs:
        assert isinstance(args[1], torch.Tensor) and args[1].device == every.device
    assert torch.equal(got, T.ToTensor()(every[0].permute(1, 2, 0).numpy()).unsqueeze(0))


def test_normalize_constants_are_built_once_per_device():
    tail = D.DeviceTail([NORM, T.Normalize([0.1], [0.3])])
    imgs = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    want = torch.stack([T.Normalize([0.1], [0.3])(NORM(T.ToTensor()(im.permute(1, 2, 0).numpy()))) for im in imgs])
    assert torch.equal(tail(imgs), want)
    with _Calls() as m:
        for _ in range(3):
            tail(imgs)
    names = [getattr(f, "__name__", str(f)) for f, _a, _k in m.calls]
    names = [n for n in names if n != "__get__"]       # reading .dtype / .device
    # per batch: one conversion, one division, and a sub and a div per Normalize; nothing else
    assert sorted(set(names)) == ["div_", "sub_", "to"], names
    assert names.count("to") == 3


def test_a_zero_std_is_not_split_and_fails_as_on_the_cpu(photos, cpu_device):
    ds = coordl.ImageFolder(photos, transform=T.Compose([T.ToTensor(), T.Normalize([0.5] * 3, [1.0, 0.0, 1.0])]))
    L = coordl.DataLoader(ds, batch_size=4, seed=5, device="cpu")
    with pytest.raises(ValueError, match="std evaluated to zero"):
        next(iter(L))
    assert L.stats().device_split.startswith("not split (std evaluated to zero")


# --------------------- batches of torch's machinery, containers, custom batches
class Plain(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.full((3,), float(i)), i


def _record(monkeypatch):
    seen = {"stage": [], "send": []}
    real_stage, real_send = D.DeviceDelivery.stage, D.DeviceDelivery.send
    monkeypatch.setattr(D.DeviceDelivery, "stage", lambda self, b, *a: seen["stage"].append(
        threading.current_thread().name) or real_stage(self, b, *a))
    monkeypatch.setattr(D.DeviceDelivery, "send", lambda self, b: seen["send"].append(
        threading.current_thread().name) or real_send(self, b))
    return seen


@pytest.mark.parametrize("ds", [Plain(), torch.utils.data.TensorDataset(torch.arange(8.0), torch.arange(8))],
                         ids=["map-style", "TensorDataset"])
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_of_torchs_machinery_skip_the_ring(cpu_device, monkeypatch, ds, workers):
    """No host copy into coordl's ring on the training thread (torch's pin
    thread pins them on a machine with CUDA); the copy starts from torch's
    batch."""
    seen = _record(monkeypatch)
    want = list(torch.utils.data.DataLoader(ds, batch_size=3))
    got = list(coordl.DataLoader(ds, batch_size=3, num_workers=workers, device="cpu"))
    assert seen["stage"] == [] and len(seen["send"]) == len(want)
    assert all(_same(a, b) for a, b in zip(got, want))
    L = coordl.DataLoader(ds, batch_size=3, device="cpu")
    list(L)
    assert L.stats().device_split.startswith("not split (torch's machinery")


class Holder:
    """A custom batch with pin_memory() and to() (torch's rule for custom types)."""

    def __init__(self, t, moved_to=None):
        self.t, self.moved_to = t, moved_to

    def pin_memory(self):
        return Holder(self.t.pin_memory())

    def to(self, device, non_blocking=False):
        return Holder(self.t.to(device, copy=True), moved_to=device)


@dataclasses.dataclass
class DC:
    t: torch.Tensor


def test_containers_are_walked_as_torch_pin_memory_walks_them(cpu_device):
    src = torch.arange(4.0)
    made = []

    def collate(batch):
        t = torch.stack([x for x, _ in batch])
        made.append(t)
        return {"m": Frozen({"a": t}), "n": Pair(t, t), "o": Holder(t), "l": [t, (t,)], "s": "text"}

    ds = torch.utils.data.TensorDataset(torch.stack([src] * 4), torch.arange(4))
    (b,) = list(coordl.DataLoader(ds, batch_size=4, collate_fn=collate, device="cpu"))
    (t,) = made
    assert type(b["m"]) is Frozen and type(b["n"]) is Pair and b["s"] == "text"
    leaves = [b["m"]["a"], b["n"].image, b["n"].label, b["l"][0], b["l"][1][0]]
    # every tensor was copied to the "device" (never the collated tensor itself)
    assert all(x.data_ptr() != t.data_ptr() and torch.equal(x, t) for x in leaves)
    assert isinstance(b["o"], Holder) and b["o"].moved_to == torch.device("cpu")
    # a dataclass is not walked (as in torch's pin_memory): delivered as it is, with a warning
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        (b,) = list(coordl.DataLoader(ds, batch_size=4, collate_fn=lambda bt: DC(torch.zeros(2)), device="cpu"))
    assert isinstance(b, DC) and any("dataclass" in str(x.message) for x in w)


def test_a_custom_batch_without_to_is_refused_clearly(cpu_device):
    class PinOnly:
        def pin_memory(self):
            return self

    ds = torch.utils.data.TensorDataset(torch.arange(4.0))
    L = coordl.DataLoader(ds, batch_size=2, collate_fn=lambda b: PinOnly(), device="cpu")
    with pytest.raises(TypeError, match="has pin_memory\\(\\) but no to\\(\\)"):
        next(iter(L))


def test_torchs_iterator_pins_for_a_cuda_device(monkeypatch):
    """device="cuda" with pin_memory=False: torch's own iterator is built to
    pin (its pin thread, off the training thread), and the user's
    pin_memory setting is left as it was."""
    L = coordl.DataLoader(Plain(), batch_size=2, num_workers=0)
    L._device = torch.device("cuda")             # as on a machine with CUDA
    seen = []
    monkeypatch.setattr(L._mode, "build_torch_iterator", lambda loader: seen.append(loader.pin_memory) or 0)
    assert L._get_iterator() == 0
    assert seen == [True] and L.pin_memory is False


# ------------------------------------------- found on the way (the copy path)
class OddRow(torch.utils.data.Dataset):
    """Row 2 of each batch has another dtype: the batch leaves the in-place
    layout after rows were written."""

    def __len__(self):
        return 8

    def raw(self, i):
        return bytes([i])

    def prep(self, raw, i):
        x = torch.full((2,), i, dtype=torch.uint8 if i % 4 == 2 else torch.float32)
        return x, i, 0.5 * i, np.array([i, i])

    def __getitem__(self, i):
        return self.prep(self.raw(i), i)


def test_a_batch_that_leaves_the_in_place_layout_collates_as_torch():
    """Rows already written come back as the numbers and arrays they were
    (default_collate cannot stack a 0-dim tensor with an int)."""
    want = list(torch.utils.data.DataLoader(OddRow(), batch_size=4))
    got = list(coordl.DataLoader(OddRow(), batch_size=4))
    assert len(got) == len(want) == 2
    assert all(_same(a, b) for a, b in zip(got, want))


# ------------------------------------------- torchvision recipes with steps run as written
def _tv():
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _torchvision import import_torchvision

    tv = import_torchvision()
    if tv is None:
        pytest.skip("torchvision is not installed (pip install coordl[test])")
    return tv


MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _recipe(kind):
    _tv()
    from torchvision import transforms as V
    from torchvision.transforms import v2 as V2

    if kind == "v1 ColorJitter":         # timm's default training recipe, written with torchvision's steps
        return V.Compose([V.RandomResizedCrop(16), V.RandomHorizontalFlip(), V.ColorJitter(0.4, 0.4, 0.4),
                          V.ToTensor(), V.Normalize(MEAN, STD)])
    if kind == "v2 ColorJitter":
        return V2.Compose([V2.RandomResizedCrop(16), V2.RandomHorizontalFlip(), V2.ColorJitter(0.4, 0.4, 0.4, 0.1),
                           V2.ToImage(), V2.ToDtype(torch.float32, scale=True), V2.Normalize(MEAN, STD),
                           V2.ToPureTensor()])
    if kind == "TrivialAugmentWide":     # a policy drawn in the worker, its operation on the device
        return V.Compose([V.RandomResizedCrop(16), V.TrivialAugmentWide(), V.PILToTensor(),
                          V.ConvertImageDtype(torch.float32), V.Normalize(MEAN, STD)])
    if kind == "AugMix":                 # drawn in the worker, mixed on the device
        return V.Compose([V.RandomResizedCrop(16), V.AugMix(), V.PILToTensor(),
                          V.ConvertImageDtype(torch.float32), V.Normalize(MEAN, STD)])
    if kind == "ElasticTransform":      # run as written in the worker
        return V.Compose([V.RandomResizedCrop(16), V.ElasticTransform(sigma=1.0), V.PILToTensor(),
                          V.ConvertImageDtype(torch.float32), V.Normalize(MEAN, STD)])
    if kind == "RandomGrayscale":       # drawn in the worker, its grey image a saturation at 0 on the device
        return V.Compose([V.RandomResizedCrop(16), V.RandomGrayscale(0.5), V.ToTensor(), V.Normalize(MEAN, STD)])
    raise AssertionError(kind)


@pytest.mark.parametrize("kind,workers", [("v1 ColorJitter", 0), ("v2 ColorJitter", 2), ("TrivialAugmentWide", 2),
                                          ("RandomGrayscale", 0), ("AugMix", 2), ("ElasticTransform", 2)])
def test_a_torchvision_recipe_with_steps_run_as_written_is_split(photos, cpu_device, kind, workers):
    """torchvision's ImageFolder with a ColorJitter (timm's default training
    recipe), or an auto-augment policy, between the fused crop and the
    conversion: the workers stop at the uint8 image (a quarter of the bytes
    travel) and the device converts, after applying the jitter's operations
    the workers drew; the batches are the CPU path's, bit for bit."""
    _tv()
    from torchvision import datasets

    ds = datasets.ImageFolder(photos, transform=_recipe(kind))
    plain, got, L = _both(ds, num_workers=workers)
    assert len(got) == len(plain) == 3
    for a, b in zip(got, plain):
        assert _same(a, b), kind
    st = L.stats()
    if kind != "ElasticTransform":       # drawn in the worker, applied on the device
        name = kind.split()[-1]
        assert st.device_split.startswith(f"split: uint8 images travel; {name}, ToTensor's scaling"), st
    else:
        assert st.device_split.startswith("split: uint8 images travel after the steps run as written"), st
    assert L._delivery is not None and L._delivery.k == 3 and st.device_split_cpu_samples == 0


def test_what_follows_the_conversion_keeps_a_recipe_unsplit(photos, cpu_device):
    """A v2 pipeline that delivers tv_tensors.Image, or a step after a
    RandomErasing: converted on the CPU, with the reason in stats()."""
    _tv()
    from torchvision import datasets
    from torchvision import transforms as V
    from torchvision.transforms import v2 as V2

    for tf, why in [
        (V2.Compose([V2.RandomResizedCrop(16), V2.ColorJitter(0.4), V2.ToImage(), V2.ToDtype(torch.float32, scale=True)]),
         "are not ToTensor() and Normalize()s"),
        (V2.Compose([V2.RandomResizedCrop(16), V2.ColorJitter(0.4), V2.ToImage(), V2.ToDtype(torch.float32, scale=True),
                     V2.Normalize(MEAN, STD), V2.RandomErasing(0.5), V2.ToDtype(torch.float64)]),
         "ToDtype follow RandomErasing"),
    ]:
        plain, got, L = _both(datasets.ImageFolder(photos, transform=tf))
        assert all(_same(a, b) for a, b in zip(got, plain))
        assert L.stats().device_split.startswith("not split") and why in L.stats().device_split, L.stats().device_split


def test_a_one_channel_image_after_the_steps_is_converted_on_the_cpu(photos, cpu_device):
    """Where the steps run as written give a mode L image, the workers
    convert it as the CPU path does (the split carries RGB planes)."""
    _tv()
    from torchvision import datasets
    from torchvision import transforms as V

    tf = V.Compose([V.RandomResizedCrop(16), V.RandomApply([V.Grayscale(1)], p=1.0), V.ToTensor(),
                    V.Normalize([0.5], [0.2])])
    plain, got, L = _both(datasets.ImageFolder(photos, transform=tf))
    assert len(got) == 3 and all(_same(a, b) for a, b in zip(got, plain))
    assert got[0][0].shape[1] == 1 and L.stats().device_split.startswith("split")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_sampler_is_split(photos, cpu_device, workers):
    """A batch_sampler (batch_size=None, default collation, batches of any
    size): uint8 travels and the batches are the CPU path's."""
    ds = Structured(photos, _tf(), "dict")
    batches = [[3, 1, 4], [11, 9, 2, 6, 5], [0]]
    kw = dict(batch_sampler=batches, seed=5, num_workers=workers)
    plain = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cpu", **kw)
    got = list(L)
    assert [len(b["label"]) for b in got] == [3, 5, 1]
    assert all(_same(a, b) for a, b in zip(got, plain))
    assert L.stats().device_split.startswith("split")


def _erasing_recipe(which):
    _tv()
    from torchvision import transforms as V
    from torchvision.transforms import v2 as V2

    if which == "v1":
        return V.Compose([V.RandomResizedCrop(16), V.RandomHorizontalFlip(), V.ColorJitter(0.4, 0.4, 0.4),
                          V.ToTensor(), V.Normalize(MEAN, STD), V.RandomErasing(0.6, value=(7.0, -9.0, 11.0))])
    if which == "v2":
        return V2.Compose([V2.RandomResizedCrop(16), V2.TrivialAugmentWide(), V2.PILToTensor(),
                           V2.ToDtype(torch.float32, scale=True), V2.Normalize(MEAN, STD), V2.RandomErasing(0.6),
                           V2.ToPureTensor()])
    timm_re = pytest.importorskip("timm.data.random_erasing")
    return V.Compose([V.RandomResizedCrop(16), V.ColorJitter(0.4, 0.4, 0.4), V.ToTensor(), V.Normalize(MEAN, STD),
                      timm_re.RandomErasing(0.8, max_count=3, device="cpu")])


@pytest.mark.parametrize("which,workers", [("v1", 0), ("v2", 2), ("timm", 2)])
def test_a_recipe_with_randomerasing_is_split_and_erased_on_the_device(photos, cpu_device, which, workers):
    """A RandomErasing after the conversion (torchvision's v1 and v2,
    timm's with several rectangles): the workers draw its rectangles where
    the CPU path draws them, uint8 travels, the device converts and erases;
    the batches are the CPU path's, bit for bit."""
    tf = _erasing_recipe(which)
    from torchvision import datasets

    ds = datasets.ImageFolder(photos, transform=tf)
    plain, got, L = _both(ds, num_workers=workers)
    assert len(got) == len(plain) == 3
    for a, b in zip(got, plain):
        assert _same(a, b), which
    st = L.stats()
    assert st.device_split.startswith("split") and "RandomErasing run on" in st.device_split, st.device_split
    assert st.device_split_cpu_samples == 0 and L._delivery.k == 3
    odd = torch.tensor([7.0, -9.0, 11.0]).view(1, 3, 1, 1)
    erased = sum(int(((x == 0).all(1) | (x == odd).all(1)).flatten(1).any(1).sum()) for x, _ in got)
    assert erased > 0


@pytest.mark.parametrize("kind", ["two_views", "odd_one"])
def test_erased_images_anywhere_and_rows_finished_on_the_cpu(photos, cpu_device, kind):
    """Two views each with its own rectangles; and a batch whose rows
    disagree, its marked rows converted and erased on the CPU: the CPU
    path's values either way."""
    from coordl.tvcompat import translate

    pipe = translate(_erasing_recipe("v1"))[0]
    ds = Structured(photos, pipe, kind)
    plain, got, L = _both(ds, num_workers=0)
    assert all(_same(a, b) for a, b in zip(got, plain)), kind
    split = L.stats()
    assert split.device_split.startswith("split")
    assert (split.device_split_cpu_samples > 0) == (kind == "odd_one")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_jitter_or_erasing_assigned_later_is_applied_at_the_next_pass(photos, cpu_device, workers):
    """A transform assigned between passes (to the loader's dataset, here
    torchvision's steps as coordl translates them) with the same Normalize
    but a ColorJitter (then also an erasing) the device applies: the next
    pass's tail applies them (the loader keeps the last pass's tail only
    where it does the same); the batches are the CPU path's."""
    _tv()
    from torchvision import datasets
    from torchvision import transforms as V

    from coordl.tvcompat import translate

    plain = [V.RandomResizedCrop(16), V.ToTensor(), V.Normalize(MEAN, STD)]
    jitter = [V.RandomResizedCrop(16), V.ColorJitter(0.4, 0.4, 0.4), V.ToTensor(), V.Normalize(MEAN, STD)]
    erase = jitter + [V.RandomErasing(0.9, value=(7.0, -9.0, 11.0))]
    ds = datasets.ImageFolder(photos, transform=V.Compose(plain))
    kw = dict(batch_size=4, seed=5, shuffle=True, num_workers=workers)
    L = coordl.DataLoader(ds, device="cpu", **kw)
    for epoch, steps in enumerate((plain, jitter, erase)):
        L.dataset.transform = translate(V.Compose(steps))[0]
        L.set_epoch(epoch)
        got = list(L)
        W = coordl.DataLoader(datasets.ImageFolder(photos, transform=V.Compose(steps)), **kw)
        W.set_epoch(epoch)
        want = list(W)
        assert L.stats().device_split.startswith("split")
        for (a, y), (b, y2) in zip(got, want):
            assert torch.equal(a, b) and torch.equal(y, y2), len(steps)
