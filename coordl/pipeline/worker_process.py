"""What runs inside a worker process of coordl's pipeline (one per
``num_workers``): :func:`_worker_main` with its control reader thread and
:class:`~.engine.Engine`, the watch on the main process (a pidfd, polled;
never PR_SET_PDEATHSIG), and the worker's seeding as torch seeds its
workers.  The main process's side (:class:`~.workers.WorkerPool`) and the
message protocol are described in :mod:`.workers`.
"""
from __future__ import annotations

import os
import queue
import random
import select
import signal
import threading
import time
import traceback
from multiprocessing import reduction

import numpy as np
import torch

from .engine import Engine
from .slots import WorkerSlots

_POLL = 1.0

_ORPHAN_GRACE = 5.0  # seconds a worker whose parent died gives its main thread to stop


def _watch_parent(parent_pid: int):
    """A pidfd of the main process (readable once it has exited), or None
    where the kernel has no pidfds (then the parent is polled, as torch does).

    Not PR_SET_PDEATHSIG: that fires when the *thread* that started the
    worker exits (``iter(loader)`` in a setup thread), not the process."""
    try:
        fd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):
        return None
    try:  # the pid may already name another process if the parent died first
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        os.close(fd)
        return None
    return fd


def _readable(fds: list, timeout: float) -> list:
    """Which of ``fds`` are readable (or closed) within ``timeout`` seconds:
    poll, not select (select fails on descriptors past 1024)."""
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN)
    got = {fd for fd, ev in p.poll(timeout * 1000) if ev}
    return [fd for fd in fds if fd in got]


def _parent_gone(pidfd, parent_pid: int) -> bool:
    if pidfd is not None:
        return bool(_readable([pidfd], 0))
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _seed_worker(base_seed: int, w: int, dataset, num_workers: int) -> None:
    from torch.utils.data._utils import worker as tw

    seed = base_seed + w
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(tw._generate_state(base_seed, w))
    tw._worker_info = tw.WorkerInfo(id=w, num_workers=num_workers, seed=seed, dataset=dataset)


def _worker_main(w: int, num_workers: int, dataset, cfg: dict, ctrl, res, parent_pid: int, spares=()) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C
    pidfd = _watch_parent(parent_pid)
    torch.set_num_threads(1)
    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            res.send(msg)

    def announce(sid, gen, size, fd) -> None:
        with lock:
            res.send(("slot", sid, gen, size))
            reduction.send_handle(res, fd, parent_pid)

    def announce_spare(sid, gen, i) -> None:
        with lock:
            res.send(("spare", sid, gen, i))

    slots = WorkerSlots(announce, spares, announce_spare)
    engine = Engine(dataset, seed=cfg["seed"], on_error=cfg["on_error"], collate_fn=cfg["collate_fn"],
                    batch_size=cfg["batch_size"], prefetch=cfg["prefetch"],
                    fetch_threads=cfg["fetch_threads"], budget_bytes=cfg["budget"], slots=slots,
                    emit=lambda kind, k, *p: send((kind, engine.pass_id, k) + p), worker_id=w,
                    cache=cfg.get("cache"), peers=cfg.get("peers"),
                    collate_later=cfg.get("collate_later", False), pack=True)
    try:
        _seed_worker(cfg["base_seed"], w, dataset, num_workers)
        if cfg["worker_init_fn"] is not None:
            cfg["worker_init_fn"](w)
    except BaseException:
        send(("fatal", None, None, f"Caught an error in worker_init_fn in DataLoader worker process {w}.\n"
                                   f"Original {traceback.format_exc()}"))
        return

    q = engine.q

    def read_control() -> None:
        try:
            watch_control()
        except BaseException:  # report it: a dead control reader would hang the worker
            q.put(("ctl", ("died", f"the control thread of DataLoader worker process {w} died "
                                   f"receiving a message from the main process.\n"
                                   f"Original {traceback.format_exc()}")))

    def watch_control() -> None:
        """Control messages -> the event queue.  Also watches the main
        process: when it is gone (pidfd readable, or EOF on the control pipe)
        the worker stops; if the main thread is stuck in user code it is
        given _ORPHAN_GRACE seconds, then the process exits."""
        try:
            watch = [ctrl.fileno()] + ([pidfd] if pidfd is not None else [])
            while True:
                ready = _readable(watch, _POLL)
                if (pidfd is not None and pidfd in ready) or (not ready and _parent_gone(pidfd, parent_pid)):
                    from ..cache import mark_orphaned
                    mark_orphaned()  # the node cache stays for a restart to adopt
                    break
                if ctrl.fileno() in ready:
                    q.put(("ctl", ctrl.recv()))
        except (EOFError, OSError):
            pass
        q.put(("ctl", ("stop",)))
        time.sleep(_ORPHAN_GRACE)
        os._exit(0)

    threading.Thread(target=read_control, name="coordl-control", daemon=True).start()
    try:
        while True:
            ev = engine.next_event()
            while True:
                if type(ev) is tuple:
                    msg = ev[1]
                    op = msg[0]
                    if op == "stop":
                        engine.end_pass()
                        return
                    if op == "died":
                        raise _Died(msg[1])
                    if op == "pass":
                        _, pass_id, plan, epoch, start, skip = msg
                        engine.begin_pass(pass_id, plan, epoch, start, num_workers, w, skip)
                    elif op == "consumed":
                        if msg[1] == engine.pass_id:
                            engine.on_consumed(msg[2])
                    elif op == "free":
                        slots.release((msg[1], msg[2]))
                    elif op == "retire":   # a forked child of main may still view it
                        slots.retire((msg[1], msg[2]))
                    elif op == "stats":
                        send(("stats", None, w, _worker_stats(slots, engine)))
                else:
                    engine.on_fetched(ev)
                try:
                    ev = q.get_nowait()
                except queue.Empty:
                    break
            engine.pump(interrupt=lambda: not q.empty())
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return  # the main process went away
    except BaseException as e:  # this thread (the worker's prep thread) is dying: report what it did
        if isinstance(e, _Died):
            text = str(e)
        else:
            text = (f"DataLoader worker process {w} failed while {engine.doing()}: "
                    f"{type(e).__name__}: {e}\nOriginal {traceback.format_exc()}")
        try:
            send(("fatal", None, w, text))
        except BaseException:
            pass  # main then sees the exit code
        engine.end_pass()


class _Died(Exception):
    """A worker thread died; the text says which and why."""


def _worker_stats(slots, engine) -> dict:
    """What a worker holds, for tests and debugging (``WorkerPool.worker_stats``)."""
    f = engine.fetcher
    return {"slots": slots.count, "slot_bytes": slots.nbytes, "free_slots": len(slots._free),
            "read_ahead_bytes": f.held_bytes if f is not None else 0,
            "fetch_threads": f.threads if f is not None else 0,   # started this pass
            "batch_reads": engine._batches is not None,           # coordl.pipeline.device_batches
            "threads": sorted(t.name for t in threading.enumerate())}
