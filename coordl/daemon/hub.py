"""The daemon's state: groups of jobs, their staging memory, the worker pool,
and the messages that move samples between them.  Driven by the serve loop
in ``server.py`` (one thread: every event comes through one poller; every
send here is queued on the connection and goes out as its socket takes it,
so nothing here waits on a member or a worker).

Members (jobs with ``share=True``) speak JSON frames (:mod:`ipc`)::

    join  {key, name, num_workers, seed, plan, sys_path, cache, stride,
           digest, samples_per_epoch}  + [pickled dataset memfd]
          -> {op: joined, gid, slots, stride} + [staging memfd]
    pass  {epoch, start, end}          a pass over global positions [start, end)
    step  {pos, release, want, shared, self}
          -> {op: ready, items: [[G, slot, ok, info|why], ...]}  (as they are prepared)
          -> {op: detach, why}          (fell behind the staging bound, or the group broke)
    end   {}                            the pass is over

A group is keyed by what decides a prepared sample: the dataset's
fingerprint and pickled identity (transforms included), the seed, shuffle
and rank partition, and the sample layout.  The policy (what to keep, whom
to detach) is in :mod:`groups`; this module only carries it out.

Workers are ``python -m coordl.daemon.worker`` processes on a socket pair.
As many as the largest ``num_workers`` among the members (at least 1, at
most the CPUs this process may use); the pool only grows while the daemon
runs.  A worker that dies, or makes no progress on the samples in its hands
within ``COORDL_DAEMON_WORKER_STALL`` seconds (default 30; hung: it is
SIGKILLed), is replaced and its samples are prepared again by another worker
(once; a sample that takes down a second worker is failed, and its members
prepare it themselves).
"""
from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import time

from . import ipc
from .groups import Group, Member

__all__ = ["Hub", "DEFAULT_STAGING"]

DEFAULT_STAGING = 512 << 20   # bytes of staging per group (touched only as it is used)
_IN_FLIGHT = 8                # samples handed to one worker at a time (it reads ahead on them)
_DELIVER_BATCH = 32           # ready samples a member gets in one message unless it waits for one
_MAX_STRIDE = 1 << 30         # bytes of one staged sample, at most


def _env_seconds(name: str, default: float) -> float:
    from .server import _env_seconds as f

    return f(name, default)


def _pos(x, what: str) -> int:
    """A global position from a member: a non-negative int, nothing else."""
    if type(x) is not int or x < 0:
        raise ValueError(f"{what} should be a non-negative integer, but got {what}={x!r}")
    return x


def _positions(xs, what: str) -> list[int]:
    if xs is None:
        return []
    if not isinstance(xs, list):
        raise ValueError(f"{what} should be a list of positions, but got {type(xs).__name__}")
    return [_pos(x, what) for x in xs]


class _Worker:
    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        mine.set_inheritable(False)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "coordl.daemon.worker", "--fd", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = ipc.Conn(mine, self.proc.pid)
        self.inflight: set[tuple[int, int]] = set()   # (gid, G) handed to it, not reported yet
        self.ready = False           # it said hello (imports done)
        self.setting_up = 0          # groups sent, not answered yet (unpickling, imports)
        self.progress_t = time.monotonic()   # last sign of progress: a message, or work handed to it idle

    def fileno(self) -> int:
        return self.conn.fileno()


