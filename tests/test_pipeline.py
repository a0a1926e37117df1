"""coordl's own fetch/prep pipeline (two-stage datasets in plan order)."""
import collections
import gc
import os
import random
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import coordl
from coordl import DataLoader
from coordl.pipeline import collate as _collate
from coordl.pipeline.readahead import Fetcher
from coordl.plan import plan
from _collate_helpers import written
from toydata import TwoStageToy


class Jittery(TwoStageToy):
    """Random per-sample read delays (a few much slower)."""

    def raw(self, i):
        r = random.Random(i)
        time.sleep(0.02 if r.random() < 0.05 else r.random() * 0.002)
        return super().raw(i)


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_order_and_exactly_once_under_random_delays(num_workers):
    ds = Jittery(150)
    L = DataLoader(ds, batch_size=7, shuffle=True, seed=4, num_workers=num_workers, fetch_threads=4)
    for epoch in range(2):
        got = [i for x, _ in L for i in x[:, 0].tolist()]
        assert got == plan(150, 4, epoch).tolist()


def test_in_order_false_yields_every_batch_once():
    ds = Jittery(90)
    L = DataLoader(ds, batch_size=6, shuffle=True, seed=1, num_workers=2, in_order=False)
    got = sorted(i for x, _ in L for i in x[:, 0].tolist())
    assert got == list(range(90))


