"""A bad sample's error keeps its own type.

torch re-raises a failing sample's exception type, so a user's ``except
OSError:`` works; coordl adds its context (stage, index, path, remedy) and
raises an instance of both ``SampleError`` and the original type, on every
path: in-process, from coordl's workers, through torch's worker machinery.
"""
from __future__ import annotations

import pickle

import pytest
import torch

from coordl import DataLoader, SampleError
from coordl.errors import sample_error_type
from toydata import Unsized


class UserError(Exception):
    """A user's own exception type, importable (picklable by reference)."""


def _local_error_type():
    class LocalError(Exception):
        pass
    return LocalError


class DecoratingError(Exception):
    def __init__(self, msg):
        super().__init__(f"[decoder] {msg}")
        self.tag = "decoder"


class TwoArgError(Exception):
    def __init__(self, code, msg):
        super().__init__(code, msg)


LocalError = _local_error_type()  # qualname has <locals>: not picklable by reference


def _raise(kind: str, i: int):
    if kind == "os":
        raise OSError(f"image file is truncated (sample {i})")
    if kind == "value":
        raise ValueError(f"bad label {i}")
    if kind == "key":
        raise KeyError(f"label{i}")
    if kind == "unicode":
        b"\xff".decode("utf-8")
    if kind == "user":
        raise UserError(f"user error {i}")
    if kind == "local":
        raise LocalError(f"local error {i}")
    if kind == "notfound":
        raise FileNotFoundError(2, "No such file or directory", f"/err/{i}.bin")
    raise AssertionError(kind)


class ErrDataset(torch.utils.data.Dataset):
    """Two-stage dataset: sample ``bad`` fails in ``prep`` (or ``raw``) with ``kind``."""

    def __init__(self, n: int, bad: int, kind: str, stage: str = "prep"):
        self.n, self.bad, self.kind, self.stage = n, bad, kind, stage

    def __len__(self):
        return self.n

    def describe(self, i):
        return f"/err/sample_{i}.bin"

    def raw(self, i):
        if self.stage == "raw" and i == self.bad:
            _raise(self.kind, i)
        return bytes([i % 256]) * 8

    def prep(self, raw, i):
        if self.stage == "prep" and i == self.bad:
            _raise(self.kind, i)
        return torch.tensor([raw[0]])

    def __getitem__(self, i):
        return self.prep(self.raw(i), i)


# (num_workers, sampler) -> coordl pipeline in-process, coordl's workers (in the plan's
# order, in a sampler's), torch's single-process iterator, torch's worker processes
# (a sampler without a length)
PATHS = [(0, None), (2, None), (2, "sized"), (0, "unsized"), (2, "unsized")]
IDS = ["inline", "coordl-workers", "coordl-sampler", "torch-inline", "torch-workers"]


def _first_error(ds, num_workers, user_sampler, **kw):
    sampler = None if user_sampler is None else torch.utils.data.SequentialSampler(range(len(ds))) \
        if user_sampler == "sized" else Unsized(len(ds))
    L = DataLoader(ds, batch_size=2, num_workers=num_workers, seed=0, sampler=sampler,
                   timeout=60 if num_workers else 0, **kw)
    try:
        for _ in L:
            pass
    except BaseException as e:  # noqa: B036 - the test inspects whatever is raised
        c = e
        while c is not None:  # drop the frames, which hold the iterator and so its workers
            c.__traceback__ = None
            c = c.__cause__ or c.__context__
        return e
    raise AssertionError("no error raised")


@pytest.mark.parametrize("num_workers,user_sampler", PATHS, ids=IDS)
@pytest.mark.parametrize("kind,original", [("os", OSError), ("value", ValueError),
                                           ("user", UserError)])
def test_error_is_both_sample_error_and_original_type(num_workers, user_sampler, kind, original):
    e = _first_error(ErrDataset(8, bad=3, kind=kind), num_workers, user_sampler)
    assert isinstance(e, SampleError) and isinstance(e, original) and isinstance(e, RuntimeError), \
        type(e).__mro__
    assert type(e) is sample_error_type(original)
    msg = str(e)
    assert "sample 3" in msg and "/err/sample_3.bin" in msg and "on_error='skip'" in msg
    assert original.__name__ in msg
    if num_workers:
        assert "DataLoader worker process" in msg and "Traceback" in msg
    else:  # in-process: the original exception itself is chained
        assert type(e.__cause__) is original


@pytest.mark.parametrize("num_workers,user_sampler", PATHS, ids=IDS)
@pytest.mark.parametrize("kind,stage,where,clauses", [
    ("notfound", "raw", "reading sample 2", (OSError, FileNotFoundError, SampleError, RuntimeError)),
    ("value", "prep", "preparing sample 2", (ValueError, SampleError, RuntimeError)),
])
def test_user_except_clauses_catch_it(num_workers, user_sampler, kind, stage, where, clauses):
    caught = []
    for clause in clauses:
        try:
            _raise_first(ErrDataset(6, bad=2, kind=kind, stage=stage), num_workers, user_sampler)
        except clause as e:
            caught.append((clause, type(e), str(e)))
    assert [c for c, _, _ in caught] == list(clauses)
    assert len({t for _, t, _ in caught}) == 1
    assert all(f"{where} (/err/sample_2.bin)" in m for _, _, m in caught)


def _raise_first(ds, num_workers, user_sampler):
    e = _first_error(ds, num_workers, user_sampler)
    raise e


