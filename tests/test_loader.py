"""coordl-specific behaviour of DataLoader: plan, resume, stats, errors."""
import gc
import pickle

import pytest
import torch
from torch.utils.data import TensorDataset

import coordl
from coordl import DataLoader, SampleError, SkippedSampleWarning, StateError
from coordl.plan import plan
from toydata import Plain, TwoStageToy


def _values(batches):
    """Sample indices of every batch, as lists."""
    return [b[0][:, 0].tolist() for b in batches]


def _run(loader, epochs=1):
    out = []
    for _ in range(epochs):
        out.extend(loader)
    return out


def _equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_two_stage_order_is_the_plan():
    ds = TwoStageToy(50)
    L = DataLoader(ds, batch_size=8, shuffle=True, seed=3)
    for epoch in range(3):
        got = [i for b in _values(L) for i in b]
        assert got == plan(50, 3, epoch).tolist()


def test_shuffle_false_natural_order_and_seed_default_from_torch_rng():
    ds = TwoStageToy(20)
    L = DataLoader(ds, batch_size=5)
    assert [i for b in _values(L) for i in b] == list(range(20))
    torch.manual_seed(42)
    a = DataLoader(ds, batch_size=5, shuffle=True)
    torch.manual_seed(42)
    b = DataLoader(ds, batch_size=5, shuffle=True)
    assert a.seed == b.seed and a.seed is not None
    _equal(_run(a), _run(b))


def test_augmentation_is_a_function_of_seed_epoch_index():
    ds = TwoStageToy(16)
    a = _run(DataLoader(ds, batch_size=4, shuffle=True, seed=1), epochs=2)
    b = _run(DataLoader(ds, batch_size=4, shuffle=True, seed=1, num_workers=2), epochs=2)
    _equal(a, b)  # same draws whichever process prepared the sample
    draws = {}
    for epoch_batches, epoch in ((a[:4], 0), (a[4:], 1)):
        for x, _ in epoch_batches:
            for idx, draw, _ in x.tolist():
                draws[(epoch, idx)] = draw
    assert any(draws[(0, i)] != draws[(1, i)] for i in range(16))


def test_set_epoch_and_auto_advance():
    ds = TwoStageToy(30)
    L = DataLoader(ds, batch_size=30, shuffle=True, seed=9)
    assert L.epoch == 0
    e0 = _values(L)[0]
    assert L.epoch == 1
    e1 = _values(L)[0]
    assert e0 == plan(30, 9, 0).tolist() and e1 == plan(30, 9, 1).tolist()
    L.set_epoch(5)
    assert _values(L)[0] == plan(30, 9, 5).tolist()
    L.set_epoch(5)
    assert _values(L)[0] == plan(30, 9, 5).tolist()
    with pytest.raises(ValueError, match="epoch should be a non-negative int, but got epoch=-1"):
        L.set_epoch(-1)


def test_generic_dataset_with_seed_uses_plan_and_without_uses_torch():
    ds = Plain(40)
    L = DataLoader(ds, batch_size=10, shuffle=True, seed=4)
    got = [int(v) for b in L for v in b[:, 0]]
    assert got == plan(40, 4, 0).tolist()
    assert DataLoader(ds, batch_size=10, shuffle=True).plan is None


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_world_size_partition_equal_batch_counts(world_size, drop_last):
    ds = TwoStageToy(23)
    loaders = [DataLoader(ds, batch_size=3, shuffle=True, seed=2, rank=r, world_size=world_size,
                          drop_last=drop_last) for r in range(world_size)]
    counts = {len(list(L)) for L in loaders}
    assert len(counts) == 1 and counts == {len(loaders[0])}
    seen = [i for L in loaders for b in _values(L) for i in b]
    if drop_last:
        assert len(seen) == len(set(seen))
    else:
        assert set(seen) == set(range(23))


# ----------------------------------------------------------------- resume
RESUME_CASES = [(nw, cut) for nw in (0, 2) for cut in (0, 1, 2, 5, 9, 10)]


