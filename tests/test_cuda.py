"""The real CUDA path of device delivery: streams, events, pinned buffers,
``record_stream`` and the bit-identical check against the CPU path; and the
training scripts users run on a GPU node, each in a child process whose
CUDA context exists before any worker starts (a training and a validation
loader interleaved, three loaders, later epochs, persistent workers on and
off, tuple, dict and namedtuple samples, torchvision's ImageFolder with
only the import changed, ``share=True``, ``pin_memory=True`` without
``device=``, spawn and forkserver workers): no worker may die, and every
batch is the CPU path's.

Runs wherever CUDA is present; skipped otherwise (the same code is tested
through its seams in test_device*.py and test_worker_device_state.py).
``COORDL_TEST_CUDA_AS_CPU=1`` runs the scenario tests on a machine without
CUDA, the CPU standing in for the device, to check the scripts themselves."""
import collections
import os
import textwrap
import threading

import pytest
import torch

import coordl
from coordl.device import delivery as D
from coordl import transforms as T

AS_CPU = os.environ.get("COORDL_TEST_CUDA_AS_CPU") == "1" and not torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or AS_CPU), reason="needs CUDA")
HERE = os.path.dirname(os.path.abspath(__file__))

NORM = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
Pair = collections.namedtuple("Pair", "image label")


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("cuda", num_images=24, num_classes=2, mean_kb=2, image_size=(40, 32), seed=2)


def _tf():
    return T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToTensor(), NORM])


def _cpu(x):
    return D.map_tensors(x, lambda t: t.cpu())


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@needs_cuda
def test_the_tail_is_bit_identical_to_the_cpu_path_on_cuda():
    every = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(1, 3, 16, 16)
    tail = D.DeviceTail([NORM, T.Normalize([0.1, 0.2, 0.3], [0.7, 0.11, 0.13])])
    want = tail(every)                                    # the CPU path's operations, on the CPU
    ref = T.Normalize([0.1, 0.2, 0.3], [0.7, 0.11, 0.13])(NORM(T.ToTensor()(every[0].permute(1, 2, 0).numpy())))
    assert torch.equal(want[0], ref)
    got = tail(every.cuda()).cpu()
    assert torch.equal(got, want)                         # bit for bit, every uint8 value
    # constants live on the device, built once
    div, pairs = tail.constants(torch.device("cuda", torch.cuda.current_device()))
    assert div.is_cuda and all(m.is_cuda and s.is_cuda for m, s in pairs)


@needs_cuda
def test_ring_streams_events_pinned_buffers_and_record_stream(monkeypatch):
    dd = D.DeviceDelivery(torch.device("cuda"), tail=D.DeviceTail([NORM]))
    assert isinstance(dd.streams, D.CudaStreams)
    recorded = []
    real_record = torch.Tensor.record_stream
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, s: recorded.append((self.data_ptr(), s)) or real_record(self, s))
    g = torch.Generator().manual_seed(0)
    src = [{"image": torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=g), "label": torch.arange(4)}
           for _ in range(5)]
    out = [dd.deliver(b, [("image",)]) for b in src]
    torch.cuda.current_stream().synchronize()
    for slot in dd.slots:
        assert slot.buffers and all(b.is_pinned() for b in slot.buffers)
        assert isinstance(slot.event, torch.cuda.Event)
    assert dd.streams.copy_stream() != torch.cuda.current_stream()
    # the loader's work on the GPU runs ahead of the training stream's kernels when both wait
    assert dd.streams.copy_stream().priority < torch.cuda.current_stream().priority
    # every delivered tensor was recorded on the training (current) stream
    assert len(recorded) == 2 * len(src) and all(s == torch.cuda.current_stream() for _, s in recorded)
    tail = D.DeviceTail([NORM])
    for got, want in zip(out, src):
        assert got["image"].is_cuda and got["label"].is_cuda
        assert torch.equal(got["image"].cpu(), tail(want["image"])) and torch.equal(got["label"].cpu(), want["label"])


class DictFolder(coordl.ImageFolder):
    """A two-stage dataset whose samples are dicts (and two views)."""

    def prep(self, raw, i):
        img, y = self._prep(raw, i)
        return {"image": img, "label": y}


@needs_cuda
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_loader_batches_on_cuda_are_the_cpu_paths(photos, workers, kind):
    cls = coordl.ImageFolder if kind == "tuple" else DictFolder
    ds = cls(photos, transform=_tf())
    kw = dict(batch_size=5, seed=4, shuffle=True, num_workers=workers)
    plain = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cuda", **kw)
    got = list(L)
    torch.cuda.synchronize()
    assert L.stats().device_split.startswith("split") and L.stats().device_split_cpu_samples == 0
    assert len(got) == len(plain)
    for a, b in zip(got, plain):
        leaves = D.map_tensors(a, lambda t: t)
        assert all(t.is_cuda for t in (leaves.values() if isinstance(leaves, dict) else leaves))
        assert _same(_cpu(a), b)


@needs_cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_torch_machinery_batches_are_pinned_by_torch_and_copied_once(monkeypatch, workers):
    ds = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.arange(20))
    seen = []
    real_send = D.DeviceDelivery.send
    monkeypatch.setattr(D.DeviceDelivery, "send", lambda self, b: seen.append(
        (threading.current_thread().name, all(t.is_pinned() for t in b))) or real_send(self, b))
    monkeypatch.setattr(D.DeviceDelivery, "stage", lambda *a: pytest.fail("torch batches do not use the ring"))
    want = list(torch.utils.data.DataLoader(ds, batch_size=6))
    got = list(coordl.DataLoader(ds, batch_size=6, num_workers=workers, device="cuda"))
    torch.cuda.synchronize()
    assert len(seen) == len(want) and all(pinned for _, pinned in seen)
    assert all(a[0].is_cuda and torch.equal(a[0].cpu(), b[0]) and torch.equal(a[1].cpu(), b[1])
               for a, b in zip(got, want))


# ------------------------------------------------------------------ scripts users run on a GPU node
_SCRIPT = '''
import collections, gc, os, sys, torch
sys.path.insert(0, HERE)
import coordl
from coordl import transforms as T
from coordl.device import delivery as D

if torch.cuda.is_available():
    DEV = "cuda"
    torch.zeros(1, device="cuda")        # the CUDA context exists before any worker starts
else:                                    # COORDL_TEST_CUDA_AS_CPU: the CPU stands in
    DEV = "cpu"
    D.CPU_TEST_DEVICE = True
Pair = collections.namedtuple("Pair", "image label")
NORM = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
TRAIN = T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToTensor(), NORM])
VAL = T.Compose([T.Resize(20), T.CenterCrop(16), T.ToTensor(), NORM])


class DictFolder(coordl.ImageFolder):
    def prep(self, raw, i):
        img, y = self._prep(raw, i)
        return {"image": img, "label": y}


class PairFolder(coordl.ImageFolder):
    def prep(self, raw, i):
        return Pair(*self._prep(raw, i))


KINDS = {"tuple": coordl.ImageFolder, "dict": DictFolder, "namedtuple": PairFolder}


def cpu(x):
    return D.map_tensors(x, lambda t: t.cpu())


def on_device(x):
    leaves = []
    D.map_tensors(x, lambda t: leaves.append(t) or t)
    return leaves and all(t.device.type == DEV for t in leaves)


def same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def step_garbage(batch):
    """What a training step leaves for the cyclic collector."""
    junk = {"batch": batch}
    junk["self"] = junk


def check(got, want, what):
    assert len(got) == len(want), (what, len(got), len(want))
    for k, (a, b) in enumerate(zip(got, want)):
        assert on_device(a), (what, k, "not on the device")
        assert same(cpu(a), b), (what, k, "differs from the CPU path")
'''


