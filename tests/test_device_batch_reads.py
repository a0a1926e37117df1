"""decode="device" over a plain image folder: the workers read and record a
batch at a time (coordl.pipeline.device_batches).  What reaches the main process
must be what the per-sample path sends: every test runs both (the module's
ENABLED switch) on the same inputs and compares the batches delivered (the
CPU stand-in decodes the records and bytes, so a wrong record, label or
byte shows) and the statistics, on the cases the batch path hands back to
the per-sample path."""
import os
import warnings

import pytest
import torch
from PIL import Image

import coordl
from coordl import transforms as T
from coordl.pipeline import device_batches as BR
from coordl.device import encoded as E
from coordl.device import delivery as D

NORM = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def _rrc(size=16):
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), NORM])


@pytest.fixture(autouse=True)
def cpu_device(monkeypatch):
    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("batchreads", num_images=22, num_classes=3, mean_kb=5, image_size=(80, 60), seed=9)


def _odd(root):
    """``root``: JPEGs, plus what the batch path hands back: a CMYK JPEG, a
    PNG named .jpg, a JPEG cut short (no end marker)."""
    import io

    import numpy as np

    rng = np.random.default_rng(3)
    for c in ("a", "b"):
        os.makedirs(os.path.join(root, c), exist_ok=True)

    def photo(h, w):
        return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))

    for k in range(9):
        photo(40 + k, 50 - k).save(os.path.join(root, "a", f"{k}.jpg"), quality=85)
    photo(44, 52).convert("CMYK").save(os.path.join(root, "b", "cmyk.jpg"), quality=85)
    photo(41, 47).save(os.path.join(root, "b", "png.jpg"), format="PNG")
    buf = io.BytesIO()
    photo(48, 48).save(buf, "JPEG", quality=85)
    with open(os.path.join(root, "b", "short.jpg"), "wb") as f:
        f.write(buf.getvalue()[:-200])
    return root


