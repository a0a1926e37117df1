"""Exact resume: out-of-order delivery, whole-batch
skips, and state saved after breaking out of a pass."""
import gc
import pickle
import time
import warnings

import pytest
import torch
from torch.utils.data import TensorDataset

from coordl import DataLoader, SkippedSampleWarning, StateError
from coordl.plan import plan
from toydata import TwoStageToy


class SlowFirstBatch(TwoStageToy):
    """Reads of the first batch's samples take 0.3 s and every other read a
    small per-sample delay, so workers finish batches out of plan order."""

    def __init__(self, n, first, bad=()):
        super().__init__(n, bad=bad)
        self.first = frozenset(first)

    def raw(self, i):
        time.sleep(0.3 if i in self.first else ((i * 7919) % 5) * 0.002)
        return super().raw(i)


def _key(batch):
    return tuple(batch[0][:, 0].tolist())


def _by_key(batches):
    return {_key(b): b for b in batches}


def _same_batches(got, full):
    """got and full hold the same batches (sample indices and augmentation
    draws), in any order, each once."""
    g, f = _by_key(got), _by_key(full)
    assert len(g) == len(got), "a batch was delivered twice"
    assert sorted(g) == sorted(f)
    for k, b in g.items():
        assert torch.equal(b[0], f[k][0]) and torch.equal(b[1], f[k][1])


def _resume(make, cut):
    """Deliver `cut` batches from one loader, save (through pickle), restore
    into a fresh loader and finish the epoch there."""
    a = make(seed=5)
    it = iter(a)
    got = [next(it) for _ in range(cut)]
    state = pickle.loads(pickle.dumps(a.state_dict()))
    del it, a
    gc.collect()
    b = make(seed=99)  # the state's seed wins
    b.load_state_dict(state)
    assert b.epoch == 0
    got += list(b)
    return got, state


N, BS = 40, 4


@pytest.mark.parametrize("num_workers", [1, 2])
def test_resume_exact_with_in_order_false(num_workers):
    first = plan(N, 5, 0)[:BS].tolist()
    ds = SlowFirstBatch(N, first)

    def make(seed):
        return DataLoader(ds, batch_size=BS, shuffle=True, seed=seed, num_workers=num_workers,
                          in_order=False)

    full = list(make(5))
    assert sorted(i for b in full for i in _key(b)) == list(range(N))
    out_of_order = False
    for cut in (1, 2, 3, 5, 8, 9):
        got, state = _resume(make, cut)
        out_of_order |= bool(state.get("done"))
        assert sorted(i for b in got for i in _key(b)) == list(range(N)), f"cut={cut}"
        _same_batches(got, full)
    # the slow first batch really was overtaken, so the test exercised "done"
    assert out_of_order


@pytest.mark.parametrize("num_workers,in_order", [(0, True), (2, True), (2, False)])
def test_resume_exact_with_whole_batches_skipped(num_workers, in_order):
    order = plan(N, 5, 0)
    bad = order[BS * 1:BS * 2].tolist() + order[BS * 2:BS * 3].tolist() + [int(order[BS * 6])]
    ds = SlowFirstBatch(N, order[:BS].tolist() if not in_order else (), bad=bad)

    def make(seed):
        return DataLoader(ds, batch_size=BS, shuffle=True, seed=seed, num_workers=num_workers,
                          on_error="skip", in_order=in_order)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedSampleWarning)
        full = list(make(5))
        want = sorted(set(range(N)) - set(bad))
        assert sorted(i for b in full for i in _key(b)) == want
        for cut in (1, 2, 3, 5, 7):
            got, _ = _resume(make, cut)
            assert sorted(i for b in got for i in _key(b)) == want, f"cut={cut}"
            _same_batches(got, full)


def test_state_counts_a_whole_batch_skip_as_delivered():
    order = plan(12, 1, 0)
    ds = TwoStageToy(12, bad=order[4:8].tolist())
    L = DataLoader(ds, batch_size=4, shuffle=True, seed=1, on_error="skip")
    it = iter(L)
    with pytest.warns(SkippedSampleWarning):
        next(it), next(it)  # the second call skips over step 1 and delivers step 2
    assert (L.state_dict()["epoch"], L.state_dict()["batches"]) == (1, 0)


