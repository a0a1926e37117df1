"""Pinning the batches of coordl's own pipeline (``pin_memory=True``).

torch's machinery pins in its own pin-memory thread; coordl's pipeline pins
here, with the same rule as torch: only when an accelerator is available
(``torch.accelerator.is_available()``); without one the loader warns once per
pass and delivers unpinned batches, as torch does.

With worker processes a ``PinThread`` runs the pass's iterator: it receives
each batch, copies it into page-locked memory and queues it, up to ``depth``
batches ahead, so the copy overlaps with training.  The thread is the only
one driving the pass's iterator while it runs (one owner).  Its errors, and
the pass's own (a ``SampleError``, a dead worker), reach the consumer in order
through the queue; if the thread itself dies the consumer gets an error
naming it instead of waiting.  When the consumer drops the iterator, a
finalizer only sets the stop flag; the thread notices within ``_POLL``
seconds, stops, and drops the pass's iterator, whose own finalizer ends the
pass.  Without workers the batch is pinned in the main thread, as torch's
single-process iterator does.
"""
from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref

import torch
from torch.utils.data._utils.pin_memory import pin_memory as _torch_pin

__all__ = ["pin_batch", "PinThread", "PinInline", "StageInline", "accelerator_available"]

_POLL = 1.0
_STOP_WAIT = 10.0  # longest wait for the pin thread to leave the pool on shutdown
_EXIT_WAIT = 2.0 * _POLL  # longest wait, at the interpreter's exit, for the running threads to stop

# the pin and decode threads running now, each with its stop flag (added before it starts, removed as it ends)
_running: dict = {}
_running_lock = threading.Lock()


def _stop_running_threads() -> None:
    """At the interpreter's exit, before it finalizes: stop every pin and
    decode thread still running a pass (a script that left its loop
    mid-epoch) and wait for each to leave the call it is in.  A daemon
    thread inside a torch call that released the GIL (a resize, a copy,
    a decoder) would otherwise take the GIL back during finalization, be
    ended there by Python, and the unwinding through torch's C++ frames
    aborts the process ("terminate called without an active exception",
    exit status 134).  A thread waiting on a queue or a pipe in Python is
    harmless and may be left waiting past the bounded wait."""
    with _running_lock:
        running = list(_running.items())
    for _, (stop, q) in running:
        _halt(stop, q)
    deadline = time.monotonic() + _EXIT_WAIT
    for t, _ in running:
        if t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))


# put by stop_threads into the queue of a thread that ended: its consumer, waiting on that queue (the pin
# thread on the decode thread's), wakes and sees the flag rather than at its next poll
_WAKE = ("wake", None)


def _halt(stop: threading.Event, q: queue.Queue) -> None:
    """Stop a pin (or decode) thread and wake it where it may wait on its own
    queue: called where its consumer is done with the pass, so what the queue
    holds is dropped, and a put into the full queue returns at once rather
    than at its next poll (the thread then sees the flag and ends)."""
    stop.set()
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


def stop_threads(halting: list, wait: float | None = None) -> None:
    """End the threads of ``halting`` (:attr:`PinThread.halting` of each):
    all stopped and woken first, then joined (for ``wait`` seconds in all,
    or until they end), each one's queue emptied again as it ends (of what
    it put between its check of the flag and its end) and given a wake-up
    for a consumer waiting on it."""
    for stop, q, _ in halting:
        _halt(stop, q)
    # Joined together, in short steps (the main thread still takes signals): as each ends, its queue is
    # emptied and given _WAKE, which no thread of its puts behind, so that a consumer waiting on it (a
    # stacked thread reading this one) wakes at once and ends in turn.
    deadline = None if wait is None else time.monotonic() + wait
    pending = list(halting)
    while pending:
        for h in [h for h in pending if not h[2].is_alive()]:
            _halt(*h[:2])
            try:
                h[1].put_nowait(_WAKE)
            except queue.Full:
                pass
            pending.remove(h)
        if not pending or (deadline is not None and time.monotonic() >= deadline):
            break
        pending[0][2].join(0.01)
    for stop, q, _ in pending:
        _halt(stop, q)


_exit_hook = False


def _ensure_exit_hook() -> None:
    """Register :func:`_stop_running_threads` with ``atexit`` once, when the
    first pin or decode thread starts.  atexit's handlers run after the
    interpreter has joined the non-daemon threads (a training thread that
    outlives the main one keeps its loader to the end) and before it
    finalizes; and last-registered first, so this one runs before the
    handlers coordl's modules registered at import (the node cache's), with
    its threads stopped before what they read is torn down."""
    global _exit_hook
    with _running_lock:
        if _exit_hook:
            return
        _exit_hook = True
    atexit.register(_stop_running_threads)


def accelerator_available() -> bool:
    """torch's test for pinning (its iterators pin only when this is True)."""
    return torch.accelerator.is_available()


def _accel_fn(name: str):
    # torch 2.7 renamed current_device_idx/set_device_idx to *_index (2.6 has only *_idx)
    acc = torch.accelerator
    return getattr(acc, name + "_index", None) or getattr(acc, name + "_idx")


def current_device_index() -> int:
    return _accel_fn("current_device")()


def set_device_index(index: int) -> None:
    _accel_fn("set_device")(index)


def pin_batch(batch):
    """A copy of ``batch`` with every tensor in page-locked memory (torch's
    ``pin_memory`` helper: tensors, containers, objects with ``pin_memory()``)."""
    return _torch_pin(batch)


