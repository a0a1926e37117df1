"""Several decoders sharing each batch of ``decode="device"``
(``COORDL_DEVICE_DECODER="a+b:2"``, :class:`coordl.device.decoders.DecoderSplit`),
on the CPU: the stand-in decoder takes each named decoder's place, so the
split, its threads, its order and its errors run here as on a GPU
(tests/test_cuda.py runs it with the real decoders)."""
import os
import threading

import numpy as np
import pytest
import torch

import coordl
from coordl import transforms as T
from coordl.device import decoders as DD
from coordl.device import delivery as D

NORM = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("split", num_images=24, num_classes=3, mean_kb=6, image_size=(96, 72), seed=9)


def _streams(root, n=10):
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)[:n]
    return [torch.from_numpy(np.fromfile(f, dtype=np.uint8)) for f in files]


class _Watching(DD.HostDecoder):
    """The stand-in, noting the thread and the streams of each call."""

    def __init__(self, tag, calls, fail=False):
        super().__init__()
        self.tag, self.calls, self.fail = tag, calls, fail
        self.finished = self.released = 0

    def decode(self, streams):
        self.calls.append((self.tag, threading.current_thread().name, len(streams)))
        if self.fail:
            raise MemoryError(f"decoder {self.tag} is out of memory")
        return super().decode(streams)

    def finish(self):
        self.finished += 1

    def release(self):
        self.released += 1
        return [self.tag]


@pytest.mark.parametrize("text,want", [
    (None, [("auto", 1.0)]),
    ("", [("auto", 1.0)]),
    ("torchvision", [("torchvision", 1.0)]),
    (" NVIMGCODEC-HW : 2 + torchvision ", [("nvimgcodec-hw", 2.0), ("torchvision", 1.0)]),
    ("auto+auto:0.5+nvimgcodec", [("auto", 1.0), ("auto", 0.5), ("nvimgcodec", 1.0)]),
    ("torchvision:3+nvimgcodec-hybrid:2", [("torchvision", 3.0), ("nvimgcodec-hybrid", 2.0)]),
])
def test_the_decoder_setting_is_read_as_names_and_weights(monkeypatch, text, want):
    monkeypatch.delenv("COORDL_DEVICE_DECODER", raising=False)
    if text is not None:
        monkeypatch.setenv("COORDL_DEVICE_DECODER", text)
    assert DD.decoder_spec() == want


@pytest.mark.parametrize("text", ["pillow", "torchvision+", "torchvision:0", "nvimgcodec:-1", "auto:x", "auto:inf"])
def test_a_wrong_decoder_setting_names_the_grammar(monkeypatch, text):
    monkeypatch.setenv("COORDL_DEVICE_DECODER", text)
    with pytest.raises(ValueError, match=r'COORDL_DEVICE_DECODER should be one of "auto", "torchvision", '
                                         r'"nvimgcodec", "nvimgcodec-hw", "nvimgcodec-hybrid" or "nvimgcodec-cuda", '
                                         r'or several of them joined by "\+"'):
        DD.decoder_for(torch.device("cpu"))


def test_one_name_is_one_decoder_and_several_are_a_split(monkeypatch):
    monkeypatch.setenv("COORDL_DEVICE_DECODER", "auto")
    assert type(DD.decoder_for(torch.device("cpu"))) is DD.HostDecoder
    monkeypatch.setenv("COORDL_DEVICE_DECODER", "torchvision:3+nvimgcodec-hw")
    split = DD.decoder_for(torch.device("cpu"))
    assert type(split) is DD.DecoderSplit and split.weights == [3.0, 1.0]
    assert all(type(d) is DD.HostDecoder for d in split.parts) and " + " in split.name


@pytest.mark.parametrize("text,fancy", [
    ("auto", [False]), ("torchvision", [False]), ("nvimgcodec", [True]), ("nvimgcodec-hw", [True]),
    ("torchvision:3+nvimgcodec-hybrid:2", [False, True]), ("nvimgcodec-cuda", [False]),
    ("nvimgcodec-hw+nvimgcodec-cuda", [True, False]),
])
def test_the_stand_in_upsamples_chroma_as_the_decoder_it_stands_for(monkeypatch, text, fancy):
    """nvImageCodec interpolates chroma (every variant, measured on a GPU),
    torchvision's nvJPEG call does not: each named decoder's stand-in does
    as it does, so a stand-in run gives that decoder's pixels."""
    monkeypatch.setenv("COORDL_DEVICE_DECODER", text)
    got = DD.decoder_for(torch.device("cpu"))
    parts = got.parts if isinstance(got, DD.DecoderSplit) else [got]
    assert [not d._fast for d in parts] == fancy
    assert [("interpolated" in d.name) for d in parts] == fancy
    from PIL import Image
    import io

    import numpy as np

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (32, 48, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    want = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))   # libjpeg, interpolated chroma
    for d, f in zip(parts, fancy):
        img = d.decode([data])[0].permute(1, 2, 0).numpy()
        assert np.array_equal(img, want) == f


