"""Fetch stage: threads that read raw sample bytes ahead along the plan.

The fetch stage is the only place coordl reads samples.  It is given the
order it will be asked for (a worker's share of the epoch plan), starts reads
in that order on a few threads, and hands back completed reads in whatever
order they finish, so one slow read never holds up the ones behind it.

Two bounds keep it honest:

* ``budget_bytes``: bytes read but not yet released by the consumer (the prep
  stage releases a sample's bytes once prepared).  Sample sizes come from
  ``size_of(i)`` when the dataset knows them (``ImageFolder.sizes``), else a
  running mean stands in until the read returns.  One read is always allowed
  when nothing is held, so a sample larger than the budget cannot deadlock.
* ``threads``: reads in flight at once, at most: enough to hide storage
  latency (``threads / latency`` reads per second).  A fetcher starts with
  ``start_threads`` and the consumer adds one with :meth:`grow` when it
  waits on a read it needs; the next pass's fetcher starts with half the
  grown count (``Engine``).  Threads it does not need cost the prep thread:
  each one takes the GIL for every read and queue hand-off, and on a
  machine whose cores all run workers a fetch thread preempted while it
  holds the GIL stops its worker's prep thread until it runs again.  With
  reads from the page cache (~30 us for 110 KB against ~2.5 ms of prep)
  one thread stays far ahead; slow storage makes the prep thread wait and
  so grows the count within a few reads (each read that completes while
  the prep thread waits allows one more thread: the count roughly doubles
  per read latency).  Storage that can fetch many
  objects in one call (``read_many``: fsspec's concurrent ``cat``) gets up to
  ``batch`` already-admitted items per call, which cuts the client's CPU per
  request (measured here: fsspec HTTP ~500 us/request one by one, ~300 us
  batched).

``read`` is the engine's reader (``engine._make_reader``): the node cache
first, then storage.

Failures: whatever ``read``/``read_many`` raises, or a malformed result (not
bytes, a ``read_many`` list of the wrong length), is delivered as that item's
``Fetched.error``.  Anything escaping a thread's loop closes the fetcher and
puts a :class:`FetcherDied` on ``out``, so the consumer never waits for reads
that will not come.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Callable, Iterable, Iterator

__all__ = ["Fetcher", "Fetched", "FetcherDied"]


class Fetched:
    """One completed read: ``data`` or the ``error`` it raised."""

    __slots__ = ("key", "index", "data", "error", "nbytes", "seconds", "source")

    def __init__(self, key, index, data, error, nbytes, seconds, source) -> None:
        self.key = key
        self.index = index
        self.data = data
        self.error = error
        self.nbytes = nbytes
        self.seconds = seconds
        self.source = source


class FetcherDied:
    """Put on the output queue when a fetch thread dies (anything escaping its
    loop): the items it held will never arrive, so the consumer must fail the
    pass with this, never wait.  ``index`` is the sample it was handling (None
    when it held none); ``fetcher`` tells a stale pass's death from the
    current one's."""

    __slots__ = ("fetcher", "thread", "index", "stage", "error", "traceback")

    def __init__(self, fetcher, thread, index, stage, error, tb) -> None:
        self.fetcher = fetcher
        self.thread = thread
        self.index = index
        self.stage = stage
        self.error = error
        self.traceback = tb

    def message(self, where: str | None) -> str:
        what = f" while {self.stage} sample {self.index} ({where})" if self.index is not None else ""
        return (f"coordl: fetch thread {self.thread} died{what}: {type(self.error).__name__}: "
                f"{self.error}. The pass cannot go on (that thread's reads are lost). Check the "
                f"dataset's raw()/raw_many()/sizes.\nOriginal {self.traceback}")


class _Admitting(Exception):
    """size_of(index) failed while admitting ``index``."""

    def __init__(self, index) -> None:
        super().__init__(index)
        self.index = index


