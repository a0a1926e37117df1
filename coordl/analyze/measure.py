"""The analyzer's measurements: timed passes of a real ``coordl.DataLoader``.

Each pass builds a loader, iterates it and returns what it saw.  Rates are
steady-state: the clock starts when the ``max(1, workers)``-th batch has been
consumed (by then every worker has started and produced its first batch) and
only the samples after it count, so worker start-up is not charged to the
pipeline.  A pass too short for that (not more batches than workers) is
timed from ``iter()`` instead and flagged ``"short": True``.

Eviction (making the next read come from storage): as root,
``echo 3 > /proc/sys/vm/drop_caches`` (after ``sync``); otherwise, or when
asked, ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file of the dataset,
each opened read-only by this process.
"""
from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import time
from typing import Any, Callable

import torch

__all__ = ["load_callable", "make_transform", "TRANSFORMS", "FetchOnly", "Subset", "dataset_files",
           "evict", "DeviceCounter", "RateStep", "run_pass", "ingest_rate", "batch_samples"]


def _import_like_python_m(mod_name: str, spec: str, what: str):
    """Import ``mod_name`` with the current directory searched first, as
    ``python -m`` does: the installed ``coordl`` command's ``sys.path`` starts
    with its own bin directory, not the directory it is run from, so
    ``coordl analyze --step mymodel:train_step`` did not find ``./mymodel.py``.
    The directory stays on ``sys.path`` (at the front, as under ``python -m``)
    so worker processes and pickled objects find the module too."""
    import sys

    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise  # the module was found; something it imports is missing: that error is the user's
        raise ValueError(f"{what}={spec!r}: no module named {e.name!r} in the current directory ({cwd}) "
                         f"or on sys.path; run coordl from the directory that holds {e.name}.py, or "
                         f"give a file: {what}=path/to/{mod_name.replace('.', '/')}.py:"
                         f"{spec.rpartition(':')[2]}") from None


def load_callable(spec: str, what: str) -> Callable:
    """``"package.module:name"`` or ``"path/to/file.py:name"`` -> the object.

    A module name is imported as ``python -m`` would: the current directory
    is searched first, then ``sys.path``."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f'{what} should be "module:callable" or "path/to/file.py:callable", but got '
                         f"{what}={spec!r}")
    mod_name, _, attr = spec.rpartition(":")
    if mod_name.endswith(".py"):
        path = os.path.abspath(mod_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{what}={spec!r}: no file {path}")
        modspec = importlib.util.spec_from_file_location(
            "_coordl_analyze_" + os.path.splitext(os.path.basename(path))[0], path)
        module = importlib.util.module_from_spec(modspec)
        modspec.loader.exec_module(module)
    else:
        module = _import_like_python_m(mod_name, spec, what)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{what}={spec!r}: {mod_name} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{what}={spec!r}: {attr} is not callable")
    return obj


def _rrc224():
    from .. import transforms as T
    return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor()])


def _rrc224u8():
    from .. import transforms as T
    return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])


def _center224():
    from .. import transforms as T
    return T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor()])


TRANSFORMS: dict[str, tuple[Callable, str]] = {
    "rrc224": (_rrc224, "RandomResizedCrop(224) + RandomHorizontalFlip() + ToTensor() (float CHW)"),
    "rrc224u8": (_rrc224u8, "RandomResizedCrop(224) + RandomHorizontalFlip() + PILToTensor() (uint8 CHW)"),
    "center224": (_center224, "Resize(256) + CenterCrop(224) + ToTensor() (validation)"),
}


def make_transform(spec: Any):
    """A transform from a name in :data:`TRANSFORMS`, a ``"module:callable"``
    returning one, or a transform object (returned as is)."""
    if spec is None or callable(spec):
        return spec
    if isinstance(spec, str) and spec in TRANSFORMS:
        return TRANSFORMS[spec][0]()
    if isinstance(spec, str) and ":" in spec:
        return load_callable(spec, "transform")()
    raise ValueError(f"transform should be one of {', '.join(TRANSFORMS)} or \"module:callable\", but got "
                     f"transform={spec!r}")


class FetchOnly:
    """``dataset`` with prep replaced by ``len(raw)``: a pass over it times the
    fetch stage alone (same reads, same node cache: same fingerprint)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def raw(self, i: int) -> bytes:
        return self.dataset.raw(i)

    def prep(self, raw: bytes, i: int):
        return torch.tensor(len(raw), dtype=torch.int64)

    def __getitem__(self, i: int):
        return self.prep(self.raw(i), i)

    def __getattr__(self, name: str):
        # fingerprint, sizes, describe, raw_uncached, raw_many: the wrapped dataset's
        if name in ("fingerprint", "sizes", "describe", "raw_uncached", "raw_many"):
            return getattr(self.dataset, name)
        raise AttributeError(name)