def _script(photos, body: str, timeout: float = 240):
    from coordl.testing import run_in_child

    code = f"HERE, ROOT = {HERE!r}, {photos!r}\n" + _SCRIPT + textwrap.dedent(body) + "\nprint('SCRIPT OK')\n"
    r = run_in_child(code, timeout=timeout)
    assert r.returncode == 0 and "SCRIPT OK" in r.stdout, (
        f"exit status {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    assert "initialization error" not in r.stderr, r.stderr[-6000:]


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("kind", ["tuple", "dict", "namedtuple"])
def test_training_and_validation_loaders_interleaved_over_epochs(photos, kind, persistent):
    _script(photos, f"""
        cls = KINDS[{kind!r}]
        kw = dict(batch_size=5, seed=4, num_workers=2, persistent_workers={persistent})
        train = coordl.DataLoader(cls(ROOT, transform=TRAIN), shuffle=True, device=DEV, **kw)
        val = coordl.DataLoader(cls(ROOT, transform=VAL), device=DEV, **kw)
        ref_train = coordl.DataLoader(cls(ROOT, transform=TRAIN), shuffle=True, batch_size=5, seed=4)
        ref_val = list(coordl.DataLoader(cls(ROOT, transform=VAL), batch_size=5, seed=4))
        held = []
        for epoch in range(4):
            train.set_epoch(epoch)
            ref_train.set_epoch(epoch)
            want = list(ref_train)
            got = []
            for k, batch in enumerate(train):
                step_garbage(batch)
                got.append(batch)
                if epoch == 1 and k == 1:
                    break                      # a pass left early
            check(got, want[:len(got)], f"train epoch {{epoch}}")
            held.append(got[0])
            got = []
            for batch in val:
                step_garbage(batch)
                got.append(batch)
            check(got, ref_val, f"val epoch {{epoch}}")
        torch.cuda.synchronize() if DEV == "cuda" else None
    """)


def test_three_loaders_in_one_process(photos):
    _script(photos, """
        loaders = [coordl.DataLoader(coordl.ImageFolder(ROOT, transform=tf), batch_size=5, seed=1, device=DEV,
                                     num_workers=w, shuffle=s)
                   for tf, w, s in ((TRAIN, 4, True), (VAL, 2, False), (TRAIN, 1, False))]
        refs = [coordl.DataLoader(coordl.ImageFolder(ROOT, transform=tf), batch_size=5, seed=1, shuffle=s)
                for tf, s in ((TRAIN, True), (VAL, False), (TRAIN, False))]
        for epoch in range(3):
            for i, (L, R) in enumerate(zip(loaders, refs)):
                L.set_epoch(epoch)
                R.set_epoch(epoch)
                got = []
                for b in L:
                    step_garbage(b)
                    got.append(b)
                check(got, list(R), f"loader {i} epoch {epoch}")
    """)


def test_torchvision_imagefolder_with_only_the_import_changed(photos):
    """torchvision's ImageFolder and v1 transforms, coordl's DataLoader: with
    the user's own ``.cuda(non_blocking=True)`` and ``pin_memory=True``, and
    with ``device=``; training and validation loaders, two epochs."""
    _script(photos, """
        from _torchvision import import_torchvision
        tv = import_torchvision()
        tt = tv.transforms
        norm = tt.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        train_tf = tt.Compose([tt.RandomResizedCrop(16), tt.RandomHorizontalFlip(), tt.ToTensor(), norm])
        val_tf = tt.Compose([tt.Resize(20), tt.CenterCrop(16), tt.ToTensor(), norm])
        kw = dict(batch_size=5, num_workers=2, seed=3)
        ref_val = list(coordl.DataLoader(tv.datasets.ImageFolder(ROOT, val_tf), batch_size=5, seed=3))
        for dev_kw in (dict(pin_memory=True), dict(device=DEV)):
            train = coordl.DataLoader(tv.datasets.ImageFolder(ROOT, train_tf), shuffle=True, **kw, **dev_kw)
            val = coordl.DataLoader(tv.datasets.ImageFolder(ROOT, val_tf), **kw, **dev_kw)
            for epoch in range(2):
                n = 0
                for images, labels in train:
                    images = images.to(DEV, non_blocking=True)
                    step_garbage((images, labels))
                    n += len(labels)
                assert n == 24, n
                got = [D.map_tensors(b, lambda t: t.to(DEV, non_blocking=True)) for b in val]
                check(got, ref_val, f"{dev_kw} val epoch {epoch}")
    """)


def test_pin_memory_without_device_after_cuda_tensors_exist(photos):
    """``pin_memory=True`` and the user's own copy, on coordl's pipeline and on
    torch's machinery (a plain dataset), several epochs."""
    _script(photos, """
        class Plain(torch.utils.data.Dataset):
            def __init__(self):
                self.ds = coordl.ImageFolder(ROOT, transform=TRAIN)
            def __len__(self):
                return len(self.ds)
            def __getitem__(self, i):
                return self.ds[i]

        for ds in (coordl.ImageFolder(ROOT, transform=TRAIN), Plain()):
            for persistent in (False, True):
                L = coordl.DataLoader(ds, batch_size=5, num_workers=2, pin_memory=True, seed=2,
                                      persistent_workers=persistent)
                for epoch in range(3):
                    n = 0
                    for images, labels in L:
                        if DEV == "cuda":
                            assert images.is_pinned()
                        step_garbage(images.to(DEV, non_blocking=True))
                        n += len(labels)
                    assert n == 24, n
    """)


def test_spawn_and_forkserver_workers_on_the_device(photos):
    _script(photos, """
        ref = list(coordl.DataLoader(coordl.ImageFolder(ROOT, transform=TRAIN), batch_size=5, seed=5))
        for ctx in ("spawn", "forkserver"):
            L = coordl.DataLoader(coordl.ImageFolder(ROOT, transform=TRAIN), batch_size=5, seed=5, device=DEV,
                                  num_workers=2, multiprocessing_context=ctx)
            check(list(L), ref, ctx)
    """)


def test_share_true_on_the_device(photos, tmp_path, monkeypatch):
    """Jobs sharing prep through the node daemon, batches delivered on the
    device, two epochs; the same batches as the CPU path."""
    from coordl.testing import stop_daemon

    monkeypatch.setenv("COORDL_RUN_DIR", str(tmp_path / "run"))
    try:
        _script(photos, """
            tf = T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.PILToTensor()])
            ref = coordl.DataLoader(coordl.ImageFolder(ROOT, transform=tf), batch_size=5, seed=6, shuffle=True)
            L = coordl.DataLoader(coordl.ImageFolder(ROOT, transform=tf), batch_size=5, seed=6, shuffle=True,
                                  share=True, num_workers=2, device=DEV)
            for epoch in range(2):
                got = []
                for b in L:
                    step_garbage(b)
                    got.append(b)
                check(got, list(ref), f"epoch {epoch}")
            assert L.stats().samples_shared > 0, L.stats()
        """)
    finally:
        assert not stop_daemon()


# ---------------------------------------------------------------- decode="device"
# docs/guide/gpu.md, "Same semantics as the CPU path, and the tolerance": the bound against the CPU path (mean
# and max absolute difference per channel value, in uint8 levels)
DECODE_MEAN, DECODE_MAX = 6.0, 96
# the GPU decoder's own arithmetic against the CPU stand-in CI runs (same
# chroma upsampling, same geometry): mean per channel value
STAND_IN_MEAN = 1.0


@pytest.fixture(scope="module")
def mixed_jpegs(tmp_path_factory):
    """ImageNet-like JPEGs (synth's size mix) and, in class "odd", a CMYK
    JPEG, a grayscale JPEG, a PNG, a progressive JPEG and one with corrupt
    data (header and end marker intact)."""
    import io

    import numpy as np
    from PIL import Image

    from coordl.synth import make_image_folder

    root = tmp_path_factory.mktemp("gpudecode") / "data"
    make_image_folder(str(root), num_images=20, num_classes=2, seed=9)
    odd = root / "odd"
    odd.mkdir()
    rng = np.random.default_rng(2)

    def photo(h, w):
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (h + w)], -1)
        return Image.fromarray(np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8))

    photo(300, 400).convert("CMYK").save(odd / "cmyk.jpg", quality=90)
    photo(280, 350).convert("L").save(odd / "gray.jpg", quality=90)
    photo(290, 310).save(odd / "png.jpg", format="PNG")
    photo(333, 377).save(odd / "progressive.jpg", quality=85, progressive=True)
    buf = io.BytesIO()
    photo(256, 256).save(buf, "JPEG", quality=90)
    raw = buf.getvalue()
    (odd / "corrupt.jpg").write_bytes(raw[:raw.find(b"\xff\xda") + 3000] + b"\xff\xd9")
    return str(root)