@pytest.mark.parametrize("weights,n,want", [
    ([1, 1], 10, [(0, 5), (5, 10)]),
    ([1, 2], 9, [(0, 3), (3, 9)]),
    ([2, 1, 1], 128, [(0, 64), (64, 96), (96, 128)]),
    ([1, 1], 1, [(0, 0), (0, 1)]),
    ([1, 3], 0, [(0, 0), (0, 0)]),
])
def test_shares_are_contiguous_and_by_weight(weights, n, want):
    split = DD.DecoderSplit([(DD.HostDecoder(), w) for w in weights], torch.device("cpu"))
    assert split.shares(n) == want


@pytest.mark.parametrize("bad_at", [None, 0, 4, 9])
def test_a_split_decodes_what_one_decoder_decodes_in_order(photos, bad_at):
    """Every image in its stream's place, equal to one decoder's; a stream
    no decoder can read is an error in its own place in whichever share;
    the shares after the first run in threads of their own."""
    streams = _streams(photos)
    if bad_at is not None:
        streams[bad_at] = torch.frombuffer(bytearray(b"not a jpeg" * 30), dtype=torch.uint8)
    calls = []
    parts = [(_Watching("a", calls), 1), (_Watching("b", calls), 2), (_Watching("c", calls), 1)]
    split = DD.DecoderSplit(parts, torch.device("cpu"))
    got, want = split.decode(streams), DD.HostDecoder().decode(streams)
    assert len(got) == len(want) == 10
    for i, (a, b) in enumerate(zip(got, want)):
        if i == bad_at:
            assert isinstance(a, Exception) and isinstance(b, Exception)
        else:
            assert torch.equal(a, b), i
    assert sorted((tag, n) for tag, _, n in calls) == [("a", 2), ("b", 6), ("c", 2)]
    names = {tag: thread for tag, thread, _ in calls}
    assert names["a"] == threading.current_thread().name
    assert names["b"].startswith("coordl-device-decode-part") and names["c"].startswith("coordl-device-decode-part")
    assert names["b"] != names["c"]
    assert split.images == [2, 6, 2]
    split.finish()
    assert [d.finished for d, _ in parts] == [1, 1, 1]
    assert split.release() == ["a", "b", "c"]


@pytest.mark.parametrize("failing", [0, 1])
def test_a_decoder_that_fails_fails_the_call_after_every_share_returned(photos, failing):
    calls = []
    parts = [(_Watching("a", calls, fail=failing == 0), 1), (_Watching("b", calls, fail=failing == 1), 1)]
    split = DD.DecoderSplit(parts, torch.device("cpu"))
    with pytest.raises(MemoryError, match=f"decoder {'ab'[failing]} is out of memory"):
        split.decode(_streams(photos, 6))
    assert sorted(tag for tag, _, _ in calls) == ["a", "b"]
    # the split is still usable once the decoder recovers
    parts[failing][0].fail = False
    assert len(split.decode(_streams(photos, 6))) == 6


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_with_a_split_delivers_one_decoders_batches(photos, monkeypatch, workers):
    """The whole path, CPU device: the same batches, labels and counts with
    three decoders sharing each batch as with one; the split is named."""
    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)
    tf = T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.ToTensor(), NORM])
    ds = coordl.ImageFolder(photos, tf)
    kw = dict(batch_size=5, seed=3, shuffle=True, num_workers=workers, device="cpu", decode="device")
    monkeypatch.setenv("COORDL_DEVICE_DECODER", "auto")
    one = coordl.DataLoader(ds, **kw)
    want = [list(one) for _ in range(2)]
    monkeypatch.setenv("COORDL_DEVICE_DECODER", "torchvision+torchvision:2+auto")
    L = coordl.DataLoader(ds, **kw)
    got = [list(L) for _ in range(2)]
    for e in range(2):
        assert len(got[e]) == len(want[e]) == 5
        for (a, y), (b, y2) in zip(want[e], got[e]):
            assert torch.equal(a, b) and torch.equal(y, y2)
    st = L.stats()
    assert st.device_decode_images == 2 * len(ds) and st.device_decode_cpu_images == 0
    assert st.device_decode.count("CPU stand-in") == 3
    # weights 1, 2, 1: a batch of 5 is cut 1 + 3 + 1, the last batch of 4, 1 + 2 + 1; two passes
    assert L._decoder.images == [2 * 5, 2 * 14, 2 * 5]