def test_state_mid_pass_refused_for_out_of_order_torch_workers():
    """torch's machinery with in_order=False does not say which step a batch
    was: a mid-epoch state is refused when asked for, boundaries still work."""
    ds = TensorDataset(torch.arange(40))
    L = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, in_order=False,
                   generator=torch.Generator().manual_seed(3))
    it = iter(L)
    next(it)
    with pytest.raises(StateError, match="in_order=False.*epoch boundary"):
        L.state_dict()
    rest = list(it)
    assert len(rest) == 9
    assert L.state_dict()["epoch"] == 1 and L.state_dict()["batches"] == 0


def test_done_steps_validated_on_load():
    ds = TwoStageToy(40)
    L = DataLoader(ds, batch_size=4, seed=1)
    sd = L.state_dict()
    sd.update(batches=3, done=[2])
    with pytest.raises(StateError, match="done should list distinct steps after batches=3"):
        L.load_state_dict(sd)
    sd.update(done=[12])
    with pytest.raises(StateError, match="epoch of this loader has 10 batches"):
        L.load_state_dict(sd)


def test_version_1_state_still_loads():
    ds = TwoStageToy(40)
    full = list(DataLoader(ds, batch_size=4, shuffle=True, seed=2))
    a = DataLoader(ds, batch_size=4, shuffle=True, seed=2)
    it = iter(a)
    got = [next(it) for _ in range(3)]
    sd = a.state_dict()
    del sd["done"]
    sd["version"] = 1
    b = DataLoader(ds, batch_size=4, shuffle=True, seed=2)
    b.load_state_dict(sd)
    got += list(b)
    assert [_key(x) for x in got] == [_key(x) for x in full]


# ------------------------------------------------------ the state after a break
STEPS, EPOCHS = 3, 4


def _steps_per_epoch(loader, epochs, save_at=None):
    """The usual `for epoch: for step, batch in zip(range(STEPS), loader)` loop.
    With save_at, the state is saved after that epoch's loop and restored into
    a fresh loader, which continues."""
    out = []
    for epoch in range(epochs):
        for _, batch in zip(range(STEPS), loader):
            out.append(batch)
        if save_at is not None and epoch == save_at:
            state = pickle.loads(pickle.dumps(loader.state_dict()))
            assert (state["epoch"], state["batches"], state.get("done", [])) == (epoch + 1, 0, [])
            fresh = loader._remake()
            fresh.load_state_dict(state)
            loader = fresh
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["two_stage", "generic_seed"])
def test_state_after_break_is_the_next_epoch(num_workers, kind):
    def make():
        if kind == "two_stage":
            L = DataLoader(TwoStageToy(40), batch_size=4, shuffle=True, seed=7, num_workers=num_workers)
        else:
            L = DataLoader(TensorDataset(torch.arange(40) * 10), batch_size=4, shuffle=True, seed=7,
                           num_workers=num_workers)
        L._remake = make
        return L

    def flat(batches):
        return [x[0].tolist() for x in batches]

    straight = flat(_steps_per_epoch(make(), EPOCHS))
    assert len(straight) == STEPS * EPOCHS
    for save_at in range(EPOCHS - 1):
        assert flat(_steps_per_epoch(make(), EPOCHS, save_at)) == straight, f"save_at={save_at}"


def test_state_while_iterator_alive_is_mid_pass_and_epoch_property():
    L = DataLoader(TwoStageToy(40), batch_size=4, shuffle=True, seed=7)
    it = iter(L)
    next(it), next(it)
    assert (L.state_dict()["epoch"], L.state_dict()["batches"], L.epoch) == (0, 2, 0)
    del it  # the pass can no longer continue: the next one is epoch 1
    assert (L.state_dict()["epoch"], L.state_dict()["batches"], L.epoch) == (1, 0, 1)