def _decode_pipeline(kind):
    if kind == "train":
        return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), NORM])
    return T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])


def _cpu_and_gpu_decode(ds, workers):
    """``(file names, the loaders' arguments, the CPU path's batches, the
    decode="device" loader on CUDA, its batches)`` of ``ds`` in order."""
    names = [os.path.basename(p) for p, _ in ds.samples]
    kw = dict(batch_size=6, seed=8, shuffle=False, num_workers=workers)
    cpu = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cuda", decode="device", **kw)
    got = list(L)
    torch.cuda.synchronize()
    return names, kw, cpu, L, got


def _levels(a, b):
    if a.dtype == torch.uint8:
        return (a.int() - b.int()).abs().float()
    return (a - b).abs() * torch.tensor(NORM.std).view(1, 3, 1, 1) * 255


@needs_cuda
@pytest.mark.parametrize("decoder", ["torchvision", "nvimgcodec", "nvimgcodec-hw", "nvimgcodec-hybrid",
                                     "nvimgcodec-cuda", "torchvision:3+nvimgcodec-hybrid:2"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["train", "eval"])
def test_decode_on_the_gpu_is_the_cpu_path_within_the_documented_bound(mixed_jpegs, monkeypatch, decoder, workers,
                                                                        kind):
    """The real GPU decoder, its batched call and the stage on CUDA: images
    within docs/guide/gpu.md's bound of the CPU path, and within the decoder's own
    arithmetic of the CPU stand-in CI runs (same geometry, same resize);
    labels equal; CMYK and PNG prepared by the CPU path in the workers (its
    very pixels); counts in stats()."""
    if "nvimgcodec" in decoder:
        pytest.importorskip("nvidia.nvimgcodec")
    monkeypatch.setenv("COORDL_DEVICE_DECODER", decoder)
    ds = coordl.ImageFolder(mixed_jpegs, _decode_pipeline(kind))
    names, kw, cpu, L, got = _cpu_and_gpu_decode(ds, workers)
    # the stand-in of each named decoder (its chroma upsampling; a split's shares as the GPU's)
    stand_in = list(coordl.DataLoader(ds, device="cpu", decode="device", **kw))
    assert len(got) == len(cpu) == len(stand_in)
    row = 0
    for (a, y), (b, y2), (c, y3) in zip(cpu, got, stand_in):
        assert b.is_cuda and y2.is_cuda and b.dtype == a.dtype and b.shape == a.shape
        assert torch.equal(y, y2.cpu()) and torch.equal(y, y3)
        b = b.cpu()
        for k in range(len(y)):
            name = names[row + k]
            d = _levels(a[k:k + 1], b[k:k + 1])
            if name in ("cmyk.jpg", "png.jpg"):
                assert float(d.max()) == 0, name
            elif name != "corrupt.jpg":
                assert float(d.mean()) <= DECODE_MEAN and float(d.max()) <= DECODE_MAX, (name, float(d.mean()),
                                                                                         float(d.max()))
                assert float(_levels(c[k:k + 1], b[k:k + 1]).mean()) <= STAND_IN_MEAN, name
        row += len(y)
    st = L.stats()
    assert st.device_decode.startswith(("torchvision" if decoder.startswith("torchvision") else "nvImageCodec"))
    assert ("hardware decoder first" in st.device_decode) == ("-hw" in decoder)
    assert ("hybrid" in st.device_decode) == ("-hybrid" in decoder)
    assert ("CUDA decoding first" in st.device_decode) == ("-cuda" in decoder)
    # CMYK and PNG are the workers'; the corrupt file may fall back, and the progressive one too where the
    # decoder's backends (nvimgcodec-hw, -hybrid, -cuda: no CPU backend inside nvImageCodec) do not take it
    most = 3 if decoder in ("torchvision", "nvimgcodec") else 4
    assert 2 <= st.device_decode_cpu_images <= most
    assert st.device_decode_images + st.device_decode_cpu_images == len(ds)


@needs_cuda
def test_a_drawn_interpolation_on_the_gpu_is_the_cpu_path_within_the_documented_bound(mixed_jpegs, monkeypatch):
    """timm's random interpolation (a mode drawn per sample): each image
    resized on the GPU with its record's mode, within the bound of the CPU
    path and of the CPU stand-in's arithmetic, as one mode is."""
    monkeypatch.setenv("COORDL_DEVICE_DECODER", "torchvision")
    both = (T.InterpolationMode.BILINEAR, T.InterpolationMode.BICUBIC)
    ds = coordl.ImageFolder(mixed_jpegs, T.Compose([T.RandomResizedCrop(224, interpolation=both),
                                                    T.RandomHorizontalFlip(), T.ToTensor(), NORM]))
    names = [os.path.basename(p) for p, _ in ds.samples]
    kw = dict(batch_size=6, seed=8, shuffle=False, num_workers=2)
    cpu = list(coordl.DataLoader(ds, **kw))
    got = list(coordl.DataLoader(ds, device="cuda", decode="device", **kw))
    torch.cuda.synchronize()
    stand_in = list(coordl.DataLoader(ds, device="cpu", decode="device", **kw))
    row = 0
    for (a, _), (b, _), (c, _) in zip(cpu, got, stand_in):
        b = b.cpu()
        for k in range(len(a)):
            if names[row + k] not in ("cmyk.jpg", "png.jpg", "corrupt.jpg"):
                d = _levels(a[k:k + 1], b[k:k + 1])
                assert float(d.mean()) <= DECODE_MEAN and float(d.max()) <= DECODE_MAX, names[row + k]
                assert float(_levels(c[k:k + 1], b[k:k + 1]).mean()) <= STAND_IN_MEAN, names[row + k]
        row += len(a)


@needs_cuda
@pytest.mark.parametrize("decoder", ["torchvision", "nvimgcodec-hw"])
def test_checked_data_gives_a_corrupt_jpeg_the_cpu_paths_pixels_on_the_gpu(mixed_jpegs, monkeypatch, decoder):
    """COORDL_DEVICE_CHECK_DATA=1 on CUDA: the JPEG whose data ends early
    is the CPU path's, bit for bit, and a second loader gives the same batch."""
    if "nvimgcodec" in decoder:
        pytest.importorskip("nvidia.nvimgcodec")
    monkeypatch.setenv("COORDL_DEVICE_DECODER", decoder)
    monkeypatch.setenv("COORDL_DEVICE_CHECK_DATA", "1")
    ds = coordl.ImageFolder(mixed_jpegs, _decode_pipeline("train"))
    names = [os.path.basename(p) for p, _ in ds.samples]
    k = names.index("corrupt.jpg")
    kw = dict(batch_size=len(ds), seed=8, shuffle=False, num_workers=2)
    cpu = list(coordl.DataLoader(ds, **kw))[0][0]
    L = coordl.DataLoader(ds, device="cuda", decode="device", **kw)
    first = list(L)[0][0].cpu()
    assert torch.equal(first[k], cpu[k])
    torch.cuda.empty_cache()
    junk = torch.full((64 << 20,), 77, dtype=torch.uint8, device="cuda")     # memory the decoder may get next
    del junk
    again = coordl.DataLoader(ds, device="cuda", decode="device", **kw)         # the same epoch, anew
    assert torch.equal(list(again)[0][0].cpu(), first)


@needs_cuda
@pytest.mark.parametrize("decoder", ["torchvision", "torchvision+torchvision:2"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_lagging_copy_stream_never_reads_the_next_images(mixed_jpegs, monkeypatch, decoder, workers):
    """Each image's geometry queued behind GPU work on the copy stream (as
    behind a training step's kernels), each image a chunk of its own
    (BUDGET), the decode thread a batch ahead: the decoder's next images
    must never land in memory whose geometry has not run yet.  torchvision
    allocates on the current stream and writes on a stream of its own, so
    a block freed with its geometry still queued could be handed to it."""
    from coordl.device import decode as DD

    monkeypatch.setenv("COORDL_DEVICE_GEOMETRY", "per-image")
    monkeypatch.setenv("COORDL_DEVICE_CHECK_DATA", "1")
    monkeypatch.setenv("COORDL_DEVICE_DECODER", decoder)
    ds = coordl.ImageFolder(mixed_jpegs, _decode_pipeline("train"))
    kw = dict(batch_size=6, seed=8, shuffle=True, num_workers=workers, device="cuda", decode="device")
    want = [(x.cpu(), y.cpu()) for x, y in coordl.DataLoader(ds, **kw)]
    orig = DD.DecodeStage._geometry

    def lagging(self, img, rec, into=None):
        torch.cuda._sleep(20_000_000)       # some milliseconds of GPU time ahead of this image's geometry
        return orig(self, img, rec, into=into)

    monkeypatch.setattr(DD.DecodeStage, "_geometry", lagging)
    monkeypatch.setattr(DD, "BUDGET", 1)     # one image per decoder call: the next call comes at once
    got = [(x.cpu(), y.cpu()) for x, y in coordl.DataLoader(ds, **kw)]
    assert len(got) == len(want)
    for k, ((a, y), (b, y2)) in enumerate(zip(want, got)):
        assert torch.equal(y, y2) and torch.equal(a, b), f"batch {k}"


@needs_cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_decoders_sharing_a_batch_on_their_own_streams_give_one_decoders_batches(mixed_jpegs, monkeypatch, workers):
    """Three torchvision decoders sharing each batch, two of them in
    threads of their own on streams of their own: the very batches one
    decoder gives (the caller's stream waits for each share's), over two
    passes; each share decoded its rows.  The JPEG whose data ends early
    is checked out to the CPU path (COORDL_DEVICE_CHECK_DATA): nvJPEG
    decodes it in part, the rest of its pixels what the memory held, which
    differs between two loaders (seen on an H200)."""
    monkeypatch.setenv("COORDL_DEVICE_GEOMETRY", "per-image")    # one geometry path for both, whatever the GPU
    monkeypatch.setenv("COORDL_DEVICE_CHECK_DATA", "1")
    ds = coordl.ImageFolder(mixed_jpegs, _decode_pipeline("train"))
    kw = dict(batch_size=6, seed=8, shuffle=True, num_workers=workers, device="cuda", decode="device")
    monkeypatch.setenv("COORDL_DEVICE_DECODER", "torchvision")
    one = coordl.DataLoader(ds, **kw)
    want = [[(x.cpu(), y.cpu()) for x, y in one] for _ in range(2)]
    monkeypatch.setenv("COORDL_DEVICE_DECODER", "torchvision+torchvision:2+torchvision")
    L = coordl.DataLoader(ds, **kw)
    for e in range(2):
        got = [(x.cpu(), y.cpu()) for x, y in L]
        assert len(got) == len(want[e])
        for (a, y), (b, y2) in zip(want[e], got):
            assert torch.equal(a, b) and torch.equal(y, y2)
    assert all(n > 0 for n in L._decoder.images), L._decoder.images


@needs_cuda
def test_the_workers_share_on_the_gpu_is_the_cpu_paths_pixels(mixed_jpegs, monkeypatch):
    """torchvision's decoder beside the workers' share: the share's samples
    (by index) are the CPU path's bit for bit on CUDA (the tail's
    conversion is), the rest within the decoder's bound; counted."""
    from coordl.device import decoders as DDS
    from coordl.device.encoded import plan_for

    monkeypatch.setenv("COORDL_DEVICE_DECODER", "torchvision:4+workers:1")
    ds = coordl.ImageFolder(mixed_jpegs, _decode_pipeline("train"))
    names = [os.path.basename(p) for p, _ in ds.samples]
    kw = dict(batch_size=6, seed=8, shuffle=False, num_workers=2)
    cpu = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cuda", decode="device", **kw)
    got = [(x.cpu(), y.cpu()) for x, y in L]
    plan = plan_for(ds.transform)
    plan.cpu_share = DDS.cpu_share(2)
    assert plan.cpu_share == pytest.approx(1 / 3)
    shared, row = 0, 0
    for (a, y), (b, y2) in zip(cpu, got):
        assert torch.equal(y, y2)
        for k in range(len(y)):
            i, name = row + k, names[row + k]
            if plan.on_cpu(i):
                shared += 1
                assert torch.equal(a[k], b[k]), name
            elif name not in ("corrupt.jpg", "cmyk.jpg", "png.jpg"):
                d = _levels(a[k:k + 1], b[k:k + 1])
                assert float(d.mean()) <= DECODE_MEAN and float(d.max()) <= DECODE_MAX, name
        row += len(y)
    st = L.stats()
    assert 0 < shared < len(ds) and "the workers decode 33% of the samples" in st.device_decode
    assert st.device_decode_images + st.device_decode_cpu_images == len(ds)
    assert st.device_decode_cpu_images >= shared


@needs_cuda
def test_decode_on_the_gpu_resumes_exactly_and_skips_what_no_decoder_reads(mixed_jpegs, monkeypatch):
    """Mid-epoch resume gives the rest of the epoch's batches exactly; a
    stream the GPU decoder rejects and the CPU cannot read either is
    skipped under on_error="skip" (counted, warned), the other rows of its
    batch delivered."""
    from coordl.decode import jpeg
    from coordl.device import decode as DD

    ds = coordl.ImageFolder(mixed_jpegs, _decode_pipeline("train"))
    kw = dict(batch_size=5, seed=3, shuffle=True, num_workers=2, device="cuda", decode="device")
    whole = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, **kw)
    it = iter(L)
    first = [next(it) for _ in range(2)]
    state = L.state_dict()
    del it
    R = coordl.DataLoader(ds, **kw)
    R.load_state_dict(state)
    for (a, y), (b, y2) in zip(first + list(R), whole):
        assert torch.equal(a, b) and torch.equal(y, y2)
    bad = next(i for i, (p, _) in enumerate(ds.samples) if p.endswith("progressive.jpg"))
    head = ds.raw(bad)[:64]
    real_host, real_for = jpeg.decode_rgb, DD.decoder_for

    class Refusing:
        def __init__(self, inner):
            self.inner, self.name = inner, inner.name

        def decode(self, streams):
            return [RuntimeError("rejected") if bytes(s[:64].numpy()) == head else x
                    for s, x in zip(streams, self.inner.decode(streams))]

        def finish(self):
            self.inner.finish()

        def release(self):
            return self.inner.release()

    monkeypatch.setattr(jpeg, "decode_rgb", lambda raw, scale=1: (_ for _ in ()).throw(OSError("unreadable"))
                        if bytes(raw[:64]) == head else real_host(raw, scale))
    monkeypatch.setattr(DD, "decoder_for", lambda dev, **kw: Refusing(real_for(dev)))
    S = coordl.DataLoader(ds, on_error="skip", **kw)
    with pytest.warns(coordl.SkippedSampleWarning, match="progressive.jpg"):
        got = list(S)
    assert sum(len(y) for _, y in got) == len(ds) - 1 and S.stats().skipped == 1


@needs_cuda
@pytest.mark.parametrize("mode,antialias", [("bilinear", True), ("bicubic", True), ("bilinear", False)])
def test_the_stages_resize_on_cuda_is_f_interpolates_also_into_a_row(mode, antialias):
    """On the GPU, the stage's resize (the operator F.interpolate calls,
    writing a row of the batch itself where the probe allows) gives
    F.interpolate's values there, and writes that row only."""
    import torch.nn.functional as F
    from coordl.device import decode as DD

    dev = torch.device("cuda")
    resize = DD._resizer(mode, antialias, dev)
    g = torch.Generator().manual_seed(5)
    for shape, size in [((1, 3, 375, 500), (224, 224)), ((1, 3, 20, 15), (33, 41))]:
        x = (torch.rand(shape, generator=g) * 255).to(dev)
        want = F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=antialias)
        assert torch.equal(resize(x, size), want)
        batch = torch.full((3, 3, *size), -7.0, device=dev)
        resize(x, size, batch[1:2])
        assert torch.equal(batch[1:2], want) and bool((batch[0] == -7).all() and (batch[2] == -7).all())


@needs_cuda
def test_the_batch_geometry_kernel_on_cuda_is_the_per_image_path_within_a_level():
    """Where Triton imports: the kernel's rows on the GPU against the
    per-image path's on the same device (crops down and up, a second crop
    reaching outside, no resize, an (H, W, 3) image), the float values
    close and the rounded ones within a level; and ImageNet-sized crops to
    224, as a training batch has them."""
    import numpy as np
    from coordl.device import decode as DD
    from coordl.device import geometry_kernel as GK
    from coordl.device.encoded import plan_for

    if not GK.available():
        pytest.skip("triton does not import here")
    dev = torch.device("cuda")
    rng = np.random.default_rng(11)
    for tf, make in [
        (T.Compose([T.RandomResizedCrop(224), T.ToTensor()]),
         lambda H, W, k: (lambda h, w: [0, H, W, int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1)),
                                        h, w, 224, 224, 0, 0, 224, 224, 0, 0, 0, k, 3])(int(rng.integers(1, H + 1)),
                                                                                   int(rng.integers(1, W + 1)))),
        (T.Compose([T.Resize((60, 60)), T.CenterCrop(48), T.ToTensor()]),
         lambda H, W, k: [0, H, W, 0, 0, H, W, 40 + k, 70 - k, (40 + k - 48) // 2, (70 - k - 48) // 2, 48, 48,
                          0, 0, 0, k, 3]),
        (T.Compose([T.CenterCrop(48), T.ToTensor()]),
         lambda H, W, k: [0, H, W, 0, 0, H, W, 0, 0, (H - 48) // 2, (W - 48) // 2, 48, 48, 0, 0, 0, k, 3]),
    ]:
        plan = plan_for(tf)
        stage = DD.DecodeStage(dev, plan, DD.HostDecoder(dev), "raise", str)
        imgs, recs = [], []
        for k in range(12):
            H, W = int(rng.integers(30, 600)), int(rng.integers(30, 600))
            x = torch.from_numpy(rng.integers(0, 256, (H, W, 3), dtype=np.uint8)).to(dev)
            imgs.append(x.permute(2, 0, 1) if k % 3 == 0 else x.permute(2, 0, 1).contiguous())
            recs.append(make(H, W, k))
        rows = {}
        for kind in GK.KINDS:     # the separable kernel and the two it falls back to
            geo = GK.BatchGeometry(plan.size, kind)
            ok, what = GK.agrees(stage, imgs, recs, geo)
            assert ok, (kind, what)
            rows[kind] = torch.empty((len(imgs), 3, *plan.size), device=dev)
            geo.run([(j, a, r) for j, (a, r) in enumerate(zip(imgs, recs))], rows[kind])
        # the separable kernel adds the tiled kernel's products in its order: the same float rows
        assert torch.equal(rows["separable"], rows["tiled"])
        # the kernels' own rounding (half to even, through float adds the compiler must keep),
        # clamp and mirror give exactly the rows the stage would make of their float rows
        # and their ToTensor/Normalize arithmetic is the device tail's, bit for bit
        from coordl.device.split import DeviceTail
        flipped = [list(r[:13]) + [k % 2] + list(r[14:]) for k, r in enumerate(recs)]
        for kind in ("separable", "tiled"):
            geo = GK.BatchGeometry(plan.size, kind)
            ok, what = GK.fused_agrees(geo, dev, imgs, flipped, DeviceTail([NORM]))
            assert ok and geo.fused and geo.fused_tail, (kind, what)


@needs_cuda
def test_the_wait_setting_sets_the_devices_scheduling_and_changes_no_batch(mixed_jpegs, monkeypatch):
    """COORDL_CUDA_WAIT=block through the real driver: the device's
    scheduling flag reads back as blocking after the loader's first pass,
    the batches are those of CUDA's own choice; the flag is restored."""
    from coordl.device import waits

    ordinal = torch.cuda.current_device()
    torch.zeros(1, device="cuda")            # the primary context is active, as under a training loop
    before = waits.scheduling(ordinal)
    try:                                      # a driver that keeps an active context's flags: said, not failed
        waits.set_scheduling(ordinal, "block")
    except RuntimeError as e:
        pytest.skip(f"this driver does not change an active context's scheduling: {e}")
    waits.set_scheduling(ordinal, before)
    monkeypatch.setenv("COORDL_DEVICE_GEOMETRY", "per-image")    # one geometry path for both loaders
    ds = coordl.ImageFolder(mixed_jpegs, _decode_pipeline("train"))
    kw = dict(batch_size=6, seed=8, shuffle=False, num_workers=2, device="cuda", decode="device")
    monkeypatch.delenv("COORDL_CUDA_WAIT", raising=False)
    want = [(x.cpu(), y.cpu()) for x, y in coordl.DataLoader(ds, **kw)]
    monkeypatch.setenv("COORDL_CUDA_WAIT", "block")
    try:
        got = [(x.cpu(), y.cpu()) for x, y in coordl.DataLoader(ds, **kw)]
        assert waits.scheduling(ordinal) == "block"
    finally:
        waits.set_scheduling(ordinal, before)
    assert waits.scheduling(ordinal) == before
    assert len(got) == len(want)
    for (a, y), (b, y2) in zip(want, got):
        assert torch.equal(a, b) and torch.equal(y, y2)


@needs_cuda
def test_colorjitter_on_cuda_gives_pils_bytes_row_by_row():
    """The device's ColorJitter on CUDA, in the Triton kernel and in torch's
    operations: each row of a batch with its own operations in its own
    order is what PIL gives, and every kind passed its first-use check on
    that path (none fell back)."""
    import sys

    import numpy as np

    from coordl.device import jitter as J
    from coordl.device.jitter import DeviceJitter

    sys.path.insert(0, HERE)
    import _jitter_cases as cases

    y, ops = cases.batch(3, 16, 19, 23)
    want = cases.pils(y, ops)
    for path in ("kernel", "torch operations"):
        dj = DeviceJitter(torch.device("cuda"))
        if path == "torch operations":
            dj._kernel_ok = None
        elif J._kernel() is None:
            continue                                        # no Triton here
        got = dj(y.cuda(), ops).cpu()
        # every kind passed its first-use check on the path taken (none fell back)
        if path == "kernel":
            assert dj._kernel_ok == {0: True, 1: True, 2: True} and dj._exact == {}, (dj._kernel_ok, dj._exact)
        else:
            assert dj._exact == {0: True, 1: True, 2: True}, dj._exact
        for r in range(len(ops)):
            assert np.array_equal(got[r].numpy(), want[r]), (path, r, ops[r])


@needs_cuda
def test_the_auto_augment_operations_on_cuda_give_pils_bytes_row_by_row():
    """Every operation of torchvision's auto-augment policies on CUDA
    (coordl.device.pil_ops through DeviceJitter: sharpness, posterize,
    solarize, autocontrast, equalize, invert, PIL's affine maps, quarter
    turns), each row with its own value: PIL's bytes, and every kind passed
    its first-use check there (none fell back to the CPU path's code)."""
    import sys

    import numpy as np

    from coordl.decode import color as C
    from coordl.device import jitter as J
    from coordl.device import pil_ops as P

    sys.path.insert(0, HERE)
    import test_device_policy as cases

    dj = J.DeviceJitter(torch.device("cuda"))
    for h, w in ((24, 24), (19, 31)):
        ops = [(C.SHARPNESS, 0.3), (C.SHARPNESS, 1.9), (C.POSTERIZE, 2), (C.SOLARIZE, 127.5), (C.AUTOCONTRAST, 0),
               (C.EQUALIZE, 0), (C.INVERT, 0)] + cases._geometric_ops(h, w)
        y = cases._rows(h, len(ops), h, w)
        got = dj(y.cuda(), [[op] for op in ops]).cpu()
        want = cases._pils(y, [[op] for op in ops])
        for r, op in enumerate(ops):
            assert np.array_equal(got[r].numpy(), want[r]), (h, w, op)
    assert all(dj._exact[J._KIND[c]] for c in P.CODES if J._KIND[c] in dj._exact), dj._exact


def _gpu_rows_against(mixed_jpegs, V, step, workers, on_cpu, same=torch.equal, steps=None, end=None):
    """decode="device" on CUDA with ``step`` between the geometry and
    ``PILToTensor`` (or ``steps`` then ``end``), against the same loader
    without it: each row is
    ``on_cpu(row without it, the sample's draws)`` bit for bit, or as
    ``same(got, want)`` says (samples the CPU path prepared, CMYK and PNG,
    got it there, drawn alike; a corrupt stream's pixels are the decoder's
    own)."""
    from torchvision import datasets

    from coordl import _rng
    from coordl.device.encoded import plan_for

    steps = steps or [V.RandomResizedCrop(64), V.RandomHorizontalFlip()]
    end = end or V.PILToTensor()
    kw = dict(batch_size=6, seed=4, shuffle=False, num_workers=workers, device="cuda", decode="device")
    with_it = coordl.DataLoader(datasets.ImageFolder(mixed_jpegs, transform=V.Compose(steps + [step, end])), **kw)
    plain = coordl.DataLoader(datasets.ImageFolder(mixed_jpegs, transform=V.Compose(steps + [end])), **kw)
    got = [(x.cpu(), y.cpu()) for x, y in with_it]
    base = [(x.cpu(), y.cpu()) for x, y in plain]
    plan, ds = plan_for(with_it.dataset.transform), with_it.dataset
    i = 0
    for (a, y), (b, y2) in zip(got, base):
        assert torch.equal(y, y2)
        for r in range(len(y)):
            g = _rng.derive(4, 0, i)
            size = plan.device_size(ds.raw(i), i)
            if size is not None and not ds.samples[i][0].endswith("corrupt.jpg"):
                plan.draw(*size, g)
                assert same(a[r], on_cpu(b[r], plan.draw_ops(g))), i
            i += 1
    assert i == len(ds)


@needs_cuda
@pytest.mark.parametrize("version", [0, 1])
def test_gaussian_blur_on_cuda_is_within_a_level_on_a_few_values(version):
    """torchvision's GaussianBlur on CUDA (one grouped convolution in double
    precision with the CPU path's float32 kernels): within 1 level of
    torchvision's own blur on the CPU, on under 0.1% of the values (the
    measured bound, docs/guide/gpu.md), and its kind passed its first-use
    check there (no fallback to the CPU path's code)."""
    import sys

    import numpy as np

    from coordl.decode import color as C
    from coordl.device import jitter as J

    sys.path.insert(0, HERE)
    import test_device_policy as cases

    torch.manual_seed(1)
    y = torch.randint(0, 256, (6, 3, 96, 112), dtype=torch.uint8)
    y[3:] = y[3:] // 40 * 40
    ops = [[(C.BLUR, (23, 23, 0.1 + 0.35 * r, 0.1 + 0.35 * r, version))] for r in range(5)]
    ops.append([(C.BLUR, (5, 9, 0.8, 1.7, version))])
    dj = J.DeviceJitter(torch.device("cuda"))
    got = dj(y.cuda(), ops).cpu().numpy().astype(int)
    want = np.stack(cases._pils(y, ops))
    d = np.abs(got - want)
    assert d.max() <= 1 and (d > 0).mean() < 1e-3, (d.max(), (d > 0).mean())
    assert dj._exact[J._KIND[C.BLUR]] is True


@needs_cuda
@pytest.mark.parametrize("workers,version,policy", [(0, "v1", "ta_wide"), (2, "v2", "ra"), (2, "v1", "imagenet"),
                                                    (2, "v2", "ra_bilinear"), (0, "v1", "timm:rand-m7-mstd0.5"),
                                                    (2, "v1", "timm:original-bicubic"), (0, "v2", "geo:rotation"),
                                                    (2, "v1", "geo:affine_bicubic"), (2, "v2", "geo:perspective"),
                                                    (0, "v1", "geo:perspective_nearest"), (2, "v1", "timm:3a"),
                                                    (0, "v1", "timm:augmix-m3-w3"),
                                                    (2, "v2", "photo:RandomPhotometricDistort")])
def test_an_auto_augment_policy_on_the_gpu_is_pils_on_the_gpus_rows(mixed_jpegs, workers, version, policy):
    """torchvision's policies (the reference recipe's ``--auto-augment``) and
    timm's, and a RandomRotation, RandomAffine or RandomPerspective after the crop, with
    decode="device" on CUDA: bit for bit PIL's operations of each sample's
    draws on the rows the same loader makes without the policy (nearest,
    bilinear and bicubic affine maps among them)."""
    import sys

    sys.path.insert(0, HERE)
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    import test_device_policy as cases
    from torchvision import transforms as V1
    from torchvision.transforms import v2 as V2

    V = V1 if version == "v1" else V2
    t = cases.TIMM[policy[5:]](cases._timm_aa()) if policy.startswith("timm:") else \
        cases.GEOMETRIC[policy[4:]](V) if policy.startswith("geo:") else getattr(V, policy[6:])() \
        if policy.startswith("photo:") else cases.POLICIES[policy](V)
    _gpu_rows_against(mixed_jpegs, V, t, workers,
                      lambda row, ops: torch.from_numpy(cases._pils(row[None], [ops])[0].copy()))


@needs_cuda
@pytest.mark.parametrize("workers,version", [(0, "v1"), (2, "v2")])
def test_augmix_on_the_gpu_is_within_its_tolerance_of_the_cpu_mix(mixed_jpegs, workers, version):
    """torchvision's AugMix (the reference recipe's ``--auto-augment
    augmix``) with decode="device" on CUDA, torchvision's own functions
    running there: within 1 level of the CPU's mix of each sample's draws on
    the rows the same loader makes without it, on at most 0.1% of the
    values (its kind's stated tolerance), and its kind passed its first-use
    check there (no fallback to the CPU path's code)."""
    import sys

    sys.path.insert(0, HERE)
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    import test_device_policy as cases
    from torchvision import transforms as V1
    from torchvision.transforms import v2 as V2

    from coordl.decode import color as C
    from coordl.device import jitter as J

    V = V1 if version == "v1" else V2
    diffs = []
    _gpu_rows_against(mixed_jpegs, V, V.AugMix(), workers,
                      lambda row, ops: torch.from_numpy(cases._pils(row[None], [ops])[0].copy()),
                      same=lambda a, b: diffs.append((a.int() - b.int()).abs().flatten()) is None)
    d = torch.cat(diffs)
    assert int(d.max()) <= 1 and float((d > 0).float().mean()) <= 1e-3, (int(d.max()), float((d > 0).float().mean()))
    assert J.DeviceJitter(torch.device("cuda")).exact(J._KIND[C.AUGMIX])


@needs_cuda
@pytest.mark.parametrize("workers,version,policy", [(0, "v1", "ta_wide"), (2, "v2", "augmix"), (2, "v1", "imagenet")])
def test_a_policy_given_a_tensor_on_the_gpu_is_within_its_tolerance(mixed_jpegs, workers, version, policy):
    """The reference preset's ``backend="tensor"`` (PILToTensor before the
    crop) with a policy, decode="device" on CUDA: torchvision's own tensor
    functions of each sample's draws run there, within AugMix's stated
    tolerance of the same functions on the CPU (1 level, at most 0.1% of
    the values), and the kind passed its first-use check there."""
    import sys

    sys.path.insert(0, HERE)
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    import test_device_policy as cases
    from torchvision import transforms as V1
    from torchvision.transforms import v2 as V2

    from coordl.decode import color as C
    from coordl.device import jitter as J

    V = V1 if version == "v1" else V2
    diffs = []
    _gpu_rows_against(mixed_jpegs, V, cases.ON_TENSOR[policy](V), workers, cases._on_tensor,
                      same=lambda a, b: diffs.append((a.int() - b.int()).abs().flatten()) is None,
                      steps=[V.PILToTensor(), V.RandomResizedCrop(64, antialias=True), V.RandomHorizontalFlip()],
                      end=V.ToDtype(torch.uint8) if version == "v2" else V.ConvertImageDtype(torch.uint8))
    d = torch.cat(diffs)
    assert int(d.max()) <= 1 and float((d > 0).float().mean()) <= 1e-3, (int(d.max()), float((d > 0).float().mean()))
    assert J.DeviceJitter(torch.device("cuda")).exact(J._KIND[C.AUGMIX])


@needs_cuda
@pytest.mark.parametrize("workers,version", [(0, "v1"), (2, "v2")])
def test_colorjitter_on_the_gpu_is_the_cpu_jitter_of_the_gpus_rows(mixed_jpegs, workers, version):
    """torchvision's ColorJitter (v1, v2: this torchvision's own draws) with
    decode="device" on CUDA: bit for bit the CPU's jitter (coordl.decode.color,
    PIL's bytes) of the rows the same loader makes without it, with each
    sample's draws."""
    import sys

    sys.path.insert(0, HERE)
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    from torchvision import transforms as V1
    from torchvision.transforms import v2 as V2

    from coordl.decode import color as C

    V = V1 if version == "v1" else V2
    _gpu_rows_against(mixed_jpegs, V, V.ColorJitter(0.4, 0.4, 0.4, 0.1), workers,
                      lambda row, ops: torch.from_numpy(C.jitter(row.numpy(), ops)))


@needs_cuda
@pytest.mark.parametrize("workers,which", [(0, "v1"), (2, "timm")])
def test_randomerasing_on_the_gpu_erases_the_cpu_paths_rectangles(mixed_jpegs, workers, which):
    """torchvision's RandomErasing (an odd value per channel, which no
    normalized pixel has) and timm's (zeros, up to three rectangles, after a
    ColorJitter) erased on the GPU: exactly the pixels the CPU path erases,
    on every row (the device's, the workers' CMYK and PNG samples)."""
    import sys

    sys.path.insert(0, HERE)
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    from torchvision import datasets
    from torchvision import transforms as V

    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    if which == "v1":
        value, erase, jitter = (7.0, -9.0, 11.0), V.RandomErasing(0.6, value=(7.0, -9.0, 11.0)), []
    else:
        timm_re = pytest.importorskip("timm.data.random_erasing")
        value, erase, jitter = (0.0,) * 3, timm_re.RandomErasing(0.8, max_count=3, device="cpu"), [
            V.ColorJitter(0.4, 0.4, 0.4)]
    tf = V.Compose([V.RandomResizedCrop(64), V.RandomHorizontalFlip(), *jitter, V.ToTensor(), V.Normalize(mean, std),
                    erase])
    ds = datasets.ImageFolder(mixed_jpegs, transform=tf)
    kw = dict(batch_size=6, seed=4, shuffle=False, num_workers=workers)
    v = torch.tensor(value).view(1, 3, 1, 1)
    cpu = [(x == v).all(1) for x, _ in coordl.DataLoader(ds, **kw)]
    L = coordl.DataLoader(ds, device="cuda", decode="device", **kw)
    gpu = [(x.cpu() == v).all(1) for x, _ in L]
    assert len(cpu) == len(gpu) and any(bool(m.any()) for m in cpu)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b)
    assert "RandomErasing" in L.stats().device_decode


