"""Small datasets and worker hooks shared by the conformance tests.

They live in an importable module (not in a test file) so that workers started
with the ``spawn`` method can unpickle them.
"""
from __future__ import annotations

import collections
import os
import random
import time

import numpy as np
import psutil
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

Pair = collections.namedtuple("Pair", ["feature", "label"])


class TwoArgError(Exception):
    """An exception that cannot be rebuilt from a single message argument."""

    def __init__(self, code, detail):
        super().__init__(code, detail)


class FolderTwoStage(Dataset):
    """A two-stage dataset of a test's own over an image folder (its
    ``raw`` and length coordl.ImageFolder's): subclasses write ``prep``,
    with ``transform`` and ``kind`` to choose what a sample is."""

    def __init__(self, root, transform, kind):
        import coordl

        self.base = coordl.ImageFolder(root)
        self.transform = transform
        self.kind = kind

    def __len__(self):
        return len(self.base)

    def raw(self, i):
        return self.base.raw(i)


class RangeDataset(Dataset):
    """Sample i is ``torch.tensor(i)``."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for RangeDataset of length {self.n}")
        return torch.tensor(i)


class TypedDataset(Dataset):
    """Samples of one kind of Python/numpy/torch structure."""

    KINDS = (
        "tensor",
        "tuple",
        "list",
        "dict",
        "ordereddict",
        "namedtuple",
        "numpy",
        "numpy_scalar",
        "int",
        "float",
        "bool",
        "str",
        "bytes",
        "nested",
    )

    def __init__(self, kind, n=10):
        assert kind in self.KINDS, kind
        self.kind = kind
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        k = self.kind
        if k == "tensor":
            return torch.arange(3, dtype=torch.float32) + i
        if k == "tuple":
            return (torch.tensor([i, -i], dtype=torch.int16), i % 3)
        if k == "list":
            return [i, float(i) / 4, torch.tensor(i, dtype=torch.uint8)]
        if k == "dict":
            return {"x": torch.full((2,), float(i)), "y": i, "name": f"s{i}"}
        if k == "ordereddict":
            return collections.OrderedDict([("b", i), ("a", np.float32(i) / 3)])
        if k == "namedtuple":
            return Pair(feature=np.arange(2, dtype=np.int32) * i, label=i % 2)
        if k == "numpy":
            return np.arange(4, dtype=np.float64).reshape(2, 2) * i
        if k == "numpy_scalar":
            return np.int64(i) * 7
        if k == "int":
            return i
        if k == "float":
            return i / 8
        if k == "bool":
            return i % 2 == 0
        if k == "str":
            return f"sample-{i}"
        if k == "bytes":
            return bytes([65 + i % 26]) * 2
        if k == "nested":
            return {
                "img": np.full((2, 2), i, dtype=np.uint8),
                "meta": (i, f"id{i}", {"w": i * 1.5}),
                "tags": [torch.tensor(i), torch.tensor(-i)],
            }
        raise AssertionError(k)


class BadSampleDataset(Dataset):
    """Samples chosen to make ``default_collate`` fail."""

    def __init__(self, kind, n=6):
        self.kind = kind
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.kind == "none":
            return None
        if self.kind == "ragged":
            return torch.zeros(i + 1)
        if self.kind == "numpy_str":
            return np.array([f"s{i}"])
        if self.kind == "ragged_list":
            return list(range(i + 1))
        raise AssertionError(self.kind)


class RandomDrawDataset(Dataset):
    """Each sample draws from torch's, Python's and numpy's global generators.

    In a worker process those generators are seeded by the DataLoader, so the
    draws expose the seeding scheme.  With ``with_pid`` the worker's pid is
    appended (it differs between runs; tests compare it separately).
    """

    def __init__(self, n, with_pid=False):
        self.n = n
        self.with_pid = with_pid

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        sample = (
            i,
            torch.randint(0, 2**30, ()).item(),
            random.randrange(2**30),
            int(np.random.randint(0, 2**30)),
        )
        if self.with_pid:
            sample += (os.getpid(),)
        return sample


class WorkerInfoDataset(Dataset):
    """Sample i reports the worker that produced it."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        if info is None:
            return (i, None)
        return (
            i,
            {
                "id": info.id,
                "num_workers": info.num_workers,
                "seed": info.seed,
                "torch_initial_seed": torch.initial_seed(),
                "dataset_type": type(info.dataset).__name__,
                "dataset_is_copy_of_mine": isinstance(info.dataset, WorkerInfoDataset)
                and info.dataset.n == self.n,
            },
        )


