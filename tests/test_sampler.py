"""A user's sampler or batch sampler over a two-stage dataset runs on
coordl's pipeline: the indices torch's DataLoader would deliver for the
same torch seed, epoch after epoch, read ahead and prepared in coordl's
workers; resume exact."""
import gc
import os
import pickle
import random

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data import DataLoader as TorchDataLoader

import coordl
from coordl import DataLoader, SampleError, StateError
from toydata import TwoStageToy


class Plain(TwoStageToy):
    """Two-stage samples without random draws: under torch's DataLoader
    with num_workers=0 a random transform draws from the generator the
    sampler draws from, and the orders would part from the second epoch."""

    def prep(self, raw, i):
        return torch.tensor([int.from_bytes(raw[:8], "little")]), i % 3


N = 23


def _indices(loader, epochs=2):
    out = []
    for _ in range(epochs):
        out.append([i for b in loader for i in b[0][:, 0].tolist()])
    return out


SAMPLERS = {
    "random": lambda ds: RandomSampler(ds),
    "random_generator": lambda ds: RandomSampler(ds, generator=torch.Generator().manual_seed(3)),
    "random_replacement": lambda ds: RandomSampler(ds, replacement=True, num_samples=17),
    "sequential": lambda ds: SequentialSampler(ds),
    "distributed": lambda ds: DistributedSampler(ds, num_replicas=3, rank=1, seed=4),
    "distributed_drop_last": lambda ds: DistributedSampler(ds, num_replicas=3, rank=2, shuffle=False,
                                                           drop_last=True),
    "subset_random": lambda ds: SubsetRandomSampler([3, 1, 4, 15, 9, 2, 6]),
    "weighted": lambda ds: WeightedRandomSampler([0.1] * 10 + [1.0] * 13, 15),
    "list": lambda ds: [5, 3, 3, 0, 19, 7, 22],
}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_sampler_order_is_torchs_on_coordls_pipeline(name, num_workers):
    ds = Plain(N)
    got = {}
    for cls in (TorchDataLoader, DataLoader):
        torch.manual_seed(11)
        L = cls(ds, batch_size=4, sampler=SAMPLERS[name](ds), num_workers=num_workers)
        got[cls] = _indices(L)
        got[cls, "after"] = torch.rand(2)   # torch's generator left where torch leaves it
    assert got[DataLoader] == got[TorchDataLoader]
    assert torch.equal(got[DataLoader, "after"], got[TorchDataLoader, "after"])
    assert L.stats().path == "coordl" and "order of the loader's sampler" in L.stats().path_reason
    assert L.stats().samples_from_storage == 2 * len(got[DataLoader][0])


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_order_is_torchs(num_workers, persistent, drop_last):
    ds = Plain(N)
    got = {}
    for cls in (TorchDataLoader, DataLoader):
        torch.manual_seed(2)
        L = cls(ds, batch_sampler=BatchSampler(RandomSampler(ds), 5, drop_last), num_workers=num_workers,
                persistent_workers=persistent)
        got[cls] = [[b[0][:, 0].tolist() for b in L] for _ in range(2)]
    assert got[DataLoader] == got[TorchDataLoader]
    assert L.stats().path == "coordl"


def test_irregular_batches_and_no_batching():
    ds = Plain(N)
    steps = [[0, 1, 2], [5], [4, 4, 3, 9]]
    got = [b[0][:, 0].tolist() for b in DataLoader(ds, batch_sampler=steps, num_workers=2)]
    assert got == steps
    single = list(DataLoader(ds, batch_size=None, sampler=[7, 2, 2], num_workers=2))
    ref = list(TorchDataLoader(ds, batch_size=None, sampler=[7, 2, 2]))
    assert [x[0].tolist() for x in single] == [x[0].tolist() for x in ref] == [[7], [2], [2]]


class CountingSampler(torch.utils.data.Sampler):
    """Records who iterates it, and when."""

    def __init__(self, n):
        self.n, self.calls = n, []

    def __len__(self):
        return self.n

    def __iter__(self):
        self.calls.append(os.getpid())
        return iter(range(self.n - 1, -1, -1))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_sampler_is_iterated_once_per_epoch_in_the_main_process(num_workers):
    s = CountingSampler(N)
    L = DataLoader(Plain(N), batch_size=4, sampler=s, num_workers=num_workers)
    assert s.calls == []   # not at construction
    for epoch in range(3):
        it = iter(L)
        assert s.calls == [os.getpid()] * (epoch + 1)   # when the pass starts, as torch's iterator
        assert [i for b in it for i in b[0][:, 0].tolist()] == list(range(N - 1, -1, -1))