@needs_cuda
@pytest.mark.parametrize("value", [(0.0,), (7.0, -9.0, 11.0)])
def test_erasing_on_cuda_both_ways_is_torchvisions_erase(value):
    """The two ways of setting RandomErasing's rectangles on CUDA (a copy
    each; the batch's mask and a masked fill per channel) against
    torchvision's erase of each rectangle in turn, on the CPU: bit for bit."""
    import sys

    sys.path.insert(0, HERE)
    import _erase_cases as erase_cases

    from coordl.device import erase as ER

    y, rows, want = erase_cases.case(value, b=33, h=64, w=48)
    kept = ER.FEW_RECTS
    try:
        for few in (0, 10 ** 9):
            ER.FEW_RECTS = few
            got = ER.erase_rows(y.cuda(), rows, ER.value_on(value, torch.device("cuda"))).cpu()
            assert torch.equal(got, want), few
    finally:
        ER.FEW_RECTS = kept


@needs_cuda
@pytest.mark.parametrize("workers,which", [(0, "torchvision"), (2, "timm")])
def test_a_jitter_and_erasing_recipe_split_on_cuda_is_the_cpu_paths(photos, workers, which):
    """timm's default recipe with an erasing after Normalize (torchvision's
    value per channel; timm's, several rectangles, enough of them in a batch
    for the mask) through torchvision's ImageFolder with device="cuda": uint8
    travels, the GPU converts and erases; the batches are the CPU path's, bit
    for bit."""
    import sys

    sys.path.insert(0, HERE)
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    from torchvision import datasets
    from torchvision import transforms as V

    if which == "timm":
        erase = pytest.importorskip("timm.data.random_erasing").RandomErasing(1.0, max_count=4, device="cpu")
    else:
        erase = V.RandomErasing(0.7, value=(7.0, -9.0, 11.0))
    tf = V.Compose([V.RandomResizedCrop(32), V.RandomHorizontalFlip(), V.ColorJitter(0.4, 0.4, 0.4), V.ToTensor(),
                    V.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]), erase])
    ds = datasets.ImageFolder(photos, transform=tf)
    kw = dict(batch_size=8, seed=4, shuffle=True, num_workers=workers)
    plain = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cuda", **kw)
    got = [(x.cpu(), y.cpu()) for x, y in L]
    st = L.stats()
    assert st.device_split.startswith("split") and "RandomErasing" in st.device_split and not st.device_split_cpu_samples
    assert len(got) == len(plain)
    for (a, y), (b, y2) in zip(got, plain):
        assert torch.equal(a, b) and torch.equal(y, y2)