@pytest.mark.parametrize("num_workers,cut", RESUME_CASES)
def test_resume_two_stage_exact(num_workers, cut):
    """Stop after `cut` batches (prefetched batches in flight), restore in a
    new loader: the rest of the epoch and the next one are identical."""
    ds = TwoStageToy(37)
    kw = dict(batch_size=4, shuffle=True, num_workers=num_workers)
    full = _run(DataLoader(ds, seed=5, **kw), epochs=2)
    a = DataLoader(ds, seed=5, **kw)
    it = iter(a)
    got = [next(it) for _ in range(cut)]
    state = pickle.loads(pickle.dumps(a.state_dict()))
    assert (state["epoch"], state["batches"]) == ((0, cut) if cut < 10 else (1, 0))
    del it, a
    gc.collect()
    b = DataLoader(ds, seed=123, **kw)  # the state's seed wins
    b.load_state_dict(state)
    got += _run(b, epochs=2)
    _equal(got[: len(full)], full)
    seen = [i for batch in _values(got[:10]) for i in batch]
    assert sorted(seen) == list(range(37))  # each sample once in the epoch


@pytest.mark.parametrize("num_workers,cut", [(0, 3), (2, 3), (2, 7)])
def test_resume_torch_samplers_with_generator(num_workers, cut):
    ds = TensorDataset(torch.arange(50))

    def make():
        return DataLoader(ds, batch_size=4, shuffle=True, num_workers=num_workers,
                          generator=torch.Generator().manual_seed(8))

    full = [b[0] for b in make()]
    a = make()
    it = iter(a)
    got = [next(it)[0] for _ in range(cut)]
    state = a.state_dict()
    del it, a
    b = make()
    b.load_state_dict(state)
    got += [x[0] for x in b]
    assert len(got) == len(full) and all(torch.equal(x, y) for x, y in zip(got, full))


def test_resume_torch_samplers_global_rng_untouched():
    ds = TensorDataset(torch.arange(30))
    torch.manual_seed(1)
    a = DataLoader(ds, batch_size=5, shuffle=True)
    full = [b[0] for b in a]
    torch.manual_seed(1)
    a = DataLoader(ds, batch_size=5, shuffle=True)
    it = iter(a)
    got = [next(it)[0] for _ in range(2)]
    state = a.state_dict()
    torch.manual_seed(999)
    before = torch.get_rng_state()
    b = DataLoader(ds, batch_size=5, shuffle=True)
    b.load_state_dict(state)
    got += [x[0] for x in b]
    assert all(torch.equal(x, y) for x, y in zip(got, full)) and len(got) == len(full)
    torch.manual_seed(999)
    assert torch.equal(torch.get_rng_state(), before)


def test_resume_iterable_dataset_fast_forwards():
    class It(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(20))

    full = [b.tolist() for b in DataLoader(It(), batch_size=3)]
    a = DataLoader(It(), batch_size=3)
    it = iter(a)
    got = [next(it).tolist() for _ in range(2)]
    b = DataLoader(It(), batch_size=3)
    b.load_state_dict(a.state_dict())
    got += [x.tolist() for x in b]
    assert got == full


def test_state_at_epoch_boundary_and_end_of_epoch():
    ds = TwoStageToy(8)
    L = DataLoader(ds, batch_size=4, seed=0)
    assert L.state_dict()["epoch"] == 0 and L.state_dict()["batches"] == 0
    it = iter(L)
    next(it), next(it)
    sd = L.state_dict()  # every batch consumed, StopIteration not yet seen
    assert (sd["epoch"], sd["batches"]) == (1, 0)
    list(it)
    assert (L.state_dict()["epoch"], L.state_dict()["batches"]) == (1, 0)


