"""Forking worker processes that never free the parent's objects.

A forked child starts with a copy of every object of its parent, including
the garbage the parent's cyclic collector has not reached yet: a dropped
loader, an abandoned pass, a training step's reference cycles.  If the
child's collector frees such an object, its destructor runs in the child.
For a CUDA tensor, or page-locked host memory that a copy to the device has
used, that destructor calls into a CUDA context the child does not have, and
the process aborts (``CUDA error: initialization error`` thrown from
``~TensorImpl``): the worker dies with SIGABRT.

:func:`starting_workers` wraps the code that forks worker processes (coordl's
pool, and torch's iterator when coordl builds it):

- the parent's cyclic collector is off while it runs, so no collection can
  happen in a child between its fork and the hook below (a child inherits
  the collector's state);
- in a child forked inside it, an at-fork hook moves every inherited object
  into the collector's permanent generation (``gc.freeze``) and only then
  turns the collector back on: the child's collector looks only at objects
  the child made.  An inherited object can then die in the child only by
  reference count, when the child drops the last reference to it, which
  worker code does only for what it was given (and what it is given holds
  no device state: see coordl.device, "Workers never see GPU state").

The frozen objects cost nothing in the child: their pages stay shared with
the parent (a collection would have touched them, copying them).  Children
started with ``spawn`` or ``forkserver`` inherit no objects; the guard does
nothing for them but hold the parent's collector off while they start.
"""
from __future__ import annotations

import contextlib
import gc
import os
import threading

__all__ = ["starting_workers"]

_lock = threading.Lock()
_depth = 0            # guards open in this process
_was_enabled = False  # the collector's state before the outermost guard


def _after_fork_in_child() -> None:
    global _depth, _lock
    if _depth == 0:
        return          # a fork of someone else's: nothing of ours to do
    _lock = threading.Lock()    # the parent's may have been held by another thread
    _depth = 0
    gc.freeze()                 # inherited objects are never collected here
    if _was_enabled:
        gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def starting_workers():
    """Hold the cyclic collector off while worker processes are forked; a
    child forked meanwhile never collects what it inherited (module doc)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
