"""coordl.DataLoader must behave exactly like torch's DataLoader for datasets
that are not two-stage.

Every test builds the same loader with ``torch.utils.data.DataLoader`` (the
reference) and with ``coordl.DataLoader`` and compares what they produce: the
batches (types and dtypes included), the random-generator state they leave
behind, the warnings, and the exceptions (type and message).
"""
from __future__ import annotations

import collections
import inspect
import json
import multiprocessing
import os
import random
import re
import time
import traceback
import warnings

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import (
    BatchSampler,
    DataLoader as TorchDataLoader,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import _datasets_for_tests as D
from coordl import DataLoader as CoordlDataLoader
from coordl.testing import live_children, run_in_child

LOADERS = (TorchDataLoader, CoordlDataLoader)

_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
if (_CPUS or 1) < 2:
    # torch warns when num_workers exceeds the usable CPUs; on such a machine the
    # two-worker tests would trip `filterwarnings = error` for both loaders alike.
    pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

def assert_same(expected, actual, path="result"):
    """Exact structural equality: same types at every level, same tensor dtype,
    shape, device, layout and values (NaN equal to NaN), same dict key order."""
    assert type(actual) is type(expected), (
        f"{path}: type {type(actual).__name__} != {type(expected).__name__}"
    )
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert actual.device == expected.device, f"{path}: device {actual.device} != {expected.device}"
        assert actual.layout == expected.layout, f"{path}: layout differs"
        assert actual.requires_grad == expected.requires_grad, f"{path}: requires_grad differs"
        equal_nan = expected.is_floating_point() or expected.is_complex()
        assert torch.equal(actual, expected) or (
            equal_nan and torch.allclose(actual, expected, rtol=0, atol=0, equal_nan=True)
        ), f"{path}: values differ:\n{actual}\n!=\n{expected}"
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape differs"
        assert np.array_equal(actual, expected, equal_nan=expected.dtype.kind in "fc"), f"{path}: values differ"
    elif isinstance(expected, collections.abc.Mapping):
        assert list(actual.keys()) == list(expected.keys()), f"{path}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_same(expected[k], actual[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{path}[{i}]")
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, f"{path}: {actual!r} != nan"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def epochs(loader, n=1):
    """The batches of ``n`` consecutive epochs, each fully consumed."""
    return [list(loader) for _ in range(n)]


def both(build, n_epochs=1, before_each=None):
    """Run ``build(DataLoaderClass)`` for torch and coordl; return both results.

    ``before_each`` runs right before each loader is built (e.g. to reseed
    global generators).  Results are lists of epochs of batches.
    """
    results = []
    for cls in LOADERS:
        if before_each is not None:
            before_each()
        loader = build(cls)
        results.append(epochs(loader, n_epochs))
        del loader
    return results


def assert_both_same(build, n_epochs=1, before_each=None):
    expected, actual = both(build, n_epochs, before_each)
    assert_same(expected, actual, "epochs")
    return expected