def _pin_envelope(env, step_note: str):
    if env.batch is None:
        return env
    try:
        env.batch = pin_batch(env.batch)
    except Exception as e:
        raise RuntimeError(
            f"pinning {step_note} failed ({type(e).__name__}: {e}); pass pin_memory=False if this "
            "batch type cannot be pinned, or give it a pin_memory() method"
        ) from e
    return env


def _note(env) -> str:
    step = getattr(env, "step", None)
    return f"batch {step} of epoch {env.epoch}" if step is not None else "a batch"


class PinInline:
    """Pins each batch of ``inner`` in the calling thread (``num_workers=0``)."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._inner)

    def __next__(self):
        env = next(self._inner)
        return _pin_envelope(env, _note(env))

    def worker_processes(self) -> list:
        return self._inner.worker_processes()

    def shutdown_workers(self) -> None:
        self._inner.shutdown_workers()


class StageInline:
    """Runs ``stage(envelope, note)`` on each envelope of ``inner`` in the
    calling thread (``num_workers=0`` with ``decode="device"``): the batch
    is decoded and its copy started before the loop counts it, so samples
    the stage skips are counted as skipped."""

    def __init__(self, inner, stage) -> None:
        self._inner = inner
        self._stage = stage

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._inner)

    def __next__(self):
        env = next(self._inner)
        return self._stage(env, _note(env))

    def worker_processes(self) -> list:
        return self._inner.worker_processes()

    def shutdown_workers(self) -> None:
        self._inner.shutdown_workers()


def _pin_loop(inner, q: queue.Queue, stop: threading.Event, device_index, stage=_pin_envelope) -> None:
    try:
        _pin_batches(inner, q, stop, device_index, stage)
    finally:
        with _running_lock:
            _running.pop(threading.current_thread(), None)


def _pin_batches(inner, q: queue.Queue, stop: threading.Event, device_index, stage) -> None:
    if device_index is not None:  # pin for the device the consumer had selected
        set_device_index(device_index)
    while not stop.is_set():
        try:
            env = next(inner)
        except StopIteration:
            item = ("end", None)
        except BaseException as e:  # forwarded in order; the pass decides what comes next
            item = ("error", e)
        else:
            if stop.is_set():   # stopped while it waited: no new device or torch work (see _stop_running_threads)
                return
            try:
                item = ("data", stage(env, _note(env)))
            except BaseException as e:
                item = ("error", e)
        while not stop.is_set():
            try:
                q.put(item, timeout=_POLL)
                break
            except queue.Full:
                continue
        # drop this frame's reference: an error's traceback holds this frame,
        # and the cycle would keep the pass (and its workers) alive until gc
        kind, item = item[0], None
        if kind == "end":
            return


class PinThread:
    """Runs ``inner`` (a pass of coordl's pipeline) in a pin thread; yields
    its envelopes with pinned batches, at most ``depth`` ahead."""

    def __init__(self, inner, depth: int, stage=None, name: str = "coordl-pin-memory") -> None:
        """``stage(envelope, note) -> envelope``: what the thread does to each
        batch (default: pin it; with a device: start its copy, see
        coordl.device).  ``inner`` may be another PinThread (a stage one
        batch ahead of this one): shutting this one down shuts that one
        down after it."""
        self._inner = inner
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._ended = False
        index = None
        if accelerator_available():
            index = current_device_index()
        self._thread = threading.Thread(target=_pin_loop,
                                        args=(inner, self._q, self._stop, index, stage or _pin_envelope),
                                        name=name, daemon=True)
        _ensure_exit_hook()
        with _running_lock:
            _running[self._thread] = (self._stop, self._q)
        self._thread.start()
        # the finalizer only sets a flag; the pin thread acts on it
        self._final = weakref.finalize(self, self._stop.set)

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._inner)

    def __next__(self):
        if self._ended:
            raise StopIteration
        while True:
            if self._stop.is_set():     # stopped from outside: a newer pass of the loader began (its queue emptied)
                self._ended = True
                raise RuntimeError(
                    "coordl: this iterator's pass ended when a newer pass of the same loader began "
                    "(iter(loader) again): with device= or pin_memory a loader runs one pass at a time; "
                    "take the batches from the newest iterator, or give each pass a loader of its own")
            try:
                kind, value = self._q.get(timeout=_POLL)
                if not self._stop.is_set():
                    break
                continue            # stopped: what it took is dropped (_WAKE among them), the flag says why
            except queue.Empty:
                if not self._thread.is_alive() and self._q.empty():
                    self._ended = True
                    name = self._thread.name
                    hint = ("; pass pin_memory=False to deliver unpinned batches" if name == "coordl-pin-memory"
                            else "")
                    raise RuntimeError(
                        f"coordl's thread {name} exited without finishing the pass (see its traceback "
                        f"above){hint}") from None
        if kind == "data":
            return value
        if kind == "end":
            self._ended = True
            raise StopIteration
        try:
            raise value
        finally:
            # the traceback holds this frame: without this the error, the
            # frame and self would form a cycle that keeps the workers alive
            # until the garbage collector runs
            value = None

    def worker_processes(self) -> list:
        return self._inner.worker_processes()

    @property
    def halting(self) -> tuple:
        """``(stop flag, queue, thread)``: what :func:`_halt` and a join need
        to end this thread, without holding this object."""
        return self._stop, self._q, self._thread

    @property
    def base_seed(self):
        return getattr(self._inner, "base_seed", None)

    def shutdown_workers(self) -> None:
        # Let the pin thread leave the pool first (it stops after the batch it
        # is waiting for): closing pipes another thread is polling is unsafe.
        self._ended = True
        stop_threads([self.halting], _STOP_WAIT)
        self._inner.shutdown_workers()