def test_a_split_resumes_mid_epoch_exactly(photos, monkeypatch):
    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)
    monkeypatch.setenv("COORDL_DEVICE_DECODER", "auto+auto")
    tf = T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.ToTensor(), NORM])
    ds = coordl.ImageFolder(photos, tf)
    kw = dict(batch_size=4, seed=5, shuffle=True, num_workers=2, device="cpu", decode="device")
    L = coordl.DataLoader(ds, **kw)
    it = iter(L)
    first = [next(it) for _ in range(2)]
    state = L.state_dict()
    rest = list(it)
    R = coordl.DataLoader(ds, **kw)
    R.load_state_dict(state)
    again = list(R)
    assert len(first) + len(rest) == 6 and len(again) == len(rest)
    for (a, y), (b, y2) in zip(rest, again):
        assert torch.equal(a, b) and torch.equal(y, y2)


def test_a_dropped_loader_leaves_no_decode_threads(photos, monkeypatch):
    """The split's threads end with the loader that made them."""
    import gc
    import time

    def parts():
        return {t for t in threading.enumerate() if t.name.startswith("coordl-device-decode-part")}

    gc.collect()
    before = parts()          # another test's, if any is still being collected
    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)
    monkeypatch.setenv("COORDL_DEVICE_DECODER", "auto+auto+auto")
    ds = coordl.ImageFolder(photos, T.Compose([T.RandomResizedCrop(16), T.ToTensor()]))
    L = coordl.DataLoader(ds, batch_size=6, num_workers=0, device="cpu", decode="device")
    assert len(list(L)) == 4
    ours = parts() - before
    assert len(ours) == 2
    del L
    gc.collect()
    deadline = time.monotonic() + 10
    while ours & parts() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ours & parts()


# ---------------------------------------------------------------- nvImageCodec's CPU threads
@pytest.mark.parametrize("value,workers,want", [(None, 0, 1), (None, 1, 1), (None, 8, 8), ("", 15, 15),
                                                ("0", 8, 0), (" 6 ", 2, 6)])
def test_nvimgcodecs_threads_are_the_workers_unless_set(monkeypatch, value, workers, want):
    monkeypatch.delenv("COORDL_DEVICE_DECODER_THREADS", raising=False)
    if value is not None:
        monkeypatch.setenv("COORDL_DEVICE_DECODER_THREADS", value)
    assert DD.decoder_threads(workers) == want


@pytest.mark.parametrize("value", ["-1", "many", "2.5"])
def test_a_wrong_thread_count_fails_when_the_loader_is_made(monkeypatch, photos, value):
    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)
    monkeypatch.setenv("COORDL_DEVICE_DECODER_THREADS", value)
    ds = coordl.ImageFolder(photos, T.Compose([T.RandomResizedCrop(16), T.ToTensor()]))
    with pytest.raises(ValueError, match=r"COORDL_DEVICE_DECODER_THREADS should be a whole number of CPU threads "
                                         r"for nvImageCodec's decoding, or 0 for one per core; but got "):
        coordl.DataLoader(ds, batch_size=6, device="cpu", decode="device")


@pytest.mark.parametrize("workers,value,want", [(2, None, 2), (0, None, 1), (1, "0", 0), (2, "12", 12)])
def test_the_loader_gives_its_decoders_its_worker_count(monkeypatch, photos, workers, value, want):
    """A loader's nvImageCodec decoding uses as many CPU threads as it has
    workers (as DALI's num_threads), not one per core in each of a node's
    loaders."""
    from coordl.device import decode as DE

    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)
    monkeypatch.delenv("COORDL_DEVICE_DECODER_THREADS", raising=False)
    if value is not None:
        monkeypatch.setenv("COORDL_DEVICE_DECODER_THREADS", value)
    seen = []
    real = DE.decoder_for
    monkeypatch.setattr(DE, "decoder_for", lambda dev, **kw: seen.append(kw) or real(dev, **kw))
    ds = coordl.ImageFolder(photos, T.Compose([T.RandomResizedCrop(16), T.ToTensor()]))
    coordl.DataLoader(ds, batch_size=6, num_workers=workers, device="cpu", decode="device")
    assert seen == [{"cpu_threads": want}]


