"""Zero-copy batches across a fork of the process that holds them.

A batch coordl hands out may view shared memory that is reused once the
batch dies: a worker's slot (``pipeline.workers``), the daemon's staging
(``daemon.shared_iter``).  A child forked while such a batch lives (e.g.
``mp.Process(target=f, args=(batch,))`` with the fork start method) maps the
same pages and keeps its copy of the batch after the parent drops its own;
reuse would change the child's bytes.  So the modules that hand out such
views register a hook here (:func:`on_fork`), run in the forking thread
just before every fork, that makes the live views safe for a child (a
worker's slot is then retired instead of reused; a view of staging gets
private pages).

The hooks run under :data:`lock`, held until the fork is done (released in
both processes after it).  Code that hands out a new view records it under
the same lock, so a view is either seen by the hooks or made after the
fork (then the child cannot reach it).  The lock is reentrant: a fork from
inside such a record (a ``__del__`` run by a gc there) must not deadlock.  Nothing is done per batch but that
record: the work is at the fork, for the views alive then.
"""
from __future__ import annotations

import os
import threading
import traceback

__all__ = ["lock", "on_fork"]

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


def _after() -> None:
    try:
        lock.release()
    except RuntimeError:
        pass


os.register_at_fork(before=_before, after_in_parent=_after, after_in_child=_after)
