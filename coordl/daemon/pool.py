"""The daemon's worker pools: starting, setting up, feeding, watching and
replacing the worker processes that prepare a group's samples.

:class:`WorkerPools` is the part of :class:`~coordl.daemon.hub.Hub` that
deals with its workers (the hub is one object driven by one thread; these
methods read and change its state as its other methods do); ``_Pool`` and
``_Worker`` are what it holds of them.

A group runs one code: the key includes the members' code identity
(:mod:`codeid`), and the group's samples are prepared only by the workers
of its *pool*: ``python -m coordl.daemon.worker`` processes on socket
pairs, started fresh for one (code identity, ``sys.path``, cache
directory), with the job's ``COORDL_SHM_DIR``, never given another pool's
group; each checks the code it imported against the members' identity
before it prepares anything.  A pool has as many workers as the largest
``num_workers`` among its members (at least 1, at most the CPUs this
process may use); a pool without groups keeps its workers (and node
caches) for the next run of that code, up to two such pools.  A worker
that dies fails its samples in flight (members prepare those themselves)
and is replaced; one that cannot set a group up is replaced too, and a
group no worker could set up is tried again at its members' next pass.

A worker that dies, or makes no progress on the samples in its hands
within ``COORDL_DAEMON_WORKER_STALL`` seconds (default 30; hung: it is
SIGKILLed), is replaced and its samples are prepared again by another worker
of its pool (once; a sample that takes down a second worker is failed, and
its members prepare it themselves).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from . import ipc
from .worker import HEADER, LAYOUT

if TYPE_CHECKING:
    from .hub import _GroupRes

_IN_FLIGHT = 16               # samples handed to one worker at a time (it reads ahead on them)


class _Pool:
    """The workers that run one code: the groups whose members' code
    identity, ``sys.path`` and cache directory are these.  Its workers are
    started fresh for it, import that code from that ``sys.path``, attach
    node caches in that directory, and never serve another pool's group."""

    def __init__(self, key: str, join: dict) -> None:
        self.key = key
        self.sys_path = list(join.get("sys_path") or [])
        self.shm_dir = join.get("shm_dir") or None
        self.workers: list[_Worker] = []
        self.gids: set[int] = set()
        self.used = 0          # when a group last joined it (a counter): idle pools retire oldest first


def _pool_key(join: dict) -> str:
    import hashlib
    import json

    return hashlib.blake2b(json.dumps([str(join.get("code")), join.get("shm_dir"), join.get("sys_path")]).encode(),
                           digest_size=16).hexdigest()


class _Worker:
    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        env = dict(os.environ)
        if pool.shm_dir:    # node caches in the job's directory, not the one the daemon was started with
            env["COORDL_SHM_DIR"] = pool.shm_dir
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        mine.set_inheritable(False)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "coordl.daemon.worker", "--fd", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self.conn = ipc.Conn(mine, self.proc.pid)
        self.inflight: set[tuple[int, int]] = set()   # (gid, G) handed to it, not reported yet
        self.ready = False           # it said hello (imports done)
        self.setting_up = 0          # groups sent, not answered yet (unpickling, imports)
        self.progress_t = time.monotonic()   # last sign of progress: a message, or work handed to it idle

    def fileno(self) -> int:
        return self.conn.fileno()