class Fetcher:
    """Reads ``(key, index)`` items from an iterable order with ``threads`` threads.

    ``read(index) -> (bytes, source)`` does the I/O; completed reads are put on
    ``out`` (a ``queue.Queue`` the consumer may share with other producers) as
    :class:`Fetched`.  Call :meth:`release` with a completion's ``nbytes`` once
    its bytes are no longer held.  ``threads`` is the most threads it runs;
    it starts ``start_threads`` of them (default: all) and :meth:`grow` adds
    one.
    """

    def __init__(
        self,
        read: Callable[[int], tuple[bytes, str]],
        order: Iterable[tuple[object, int]],
        out: "queue.Queue",
        threads: int = 8,
        budget_bytes: int = 64 << 20,
        size_of: Callable[[int], int] | None = None,
        name: str = "coordl-fetch",
        read_many: Callable[[list], list] | None = None,
        batch: int = 8,
        start_threads: int | None = None,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads should be a positive int, but got threads={threads!r}")
        if budget_bytes < 1:
            raise ValueError(f"budget_bytes should be a positive int, but got budget_bytes={budget_bytes!r}")
        self._read = read
        self._read_many = read_many
        self._batch = max(1, batch) if read_many is not None else 1
        self._order: Iterator[tuple[object, int]] = iter(order)
        self._out = out
        self._budget = budget_bytes
        self._size_of = size_of
        self._cond = threading.Condition()
        self._held = 0          # bytes admitted and not yet released
        self._outstanding = 0   # reads admitted and not yet released
        self._mean = 0.0
        self._reads = 0
        self._closed = False
        self._exhausted = False
        self._pending = None    # the next item, taken off the order, not yet admitted
        self._slack = budget_bytes // 8  # free budget that wakes a waiting thread
        self._name = name
        self._max_threads = threads
        self._grown_at = 0      # reads completed when grow() last added a thread
        self._threads: list[threading.Thread] = []
        for _ in range(threads if start_threads is None else max(1, min(threads, start_threads))):
            self._start_thread()

    def _start_thread(self) -> None:
        t = threading.Thread(target=self._loop, name=f"{self._name}-{len(self._threads)}", daemon=True)
        self._threads.append(t)
        t.start()

    @property
    def threads(self) -> int:
        """Fetch threads started so far."""
        return len(self._threads)

    def grow(self) -> bool:
        """One more thread, up to ``threads``: the consumer calls this when it
        waits on a read it needs.  Only after a read completed since the
        last one was added (the first read of a pass is always waited for,
        however many threads run) and while reads are left to start.
        Consumer side only; returns whether a thread was added."""
        if (len(self._threads) >= self._max_threads or self._reads <= self._grown_at
                or self._closed or self._exhausted):
            return False
        self._grown_at = self._reads
        self._start_thread()
        return True

    # consumer side ---------------------------------------------------------
    def release(self, nbytes: int) -> None:
        with self._cond:
            self._held -= nbytes
            self._outstanding -= 1
            self._wake_if_room()

    def close(self) -> None:
        """Stop issuing reads; threads exit after their current read."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def join(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    @property
    def held_bytes(self) -> int:
        return self._held

    # threads ---------------------------------------------------------------
    def _wake_if_room(self) -> None:
        """Wake one waiting thread if the budget has room for a read of the
        usual size or nothing is outstanding (caller holds ``_cond``).

        One thread, not all, and only with room: waking every fetch thread
        on each admission, completion and release (notify_all) cost the
        worker's prep thread ~25% of its time in wake-ups and the GIL
        hand-offs that follow (py-spy, ``benchmarks/profile_worker.py``).  A woken
        thread that admits a read calls this again, so a freed budget is
        taken up by as many threads as it fits.  Waiting for a read's worth
        of room, rather than any room, batches the wake-ups when samples
        are released one by one; nothing can wait forever, because the
        last release (nothing outstanding) always wakes a waiter.
        """
        if self._outstanding == 0 or self._budget - self._held >= self._slack:
            self._cond.notify()

    def _admit(self, block: bool = True):
        """Next (key, index, estimate) to read, or None when done/closed
        (or, with ``block=False``, when the budget does not admit it now).

        Strictly in order: the next item is only taken off the order once the
        budget admits it, so a thread woken early can never jump ahead of an
        earlier sample (that would let read-ahead fill the budget with late
        samples while an early one waits: a deadlock).
        """
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._pending is None:
                    if self._exhausted:
                        return None
                    try:
                        key, index = next(self._order)
                    except StopIteration:
                        self._exhausted = True
                        self._cond.notify_all()
                        return None
                    try:
                        est = self._size_of(index) if self._size_of is not None else int(self._mean)
                    except BaseException as e:
                        raise _Admitting(index) from e
                    self._pending = (key, index, est)
                est = self._pending[2]
                if self._outstanding == 0 or self._held + est <= self._budget:
                    item, self._pending = self._pending, None
                    self._held += est
                    self._outstanding += 1
                    self._wake_if_room()  # hand the wake-up on while there is room
                    return item
                if not block:
                    return None
                self._cond.wait()

    def _loop(self) -> None:
        in_hand: list = []
        try:
            self._run(in_hand)
        except BaseException as e:  # the thread is dying: say so, never leave the consumer waiting
            stage, index, err = "reading", (in_hand[0][1] if in_hand else None), e
            if isinstance(e, _Admitting):
                stage, index, err = "admitting", e.index, e.__cause__
            tb = "".join(traceback.format_exception(err))
            with self._cond:
                self._closed = True  # the others stop too: the pass is over
                self._cond.notify_all()
            self._out.put(FetcherDied(self, threading.current_thread().name, index, stage, err, tb))

    def _run(self, in_hand: list) -> None:
        clock = time.perf_counter
        while True:
            in_hand.clear()
            item = self._admit()
            if item is None:
                return
            items = in_hand
            items.append(item)
            while len(items) < self._batch:  # more, only if admitted right away
                nxt = self._admit(block=False)
                if nxt is None:
                    break
                items.append(nxt)
            t0 = clock()
            if len(items) == 1:
                try:
                    results = [self._read(item[1])]
                except BaseException as e:  # handed to the consumer, which decides
                    results = [e]
            else:
                try:
                    results = self._read_many([it[1] for it in items])
                    if len(results) != len(items):
                        raise ValueError(f"raw_many() should return one result per index, but got "
                                         f"{len(results)} results for {len(items)} indices")
                except BaseException as e:
                    results = [e] * len(items)
            seconds = (clock() - t0) / len(items)
            while items:
                key, index, est = items[0]
                res = results[len(results) - len(items)]
                data, error, source = None, None, "storage"
                try:
                    if isinstance(res, BaseException):
                        error = res
                    else:
                        data, source = res
                        nbytes = len(data)
                except BaseException:  # a malformed result is that sample's error
                    data, error = None, TypeError(
                        f"raw({index}) should return bytes, but got {_kind(res)}")
                nbytes = len(data) if data is not None else 0
                with self._cond:
                    self._held += nbytes - est  # correct the estimate
                    self._reads += 1
                    self._mean += (nbytes - self._mean) / self._reads
                    if nbytes < est:
                        self._wake_if_room()
                self._out.put(Fetched(key, index, data, error, nbytes, seconds, source))
                items.pop(0)


def _kind(res) -> str:
    if isinstance(res, tuple) and len(res) == 2:  # (data, source) from the reader
        res = res[0]
    return f"{type(res).__name__} {res!r:.60}"