def _run(ds, batch_reads, epochs=1, **kw):
    """The batches of ``epochs`` passes and what the statistics say, with
    the batch path on or off."""
    old = BR.ENABLED
    BR.ENABLED = batch_reads
    try:
        kw = {"batch_size": 4, "seed": 5, "shuffle": True, "device": "cpu", "decode": "device", **kw}
        L = coordl.DataLoader(ds, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # on_error="skip" warns about what it skipped, both ways
            batches = [list(L) for _ in range(epochs)]
        if kw.get("num_workers", 0) and kw.get("persistent_workers"):
            used = {s["batch_reads"] for s in L._mode.pool.worker_stats()}
        else:
            used = None
        st = L.stats()
        facts = [(e.samples_from_storage, e.samples_from_cache, e.skipped) for e in st.epochs]
        return batches, (facts, st.device_decode_images, st.device_decode_cpu_images), used
    finally:
        BR.ENABLED = old


def _same(a, b):
    assert len(a) == len(b)
    for ea, eb in zip(a, b):
        assert len(ea) == len(eb)
        for (x, y), (x2, y2) in zip(ea, eb):
            assert torch.equal(y, y2)
            assert torch.equal(x, x2)


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_and_stats_are_the_per_sample_paths(photos, workers):
    ds = coordl.ImageFolder(photos, _rrc())
    kw = dict(num_workers=workers, persistent_workers=bool(workers), epochs=2)
    got, facts, used = _run(ds, True, **kw)
    want, want_facts, unused = _run(ds, False, **kw)
    _same(got, want)
    assert facts == want_facts and facts[1] == 2 * len(ds)
    if workers:
        assert used == {True} and unused == {False}


def test_an_evaluation_transform_and_torchvisions_dataset(photos):
    """Resize + CenterCrop, and torchvision's ImageFolder recognized."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _torchvision import import_torchvision

    import_torchvision()
    from torchvision import datasets, transforms as tvT

    ds = coordl.ImageFolder(photos, T.Compose([T.Resize(30), T.CenterCrop(24), T.ToTensor(), NORM]))
    got, facts, _ = _run(ds, True, shuffle=False)
    want, want_facts, _ = _run(ds, False, shuffle=False)
    _same(got, want)
    assert facts == want_facts
    tv = datasets.ImageFolder(photos, transform=tvT.Compose([tvT.RandomResizedCrop(20), tvT.RandomHorizontalFlip(),
                                                              tvT.ToTensor()]))
    got, facts, used = _run(tv, True, num_workers=1, persistent_workers=True)
    want, want_facts, _ = _run(tv, False, num_workers=1, persistent_workers=True)
    _same(got, want)
    assert facts == want_facts and used == {True}


@pytest.mark.parametrize("workers", [0, 2])
def test_the_node_cache_serves_and_admits_as_before(photos, tmp_path, workers):
    """Each path over its own copy of the folder: a node cache is the
    node's, found again by the next loader over the same files."""
    import shutil

    kw = dict(num_workers=workers, persistent_workers=bool(workers), epochs=2, cache_size="8MiB")
    mine, other = shutil.copytree(photos, tmp_path / "a"), shutil.copytree(photos, tmp_path / "b")
    ds = coordl.ImageFolder(str(mine), _rrc())
    got, facts, used = _run(ds, True, **kw)
    want, want_facts, _ = _run(coordl.ImageFolder(str(other), _rrc()), False, **kw)
    _same(got, want)
    assert facts == want_facts
    assert facts[0][0][:2] == (len(ds), 0) and facts[0][1][:2] == (0, len(ds))   # epoch 1 from the cache
    if workers:
        assert used == {True}


@pytest.mark.parametrize("on_error", ["skip", "raise"])
@pytest.mark.parametrize("workers", [0, 2])
def test_files_the_batch_path_hands_back(tmp_path, workers, on_error):
    """CMYK and PNG (prepared on the CPU in the worker), a JPEG cut short,
    a file gone since the scan, files grown and cut since: the per-sample
    path's samples, errors and counts."""
    root = _odd(str(tmp_path / "odd"))
    ds = coordl.ImageFolder(root, _rrc())
    paths = [p for p, _ in ds.samples]
    os.remove(paths[2])
    with open(paths[5], "ab") as f:
        f.write(b"\0" * 10)      # a JPEG with bytes after its end marker: another size than the table's
    os.truncate(paths[7], os.path.getsize(paths[7]) - 5)    # shorter than the table says
    kw = dict(num_workers=workers, shuffle=False, on_error=on_error)

    def run(flag):
        if on_error == "skip":
            return _run(ds, flag, **kw)
        L_batches = []
        old = BR.ENABLED
        BR.ENABLED = flag
        try:
            L = coordl.DataLoader(ds, batch_size=4, seed=5, device="cpu", decode="device", **kw)
            it = iter(L)
            for _ in range(L.plan.num_batches):
                try:
                    x, y = next(it)
                    L_batches.append(("batch", x, y))
                except coordl.SampleError as e:
                    L_batches.append(("error", type(e).__name__, str(e).split("\n")[0]))
            return L_batches, None, None
        finally:
            BR.ENABLED = old

    got, facts, _ = run(True)
    want, want_facts, _ = run(False)
    if on_error == "skip":
        _same(got, want)
        assert facts == want_facts
        assert facts[0][0][2] >= 1 and facts[2] >= 2          # the missing file skipped; CMYK, PNG on the CPU
    else:
        assert [g[0] for g in got] == [w[0] for w in want] and "error" in [g[0] for g in got]
        for g, w in zip(got, want):
            if g[0] == "error":
                assert g == w
            else:
                assert torch.equal(g[1], w[1]) and torch.equal(g[2], w[2])


def test_which_datasets_take_it(photos):
    """Only what it can prove: coordl's and torchvision's folders with the
    stock raw and prep, local files, no target_transform; a subclass that
    reads its own way, a target_transform or peers keep the per-sample path."""
    from coordl.device.encoded import DecodePrep, plan_for

    def takes(ds, **kw):
        prep = DecodePrep(ds, plan_for(ds.transform))
        return BR.batch_reads_for(prep, cache=None, peers=kw.get("peers"), in_place=True, batch_size=4) is not None

    assert takes(coordl.ImageFolder(photos, _rrc()))

    class OwnRead(coordl.ImageFolder):
        def _raw(self, index):
            return super()._raw(index)

    assert not takes(OwnRead(photos, _rrc()))
    patched = coordl.ImageFolder(photos, _rrc())
    patched._raw = lambda index: b"not the file"
    assert not takes(patched)
    assert not takes(coordl.ImageFolder(photos, _rrc(), target_transform=lambda t: t + 1))
    assert not takes(coordl.ImageFolder(photos, _rrc()), peers=object())
    prep = DecodePrep(coordl.ImageFolder(photos, _rrc()), plan_for(_rrc()))
    assert BR.batch_reads_for(prep, cache=None, peers=None, in_place=False, batch_size=4) is None


# ---------------------------------------------------------------- the draws' extension
def test_the_extensions_generator_is_pythons():
    """coordl.decode._draws seeds and runs the sample's generator as
    ``random.Random(key)`` does, past its first 624 outputs (where the
    state is twisted again)."""
    import numpy as np

    from coordl import _rng

    draws = pytest.importorskip("coordl.decode._draws")
    for seed, epoch, index in [(0, 0, 0), (1, 2, 3), (2 ** 64 - 1, 2 ** 64 - 1, 2 ** 63 - 1), (5, 0, 2 ** 40)]:
        g = _rng.derive(seed, epoch, index)
        assert np.frombuffer(draws.words(seed, epoch, index, 1500), np.uint32).tolist() == \
            [g.getrandbits(32) for _ in range(1500)]


@pytest.mark.parametrize("tf", [
    T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToTensor()]),
    T.Compose([T.RandomResizedCrop((9, 31), scale=(0.001, 0.002), ratio=(0.2, 5.0)), T.RandomHorizontalFlip(0.3),
               T.ToTensor()]),
    T.Compose([T.RandomResizedCrop(12, scale=(1, 1), ratio=(1, 1)), T.ToTensor()]),
])
def test_native_draws_are_the_plans_draws(tf):
    """Many keys and image sizes (the first attempt, many attempts, both
    fallbacks, one-pixel sides): the extension's (box, flip) is what
    ``DecodePlan.draw`` draws from the same generator, and its seeds after
    them torch's and Python's seeds for the as-written steps
    (``_rng.global_seeds``)."""
    import random

    from coordl import _rng
    from coordl.device.encoded import plan_for

    pytest.importorskip("coordl.decode._draws")
    plan = plan_for(tf)
    draws = BR.native_draws(plan)
    assert draws is not None
    rnd = random.Random(4)
    for _ in range(20):
        seed, epoch = rnd.choice([0, 2 ** 64 - 1, rnd.getrandbits(64)]), rnd.choice([0, 9, rnd.getrandbits(64)])
        idx = [rnd.choice([0, 2 ** 63 - 1, rnd.getrandbits(63)]) for _ in range(30)]
        hs = [rnd.choice([1, 2, 375, 5000, rnd.randint(1, 3000)]) for _ in range(30)]
        ws = [rnd.choice([1, 3, 500, 4000, rnd.randint(1, 3000)]) for _ in range(30)]
        got = draws(idx, hs, ws, seed, epoch).tolist()
        for i, h, w, row in zip(idx, hs, ws, got):
            g = _rng.derive(seed, epoch, i)
            want = plan.draw(h, w, g)
            assert want[E.MODE - E.T1] == 0 and want[E.VFLIP - E.T1] == 0   # one mode; no vertical flip
            assert row == [*want[:4], want[E.FLIP - E.T1], *_rng.global_seeds(g)], (seed, epoch, i, h, w)


