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
import os
import time
from typing import Callable

import torch

from .sources import (  # noqa: F401 (public names of this module, defined in sources.py)
    TRANSFORMS,
    FetchOnly,
    Subset,
    load_callable,
    make_transform,
)

__all__ = ["load_callable", "make_transform", "TRANSFORMS", "FetchOnly", "Subset", "dataset_files",
           "evict", "DeviceCounter", "RateStep", "run_pass", "ingest_rate", "batch_samples", "CPUClock",
           "SyncStep", "cuda_sync"]


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


class CPUClock:
    """CPU-seconds used by this process (every thread: the loader's fetch
    threads, the consumer, a step's intra-op threads) and by its child
    processes (the loader's workers), from ``psutil``.  Children are read
    while alive, so a pass must keep its workers alive to the end of its
    window (the analyzer's loaders use ``persistent_workers=True``); a
    child that exits inside the window loses its share since the last
    read (``lost`` counts such children)."""

    def __init__(self):
        import psutil

        self._me = psutil.Process()
        self._psutil = psutil

    def read(self) -> dict:
        own = time.process_time()  # every thread of this process, CLOCK_PROCESS_CPUTIME_ID (ns)
        kids, waits = {}, {}
        for c in self._me.children(recursive=True):
            run_wait = _task_schedstats(c.pid)
            if run_wait is not None:  # nanosecond counters, every thread of the child
                kids[c.pid], waits[c.pid] = run_wait
                continue
            try:
                ct = c.cpu_times()  # clock ticks (10 ms)
                kids[c.pid] = ct.user + ct.system
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                continue
            waits[c.pid] = _schedstat_wait(f"/proc/{c.pid}/schedstat")
        return {"self": own, "children": kids, "waits": waits}

    @staticmethod
    def delta(a: dict, b: dict) -> dict:
        """CPU between two reads: ``{"self", "children", "children_wait", "lost"}``;
        ``children_wait``: seconds the children's main threads waited in the
        run queue for a core (runnable, not running)."""
        kids = sum(v - a["children"].get(pid, 0.0) for pid, v in b["children"].items())
        wait = sum(v - a.get("waits", {}).get(pid, 0.0) for pid, v in b.get("waits", {}).items())
        lost = sum(1 for pid in a["children"] if pid not in b["children"])
        return {"self": b["self"] - a["self"], "children": max(kids, 0.0), "children_wait": max(wait, 0.0),
                "lost": lost}


def _task_schedstats(pid: int) -> tuple[float, float] | None:
    """``(seconds on a CPU, seconds waiting in the run queue)`` summed over
    the threads of ``pid`` (``/proc/<pid>/task/*/schedstat``, nanoseconds:
    finer than the 10 ms ticks of ``/proc/<pid>/stat``); ``None`` where not
    available."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    run = wait = 0.0
    seen = False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                v = f.read().split()
            run += int(v[0]) / 1e9
            wait += int(v[1]) / 1e9
            seen = True
        except (OSError, ValueError, IndexError):
            continue
    return (run, wait) if seen else None


def _schedstat_wait(path: str) -> float:
    """Run-queue wait in seconds from a ``schedstat`` file (field 2); 0 where not available."""
    try:
        with open(path) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _segments(times: list, counts: list, first: int, k: int = 5) -> list:
    """Rates of up to ``k`` consecutive segments of the steady-state window
    (batch means: their spread says how steady the pass was)."""
    idx = list(range(first, len(times)))
    if len(idx) < 2 * k:
        k = len(idx) // 2
    if k < 2:
        return []
    out = []
    for j in range(k):
        lo, hi = idx[0] + j * len(idx) // k, idx[0] + (j + 1) * len(idx) // k
        t0 = times[lo - 1]
        dt = times[hi - 1] - t0
        if dt > 0:
            out.append(sum(counts[lo:hi]) / dt)
    return out


def run_pass(loader, step: Callable | None = None, device: DeviceCounter | None = None,
             keep_batch: bool = False) -> dict:
    """Iterate ``loader`` once (one epoch), calling ``step(batch)`` on each
    batch; returns the steady-state rate, the CPU-seconds per sample this
    process (``cpu_self``) and its children (``cpu_children``: the workers)
    used in the same window, the rates of segments of the window
    (``segments``), the CPU the consuming thread used per sample
    (``cpu_main``: with a step, the step's share on this thread too) and the
    loader's counters for the pass (differences of
    ``loader.stats()``)."""
    workers = max(1, int(loader.num_workers))
    before = _stats_tuple(loader)
    dev0 = device.read() if device is not None else None
    clock = CPUClock()
    kept = None
    times, counts = [], []
    t_start = time.perf_counter()
    c_start = clock.read()
    m_start = time.thread_time()
    c_win = None
    m_win = m_start
    for batch in loader:
        n = batch_samples(batch)
        if step is not None:
            step(batch)
        if keep_batch and kept is None:
            kept = _clone(batch)
        del batch
        times.append(time.perf_counter())
        counts.append(n)
        if len(times) == workers:
            c_win = clock.read()
            m_win = time.thread_time()
    t_end = time.perf_counter()
    m_end = time.thread_time()
    c_end = clock.read()
    dev1 = device.read() if device is not None else None
    after = _stats_tuple(loader)
    d = [a - b for a, b in zip(after, before)]
    total = sum(counts)
    short = len(times) <= workers
    if short:
        rate = total / max(t_end - t_start, 1e-9)
        win_samples, cpu = total, CPUClock.delta(c_start, c_end)
        m_win = m_start
        segs = []
    else:
        win_samples = sum(counts[workers:])
        rate = win_samples / max(times[-1] - times[workers - 1], 1e-9)
        cpu = CPUClock.delta(c_win, c_end)
        segs = _segments(times, counts, workers)
    out = {
        "samples": total, "batches": len(times), "seconds": t_end - t_start, "rate": rate, "short": short,
        "segments": segs, "cpu_self": cpu["self"] / max(win_samples, 1),
        "cpu_children": cpu["children"] / max(win_samples, 1), "cpu_children_lost": cpu["lost"],
        "cpu_main": (m_end - m_win) / max(win_samples, 1),
        "wait_children": cpu["children_wait"] / max(win_samples, 1),
        "bytes_storage": d[1], "bytes_cache": d[2], "samples_from_cache": d[3], "wait_seconds": d[4],
        "fetch_seconds": d[5], "prep_seconds": d[6], "workers": int(loader.num_workers),
        "device_bytes": None if dev0 is None or dev1 is None else dev1 - dev0,
    }
    if keep_batch:
        out["batch"] = kept
    return out


def _clone(batch):
    from ..device.delivery import map_tensors

    return map_tensors(batch, torch.Tensor.clone)


def cuda_sync() -> Callable[[], None] | None:
    """``torch.cuda.synchronize`` when CUDA is in use in this process (a
    step on the GPU returns before the device is done: timing it without a
    synchronize measures the launch, not the work); else ``None``."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.synchronize
    return None