def test_set_epoch_after_load_keeps_resume_for_same_epoch():
    ds = TwoStageToy(20)
    a = DataLoader(ds, batch_size=4, shuffle=True, seed=1)
    a.set_epoch(3)
    it = iter(a)
    first = next(it)
    b = DataLoader(ds, batch_size=4, shuffle=True, seed=1)
    b.load_state_dict(a.state_dict())
    b.set_epoch(3)  # the usual training loop does this
    rest = list(b)
    assert len(rest) == 4
    flat = first[0][:, 0].tolist() + [i for x in _values(rest) for i in x]
    assert flat == plan(20, 1, 3).tolist()


def test_world_size_change_mid_epoch_is_refused_but_boundary_works():
    ds = TwoStageToy(40)
    a = DataLoader(ds, batch_size=4, shuffle=True, seed=1, rank=0, world_size=2)
    it = iter(a)
    next(it)
    b = DataLoader(ds, batch_size=4, shuffle=True, seed=1, rank=0, world_size=4)
    with pytest.raises(StateError, match="world_size=2.*world_size=4.*repeat or drop"):
        b.load_state_dict(a.state_dict())
    del it
    boundary = DataLoader(ds, batch_size=4, shuffle=True, seed=1, rank=0, world_size=2)
    list(boundary)
    b.load_state_dict(boundary.state_dict())
    assert b.epoch == 1 and len(list(b)) == len(b)


@pytest.mark.parametrize("change,match", [
    (dict(batch_size=5), "batch_size"),
    (dict(drop_last=True), "drop_last"),
    (dict(shuffle=False), "shuffle"),
])
def test_mismatched_settings_refused_mid_epoch(change, match):
    ds = TwoStageToy(40)
    kw = dict(batch_size=4, shuffle=True, seed=1)
    a = DataLoader(ds, **kw)
    it = iter(a)
    next(it)
    kw.update(change)
    with pytest.raises(StateError, match=match):
        DataLoader(ds, **kw).load_state_dict(a.state_dict())


def test_other_dataset_length_and_garbage_state_refused():
    a = DataLoader(TwoStageToy(10), batch_size=2, seed=1)
    with pytest.raises(StateError, match="10 samples.*has 11"):
        DataLoader(TwoStageToy(11), batch_size=2, seed=1).load_state_dict(a.state_dict())
    with pytest.raises(StateError, match="state_dict"):
        a.load_state_dict({"epoch": 1})
    with pytest.raises(StateError, match="epoch plan"):
        DataLoader(Plain(10), batch_size=2).load_state_dict(a.state_dict())


def _folder(root, seed, n=12):
    from coordl.synth import make_image_folder

    make_image_folder(str(root), num_images=n, num_classes=2, image_size=(40, 30), seed=seed)
    return coordl.ImageFolder(str(root), transform=coordl.transforms.PILToTensor())


def test_mid_epoch_state_of_another_dataset_of_the_same_length_refused(tmp_path):
    """Two folders of 12 images each: a mid-epoch state of one must not
    resume on the other (it would deliver the rest of an epoch of the wrong
    samples); the same folder copied elsewhere resumes."""
    import shutil

    a = DataLoader(_folder(tmp_path / "a", seed=1), batch_size=2, seed=4)
    it = iter(a)
    next(it)
    state = pickle.loads(pickle.dumps(a.state_dict()))
    other = DataLoader(_folder(tmp_path / "b", seed=2), batch_size=2, seed=4)
    with pytest.raises(StateError, match="another dataset.*same dataset"):
        other.load_state_dict(state)
    shutil.copytree(tmp_path / "a", tmp_path / "a_copy")
    moved = DataLoader(coordl.ImageFolder(str(tmp_path / "a_copy"), transform=coordl.transforms.PILToTensor()),
                       batch_size=2, seed=4)
    moved.load_state_dict(state)
    assert len(list(moved)) == len(moved) - 1
    del it