def test_distributed_sampler_set_epoch_by_the_loader_or_the_sampler():
    ds = Plain(N)
    for via_loader in (True, False):
        s = DistributedSampler(ds, num_replicas=2, rank=0, seed=9)
        L = DataLoader(ds, batch_size=3, sampler=s, num_workers=2)
        for epoch in (0, 1, 5):
            (L if via_loader else s).set_epoch(epoch)
            ref = DistributedSampler(ds, num_replicas=2, rank=0, seed=9)
            ref.set_epoch(epoch)
            want = list(ref)
            assert [i for b in L for i in b[0][:, 0].tolist()] == want


# ---------------------------------------------------------------- resume
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("in_order", [True, False])
def test_resume_mid_epoch_is_exact_and_later_epochs_follow(num_workers, in_order):
    ds = TwoStageToy(N)   # random draws per sample: augmentation resumes exactly too

    def make():
        return DataLoader(ds, batch_size=4, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(8)),
                          num_workers=num_workers, in_order=in_order, seed=None if in_order else 3)

    torch.manual_seed(0)
    ref = make()
    full = [b[0] for b in ref] + [b[0] for b in ref]
    torch.manual_seed(0)
    a = make()
    it = iter(a)
    got = [next(it)[0] for _ in range(3)]
    state = pickle.loads(pickle.dumps(a.state_dict()))
    assert state["order"] is not None and sorted(state["order"]["indices"].tolist()) == list(range(N))
    del it, a
    gc.collect()
    torch.manual_seed(123)   # another process: its own global RNG
    b = make()
    b.load_state_dict(state)
    got += [x[0] for x in b] + [x[0] for x in b]
    key = lambda t: t[:, 0].tolist()  # noqa: E731
    if in_order:
        assert [key(x) for x in got] == [key(x) for x in full]
        assert all(torch.equal(x, y) for x, y in zip(got, full))
    else:
        assert sorted(map(key, got[:6])) == sorted(map(key, full[:6]))