class _FakeNvImageCodec:
    """``nvidia.nvimgcodec``'s names the decoder uses, recording how its
    Decoder is made."""

    NVIMGCODEC_DEVICE_CPU_ONLY = -99

    def __init__(self):
        self.made = []
        fake = self

        class Decoder:
            def __init__(self, **kw):
                fake.made.append(kw)

        class Backend:
            def __init__(self, kind):
                self.kind = kind

        class Kinds:
            HW_GPU_ONLY, GPU_ONLY, HYBRID_CPU_GPU, CPU_ONLY = "hw", "gpu", "hybrid", "cpu"

        class ColorSpec:
            RGB = "rgb"

        self.Decoder, self.Backend, self.BackendKind, self.ColorSpec = Decoder, Backend, Kinds, ColorSpec
        self.DecodeParams = lambda **kw: kw


@pytest.mark.parametrize("threads", [0, 1, 6])
def test_nvimgcodec_is_made_with_the_thread_bound(monkeypatch, threads):
    import sys
    import types

    fake = _FakeNvImageCodec()
    pkg = types.ModuleType("nvidia")
    pkg.nvimgcodec = fake
    monkeypatch.setitem(sys.modules, "nvidia", pkg)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", fake)
    dec = DD.NvImageCodecDecoder(torch.device("cpu"), cpu_threads=threads)
    assert len(fake.made) == 1
    assert fake.made[0].get("max_num_cpu_threads") == (threads or None)
    assert dec.name == "nvImageCodec" + (f", {threads} CPU threads" if threads else "")


# ---------------------------------------------------------------- the workers' share
def test_workers_is_a_share_beside_a_device_decoder(monkeypatch):
    assert DD.decoder_spec("torchvision:28+workers:1") == [("torchvision", 28.0), ("workers", 1.0)]
    for text in ("workers", "workers:2", "auto+workers+workers"):
        with pytest.raises(ValueError, match=r'"workers" \(the loader\'s workers decoding a share of the samples on '
                                             r'the CPU\) comes once, beside a device decoder.*use decode="cpu"'):
            DD.decoder_spec(text)
    monkeypatch.setenv("COORDL_DEVICE_DECODER", "auto:2+workers:1+auto")
    split = DD.decoder_for(torch.device("cpu"))      # the workers never reach the stage's decoders
    assert type(split) is DD.DecoderSplit and split.weights == [2.0, 1.0]


@pytest.mark.parametrize("text,workers,want", [
    ("torchvision:28+workers:1", 15, 15 / 43), ("torchvision:28+workers:1", 4, 4 / 32),
    ("torchvision:28+workers:1", 0, 0.0), ("auto:2+workers:0.5+auto:2", 2, 1 / 5), ("torchvision", 8, 0.0)])
def test_the_workers_share_grows_with_the_workers(text, workers, want):
    assert DD.cpu_share(workers, DD.decoder_spec(text)) == pytest.approx(want)


@pytest.mark.parametrize("share", [0.1, 0.25, 15 / 43, 0.5])
def test_the_workers_samples_are_spread_by_index(share):
    """Any run of consecutive indices holds the share, to within two
    samples; a function of the index alone."""
    from coordl.device.encoded import plan_for

    plan = plan_for(T.Compose([T.RandomResizedCrop(8), T.ToTensor()]))
    plan.cpu_share = share
    on = [plan.on_cpu(i) for i in range(20000)]
    for start in (0, 1, 777, 12345):
        for n in (16, 128, 1000):
            assert abs(sum(on[start:start + n]) - share * n) <= 2, (start, n)
    assert on == [plan.on_cpu(i) for i in range(20000)]
    assert [plan.on_cpu(np.int64(i)) for i in range(2 ** 40, 2 ** 40 + 64)] == \
        [plan.on_cpu(i) for i in range(2 ** 40, 2 ** 40 + 64)]       # a sampler's numpy index, a large one
    plan.cpu_share = 0.0
    assert not any(plan.on_cpu(i) for i in range(1000))


