"""Asking other nodes for samples: the fetch stage's middle tier (node cache
-> owning peer -> storage).

A :class:`PeerClient` is plain configuration (the peer table, the job
secret, the plan) and is pickled into every worker process; connections are
made lazily in the process that uses them, one per peer per process, and
shared by that process's fetch threads: each request carries an id, a
receiver thread per connection hands each answer to the thread that asked,
so many requests are in flight on one connection (pipelined along the plan
like storage reads).

Who holds what is asked of the peers themselves, never derived from a plan
(a resume, a partial first pass, an evaluation pass or adopted caches make
any plan-derived guess wrong for good, since caches never evict): at each
epoch start, the first fetch of a process asks every peer for its cache's
membership bitmap (HAVE?, one bit per sample, n/8 bytes) over the
connection it uses anyway; a sample is asked of a peer only if that peer
held it then (among several holders, a rotation spreads the load), and
what no peer holds is read from storage at once, without a round trip.
A sample a node admits after the snapshot is found at the next epoch.
Nothing collective runs during iteration.

Bytes from a peer carry the CRC32 of what the peer's cache verified
(``protocol.py``); a mismatch reads the sample from storage instead, so a
corrupt entry on one node cannot spread.  A peer's bytes are admitted to
this node's cache only while that cannot crowd out a sample no node holds
(:meth:`PeerClient.admit`): caches never evict, and the cluster reads
least from storage when the caches together hold as much as they can.

Failures: a peer that refuses, breaks the protocol or does not answer
within ``timeout`` is marked down (every request waiting on it fails at
once, and later ones go straight to storage), so it costs at most one
timeout; it is tried again one ``timeout`` later (then 2, 4, ... up to a
minute while it keeps failing at that cost), and at every
:meth:`new_epoch`.  A connection refused at once (nothing listening: a node
daemon being restarted) costs nothing and is tried again every
``timeout``, so a peer whose server came back serves again within about
one timeout of its return, however long the restart took.
"""
from __future__ import annotations

import itertools
import os
import socket
import threading
import time
import zlib

import numpy as np

from . import protocol as P

__all__ = ["PeerClient", "PeerDown"]

DEFAULT_TIMEOUT = 5.0


class PeerDown(ConnectionError):
    """A peer could not answer (down, stalled, or not one of ours).
    ``refused``: nothing listened at its address (connect() refused at
    once: a node daemon being restarted), a failure that cost no time."""

    refused = False


