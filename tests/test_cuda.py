"""The real CUDA path of device delivery (issue 21 item 7): streams,
events, pinned buffers, ``record_stream`` and the bit-identical check
against the CPU path.  Runs wherever CUDA is present; skipped otherwise
(the same code is tested through its seams in test_device*.py)."""
import collections
import threading

import pytest
import torch

import coordl
from coordl.device import delivery as D
from coordl import transforms as T

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NORM = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
Pair = collections.namedtuple("Pair", "image label")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    from coordl.synth import make_image_folder

    root = tmp_path_factory.mktemp("cuda") / "photos"
    make_image_folder(str(root), num_images=24, num_classes=2, mean_kb=2, image_size=(40, 32), seed=2)
    return str(root)


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