def _share_loaders(photos, monkeypatch, workers, spec="auto:4+workers:1", **kw):
    monkeypatch.setenv("COORDL_DEVICE_DECODER", spec)
    ds = coordl.ImageFolder(photos, T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToTensor(),
                                               NORM]))
    kw = dict(batch_size=5, seed=3, shuffle=False, num_workers=workers, **kw)
    return ds, coordl.DataLoader(ds, device="cpu", decode="device", **kw), coordl.DataLoader(ds, **kw)


@pytest.mark.parametrize("workers,batch_path,spec", [(0, True, "auto:4+workers:1"), (2, True, "auto:4+workers:1"),
                                                     (2, False, "auto:4+workers:1"),
                                                     (2, True, "auto:2+workers:1+auto:2")])   # beside a split
def test_the_workers_share_is_the_cpu_paths_pixels(photos, monkeypatch, workers, batch_path, spec):
    """Each sample the share gives the workers is the CPU path's, bit for
    bit (decoded, cropped, resized and flipped there; converted on the
    device as a split batch is); the others are the device decoder's; the
    statistics count them; whether a worker reads batches or samples does
    not change a pixel.  The rows the workers prepared are gathered for
    their copy by the fetch thread (by the calling thread without
    workers), never by the decode thread."""
    from coordl.device import decode as DE
    from coordl.device.encoded import plan_for
    from coordl.pipeline import device_batches

    monkeypatch.setattr(device_batches, "ENABLED", batch_path)
    gathered = set()
    real_prepare = DE.DecodeStage.prepare

    def prepare(self, batch, stats):
        gathered.add(threading.current_thread().name)
        return real_prepare(self, batch, stats)

    monkeypatch.setattr(DE.DecodeStage, "prepare", prepare)
    if workers:
        ds, L, C = _share_loaders(photos, monkeypatch, workers, spec)
    else:
        with pytest.warns(UserWarning, match=r'names "workers", but this loader has num_workers=0: no sample is '
                                             r"prepared on the CPU path"):
            ds, L, C = _share_loaders(photos, monkeypatch, workers, spec)
    assert (type(L._decoder) is DD.DecoderSplit) == (spec.count("auto") == 2)
    plan = plan_for(ds.transform)
    plan.cpu_share = DD.cpu_share(workers)
    got, want = list(L), list(C)
    cpu_rows = on_cpu = 0
    for b, ((x, y), (x2, y2)) in enumerate(zip(got, want)):
        assert torch.equal(y, y2)
        for j in range(x.shape[0]):
            if plan.on_cpu(b * 5 + j):
                on_cpu += 1
                assert torch.equal(x[j], x2[j]), (b, j)
            cpu_rows += int(torch.equal(x[j], x2[j]))
    st = L.stats()
    assert st.device_decode_cpu_images == on_cpu and st.device_decode_images == len(ds) - on_cpu
    if workers:
        assert 0 < on_cpu < len(ds) and "the workers decode 33% of the samples on the CPU path" in st.device_decode
    else:           # without workers the main process's time is the device stage's: no share
        assert on_cpu == 0 and "workers decode" not in st.device_decode
    assert cpu_rows >= on_cpu
    assert gathered == ({"coordl-device-fetch"} if workers else {threading.main_thread().name})


def test_the_workers_share_resumes_mid_epoch_exactly(photos, monkeypatch):
    ds, L, _ = _share_loaders(photos, monkeypatch, 2)
    L2 = coordl.DataLoader(ds, device="cpu", decode="device", batch_size=4, seed=5, shuffle=True, num_workers=2)
    it = iter(L2)
    first = [next(it) for _ in range(2)]
    state = L2.state_dict()
    rest = list(it)
    R = coordl.DataLoader(ds, device="cpu", decode="device", batch_size=4, seed=5, shuffle=True, num_workers=2)
    R.load_state_dict(state)
    again = list(R)
    assert len(first) + len(rest) == 6 and len(again) == len(rest)
    for (a, y), (b, y2) in zip(rest, again):
        assert torch.equal(a, b) and torch.equal(y, y2)
    assert R.stats().device_decode_cpu_images > 0