def test_other_plans_and_an_extension_that_disagrees_draw_in_python(photos, monkeypatch):
    """A flip before the crop, or a resize and a crop: Python's draws.  An
    extension whose draws differ from this Python's is not used, and the
    batches are still the per-sample path's."""
    import types

    from coordl.decode import extensions
    from coordl.device.encoded import plan_for

    flip_first = T.Compose([T.RandomHorizontalFlip(), T.RandomResizedCrop(16), T.ToTensor()])
    assert BR.native_draws(plan_for(flip_first)) is None
    assert BR.native_draws(plan_for(T.Compose([T.Resize(20), T.RandomCrop(16), T.ToTensor()]))) is None
    ds = coordl.ImageFolder(photos, flip_first)
    _same(_run(ds, True)[0], _run(ds, False)[0])

    def wrong(*args):
        args[-1][:] = 0
    monkeypatch.setattr(BR, "_CHECKED", {})
    monkeypatch.setattr(extensions, "load", lambda name, log, without: types.SimpleNamespace(rrc=wrong))
    assert BR.native_draws(plan_for(_rrc())) is None
    ds = coordl.ImageFolder(photos, _rrc())
    _same(_run(ds, True)[0], _run(ds, False)[0])


def test_a_drawn_interpolation_draws_in_python_and_gives_the_per_sample_paths_batches(photos, cpu_device):
    """timm's random interpolation (a mode drawn after the box): the
    extension does not draw it, so the batch reads draw in Python; their
    batches, and a resumed pass, are the per-sample path's."""
    from _batch_reads import check_batch_reads_and_resume
    from coordl.device.encoded import plan_for

    both = (T.InterpolationMode.BILINEAR, T.InterpolationMode.BICUBIC)
    tf = T.Compose([T.RandomResizedCrop(16, interpolation=both), T.RandomHorizontalFlip(), T.ToTensor()])
    assert BR.native_draws(plan_for(tf)) is None
    runs = check_batch_reads_and_resume(coordl.ImageFolder(photos, tf), batch_size=3, seed=11, shuffle=True,
                                        device="cpu", decode="device")
    assert len(runs) > 2


