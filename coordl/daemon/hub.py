"""The daemon's state: groups of jobs, their staging memory, the worker pool,
and the messages that move samples between them.  Driven by the serve loop
in ``server.py`` (one thread: every event comes through one poller; every
send here is queued on the connection and goes out as its socket takes it,
so nothing here waits on a member or a worker).

Members (jobs with ``share=True``) speak JSON frames (:mod:`ipc`)::

    join  {key, name, num_workers, seed, plan, sys_path, cache, stride,
           digest, samples_per_epoch}  + [pickled dataset memfd]
          -> {op: joined, gid, slots, stride} + [staging memfd]
    pass  {pass, epoch, start, end}    pass number ``pass`` over global positions [start, end)
    step  {pass, pos, need, release, unpin, want, shared, self, pin?: [lo, hi]}
          -> {op: ready, pass, items: [[G, slot, ok, info|why, pinned], ...], pins?: [[G, slot], ...]}
             (as they are prepared)
          -> {op: detach, pass, why}    (fell behind the staging bound, or the group broke)
    end   {pass, complete, release, unpin}   the pass is over
    release {pass, release, unpin}      claims and pins the job no longer uses

``pin`` asks that what the member is given of positions [lo, hi) is never
revoked until it gives the pin back (or its connection closes): it hands
out batches that are views of those slots (zero-copy).  Pins are counted
(groups.py): each item delivered says whether it pinned, ``pins`` lists the
claims of the range that became pins, and ``unpin`` gives back one pin per
position listed.  ``release`` gives back claims (of the member's current
pass only; the others ended with it).  Everything sent for a pass is tagged
with the job's number for it: when a pass ends (or the next begins), what
was gathered for it and not sent yet is dropped and its pins given back
here, since the job will never hear of them; whatever the job reads for a
pass that is over, it gives back.

A group is keyed by what decides a prepared sample: the dataset's
fingerprint and pickled identity (transforms included), the seed, shuffle
and rank partition, and the sample layout.  The policy (what to keep, whom
to detach) is in :mod:`groups`; this module only carries it out.

The worker pools (which processes prepare a group's samples, and how a
dead or hung one is replaced) are in :mod:`pool`: ``Hub`` is a
:class:`~coordl.daemon.pool.WorkerPools`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from ..base.units import env_seconds as _env_seconds
from . import ipc
from .groups import Group, Member
from .pool import WorkerPools, _Pool, _pool_key, _Worker
from .staging import GroupRes

__all__ = ["Hub", "DEFAULT_STAGING"]

DEFAULT_STAGING = 512 << 20   # bytes of staging per group (touched only as it is used)
_DELIVER_BATCH = 512          # ready samples a member gets in one message unless its batch is complete first
_COMPACT_BYTES = 128 << 20   # staging a run of positions walks through before it turns back (groups.py)
_MAX_STRIDE = 1 << 30         # bytes of one staged sample, at most


def _max_workers() -> int:
    """Daemon workers of all pools together, at most: ``COORDL_DAEMON_MAX_WORKERS``,
    else the CPUs this process may use."""
    v = os.environ.get("COORDL_DAEMON_MAX_WORKERS")
    if v:
        try:
            n = int(v)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"COORDL_DAEMON_MAX_WORKERS should be a whole number >= 1, but got "
                             f"COORDL_DAEMON_MAX_WORKERS={v!r}")
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


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
    if all(type(x) is int for x in xs) and (not xs or min(xs) >= 0):
        return xs      # (the common case, checked at C speed)
    return [_pos(x, what) for x in xs]


class Hub(WorkerPools):
    def __init__(self, staging_bytes: int = DEFAULT_STAGING, log=None) -> None:
        self.staging_bytes = staging_bytes
        self.log = log or (lambda s: print(f"coordl daemon: {s}", file=sys.stderr, flush=True))
        self.groups: dict[int, GroupRes] = {}
        self.by_key: dict[str, int] = {}
        self.members: dict[int, tuple[ipc.Conn, Member, int | None]] = {}   # conn fd -> ...
        self.workers: list[_Worker] = []      # every pool's (the serve loop waits on them)
        self.pools: dict[str, _Pool] = {}
        self._pool_uses = 0
        self._next_gid = 1
        self._next_mid = 1
        self._conn_by_mid: dict[int, ipc.Conn] = {}
        self._outbox: dict[int, tuple] = {}   # conn fd -> (conn, [ready items]) until flush()
        self._stirred: set[int] = set()        # conn fds whose member's wait may have ended since flush()
        self._pins: dict[int, list] = {}      # conn fd -> [[G, slot], ...] claims pinned, to tell it at flush()
        self._waits: dict[tuple, tuple] = {}  # (gid, mid) -> ((need, short), since when) of a waiting member
        self.peer_servers: dict[int, tuple] = {}   # conn fd -> (PeerServer, NodeCache, job pid)
        self.worker_stall = _env_seconds("COORDL_DAEMON_WORKER_STALL", 30.0)
        self.worker_start = _env_seconds("COORDL_DAEMON_WORKER_START", 120.0)
        self.worker_wait = _env_seconds("COORDL_DAEMON_WORKER_WAIT", 5.0)
        self.replaced = 0                          # workers replaced for making no progress
        self.max_workers = _max_workers()

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
        self._stirred.add(conn.fileno())   # its wait may end with what it says (flush() looks)
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
        pid = msg.get("pass")
        ours = pid is None or _pos(pid, "pass") == m.pass_id   # of its current pass (else one that is over)
        if op == "pass":
            epoch, start, end = _pos(msg["epoch"], "epoch"), _pos(msg["start"], "start"), _pos(msg["end"], "end")
            if end < start:
                raise ValueError(f"end should be >= start, but got start={start}, end={end}")
            self._drop_unsent(conn, m, g)     # of its last pass
            m.pass_id = pid if pid is not None else m.pass_id + 1
            if res.broken and res.permanent:
                self._send(conn, {"op": "detach", "pass": m.pass_id, "why": res.broken, "permanent": True})
                return
            if res.broken and epoch <= res.broken_at:   # not in the epoch it failed in
                self._send(conn, {"op": "detach", "pass": m.pass_id, "why": res.broken, "permanent": False,
                                  "warn": True})
                return
            if res.broken or res.failures >= 2:   # a failed group is retried at its members' next epoch
                self.log(f"group {g.gid}: trying again (it failed: {res.broken or 'a worker setup'})")
                res.broken, res.failures = None, 0
                self._resize()
                for w in res.pool.workers:
                    if w not in res.ready and w not in res.pending:
                        self._setup(w, res)
            self._act(res, g.begin_pass(m.mid, epoch, start, end))
        elif op == "step":
            pos = _pos(msg["pos"], "pos")
            release, want = _positions(msg.get("release"), "release"), _positions(msg.get("want"), "want")
            need = msg.get("need")
            need = None if need is None else _pos(need, "need")
            pin = msg.get("pin")
            if pin is not None:
                pin = _positions(pin, "pin")
                if len(pin) != 2:
                    raise ValueError(f"pin should be [lo, hi], but got {pin!r}")
            unpin = _positions(msg.get("unpin"), "unpin")
            m.shared, m.self_prepared = int(msg.get("shared", m.shared)), int(msg.get("self", m.self_prepared))
            if ours:
                self._act(res, g.step(m.mid, pos, release, want, need, pin, unpin))
            else:
                g.unpin(m.mid, unpin)
        elif op == "end":
            m.shared, m.self_prepared = int(msg.get("shared", m.shared)), int(msg.get("self", m.self_prepared))
            g.release(m.mid, _positions(msg.get("release"), "release") if ours else (),
                      _positions(msg.get("unpin"), "unpin"))
            if ours:
                self._drop_unsent(conn, m, g)
                self._act(res, g.end_pass(m.mid, complete=bool(msg.get("complete"))))
        elif op == "release":    # claims and pins it no longer uses (views gone, a pass left)
            g.release(m.mid, _positions(msg.get("release"), "release") if ours else (),
                      _positions(msg.get("unpin"), "unpin"))
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
            group = Group(gid, key, nslots, n, compact=max(256, _COMPACT_BYTES // stride))
            try:
                res = GroupRes(group, msg, dataset_fd, stride)
            except BaseException:
                os.close(dataset_fd)
                raise
            self.groups[gid] = res
            self.by_key[key] = gid
            pk = _pool_key(msg)
            pool = self.pools.get(pk)
            if pool is None:
                pool = self.pools[pk] = _Pool(pk, msg)
            self._pool_uses += 1
            pool.used = self._pool_uses
            pool.gids.add(gid)
            res.pool = pool
            for w in pool.workers:
                self._setup(w, res)
        else:
            os.close(dataset_fd)   # the group already has one, identical by its key
            res = self.groups[gid]
        m = Member(self._next_mid, conn.peer_pid, str(msg.get("name", ""))[:200], nw)
        self._next_mid += 1
        res.group.add(m)
        self.members[conn.fileno()] = (conn, m, gid)
        self._conn_by_mid[m.mid] = conn
        self._resize()
        self._retire_idle()
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
        try:   # in the job's cache directory (the daemon may have been started with another)
            cache = in_shm_dir(c.get("shm_dir"), lambda: NodeCache.from_spec(c))
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
        cache._coordl_shm_dir = c.get("shm_dir")   # where it is released too
        self.peer_servers[conn.fileno()] = (srv, cache, conn.peer_pid)
        self.log(f"serving node cache {cache.name} to peers on {srv.address[0]}:{srv.address[1]} "
                 f"for pid {conn.peer_pid}")
        self._send(conn, {"op": "serving", "address": list(srv.address)})

    def _end_peer_serve(self, fd: int) -> None:
        entry = self.peer_servers.pop(fd, None)
        if entry is not None:
            srv, cache, _ = entry
            srv.close()
            in_shm_dir(getattr(cache, "_coordl_shm_dir", None), cache.close)

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
        self._resize()    # what it brought leaves with it

    def _drop(self, res: GroupRes) -> None:
        g = res.group
        del self.groups[g.gid]
        self.by_key.pop(g.key, None)
        res.pool.gids.discard(g.gid)
        for w in list(res.pool.workers):
            w.inflight = {k for k in w.inflight if k[0] != g.gid}
            self._wsend(w, {"op": "drop", "gid": g.gid})
        res.close()
        self._retire_idle()

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

    def _act(self, res: GroupRes, actions) -> None:
        staged = res.group.items
        for a in actions:
            m = a[1]
            conn = self._conn_of(m)
            if conn is None:
                continue
            fd = conn.fileno()
            if a[0] == "deliver":
                items = self._outbox.setdefault(fd, (conn, []))[1]
                self._stirred.add(fd)
                for g, pinned in zip(a[2], a[3]):
                    it = staged[g]
                    if it.state == "ready":
                        items.append([g, it.slot, True, it.info, pinned])
                    else:
                        items.append([g, it.slot, False, it.why, pinned])
            elif a[0] == "pinned":   # told with its next delivery (alone if it waits for none)
                if a[3]:
                    self._outbox.setdefault(fd, (conn, []))
                    self._pins.setdefault(fd, []).extend([g, staged[g].slot] for g in a[3])
            elif a[0] == "detach":
                self._drop_unsent(conn, m, res.group)   # its claims are revoked (not its pins)
                why = res.broken or "fell further behind the group than its staging holds"
                self._send(conn, {"op": "detach", "pass": m.pass_id, "why": why,
                                  **({"permanent": res.permanent, "warn": True} if res.broken else {})})

    def flush(self) -> None:
        """Send gathered deliveries, one message per member: when the batch
        it waits for (everything below its ``need``) is complete, or once
        ``_DELIVER_BATCH`` have gathered, so a job wakes about once per
        batch, not once per sample."""
        keep = {}
        pins, self._pins = self._pins, {}
        stirred, self._stirred = self._stirred, set()
        for fd, (conn, items) in self._outbox.items():
            pin = pins.get(fd)
            if (not items and pin is None) or conn.fileno() < 0:
                continue
            if pin is None and fd not in stirred:
                keep[fd] = (conn, items)   # nothing came for it and it asked nothing: still waiting
                continue
            entry = self.members.get(fd)
            m = entry[1] if entry is not None else None
            # a member waiting for its batch is woken once, when the whole batch is here
            # (m.short: what it still waits for of that batch, counted by the group); a pin's
            # answer goes with that message, alone only to a member that waits for nothing
            ready = m is None or (any(it[0] < m.need for it in items) and not m.short)
            if len(items) >= _DELIVER_BATCH or ready or (pin is not None and not m.short):
                msg = {"op": "ready", "pass": m.pass_id if m is not None else 0, "items": items}
                if pin is not None:
                    msg["pins"] = pin
                self._send(conn, msg)
            else:
                keep[fd] = (conn, items)
                if pin is not None:
                    self._pins[fd] = pin
        self._outbox = keep

    def _conn_of(self, m: Member):
        return self._conn_by_mid.get(m.mid)

    def _drop_unsent(self, conn: ipc.Conn, m: Member, g: Group) -> None:
        """What was gathered for ``m``'s pass and not sent is dropped (its pass
        is over, or it was detached): the pins among it are given back here,
        since the job will never hear of them."""
        fd = conn.fileno()
        entry = self._outbox.pop(fd, None)
        unsent = [it[0] for it in entry[1] if it[4]] if entry is not None else []
        unsent += [x[0] for x in self._pins.pop(fd, ())]
        if unsent:
            g.unpin(m.mid, unsent)

    # ------------------------------------------------------------------ broken groups, pump, stop
    def _break(self, res: GroupRes, why: str, permanent: bool) -> None:
        """Every member of ``res`` leaves the stream (``permanent``: for good)
        and prepares for itself, told ``why``."""
        self.log(f"group {res.group.gid}: {why}")
        res.broken, res.permanent = why, permanent
        res.broken_at = max([m.epoch for m in res.group.members.values()] + [-1])
        for conn, m, gid in list(self.members.values()):
            if gid == res.group.gid:
                self._drop_unsent(conn, m, res.group)
                res.group.end_pass(m.mid)
                self._send(conn, {"op": "detach", "pass": m.pass_id, "why": why, "permanent": permanent,
                                  "warn": True})

    def _variable_shapes(self, res: GroupRes, detail: str) -> None:
        """Staging holds samples of one layout: a dataset whose samples differ
        in shape cannot be shared, so the daemon stops preparing them."""
        self._break(res, f"this dataset's samples differ in shape, dtype or structure ({detail}), so the daemon "
                         "cannot stage them for sharing; to share, make every sample the same shape (e.g. a "
                         "fixed-size crop or resize)", permanent=True)

    def pump(self) -> None:
        """Hand queued samples to workers with room, lowest position first;
        then send what was delivered."""
        try:
            self._pump()
        finally:
            self.flush()

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
        self.pools.clear()
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
            st["code"] = str(res.join.get("code", ""))[:16]
            st["worker_pids"] = [w.proc.pid for w in res.pool.workers] if res.pool else []
            groups.append(st)
        peers = [{"address": list(srv.address), "cache": cache.name, "job_pid": pid,
                  "connections": srv.connections, "samples_served": srv.samples_served,
                  "bytes_served": srv.bytes_served, "absent": srv.absent}
                 for srv, cache, pid in self.peer_servers.values()]
        targets = self._targets()
        pools = [{"groups": sorted(p.gids), "brought": self._brought(p), "target": targets.get(p.key),
                  "workers": [{"pid": w.proc.pid, "ready": w.ready, "samples": len(w.inflight),
                               "retiring": w.retiring} for w in p.workers]}
                 for p in self.pools.values()]
        return {"groups": groups, "worker_pids": [w.proc.pid for w in self.workers], "peer_servers": peers,
                "pools": pools, "max_workers": self.max_workers,
                "workers_replaced": self.replaced, "staging_limit": self.staging_bytes,
                "caches": _caches([None] + [p.shm_dir for p in self.pools.values()])}


def in_shm_dir(shm_dir, fn):
    """``fn()`` with node caches in ``shm_dir`` (a job's ``COORDL_SHM_DIR``)
    rather than the daemon's own.  The serve loop is the only thread that
    attaches or detaches caches in the daemon, so the variable is swapped
    around the call."""
    from ..cache import shm_root

    if not shm_dir or shm_dir == shm_root():
        return fn()
    old = os.environ.get("COORDL_SHM_DIR")
    os.environ["COORDL_SHM_DIR"] = shm_dir
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("COORDL_SHM_DIR", None)
        else:
            os.environ["COORDL_SHM_DIR"] = old


def _caches(dirs) -> list:
    from ..cache import list_caches, shm_root

    out, seen = [], set()
    for d in dirs:
        d = d or shm_root()
        if d in seen:
            continue
        seen.add(d)
        try:
            out += [{"name": c.name, "capacity": c.capacity, "filled": c.filled, "cached": c.cached,
                     "samples": c.samples, "holders": c.holders, "dir": d}
                    for c in in_shm_dir(d, list_caches)]
        except Exception as e:  # the status must answer even if a cache is unreadable
            out.append({"name": f"(unreadable: {e})", "capacity": 0, "filled": 0, "cached": 0, "samples": 0,
                        "holders": 0, "dir": d})
    return out