def test_the_workers_share_lands_beside_the_files_bytes_without_packing_the_batch_again(photos, monkeypatch):
    """The batch path keeps room after a batch's file bytes for the images
    its share prepares on the CPU path: they are written there, and the
    batch is not packed again (a copy of every file's bytes per batch);
    the batches are the per-sample path's."""
    from coordl.pipeline import collate, device_batches

    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)
    monkeypatch.setattr(DD, "cpu_share", lambda workers, spec=None: 0.5)   # a share without workers' processes
    packed = []
    real = collate.pack_payloads
    monkeypatch.setattr(collate, "pack_payloads", lambda b, rows, slots: packed.append(len(rows)) or real(b, rows, slots))
    ds = coordl.ImageFolder(photos, T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToTensor(),
                                               NORM]))
    kw = dict(batch_size=5, seed=3, shuffle=True, device="cpu", decode="device")
    L = coordl.DataLoader(ds, **kw)
    got = list(L)
    assert packed == [] and L.stats().device_decode_cpu_images > 0
    monkeypatch.setattr(device_batches, "ENABLED", False)
    want = list(coordl.DataLoader(ds, **kw))
    assert packed                                   # the per-sample path packs every batch
    assert len(got) == len(want)
    for (a, y), (b, y2) in zip(got, want):
        assert torch.equal(a, b) and torch.equal(y, y2)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_the_cpu_path_made_whole_is_delivered_as_it_is(photos, monkeypatch, workers):
    """Every sample the workers' share: each batch is the CPU path's bit
    for bit, its rows taken as they are (no float batch rounded again),
    then through the device tail; nothing decoded on the device."""
    from coordl.device import decode as DE

    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)
    monkeypatch.setattr(DD, "cpu_share", lambda workers, spec=None: 1.0)
    rounded = []
    real = DE.finished
    monkeypatch.setattr(DE, "finished", lambda y, flips: rounded.append(len(flips)) or real(y, flips))
    ds = coordl.ImageFolder(photos, T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToTensor(),
                                               NORM]))
    kw = dict(batch_size=5, seed=3, shuffle=True, num_workers=workers)
    L = coordl.DataLoader(ds, device="cpu", decode="device", **kw)
    got = list(L)
    want = list(coordl.DataLoader(ds, **kw))
    assert len(got) == len(want) and rounded == []
    for (a, y), (b, y2) in zip(got, want):
        assert torch.equal(a, b) and torch.equal(y, y2)
    st = L.stats()
    assert st.device_decode_images == 0 and st.device_decode_cpu_images == len(ds)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_skipped_sample_beside_the_workers_rows_leaves_them_in_their_places(photos, monkeypatch, workers):
    """A batch with the workers' rows and a sample neither decoder reads,
    skipped: the rows left are the other samples in plan order, and each
    of the workers' rows is the CPU path's image of its own sample."""
    from coordl.decode import jpeg

    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)
    monkeypatch.setattr(DD, "cpu_share", lambda workers, spec=None: 0.5)
    ds = coordl.ImageFolder(photos, T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.PILToTensor()]))
    kw = dict(batch_size=4, seed=3, shuffle=False, num_workers=workers)
    from coordl.device.encoded import plan_for

    plan = plan_for(ds.transform)
    plan.cpu_share = 0.5
    # the bad sample: one the device decodes, in a batch with rows of the workers' before and after it
    bad = next(i for i in range(1, len(ds) - 1) if not plan.on_cpu(i) and plan.on_cpu(i - 1) and plan.on_cpu(i + 1)
               and i // 4 == (i - 1) // 4 == (i + 1) // 4)
    broken = bytes(ds.raw(bad))
    real = jpeg.decode_rgb

    def host(raw, scale=1):
        if bytes(raw) == broken:
            raise OSError("broken data stream when reading image file")
        return real(raw, scale)

    class Refusing(DD.HostDecoder):
        def decode(self, streams):
            return [RuntimeError("rejected") if bytes(s.numpy()) == broken else super(Refusing, self).decode([s])[0]
                    for s in streams]

    monkeypatch.setattr(jpeg, "decode_rgb", host)
    from coordl.device import decode as DE

    monkeypatch.setattr(DE, "decoder_for", lambda dev, **kw: Refusing(dev))
    L = coordl.DataLoader(ds, device="cpu", decode="device", on_error="skip", **kw)
    with pytest.warns(coordl.SkippedSampleWarning):
        got = torch.cat([x for x, _ in L])
    want = torch.cat([x for x, _ in coordl.DataLoader(ds, **kw)])
    order = [i for i in range(len(ds)) if i != bad]
    assert got.shape[0] == len(order)
    shared = [j for j, i in enumerate(order) if plan.on_cpu(i)]
    assert shared and all(torch.equal(got[j], want[order[j]]) for j in shared)