class PythonRandomSampler(torch.utils.data.Sampler):
    """Randomness from Python's random module: not a torch generator a
    state saves."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        order = list(range(self.n))
        random.shuffle(order)
        return iter(order)


def test_resume_follows_the_recorded_order_when_the_sampler_cannot_replay_it():
    ds = Plain(N)
    random.seed(1)
    a = DataLoader(ds, batch_size=4, sampler=PythonRandomSampler(N), num_workers=2)
    it = iter(a)
    first = [next(it)[0][:, 0].tolist() for _ in range(2)]
    rest = [b[0][:, 0].tolist() for b in it]
    random.seed(1)
    a = DataLoader(ds, batch_size=4, sampler=PythonRandomSampler(N), num_workers=2)
    it = iter(a)
    assert [next(it)[0][:, 0].tolist() for _ in range(2)] == first
    state = a.state_dict()
    del it
    random.seed(77)
    b = DataLoader(ds, batch_size=4, sampler=PythonRandomSampler(N), num_workers=2)
    b.load_state_dict(state)
    with pytest.warns(UserWarning, match="another order for epoch 0 than the one the loaded state recorded"):
        got = [x[0][:, 0].tolist() for x in b]
    assert got == rest


def test_a_state_from_another_order_length_is_refused():
    ds = Plain(N)
    a = DataLoader(ds, batch_size=4, sampler=list(range(8)))
    it = iter(a)
    next(it)
    state = a.state_dict()
    state["order"]["lengths"] = torch.tensor([4, 4, 4])
    with pytest.raises(StateError, match="order"):
        DataLoader(ds, batch_size=4, sampler=list(range(8))).load_state_dict(state)
    del it


# ---------------------------------------------------------------- edges
def test_an_index_out_of_range_is_named_when_the_pass_starts():
    L = DataLoader(Plain(N), batch_size=4, sampler=[0, 1, N], num_workers=2)
    with pytest.raises(IndexError, match=f"index {N}, but the dataset has {N} samples"):
        iter(L)
    assert len(list(DataLoader(Plain(N), batch_size=4, sampler=[0, 1, 2]))) == 1   # the loader still works


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_empty_batch_fails_that_step_like_torch(num_workers):
    ds = Plain(N)
    L = DataLoader(ds, batch_sampler=[[0, 1], [], [2]], num_workers=num_workers)
    it = iter(L)
    assert next(it)[0][:, 0].tolist() == [0, 1]
    with pytest.raises(SampleError) as ei:
        next(it)
    with pytest.raises(type(ei.value.__cause__) if ei.value.__cause__ else Exception):
        next(iter(TorchDataLoader(ds, batch_sampler=[[]])))
    assert next(it)[0][:, 0].tolist() == [2]


def test_a_sampler_without_a_length_stays_on_torchs_machinery_and_says_why():
    ds = Plain(N)

    class Endless(torch.utils.data.Sampler):
        def __iter__(self):
            return iter([4, 2, 0])

    L = DataLoader(ds, batch_size=2, sampler=Endless())
    s = L.stats()
    assert s.path == "torch" and "no len()" in s.path_reason, s
    assert [b[0][:, 0].tolist() for b in L] == [[4, 2], [0]]


def test_share_says_it_needs_the_epoch_plan():
    ds = Plain(N)
    with pytest.warns(UserWarning, match="share=True has no effect here.*user sampler"):
        DataLoader(ds, batch_size=2, sampler=[1, 2], share=True)


def test_pin_memory_and_the_node_cache_with_a_sampler(tmp_path):
    from coordl.synth import make_image_folder

    make_image_folder(str(tmp_path), num_images=12, num_classes=2, image_size=(40, 30), seed=1)
    ds = coordl.ImageFolder(str(tmp_path), transform=coordl.transforms.PILToTensor())
    L = DataLoader(ds, batch_size=4, sampler=RandomSampler(ds), num_workers=2, cache_size="1MiB", pin_memory=True)
    list(L), list(L)
    e0, e1 = L.stats().epochs
    assert e0.bytes_from_storage > 0 and e1.bytes_from_cache == e0.bytes_from_storage


class RepeatedAugmentation(torch.utils.data.Sampler):
    """Each index ``times`` times in a row (the shape of torchvision's
    reference ``RASampler``, without its distribution across ranks)."""

    def __init__(self, n: int, times: int = 3):
        self.n, self.times = n, times

    def __iter__(self):
        return iter([i for i in range(self.n) for _ in range(self.times)])

    def __len__(self) -> int:
        return self.n * self.times


def _draws_by_index(batches) -> dict:
    out: dict = {}
    for b in batches:
        for value, draw, _ in b[0].tolist():
            out.setdefault(value, []).append(draw)
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("name", ["repeated", "weighted", "random_replacement"])
def test_a_repeated_index_draws_its_own_augmentation_each_time(num_workers, name):
    """A sampler that repeats an index within a pass (repeated augmentation,
    sampling with replacement: each draw of torch's DataLoader a new one)
    gets a new augmentation each time: the first time the one the index
    gets in a pass without repeats, the next ones each their own; the same
    for any number of workers, and after a resume mid-pass."""
    ds = TwoStageToy(N)
    sampler = {"repeated": lambda: RepeatedAugmentation(N),
               "weighted": lambda: WeightedRandomSampler([1.0] * 3 + [0.01] * (N - 3), 30,
                                                         generator=torch.Generator().manual_seed(2)),
               "random_replacement": lambda: RandomSampler(ds, replacement=True, num_samples=40,
                                                           generator=torch.Generator().manual_seed(5))}[name]

    def make(workers):
        return DataLoader(ds, batch_size=4, sampler=sampler(), num_workers=workers, seed=7)

    batches = list(make(num_workers))
    by = _draws_by_index(batches)
    assert any(len(d) > 1 for d in by.values()), by
    for value, draws in by.items():
        assert len(set(draws)) == len(draws), (value, draws)      # each time its own draw
    once = _draws_by_index(DataLoader(ds, batch_size=4, sampler=SequentialSampler(ds), seed=7))
    assert all(draws[0] == once[value][0] for value, draws in by.items())   # the first time: the index's own
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, make(0 if num_workers else 2)))
    a = make(num_workers)
    it = iter(a)
    got = [next(it)[0] for _ in range(2)]
    state = pickle.loads(pickle.dumps(a.state_dict()))
    del it, a
    gc.collect()
    b = make(num_workers)
    b.load_state_dict(state)
    got += [x[0] for x in b]
    assert len(got) == len(batches) and all(torch.equal(x, y[0]) for x, y in zip(got, batches))


class RepeatsAcrossRanks(torch.utils.data.Sampler):
    """Repeated augmentation as torchvision's ``RASampler`` and timm's
    ``RepeatAugSampler`` spread it: each index ``times`` times in a row,
    then every ``num_replicas``-th position from ``rank`` (so the repeats
    of an index land on different ranks)."""

    def __init__(self, n: int, rank: int, num_replicas: int = 2, times: int = 2):
        self.n, self.rank, self.num_replicas, self.times = n, rank, num_replicas, times

    def __iter__(self):
        every = [i for i in range(self.n) for _ in range(self.times)]
        return iter(every[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return self.n * self.times // self.num_replicas


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("how", ["sampler", "loader", "unsized"])
def test_the_same_index_on_two_ranks_draws_two_augmentations(num_workers, how):
    """A sampler of repeated augmentation gives each rank of a distributed
    run the same indices (``RASampler``, ``RepeatAugSampler``): each rank
    draws its own augmentation of an index, as under torch, whatever the
    seed agreed across ranks; rank 0 keeps the index's own draws (a run of
    one rank is unchanged). The rank is the sampler's (its ``rank`` and
    ``num_replicas``), else the loader's (``rank``/``world_size``, or
    torch.distributed's), on coordl's pipeline and on torch's machinery."""
    ds = TwoStageToy(N)

    def draws(rank):
        if how == "sampler":
            sampler, kw = RepeatsAcrossRanks(N, rank), {}
        else:
            order = list(RepeatsAcrossRanks(N, rank))
            sampler, kw = order, {"rank": rank, "world_size": 2}
            if how == "unsized":
                class Unsized(torch.utils.data.Sampler):
                    def __iter__(self):
                        return iter(order)
                sampler = Unsized()
        L = DataLoader(ds, batch_size=3, sampler=sampler, num_workers=num_workers, seed=7, **kw)
        assert L.stats().path == ("torch" if how == "unsized" else "coordl")
        return _draws_by_index(list(L))

    r0, r1 = draws(0), draws(1)
    assert sorted(r0) == sorted(r1) == list(range(N))      # every index on both ranks
    assert all(r0[i][0] != r1[i][0] for i in range(N)), (r0, r1)
    once = _draws_by_index(DataLoader(ds, batch_size=4, sampler=SequentialSampler(ds), seed=7))
    assert all(r0[i][0] == once[i][0] for i in range(N))


