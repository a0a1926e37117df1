"""What coordl does around a fork of a process that holds its objects.

Two concerns, both tied to ``os.register_at_fork``:

**Worker processes never free the parent's objects.**  A forked child
starts with a copy of every object of its parent, including the garbage the
parent's cyclic collector has not reached yet: a dropped loader, an
abandoned pass, a training step's reference cycles.  If the child's
collector frees such an object, its destructor runs in the child.  For a
CUDA tensor, or page-locked host memory that a copy to the device has used,
that destructor calls into a CUDA context the child does not have, and the
process aborts (``CUDA error: initialization error`` thrown from
``~TensorImpl``): the worker dies with SIGABRT.

:func:`starting_workers` wraps the code that forks worker processes
(coordl's pool, and torch's iterator when coordl builds it):

- the parent's cyclic collector is off while it runs, so no collection can
  happen in a child between its fork and the hook below (a child inherits
  the collector's state);
- in a child forked inside it, the at-fork hook moves every inherited
  object into the collector's permanent generation (``gc.freeze``) and only
  then turns the collector back on: the child's collector looks only at
  objects the child made.  An inherited object can then die in the child
  only by reference count, when the child drops the last reference to it,
  which worker code does only for what it was given (and what it is given
  holds no device state: see coordl.device, "Workers never see GPU state").

The frozen objects cost nothing in the child: their pages stay shared with
the parent (a collection would have touched them, copying them).

In such a child the locks a worker takes are also made free again: numpy's
global generator's (numpy holds it with the GIL released, and coordl seeds
that generator per sample, so a loader iterated in another thread may hold
it at the fork; the worker reseeds the generator right after) and coordl's
own module locks, registered with :func:`worker_safe`.  Otherwise a lock
held at the fork by a thread the child does not have stays held there for
ever, and the worker hangs at its first use of it.  Children
started with ``spawn`` or ``forkserver`` inherit no objects; the guard does
nothing for them but hold the parent's collector off while they start.

**Zero-copy batches keep their bytes in a forked child.**  A batch coordl
hands out may view shared memory that is reused once the batch dies: a
worker's slot (``pipeline.workers``), the daemon's staging
(``daemon.shared_iter``).  A child forked while such a batch lives (e.g.
``mp.Process(target=f, args=(batch,))`` with the fork start method) maps
the same pages and keeps its copy of the batch after the parent drops its
own; reuse would change the child's bytes.  So the modules that hand out
such views register a hook here (:func:`on_fork`), run in the forking
thread just before every fork, that makes the live views safe for a child
(a worker's slot is then retired instead of reused; a view of staging gets
private pages).

The hooks run under :data:`lock`, held until the fork is done (released in
both processes after it).  Code that hands out a new view records it under
the same lock, so a view is either seen by the hooks or made after the
fork (then the child cannot reach it).  The lock is reentrant: a fork from
inside such a record (a ``__del__`` run by a gc there) must not deadlock.
Nothing is done per batch but that record: the work is at the fork, for
the views alive then.
"""
from __future__ import annotations

import contextlib
import gc
import os
import threading
import traceback

__all__ = ["starting_workers", "lock", "on_fork", "worker_safe"]

# ---------------------------------------------------------------- zero-copy views
lock = threading.RLock()
_hooks: list = []


def on_fork(fn) -> None:
    """Run ``fn()`` before every fork of this process (under :data:`lock`)."""
    _hooks.append(fn)


def _before() -> None:
    lock.acquire()
    for fn in _hooks:
        try:
            fn()
        except Exception:   # an at-fork hook cannot stop the fork: say what failed
            traceback.print_exc()


def _release() -> None:
    try:
        lock.release()
    except RuntimeError:
        pass


# ---------------------------------------------------------------- worker starts
_guard = threading.Lock()
_depth = 0            # starting_workers guards open in this process
_was_enabled = False  # the collector's state before the outermost guard


def _after_in_child() -> None:
    global _depth, _guard
    _release()
    if _depth == 0:
        return          # a fork of someone else's: nothing of ours to do
    _guard = threading.Lock()   # the parent's may have been held by another thread
    for lk in _worker_locks:
        lk._at_fork_reinit()
    _numpy_generator_unheld()
    _depth = 0
    gc.freeze()                 # inherited objects are never collected here
    if _was_enabled:
        gc.enable()


os.register_at_fork(before=_before, after_in_parent=_release, after_in_child=_after_in_child)


_worker_locks: list = []


def worker_safe(lk):
    """``lk`` (a module's lock that workers take too), made free again in
    each worker coordl forks: another thread of the parent may hold it at
    the fork, and the worker's copy would stay held by a thread the worker
    does not have (its next acquire waiting forever).  Returns ``lk``."""
    _worker_locks.append(lk)
    return lk


def _numpy_generator_unheld() -> None:
    """In a worker just forked: numpy's global generator's lock made free.
    numpy holds it while it draws or is seeded, the GIL released, so
    another thread of the parent (a loader iterated there, whose samples'
    steps coordl seeds numpy's generator for) may hold it at the fork; the
    worker's copy would stay held by a thread the worker does not have, and
    the worker's seeding of that generator would wait forever.  The state
    it guards is seeded anew right after (the worker's seed), so whatever
    that thread was doing to it does not matter."""
    import sys

    np = sys.modules.get("numpy")
    lock = getattr(getattr(getattr(getattr(np, "random", None), "mtrand", None), "_rand", None), "_bit_generator", None)
    lock = getattr(lock, "lock", None)
    reinit = getattr(lock, "_at_fork_reinit", None)
    if reinit is not None:
        reinit()


@contextlib.contextmanager
def starting_workers():
    """Hold the cyclic collector off while worker processes are forked; a
    child forked meanwhile never collects what it inherited (module doc)."""
    global _depth, _was_enabled
    with _guard:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _guard:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