def seed_everything(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _summary(exc):
    """(type, message) of ``exc``, then drop the frames its traceback keeps.

    torch re-raises a worker's exception from a local variable, so the
    exception, its traceback and the frame holding the iterator form a cycle.
    Left to the garbage collector, the iterator's shutdown runs after
    multiprocessing has already finalized its index queues: the workers never
    get the stop message and each costs a 5 s join timeout plus SIGTERM.
    Clearing the frames frees the iterator at once, as a plain ``for`` loop
    over a finished epoch would.
    """
    summary = (type(exc), str(exc))
    traceback.clear_frames(exc.__traceback__)
    return summary


def outcome(fn):
    """``("ok", value)`` or ``("raised", type, message)``."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - we compare whatever is raised
        return ("raised", *_summary(exc))


def attempt(cls, dataset, kwargs):
    """Build a loader and run one epoch: ``(phase, type, message)`` where the
    phase is "init" or "iter" for whichever raised, or "ok"."""
    try:
        loader = cls(dataset, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return ("init", *_summary(exc))
    try:
        list(loader)
    except Exception as exc:  # noqa: BLE001
        return ("iter", *_summary(exc))
    return ("ok", None, None)


def recorded_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = fn()
    return value, [(w.category, str(w.message)) for w in caught]


def seeded(seed):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------
# class and signature
# --------------------------------------------------------------------------

def test_is_a_torch_dataloader_subclass():
    assert issubclass(CoordlDataLoader, TorchDataLoader)
    assert isinstance(CoordlDataLoader(D.RangeDataset(3)), TorchDataLoader)
    assert CoordlDataLoader.__name__ == "DataLoader"


def test_signature_has_every_torch_parameter_with_same_default_and_kind():
    ref = inspect.signature(TorchDataLoader.__init__).parameters
    ours = inspect.signature(CoordlDataLoader.__init__).parameters
    for name, p in ref.items():
        assert name in ours, f"missing parameter {name!r}"
        assert ours[name].kind == p.kind, f"{name}: kind {ours[name].kind} != {p.kind}"
        assert ours[name].default == p.default, f"{name}: default {ours[name].default!r} != {p.default!r}"
    # Positional parameters come in torch's order, so positional calls bind alike.
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    assert [n for n, p in ours.items() if p.kind in positional] == [
        n for n, p in ref.items() if p.kind in positional
    ]
    # Anything coordl adds is keyword-only and optional.
    for name in set(ours) - set(ref):
        assert ours[name].kind == inspect.Parameter.KEYWORD_ONLY, f"extra {name!r} must be keyword-only"
        assert ours[name].default is not inspect.Parameter.empty, f"extra {name!r} needs a default"


def test_positional_arguments_bind_like_torch():
    ds = D.RangeDataset(11)

    def build(cls):
        # dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
        # pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator
        return cls(ds, 4, True, None, None, 0, None, False, True, 0, None, None, seeded(5))

    assert_both_same(build)
    t, c = build(TorchDataLoader), build(CoordlDataLoader)
    assert (t.batch_size, t.drop_last, type(t.sampler)) == (c.batch_size, c.drop_last, type(c.sampler))


ATTRIBUTE_CONFIGS = {
    "defaults": lambda ds: {},
    "shuffled": lambda ds: {"shuffle": True, "batch_size": 3, "drop_last": True},
    "no_autocollation": lambda ds: {"batch_size": None},
    "sampler": lambda ds: {"sampler": SequentialSampler(ds), "batch_size": 2},
    "batch_sampler": lambda ds: {"batch_sampler": BatchSampler(SequentialSampler(ds), 3, False)},
    "workers": lambda ds: {"num_workers": 2},
    "workers_full": lambda ds: {
        "num_workers": 2,
        "prefetch_factor": 5,
        "persistent_workers": True,
        "timeout": 3.5,
        "worker_init_fn": D.record_worker_init,
        "multiprocessing_context": "fork",
        "in_order": False,
        "pin_memory": True,
        "generator": seeded(1),
    },
}


@pytest.mark.parametrize("config", sorted(ATTRIBUTE_CONFIGS))
def test_public_attributes_match_torch(config):
    ds = D.RangeDataset(10)
    kwargs = ATTRIBUTE_CONFIGS[config](ds)
    t, c = TorchDataLoader(ds, **kwargs), CoordlDataLoader(ds, **kwargs)
    for attr in (
        "batch_size", "drop_last", "num_workers", "prefetch_factor", "pin_memory",
        "pin_memory_device", "timeout", "persistent_workers", "in_order", "_auto_collation",
    ):
        assert getattr(c, attr) == getattr(t, attr), attr
    for attr in ("dataset", "worker_init_fn", "generator", "collate_fn"):
        assert getattr(c, attr) is getattr(t, attr), attr
    assert type(c.sampler) is type(t.sampler)
    assert type(c.batch_sampler) is type(t.batch_sampler)
    assert type(c.multiprocessing_context) is type(t.multiprocessing_context)
    if "sampler" in kwargs:
        assert c.sampler is kwargs["sampler"]
    if "batch_sampler" in kwargs:
        assert c.batch_sampler is kwargs["batch_sampler"]
    assert len(c) == len(t)


# --------------------------------------------------------------------------
# batching, length, order
# --------------------------------------------------------------------------

@pytest.mark.parametrize("batch_size", [1, 3, 7, 10, 25])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sequential_batching(batch_size, drop_last):
    ds = D.TypedDataset("tuple", n=23)
    expected = assert_both_same(lambda cls: cls(ds, batch_size=batch_size, drop_last=drop_last))
    t = TorchDataLoader(ds, batch_size=batch_size, drop_last=drop_last)
    c = CoordlDataLoader(ds, batch_size=batch_size, drop_last=drop_last)
    assert len(c) == len(t) == len(expected[0])


def test_defaults_give_batches_of_one_in_order():
    ds = D.RangeDataset(5)
    expected = assert_both_same(lambda cls: cls(ds))
    assert [b.tolist() for b in expected[0]] == [[0], [1], [2], [3], [4]]


@pytest.mark.parametrize("kind", ["tensor", "numpy", "int", "float", "str", "dict", "tuple", "nested"])
def test_batch_size_none_converts_without_collating(kind):
    ds = D.TypedDataset(kind, n=5)
    expected = assert_both_same(lambda cls: cls(ds, batch_size=None))
    assert len(expected[0]) == 5
    assert len(TorchDataLoader(ds, batch_size=None)) == len(CoordlDataLoader(ds, batch_size=None)) == 5


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_false_and_none_are_sequential(num_workers):
    ds = D.RangeDataset(9)
    for shuffle in (None, False):
        assert_both_same(lambda cls: cls(ds, batch_size=2, shuffle=shuffle, num_workers=num_workers))


@pytest.mark.parametrize(
    "build_len",
    [
        pytest.param(lambda cls: cls(D.RangeDataset(10), batch_size=3), id="map"),
        pytest.param(lambda cls: cls(D.RangeDataset(10), batch_size=3, drop_last=True), id="map_drop_last"),
        pytest.param(lambda cls: cls(D.RangeDataset(10), batch_size=None), id="map_no_batching"),
        pytest.param(lambda cls: cls(D.RangeDataset(10), sampler=[1, 2, 3, 4]), id="list_sampler"),
        pytest.param(lambda cls: cls(D.RangeDataset(10), batch_sampler=[[1, 2], [3]]), id="list_batch_sampler"),
        pytest.param(lambda cls: cls(D.RangeDataset(0)), id="empty"),
        pytest.param(lambda cls: cls(D.ShardedIterable(0, 10), batch_size=4), id="iterable"),
        pytest.param(lambda cls: cls(D.ShardedIterable(0, 10), batch_size=4, drop_last=True), id="iterable_drop_last"),
        pytest.param(lambda cls: cls(D.ShardedIterable(0, 10), batch_size=None), id="iterable_no_batching"),
        pytest.param(lambda cls: cls(D.ShardedIterable(0, 10, with_len=False)), id="iterable_without_len"),
        pytest.param(lambda cls: cls(D.RangeDataset(10), sampler=(i for i in range(3))), id="generator_sampler"),
    ],
)
def test_len_matches_torch(build_len):
    results = [outcome(lambda: len(build_len(cls))) for cls in LOADERS]
    assert results[1] == results[0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterator_protocol_matches_torch(num_workers):
    ds = D.RangeDataset(7)
    for cls in LOADERS:
        loader = cls(ds, batch_size=2, num_workers=num_workers)
        it = iter(loader)
        assert iter(it) is it
        assert len(it) == len(TorchDataLoader(ds, batch_size=2)) == 4
        assert len(list(it)) == 4
        with pytest.raises(StopIteration):
            next(it)
        del it, loader


def test_empty_dataset_yields_nothing():
    ds = D.RangeDataset(0)
    expected = assert_both_same(lambda cls: cls(ds, batch_size=4))
    assert expected == [[]]


# --------------------------------------------------------------------------
# shuffling and randomness
# --------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 12345])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_with_generator(seed, num_workers):
    ds = D.RangeDataset(50)
    gens = {}

    def build(cls):
        gens[cls] = seeded(seed)
        return cls(ds, batch_size=4, shuffle=True, generator=gens[cls], num_workers=num_workers)

    expected = assert_both_same(build)
    flat = torch.cat(expected[0]).tolist()
    assert sorted(flat) == list(range(50)) and flat != list(range(50))
    # The loader consumed the generator exactly as torch's did.
    assert torch.equal(gens[CoordlDataLoader].get_state(), gens[TorchDataLoader].get_state())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_with_global_seed(num_workers):
    ds = D.RangeDataset(40)
    states = {}
    results = []
    for cls in LOADERS:
        torch.manual_seed(77)
        loader = cls(ds, batch_size=5, shuffle=True, num_workers=num_workers)
        results.append(epochs(loader))
        states[cls] = torch.get_rng_state()
        del loader
    assert_same(results[0], results[1])
    # Same draws from the global generator (a training loop relying on it
    # afterwards would otherwise diverge).
    assert torch.equal(states[CoordlDataLoader], states[TorchDataLoader])


@pytest.mark.parametrize("use_generator", [True, False], ids=["generator", "global_seed"])
def test_consecutive_epochs_match_torch(use_generator):
    ds = D.RangeDataset(30)

    def build(cls):
        kwargs = {"generator": seeded(3)} if use_generator else {}
        return cls(ds, batch_size=4, shuffle=True, **kwargs)

    expected = assert_both_same(build, n_epochs=3, before_each=lambda: torch.manual_seed(3))
    orders = [torch.cat(epoch).tolist() for epoch in expected]
    assert orders[0] != orders[1] != orders[2], "each epoch should reshuffle"


def test_abandoned_epoch_then_new_epoch_matches_torch():
    ds = D.RangeDataset(30)
    results = []
    for cls in LOADERS:
        loader = cls(ds, batch_size=4, shuffle=True, generator=seeded(8))
        it = iter(loader)
        first = [next(it), next(it)]
        del it
        results.append((first, list(loader), list(loader)))
        del loader
    assert_same(results[0], results[1])


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("use_generator", [True, False], ids=["generator", "global_seed"])
def test_random_draws_inside_dataset_match_torch(num_workers, use_generator):
    """The generators a sample sees (torch, random, numpy; seeded per worker
    when loading in workers) are the same as under torch."""
    ds = D.RandomDrawDataset(24)

    def build(cls):
        kwargs = {"generator": seeded(11)} if use_generator else {}
        return cls(ds, batch_size=3, shuffle=True, num_workers=num_workers, **kwargs)

    assert_both_same(build, n_epochs=2, before_each=lambda: seed_everything(2024))


def test_worker_info_matches_torch():
    ds = D.WorkerInfoDataset(12)

    def build(cls):
        return cls(ds, batch_size=2, num_workers=2, generator=seeded(99), collate_fn=D.identity_collate)

    expected = assert_both_same(build)
    infos = [info for batch in expected[0] for _, info in batch]
    assert {i["id"] for i in infos} == {0, 1}
    assert all(i["num_workers"] == 2 and i["dataset_is_copy_of_mine"] for i in infos)
    assert all(i["seed"] == i["torch_initial_seed"] for i in infos)


def test_worker_info_is_none_in_main_process():
    ds = D.WorkerInfoDataset(3)
    expected = assert_both_same(lambda cls: cls(ds, batch_size=None))
    assert all(info is None for _, info in expected[0])
    assert tud.get_worker_info() is None


# --------------------------------------------------------------------------
# samplers, batch samplers, collate functions, sample types
# --------------------------------------------------------------------------

SAMPLERS = {
    "sequential": lambda ds: SequentialSampler(ds),
    "random_with_generator": lambda ds: RandomSampler(ds, generator=seeded(4)),
    "random_with_replacement": lambda ds: RandomSampler(ds, replacement=True, num_samples=13, generator=seeded(4)),
    "subset_random": lambda ds: SubsetRandomSampler([3, 1, 4, 1, 5, 9, 2, 6], generator=seeded(4)),
    "weighted": lambda ds: WeightedRandomSampler([0.1] * 10 + [1.0] * 10, 15, generator=seeded(4)),
    "plain_list": lambda ds: [5, 3, 3, 0, 19, 7, 2],
    "range": lambda ds: range(19, -1, -3),
    "generator_expression": lambda ds: (i * 2 for i in range(7)),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
@pytest.mark.parametrize("batch_size", [None, 1, 3])
def test_custom_sampler(name, batch_size):
    ds = D.RangeDataset(20)
    samplers = {}

    def build(cls):
        samplers[cls] = SAMPLERS[name](ds)
        return cls(ds, batch_size=batch_size, sampler=samplers[cls])

    assert_both_same(build)
    loader = CoordlDataLoader(ds, sampler=samplers[CoordlDataLoader], batch_size=batch_size)
    assert loader.sampler is samplers[CoordlDataLoader]


def test_sampler_is_not_consumed_at_construction_and_is_reiterable():
    ds = D.RangeDataset(12)
    expected = assert_both_same(
        lambda cls: cls(ds, batch_size=5, sampler=RandomSampler(ds, generator=seeded(6))), n_epochs=2
    )
    assert not all(torch.equal(a, b) for a, b in zip(*expected))


BATCH_SAMPLERS = {
    "batch_sampler_random": lambda ds: BatchSampler(RandomSampler(ds, generator=seeded(2)), 4, False),
    "batch_sampler_drop_last": lambda ds: BatchSampler(SequentialSampler(ds), 4, True),
    "list_of_lists": lambda ds: [[0, 1, 2], [5], [4, 4, 3, 9]],
    "generator_of_lists": lambda ds: ([i, i + 1] for i in range(0, 10, 2)),
}


@pytest.mark.parametrize("name", sorted(BATCH_SAMPLERS))
@pytest.mark.parametrize("num_workers", [0, 2])
def test_custom_batch_sampler(name, num_workers):
    ds = D.TypedDataset("dict", n=10)
    assert_both_same(lambda cls: cls(ds, batch_sampler=BATCH_SAMPLERS[name](ds), num_workers=num_workers))


def test_empty_batch_from_batch_sampler_fails_like_torch():
    ds = D.RangeDataset(10)
    results = [attempt(cls, ds, {"batch_sampler": [[0, 1], []]}) for cls in LOADERS]
    assert results[0][0] == "iter"
    assert results[1] == results[0]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 4])
def test_custom_collate_fn(num_workers, batch_size):
    ds = D.RangeDataset(10)
    collate = D.tagging_collate if batch_size else D.tagging_convert
    assert_both_same(lambda cls: cls(ds, batch_size=batch_size, collate_fn=collate, num_workers=num_workers))


@pytest.mark.parametrize("kind", D.TypedDataset.KINDS)
def test_sample_types_collate_identically(kind):
    ds = D.TypedDataset(kind, n=7)
    assert_both_same(lambda cls: cls(ds, batch_size=3))


def test_sample_types_collate_identically_in_workers():
    ds = D.TypedDataset("nested", n=9)
    assert_both_same(lambda cls: cls(ds, batch_size=2, num_workers=2))


@pytest.mark.parametrize("kind", ["none", "ragged", "numpy_str", "ragged_list"])
def test_collate_errors_match_torch(kind):
    ds = D.BadSampleDataset(kind)
    results = [attempt(cls, ds, {"batch_size": 3}) for cls in LOADERS]
    assert results[0][0] == "iter"
    assert results[1] == results[0]


# --------------------------------------------------------------------------
# __getitems__
# --------------------------------------------------------------------------

@pytest.mark.parametrize("batch_size", [None, 1, 4])
def test_getitems_is_used_the_same_way(batch_size):
    datasets = {}

    def build(cls):
        datasets[cls] = D.GetItemsDataset(10)
        return cls(datasets[cls], batch_size=batch_size, shuffle=True, generator=seeded(1))

    assert_both_same(build)
    assert datasets[CoordlDataLoader].calls == datasets[TorchDataLoader].calls
    kinds = {k for k, _ in datasets[TorchDataLoader].calls}
    assert kinds == ({"getitem"} if batch_size is None else {"getitems"})


def test_getitems_in_workers():
    ds = D.GetItemsDataset(11)
    assert_both_same(lambda cls: cls(ds, batch_size=3, num_workers=2))
    assert ds.calls == []  # only the workers' copies were used


# --------------------------------------------------------------------------
# iterable-style datasets
# --------------------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size,drop_last", [(None, False), (1, False), (4, False), (4, True)])
def test_iterable_dataset_sharded_with_get_worker_info(num_workers, batch_size, drop_last):
    ds = D.ShardedIterable(0, 23)
    expected = assert_both_same(
        lambda cls: cls(ds, batch_size=batch_size, drop_last=drop_last, num_workers=num_workers),
        n_epochs=2,
    )
    if not drop_last:
        if batch_size is None:
            values = [int(s["value"]) for s in expected[0]]
        else:
            values = [int(v) for b in expected[0] for v in b["value"]]
        assert sorted(values) == list(range(23))


def test_iterable_dataset_without_sharding_duplicates_like_torch():
    ds = D.UnshardedIterable(5)
    expected = assert_both_same(lambda cls: cls(ds, batch_size=2, num_workers=2))
    assert sum(len(b) for b in expected[0]) == 10


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_dataset_length_warning_matches_torch(num_workers):
    ds = D.LyingLengthIterable(actual=6, reported=3)
    results = []
    for cls in LOADERS:
        loader = cls(ds, batch_size=None, num_workers=num_workers)
        assert len(loader) == 3
        batches, caught = recorded_warnings(lambda: list(loader))
        results.append((batches, caught))
        del loader
    assert_same(results[0][0], results[1][0])
    assert results[0][1], "torch should warn about the wrong length"
    assert results[1][1] == results[0][1]


def test_error_inside_iterable_dataset_matches_torch():
    ds = D.FailingIterable(8, bad=3)
    results = [attempt(cls, ds, {"batch_size": 2}) for cls in LOADERS]
    assert results[0] == ("iter", RuntimeError, "stream broke at 3")
    assert results[1] == results[0]


# --------------------------------------------------------------------------
# workers
# --------------------------------------------------------------------------

def test_worker_init_fn_called_once_per_worker(tmp_path):
    results = {}
    for cls in LOADERS:
        log = tmp_path / f"{cls.__module__}.log"
        ds = D.InitRecordingDataset(16, log_path=log)
        loader = cls(ds, batch_size=2, num_workers=2, worker_init_fn=D.record_worker_init,
                     collate_fn=D.identity_collate)
        results[cls] = (epochs(loader, 2), sorted(log.read_text().split("\n")[:-1]))
        del loader
    (t_data, t_log), (c_data, c_log) = results[TorchDataLoader], results[CoordlDataLoader]
    assert_same(t_data, c_data)
    # Each sample sees exactly one init call in its worker, made with the
    # worker's own id; batches alternate between the two workers.
    for k, batch in enumerate(c_data[0]):
        for _, calls in batch:
            assert calls == [(k % 2, k % 2, 2)]
    # Two epochs without persistent workers: two workers started per epoch.
    assert [line.split()[0] for line in c_log] == [line.split()[0] for line in t_log] == ["0", "0", "1", "1"]
    assert len({line.split()[1] for line in c_log}) == 4
    assert ds.init_calls == []  # never called in the main process


def _worker_pids(epoch):
    return {int(p) for batch in epoch for p in batch[4]}


def test_persistent_workers_over_three_epochs():
    ds = D.RandomDrawDataset(20, with_pid=True)
    results = {}
    for cls in LOADERS:
        seed_everything(5)
        loader = cls(ds, batch_size=3, shuffle=True, num_workers=2, persistent_workers=True,
                     generator=seeded(21))
        runs = []
        for _ in range(3):
            runs.append(list(loader))
            pids = _worker_pids(runs[-1])
            alive = {p.pid for p in live_children()}
            assert pids <= alive, "persistent workers must outlive the epoch"
        results[cls] = runs
        del loader
    for cls, runs in results.items():
        pid_sets = [_worker_pids(r) for r in runs]
        assert len(pid_sets[0]) == 2 and os.getpid() not in pid_sets[0]
        assert pid_sets[0] == pid_sets[1] == pid_sets[2], f"{cls.__module__}: workers were replaced"

    def without_pids(runs):
        return [[batch[:4] for batch in epoch] for epoch in runs]

    assert_same(without_pids(results[TorchDataLoader]), without_pids(results[CoordlDataLoader]))


def test_non_persistent_workers_exit_after_each_epoch():
    ds = D.RandomDrawDataset(8, with_pid=True)
    loader = CoordlDataLoader(ds, batch_size=2, num_workers=2)
    pid_sets = []
    for _ in range(2):
        epoch = list(loader)
        pids = _worker_pids(epoch)
        deadline = time.monotonic() + 5
        while pids & {p.pid for p in live_children()} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not pids & {p.pid for p in live_children()}, "workers outlived their epoch"
        pid_sets.append(pids)
    assert pid_sets[0].isdisjoint(pid_sets[1])


@pytest.mark.parametrize("prefetch_factor", [1, 2, 4])
def test_prefetch_factor_same_data(prefetch_factor):
    ds = D.RangeDataset(17)
    assert_both_same(lambda cls: cls(ds, batch_size=2, num_workers=2, prefetch_factor=prefetch_factor))
    assert CoordlDataLoader(ds, num_workers=2, prefetch_factor=prefetch_factor).prefetch_factor == prefetch_factor


def _line_count(path):
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _settled_count(path, quiet=1.0, limit=15.0):
    deadline = time.monotonic() + limit
    last, since = _line_count(path), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _line_count(path)
        if now != last:
            last, since = now, time.monotonic()
        elif last and time.monotonic() - since >= quiet:
            break
    return last


@pytest.mark.parametrize("prefetch_factor", [1, 3])
def test_prefetch_depth_matches_torch(tmp_path, prefetch_factor):
    """How far ahead the workers read after the first batch is taken."""
    counts = {}
    for cls in LOADERS:
        path = tmp_path / f"{cls.__module__}.log"
        loader = cls(D.FetchLogDataset(60, path), batch_size=1, num_workers=2, prefetch_factor=prefetch_factor)
        it = iter(loader)
        next(it)
        counts[cls] = _settled_count(path)
        assert len(list(it)) == 59
        del it, loader
    assert counts[TorchDataLoader] < 60
    assert counts[CoordlDataLoader] == counts[TorchDataLoader]


def test_in_order_false_yields_same_multiset():
    ds = D.SlowFirstDataset(24, delay=0.3)
    expected, actual = both(lambda cls: cls(ds, batch_size=2, num_workers=2, in_order=False))
    key = lambda epoch: sorted(b.tolist() for b in epoch)  # noqa: E731
    assert key(actual[0]) == key(expected[0])
    assert sorted(torch.cat(actual[0]).tolist()) == list(range(24))


def test_spawn_context_with_importable_dataset():
    ds = D.StartMethodDataset(6)
    expected = assert_both_same(
        lambda cls: cls(ds, batch_size=2, num_workers=2, multiprocessing_context="spawn")
    )
    assert all(bool(flag) for batch in expected[0] for flag in batch[1]), "workers were not spawned"
    assert [b[2].tolist() for b in expected[0]] == [[0, 0], [1, 1], [0, 0]]


def test_context_object_is_accepted_like_torch():
    ds = D.RangeDataset(6)
    ctx = multiprocessing.get_context("fork")
    assert_both_same(lambda cls: cls(ds, batch_size=2, num_workers=2, multiprocessing_context=ctx))
    assert CoordlDataLoader(ds, num_workers=2, multiprocessing_context=ctx).multiprocessing_context is ctx


# --------------------------------------------------------------------------
# argument errors
# --------------------------------------------------------------------------

def _map(n=10):
    return D.RangeDataset(n)


def _iterable():
    return D.ShardedIterable(0, 10)


INVALID = {
    "negative_num_workers": (_map, lambda ds: {"num_workers": -1}),
    "negative_timeout": (_map, lambda ds: {"timeout": -0.5}),
    "negative_workers_and_timeout": (_map, lambda ds: {"num_workers": -2, "timeout": -1}),
    "prefetch_factor_without_workers": (_map, lambda ds: {"prefetch_factor": 2}),
    "negative_prefetch_factor": (_map, lambda ds: {"num_workers": 2, "prefetch_factor": -1}),
    "persistent_without_workers": (_map, lambda ds: {"persistent_workers": True}),
    "sampler_and_shuffle": (_map, lambda ds: {"sampler": SequentialSampler(ds), "shuffle": True}),
    "batch_sampler_and_batch_size": (_map, lambda ds: {"batch_sampler": [[0, 1]], "batch_size": 2}),
    "batch_sampler_and_shuffle": (_map, lambda ds: {"batch_sampler": [[0, 1]], "shuffle": True}),
    "batch_sampler_and_sampler": (_map, lambda ds: {"batch_sampler": [[0, 1]], "sampler": [0, 1]}),
    "batch_sampler_and_drop_last": (_map, lambda ds: {"batch_sampler": [[0, 1]], "drop_last": True}),
    "no_batching_and_drop_last": (_map, lambda ds: {"batch_size": None, "drop_last": True}),
    "zero_batch_size": (_map, lambda ds: {"batch_size": 0}),
    "bool_batch_size": (_map, lambda ds: {"batch_size": True}),
    "non_bool_drop_last": (_map, lambda ds: {"drop_last": "yes"}),
    "shuffle_empty_dataset": (lambda: _map(0), lambda ds: {"shuffle": True}),
    "iterable_shuffle": (_iterable, lambda ds: {"shuffle": True}),
    "iterable_sampler": (_iterable, lambda ds: {"sampler": [0, 1, 2]}),
    "iterable_batch_sampler": (_iterable, lambda ds: {"batch_sampler": [[0, 1]]}),
    "iterable_shuffle_and_sampler": (_iterable, lambda ds: {"shuffle": True, "sampler": [0]}),
    "bad_context_string": (_map, lambda ds: {"num_workers": 2, "multiprocessing_context": "bogus"}),
    "bad_context_type": (_map, lambda ds: {"num_workers": 2, "multiprocessing_context": 42}),
    "context_without_workers": (_map, lambda ds: {"multiprocessing_context": "fork"}),
    "timeout_without_workers": (_map, lambda ds: {"timeout": 1.0}),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_arguments_raise_like_torch(case):
    make_ds, make_kwargs = INVALID[case]
    ds = make_ds()
    kwargs = make_kwargs(ds)  # shared: messages may embed reprs of these objects
    expected = attempt(TorchDataLoader, ds, kwargs)
    actual = attempt(CoordlDataLoader, ds, kwargs)
    assert expected[0] != "ok", f"torch accepted {case}"
    assert actual == expected


@pytest.mark.parametrize(
    "attr", ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"]
)
def test_setting_locked_attribute_after_init_raises_like_torch(attr):
    ds = D.RangeDataset(10)
    results, values = [], []
    for cls in LOADERS:
        loader = cls(ds, batch_size=2)
        before = getattr(loader, attr)
        results.append(outcome(lambda: setattr(loader, attr, 3)))
        values.append(getattr(loader, attr) is before)
    assert results[0][0] == "raised"
    assert results[1] == results[0]
    assert values == [True, True]


def test_too_many_workers_warns_like_torch():
    ds = D.RangeDataset(4)
    n = (_CPUS or 1) + 1
    caught = [recorded_warnings(lambda: cls(ds, num_workers=n))[1] for cls in LOADERS]
    assert caught[0], "torch should warn"
    assert caught[1] == caught[0]


@pytest.mark.parametrize("pin_memory_device", ["", "cpu"])
def test_pin_memory_without_accelerator_like_torch(pin_memory_device):
    ds = D.TypedDataset("dict", n=6)
    results = []
    for cls in LOADERS:
        loader = cls(ds, batch_size=4, pin_memory=True, pin_memory_device=pin_memory_device)
        results.append(recorded_warnings(lambda: list(loader)))
    assert_same(results[0][0], results[1][0])
    assert results[1][1] == results[0][1]


# --------------------------------------------------------------------------
# errors raised while loading
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["value", "key", "two_arg", "index"])
def test_dataset_error_in_main_process_propagates_unchanged(kind):
    ds = D.FailingDataset(10, bad=5, kind=kind)
    results = []
    for cls in LOADERS:
        loader = cls(ds, batch_size=2)
        try:
            list(loader)
        except Exception as exc:  # noqa: BLE001
            results.append((type(exc), exc.args, str(exc)))
            traceback.clear_frames(exc.__traceback__)
        else:
            results.append(None)
    assert results[0] is not None
    assert results[1] == results[0]


def _message_shape(msg):
    lines = msg.strip("\n").split("\n")
    return lines[0], lines[1], lines[-1]


@pytest.mark.parametrize("kind", ["value", "key", "two_arg"])
def test_dataset_error_in_worker_propagates_like_torch(kind):
    ds = D.FailingDataset(10, bad=5, kind=kind)
    results = [attempt(cls, ds, {"batch_size": 2, "num_workers": 2}) for cls in LOADERS]
    (t_phase, t_type, t_msg), (c_phase, c_type, c_msg) = results
    # torch re-raises the worker's exception type, or RuntimeError when that
    # type cannot be rebuilt from a single message.
    expected_type = {"value": ValueError, "key": KeyError, "two_arg": RuntimeError}[kind]
    assert (t_phase, t_type) == ("iter", expected_type)
    assert (c_phase, c_type) == (t_phase, t_type)
    first, second, last = _message_shape(t_msg)
    assert re.fullmatch(r"Caught \w+ in DataLoader worker process \d\.", first), first
    assert second == "Original Traceback (most recent call last):"
    assert _message_shape(c_msg) == (first, second, last)
    # The dataset's own frame is in the forwarded traceback.
    for msg in (t_msg, c_msg):
        assert "_datasets_for_tests.py" in msg and "__getitem__" in msg


def test_worker_timeout_raises_like_torch():
    ds = D.SlowFirstDataset(4, delay=1.5)
    results = [attempt(cls, ds, {"num_workers": 2, "timeout": 0.2}) for cls in LOADERS]
    assert results[0] == ("iter", RuntimeError, "DataLoader timed out after 0.2 seconds")
    assert results[1] == results[0]


CRASH_CHILD = r"""
import json, os, re, sys
import torch
from torch.utils.data import Dataset, DataLoader as TorchDataLoader
from coordl import DataLoader as CoordlDataLoader

class Exits(Dataset):
    # Worker 1 dies at the first sample it is given (index 2, mid-epoch: batch
    # 0 comes from worker 0), before it has sent any batch.  A worker that
    # dies *after* sending a batch makes the outcome a race in torch itself:
    # a batch's tensors cross in shared memory whose fd the receiving process
    # fetches from the sender's resource_sharer thread, so if the sender has
    # died by then, unpickling the batch raises ConnectionResetError or
    # EOFError (seen once each, for torch and for coordl, which runs torch's
    # machinery for plain datasets) instead of the "exited unexpectedly" error.
    def __len__(self):
        return 12
    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        if info is not None and info.id == 1:
            os._exit(7)
        return i

out = {}
for cls in (TorchDataLoader, CoordlDataLoader):
    # on stderr, which loader was running: a timeout's report then says which one hung
    print("starting", cls.__module__, file=sys.stderr, flush=True)
    loader = cls(Exits(), batch_size=2, num_workers=2)
    try:
        list(loader)
        out[cls.__module__] = None
    except Exception as exc:
        out[cls.__module__] = [type(exc).__name__, str(exc)]
    print("raised" if out[cls.__module__] else "ended", cls.__module__, file=sys.stderr, flush=True)
    del loader
    print("released", cls.__module__, file=sys.stderr, flush=True)
print(json.dumps(out))
"""


def test_worker_crash_raises_like_torch():
    res = run_in_child(CRASH_CHILD, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.stragglers == [], "a crashed loader left processes behind"
    # Which of torch's two detection paths fires (SIGCHLD handler or the
    # queue-poll liveness check) is a race, so compare the shape only.
    shape = re.compile(r"DataLoader worker \(pids?(\(s\))? [\d, ]+\) exited unexpectedly")
    for module, result in out.items():
        assert result is not None, f"{module} did not notice the crash"
        assert result[0] == "RuntimeError", (module, result)
        assert shape.search(result[1]), (module, result)