class WorkerPools:
    """The :class:`~coordl.daemon.hub.Hub`'s worker pools (a base of ``Hub``:
    ``self`` is the hub, its ``groups``, ``pools``, ``workers`` and the
    ``_act``/``_break`` that carry out the group policy)."""

    def _grow(self, pool: _Pool) -> None:
        """As many workers in ``pool`` as the largest ``num_workers`` among
        its groups' members (at least 1, at most the CPUs)."""
        live = [gid for gid in pool.gids if not self.groups[gid].permanent]
        if not live:
            return
        n = max([m.num_workers for gid in live for m in self.groups[gid].group.members.values()] + [1])
        n = min(n, self.max_workers)
        while len(pool.workers) < n:
            w = _Worker(pool)
            pool.workers.append(w)
            self.workers.append(w)
            for gid in sorted(pool.gids):
                res = self.groups[gid]
                if not res.broken and res.failures < 2:   # else: at the group's next pass
                    self._setup(w, res)

    def _retire_idle(self, keep: int = 2) -> None:
        """Stop the workers of pools without groups beyond the ``keep`` used
        last (they hold their node caches warm for the next jobs of that
        code; a pool's workers never serve another code)."""
        idle = sorted((p for p in self.pools.values() if not p.gids), key=lambda p: p.used, reverse=True)
        for pool in idle[keep:]:
            del self.pools[pool.key]
            for w in list(pool.workers):
                self._retire(w)

    def _retire(self, w: _Worker) -> None:
        """Stop ``w`` (its samples in flight fail: members prepare them)."""
        if w not in self.workers:
            return
        try:
            w.conn.send({"op": "stop"}, timeout=1.0)
        except (OSError, ValueError):
            pass
        self._forget(w)

    def _setup(self, w: _Worker, res: _GroupRes) -> None:
        j = res.join
        res.pending.add(w)
        w.setting_up += 1
        self._wsend(w, {"op": "group", "gid": res.group.gid, "seed": j["seed"], "plan": j["plan"],
                        "sys_path": j.get("sys_path"), "cache": j.get("cache"), "stride": res.stride,
                        "slots": res.group.nslots,
                        "digest": j["digest"], "peers": j.get("peers"), "code": j.get("code"),
                        "code_desc": j.get("code_desc"), "layout": j.get("layout")},
                   fds=[res.dataset_fd, res.staging_fd])

    def _wsend(self, w: _Worker, msg: dict, fds=()) -> bool:
        try:
            w.conn.queue(msg, fds)
            w.conn.write_ready()
            return True
        except (OSError, ValueError) as e:
            self.log(f"worker pid {w.proc.pid}: {e}")
            self.worker_gone(w)
            return False

    def worker_msg(self, w: _Worker, msg: dict, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        op = msg.get("op")
        w.progress_t = time.monotonic()
        res = self.groups.get(int(msg.get("gid", -1)))
        if op == "hello":
            w.ready = True
        elif op in ("group_ok", "group_failed"):
            w.setting_up = max(0, w.setting_up - 1)
        if op == "done":
            by_group: dict[int, list] = {}      # one set of deliveries per group and message
            for item in msg["items"]:
                gid, g = int(item["gid"]), int(item["g"])
                if (gid, g) not in w.inflight or gid not in self.groups:
                    continue
                w.inflight.discard((gid, g))
                by_group.setdefault(gid, []).append((g, bool(item.get("ok")), str(item.get("why", "")),
                                                     item.get("info")))
            for gid, results in by_group.items():
                res = self.groups.get(gid)
                if res is None:
                    continue
                self._act(res, res.group.done_many(results))
                for _g, _ok, why, _info in results:
                    if why.startswith(LAYOUT) and not res.broken:
                        self._variable_shapes(res, why[len(LAYOUT):])
        elif op == "group_ok" and res is not None and w in res.pending:
            res.pending.discard(w)
            res.ready.add(w)
            res.failures = 0
        elif op == "group_failed" and res is not None and w in res.pending:
            self._setup_failed(w, res, str(msg.get("why")), bool(msg.get("code")))

    def _setup_failed(self, w: _Worker, res: _GroupRes, why: str, code: bool) -> None:
        """A worker could not set a group up.  Other code than the members'
        is final for the group; anything else is the worker's: it is replaced
        (its imports may be half done), and after a second failure in a row
        the group waits for its members' next pass to be tried again."""
        res.pending.discard(w)
        pid = w.proc.pid
        self._retire(w)
        if code:
            self._break(res, why, permanent=True)
        else:
            res.failures += 1
            self.log(f"worker pid {pid} could not set up group {res.group.gid}: {why}")
            if res.failures >= 2 and not res.ready:
                self._break(res, f"the daemon's worker could not set this job's group up ({why}); this job "
                                 "prepares its own samples meanwhile and the daemon tries again at its next epoch",
                            permanent=False)
        self._grow(res.pool)

    def _forget(self, w: _Worker, why: str | None = None) -> None:
        """``w`` is gone or going (died, broke the protocol, hung, or
        retired): SIGKILL it, so it can write into no slot after this; its
        samples in flight go to another worker once, then to the members."""
        if w not in self.workers:
            return
        self.workers.remove(w)
        if w in w.pool.workers:
            w.pool.workers.remove(w)
        for res in self.groups.values():
            res.ready.discard(w)
            res.pending.discard(w)
        w.conn.close()
        if w.proc.poll() is None:
            w.proc.kill()
            try:
                w.proc.wait(timeout=1.0)    # a SIGKILLed process is gone in milliseconds, stopped or not
            except subprocess.TimeoutExpired:
                pass
        what = why or f"exited with {w.proc.returncode}"
        self.log(f"worker pid {w.proc.pid} {what}; {len(w.inflight)} samples in its hands go to another worker")
        for (gid, g) in sorted(w.inflight):
            res = self.groups.get(gid)
            if res is None:
                continue
            tries = res.retries[g] = res.retries.get(g, 0) + 1
            if tries <= 1 and w.proc.returncode is not None:
                res.group.requeue(g)
            else:   # it took down a second worker (or this one could not be reaped): its members prepare it
                self._act(res, res.group.done(g, False, f"the daemon's worker pid {w.proc.pid} {what}"))
        w.inflight.clear()

    def worker_gone(self, w: _Worker, why: str | None = None) -> None:
        """``w`` died, broke the protocol or hung: forget it, replace it."""
        if w not in self.workers:
            return
        setting_up = [res for res in self.groups.values() if w in res.pending]
        self._forget(w, why)
        for res in setting_up:   # died while setting a group up: a setup failure too (no endless respawns)
            res.failures += 1
            if res.failures >= 2 and not res.ready and not res.broken:
                self._break(res, f"the daemon's worker pid {w.proc.pid} died while setting this job's group up "
                                 f"(exit {w.proc.returncode}); this job prepares its own samples meanwhile and "
                                 "the daemon tries again at its next epoch", permanent=False)
        self._grow(w.pool)

    def check_workers(self) -> None:
        """Liveness by progress: a worker with samples in its hands that sent
        nothing for ``worker_stall`` seconds (``worker_start`` while it starts
        or loads a group) is hung, and replaced."""
        now = time.monotonic()
        for w in list(self.workers):
            if w.proc.poll() is not None:
                self.worker_gone(w)
                continue
            starting = not w.ready or w.setting_up > 0
            limit = self.worker_start if starting else self.worker_stall
            if (w.inflight or starting) and now - w.progress_t > limit:
                self.replaced += 1
                self.worker_gone(w, f"made no progress on its {len(w.inflight)} samples in {limit:g} s "
                                    "(hung): SIGKILLed and replaced")
        for pool in list(self.pools.values()):
            if pool.gids and not pool.workers:
                self._grow(pool)

    def paused(self, gap: float) -> None:
        """This process did not run for ``gap`` seconds (SIGSTOP, suspend):
        nobody could make progress meanwhile, so no clock runs on it."""
        for w in self.workers:
            w.progress_t += gap

    def _pump(self) -> None:
        if not self.workers:
            return
        batches: dict[tuple[int, int], list] = {}    # (worker index, gid) -> [[g, slot], ...]
        # each group's workers: its own pool's that set it up (or are setting it up: the
        # tasks follow the setup on the same socket); a group out of work or of room drops out
        live = [(res, [(k, w) for k, w in enumerate(self.workers) if w in res.ready or w in res.pending])
                for res in self.groups.values() if not res.broken]
        live = [x for x in live if x[1]]
        while live:    # one task per group per round, so groups sharing a pool take turns
            left = []
            for res, mine in live:
                if res.broken or self.groups.get(res.group.gid) is not res:
                    continue                 # broken or dropped by an action of this round
                k, w = min(mine, key=lambda kw: len(kw[1].inflight))
                if len(w.inflight) >= _IN_FLIGHT:
                    continue
                actions, task = res.group.next_task()
                self._act(res, actions)
                if task is None:
                    continue
                left.append((res, mine))
                g, slot = task
                base = slot * HEADER
                res.mm[base:base + 32] = b"\xff" * 32   # invalid until the worker's header lands
                if not w.inflight:
                    w.progress_t = time.monotonic()   # its clock starts with its work
                w.inflight.add((res.group.gid, g))
                batches.setdefault((k, res.group.gid), []).append([g, slot])
            live = left
        workers = list(self.workers)
        for (k, gid), tasks in batches.items():   # one message per worker and group
            if workers[k] in self.workers:
                self._wsend(workers[k], {"op": "prep", "gid": gid, "tasks": tasks})
