"""coordl's own pipeline for two-stage datasets: worker pool and iterators.

::

    main process                                   worker w (one per num_workers)
    ------------                                   ------------------------------
    PipelineIter.__next__                          control reader thread
      pool.begin_pass ----("pass", id, plan, e, start, skip)--> Engine.begin_pass
                                                   fetch threads (read ahead along
                                                   the worker's share of the plan)
                                                   Engine.pump: prep into slot rows
      pool.get(k) <----("slot" + memfd)------------ new slot (once)
                  <----("batch", id, k, slot, layout, rows, stats)
                  <----("packed", id, k, slot, packed, stats)  (a collate_fn's batch)
      tensors view the slot (zero copy)
      pool.consumed ----("consumed", id, k)------> window advances
      last tensor freed -> finalizer queues the slot;
      the next call into the pool sends ("free", slot) --> slot reusable
      (or ("retire", slot) if a child was forked while the batch lived:
      the worker drops the slot and never writes it again)

Every wait has a timeout after which the workers' liveness is checked; a dead
worker is reported with its pid and exit code or signal.  Workers exit when
told, when their control pipe closes, or when the main *process* exits (a
pidfd of it, watched by the control thread; not PR_SET_PDEATHSIG, which
fires when the *thread* that started the worker exits).
"""
from __future__ import annotations

import collections
import functools
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
import weakref
from multiprocessing import reduction

import numpy as np

from . import collate as _collate
from ..base import forks as _forks
from ..base import reaper as _reaper
from ..base.forks import starting_workers
from .engine import Engine, pass_steps
from .torch_path import Envelope
from ..errors import SampleError
from .slots import LocalSlots, map_slot
from .worker_process import _POLL, _worker_main

__all__ = ["WorkerPool", "PipelineIter", "InlineIter"]


