"""Asking other nodes for samples: the fetch stage's middle tier (node cache
-> owning peer -> storage).

A :class:`PeerClient` is plain configuration (the peer table, the job
secret, the plan) and is pickled into every worker process; connections are
made lazily in the process that uses them, one per peer per process, and
shared by that process's fetch threads: each request carries an id, a
receiver thread per connection hands each answer to the thread that asked,
so many requests are in flight on one connection (pipelined along the plan
like storage reads).

Who holds what follows from the plan, so nothing is exchanged per sample:
node caches admit until full and never evict (MinIO), so a sample stays
where it was first read, and in the first epoch of the run (``e0``) sample
``i`` was read by the node of the rank whose share of that epoch held it.
A peer asked for something it does not hold answers "absent" at once, and
the sample is read from storage.

Failures: a peer that refuses, breaks the protocol or does not answer
within ``timeout`` is marked down for the rest of the epoch (every request
waiting on it fails at once, and later ones go straight to storage), so it
costs at most one timeout; :meth:`new_epoch` lets it be tried again.
"""
from __future__ import annotations

import itertools
import os
import socket
import threading
import time

import numpy as np

from . import protocol as P

__all__ = ["PeerClient", "PeerDown"]

DEFAULT_TIMEOUT = 5.0


class PeerDown(ConnectionError):
    """A peer could not answer (down, stalled, or not one of ours)."""