def test_the_repeats_of_an_order_are_counted_position_by_position():
    from coordl.plan import IndexOrder

    order = IndexOrder.from_steps([[4, 1, 4], [2, 4], [1]], True, 6)
    assert order.repeats().tolist() == [0, 0, 1, 0, 2, 1]
    assert order.again(0, [1, 2]) == [[0, 2], [1]]
    assert IndexOrder.from_steps([3, 0, 5], False, 6).repeats() is None
    assert IndexOrder.from_steps([3, -3, 5], False, 6).again(0, [0, 1]) == [[0], [1]]   # -3 is 3
    order = pickle.loads(pickle.dumps(IndexOrder.from_steps([1, 1], False, 6)))
    assert order.again(0, [0, 1]) == [[0], [1]]
    order = IndexOrder.from_steps([[4, 1, 4], [2]], True, 6)
    order.set_lane(1, 3)        # rank 1 of 3: each (count, rank) a key of its own
    assert order.repeats().tolist() == [1, 1, 4, 1]
    order = pickle.loads(pickle.dumps(order))     # (as workers get it)
    assert order.again(0, [0, 1]) == [[1, 1, 4], [1]]
    order.set_lane(0, 3)
    assert order.repeats().tolist() == [0, 0, 3, 0]


@pytest.mark.parametrize("num_workers,batch_size", [(0, 2), (2, 3), (0, None)])
def test_a_repeated_index_draws_anew_on_torchs_machinery_too(num_workers, batch_size):
    """A sampler without a length (torch's machinery, coordl's prep step)
    that repeats indices: each repeat its own draw, the first time the
    index's own; a resumed pass counts the steps it skips."""
    ds = TwoStageToy(N)

    class Unsized(torch.utils.data.Sampler):
        def __iter__(self):
            return iter([5, 5, 1, 5, 1, 9, 2, 9])

    def make():
        return DataLoader(ds, batch_size=batch_size, sampler=Unsized(), num_workers=num_workers, seed=4)

    L = make()
    assert L.stats().path == "torch"
    batches = list(L)
    rows = torch.cat([b[0].reshape(-1, 3) for b in batches])
    by = _draws_by_index([(rows, None)])
    assert sorted(by) == [1, 2, 5, 9] and len(by[5]) == 3
    assert all(len(set(d)) == len(d) for d in by.values()), by
    once = _draws_by_index(DataLoader(ds, batch_size=4, sampler=SequentialSampler(ds), seed=4))
    assert all(d[0] == once[i][0] for i, d in by.items())
    a = make()
    it = iter(a)
    head = [next(it)]
    state = a.state_dict()
    del it, a
    gc.collect()
    b = make()
    b.load_state_dict(state)
    got = torch.cat([x[0].reshape(-1, 3) for x in head + list(b)])
    assert torch.equal(got, rows)