class _GroupRes:
    """The kernel objects of one group: the dataset pickle and the staging memfd."""

    def __init__(self, group: Group, join: dict, dataset_fd: int, stride: int) -> None:
        self.group = group
        self.join = join
        self.dataset_fd = dataset_fd
        self.stride = stride
        self.staging_fd = os.memfd_create(f"coordl-staging-{group.gid}", os.MFD_CLOEXEC)
        try:
            os.fchmod(self.staging_fd, 0o600)
            size = group.nslots * stride
            os.ftruncate(self.staging_fd, size)
            self.mm = mmap.mmap(self.staging_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:   # a join that fails here leaves nothing behind (the caller closes dataset_fd)
            os.close(self.staging_fd)
            raise
        self.broken: str | None = None
        self.workers_ready: set[int] = set()
        self.retries: dict[int, int] = {}    # G -> times a worker died or hung with it

    def close(self) -> None:
        self.mm.close()
        os.close(self.staging_fd)
        os.close(self.dataset_fd)


class Hub:
    def __init__(self, staging_bytes: int = DEFAULT_STAGING, log=None) -> None:
        self.staging_bytes = staging_bytes
        self.log = log or (lambda s: print(f"coordl daemon: {s}", file=sys.stderr, flush=True))
        self.groups: dict[int, _GroupRes] = {}
        self.by_key: dict[str, int] = {}
        self.members: dict[int, tuple[ipc.Conn, Member, int | None]] = {}   # conn fd -> ...
        self.workers: list[_Worker] = []
        self._next_gid = 1
        self._next_mid = 1
        self._conn_by_mid: dict[int, ipc.Conn] = {}
        self._outbox: dict[int, tuple] = {}   # conn fd -> (conn, [ready items]) until flush()
        self.peer_servers: dict[int, tuple] = {}   # conn fd -> (PeerServer, NodeCache, job pid)
        self.worker_stall = _env_seconds("COORDL_DAEMON_WORKER_STALL", 30.0)
        self.worker_start = _env_seconds("COORDL_DAEMON_WORKER_START", 120.0)
        self.replaced = 0                          # workers replaced for making no progress
        try:
            self.max_workers = max(1, len(os.sched_getaffinity(0)))
        except AttributeError:
            self.max_workers = max(1, os.cpu_count() or 1)

    # ------------------------------------------------------------------ select
    def is_worker(self, conn) -> _Worker | None:
        for w in self.workers:
            if w.conn is conn:
                return w
        return None

    # ------------------------------------------------------------------ members
    def member_msg(self, conn: ipc.Conn, msg: dict, fds: list[int]) -> None:
        op = msg.get("op")
        entry = self.members.get(conn.fileno())
        if op == "join":
            self._join(conn, msg, fds)
            return
        for fd in fds:
            os.close(fd)
        if op == "peer_serve":
            self._peer_serve(conn, msg)
            return
        if entry is None:
            self._send(conn, {"op": "error", "why": f"unknown op {op!r} before join"})
            return
        _, m, gid = entry
        res = self.groups.get(gid)
        if res is None:
            return
        g = res.group
        if op == "pass":
            if res.broken:
                self._send(conn, {"op": "detach", "why": res.broken, "permanent": True})
                return
            epoch, start, end = _pos(msg["epoch"], "epoch"), _pos(msg["start"], "start"), _pos(msg["end"], "end")
            if end < start:
                raise ValueError(f"end should be >= start, but got start={start}, end={end}")
            self._act(res, g.begin_pass(m.mid, epoch, start, end))
        elif op == "step":
            pos = _pos(msg["pos"], "pos")
            release, want = _positions(msg.get("release"), "release"), _positions(msg.get("want"), "want")
            need = msg.get("need")
            need = None if need is None else _pos(need, "need")
            m.shared, m.self_prepared = int(msg.get("shared", m.shared)), int(msg.get("self", m.self_prepared))
            self._act(res, g.step(m.mid, pos, release, want, need))
        elif op == "end":
            m.shared, m.self_prepared = int(msg.get("shared", m.shared)), int(msg.get("self", m.self_prepared))
            self._act(res, g.end_pass(m.mid, complete=bool(msg.get("complete"))))
        else:
            self._send(conn, {"op": "error", "why": f"unknown op {op!r}"})

    def _join(self, conn: ipc.Conn, msg: dict, fds: list[int]) -> None:
        if len(fds) != 1 or conn.fileno() in self.members:
            for fd in fds:
                os.close(fd)
            self._send(conn, {"op": "refused", "why": "a join carries exactly one descriptor, once"})
            return
        dataset_fd = fds[0]
        try:   # a malformed join is refused before anything is created
            key, stride, n = str(msg["key"]), int(msg["stride"]), int(msg["samples_per_epoch"])
            nw = int(msg.get("num_workers", 0))
            for field in ("seed", "plan", "digest"):
                msg[field]
            if not 64 <= stride <= _MAX_STRIDE or n < 0:
                raise ValueError(f"stride {stride} or samples_per_epoch {n} out of range")
        except BaseException:
            os.close(dataset_fd)
            raise
        gid = self.by_key.get(key)
        if gid is None:
            gid = self._next_gid
            self._next_gid += 1
            nslots = max(16, min(1 << 16, self.staging_bytes // max(stride, 1)))
            group = Group(gid, key, nslots, n)
            try:
                res = _GroupRes(group, msg, dataset_fd, stride)
            except BaseException:
                os.close(dataset_fd)
                raise
            self.groups[gid] = res
            self.by_key[key] = gid
            for w in self.workers:
                self._setup(w, res)
        else:
            os.close(dataset_fd)   # the group already has one, identical by its key
            res = self.groups[gid]
        m = Member(self._next_mid, conn.peer_pid, str(msg.get("name", ""))[:200], nw)
        self._next_mid += 1
        res.group.add(m)
        self.members[conn.fileno()] = (conn, m, gid)
        self._conn_by_mid[m.mid] = conn
        self._grow(max(1, m.num_workers))
        self._send(conn, {"op": "joined", "gid": gid, "slots": res.group.nslots, "stride": res.stride},
                   fds=[res.staging_fd])

    def _peer_serve(self, conn: ipc.Conn, msg: dict) -> None:
        """Serve this node's cache to the job's other nodes (coordl.peers) for
        as long as ``conn`` (the job's node-lowest rank) stays connected."""
        from ..cache import NodeCache
        from ..peers.server import PeerServer

        if conn.fileno() in self.peer_servers:
            self._send(conn, {"op": "refused", "why": "this connection serves already"})
            return
        c = msg["cache"]
        secret = bytes.fromhex(msg["secret"])   # from a same-uid process (SO_PEERCRED-checked)
        try:
            cache = NodeCache.from_spec(c)
        except (OSError, ValueError, RuntimeError, MemoryError) as e:
            self._send(conn, {"op": "refused", "why": f"cannot attach the node cache: {e}"})
            return
        try:
            srv = PeerServer(cache, secret, str(msg["host"]), int(msg.get("port") or 0),
                             key=str(c["fingerprint"]))
        except (OSError, ValueError) as e:
            cache.close()
            self._send(conn, {"op": "refused", "why": f"cannot listen on {msg['host']}: {e}"})
            return
        self.peer_servers[conn.fileno()] = (srv, cache, conn.peer_pid)
        self.log(f"serving node cache {cache.name} to peers on {srv.address[0]}:{srv.address[1]} "
                 f"for pid {conn.peer_pid}")
        self._send(conn, {"op": "serving", "address": list(srv.address)})

    def _end_peer_serve(self, fd: int) -> None:
        entry = self.peer_servers.pop(fd, None)
        if entry is not None:
            srv, cache, _ = entry
            srv.close()
            cache.close()

    def member_gone(self, conn: ipc.Conn) -> None:
        self._end_peer_serve(conn.fileno())
        entry = self.members.pop(conn.fileno(), None)
        conn.close()
        if entry is None:
            return
        _, m, gid = entry
        self._conn_by_mid.pop(m.mid, None)
        res = self.groups.get(gid)
        if res is None:
            return
        res.group.remove(m.mid)
        if not res.group.members:
            self._drop(res)

    def _drop(self, res: _GroupRes) -> None:
        g = res.group
        del self.groups[g.gid]
        self.by_key.pop(g.key, None)
        for w in self.workers:
            w.inflight = {k for k in w.inflight if k[0] != g.gid}
            self._wsend(w, {"op": "drop", "gid": g.gid})
        res.close()

    def _send(self, conn: ipc.Conn, msg: dict, fds=()) -> bool:
        """Queue ``msg`` for ``conn``; it goes out as the socket takes it
        (the serve loop), so a member that does not read never holds us."""
        if conn.fileno() < 0:
            return False
        try:
            conn.queue(msg, fds)
            conn.write_ready()
            return True
        except (OSError, ValueError) as e:
            self.log(f"dropping member pid {conn.peer_pid}: {e}")
            self.member_gone(conn)
            return False

    reply = _send

    def progress_of(self, conn: ipc.Conn) -> dict:
        """For a member's ping: what of its requests is still open."""
        entry = self.members.get(conn.fileno())
        if entry is None:
            return {"member": False}
        m = entry[1]
        return {"member": True, "attached": m.attached, "waiting": len(m.want)}

    def _act(self, res: _GroupRes, actions) -> None:
        for a in actions:
            m = a[1]
            conn = self._conn_of(m)
            if conn is None:
                continue
            if a[0] == "deliver":
                items = self._outbox.setdefault(conn.fileno(), (conn, []))[1]
                for g in a[2]:
                    it = res.group.items[g]
                    if it.state == "ready":
                        items.append([g, it.slot, True, it.info])
                    else:
                        items.append([g, it.slot, False, it.why])
            elif a[0] == "detach":
                self._outbox.pop(conn.fileno(), None)   # its claims are revoked
                self._send(conn, {"op": "detach", "why": "fell further behind the group than its staging holds"})

    def flush(self) -> None:
        """Send gathered deliveries, one message per member: when the batch
        it waits for (everything below its ``need``) is complete, or once
        ``_DELIVER_BATCH`` have gathered, so a job wakes about once per
        batch, not once per sample."""
        keep = {}
        for fd, (conn, items) in self._outbox.items():
            if not items or conn.fileno() < 0:
                continue
            entry = self.members.get(fd)
            m = entry[1] if entry is not None else None
            # a member waiting for its batch is woken once, when the whole batch is here
            ready = m is None or (any(it[0] < m.need for it in items)
                                  and not any(w < m.need for w in m.want))
            if len(items) >= _DELIVER_BATCH or ready:
                self._send(conn, {"op": "ready", "items": items})
            else:
                keep[fd] = (conn, items)
        self._outbox = keep

    def _conn_of(self, m: Member):
        return self._conn_by_mid.get(m.mid)

    # ------------------------------------------------------------------ workers
    def _grow(self, n: int) -> None:
        n = min(n, self.max_workers)
        while len(self.workers) < n:
            w = _Worker()
            self.workers.append(w)
            for res in self.groups.values():
                self._setup(w, res)

    def _setup(self, w: _Worker, res: _GroupRes) -> None:
        j = res.join
        w.setting_up += 1
        self._wsend(w, {"op": "group", "gid": res.group.gid, "seed": j["seed"], "plan": j["plan"],
                        "sys_path": j.get("sys_path"), "cache": j.get("cache"), "stride": res.stride,
                        "digest": j["digest"], "peers": j.get("peers")}, fds=[res.dataset_fd, res.staging_fd])

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
            for item in msg["items"]:
                gid, g = int(item["gid"]), int(item["g"])
                res = self.groups.get(gid)
                if (gid, g) not in w.inflight or res is None:
                    continue
                w.inflight.discard((gid, g))
                self._act(res, res.group.done(g, bool(item.get("ok")), item.get("why", ""), item.get("info")))
        elif op == "group_failed" and res is not None:
            why = (f"the daemon could not load this dataset ({msg.get('why')}); prepare in the job "
                   "(define the dataset's classes in an importable module, not in __main__)")
            self.log(why)
            res.broken = why
            for conn, m, gid in list(self.members.values()):
                if gid == res.group.gid:
                    res.group.end_pass(m.mid)
                    self._send(conn, {"op": "detach", "why": why, "permanent": True})

    def worker_gone(self, w: _Worker, why: str | None = None) -> None:
        """``w`` died, broke the protocol or hung: it goes (SIGKILL, so it can
        write into no slot after this), its samples are handed to the others."""
        if w not in self.workers:
            return
        self.workers.remove(w)
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
        want = max([m.num_workers for _, m, _ in self.members.values()] + [1]) if self.members else 0
        self._grow(want)

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
        if self.members and not self.workers:
            self._grow(max([m.num_workers for _, m, _ in self.members.values()] + [1]))

    def paused(self, gap: float) -> None:
        """This process did not run for ``gap`` seconds (SIGSTOP, suspend):
        nobody could make progress meanwhile, so no clock runs on it."""
        for w in self.workers:
            w.progress_t += gap

    def pump(self) -> None:
        """Hand queued samples to workers with room, lowest position first;
        then send what was delivered."""
        try:
            self._pump()
        finally:
            self.flush()

    def _pump(self) -> None:
        if not self.workers:
            return
        batches: dict[tuple[int, int], list] = {}    # (worker index, gid) -> [[g, slot], ...]
        progress = True
        while progress:
            progress = False
            for res in list(self.groups.values()):
                if res.broken:
                    continue
                k = min(range(len(self.workers)), key=lambda k: len(self.workers[k].inflight))
                w = self.workers[k]
                if len(w.inflight) >= _IN_FLIGHT:
                    break
                actions, task = res.group.next_task()
                self._act(res, actions)
                if task is None:
                    continue
                g, slot = task
                base = slot * res.stride
                res.mm[base:base + 32] = b"\xff" * 32   # invalid until the worker's header lands
                if not w.inflight:
                    w.progress_t = time.monotonic()   # its clock starts with its work
                w.inflight.add((res.group.gid, g))
                batches.setdefault((k, res.group.gid), []).append([g, slot])
                progress = True
        workers = list(self.workers)
        for (k, gid), tasks in batches.items():   # one message per worker and group
            if workers[k] in self.workers:
                self._wsend(workers[k], {"op": "prep", "gid": gid, "tasks": tasks})

    def stop(self) -> None:
        for fd in list(self.peer_servers):
            self._end_peer_serve(fd)
        for w in list(self.workers):
            self._wsend(w, {"op": "stop"})
        deadline = time.monotonic() + 2.0
        for w in list(self.workers):
            while w.conn.pending_out and time.monotonic() < deadline:
                try:
                    if not w.conn.write_ready():
                        time.sleep(0.01)
                except OSError:
                    break
        for w in list(self.workers):
            try:
                w.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            w.conn.close()
        self.workers.clear()
        for conn, _, _ in list(self.members.values()):
            conn.close()
        self.members.clear()
        for res in list(self.groups.values()):
            res.close()
        self.groups.clear()

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        groups = []
        for res in self.groups.values():
            st = res.group.status()
            st["stride"] = res.stride
            st["staging_bytes"] = res.group.nslots * res.stride
            st["staged_bytes"] = (st["staged"] + st["preparing"]) * res.stride
            st["dataset"] = str(res.join.get("dataset", ""))[:200]
            st["broken"] = res.broken
            groups.append(st)
        peers = [{"address": list(srv.address), "cache": cache.name, "job_pid": pid,
                  "connections": srv.connections, "samples_served": srv.samples_served,
                  "bytes_served": srv.bytes_served, "absent": srv.absent}
                 for srv, cache, pid in self.peer_servers.values()]
        return {"groups": groups, "worker_pids": [w.proc.pid for w in self.workers], "peer_servers": peers,
                "workers_replaced": self.replaced,
                "staging_limit": self.staging_bytes, "caches": _caches()}


def _caches() -> list:
    try:
        from ..cache import list_caches

        return [{"name": c.name, "capacity": c.capacity, "filled": c.filled, "cached": c.cached,
                 "samples": c.samples, "holders": c.holders} for c in list_caches()]
    except Exception as e:  # the status must answer even if a cache is unreadable
        return [{"name": f"(unreadable: {e})", "capacity": 0, "filled": 0, "cached": 0, "samples": 0,
                 "holders": 0}]
