"""SIGTERM runs the normal exit path.

Schedulers preempt jobs with SIGTERM (then SIGKILL after a grace period).
Python's default for SIGTERM is to die at once, skipping ``finally`` blocks,
``atexit`` and finalizers: the node cache would stay in /dev/shm with no
owner.  :func:`install_sigterm_exit` (called when a process attaches a node
cache) makes SIGTERM raise ``SystemExit`` in the main thread instead, so the
process unwinds and exits normally, and then ends as killed by SIGTERM, as
it would have without coordl (exit status -15 / 143 to the scheduler).

It changes nothing when the program has its own SIGTERM handler (or ignores
SIGTERM), or when called from another thread.  A second SIGTERM during the
exit path kills at once.  Forked children get the default action back.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading

__all__ = ["install_sigterm_exit"]

_installed = False
_terminated = False
_exiting = False


def _on_sigterm(signum, frame):
    global _terminated
    _terminated = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
    # atexit runs handlers last-registered first: be the first, run the rest
    # from inside (each once), then die of the signal
    atexit.unregister(_end_as_killed)
    atexit.register(_end_as_killed)
    raise SystemExit(128 + signal.SIGTERM)


def _end_as_killed() -> None:
    """The first atexit handler after a SIGTERM: run every other handler
    (weakref finalizers, the node cache's detach, ...), then die of SIGTERM."""
    global _exiting
    if not _terminated or _exiting:
        return
    _exiting = True
    atexit._run_exitfuncs()  # every other handler, once (we are skipped: _exiting)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _reset_in_child() -> None:
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def install_sigterm_exit() -> bool:
    """Make SIGTERM exit through the normal path; True if our handler is in place."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return True
    if current is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    if not _installed:
        _installed = True
        os.register_at_fork(after_in_child=_reset_in_child)
    return True