def test_set_epoch_to_another_epoch_after_a_mid_epoch_load_warns():
    ds = TwoStageToy(20)
    a = DataLoader(ds, batch_size=4, shuffle=True, seed=1)
    it = iter(a)
    next(it)
    b = DataLoader(ds, batch_size=4, shuffle=True, seed=1)
    b.load_state_dict(a.state_dict())
    with pytest.warns(UserWarning, match=r"set_epoch\(1\) drops the position load_state_dict restored "
                                         r"\(epoch 0, 1 of 5 batches delivered\)"):
        b.set_epoch(1)
    assert b.epoch == 1 and len(list(b)) == 5
    b.load_state_dict(a.state_dict())   # the same epoch: nothing dropped, nothing said
    b.set_epoch(0)
    assert len(list(b)) == 4
    del it


# ----------------------------------------------------------------- stats
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stats_two_stage(num_workers):
    ds = TwoStageToy(21)
    L = DataLoader(ds, batch_size=4, seed=0, num_workers=num_workers)
    assert L.stats().samples == 0
    _run(L, epochs=2)
    st = L.stats()
    assert isinstance(st, coordl.LoaderStats)
    assert (st.samples, st.batches) == (42, 12)
    assert st.bytes_from_storage == 42 * 32 and st.samples_from_storage == 42
    assert st.bytes_from_cache == 0 and st.samples_from_cache == 0
    assert [e.samples for e in st.epochs] == [21, 21] and [e.epoch for e in st.epochs] == [0, 1]
    assert st.wait_seconds > 0 and st.fetch_seconds >= 0 and st.prep_seconds > 0
    with pytest.raises(Exception):
        st.samples = 3  # frozen


def test_stats_generic_dataset_counts_samples():
    L = DataLoader(Plain(10), batch_size=4)
    _run(L)
    st = L.stats()
    assert (st.samples, st.batches, st.bytes_from_storage) == (10, 3, 0)


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize("num_workers", [0, 2])
def test_bad_sample_raises_naming_index_and_path(num_workers):
    L = DataLoader(TwoStageToy(12, bad={5}), batch_size=4, num_workers=num_workers, seed=0)
    with pytest.raises(SampleError) as e:
        _run(L)
    msg = str(e.value)
    assert "sample 5" in msg and "/toy/sample_5.bin" in msg and "truncated" in msg
    assert "on_error='skip'" in msg
    if num_workers:
        assert "DataLoader worker process" in msg and "Traceback" in msg


def test_missing_file_names_path():
    L = DataLoader(TwoStageToy(6, missing={2}), batch_size=3, seed=0)
    with pytest.raises(SampleError, match=r"reading sample 2 \(/toy/sample_2.bin\).*FileNotFoundError"):
        _run(L)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_bad_samples_warns_once_each_and_counts(num_workers):
    L = DataLoader(TwoStageToy(12, bad={1, 6}, missing={9}), batch_size=4,
                   num_workers=num_workers, seed=0, on_error="skip")
    with pytest.warns(SkippedSampleWarning) as rec:
        batches = _run(L)
    msgs = sorted(str(w.message) for w in rec)
    assert len(msgs) == 3 and any("sample 9" in m and "sample_9.bin" in m for m in msgs)
    got = sorted(i for b in _values(batches) for i in b)
    assert got == [i for i in range(12) if i not in (1, 6, 9)]
    assert L.stats().skipped == 3 and L.stats().samples == 9


def test_skip_whole_batch_bad():
    L = DataLoader(TwoStageToy(6, bad={2, 3}), batch_size=2, seed=0, on_error="skip")
    with pytest.warns(SkippedSampleWarning):
        batches = _run(L)
    assert len(batches) == 2 and L.stats().batches == 2