class SyncStep:
    """``step`` followed by a device synchronize, so a pass's clock sees the
    device's time (used when CUDA is in use)."""

    def __init__(self, step: Callable, sync: Callable[[], None]):
        self.step, self.sync = step, sync

    def __call__(self, batch):
        r = self.step(batch)
        self.sync()
        return r


def ingest_rate(step: Callable, batch, seconds: float = 2.0, min_calls: int = 3, chunks: int = 3) -> dict:
    """The step alone on ``batch`` (already in memory): one warm-up call,
    then ``chunks`` timed runs of calls for ``seconds / chunks`` each (at
    least ``min_calls``), with the device synchronized after every call
    when CUDA is in use.  Each chunk's wall rate and the CPU-seconds per
    sample this process used (every thread: a step's intra-op threads
    too) are returned; ``cpu_share`` = CPU-seconds per wall-second of the
    step, the cores it keeps busy (about 0 for a step that waits on an
    accelerator or sleeps, about 1 or more for a step computing on the
    CPU)."""
    n = batch_samples(batch)
    step(batch)  # warm-up: also what first initializes CUDA for a step that moves the batch itself
    sync = cuda_sync()
    if sync is not None:
        sync()
    clock = CPUClock()
    rates, cpus, shares = [], [], []
    wall = waited = cpu_all = 0.0
    for _ in range(max(1, chunks)):
        calls = 0
        q0 = _runqueue_wait()
        c0, t0 = clock.read()["self"], time.perf_counter()
        while calls < min_calls or time.perf_counter() - t0 < seconds / max(1, chunks):
            step(batch)
            if sync is not None:
                sync()
            calls += 1
        dt = time.perf_counter() - t0
        cpu = clock.read()["self"] - c0
        wall += dt
        w_chunk = _runqueue_wait() - q0
        waited += w_chunk
        shares.append(cpu / max(dt - w_chunk, 1e-3))
        cpu_all += cpu
        rates.append(n * calls / max(dt, 1e-9))
        cpus.append(cpu / (n * calls))
    import statistics
    rate, cpu = statistics.median(rates), statistics.median(cpus)
    # the cores the step keeps busy while it runs: its CPU over the wall time it was not waiting for a
    # core (on a loaded machine a computing step waits in the run queue; a sleeping one does not)
    share = cpu_all / max(wall - waited, 1e-3)
    return {"rate": rate, "rates": rates, "cpu_per_sample": cpu, "cpu_per_sample_runs": cpus,
            "cpu_share": share, "cpu_share_runs": shares, "runqueue_wait_seconds": waited, "synchronized": sync is not None,
            "batch_samples": n}


def _runqueue_wait() -> float:
    """Seconds this thread has waited in the run queue for a core
    (``/proc/thread-self/schedstat``, field 2); 0 where not available."""
    return _schedstat_wait("/proc/thread-self/schedstat")


def collect() -> None:
    """Let loaders that went out of scope stop their workers and detach from
    the node cache before the next pass."""
    gc.collect()
