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
before it prepares anything.

A pool is the cores its jobs brought (:meth:`WorkerPools._targets`): the
sum of its members' ``num_workers`` (a member with ``num_workers=0``
counts as one: its main process would have prepared its samples), at most
``COORDL_DAEMON_MAX_WORKERS`` (default: the CPUs the daemon may use,
``os.sched_getaffinity``) over all pools with groups, shared in proportion
to what each brought.  It grows as jobs join; as they leave, workers beyond
it take no new samples and stop once the ones in their hands are done (a
worker is never stopped mid-task).  A pool without groups keeps its workers
(and node caches) for the next run of that code, up to two such pools.

A worker that dies is replaced; its samples in flight go to another worker
of its pool that has their group ready (once), else to the members, who
prepare them themselves.  One that cannot set a group up is replaced too,
and a group no worker could set up is tried again at its members' next pass.

Liveness by progress (:meth:`WorkerPools.check_workers`).  A member whose
batch has not moved (none of what it waits for came) for
``COORDL_DAEMON_WORKER_WAIT`` seconds (default 5) is overdue: a worker
holding part of that batch that reported no finished sample for as long
(each is reported within half a second) and is stopped (SIGSTOP, a
debugger) or used no CPU since and is not runnable is hung: SIGKILLed and
replaced, its samples going to another worker of the pool that has their
group ready, or to the members when there is none.  Then the member
prepares what it still waits for itself; a worker running a slow sample
goes on.  A group that lost its last ready worker is served the same way
until a replacement is ready.  Independently, a worker that makes no
progress at all on the samples in its hands for
``COORDL_DAEMON_WORKER_STALL`` seconds (default 30) is replaced.  A sample
that takes down a second worker is failed (its members prepare it).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from . import ipc
from .staging import GroupRes
from .worker import HEADER, LAYOUT


_IN_FLIGHT = 32               # samples handed to one worker at a time (it reads ahead on them; it reports
                              # them _DONE_BATCH at a time: a message per 16 samples each way)


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
        self.retiring = False        # beyond its pool's size: takes no new samples, stops once idle
        self.cpu: tuple | None = None    # (CPU seconds used or None, when): taken once a member waits on it
        self.hung_since: float | None = None   # replaced for no progress since then
        self._ps = None              # psutil's handle on it (CPU time, stopped or not)

    def fileno(self) -> int:
        return self.conn.fileno()

    def hung(self) -> bool:
        """Stopped (SIGSTOP, a debugger) or gone; or it used no CPU time
        since :attr:`cpu` was taken and is not runnable either (blocked:
        not a slow sample, nor one waiting for a busy machine's CPU).
        Unreadable counts as hung."""
        import psutil

        try:
            if self._ps is None:
                self._ps = psutil.Process(self.proc.pid)
            status = self._ps.status()
            if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE,
                          psutil.STATUS_DEAD):
                return True
            if status == psutil.STATUS_RUNNING:
                return False
            used = self.cpu_used()
        except (psutil.Error, OSError):
            return True
        return used is None or self.cpu is None or self.cpu[0] is None or used <= self.cpu[0]

    def cpu_used(self) -> float | None:
        """CPU seconds it has used (all its threads); None if unreadable."""
        import psutil

        try:
            if self._ps is None:
                self._ps = psutil.Process(self.proc.pid)
            t = self._ps.cpu_times()
            return t.user + t.system
        except (psutil.Error, OSError):
            return None