def _exit_reason(p) -> str:
    code = p.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by signal: {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _exit_hint(code) -> str:
    """What a worker's exit status suggests: only SIGKILL is the OOM killer's."""
    if code == -signal.SIGKILL:
        return ("If it was killed by the OOM killer, lower num_workers or the batch size; details may be in "
                "the worker's stderr above.")
    if code == -signal.SIGABRT:
        return ("It aborted: the worker's stderr above says why (an uncaught C++ exception, a failed "
                "assertion, or CUDA used in a forked worker: create CUDA tensors in the main process only, "
                "or pass multiprocessing_context='spawn').")
    return "Details may be in the worker's stderr above."


class WorkerPool:
    """``num_workers`` worker processes running :class:`Engine`."""

    def __init__(self, dataset, cfg: dict, num_workers: int, ctx, timeout: float = 0, stash=None) -> None:
        self.num_workers = num_workers
        # slots kept from the loader's last pool (SlotStash): mapped here, inherited by forked workers
        self._stash = stash if stash is not None and _forks_workers(ctx) else None
        self._given = self._stash.take(num_workers) if self._stash is not None else [[]] * num_workers
        self._taken: set[tuple[int, int]] = set()   # (w, index in _given[w]) a worker took
        self.timeout = timeout
        self.base_seed = cfg.get("base_seed")
        self.procs, self.ctrl, self.res = [], [], []
        self._locks = [threading.Lock() for _ in range(num_workers)]
        # one reader of the result pipes at a time: the pin thread takes results while another
        # thread may ask for statistics (worker_stats); two readers would split a message
        self._rlock = threading.RLock()
        self.maps: dict[tuple[int, int], tuple[int, object]] = {}
        self.pending: dict[int, tuple[int, tuple]] = {}
        # Slots whose last batch tensor died: (w, sid, gen).  Filled by
        # finalizers, which may run inside any allocation, including inside
        # our own send under self._locks[w] (cyclic gc): they only append
        # (deque.append takes no lock), and the thread calling into the pool
        # sends the "free" messages (_drain_frees).
        self._frees: collections.deque = collections.deque()
        # Slots that batches handed out view, (w, sid, gen) -> the finalizer
        # of the batch's owner (recorded under _forks.lock; dropped when
        # drained), and those of them a forked child may still view: when
        # the batch dies here they are retired, never reused (_forked_now).
        self._lent: dict[tuple, weakref.finalize] = {}
        self._forked: set[tuple] = set()
        self.pass_id = 0
        self.closed = False
        self._stats: dict[int, dict] = {}
        parent = os.getpid()
        try:
            with starting_workers():    # a forked worker never collects what it inherited
                self._start(dataset, cfg, num_workers, ctx, parent)
        except BaseException as e:
            _shutdown(self.procs, self.ctrl, self.res, parent)
            if "pickle" in str(e).lower():   # spawn/forkserver send the dataset to each worker
                e.add_note("coordl: the dataset goes to each worker pickled (multiprocessing_context="
                           f"{getattr(ctx, '_name', ctx)!r}): define every function it holds (its transform's "
                           "steps included) with def at module level (or as a class with __call__), not as a "
                           "lambda or inside another function")
            raise
        # Stopping workers joins and may kill: not something to do inside
        # whatever allocation triggers the gc that drops this pool.  The
        # finalizer only enqueues the stop for the reaper thread.
        self._stop = functools.partial(_shutdown, self.procs, self.ctrl, self.res, parent)
        _reaper.start()
        self._final = weakref.finalize(self, _reaper.later, self._stop)
        with _forks.lock:   # not while a fork's hook walks the pools
            _pools.add(self)

    def _start(self, dataset, cfg: dict, num_workers: int, ctx, parent: int) -> None:
        for w in range(num_workers):
            ctrl_r, ctrl_w = ctx.Pipe(duplex=False)
            res_main, res_child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker_main, name=f"coordl-worker-{w}",
                            args=(w, num_workers, dataset, cfg, ctrl_r, res_child, parent, self._given[w]),
                            daemon=True)
            p.start()
            ctrl_r.close()
            res_child.close()
            self.procs.append(p)
            self.ctrl.append(ctrl_w)
            self.res.append(res_main)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -------------------------------------------------------------- control
    def _send(self, w: int, msg) -> None:
        try:
            with self._locks[w]:
                self.ctrl[w].send(msg)
        except (BrokenPipeError, ConnectionResetError):
            # the worker is gone: its last message (a "fatal") or its exit status says why
            self._receive(0)
            self.procs[w].join(1.0)
            self._check_alive()
            raise RuntimeError(f"DataLoader worker (pid {self.procs[w].pid}) closed its control pipe "
                               "unexpectedly") from None

    def begin_pass(self, plan, epoch: int, start: int, skip=()) -> int:
        self._drain_frees()
        self.pass_id += 1
        # batches of the previous pass that arrived but were never delivered:
        # their slots go back to the workers (else each abandoned pass leaks them)
        for w, msg in self.pending.values():
            self._frees.extend(_slots_of(w, msg))
        self.pending.clear()
        skip = tuple(sorted(skip))
        for w in range(self.num_workers):
            self._send(w, ("pass", self.pass_id, plan, epoch, start, skip))
        self._drain_frees()
        return self.pass_id

    def consumed(self, w: int, k: int) -> None:
        self._send(w, ("consumed", self.pass_id, k))
        self._drain_frees()

    def _drain_frees(self) -> None:
        """Send the "free" messages queued by slot finalizers (owner thread
        only); a slot a forked child may view is retired instead."""
        frees = self._frees
        while frees:
            try:
                key = frees.popleft()
            except IndexError:
                return
            self._lent.pop(key, None)
            op = "free"
            if self._forked and key in self._forked:
                self._forked.discard(key)
                # the child's mapping keeps the pages; ours goes, and the worker drops its own
                if self.maps.get(key[:2], (None,))[0] == key[2]:
                    del self.maps[key[:2]]
                op = "retire"
            if self.closed:
                continue
            w, sid, gen = key
            try:
                self._send(w, (op, sid, gen))
            except (OSError, ValueError):
                pass  # the pool was shut down meanwhile

    def _forked_now(self) -> None:
        """Before a fork (``base.forks`` hook, under its lock): the slots of
        batches alive now may be viewed by the child; never reuse them."""
        for key, f in self._lent.copy().items():
            if f.alive:
                self._forked.add(key)

    def shutdown(self) -> None:
        """Stop the workers now (in the calling thread); with a stash, keep
        the slots nothing can write or view any more for the next pool."""
        if not self.closed:
            self.closed = True
            if self._final.detach() is not None:
                self._stop()
            self._keep_slots()
            self.maps.clear()
            self._given = []

    def _keep_slots(self) -> None:
        if self._stash is None or any(p.exitcode is None for p in self.procs):
            return   # a worker still running could still write its slots
        with _forks.lock:   # _lent and _forked as a fork's hook leaves them
            kept = [(mm, self._lent.get((w, sid, gen))) for (w, sid), (gen, mm) in self.maps.items()
                    if (w, sid, gen) not in self._forked]
        unused = [(mm, None) for w, given in enumerate(self._given) for i, mm in enumerate(given)
                  if (w, i) not in self._taken]
        used = sum(len(mm) for _, mm in self.maps.values())
        self._stash.put(kept + unused, cap=max(used, sum(len(mm) for mm, _ in unused)))

    # -------------------------------------------------------------- results
    def _check_alive(self) -> None:
        for p in self.procs:
            if p.exitcode is not None:
                raise RuntimeError(f"DataLoader worker (pid {p.pid}) exited unexpectedly with {_exit_reason(p)}. "
                                   + _exit_hint(p.exitcode))

    def _receive(self, timeout: float) -> None:
        with self._rlock:
            self._receive_locked(timeout)

    def _receive_locked(self, timeout: float) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        ready = mpc.wait(self.res + list(sentinels), timeout)
        conns = [c for c in ready if c not in sentinels]
        for c in conns:
            w = self.res.index(c)
            try:
                while c.poll():
                    self._on_message(w, c, c.recv())
            except (EOFError, OSError):
                self.procs[w].join(1.0)
                self._check_alive()
                raise RuntimeError(f"DataLoader worker (pid {self.procs[w].pid}) closed its pipe unexpectedly")
        if len(conns) < len(ready):
            time.sleep(0.05)  # let a dying worker's last messages land, then report it
            self._check_alive()

    def worker_stats(self) -> list[dict]:
        """Each worker's own accounting (slots, slot bytes, read-ahead bytes,
        thread names), asked over the control pipe; for tests and debugging."""
        self._stats = {}
        self._drain_frees()
        for w in range(self.num_workers):
            self._send(w, ("stats",))
        deadline = time.monotonic() + max(self.timeout, 30.0)
        while len(self._stats) < self.num_workers:
            if time.monotonic() > deadline:
                raise RuntimeError("DataLoader workers did not answer a statistics request in time")
            self._receive(_POLL)
            self._check_alive()
        return [self._stats[w] for w in range(self.num_workers)]

    def _on_message(self, w: int, conn, msg) -> None:
        kind = msg[0]
        if kind == "stats":
            self._stats[w] = msg[3]
            return
        if kind == "slot":
            _, sid, gen, size = msg
            fd = reduction.recv_handle(conn)
            self.maps[(w, sid)] = (gen, map_slot(fd, size))
            return
        if kind == "spare":   # a slot of the stash, mapped here already
            _, sid, gen, i = msg
            self._taken.add((w, i))
            self.maps[(w, sid)] = (gen, self._given[w][i])
            return
        if kind == "fatal":  # the worker stops after this: so does the pool
            self.shutdown()
            raise RuntimeError(msg[3])
        if msg[1] != self.pass_id:  # a batch of an abandoned pass
            self._frees.extend(_slots_of(w, msg))
            return
        self.pending[msg[2]] = (w, msg)

    def get(self, k: int | None):
        """The message for batch ``k`` (any batch when None), waiting as needed."""
        if self.closed:
            raise RuntimeError("DataLoader workers were shut down after an earlier error in this pass; "
                               "start a new pass with iter(loader)")
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
        while True:
            self._drain_frees()
            if k is None and self.pending:
                k = min(self.pending)
            if k is not None and k in self.pending:
                return self.pending.pop(k)
            wait = _POLL
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    raise RuntimeError(f"DataLoader timed out after {self.timeout} seconds")
                wait = min(wait, _POLL)
            self._receive(wait)
            self._check_alive()

    def materialize(self, w: int, msg):
        kind = msg[0]
        if kind == "error":
            raise msg[3].exception()
        if kind == "batch":
            _, _, k, (sid, gen), layout, rows, stats = msg
            owner = self._lend(w, sid, gen, layout.nbytes)
            batch = _collate.build(layout.template, _collate.views(layout, owner, rows))
            stats.layout = layout
            return batch, self._map_blob(w, stats)
        if kind == "packed":    # a collate_fn's batch, its tensors in a slot (collate.pack)
            _, _, k, (sid, gen), packed, stats = msg
            return _collate.unpack(packed, self._lend(w, sid, gen, packed.nbytes)), self._map_blob(w, stats)
        if kind == "obj":
            return msg[3], self._map_blob(w, msg[4])
        return None, msg[3]  # "empty": every sample skipped

    def _lend(self, w: int, sid: int, gen: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of worker ``w``'s slot ``sid``, as the array
        the batch's tensors are made over: the slot goes back to the worker
        once that array is garbage."""
        mgen, mm = self.maps[(w, sid)]
        assert mgen == gen, "slot generation mismatch"
        owner = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        # only enqueues (see _frees); holds the deque, not the pool
        f = weakref.finalize(owner, self._frees.append, (w, sid, gen))
        f.atexit = False
        with _forks.lock:   # seen by a fork's hook, or made after the fork
            self._lent[(w, sid, gen)] = f
        return owner

    def _map_blob(self, w: int, stats):
        """decode="device": the batch's packed JPEG bytes as a view of their
        slot, which goes back to the worker once the view is garbage (after
        the device stage has decoded them, coordl.device.decode)."""
        blob = getattr(stats, "device_blob", None)
        if blob is not None and type(blob[0]) is tuple:
            (sid, gen), total, offsets = blob
            mgen, mm = self.maps[(w, sid)]
            assert mgen == gen, "slot generation mismatch"
            owner = np.frombuffer(mm, dtype=np.uint8, count=total)
            f = weakref.finalize(owner, self._frees.append, (w, sid, gen))
            f.atexit = False
            with _forks.lock:
                self._lent[(w, sid, gen)] = f
            stats.device_blob = (owner, total, offsets)
        return stats


def _forks_workers(ctx) -> bool:
    """Workers of ``ctx`` are forked from this process (and so map what it maps)."""
    try:
        return ctx.get_start_method() == "fork"
    except (AttributeError, ValueError):
        return False


def _slots_of(w: int, msg) -> list:
    """The slots a result message of worker ``w`` holds, as ``(w, sid, gen)``:
    a batch's own, and the slot of its packed JPEG bytes (decode="device")."""
    kind = msg[0]
    if kind == "batch":
        out, stats = [(w,) + tuple(msg[3])], msg[6]
    elif kind == "packed":
        out, stats = [(w,) + tuple(msg[3])], msg[5]
    elif kind == "obj":
        out, stats = [], msg[4]
    else:
        return []
    blob = getattr(stats, "device_blob", None)
    if blob is not None and type(blob[0]) is tuple:
        out.append((w,) + tuple(blob[0]))
    return out


_pools: weakref.WeakSet = weakref.WeakSet()   # this process's pools, for the fork hook


def _forking() -> None:
    for pool in list(_pools):
        pool._forked_now()


_forks.on_fork(_forking)


def _shutdown(procs, ctrl, res, owner_pid: int) -> None:
    if os.getpid() != owner_pid:
        return  # a forked child's copy of the pool (its finalizer ran there): not ours to stop
    for c in ctrl:
        try:
            c.send(("stop",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join(2.0)
    for c in list(ctrl) + list(res):
        try:
            c.close()
        except OSError:
            pass


def _envelope(batch, stats, epoch: int, k: int) -> Envelope:
    return Envelope(batch, epoch, stats, k)


class PipelineIter:
    """One pass over the plan with worker processes; yields Envelopes that
    carry their batch index (``step``), so out-of-order delivery is recorded."""

    def __init__(self, pool: WorkerPool, plan, epoch: int, start: int, in_order: bool, owns_pool: bool,
                 skip=()) -> None:
        self._pool = pool
        self._plan = plan
        self._epoch = epoch
        self._todo = pass_steps(plan.num_batches, start, skip)
        self._pos = 0                   # in_order: position in _todo of the next batch
        self._left = len(self._todo)
        self._in_order = in_order
        self._owns = owns_pool
        pool.begin_pass(plan, epoch, start, skip)
        # an owned pool lives only through this iterator: when the iterator is
        # dropped, the pool's own finalizer has the reaper stop its workers

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self._plan.num_batches

    def _close(self) -> None:
        if self._owns:
            self._pool.shutdown()

    def worker_processes(self) -> list:
        return list(self._pool.procs)

    @property
    def base_seed(self):
        return self._pool.base_seed

    def shutdown_workers(self) -> None:
        """Stop the pool's workers now (also a persistent pool: the loader
        starts a new one for its next pass)."""
        self._pool.shutdown()

    def __next__(self) -> Envelope:
        if self._left <= 0:
            self._close()
            raise StopIteration
        try:
            w, msg = self._pool.get(self._todo[self._pos] if self._in_order else None)
        except BaseException:
            self._close()
            raise
        k = msg[2]
        self._pool.consumed(w, k)
        self._left -= 1
        if self._in_order:
            self._pos += 1
        # a failed batch raises here; the pass goes on with the next batch (as torch's)
        try:
            batch, stats = self._pool.materialize(w, msg)
        except SampleError as e:
            e.coordl_step = k  # the step is used up: the loader's state counts it
            raise
        return _envelope(batch, stats, self._epoch, k)


class InlineIter:
    """One pass in the main process (``num_workers=0``): same engine, no workers."""

    def __init__(self, dataset, cfg: dict, plan, epoch: int, start: int, timeout: float = 0,
                 skip=()) -> None:
        self._plan = plan
        self._epoch = epoch
        self._todo = pass_steps(plan.num_batches, start, skip)
        self._pos = 0
        self._out = out = {}
        self._failed: str | None = None
        # Nothing the engine holds may reference this iterator: the finalizer
        # below holds the engine, and an engine -> iterator reference would
        # keep the iterator (and the pass's fetch threads and read-ahead)
        # alive forever once the consumer drops it.
        self._engine = Engine(dataset, seed=cfg["seed"], on_error=cfg["on_error"],
                              collate_fn=cfg["collate_fn"], batch_size=cfg["batch_size"],
                              prefetch=cfg["prefetch"], fetch_threads=cfg["fetch_threads"],
                              budget_bytes=cfg["budget"], slots=LocalSlots(),
                              emit=lambda kind, k, *p: out.__setitem__(k, (kind, k) + p),
                              cache=cfg.get("cache"), peers=cfg.get("peers"),
                              collate_later=cfg.get("collate_later", False))
        self._engine.begin_pass(1, plan, epoch, start, 1, 0, skip)
        _reaper.start()
        self._final = weakref.finalize(self, _reaper.later, self._engine.end_pass)

    def _end(self) -> None:
        """End the pass now, in the calling thread (a dropped iterator's
        finalizer only hands the same clean-up to the reaper)."""
        if self._final.detach() is not None:
            self._engine.end_pass()

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self._plan.num_batches

    def worker_processes(self) -> list:
        return []

    def shutdown_workers(self) -> None:
        self._end()

    def __next__(self) -> Envelope:
        if self._pos >= len(self._todo):
            self._end()
            raise StopIteration
        if self._failed is not None:  # the pass ended with an unexpected failure
            raise RuntimeError(f"this DataLoader pass failed earlier ({self._failed}); "
                               "start a new pass with iter(loader)")
        k = self._todo[self._pos]
        eng = self._engine
        # batch reads build whole batches in this thread: none ahead of the one asked for
        done = (lambda: k in self._out) if eng._batches is not None else None
        try:
            while k not in self._out:
                eng.pump(done)
                if k in self._out:
                    break
                eng.on_fetched(eng.next_event())
                while not eng.q.empty():
                    eng.on_fetched(eng.q.get_nowait())
        except BaseException as e:  # not a bad sample (those are emitted): the pass is over
            self._end()
            self._failed = f"{type(e).__name__}: {e}".split("\n", 1)[0]
            if not isinstance(e, KeyboardInterrupt):
                e.add_note(f"coordl: raised while {eng.doing()} (num_workers=0)")
            raise
        kind, _, *p = self._out.pop(k)
        self._pos += 1
        eng.on_consumed(k)
        if kind == "error":  # this batch failed; the pass goes on with the next (as torch's)
            e, p = p[0].exception(), None
            e.coordl_step = k  # the step is used up: the loader's state counts it
            try:
                raise e
            finally:
                # the traceback holds this frame: its locals must not hold the
                # error (e, or p through the Failure), or error, frame and self
                # form a cycle that keeps the pass alive until gc
                e = None
        if kind == "batch":
            buf, layout, rows, stats = p
            batch = _collate.build(layout.template, _collate.views(layout, buf, rows))
            stats.layout = layout
        elif kind == "obj":
            batch, stats = p
        else:
            batch, stats = None, p[0]
        return _envelope(batch, stats, self._epoch, k)