class _Request:
    __slots__ = ("indices", "got", "left", "done", "error")

    def __init__(self, indices) -> None:
        self.indices = set(indices)
        self.got: dict[int, bytes | None] = {}
        self.left = len(indices)
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Link:
    """One authenticated connection to one peer, shared by this process's threads."""

    def __init__(self, addr, secret: bytes, cid: bytes, timeout: float, name: str) -> None:
        self.name = name
        self.timeout = timeout
        self._lock = threading.Lock()          # pending requests and the link's state
        self._send_lock = threading.Lock()     # one frame on the wire at a time
        self._pending: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self.dead: BaseException | None = None
        try:
            sock = socket.create_connection(addr, timeout=timeout)
        except OSError as e:
            raise PeerDown(f"peer {name} at {addr[0]}:{addr[1]}: {e}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            P.client_handshake(sock, secret, cid, timeout)
        except (OSError, P.ProtocolError) as e:
            sock.close()
            raise PeerDown(f"peer {name} at {addr[0]}:{addr[1]}: {e}") from None
        self.sock = sock
        self._rx = threading.Thread(target=self._receive, name=f"coordl-peer-rx-{name}", daemon=True)
        self._rx.start()

    def request(self, indices: list[int]) -> _Request:
        req = _Request(indices)
        with self._lock:
            if self.dead is not None:
                raise PeerDown(f"peer {self.name}: {self.dead}")
            rid = next(self._ids) & 0xFFFFFFFF
            self._pending[rid] = req
        # Sent under its own lock, not the one the receiver needs: a sender
        # blocked on a full socket must never keep the receiver from draining
        # the answers the peer is blocked sending.  Bounded: the receiver
        # leaves the socket blocking, and a peer that stopped reading must
        # cost one timeout, not a hang.
        try:
            with self._send_lock:
                P.send_frame(self.sock, P.GET, P.pack_get(rid, indices),
                             deadline=time.monotonic() + self.timeout)
        except OSError as e:
            with self._lock:
                self._pending.pop(rid, None)
                self._fail_locked(e)
            raise PeerDown(f"peer {self.name}: {e}") from None
        return req

    def wait(self, req: _Request, deadline: float) -> dict:
        if not req.done.wait(max(0.0, deadline - time.monotonic())):
            self.fail(PeerDown(f"peer {self.name} did not answer within {self.timeout:g} s"))
        if req.error is not None:
            raise PeerDown(f"peer {self.name}: {req.error}")
        return req.got

    def fail(self, e: BaseException) -> None:
        with self._lock:
            self._fail_locked(e)

    def _fail_locked(self, e: BaseException) -> None:
        if self.dead is None:
            self.dead = e
            try:
                self.sock.shutdown(socket.SHUT_RDWR)   # wakes the receiver, which closes it
            except OSError:
                pass
        for req in self._pending.values():
            req.error = e
            req.done.set()
        self._pending.clear()

    def close(self) -> None:
        self.fail(PeerDown("closed"))
        if self._rx is not threading.current_thread():
            self._rx.join(5.0)

    def _receive(self) -> None:
        try:
            while True:
                _, payload = P.recv_frame(self.sock, (P.ITEM,), None, max(self.timeout, 30.0))
                rid, index, status, data = P.unpack_item(payload)
                with self._lock:
                    req = self._pending.get(rid)
                    if req is None or index not in req.indices or index in req.got:
                        raise P.ProtocolError(f"an answer nobody asked for (request {rid}, sample {index})")
                    req.got[index] = bytes(data) if status == P.HERE else None
                    req.left -= 1
                    if req.left == 0:
                        del self._pending[rid]
                        req.done.set()
        except (OSError, P.ProtocolError) as e:
            self.fail(e)
        finally:
            try:
                self.sock.close()
            except OSError:
                pass


class PeerClient:
    """Peer table and plan; connections per process (see the module doc).

    ``nodes``: one ``(node_id, host, port)`` per node, ``me`` this node's
    position in it, ``rank_nodes[r]`` the node of rank ``r``; ``plan``: the
    :class:`coordl.plan.EpochPlan` kwargs without rank (ownership is computed
    from every rank's share of epoch ``e0``, set when the first pass starts).
    """

    def __init__(self, nodes: list, me: int, rank_nodes: list, secret: bytes, cache_name: str,
                 plan: dict, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.nodes = [(str(a), str(h), int(p)) for a, h, p in nodes]
        self.me = int(me)
        self.rank_nodes = [int(x) for x in rank_nodes]
        self.secret = bytes(secret)
        self.cache_name = cache_name
        self.plan = dict(plan)
        self.timeout = float(timeout)
        self.e0: int | None = None
        self._local_init()

    def _local_init(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._links: dict[int, _Link] = {}
        self._connecting = {n: threading.Lock() for n in range(len(self.nodes))}
        self._down: dict[int, str] = {}
        self._owner: np.ndarray | None = None
        self._owner_lock = threading.Lock()
        self._cid = P.cache_id(self.cache_name)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local_init()

    def to_json(self) -> dict:
        """The configuration as JSON (for the node daemon's workers, over the
        user's private socket: it carries the job secret)."""
        return {"nodes": self.nodes, "me": self.me, "rank_nodes": self.rank_nodes,
                "secret": self.secret.hex(), "fingerprint": self.cache_name, "plan": self.plan,
                "timeout": self.timeout, "e0": self.e0}

    @classmethod
    def from_json(cls, d: dict) -> "PeerClient":
        c = cls([tuple(x) for x in d["nodes"]], int(d["me"]), list(d["rank_nodes"]), bytes.fromhex(d["secret"]),
                str(d["fingerprint"]), dict(d["plan"]), float(d["timeout"]))
        if d.get("e0") is not None:
            c.e0 = int(d["e0"])
        return c

    # ------------------------------------------------------------------ plan
    def start(self, epoch: int) -> None:
        """The run's first epoch (the one that filled the node caches) is
        ``epoch``, unless set already.  Called before workers start."""
        if self.e0 is None:
            self.e0 = int(epoch)

    def owners(self) -> np.ndarray:
        """``owner[i]``: the node that first read sample ``i`` (-1: none)."""
        if self._owner is not None:
            return self._owner
        with self._owner_lock:   # once per process, not once per fetch thread arriving first
            if self._owner is not None:
                return self._owner
            from ..plan import EpochPlan

            n = int(self.plan["num_samples"])
            owner = np.full(n, -1, dtype=np.int32)
            e0 = self.e0 if self.e0 is not None else 0
            world = len(self.rank_nodes)
            for r in range(world):
                idx = EpochPlan(**self.plan, rank=r, world_size=world).indices(e0)
                owner[np.asarray(idx, dtype=np.int64)] = self.rank_nodes[r]
            self._owner = owner
        return self._owner

    # ------------------------------------------------------------------ use
    def _check_pid(self) -> None:
        if os.getpid() != self._pid:      # forked: the parent's connections are not ours
            self._local_init()

    def new_epoch(self) -> None:
        """Peers marked down get another chance."""
        self._check_pid()
        with self._lock:
            self._down.clear()

    def down(self) -> dict[int, str]:
        with self._lock:
            return dict(self._down)

    def _link(self, node: int) -> _Link | None:
        def usable():
            with self._lock:
                if node in self._down:
                    return None, True
                link = self._links.get(node)
                return (link, True) if link is not None and link.dead is None else (None, False)

        link, known = usable()
        if known:
            return link
        # one thread connects; the others wait for its outcome (a stalled
        # peer costs one timeout, not one per thread)
        if not self._connecting[node].acquire(timeout=2 * self.timeout + 1):
            return None
        try:
            link, known = usable()
            if known:
                return link
            _, host, port = self.nodes[node]
            try:
                link = _Link((host, port), self.secret, self._cid, self.timeout, self.nodes[node][0])
            except PeerDown as e:
                self._mark_down(node, e)
                return None
            with self._lock:
                self._links[node] = link
            return link
        finally:
            self._connecting[node].release()

    def _mark_down(self, node: int, e: BaseException) -> None:
        with self._lock:
            self._down.setdefault(node, str(e))
            link = self._links.pop(node, None)
        if link is not None:
            link.fail(e)
            link.close()    # joins its receiver (out at once: its socket is shut down)

    def fetch(self, indices) -> dict[int, bytes]:
        """Ask each sample's owner (other nodes only) for ``indices``: the
        bytes of those a peer had.  Never raises for a peer's failure."""
        self._check_pid()
        owner = self.owners()
        by_node: dict[int, list[int]] = {}
        for i in dict.fromkeys(int(i) for i in indices):   # once each: a batch may repeat a sample
            o = int(owner[i])
            if o >= 0 and o != self.me and self.nodes[o][2]:   # (port 0: that node serves nothing)
                by_node.setdefault(o, []).append(int(i))
        out: dict[int, bytes] = {}
        if not by_node:
            return out
        sent = []
        for node, idx in by_node.items():
            link = self._link(node)
            if link is None:
                continue
            try:
                for k in range(0, len(idx), P.MAX_GET):
                    sent.append((node, link, link.request(idx[k:k + P.MAX_GET])))
            except PeerDown as e:
                self._mark_down(node, e)
        deadline = time.monotonic() + self.timeout
        for node, link, req in sent:
            try:
                got = link.wait(req, deadline)
            except PeerDown as e:
                self._mark_down(node, e)
                continue
            for i, data in got.items():
                if data is not None:
                    out[i] = data
        return out

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