# ---------------------------------------------------------------- slow storage
@pytest.mark.parametrize("on_error", ["skip", "raise"])
@pytest.mark.parametrize("workers", [0, 2])
def test_slow_reads_go_to_threads_and_give_the_same_batches(tmp_path, monkeypatch, workers, on_error):
    """Reads slower than memory serves them (a network file system): after
    the first batch, a batch's reads are in flight at once in read threads;
    the batches, errors and statistics are still the per-sample path's,
    and a batch that fails gives its slot back only after its reads ended."""
    import threading
    import time

    root = _odd(str(tmp_path / "odd"))
    ds = coordl.ImageFolder(root, _rrc())
    os.remove([p for p, _ in ds.samples][6])
    names = set()
    real = BR.BatchReads._read_into

    def slow(self, i, dest, size):
        names.add(threading.current_thread().name)
        time.sleep(0.002)
        return real(self, i, dest, size)

    monkeypatch.setattr(BR.BatchReads, "_read_into", slow)
    kw = dict(num_workers=workers, shuffle=True, on_error=on_error, epochs=2, persistent_workers=bool(workers))

    def run(flag):
        old, BR.ENABLED = BR.ENABLED, flag
        try:
            if on_error == "skip":
                return _run(ds, flag, **kw)[:2]
            L = coordl.DataLoader(ds, batch_size=3, seed=5, device="cpu", decode="device", num_workers=workers,
                                  shuffle=True, on_error=on_error)
            out = []
            for _ in range(2):
                it = iter(L)
                for _ in range(L.plan.num_batches):
                    try:
                        out.append(next(it))
                    except coordl.SampleError as e:
                        out.append(str(e).split("\n")[0])
            return out, None
        finally:
            BR.ENABLED = old

    got, want = run(True), run(False)
    if on_error == "skip":
        _same(got[0], want[0])
        assert got[1] == want[1]
    else:
        assert len(got[0]) == len(want[0])
        for g, w in zip(got[0], want[0]):
            assert type(g) is type(w)
            if isinstance(g, str):
                assert g == w
            else:
                assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
    if workers == 0:
        assert any(n.startswith("coordl-fetch") for n in names), names