@needs_cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_torchvisions_mixup_cutmix_collate_on_the_gpu_is_the_cpu_paths(mixed_jpegs, workers):
    """references/classification/train.py's collate_fn (RandomChoice of
    MixUp and CutMix over default_collate's batch) with decode="device":
    it runs on the GPU's images with the CPU path's draws; the batch is all
    on the GPU, its labels the CPU path's bit for bit, its images within
    the decode's bound."""
    import sys

    from torch.utils.data import default_collate

    sys.path.insert(0, HERE)
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    from torchvision import datasets
    from torchvision.transforms import v2

    mixup_cutmix = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=3), v2.CutMix(alpha=1.0, num_classes=3)])

    def collate_fn(batch):
        return mixup_cutmix(*default_collate(batch))

    tf = v2.Compose([v2.RandomResizedCrop(64), v2.RandomHorizontalFlip(), v2.PILToTensor(),
                     v2.ToDtype(torch.float, scale=True), v2.Normalize(NORM.mean, NORM.std)])
    ds = datasets.ImageFolder(mixed_jpegs, transform=tf)
    kw = dict(batch_size=6, seed=4, shuffle=True, num_workers=workers, collate_fn=collate_fn)
    cpu = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cuda", decode="device", **kw)
    gpu = list(L)
    assert len(cpu) == len(gpu)
    for (a, y), (b, y2) in zip(cpu, gpu):
        assert b.is_cuda and y2.is_cuda and b.shape == a.shape
        assert torch.equal(y, y2.cpu())
        d = _levels(a, b.cpu())
        assert float(d.mean()) <= DECODE_MEAN and float(d.max()) <= DECODE_MAX
    assert L.stats().device_decode_images + L.stats().device_decode_cpu_images == len(ds)