@pytest.mark.parametrize("num_workers,user_sampler", PATHS, ids=IDS)
def test_key_error_message_is_readable(num_workers, user_sampler):
    e = _first_error(ErrDataset(6, bad=1, kind="key"), num_workers, user_sampler)
    assert isinstance(e, KeyError) and isinstance(e, SampleError)
    assert str(e).startswith(("coordl: error preparing sample 1", "Caught SampleError[KeyError]")), str(e)


@pytest.mark.parametrize("num_workers,user_sampler", PATHS, ids=IDS)
def test_type_not_rebuildable_from_a_message_falls_back_to_sample_error(num_workers, user_sampler):
    # UnicodeDecodeError(message) raises TypeError: torch falls back to
    # RuntimeError there; coordl to plain SampleError (a RuntimeError).
    e = _first_error(ErrDataset(6, bad=4, kind="unicode"), num_workers, user_sampler)
    assert type(e) is SampleError
    assert "sample 4" in str(e) and "UnicodeDecodeError" in str(e)


@pytest.mark.parametrize("num_workers,user_sampler", PATHS, ids=IDS)
def test_type_not_picklable_by_reference(num_workers, user_sampler):
    e = _first_error(ErrDataset(6, bad=4, kind="local"), num_workers, user_sampler)
    if num_workers:  # the type cannot cross the pipe: plain SampleError, message kept
        assert type(e) is SampleError
    else:
        assert isinstance(e, LocalError) and isinstance(e, SampleError)
    assert "sample 4" in str(e) and "LocalError: local error 4" in str(e)


def test_combined_class_pickles_by_reference():
    for t in (OSError, ValueError, KeyError, UserError, FileNotFoundError):
        cls = sample_error_type(t)
        assert issubclass(cls, SampleError) and issubclass(cls, t)
        assert pickle.loads(pickle.dumps(cls)) is cls
        e = pickle.loads(pickle.dumps(cls("m")))
        assert type(e) is cls and str(e) == "m"
    assert pickle.loads(pickle.dumps(sample_error_type(LocalError))) is SampleError
    assert sample_error_type(UnicodeDecodeError) is SampleError
    assert sample_error_type(KeyboardInterrupt) is SampleError
    assert sample_error_type(RuntimeError) is SampleError
    assert sample_error_type(SampleError) is SampleError


def test_torch_exception_wrapper_rebuilds_the_combined_type():
    # what torch's worker loop does with an error raised in its worker:
    # pickle ExceptionWrapper (the class by reference) and call exc_type(msg)
    from torch._utils import ExceptionWrapper

    cls = sample_error_type(OSError)
    try:
        raise cls("coordl: error reading sample 7 (/x/7.jpg): OSError: boom")
    except SampleError:
        w = pickle.loads(pickle.dumps(ExceptionWrapper(where="in DataLoader worker process 0")))
    with pytest.raises(OSError) as info:
        w.reraise()
    assert type(info.value) is cls
    assert "sample 7" in str(info.value) and "Caught SampleError[OSError]" in str(info.value)


@pytest.mark.parametrize("user_sampler", [False, True], ids=["coordl-workers", "torch-workers"])
def test_spawned_workers_keep_the_type(user_sampler):
    # nothing inherited by fork: the combined class is rebuilt from its reference
    e = _first_error(ErrDataset(6, bad=3, kind="user"), 1, user_sampler, multiprocessing_context="spawn")
    assert type(e) is sample_error_type(UserError) and isinstance(e, UserError)
    assert "sample 3" in str(e) and "/err/sample_3.bin" in str(e)


def test_user_types_rebuilt_as_torch_would():
    # T(message) works: the combined class runs T's own constructor
    e = sample_error_type(DecoratingError)("coordl: error preparing sample 1 (x)")
    assert isinstance(e, DecoratingError) and isinstance(e, SampleError) and e.tag == "decoder"
    assert "coordl: error preparing sample 1 (x)" in str(e)
    # T(message) raises: plain SampleError, as torch falls back to RuntimeError
    assert sample_error_type(TwoArgError) is SampleError


@pytest.mark.parametrize("stage", ["prep", "raw"])
def test_an_in_process_sample_error_does_not_keep_the_pass_alive(monkeypatch, stage):
    """num_workers=0: after a SampleError, dropping the error and the iterator
    frees the pass at once, without the garbage collector: neither the error
    nor the frames its traceback holds may be in a reference cycle with the
    iterator (which holds the pass's fetch threads and read-ahead)."""
    import gc
    import weakref

    from coordl.pipeline import workers as _pipeline

    made = []
    real_init = _pipeline.InlineIter.__init__

    def recording_init(self, *a, **kw):
        made.append(weakref.ref(self))
        real_init(self, *a, **kw)

    monkeypatch.setattr(_pipeline.InlineIter, "__init__", recording_init)
    L = DataLoader(ErrDataset(12, bad=5, kind="value", stage=stage), batch_size=2, num_workers=0, seed=0)
    gc.collect()
    gc.disable()
    try:
        it = iter(L)
        caught = None
        try:
            for _ in it:
                pass
        except SampleError as e:
            caught = str(e)
        assert caught is not None and "sample 5" in caught
        assert len(made) == 1 and made[0]() is not None
        del it
        assert made[0]() is None, "the pass outlived its iterator: a reference cycle through the error"
    finally:
        gc.enable()