def test_skip_for_generic_map_dataset():
    class Flaky(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            if i == 4:
                raise ValueError("bad record")
            return i

    L = DataLoader(Flaky(), batch_size=3, on_error="skip")
    with pytest.warns(SkippedSampleWarning, match="sample 4"):
        out = [b.tolist() for b in L]
    assert out == [[0, 1, 2], [3, 5]]


# ----------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs,msg", [
    (dict(on_error="ignore"), 'on_error should be "raise" or "skip", but got on_error=\'ignore\''),
    (dict(seed=-3), "seed should be an int in [0, 2**64), but got seed=-3"),
    (dict(cache_size="lots"), "cache_size should be a number of bytes"),
    (dict(cache_size=-1), "but got cache_size=-1"),
    (dict(cache_size="150%"), "but got cache_size='150%'"),
    (dict(device="gpu0"), "device should be None, a torch.device or a string"),
    (dict(rank=3, world_size=2), "rank should be an int in [0, world_size=2), but got rank=3"),
    (dict(world_size=0), "world_size should be a positive int, but got world_size=0"),
])
def test_extra_argument_errors(kwargs, msg):
    with pytest.raises(ValueError) as e:
        DataLoader(TwoStageToy(4), **kwargs)
    assert msg in str(e.value)


def test_cuda_device_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="torch.cuda.is_available\\(\\) is False"):
        DataLoader(TwoStageToy(4), device="cuda")


@pytest.mark.parametrize("value,expected", [
    (None, 0), (0, 0), (1234, 1234), ("1KiB", 1024), ("2MB", 2_000_000), ("1.5GiB", 3 << 29),
    ("10 b", 10),
])
def test_cache_size_parsing(value, expected):
    L = DataLoader(_Printed(4), cache_size=value)
    assert L.cache_size == expected
    assert (L._cache is not None) == (expected > 0)
    if L._cache is not None:
        assert L._cache.capacity == expected
    del L


class _Printed(TwoStageToy):
    def fingerprint(self):
        import uuid
        self._fp = getattr(self, "_fp", uuid.uuid4().hex)
        return self._fp


def test_cache_size_percent_of_available_memory():
    # a small percentage: the cache is reserved in /dev/shm at construction,
    # so available memory drops by what it takes (measure before)
    import psutil
    avail = psutil.virtual_memory().available
    got = DataLoader(_Printed(4), cache_size="1%").cache_size
    assert 0.008 * avail < got < 0.012 * avail


def test_cpu_device_delivers_cpu_tensors():
    L = DataLoader(TwoStageToy(4), batch_size=2, device="cpu", seed=0)
    assert all(b[0].device.type == "cpu" for b in L)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_stage_with_user_sampler_runs_on_torch_machinery(num_workers):
    """A user sampler decides the order; raw/prep, per-sample RNG and stats still apply."""
    ds = TwoStageToy(10)
    L = DataLoader(ds, sampler=[3, 1, 2, 9], batch_size=2, seed=4, num_workers=num_workers)
    assert L.plan is None
    out = list(L)
    assert [b[0][:, 0].tolist() for b in out] == [[3, 1], [2, 9]]
    from coordl._rng import derive
    assert out[0][0][0, 1].item() == int(derive(4, 0, 3).random() * 2**30)
    st = L.stats()
    assert st.samples == 4 and st.bytes_from_storage == 4 * 32


def test_an_unpicklable_dataset_under_spawn_names_the_remedy():
    ds = TwoStageToy(8)
    ds.f = lambda x: x   # noqa: E731
    L = DataLoader(ds, batch_size=2, seed=0, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(Exception, match="pickle") as ei:
        list(L)
    assert "with def at module level (or as a class with __call__)" in "\n".join(ei.value.__notes__)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stats_count_the_samples_of_a_batch_samplers_batches(num_workers):
    """With a batch_sampler torch's batch_size is None, but its batches are
    collated: stats() counts their samples, not one per batch (as with
    batch_size=None, where each sample comes alone)."""
    batches = [[0, 1, 2], [3, 4, 5, 6], [7]]
    L = DataLoader(Plain(12), batch_sampler=batches, num_workers=num_workers)
    assert [len(b) for b in L] == [3, 4, 1]
    assert L.stats().samples == 8 and L.stats().batches == 3
    L = DataLoader(Plain(5), batch_size=None, num_workers=num_workers)
    assert len(list(L)) == 5 and L.stats().samples == 5