@needs_cuda
def test_a_v2_conversion_tail_on_cuda_is_torchvisions_bit_for_bit():
    """v2's ToDtype(scale=True) multiplies by 1/255: the tail's multiply by
    a float32 tensor on the GPU gives torchvision's CPU values."""
    import sys

    sys.path.insert(0, HERE)
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    from torchvision.transforms import v2

    from coordl.device.split import DeviceTail

    x = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(3, 16, 16).contiguous()
    want = v2.Normalize(NORM.mean, NORM.std)(v2.ToDtype(torch.float32, scale=True)(v2.ToImage()(x)))
    got = DeviceTail([NORM], reciprocal=True)(x.cuda()).cpu()
    assert torch.equal(got, want.as_subclass(torch.Tensor))


@needs_cuda
@pytest.mark.parametrize("which", ["v2-random", "timm-pixel"])
def test_noise_erasing_on_the_gpu_is_the_cpu_paths(mixed_jpegs, which):
    """Erasing with noise on the GPU: the erased pixels are the CPU path's
    values bit for bit (the workers' noise), the rest within the decode's
    bound."""
    import sys

    sys.path.insert(0, HERE)
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    from torchvision import datasets
    from torchvision.transforms import v2

    if which == "timm-pixel":
        timm_re = pytest.importorskip("timm.data.random_erasing")
        erase = timm_re.RandomErasing(0.8, mode="pixel", max_count=3, device="cpu")
    else:
        erase = v2.RandomErasing(0.7, value="random")
    base = [v2.RandomResizedCrop(64), v2.RandomHorizontalFlip(), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(NORM.mean, NORM.std)]
    kw = dict(batch_size=6, seed=4, shuffle=False, num_workers=2)
    cpu = list(coordl.DataLoader(datasets.ImageFolder(mixed_jpegs, transform=v2.Compose(base + [erase])), **kw))
    without = list(coordl.DataLoader(datasets.ImageFolder(mixed_jpegs, transform=v2.Compose(base)), **kw))
    L = coordl.DataLoader(datasets.ImageFolder(mixed_jpegs, transform=v2.Compose(base + [erase])), device="cuda",
                          decode="device", **kw)
    gpu = [(x.cpu(), y.cpu()) for x, y in L]
    erased = 0
    for (a, _), (a0, _), (b, _) in zip(cpu, without, gpu):
        m = a != a0
        erased += int(m.sum())
        assert torch.equal(a[m], b[m])
    assert erased > 0 and "noise" in L.stats().device_decode