class BadPlain(torch.utils.data.Dataset):
    """Generic (not two-stage) dataset; `bad` indices raise."""

    def __init__(self, n, bad):
        self.n, self.bad = n, frozenset(bad)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise OSError(f"sample {i} is corrupt")
        return torch.tensor([i, i * i])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_exact_with_whole_batches_skipped_on_torch_machinery(num_workers):
    order = plan(N, 5, 0)
    bad = order[BS * 2:BS * 4].tolist()
    ds = BadPlain(N, bad)

    def make(seed):
        return DataLoader(ds, batch_size=BS, shuffle=True, seed=seed, num_workers=num_workers,
                          on_error="skip")

    def flat(batches):
        return [x[:, 0].tolist() for x in batches]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedSampleWarning)
        full = flat(make(5))
        assert sorted(i for b in full for i in b) == sorted(set(range(N)) - set(bad))
        for cut in (1, 2, 3, 5):
            a = make(5)
            it = iter(a)
            got = [next(it) for _ in range(cut)]
            state = a.state_dict()
            del it, a
            b = make(99)
            b.load_state_dict(state)
            assert flat(got) + flat(b) == full, f"cut={cut}"


def test_checkpoint_in_a_handler_inside_the_loop_is_mid_epoch():
    """The documented way to save mid-epoch on an interrupt: inside the loop."""
    ds = TwoStageToy(40)
    full = list(DataLoader(ds, batch_size=4, shuffle=True, seed=1))
    L = DataLoader(ds, batch_size=4, shuffle=True, seed=1)
    got = []
    for i, b in enumerate(L):
        got.append(b)
        try:
            if i == 3:
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            state = L.state_dict()
            break
    assert (state["epoch"], state["batches"]) == (0, 4)
    assert (L.state_dict()["epoch"], L.state_dict()["batches"]) == (1, 0)  # after the break
    R = DataLoader(ds, batch_size=4, shuffle=True, seed=1)
    R.load_state_dict(state)
    got += list(R)
    assert [_key(x) for x in got] == [_key(x) for x in full]


class _PlainBad(torch.utils.data.Dataset):
    """A generic (not two-stage) dataset whose sample 13 raises."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        if i == 13:
            raise ValueError("bad sample 13")
        return torch.tensor([i])


@pytest.mark.parametrize("kind,num_workers", [("pipeline", 0), ("pipeline", 2), ("torch", 0), ("torch", 2)])
def test_failed_batch_counts_as_used_up_in_the_state(kind, num_workers):
    """After a batch raises (the pass goes on, as under torch), state_dict()
    must not make a restored loader redo that batch or any delivered one."""
    def make(seed):
        if kind == "pipeline":
            return DataLoader(TwoStageToy(N, bad=(13,)), batch_size=BS, shuffle=True, seed=seed,
                              num_workers=num_workers)
        return DataLoader(_PlainBad(), batch_size=BS, shuffle=True, seed=seed, num_workers=num_workers)

    def key(b):
        return tuple(b[0][:, 0].tolist()) if kind == "pipeline" else tuple(b[:, 0].tolist())

    order = plan(N, 5, 0).tolist()
    bad_step = order.index(13) // BS
    a = make(5)
    it = iter(a)
    got, failed = [], 0
    for _ in range(bad_step + 2):  # past the failing batch, and one more
        try:
            got.append(key(next(it)))
        except (OSError, ValueError):  # the sample's own type (SampleError[T] or torch's rebuild)
            failed += 1
    assert failed == 1
    state = a.state_dict()
    assert state["batches"] == bad_step + 2
    del it, a
    gc.collect()
    b = make(99)
    b.load_state_dict(state)
    rest = [key(x) for x in b]
    seen = [i for k in got + rest for i in k]
    bad_batch = set(order[bad_step * BS:(bad_step + 1) * BS])
    assert len(seen) == len(set(seen)), "a sample was delivered twice"
    assert sorted(seen) == sorted(set(range(N)) - bad_batch)