class Subset:
    """``n`` samples spread evenly over a two-stage ``dataset`` (every class
    of an ImageFolder is represented), keeping the two-stage protocol."""

    def __init__(self, dataset, n: int):
        total = len(dataset)
        self.dataset = dataset
        self.indices = [i * total // n for i in range(n)]
        sizes = getattr(dataset, "sizes", None)
        if sizes is not None:
            import numpy as np
            self.sizes = np.asarray(sizes)[self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def raw(self, i: int) -> bytes:
        return self.dataset.raw(self.indices[i])

    def prep(self, raw: bytes, i: int):
        return self.dataset.prep(raw, self.indices[i])

    def __getitem__(self, i: int):
        return self.dataset[self.indices[i]]

    def describe(self, i: int) -> str:
        from ..protocol import describe
        return describe(self.dataset, self.indices[i])

    def __getattr__(self, name: str):
        if name == "fingerprint" and callable(getattr(self.dataset, "fingerprint", None)):
            return lambda: f"{self.dataset.fingerprint()}-first-{len(self.indices)}-of-{len(self.dataset)}"
        if name == "raw_uncached" and callable(getattr(self.dataset, "raw_uncached", None)):
            return lambda i: self.dataset.raw_uncached(self.indices[i])
        raise AttributeError(name)


def dataset_files(dataset) -> list[str]:
    """The local files behind ``dataset`` (``describe(i)`` of every sample
    that names an existing file), each once, in sample order."""
    fn = getattr(dataset, "describe", None)
    if not callable(fn):
        return []
    seen, out = set(), []
    for i in range(len(dataset)):
        try:
            p = str(fn(i))
        except Exception:
            continue
        if p not in seen and os.path.isfile(p):
            seen.add(p)
            out.append(p)
    return out


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def evict(files: list[str], method: str = "auto") -> str:
    """Make the next reads of ``files`` come from storage.  ``method``:
    ``"auto"`` (drop_caches when root, else fadvise), ``"drop_caches"`` or
    ``"fadvise"``.  Returns the method used (``"none"`` without files)."""
    if method not in ("auto", "drop_caches", "fadvise"):
        raise ValueError(f'evict should be "auto", "drop_caches" or "fadvise", but got evict={method!r}')
    if not files:
        return "none"
    if method == "auto":
        method = "drop_caches" if can_drop_caches() else "fadvise"
    if method == "drop_caches":
        if not can_drop_caches():
            raise PermissionError("evict='drop_caches' needs root (writing /proc/sys/vm/drop_caches); "
                                  "run as root or use evict='fadvise'")
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return method
    for p in files:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return method


class DeviceCounter:
    """Bytes read by the block device holding ``path``, from
    ``/sys/block/<disk>/stat`` (sectors read x 512): every reader of that
    disk counts, not only this job.  ``None`` when there is no such disk
    (tmpfs, network file systems)."""

    def __init__(self, path: str | None):
        self.disk = None
        if path is None:
            return
        try:
            st = os.stat(path)
        except OSError:
            return
        want = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        try:
            disks = os.listdir("/sys/block")
        except OSError:
            return
        for name in disks:
            try:
                with open(f"/sys/block/{name}/dev") as f:
                    if f.read().strip() == want:
                        self.disk = name
                        return
                for part in os.listdir(f"/sys/block/{name}"):
                    p = f"/sys/block/{name}/{part}/dev"
                    if os.path.exists(p):
                        with open(p) as f:
                            if f.read().strip() == want:
                                self.disk = name
                                return
            except OSError:
                continue

    def read(self) -> int | None:
        if self.disk is None:
            return None
        try:
            with open(f"/sys/block/{self.disk}/stat") as f:
                return int(f.read().split()[2]) * 512
        except (OSError, ValueError, IndexError):
            return None


def batch_samples(batch) -> int:
    """Samples in ``batch``: the leading dimension of its first tensor (the
    loader's own rule, ``loader._first_tensor``)."""
    from ..loader import _first_tensor

    x = _first_tensor(batch)
    return int(x.size(0)) if x is not None and x.dim() > 0 else 1


class RateStep:
    """A model step that ingests ``rate`` samples per second without using a
    CPU (it sleeps, as a host waiting for an accelerator does)."""

    def __init__(self, rate: float):
        self.rate = float(rate)

    def __call__(self, batch) -> None:
        time.sleep(batch_samples(batch) / self.rate)


def _stats_tuple(L) -> tuple:
    s = L.stats()
    return (s.samples, s.bytes_from_storage, s.bytes_from_cache, s.samples_from_cache, s.wait_seconds,
            s.fetch_seconds, s.prep_seconds)


def run_pass(loader, step: Callable | None = None, device: DeviceCounter | None = None,
             keep_batch: bool = False) -> dict:
    """Iterate ``loader`` once (one epoch), calling ``step(batch)`` on each
    batch; returns the steady-state rate and the loader's counters for the
    pass (differences of ``loader.stats()``)."""
    workers = max(1, int(loader.num_workers))
    before = _stats_tuple(loader)
    dev0 = device.read() if device is not None else None
    kept = None
    times, counts = [], []
    t_start = time.perf_counter()
    for batch in loader:
        n = batch_samples(batch)
        if step is not None:
            step(batch)
        if keep_batch and kept is None:
            kept = _clone(batch)
        del batch
        times.append(time.perf_counter())
        counts.append(n)
    t_end = time.perf_counter()
    dev1 = device.read() if device is not None else None
    after = _stats_tuple(loader)
    d = [a - b for a, b in zip(after, before)]
    total = sum(counts)
    short = len(times) <= workers
    if short:
        rate = total / max(t_end - t_start, 1e-9)
    else:
        rate = sum(counts[workers:]) / max(times[-1] - times[workers - 1], 1e-9)
    out = {
        "samples": total, "batches": len(times), "seconds": t_end - t_start, "rate": rate, "short": short,
        "bytes_storage": d[1], "bytes_cache": d[2], "samples_from_cache": d[3], "wait_seconds": d[4],
        "fetch_seconds": d[5], "prep_seconds": d[6], "workers": int(loader.num_workers),
        "device_bytes": None if dev0 is None or dev1 is None else dev1 - dev0,
    }
    if keep_batch:
        out["batch"] = kept
    return out


def _clone(batch):
    from ..device import map_tensors

    return map_tensors(batch, torch.Tensor.clone)


def ingest_rate(step: Callable, batch, seconds: float = 2.0, min_calls: int = 3) -> dict:
    """The step alone on ``batch`` (already in memory): one warm-up call,
    then calls for ``seconds`` (at least ``min_calls``)."""
    n = batch_samples(batch)
    step(batch)
    calls, t0 = 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - t0 < seconds:
        step(batch)
        calls += 1
    dt = time.perf_counter() - t0
    return {"rate": n * calls / max(dt, 1e-9), "calls": calls, "seconds": dt, "batch_samples": n}


def collect() -> None:
    """Let loaders that went out of scope stop their workers and detach from
    the node cache before the next pass."""
    gc.collect()