class _Request:
    __slots__ = ("indices", "got", "left", "done", "error", "bits")

    def __init__(self, indices) -> None:
        self.bits = None
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
        self.corrupt = 0                       # samples whose bytes failed their CRC32 (read from storage)
        try:
            sock = socket.create_connection(addr, timeout=timeout)
        except OSError as e:
            down = PeerDown(f"peer {name} at {addr[0]}:{addr[1]}: {e}")
            down.refused = isinstance(e, ConnectionRefusedError)
            raise down from None
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
        return self._ask(_Request(indices), lambda rid: (P.GET, P.pack_get(rid, indices)))

    def request_have(self, n: int) -> _Request:
        """Ask for the peer's membership bitmap over ``n`` samples."""
        return self._ask(_Request((-1,)), lambda rid: (P.HAVEQ, P.pack_haveq(rid, n)))

    def _ask(self, req: _Request, frame) -> _Request:
        """Register ``req`` under a new request id and send ``frame(rid)``
        (a frame type and its payload); its answer completes ``req``."""
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
        kind, payload = frame(rid)
        try:
            with self._send_lock:
                P.send_frame(self.sock, kind, payload, deadline=time.monotonic() + self.timeout)
        except OSError as e:
            with self._lock:
                self._pending.pop(rid, None)
                self._fail_locked(e)
            raise PeerDown(f"peer {self.name}: {e}") from None
        return req

    def put(self, index: int, data) -> None:
        """Hand sample ``index`` to the peer (no answer; bounded by the timeout)."""
        with self._lock:
            if self.dead is not None:
                raise PeerDown(f"peer {self.name}: {self.dead}")
        try:
            with self._send_lock:
                P.send_frame(self.sock, P.PUT, P.pack_put_header(index, zlib.crc32(data)), data,
                             deadline=time.monotonic() + self.timeout)
        except OSError as e:
            self.fail(e)
            raise PeerDown(f"peer {self.name}: {e}") from None

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
                ftype, payload = P.recv_frame(self.sock, (P.ITEM, P.HAVE), None, max(self.timeout, 30.0))
                if ftype == P.HAVE:
                    rid, _n, free, bits = P.unpack_have_free(payload)
                    with self._lock:
                        req = self._pending.pop(rid, None)
                        if req is None or req.indices != {-1}:
                            raise P.ProtocolError(f"a membership nobody asked for (request {rid})")
                        req.bits = np.frombuffer(bytes(bits), dtype=np.uint8)
                        req.got = {-1: free}
                        req.done.set()
                    continue
                rid, index, status, data = P.unpack_item(payload)
                if status == P.CORRUPT:
                    self.corrupt += 1
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
    """Peer table; connections and membership per process (see the module doc).

    ``nodes``: one ``(node_id, host, port)`` per node, ``me`` this node's
    position in it, ``rank_nodes[r]`` the node of rank ``r``; ``plan``: the
    :class:`coordl.plan.EpochPlan` kwargs without rank (only
    ``num_samples`` is used: the size of the membership bitmaps).
    """

    MAX_BACKOFF = 60.0

    def __init__(self, nodes: list, me: int, rank_nodes: list, secret: bytes, cache_name: str,
                 plan: dict, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.nodes = [(str(a), str(h), int(p)) for a, h, p in nodes]
        self.me = int(me)
        self.rank_nodes = [int(x) for x in rank_nodes]
        self.secret = bytes(secret)
        self.cache_name = cache_name
        self.plan = dict(plan)
        self.n = int(self.plan["num_samples"])
        self.timeout = float(timeout)
        self.e0: int | None = None
        self._local_init()

    def _local_init(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._links: dict[int, _Link] = {}
        self._connecting = {n: threading.Lock() for n in range(len(self.nodes))}
        self._down: dict[int, tuple[str, float, int]] = {}     # node: (why, retry at, failures in a row)
        self._maps: dict[int, np.ndarray] = {}                 # node: packed membership (this epoch)
        self._stale: set[int] = self._others()                 # nodes whose membership to ask again
        self._map_lock = threading.Lock()
        self._refreshing = False
        self._owner: np.ndarray | None = None
        self._unheld_bytes = 0
        self._unheld_dirty = True
        self._room: dict[int, int] = {}      # node: its cache's free bytes at the snapshot, less what we handed it
        self.handed = 0                      # samples handed to a peer with room (statistics, tests)
        self._cid = P.cache_id(self.cache_name)
        self.map_requests = 0        # membership bitmaps asked for (statistics, tests)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.n = int(self.plan["num_samples"])
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

    # ------------------------------------------------------------------ membership
    def start(self, epoch: int) -> None:
        """The first epoch this loader ran (kept for statistics; ownership no
        longer depends on it).  Called before workers start."""
        if self.e0 is None:
            self.e0 = int(epoch)

    def _others(self) -> set[int]:
        return {n for n in range(len(self.nodes)) if n != self.me}

    def _peers(self) -> list[int]:
        """Other nodes that serve, in this node's preference order."""
        k = len(self.nodes)
        return [(self.me + j) % k for j in range(1, k) if self.nodes[(self.me + j) % k][2]]

    def _refresh(self) -> None:
        """Ask the peers whose membership is stale for it (all at once, one
        timeout for all); a peer that cannot answer holds nothing for now."""
        with self._lock:
            if not self._stale and not self._refreshing:
                return
        # every fetch thread waits for a refresh in flight: none reads an old snapshot
        with self._map_lock:
            with self._lock:
                stale = [n for n in self._stale if n != self.me]
                self._stale.difference_update(stale)
                if not stale:
                    return
                self._refreshing = True
            try:
                self._ask_membership(stale)
            finally:
                with self._lock:
                    self._refreshing = False

    def _ask_membership(self, stale) -> None:
        asked = []
        for node in stale:
            if not self.nodes[node][2]:
                continue
            link = self._link(node)
            if link is None:
                with self._lock:
                    self._maps.pop(node, None)
                continue
            try:
                asked.append((node, link, link.request_have(self.n)))
                self.map_requests += 1
            except PeerDown as e:
                self._mark_down(node, e)
        deadline = time.monotonic() + self.timeout
        got, room = {}, {}
        for node, link, req in asked:
            try:
                link.wait(req, deadline)
                if req.bits is None or len(req.bits) != (self.n + 7) // 8:
                    raise PeerDown(f"peer {link.name}: no membership")
                got[node] = req.bits
                room[node] = int(req.got.get(-1, 0))
            except PeerDown as e:
                self._mark_down(node, e)
        with self._lock:
            for node, _l, _r in asked:
                self._maps.pop(node, None)
            self._maps.update(got)
            self._room.update(room)
            self._stale.difference_update(got)
            self._owner = None
            self._unheld_dirty = True

    def owners(self) -> np.ndarray:
        """``owner[i]``: the node this process asks for sample ``i`` (-1:
        none holds it, read it from storage), from the peers' membership as
        of this epoch's start.  O(n) per peer, once per process per epoch."""
        self._check_pid()
        self._refresh()
        with self._lock:
            if self._owner is not None:
                return self._owner
            maps = dict(self._maps)
        owner = np.full(self.n, -1, dtype=np.int32)
        for node in self._peers():
            bits = maps.get(node)
            if bits is None:
                continue
            held = np.unpackbits(bits, count=self.n).view(bool)
            owner[held & (owner < 0)] = node
        with self._lock:
            self._owner = owner
        return owner

    def holders(self, indices) -> np.ndarray:
        """The node to ask for each of ``indices`` (-1: none holds it), without
        building :meth:`owners`: O(peers) per index."""
        self._check_pid()
        self._refresh()
        idx = np.asarray(indices, dtype=np.int64)
        out = np.full(len(idx), -1, dtype=np.int32)
        with self._lock:
            maps = dict(self._maps)
        if not maps or not len(idx):
            return out
        k = len(self.nodes)
        byte, shift = idx >> 3, 7 - (idx & 7)
        best = np.full(len(idx), k + 1, dtype=np.int64)
        mix = ((idx & 0xFFFFFFFF) * 0x9E3779B1) >> 20      # a hash of the index: holders take turns
        for node, bits in maps.items():
            if node == self.me or not self.nodes[node][2]:
                continue
            held = (bits[byte] >> shift) & 1 == 1
            # several holders: rotate by sample, so the load spreads over them
            rank = (node - self.me - mix) % k
            better = held & (rank < best)
            best[better] = rank[better]
            out[better] = node
        return out

    def admit(self, cache, nbytes: int, sizes=None) -> bool:
        """Admit a peer's sample of ``nbytes`` to this node's ``cache``?  Only
        while the room left after it still fits every sample no node held at
        this epoch's start (those must be cached where storage reads them)."""
        free = getattr(cache, "free_bytes", None)
        if free is None:
            return True
        if free < nbytes:
            return False
        with self._lock:
            dirty = self._unheld_dirty
            self._unheld_dirty = False
        if dirty:
            self.note_unheld(cache, sizes)
        with self._lock:
            need = self._unheld_bytes
        return free - nbytes >= need

    def offer(self, i: int, data) -> None:
        """Sample ``i`` came from storage and this node's cache is full: if
        no node held it at the epoch's start, hand it to the peer with the
        most room (it would otherwise be read from storage every epoch)."""
        self._check_pid()
        n = len(data)
        if self.holders([i])[0] >= 0:
            return
        with self._lock:
            room = {k: v for k, v in self._room.items() if v >= n and k in self._maps and k not in self._down}
            if not room:
                return
            node = max(room, key=room.get)
            self._room[node] -= n
        link = self._link(node)
        if link is None:
            return
        try:
            link.put(int(i), data)
            self.handed += 1
        except PeerDown as e:
            self._mark_down(node, e)

    def note_unheld(self, cache, sizes=None) -> None:
        """Estimate the bytes of samples no node holds (this node's cache
        included), for :meth:`admit`.  Once per epoch per process."""
        held = getattr(cache, "held", None)
        if held is None:
            return
        mine = held()
        union = mine.copy()
        with self._lock:
            maps = dict(self._maps)
        for bits in maps.values():
            union |= np.unpackbits(bits, count=self.n).view(bool)
        missing = ~union
        if sizes is not None and len(sizes) == self.n:
            need = int(np.asarray(sizes)[missing].clip(min=0).sum())
        else:
            have = int(mine.sum())
            used = int(cache.capacity) - int(cache.free_bytes) if hasattr(cache, "capacity") else 0
            mean = used / have if have else 0
            need = int(mean * int(missing.sum()))
        with self._lock:
            self._unheld_bytes = need

    # ------------------------------------------------------------------ use
    def _check_pid(self) -> None:
        if os.getpid() != self._pid:      # forked: the parent's connections are not ours
            self._local_init()

    def new_epoch(self) -> None:
        """Peers marked down get another chance; every peer's membership is
        asked again (at this process's next fetch)."""
        self._check_pid()
        with self._lock:
            self._down.clear()
            self._stale = self._others()

    def down(self) -> dict[int, str]:
        with self._lock:
            return {n: why for n, (why, _t, _k) in self._down.items()}

    def _link(self, node: int) -> _Link | None:
        def usable():
            with self._lock:
                d = self._down.get(node)
                if d is not None:
                    if time.monotonic() < d[1]:
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
                d = self._down.pop(node, None)
                if d is not None or node not in self._maps:
                    self._stale.add(node)   # back after a failure: what does it hold now?
            return link
        finally:
            self._connecting[node].release()

    def _mark_down(self, node: int, e: BaseException) -> None:
        with self._lock:
            _why, _t, k = self._down.get(node, ("", 0.0, 0))
            if getattr(e, "refused", False):
                # nothing listening: trying again costs nothing, so every timeout (a restarted
                # server is used within one timeout of coming back, however long it took)
                wait = self.timeout
            else:
                wait = min(self.MAX_BACKOFF, self.timeout * (2 ** k))
                k += 1
            self._down[node] = (str(e), time.monotonic() + wait, k)
            link = self._links.pop(node, None)
        if link is not None:
            link.fail(e)
            link.close()    # joins its receiver (out at once: its socket is shut down)

    def fetch(self, indices) -> dict[int, bytes]:
        """Ask the peers that hold them for ``indices``: the bytes of those a
        peer had (CRC-checked).  Never raises for a peer's failure."""
        self._check_pid()
        uniq = list(dict.fromkeys(int(i) for i in indices))    # once each: a batch may repeat a sample
        if not uniq:
            return {}
        who = self.holders(uniq)
        by_node: dict[int, list[int]] = {}
        for i, o in zip(uniq, who.tolist()):
            if o >= 0 and o != self.me:
                by_node.setdefault(o, []).append(i)
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
