"""The one thread that acts for finalizers: a per-process daemon thread
(``coordl-reaper``) that runs the clean-ups finalizers enqueue.

A ``weakref.finalize`` callback can run inside any garbage collection, in
whatever thread triggered it, possibly while that thread holds a lock the
clean-up needs (a pipe's send lock, a directory lock, a fetcher's
condition).  So finalizers only call :func:`later`, which enqueues (a
``SimpleQueue.put`` is safe there); the reaper runs the clean-up in its own
thread.  Used for: stopping a dropped pool's workers (``pipeline.workers``),
ending a dropped inline pass's fetch threads, and a collected loader's node
cache detach.  At interpreter exit (the main thread has finished, and a
daemon thread may never run again) :func:`later` runs the clean-up at once,
and whatever was enqueued before is finished first (an exit hook waits for
the reaper), so a dropped pool's workers are stopped while the main process
still lives: workers that outlive it count as orphaned (see ``cache``).
"""
from __future__ import annotations

import atexit
import os
import queue
import threading
import traceback
from . import forks

__all__ = ["start", "later", "flush", "running"]

_q: queue.SimpleQueue = queue.SimpleQueue()
_thread: list = []   # [thread, pid] of this process's reaper
_lock = forks.worker_safe(threading.Lock())


def start() -> None:
    """Start this process's reaper (from normal code, never a finalizer)."""
    with _lock:
        if _thread and _thread[1] == os.getpid() and _thread[0].is_alive():
            return
        t = threading.Thread(target=_loop, name="coordl-reaper", daemon=True)
        t.start()
        _thread[:] = [t, os.getpid()]


def _loop() -> None:
    while True:
        fn = _q.get()
        try:
            fn()
        except Exception:  # a failed clean-up must not end the reaper; say what happened
            traceback.print_exc()


def running() -> bool:
    """Whether :func:`later` enqueues (this process's reaper runs and the
    interpreter is not exiting) rather than running the clean-up at once."""
    return bool(threading.main_thread().is_alive() and _thread and _thread[1] == os.getpid()
                and _thread[0].is_alive())


def later(fn) -> None:
    """Run ``fn()`` in the reaper thread (what a finalizer calls).  At
    interpreter exit, or in a process whose reaper was never started here
    (a forked child) or has ended, run it now (:func:`running` decides)."""
    if running():
        _q.put(fn)
    else:
        fn()


def flush(timeout: float = 10.0) -> bool:
    """Wait until every clean-up enqueued so far has run (False on timeout).
    For tests and for code that must observe a finished clean-up."""
    if not (_thread and _thread[1] == os.getpid() and _thread[0].is_alive()):
        return True
    done = threading.Event()
    _q.put(done.set)
    return done.wait(timeout)


@atexit.register
def _finish_at_exit() -> None:
    flush(30.0)
