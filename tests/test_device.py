"""Device delivery (coordl.device) on a machine without an accelerator: the
pinned ring, its reuse rule and the device tail through the HostStreams
seam, and the whole loader path with the CPU as the "device"."""
import warnings

import pytest
import torch

import coordl
from coordl.device import delivery as D
from coordl import transforms as T


def _batches(n, shape=(4, 3, 8, 8)):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, shape, dtype=torch.uint8, generator=g), torch.arange(shape[0]) + 10 * k)
            for k in range(n)]


def test_a_pinned_slot_is_reused_only_after_its_copy_finished():
    st = D.HostStreams(auto=False)              # copies "finish" only when the test says
    dd = D.DeviceDelivery(torch.device("cpu"), st, ring=2)
    src = _batches(5)
    out = [dd.deliver(src[0]), dd.deliver(src[1])]
    assert dd.waits == 0
    ev0 = dd.slots[0].event
    n = len(st.log)
    out.append(dd.deliver(src[2]))              # slot 0 again, its copy still "running": wait for it
    assert dd.waits == 1 and st.log[n] == ("synchronize", ev0)
    dd.slots[1].event.complete()                 # slot 1's copy finished: no wait
    out.append(dd.deliver(src[3]))
    assert dd.waits == 1
    out.append(dd.deliver(src[4]))
    # every delivered batch is its own batch (never a view of a ring buffer reused later)
    for got, want in zip(out, src):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_training_stream_waits_for_each_copy_on_the_device():
    st = D.HostStreams()
    dd = D.DeviceDelivery(torch.device("cpu"), st, ring=2)
    for b in _batches(3):
        dd.deliver(b)
    records = [i for i, x in enumerate(st.log) if x[0] == "record"]
    waits = [i for i, x in enumerate(st.log) if x[0] == "wait_event"]
    assert len(records) == len(waits) == 3
    for r, w in zip(records, waits):
        assert r < w and st.log[w][1] == "current" and st.log[w][2] is st.log[r][1]
    # the copies and the tail run on the copy stream
    assert [x for x in st.log if x[0] == "use"] == [("use", "copy")] * 3


def test_the_tail_is_the_cpu_transforms_on_the_batch():
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    imgs = torch.randint(0, 256, (5, 3, 7, 9), dtype=torch.uint8)
    want = torch.stack([norm(T.ToTensor()(im.permute(1, 2, 0).numpy())) for im in imgs])
    tail = D.DeviceTail([norm])
    assert torch.equal(tail(imgs), want)
    # applied at the paths the split marked, nowhere else
    got = tail.apply((imgs, torch.arange(5)), [(0,)])
    assert isinstance(got, tuple) and torch.equal(got[0], want) and torch.equal(got[1], torch.arange(5))
    assert torch.equal(tail.apply([imgs], [(0,)])[0], want)
    got = tail.apply({"a": [7, imgs], "b": imgs}, [("a", 1)])
    assert torch.equal(got["a"][1], want) and got["b"] is imgs


def test_split_for_device_keeps_the_users_dataset(photos):
    tf = T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize([0.5] * 3, [0.25] * 3)])
    ds = coordl.ImageFolder(photos, transform=tf)
    split = D.split_for_device(ds)
    assert ds.transform is tf and type(tf.transforms[2]) is T.ToTensor        # untouched
    assert isinstance(split.dataset, D.SplitPrep) and split.tail is not None
    assert split.note.startswith("split")
    # outside a split prep the copy's transform is the user's whole transform
    img = coordl.datasets.pil_decode(ds.raw(0))
    torch.manual_seed(0)
    want = tf(img)
    torch.manual_seed(0)
    assert torch.equal(split.dataset.transform(img), want)
    # nothing to split: no ToTensor at the end
    plain = coordl.ImageFolder(photos, transform=T.Compose([T.RandomResizedCrop(16), T.PILToTensor()]))
    split = D.split_for_device(plain)
    assert split.dataset is plain and split.tail is None and split.note.startswith("not split")


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("dev", num_images=24, num_classes=2, mean_kb=2, image_size=(40, 32), seed=1)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_device_path_delivers_what_the_cpu_path_delivers(photos, monkeypatch, workers):
    tf = T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = coordl.ImageFolder(photos, transform=tf)
    plain = [b for b in coordl.DataLoader(ds, batch_size=5, seed=4, shuffle=True, num_workers=workers)]
    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)
    import threading

    where = []
    real_stage = D.DeviceDelivery.stage
    monkeypatch.setattr(D.DeviceDelivery, "stage",
                        lambda self, b, *a: where.append(threading.current_thread().name) or real_stage(self, b, *a))
    L = coordl.DataLoader(ds, batch_size=5, seed=4, shuffle=True, num_workers=workers, device="cpu")
    got = list(L)
    assert L._device_tail is not None           # Normalize moved to the "device"
    # with workers the copies start in the pin thread, ahead of the training loop
    assert set(where) == ({"coordl-pin-memory"} if workers else {threading.current_thread().name})
    assert L._delivery is not None and L._delivery.k == len(got)
    assert len(got) == len(plain)
    for a, b in zip(got, plain):
        assert a[0].dtype == torch.float32 and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_pin_memory_without_an_accelerator_warns_and_works(photos, no_accelerator):
    ds = coordl.ImageFolder(photos, transform=T.Compose([T.RandomResizedCrop(16), T.PILToTensor()]))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        n = sum(len(b[0]) for b in coordl.DataLoader(ds, batch_size=4, seed=0, pin_memory=True,
                                                      num_workers=2, device="cpu"))
    assert n == 24
    pinned = [x for x in w if "pin" in str(x.message)]
    assert len(pinned) == 1 and "no accelerator" in str(pinned[0].message)