class WorkerPools:
    """The :class:`~coordl.daemon.hub.Hub`'s worker pools (a base of ``Hub``:
    ``self`` is the hub, its ``groups``, ``pools``, ``workers`` and the
    ``_act``/``_break`` that carry out the group policy)."""

    def _targets(self) -> dict[str, int]:
        """Each pool with groups: how many workers it runs.  What its
        members brought (the sum of their ``num_workers``, one for a member
        with none), all pools together at most :attr:`max_workers`, shared in
        proportion to what each brought (at least one each).  Pools without
        groups are left as they are (kept warm for the next run)."""
        brought = {}
        for key, pool in self.pools.items():
            n = self._brought(pool)
            if n:
                brought[key] = n
        total, cap = sum(brought.values()), self.max_workers
        if total <= cap:
            return brought
        return {key: max(1, n * cap // total) for key, n in brought.items()}

    def _brought(self, pool: _Pool) -> int:
        """Workers ``pool``'s members brought (0: no group to serve)."""
        live = [self.groups[gid] for gid in pool.gids if not self.groups[gid].permanent]
        if not live:
            return 0
        return max(1, sum(max(1, m.num_workers) for res in live for m in res.group.members.values()))

    def _resize(self) -> None:
        """Every pool with groups to its size (:meth:`_targets`): new workers
        are started (each is sent the pool's groups), or those beyond the
        size are retired, idle ones first; one with samples in its hands
        takes no more and stops when it has finished them."""
        for key, n in self._targets().items():
            pool = self.pools[key]
            active = [w for w in pool.workers if not w.retiring]
            for w in pool.workers:       # taking back one that retires is cheaper than starting one
                if w.retiring and len(active) < n:
                    w.retiring = False
                    active.append(w)
            while len(active) < n:
                w = _Worker(pool)
                pool.workers.append(w)
                self.workers.append(w)
                active.append(w)
                for gid in sorted(pool.gids):
                    res = self.groups[gid]
                    if not res.broken and res.failures < 2:   # else: at the group's next pass
                        self._setup(w, res)
            if len(active) > n:
                for w in sorted(active, key=lambda w: (len(w.inflight) + w.setting_up, w.ready))[:len(active) - n]:
                    w.retiring = True
        self._reap_retiring()

    def _reap_retiring(self) -> None:
        """Stop the retiring workers that have nothing in their hands."""
        for w in [w for w in self.workers if w.retiring and not w.inflight and not w.setting_up]:
            self._retire(w, "retired: its pool is larger than what its jobs brought")

    def _retire_idle(self, keep: int = 2) -> None:
        """Stop the workers of pools without groups beyond the ``keep`` used
        last (they hold their node caches warm for the next jobs of that
        code; a pool's workers never serve another code)."""
        idle = sorted((p for p in self.pools.values() if not p.gids), key=lambda p: p.used, reverse=True)
        for pool in idle[keep:]:
            del self.pools[pool.key]
            for w in list(pool.workers):
                self._retire(w)

    def _retire(self, w: _Worker, why: str | None = None) -> None:
        """Stop ``w`` (its samples in flight fail: members prepare them)."""
        if w not in self.workers:
            return
        try:
            w.conn.send({"op": "stop"}, timeout=1.0)
        except (OSError, ValueError):
            pass
        self._forget(w, why)

    def _setup(self, w: _Worker, res: GroupRes) -> None:
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
        w.cpu = None        # progress: a new span for hung() if a member waits on it again
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
            res.lost_at = None
        elif op == "group_failed" and res is not None and w in res.pending:
            self._setup_failed(w, res, str(msg.get("why")), bool(msg.get("code")))
        if w.retiring:
            self._reap_retiring()

    def _setup_failed(self, w: _Worker, res: GroupRes, why: str, code: bool) -> None:
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
        self._resize()

    def _forget(self, w: _Worker, why: str | None = None) -> None:
        """``w`` is gone or going (died, broke the protocol, hung, or
        retired): SIGKILL it, so it can write into no slot after this; its
        samples in flight go to another worker of the pool that has their
        group set up, once; to the members (who prepare them) when there is
        none, or when a sample takes down a second worker."""
        if w not in self.workers:
            return
        self.workers.remove(w)
        if w in w.pool.workers:
            w.pool.workers.remove(w)
        lost = w.hung_since if w.hung_since is not None else time.monotonic()
        for res in self.groups.values():
            if w in res.ready:
                res.ready.discard(w)
                if res.lost_at is None and not any(not x.retiring for x in res.ready):
                    res.lost_at = lost    # waiting members are served by themselves after worker_wait
            res.pending.discard(w)
        w.conn.close()
        if w.proc.poll() is None:
            w.proc.kill()
            try:
                w.proc.wait(timeout=1.0)    # a SIGKILLed process is gone in milliseconds, stopped or not
            except subprocess.TimeoutExpired:
                pass
        what = why or f"exited with {w.proc.returncode}"
        if w.inflight:
            self.log(f"worker pid {w.proc.pid} {what}; {len(w.inflight)} samples in its hands go to another "
                     "worker, or to the jobs")
        else:
            self.log(f"worker pid {w.proc.pid} {what}")
        for (gid, g) in sorted(w.inflight):
            res = self.groups.get(gid)
            if res is None:
                continue
            tries = res.retries[g] = res.retries.get(g, 0) + 1
            other = any(not x.retiring for x in res.ready)
            if tries <= 1 and w.proc.returncode is not None and other:
                res.group.requeue(g)
            else:   # no other worker can take it now, it took down a second worker, or this one could
                    # not be reaped: its members prepare it
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
        self._resize()

    def check_workers(self) -> None:
        """Liveness by progress (see the module's doc).  A worker with samples
        in its hands that reported nothing for ``worker_stall`` seconds
        (``worker_start`` while it starts or loads a group) is replaced.  A
        member that waited ``worker_wait`` seconds for its batch with none of
        it coming: a worker holding what it waits for that is hung is
        replaced, and the member prepares what it still waits for itself
        (so does every member of a group that lost its last ready worker
        ``worker_wait`` seconds ago, until one is ready)."""
        now = time.monotonic()
        for w in list(self.workers):
            if w.proc.poll() is not None:
                self.worker_gone(w)
                continue
            starting = not w.ready or w.setting_up > 0
            limit = self.worker_start if starting else self.worker_stall
            if (w.inflight or starting) and now - w.progress_t > limit:
                self.replaced += 1
                w.hung_since = w.progress_t    # (its members may have waited on it that long already)
                self.worker_gone(w, f"made no progress on its {len(w.inflight)} samples in {limit:g} s "
                                    "(hung): SIGKILLed and replaced")
                continue
            if w.cpu is None and w.inflight and now - w.progress_t >= min(1.0, self.worker_wait / 2):
                w.cpu = (w.cpu_used(), now)   # (a working worker reports at least every half second)
        waits = {}
        for res in list(self.groups.values()):
            if res.broken or self.groups.get(res.group.gid) is not res:
                continue
            if res.lost_at is not None and now - res.lost_at > self.worker_wait:
                self._excuse(res, self._waiting(res), "the daemon's workers for this group are starting")
                continue
            if not res.ready:
                continue      # its first workers start (COORDL_DAEMON_WORKER_START): waited for, as a job's own
            for m in list(res.group.members.values()):
                if not (m.attached and m.short):
                    continue
                key, mark = (res.group.gid, m.mid), (m.need, m.short)
                since = self._waits.get(key)
                if since is None or since[0] != mark:    # it began waiting, or some of its batch came
                    waits[key] = (mark, now)
                elif now - since[1] <= self.worker_wait:
                    waits[key] = since
                else:
                    self._overdue(res, m, now)
        self._waits = waits
        for pool in list(self.pools.values()):
            if pool.gids and not pool.workers:
                self._resize()

    def _overdue(self, res: GroupRes, m, now: float) -> None:
        """Member ``m`` waited ``worker_wait`` seconds and none of its batch
        came: a worker holding some of it that made no progress as long and
        is hung (:meth:`_Worker.hung`) is replaced; what ``m`` still waits
        for it prepares itself (a worker that has some of it keeps it)."""
        gs = [g for g in m.want if m.pos <= g < m.need]
        gid = res.group.gid
        for w in [w for w in res.pool.workers if any((gid, g) in w.inflight for g in gs)]:
            starting = not w.ready or w.setting_up > 0     # (judged by worker_start)
            if not starting and now - w.progress_t > self.worker_wait and w.hung():
                self.replaced += 1
                w.hung_since = w.progress_t
                self.worker_gone(w, f"made no progress for {now - w.progress_t:.1f} s on samples a job waits "
                                    "for, and is stopped or runs nothing (hung): SIGKILLed and replaced")
        if self.groups.get(gid) is res and not res.broken:
            self._excuse(res, [g for g in gs if g in m.want],
                         f"the daemon made no progress on it for {self.worker_wait:g} s")

    @staticmethod
    def _waiting(res: GroupRes) -> list[int]:
        """What ``res``'s members wait for now."""
        return sorted({g for m in res.group.members.values() if m.attached and m.short
                       for g in m.want if m.pos <= g < m.need})

    def _excuse(self, res: GroupRes, gs, why: str) -> None:
        """The members waiting for ``gs`` prepare them themselves: each gets
        them as failed items (``[G, slot or -1, False, why]``).  A worker
        that has one keeps its slot and finishes it for whoever wants it
        then (it is never freed under a worker)."""
        if not gs:
            return
        for m, got in res.group.excuse(gs):
            conn = self._conn_of(m)
            if conn is None:
                continue
            fd = conn.fileno()
            items = self._outbox.setdefault(fd, (conn, []))[1]
            self._stirred.add(fd)
            for g in got:
                it = res.group.items.get(g)
                items.append([g, it.slot if it is not None else -1, False, why])

    def paused(self, gap: float) -> None:
        """This process did not run for ``gap`` seconds (SIGSTOP, suspend):
        nobody could make progress meanwhile, so no clock runs on it."""
        for w in self.workers:
            w.progress_t += gap
            w.cpu = None
        for res in self.groups.values():
            if res.lost_at is not None:
                res.lost_at += gap
        self._waits = {k: (mark, t + gap) for k, (mark, t) in self._waits.items()}

    def _pump(self) -> None:
        if not self.workers:
            return
        batches: dict[tuple[int, int], list] = {}    # (worker index, gid) -> [[g, slot], ...]
        # each group's workers: its own pool's that set it up (or are setting it up: the
        # tasks follow the setup on the same socket); a group out of work or of room drops out
        # (to workers still setting it up only while none has: a replacement that starts
        # would hold them for seconds while the others are idle)
        live = []
        for res in self.groups.values():
            if not res.broken:
                mine = [(k, w) for k, w in enumerate(self.workers) if w in res.ready and not w.retiring]
                live.append((res, mine or [(k, w) for k, w in enumerate(self.workers)
                                           if w in res.pending and not w.retiring]))
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