class _Forever:
    """Yields the sampler it holds over and over (no length)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __iter__(self):
        while True:
            yield from iter(self.sampler)


class OneIteratorForAllEpochs(DataLoader):
    """The shape of timm's ``MultiEpochsDataLoader`` (``--use-multi-epochs-loader``)
    over coordl's loader: after it is made, its index sampler is wrapped in an
    endless repeat (past torch's check on setting it), one iterator is kept,
    and each epoch takes ``len`` batches from it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._DataLoader__initialized = False
        if self.batch_sampler is None:
            self.sampler = _Forever(self.sampler)
        else:
            self.batch_sampler = _Forever(self.batch_sampler)
        self._DataLoader__initialized = True
        self.iterator = super().__iter__()

    def __len__(self):
        return len(self.sampler.sampler) if self.batch_sampler is None else len(self.batch_sampler.sampler)

    def __iter__(self):
        for _ in range(len(self)):
            yield next(self.iterator)


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("how", ["plan", "sampler", "unbatched"])
def test_one_iterator_over_an_endless_repeat_of_the_sampler_gives_epoch_after_epoch(num_workers, persistent, how):
    """A loader whose index sampler is replaced after it is made by an
    endless repeat of it, and whose one iterator serves every epoch (timm's
    ``MultiEpochsDataLoader``): each epoch delivers every sample once, the
    batches of the loader's epochs 0, 1, 2 as a plain loader gives them."""
    ds = TwoStageToy(N)
    kw = {"plan": dict(batch_size=4, shuffle=True),
          "sampler": dict(batch_size=4, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(3))),
          "unbatched": dict(batch_size=None, shuffle=True)}[how]

    def make(cls):
        if how == "sampler":
            kw["sampler"] = RandomSampler(ds, generator=torch.Generator().manual_seed(3))
        return cls(ds, num_workers=num_workers, persistent_workers=persistent, seed=5, **kw)

    L = make(OneIteratorForAllEpochs)
    assert L._repeats_sampler()
    got = [[b[0].clone() for b in L] for _ in range(3)]
    plain = make(DataLoader)
    want = [[b[0].clone() for b in plain] for _ in range(3)]
    for g, w in zip(got, want):
        assert len(g) == len(w) == (N if how == "unbatched" else -(-N // 4))
        assert all(torch.equal(a, b) for a, b in zip(g, w))
        firsts = sorted(int(x) for b in g for x in (b.reshape(-1, 3)[:, 0] if b.dim() > 1 else b[:1]))
        assert firsts == list(range(N))
    assert not torch.equal(torch.cat([b.reshape(-1) for b in got[0]]), torch.cat([b.reshape(-1) for b in got[1]]))
    assert L.stats().epochs[-1].epoch == 2