@needs_cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_a_folder_read_by_decode_image_decodes_on_the_gpu_within_the_bound(mixed_jpegs, workers):
    """torchvision's ``ImageFolder(loader=partial(decode_image, mode=RGB))``
    with a v2 tensor pipeline and ``decode="device"``: the JPEGs decoded on
    the GPU within the bound of the CPU path (coordl's own, the same draws);
    the CMYK JPEG and the PNG decoded by torchvision's function in the
    workers, their very pixels."""
    import functools

    import sys
    sys.path.insert(0, HERE)
    from _torchvision import import_torchvision

    tv = import_torchvision()
    if tv is None:
        pytest.skip("torchvision is not installed")
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms import v2

    tf = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(),
                     v2.ToDtype(torch.float32, scale=True), v2.Normalize(NORM.mean, NORM.std)])
    ds = tv.datasets.ImageFolder(mixed_jpegs, tf, loader=functools.partial(decode_image, mode=ImageReadMode.RGB))
    names, _, cpu, L, got = _cpu_and_gpu_decode(ds, workers)
    row = 0
    for (a, y), (b, y2) in zip(cpu, got):
        assert b.is_cuda and torch.equal(y, y2.cpu()) and b.shape == a.shape
        b = b.cpu()
        for k in range(len(y)):
            d = _levels(a[k:k + 1], b[k:k + 1])
            if names[row + k] in ("cmyk.jpg", "png.jpg"):
                assert float(d.max()) == 0, names[row + k]
            elif names[row + k] != "corrupt.jpg":
                assert float(d.mean()) <= DECODE_MEAN and float(d.max()) <= DECODE_MAX, names[row + k]
        row += len(y)
    st = L.stats()
    assert st.path == "coordl" and st.device_decode_images + st.device_decode_cpu_images == len(ds)
    assert 2 <= st.device_decode_cpu_images <= 3