class ShardedIterable(IterableDataset):
    """Yields ``start..end-1``; in workers each worker yields a contiguous,
    deliberately unequal shard (worker k gets a share proportional to k + 1)."""

    def __init__(self, start, end, with_len=True):
        self.start = start
        self.end = end
        self.with_len = with_len

    def __len__(self):
        if not self.with_len:
            raise TypeError("ShardedIterable has no len()")
        return self.end - self.start

    def _bounds(self):
        info = get_worker_info()
        if info is None:
            return self.start, self.end
        weights = [k + 1 for k in range(info.num_workers)]
        total = self.end - self.start
        cut = [self.start]
        for w in weights:
            cut.append(cut[-1] + total * w // sum(weights))
        cut[-1] = self.end
        return cut[info.id], cut[info.id + 1]

    def __iter__(self):
        lo, hi = self._bounds()
        for i in range(lo, hi):
            yield {"value": torch.tensor(i), "square": i * i}


class UnshardedIterable(IterableDataset):
    """Yields the same items in every worker (duplicates with workers)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class LyingLengthIterable(IterableDataset):
    """Reports ``reported`` from ``__len__`` but yields ``actual`` items."""

    def __init__(self, actual, reported):
        self.actual = actual
        self.reported = reported

    def __len__(self):
        return self.reported

    def __iter__(self):
        return iter(range(self.actual))


class FailingDataset(Dataset):
    """Raises ``kind`` for sample ``bad``."""

    def __init__(self, n, bad, kind):
        self.n = n
        self.bad = bad
        self.kind = kind

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            if self.kind == "value":
                raise ValueError(f"bad sample {i}")
            if self.kind == "key":
                raise KeyError(f"missing/{i}")
            if self.kind == "two_arg":
                raise TwoArgError(i, "cannot rebuild me")
            if self.kind == "index":
                raise IndexError(i)
            raise AssertionError(self.kind)
        return torch.tensor(i)


class FailingIterable(IterableDataset):
    def __init__(self, n, bad):
        self.n = n
        self.bad = bad

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        for i in range(self.n):
            if i == self.bad and wid == 0:
                raise RuntimeError(f"stream broke at {i}")
            yield i


class GetItemsDataset(Dataset):
    """Defines ``__getitems__``; logs which access path the loader used."""

    def __init__(self, n):
        self.n = n
        self.calls = []

    def __len__(self):
        return self.n

    def _sample(self, i):
        return {"i": i, "t": torch.tensor([i, 2 * i])}

    def __getitem__(self, i):
        self.calls.append(("getitem", i))
        return self._sample(i)

    def __getitems__(self, indices):
        self.calls.append(("getitems", list(indices)))
        return [self._sample(i) for i in indices]


class SlowFirstDataset(Dataset):
    """Sample 0 takes ``delay`` seconds."""

    def __init__(self, n, delay):
        self.n = n
        self.delay = delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 0:
            time.sleep(self.delay)
        return torch.tensor(i)


class FetchLogDataset(Dataset):
    """Appends every fetched index to a file (visible across processes)."""

    def __init__(self, n, path):
        self.n = n
        self.path = str(path)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with open(self.path, "a") as f:
            f.write(f"{i}\n")
        return torch.tensor(i)


class InitRecordingDataset(Dataset):
    """Works with :func:`record_worker_init`: samples report the init calls
    their worker saw; with ``log_path`` each call is also logged to a file."""

    def __init__(self, n, log_path=None):
        self.n = n
        self.log_path = None if log_path is None else str(log_path)
        self.init_calls = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (i, list(self.init_calls))


def record_worker_init(worker_id):
    info = get_worker_info()
    ds = info.dataset
    ds.init_calls.append((worker_id, info.id, info.num_workers))
    if ds.log_path is not None:
        with open(ds.log_path, "a") as f:
            f.write(f"{worker_id} {os.getpid()}\n")


class StartMethodDataset(Dataset):
    """Sample i is ``(i, started_by_spawn, worker_id)``."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        cmd = " ".join(psutil.Process().cmdline())
        info = get_worker_info()
        return (i, "spawn_main" in cmd, -1 if info is None else info.id)


def identity_collate(batch):
    return batch


def tagging_collate(batch):
    """A custom collate that returns a non-default structure."""
    return {"n": len(batch), "sum": sum(int(b) for b in batch), "items": [int(b) for b in batch]}


def tagging_convert(sample):
    """A custom collate for ``batch_size=None``: applied to each sample."""
    return {"single": int(sample), "even": int(sample) % 2 == 0}