def test_batches_equal_default_collate_of_getitem():
    ds = TwoStageToy(23)
    L = DataLoader(ds, batch_size=5, shuffle=True, seed=7, num_workers=2)
    idx = plan(23, 7, 0).tolist()
    from coordl._rng import sample_rng
    for k, batch in enumerate(L):
        samples = []
        for i in idx[k * 5:(k + 1) * 5]:
            with sample_rng(7, 0, i):
                samples.append(ds[i])
        want = default_collate(samples)
        assert type(batch) is type(want) and len(batch) == len(want)
        for a, b in zip(batch, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize("sample", [
    (torch.ones(2, 3), 1),
    {"img": np.arange(6, dtype=np.float32).reshape(2, 3), "label": 2.5, "ok": True},
    Point(torch.zeros(4, dtype=torch.uint8), [1, 2]),
    [torch.arange(3), (torch.ones(1), 7)],
    # numpy's scalars (a label read from an array or a DataFrame): tensors of their dtype
    (torch.ones(2), np.int64(3), np.float32(0.5), np.bool_(True), np.float64(2.5), np.float16(1.5), np.uint8(7),
     np.complex64(1 + 2j)),
])
def test_in_place_collate_matches_default_collate(sample):
    lay = _collate.layout_of(sample, 3)
    assert lay is not None
    buf = np.zeros(lay.nbytes, dtype=np.uint8)
    targets = _collate.views(lay, buf)
    for r in (2, 0, 1):  # any order
        _collate.write_row(targets, r, lay.leaves_of(sample))
    _same_batch(_collate.build(lay.template, targets), default_collate([sample] * 3))


def test_numbers_written_through_row_targets_match_default_collate():
    """Python-number leaves go into the slot through numpy views
    (row_targets): same dtypes and values as default_collate, extremes
    included; tensor and array leaves still go through torch."""
    samples = [(torch.full((2, 2), r, dtype=torch.uint8), -(2 ** 63) + r, 1e308 * (r - 1), r == 1,
                np.full(3, r, dtype=np.int16)) for r in range(3)]
    lay = _collate.layout_of(samples[0], 3)
    buf = np.zeros(lay.nbytes, dtype=np.uint8)
    targets = _collate.views(lay, buf)
    dests = _collate.row_targets(lay, targets)
    assert [type(d) for d in dests] == [torch.Tensor, np.ndarray, np.ndarray, np.ndarray, torch.Tensor]
    for r in (1, 2, 0):
        _collate.write_row(dests, r, lay.leaves_of(samples[r]))
    got = _collate.build(lay.template, targets)
    want = default_collate(samples)
    assert type(got) is type(want) and len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_leaves_of_refuses_tensors_of_another_kind():
    lay = _collate.layout_of((torch.zeros(2, 3), 1), 4)
    assert lay.leaves_of((torch.zeros(2, 3), 5)) is not None
    assert lay.leaves_of((torch.zeros(3, 2), 5)) is None                       # shape
    assert lay.leaves_of((torch.zeros(2, 3, dtype=torch.float64), 5)) is None  # dtype
    assert lay.leaves_of((torch.zeros(2, 3).to_sparse(), 5)) is None          # layout
    assert lay.leaves_of((torch.zeros(2, 3, device="meta"), 5)) is None       # device
    assert lay.leaves_of((torch.zeros(2, 3), 5.0)) is None                     # label kind
    assert lay.leaves_of((torch.nn.Parameter(torch.zeros(2, 3)), 5)) is not None  # subclass: the full check
    lay = _collate.layout_of((torch.zeros(2, 3), np.int64(1)), 4)
    assert lay.leaves_of((torch.zeros(2, 3), np.int64(5))) is not None
    assert lay.leaves_of((torch.zeros(2, 3), np.int32(5))) is None                # another numpy dtype
    assert lay.leaves_of((torch.zeros(2, 3), 5)) is not None                      # a Python int: int64 too
    assert _collate.layout_of((torch.zeros(2), np.datetime64("2026-01-01")), 4) is None   # not a number


def test_unsupported_samples_take_copy_path():
    assert _collate.layout_of(("a string", 1), 2) is None
    assert _collate.layout_of(("a string", b"bytes"), 2, objs=True) is None    # nothing for the buffer
    assert _collate.layout_of((None, 1), 2, objs=True) is None                  # default_collate refuses None

    class Strs(TwoStageToy):
        def prep(self, raw, i):
            return f"s{i}", i

    L = DataLoader(Strs(6), batch_size=3, seed=0, num_workers=2)
    out = list(L)
    assert out[0][0] == default_collate([("s0", 0), ("s1", 1), ("s2", 2)])[0] and torch.equal(out[1][1], torch.tensor([3, 4, 5]))


def _same_batch(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same_batch(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_batch(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    else:
        assert a == b, (a, b)


def test_string_leaves_are_collated_in_place_as_default_collate_gathers_them():
    """A str or bytes beside the tensors (a file's path, a caption): the
    tensors go into the buffer in any row order and the strings into the
    batch's lists, which travel pickled with the layout; the batch is
    default_collate's, and rows taken back to the copy path keep them."""
    samples = [(torch.full((2, 3), r, dtype=torch.uint8), r, f"/data/{r}.jpg",
                {"caption": f"c{r}", "raw": bytes([r])}) for r in range(4)]
    lay, buf, targets = written(samples, (2, 0, 3, 1), objs=True)
    assert [l.kind for l in lay.leaves] == ["tensor", "int", "obj", "obj", "obj"]
    import pickle
    sent = pickle.loads(pickle.dumps(lay))      # as a worker's batch message carries it
    _same_batch(_collate.build(sent.template, _collate.views(sent, buf)), default_collate(samples))
    _same_batch(_collate.build(sent.template, _collate.views(sent, buf, 3)), default_collate(samples[:3]))
    back = _collate.rows_as_samples(lay, targets, [1, 3])
    assert back[0][2:] == samples[1][2:] and back[1][3] == samples[3][3]
    # a sample whose string is a number there, or missing, is not of the layout (the copy path takes the batch)
    assert lay.leaves_of((samples[0][0], 0, 5, samples[0][3])) is None
    assert lay.leaves_of((samples[0][0], 0, None, samples[0][3])) is None
    assert lay.leaves_of((samples[0][0], "0", "p", samples[0][3])) is None
    assert _collate.layout_of(samples[0], 4) is None    # not asked for: the copy path, as before


def test_numpy_scalars_are_collated_in_place_and_keep_their_type_when_rows_go_back():
    samples = [(torch.full((2,), r), np.int64(r), np.float32(r / 4)) for r in range(3)]
    lay, buf, targets = written(samples, (2, 0, 1))
    _same_batch(_collate.build(lay.template, targets), default_collate(samples))
    back = _collate.rows_as_samples(lay, targets, [2])[0]
    assert type(back[1]) is np.int64 and back[1] == 2 and type(back[2]) is np.float32 and back[2] == np.float32(0.5)
    assert [_collate.leaf_bytes(x, l).tobytes() for x, l in zip(lay.leaves_of(samples[1]), lay.leaves)][1:] == \
        [np.int64(1).tobytes(), np.float32(0.25).tobytes()]


class _NumpyLabel(TwoStageToy):
    def prep(self, raw, i):
        x, y = super().prep(raw, i)
        return x, np.int64(i % 3), np.float32(i / 2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_numpy_scalar_labels_are_written_in_place_and_equal_torchs(num_workers, monkeypatch):
    ds = _NumpyLabel(10)
    built = []
    monkeypatch.setattr(_collate, "build", lambda *a, _b=_collate.build: built.append(1) or _b(*a))
    got = list(DataLoader(ds, batch_size=4, num_workers=num_workers, seed=1))
    from coordl._rng import sample_rng
    want = []
    for k in range(0, 10, 4):
        smp = []
        for i in range(k, min(k + 4, 10)):
            with sample_rng(1, 0, i):
                smp.append(ds.prep(ds.raw(i), i))
        want.append(default_collate(smp))
    for a, b in zip(got, want):
        _same_batch(a, b)
    assert len(built) == len(got) == 3


class _WithPath(TwoStageToy):
    """A sample with its file's path, as ImageFolderWithPaths returns it;
    index 3 fails to read (for on_error="skip"); ``switch``: index 5 returns
    no path, which moves its batch to the copy path midway."""

    def __init__(self, n, switch=False):
        super().__init__(n)
        self.switch = switch

    def prep(self, raw, i):
        x, y = super().prep(raw, i)
        if i == 3:
            raise ValueError("a bad file")
        return (x, y) if self.switch and i == 5 else (x, y, f"/data/class_{i % 3}/{i}.jpg")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_with_paths_are_written_in_place_and_equal_torchs(num_workers, monkeypatch):
    ds = _WithPath(23)
    L = DataLoader(ds, batch_size=5, shuffle=True, seed=3, num_workers=num_workers, on_error="skip")
    idx = [i for i in plan(23, 3, 0).tolist()]
    from coordl._rng import sample_rng
    built = []      # the batches the main process builds from a slot (collated in place, not sent as objects)
    monkeypatch.setattr(_collate, "build", lambda *a, _b=_collate.build: built.append(1) or _b(*a))
    with pytest.warns(coordl.SkippedSampleWarning, match="a bad file"):
        got = list(L)
    assert len(built) == len(got) == 5
    want = []
    for k in range(0, 23, 5):
        smp = []
        for i in idx[k:k + 5]:
            if i != 3:
                with sample_rng(3, 0, i):
                    smp.append(ds.prep(ds.raw(i), i))
        want.append(default_collate(smp))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        _same_batch(a, b)
    assert L.stats().skipped == 1
    # a batch whose samples differ in structure midway: torch's collation then fails as it does under torch
    L2 = DataLoader(_WithPath(10, switch=True), batch_size=10, num_workers=num_workers, on_error="skip")
    with pytest.raises(RuntimeError, match="each element in list of batch should be of equal size"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", coordl.SkippedSampleWarning)
        list(L2)


def test_custom_collate_fn_runs_in_workers():
    def collate(samples):
        return torch.stack([s[0] for s in samples]).sum(0), len(samples)

    L = DataLoader(TwoStageToy(10), batch_size=4, seed=0, num_workers=2, collate_fn=collate)
    out = list(L)
    assert [n for _, n in out] == [4, 4, 2]
    assert out[0][0][0].item() == sum(range(4))


def test_kept_batches_are_never_overwritten():
    """Keep every batch (and views into them): later batches must not reuse
    their slots while they are referenced."""
    ds = TwoStageToy(200)
    L = DataLoader(ds, batch_size=4, shuffle=True, seed=2, num_workers=2, prefetch_factor=2)
    kept = []
    views = []
    for x, y in L:
        kept.append((x, y))
        views.append(x[0])  # a view of the slot, not a copy
    order = plan(200, 2, 0).tolist()
    got = [i for x, _ in kept for i in x[:, 0].tolist()]
    assert got == order
    assert [int(v[0]) for v in views] == order[::4]


def test_slots_are_recycled_when_batches_are_dropped():
    ds = TwoStageToy(400)
    L = DataLoader(ds, batch_size=4, seed=2, num_workers=1, persistent_workers=True)
    n = sum(1 for _ in L)
    assert n == 100
    pool = L._mode.pool
    # the worker reports each new slot once; dropping batches lets it reuse them
    assert len(pool.maps) <= 6
    del pool, L
    gc.collect()


def test_persistent_workers_keep_processes_across_epochs():
    import psutil

    L = DataLoader(TwoStageToy(40), batch_size=4, seed=0, num_workers=2, persistent_workers=True)
    list(L)
    pids1 = set(L._mode.pool.pids)
    list(L)
    assert set(L._mode.pool.pids) == pids1
    assert all(psutil.pid_exists(p) for p in pids1)
    del L
    gc.collect()


def test_worker_init_fn_and_worker_info_in_pipeline():
    class Info(TwoStageToy):
        def prep(self, raw, i):
            info = torch.utils.data.get_worker_info()
            return torch.tensor([i, info.id, info.num_workers])

    seen = []
    L = DataLoader(Info(12), batch_size=3, seed=0, num_workers=2,
                   worker_init_fn=lambda w: seen.append(w))
    out = torch.cat(list(L))
    assert set(out[:, 1].tolist()) == {0, 1} and set(out[:, 2].tolist()) == {2}
    # batch k is prepared by worker k % 2
    assert out.view(4, 3, 3)[:, 0, 1].tolist() == [0, 1, 0, 1]


def test_worker_init_fn_error_is_reported():
    def bad(w):
        raise ValueError("no GPU for you")

    L = DataLoader(TwoStageToy(8), batch_size=2, seed=0, num_workers=2, worker_init_fn=bad)
    with pytest.raises(RuntimeError, match="(?s)worker_init_fn.*no GPU for you"):
        list(L)


def test_timeout_raises():
    class Slow(TwoStageToy):
        def raw(self, i):
            time.sleep(3)
            return super().raw(i)

    L = DataLoader(Slow(4), batch_size=2, seed=0, num_workers=1, timeout=0.5, fetch_threads=1)
    with pytest.raises(RuntimeError, match="timed out after 0.5 seconds"):
        next(iter(L))


def test_abandoned_pass_then_new_pass():
    ds = Jittery(60)
    L = DataLoader(ds, batch_size=5, shuffle=True, seed=3, num_workers=2, persistent_workers=True)
    it = iter(L)
    next(it), next(it)
    del it
    got = [i for x, _ in L for i in x[:, 0].tolist()]
    assert got == plan(60, 3, 1).tolist()  # the new pass is epoch 1, complete


def test_fetcher_respects_budget_and_reads_ahead():
    lock = threading.Lock()
    peak = [0]
    import queue
    q = queue.Queue()

    def read(i):
        time.sleep(0.001)
        return b"x" * 100, "storage"

    f = Fetcher(read, ((None, i) for i in range(50)), q, threads=4, budget_bytes=350,
                size_of=lambda i: 100)
    got = []
    while len(got) < 50:
        item = q.get(timeout=10)
        with lock:
            peak[0] = max(peak[0], f.held_bytes)
        got.append(item.index)
        f.release(item.nbytes)
    f.join()
    assert sorted(got) == list(range(50))
    assert peak[0] <= 350


def test_fetcher_one_read_bigger_than_budget_does_not_deadlock():
    import queue
    q = queue.Queue()
    f = Fetcher(lambda i: (b"y" * 1000, "storage"), ((None, i) for i in range(3)), q,
                threads=2, budget_bytes=10, size_of=lambda i: 1000)
    for _ in range(3):
        item = q.get(timeout=10)
        f.release(item.nbytes)
    f.join()


def test_fetcher_admits_strictly_in_order():
    """A consumer that can only use items in order (like the prep window) and
    holds later arrivals must always get the next item: admission may never
    let a later item take the budget an earlier one is waiting for."""
    import queue
    q = queue.Queue()

    def read(i):
        time.sleep(random.Random(i).random() * 0.003)
        return b"z" * 100, "storage"

    f = Fetcher(read, ((None, i) for i in range(300)), q, threads=6, budget_bytes=300,
                size_of=lambda i: 100)
    held = {}
    for want in range(300):
        while want not in held:
            item = q.get(timeout=10)  # a deadlock shows up as queue.Empty here
            held[item.index] = item
        f.release(held.pop(want).nbytes)
    f.join()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_size_none_matches_torch_structure(num_workers):
    ds = TwoStageToy(7)
    ours = list(DataLoader(ds, batch_size=None, seed=0, num_workers=num_workers))
    theirs = list(torch.utils.data.DataLoader(ds, batch_size=None))
    assert len(ours) == len(theirs) == 7
    for a, b in zip(ours, theirs):
        assert type(a) is type(b) and torch.equal(a[0][0], b[0][0]) and a[1] == b[1]


def test_spawn_context_workers():
    L = DataLoader(TwoStageToy(20), batch_size=4, shuffle=True, seed=2, num_workers=2,
                   multiprocessing_context="spawn")
    got = [i for x, _ in L for i in x[:, 0].tolist()]
    assert got == plan(20, 2, 0).tolist()


def test_fetcher_batches_reads_in_order_and_within_budget():
    import queue
    q = queue.Queue()
    calls = []

    def read_many(idx):
        calls.append(list(idx))
        return [(bytes([i % 256]) * 100, "storage") if i != 13 else ValueError("bad") for i in idx]

    f = Fetcher(lambda i: (bytes([i % 256]) * 100, "storage"), ((None, i) for i in range(60)), q,
                threads=3, budget_bytes=1000, size_of=lambda i: 100, read_many=read_many, batch=4)
    got = {}
    while len(got) < 60:
        item = q.get(timeout=10)
        got[item.index] = item
        f.release(item.nbytes)
    f.join()
    assert isinstance(got[13].error, ValueError) and got[12].data == bytes([12]) * 100
    assert all(len(c) <= 4 for c in calls) and any(len(c) > 1 for c in calls)
    assert sorted(i for c in calls for i in c) + [] == sorted(set(i for c in calls for i in c))
    assert all(c == sorted(c) and c == list(range(c[0], c[0] + len(c))) for c in calls)


def test_breaking_out_early_stops_the_workers():
    """Non-persistent workers of an abandoned pass exit when the iterator goes
    (the autouse leak fixture fails this test if they do not)."""
    import psutil

    before = {c.pid for c in psutil.Process().children()}  # e.g. a spawn resource tracker
    L = DataLoader(Jittery(200), batch_size=4, seed=0, num_workers=2)
    for k, _ in enumerate(L):
        if k == 3:
            kids = [c for c in psutil.Process().children() if c.pid not in before]
            break
    assert len(kids) == 2
    del _
    gc.collect()
    gone, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive


def test_fetcher_does_not_wake_every_thread_per_sample(monkeypatch):
    """Each release used to wake every waiting fetch thread (notify_all, plus
    one more on each admission and completion): ~threads wake-ups per sample,
    each taking the GIL from the prep thread.  Now a release wakes at most one
    thread, and only once a read's worth of budget is free."""
    import queue

    wakeups = [0]

    class Counting(threading.Condition):
        def wait(self, timeout=None):
            r = super().wait(timeout)
            wakeups[0] += 1
            return r

    monkeypatch.setattr(threading, "Condition", Counting)
    q = queue.Queue()
    n = 400
    f = Fetcher(lambda i: (b"w" * 100, "storage"), ((None, i) for i in range(n)), q,
                threads=8, budget_bytes=2000, size_of=lambda i: 100)
    monkeypatch.undo()
    got = []
    while len(got) < n:
        item = q.get(timeout=10)
        got.append(item.index)
        f.release(item.nbytes)
        time.sleep(0.0005)  # "decoding" without the GIL, as the prep thread does: woken threads run
    f.join()
    assert sorted(got) == list(range(n))
    assert wakeups[0] <= n, f"{wakeups[0]} fetch-thread wake-ups for {n} samples"


def test_fetcher_starts_with_start_threads_and_grows_one_per_completed_read():
    """A fetcher starts ``start_threads`` threads; grow() adds one only after
    a read completed since the last one was added (the first read of a pass
    is waited for whatever the count) and never past ``threads``."""
    import queue

    tokens = threading.Semaphore(0)   # each read waits for one

    def read(i):
        assert tokens.acquire(timeout=10)
        return b"r" * 10, "storage"

    def named():
        return sum(t.name.startswith("grow-test-") and t.is_alive() for t in threading.enumerate())

    q = queue.Queue()
    f = Fetcher(read, ((None, i) for i in range(40)), q, threads=3, budget_bytes=10**6,
                name="grow-test", start_threads=1)
    try:
        assert f.threads == 1 and named() == 1
        assert not f.grow()                      # nothing read yet
        tokens.release()
        assert q.get(timeout=10).index == 0
        assert f.grow() and f.threads == 2 and named() == 2
        assert not f.grow()                      # no read completed since
        tokens.release()
        q.get(timeout=10)
        assert f.grow() and f.threads == 3
        tokens.release()
        q.get(timeout=10)
        assert not f.grow() and f.threads == 3   # at its limit
        got = 3
        for _ in range(37):
            tokens.release()
        while got < 40:
            q.get(timeout=10)
            got += 1
        assert not f.grow()                      # every read started
    finally:
        f.close()
        for _ in range(8):
            tokens.release()
        f.join()


class _Sized(TwoStageToy):
    """64 KiB samples: an epoch is more than the read-ahead budget, so the
    fetch threads are still there mid-epoch."""

    def raw(self, i):
        return super().raw(i) + bytes(1 << 16)


class _PrepSleeps(_Sized):
    """Reads from memory; prep takes a while (a decode without the GIL)."""

    def prep(self, raw, i):
        time.sleep(0.003)
        return super().prep(raw, i)


def _fetch_thread_count(L, num_workers):
    if num_workers == 0:
        return sum(t.name.startswith("coordl-fetch") for t in threading.enumerate())
    return max(sum(n.startswith("coordl-fetch") for n in s["threads"]) for s in L._mode.pool.worker_stats())


@pytest.mark.parametrize("num_workers", [0, 1])
def test_fetch_threads_grow_when_prep_waits_on_reads_and_stay_few_when_reads_keep_up(num_workers):
    """Fetch threads are added while the prep thread waits on reads (slow
    storage: up to ``fetch_threads``), and not when reads keep up (a fast
    read and a slow prep: one thread, which also holds the GIL less)."""
    kw = dict(batch_size=8, seed=0, num_workers=num_workers, fetch_threads=6, read_ahead="1MiB",
              persistent_workers=num_workers > 0)
    slow = DataLoader(_Sized(96, delay=0.01), **kw)
    fast = DataLoader(_PrepSleeps(96), **kw)
    counts = {}
    for name, L in (("slow", slow), ("fast", fast)):
        it = iter(L)
        got = [i for x, _ in (next(it) for _ in range(8)) for i in x[:, 0].tolist()]
        counts[name] = _fetch_thread_count(L, num_workers)
        got += [i for x, _ in it for i in x[:, 0].tolist()]
        assert got == list(range(96))
        del it
    assert counts["slow"] >= 4, counts
    assert counts["fast"] == 1, counts
    if num_workers:   # a persistent worker's next pass starts with half what the last one grew to
        it = iter(slow)
        next(it)
        assert _fetch_thread_count(slow, num_workers) >= counts["slow"] // 2
        del it


class _SlowWhileFlag(_Sized):
    """While a flag file exists, slow reads and a quick prep (a cold first
    epoch); then reads from memory and a slower prep."""

    def __init__(self, n, flag):
        super().__init__(n)
        self.flag = flag

    def raw(self, i):
        if os.path.exists(self.flag):
            time.sleep(0.01)
        return super().raw(i)

    def prep(self, raw, i):
        if not os.path.exists(self.flag):
            time.sleep(0.003)
        return super().prep(raw, i)


def test_a_persistent_worker_sheds_fetch_threads_its_storage_no_longer_needs(tmp_path):
    """Each pass starts with half the threads the last one grew to: after a
    slow (cold) pass grew them, fast passes come back to one."""
    flag = tmp_path / "cold"
    flag.touch()
    L = DataLoader(_SlowWhileFlag(96, str(flag)), batch_size=8, seed=0, num_workers=1, fetch_threads=6,
                   read_ahead="1MiB", persistent_workers=True)

    def started_mid_pass():
        it = iter(L)
        for _ in range(6):
            next(it)
        n = L._mode.pool.worker_stats()[0]["fetch_threads"]
        for _ in it:
            pass
        return n

    grown = started_mid_pass()
    flag.unlink()
    later = [started_mid_pass() for _ in range(3)]
    assert grown >= 4, (grown, later)
    # (a read late under load may add one back; without shedding they would stay >= grown)
    assert later[0] <= grown // 2 + 1 and later[-1] <= 2, (grown, later)


def test_place_into_a_slot_the_caller_laid_out():
    """The node daemon's member lays out a batch's slot itself (layout and
    targets, as _Builder fields) and then places samples with the engine's
    place(): the row targets are made on the first write."""
    from coordl.pipeline.engine import _Builder, finish, place
    from coordl.pipeline.slots import LocalSlots

    slots = LocalSlots()
    samples = [(torch.full((2, 2), r, dtype=torch.uint8), 10 + r) for r in range(2)]
    b = _Builder(0, [0, 1], copy=False)
    b.layout = _collate.layout_of(samples[0], 2)
    b.slot, buf = slots.acquire(b.layout.nbytes)
    b.targets = _collate.views(b.layout, buf)
    for j in (1, 0):
        place(b, j, samples[j], slots)
    assert finish(b, None, 2, slots) == ("batch", 2)
    got, want = _collate.build(b.layout.template, b.targets), default_collate(samples)
    assert all(a.dtype == w.dtype and torch.equal(a, w) for a, w in zip(got, want))


class _Slots:
    def acquire(self, n):
        buf = np.zeros(n, np.uint8)
        return buf, buf


def test_a_collate_fns_batch_packed_into_a_slot_is_rebuilt_as_it_was():
    """Every container kind, dtype and plain value a collate_fn returns
    comes back with its type, dtype, shape and values."""
    P = Point
    batch = {"x": torch.rand(4, 3, 2), "y": (torch.arange(4), "names", None, 1.5, b"raw"),
             "p": P(torch.zeros(0, 3), torch.tensor(2.5, dtype=torch.bfloat16)),
             "l": [np.ones(2), torch.tensor([True, False]), torch.tensor([1 + 2j]), np.int64(3)],
             7: torch.float16, "lam": torch.tensor(0.3)}
    buf, packed = _collate.pack(batch, _Slots())
    import pickle
    got = _collate.unpack(pickle.loads(pickle.dumps(packed)), buf)
    _same_batch(got, batch)
    tensors = [got["x"], got["y"][0], *got["p"], got["l"][1], got["l"][2], got["lam"]]
    assert all(type(t) is torch.Tensor and t.is_contiguous() for t in tensors)
    # the tensors are over the slot (the collated tensors' own memory is not kept)
    assert got["x"].untyped_storage().data_ptr() != batch["x"].untyped_storage().data_ptr()
    assert np.shares_memory(got["x"].numpy(), buf)


def test_what_packing_cannot_rebuild_exactly_goes_torchs_way():
    x = torch.rand(4, 3)
    for batch in (x.t(),                                             # strides of its own
                  torch.rand(2, 3, 4, 5).to(memory_format=torch.channels_last),
                  torch.rand(3, requires_grad=True),
                  torch.nn.Parameter(torch.rand(3)),                # a subclass
                  [x, x[1:]],                                       # two views of one storage
                  {"x": x, "meta": object()},                       # an object packing cannot see into
                  [x, {1, 2}],
                  "no tensor", [1, 2.5]):
        assert _collate.pack(batch, _Slots()) is None, batch
    assert _collate.pack([torch.zeros(0), torch.zeros(0, 2), x], _Slots()) is not None   # empty: no storage to share
    shared = torch.rand(3).share_memory_()      # default_collate's stack in a worker: torch sends its fd
    buf, packed = _collate.pack([shared, torch.rand(2)], _Slots())
    got = _collate.unpack(packed, buf)
    assert got[0] is shared and packed.spec[1][0][0] == "o"


@pytest.mark.parametrize("kw", [{}, {"persistent_workers": True}, {"in_order": False}])
def test_a_collate_fns_batches_from_workers_are_num_workers_0s(kw, monkeypatch):
    """A collate_fn making new tensors (mixup's kind): the workers' batches
    cross in slots and equal those made in the main process; a batch kept
    keeps its values while the loader goes on."""
    from toydata import mixing_collate

    R = DataLoader(TwoStageToy(40), batch_size=4, seed=2, collate_fn=mixing_collate)
    ref = [list(R) for _ in range(2)]
    unpacked = []
    monkeypatch.setattr(_collate, "unpack", lambda *a, _u=_collate.unpack: unpacked.append(1) or _u(*a))
    L = DataLoader(TwoStageToy(40), batch_size=4, seed=2, num_workers=2, collate_fn=mixing_collate, **kw)
    kept, kept_copy = None, None
    for epoch in range(2):
        got = []
        for k, b in enumerate(L):
            if epoch == 0 and k == 0:
                kept, kept_copy = b, [t.clone() for t in b]
            got.append([t.clone() for t in b])
        key = (lambda b: b[0][0, 0].item()) if kw.get("in_order") is False else (lambda b: 0)
        got = sorted(got, key=key) if kw.get("in_order") is False else got
        want = sorted(ref[epoch], key=key) if kw.get("in_order") is False else ref[epoch]
        assert len(got) == len(want) == 10
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
    assert len(unpacked) == 20
    assert all(torch.equal(a, b) for a, b in zip(kept, kept_copy))