def test_samplers_drop_last_and_resume_are_the_per_sample_paths(photos):
    """A user's sampler (indices repeated, out of order), drop_last, and a
    pass resumed from the middle: the batch path takes the same steps."""
    ds = coordl.ImageFolder(photos, _rrc())
    order = [5, 1, 1, 20, 3, 7, 0, 19, 2, 2, 8]
    for kw in (dict(sampler=order, shuffle=False), dict(drop_last=True), dict(num_workers=2)):
        got, facts, _ = _run(ds, True, batch_size=3, **kw)
        want, want_facts, _ = _run(ds, False, batch_size=3, **kw)
        _same(got, want)
        assert facts == want_facts

    def resumed(flag):
        old, BR.ENABLED = BR.ENABLED, flag
        try:
            L = coordl.DataLoader(ds, batch_size=3, seed=5, shuffle=True, device="cpu", decode="device", num_workers=2)
            it = iter(L)
            head = [next(it) for _ in range(3)]
            R = coordl.DataLoader(ds, batch_size=3, seed=5, shuffle=True, device="cpu", decode="device",
                                  num_workers=2)
            R.load_state_dict(L.state_dict())
            del it
            return head + list(R)
        finally:
            BR.ENABLED = old

    _same([resumed(True)], [resumed(False)])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_repeated_index_draws_anew_on_the_batch_path_too(photos, workers):
    """A sampler that repeats an index (repeated augmentation): each repeat
    its own crop and flip, in the same batch or the next, with the batch
    path (the extension's draws are a first time's only: repeats draw in
    Python) as with the per-sample path."""
    ds = coordl.ImageFolder(photos, _rrc())
    order = [i for i in range(9) for _ in range(3)]
    got, _, _ = _run(ds, True, batch_size=4, sampler=order, shuffle=False, num_workers=workers)
    want, _, _ = _run(ds, False, batch_size=4, sampler=order, shuffle=False, num_workers=workers)
    _same(got, want)
    rows = torch.cat([x for x, _ in got[0]])
    for i in range(9):
        a, b, c = rows[3 * i:3 * i + 3]
        assert not torch.equal(a, b) and not torch.equal(b, c) and not torch.equal(a, c), i
    first, _, _ = _run(ds, True, batch_size=3, sampler=list(range(9)), shuffle=False, num_workers=workers)
    assert torch.equal(torch.cat([x for x, _ in first[0]]), rows[::3])     # the first time: the index's own


def test_without_workers_next_builds_only_the_batch_it_returns(photos, monkeypatch):
    """num_workers=0: the batches are built in next() itself, so building
    one ahead would only delay the one asked for."""
    ds = coordl.ImageFolder(photos, _rrc())
    built = []
    real = BR.BatchReads.build

    def build(self, eng, b):
        built.append(b.k)
        return real(self, eng, b)

    monkeypatch.setattr(BR.BatchReads, "build", build)
    L = coordl.DataLoader(ds, batch_size=4, device="cpu", decode="device")
    it = iter(L)
    next(it)
    assert built == [0]
    next(it)
    assert built == [0, 1]
    assert len(list(it)) == L.plan.num_batches - 2


def test_a_plan_that_draws_nothing_makes_no_generator(photos, monkeypatch):
    """Resize + CenterCrop: the geometry depends on the image's size alone,
    so the batch path makes no per-sample generator (the batches are still
    the per-sample path's: test_an_evaluation_transform_and_torchvisions_dataset)."""
    from coordl import _rng

    made = []
    real = _rng.derive
    monkeypatch.setattr(_rng, "derive", lambda *a: made.append(a) or real(*a))
    ds = coordl.ImageFolder(photos, T.Compose([T.Resize(30), T.CenterCrop(24), T.ToTensor(), NORM]))
    assert len(_run(ds, True)[0][0]) == 6 and made == []
