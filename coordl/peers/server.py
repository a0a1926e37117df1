"""A node's cache server: answers other nodes' requests for raw sample
bytes from this node's cache (:class:`coordl.cache.NodeCache`), and for
what that cache holds (a membership bitmap, asked at each epoch start).

One per node per loader, in the node daemon or in the process that holds
the node's lowest rank (``rendezvous.py``, ``hosted.py``).  Event-driven:
an accept thread and a fixed number of loop threads (``loops``), each
multiplexing its connections with ``selectors`` (epoll: no descriptor
limit), whatever the number of connections.  At 64 nodes x 8 ranks x 8
workers a node serves ~4,000 connections this way; the threads are always
``1 + loops`` and the memory per connection is bounded (one frame being
read, at most ``MAX_QUEUED`` requests queued, one answer being sent).

Every connection must complete the handshake within ``handshake_timeout``.
Connections still unauthenticated are capped apart (``max_unauthenticated``):
when the cap is reached the oldest unauthenticated one is closed to make
room, so idle or hostile sockets can neither starve authenticated clients
nor keep new ones out.  Authenticated connections are capped by
``max_connections`` (default: what the descriptor limit allows; the server
raises the process's soft RLIMIT_NOFILE to its hard limit).  An established
connection is closed after ``idle_timeout`` without a request (the client
reconnects when it needs to); a frame must arrive whole within
``body_timeout`` of its first byte, and a client that stops reading its
answers for ``body_timeout`` is dropped.  Anything malformed closes that
connection and only that one; the server itself never stops for a client.
"""
from __future__ import annotations

import collections
import os
import resource
import select
import selectors
import socket
import struct
import threading
import time
import zlib

import numpy as np

from . import protocol as P

__all__ = ["PeerServer"]

MIN_SECRET = 16     # bytes: anything shorter can be guessed, and b"" lets anyone in
MAX_QUEUED = 4      # GET frames queued per connection before the server stops reading it
_TICK = 0.1         # seconds between deadline sweeps
_SEND_CHUNK = 256 << 10
_HELLO, _AUTH, _READY = 0, 1, 2
_EXPECT = {_HELLO: (P.HELLO,), _AUTH: (P.AUTH,), _READY: (P.GET, P.HAVEQ, P.PUT)}


def _raise_nofile() -> int:
    """Raise the soft descriptor limit to the hard one; the soft limit after."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return 1024


class _Conn:
    __slots__ = ("sock", "fd", "state", "inbuf", "queue", "out", "deadline", "frame_deadline",
                 "write_since", "cn", "sn", "loop", "reading", "events", "born")

    def __init__(self, sock, loop, deadline) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.state = _HELLO
        self.inbuf = bytearray()
        self.queue: collections.deque = collections.deque()   # [rid, indices, next position]
        self.out: list = []          # memoryviews still to send
        self.deadline = deadline     # handshake deadline, then the idle deadline
        self.frame_deadline = None   # a frame started: it must be whole by then
        self.write_since = None      # answers waiting on a client that does not read, since
        self.cn = self.sn = None
        self.loop = loop
        self.reading = True
        self.events = 0
        self.born = time.monotonic()


class _Loop:
    """One thread, one selector, its share of the connections."""

    def __init__(self, server, k: int) -> None:
        self.server = server
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.sel.register(self.wake_r, selectors.EVENT_READ, None)
        self.new: collections.deque = collections.deque()
        self.conns: dict[int, _Conn] = {}
        self.thread = threading.Thread(target=self.run, name=f"coordl-peer-loop-{k}", daemon=True)

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def add(self, sock) -> None:
        self.new.append(sock)
        self.wake()

    # ------------------------------------------------------------ the loop
    def run(self) -> None:
        srv = self.server
        try:
            next_sweep = time.monotonic() + _TICK
            while not srv._closed:
                for key, ev in self.sel.select(max(0.0, next_sweep - time.monotonic())):
                    if key.data is None:
                        try:
                            os.read(self.wake_r, 4096)
                        except OSError:
                            pass
                        continue
                    c = key.data
                    if c.fd not in self.conns:
                        continue
                    try:
                        if ev & selectors.EVENT_READ:
                            self._read(c)
                        if c.fd in self.conns and (ev & selectors.EVENT_WRITE or c.out or c.queue):
                            self._write(c)
                    except (P.ProtocolError, OSError, ValueError, struct.error):
                        self.drop(c)
                while self.new:
                    self._adopt(self.new.popleft())
                now = time.monotonic()
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + _TICK
        finally:
            for c in list(self.conns.values()):
                self.drop(c)
            while self.new:
                s = self.new.popleft()
                s.close()
            self.sel.close()
            for fd in (self.wake_r, self.wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _adopt(self, sock) -> None:
        srv = self.server
        if srv._closed:
            sock.close()
            return
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            sock.close()
            srv._forget_unauth(sock)
            return
        c = _Conn(sock, self, time.monotonic() + srv.handshake_timeout)
        self.conns[c.fd] = c
        with srv._lock:
            srv._conns[c.fd] = c
        self._interest(c)

    def _interest(self, c: _Conn) -> None:
        ev = (selectors.EVENT_READ if c.reading else 0) | (selectors.EVENT_WRITE if c.out or c.queue else 0)
        if ev == c.events:
            return
        if c.events == 0:
            self.sel.register(c.sock, ev, c)
        elif ev == 0:
            self.sel.unregister(c.sock)
        else:
            self.sel.modify(c.sock, ev, c)
        c.events = ev

    def drop(self, c: _Conn) -> None:
        if self.conns.pop(c.fd, None) is None:
            return
        srv = self.server
        with srv._lock:
            srv._conns.pop(c.fd, None)
            if c.state == _READY:
                srv._authed -= 1
            elif srv._unauth.get(c.fd) is c.sock:
                del srv._unauth[c.fd]
        if c.events:
            try:
                self.sel.unregister(c.sock)
            except (KeyError, ValueError, OSError):
                pass
        try:
            # the connection itself, not just our descriptor: a process
            # forked from ours (a loader worker) holds a copy of it
            c.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        c.sock.close()
        c.out = []
        c.queue.clear()

    def _sweep(self, now: float) -> None:
        for c in list(self.conns.values()):
            late = (now > c.deadline and (c.state != _READY or not (c.queue or c.out or c.inbuf))) \
                or (c.frame_deadline is not None and now > c.frame_deadline) \
                or (c.write_since is not None and now - c.write_since > self.server.body_timeout)
            if late:
                self.drop(c)

    # ------------------------------------------------------------ reading
    def _read(self, c: _Conn) -> None:
        data = c.sock.recv(65536)
        if not data:
            raise P.ProtocolError("connection closed")
        c.inbuf += data
        self._frames(c)

    def _frames(self, c: _Conn) -> None:
        srv = self.server
        while c.fd in self.conns:
            if len(c.inbuf) < P.HEADER.size:
                if c.inbuf and c.frame_deadline is None:
                    c.frame_deadline = time.monotonic() + srv.body_timeout
                break
            magic, version, ftype, length = P.HEADER.unpack_from(c.inbuf)
            if magic != P.MAGIC or version != P.VERSION or ftype not in _EXPECT[c.state] \
                    or length > P.MAX_PAYLOAD[ftype]:
                raise P.ProtocolError("bad frame header")
            if len(c.inbuf) < P.HEADER.size + length:
                if c.frame_deadline is None:
                    c.frame_deadline = time.monotonic() + srv.body_timeout
                break
            payload = bytes(c.inbuf[P.HEADER.size:P.HEADER.size + length])
            del c.inbuf[:P.HEADER.size + length]
            c.frame_deadline = None
            self._frame(c, ftype, payload)
        # backpressure: a client asking faster than it reads waits in its socket buffer
        want = c.fd in self.conns and len(c.queue) < MAX_QUEUED
        if c.fd in self.conns and want != c.reading:
            c.reading = want
            self._interest(c)

    def _frame(self, c: _Conn, ftype: int, p: bytes) -> None:
        srv = self.server
        if ftype == P.HELLO:
            if len(p) != P.NONCE + P.CACHE_ID:
                raise P.ProtocolError("malformed hello")
            P.check_hello_cache(p[P.NONCE:], srv._cid)      # before any challenge
            c.cn = p[:P.NONCE]
            c.sn = os.urandom(P.NONCE)
            self._send(c, P.HEADER.pack(P.MAGIC, P.VERSION, P.CHALLENGE, P.NONCE + P.MAC) + c.sn
                       + P._mac(srv._secret, b"srv", c.cn, c.sn, srv._cid))
            self._flush(c)      # on the wire before anything that follows it in the buffer is judged
            c.state = _AUTH
        elif ftype == P.AUTH:
            import hmac

            if not hmac.compare_digest(p, P._mac(srv._secret, b"cli", c.sn, c.cn, srv._cid)):
                raise P.ProtocolError("authentication failed")
            if not srv._admit(c):
                raise P.ProtocolError("too many connections")
            c.state = _READY
            c.deadline = time.monotonic() + srv.idle_timeout
            self._send(c, P.HEADER.pack(P.MAGIC, P.VERSION, P.OK, 0))
        elif ftype == P.GET:
            rid, indices = P.unpack_get(p)
            for i in indices:
                if i >= srv._n:
                    raise P.ProtocolError(f"sample {i} out of range (n={srv._n})")
            c.queue.append([rid, indices, 0])
            c.deadline = time.monotonic() + srv.idle_timeout
        elif ftype == P.PUT:
            i, crc, data = P.unpack_put(p)
            if i >= srv._n:
                raise P.ProtocolError(f"sample {i} out of range (n={srv._n})")
            if zlib.crc32(data) == crc and len(data):
                try:
                    if srv.cache.put(i, data):
                        srv.taken += 1
                        note = getattr(srv.cache, "note_peer_in", None)
                        if note is not None:
                            note(len(data))
                except Exception:   # a full or busy cache: the hand-off is a hint, never an error
                    pass
            c.deadline = time.monotonic() + srv.idle_timeout
        else:   # HAVEQ
            rid, n = P.unpack_haveq(p)
            if n != srv._n:
                raise P.ProtocolError(f"membership asked for {n} samples, this cache has {srv._n}")
            bits = srv._bitmap()
            free = int(getattr(srv.cache, "free_bytes", 0) or 0)
            self._send(c, P.HEADER.pack(P.MAGIC, P.VERSION, P.HAVE, 20 + len(bits))
                       + P.pack_have_header(rid, n, free), memoryview(bits))
            c.deadline = time.monotonic() + srv.idle_timeout

    # ------------------------------------------------------------ writing
    def _send(self, c: _Conn, *parts) -> None:
        for part in parts:
            if len(part):
                c.out.append(memoryview(part).cast("B"))

    def _flush(self, c: _Conn) -> None:
        while c.out:
            try:
                k = c.sock.send(c.out[0])
            except (BlockingIOError, InterruptedError):
                return
            if k == len(c.out[0]):
                c.out.pop(0)
            else:
                c.out[0] = c.out[0][k:]
                return

    def _write(self, c: _Conn) -> None:
        srv = self.server
        budget = _SEND_CHUNK
        progressed = False
        while True:
            while not c.out and c.queue and budget > 0:
                budget -= self._produce(c)
            if not c.out:
                break
            try:
                k = c.sock.send(c.out[0])
            except (BlockingIOError, InterruptedError):
                break
            progressed = progressed or k > 0
            if k == len(c.out[0]):
                c.out.pop(0)
            else:
                c.out[0] = c.out[0][k:]
                break
            if not c.out and (budget <= 0 or not c.queue):
                break
        if c.out:
            if progressed or c.write_since is None:
                c.write_since = time.monotonic()
        else:
            c.write_since = None
        if c.state == _READY:
            c.deadline = time.monotonic() + srv.idle_timeout
        want = len(c.queue) < MAX_QUEUED
        if want != c.reading:
            c.reading = want
        self._interest(c)
        if c.reading and c.inbuf and len(c.queue) < MAX_QUEUED:
            self._frames(c)     # requests that waited in our buffer while the queue was full

    def _produce(self, c: _Conn) -> int:
        """The next answer of the oldest request into ``c.out``; its size."""
        srv = self.server
        req = c.queue[0]
        rid, indices, k = req
        i = indices[k]
        req[2] = k + 1
        if req[2] == len(indices):
            c.queue.popleft()
        try:
            data = srv.cache.get(i, count=False, verify=True)   # a peer's lookup: not this node's hit or miss
        except Exception:   # an unreadable entry is as good as absent
            data = None
        if data is None or len(data) > P.MAX_SAMPLE:
            srv.absent += 1
            self._send(c, P.HEADER.pack(P.MAGIC, P.VERSION, P.ITEM, P._ITEM_HEAD.size)
                       + P.pack_item_header(rid, i, P.ABSENT))
            return P._ITEM_HEAD.size
        crc = zlib.crc32(data)
        self._send(c, P.HEADER.pack(P.MAGIC, P.VERSION, P.ITEM, P._ITEM_HEAD.size + len(data))
                   + P.pack_item_header(rid, i, P.HERE, crc), data)
        srv.samples_served += 1
        srv.bytes_served += len(data)
        note = getattr(srv.cache, "note_peer_out", None)
        if note is not None:
            note(len(data))
        return len(data) + 32


class PeerServer:
    """Serve ``cache`` to clients that know ``secret``, on ``(host, port)``
    (port 0: any free port; see :attr:`address`).  ``key`` is what clients
    name the cache by (the dataset fingerprint, the same on every node;
    default: the cache's name)."""

    def __init__(self, cache, secret: bytes, host: str, port: int = 0, *, key: str | None = None,
                 handshake_timeout: float = 5.0, idle_timeout: float = 300.0, body_timeout: float = 30.0,
                 max_connections: int | None = None, max_unauthenticated: int = 512, loops: int = 2) -> None:
        P.check_bind_host(host)
        if len(secret) < MIN_SECRET:
            raise ValueError(f"secret should be at least {MIN_SECRET} random bytes (the job's secret), but got "
                             f"a secret of {len(secret)} bytes")
        if not 0 <= int(port) <= 65535:
            raise ValueError(f"port should be a TCP port number in 0..65535, but got port={port!r}")
        self.cache = cache
        self._secret = bytes(secret)
        self._cid = P.cache_id(key if key is not None else cache.name)   # what clients ask for by name
        self._n = int(cache.n)
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.body_timeout = body_timeout
        nofile = _raise_nofile()
        self.max_connections = int(max_connections) if max_connections else max(64, nofile - 256)
        self.max_unauthenticated = max(1, int(max_unauthenticated))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(4096)
        except BaseException:
            self._sock.close()
            raise
        self.address = self._sock.getsockname()[:2]
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        self._unauth: "collections.OrderedDict[int, socket.socket]" = collections.OrderedDict()
        self._authed = 0
        self._closed = False
        self._bits = (None, b"")
        self._bits_lock = threading.Lock()
        # statistics (this server's; the cache header has node-wide ones)
        self.samples_served = 0
        self.bytes_served = 0
        self.absent = 0
        self.refused = 0
        self.evicted = 0          # unauthenticated connections closed to make room
        self.taken = 0            # samples other nodes handed over (PUT) and this cache admitted
        self._loops = [_Loop(self, k) for k in range(max(1, int(loops)))]
        self._next = 0
        for lp in self._loops:
            lp.thread.start()
        self._accept = threading.Thread(target=self._accept_loop, name="coordl-peer-accept", daemon=True)
        self._accept.start()

    in_daemon = False     # (see hosted.DaemonHosted: the same interface, served by the node daemon)

    def ensure(self) -> None:
        """Nothing to do: this server lives as long as its process."""

    # ------------------------------------------------------------------ life
    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, end every connection and join the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        for lp in self._loops:
            lp.wake()
        self._accept.join(timeout)
        for lp in self._loops:
            lp.thread.join(timeout)
        try:
            # stop listening even where a forked process (a loader worker)
            # holds a copy of the descriptor: its port then refuses connections
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    @property
    def connections(self) -> int:
        """Open connections (authenticated or not)."""
        with self._lock:
            return len(self._conns) + sum(1 for fd in self._unauth if fd not in self._conns)

    @property
    def unauthenticated(self) -> int:
        with self._lock:
            return len(self._unauth)

    @property
    def threads(self) -> int:
        """Threads serving (always ``1 + loops`` while open, 0 once closed)."""
        return int(self._accept.is_alive()) + sum(lp.thread.is_alive() for lp in self._loops)

    # ------------------------------------------------------------------ helpers
    def _bitmap(self) -> bytes:
        """This cache's membership, packed (recomputed only when it admitted more)."""
        held = getattr(self.cache, "held", None)
        if held is None:
            return bytes((self._n + 7) // 8)
        stamp = getattr(self.cache, "admitted", None)
        with self._bits_lock:
            if stamp is None or self._bits[0] != stamp:
                self._bits = (stamp, np.packbits(held()).tobytes())
            return self._bits[1]

    def _admit(self, c: _Conn) -> bool:
        with self._lock:
            self._unauth.pop(c.fd, None)
            if self._authed >= self.max_connections:
                self.refused += 1
                return False
            self._authed += 1
            return True

    def _forget_unauth(self, sock) -> None:
        with self._lock:
            for fd, s in list(self._unauth.items()):
                if s is sock:
                    del self._unauth[fd]

    # ------------------------------------------------------------------ threads
    def _accept_loop(self) -> None:
        # poll, not select: a loader process may hold descriptors numbered
        # past select()'s limit (1024) before the server starts
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        wake = select.poll()
        wake.register(self._wake_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._wake_r in ready or self._closed:
                return
            try:
                conn, _ = self._sock.accept()
            except OSError:
                # out of descriptors or memory (EMFILE, ENFILE, ENOBUFS): the
                # client waits in the backlog and the socket stays readable;
                # try again shortly rather than spin (or at once on close)
                wake.poll(100)
                continue
            victim = None
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._unauth) >= self.max_unauthenticated:
                    # the oldest one still unauthenticated makes room: a valid client
                    # authenticates within a round trip, an idle socket never does
                    _fd, victim = self._unauth.popitem(last=False)
                    self.evicted += 1
                self._unauth[conn.fileno()] = conn
            if victim is not None:
                try:
                    victim.shutdown(socket.SHUT_RDWR)   # its loop sees EOF and drops it
                except OSError:
                    pass
            lp = self._loops[self._next % len(self._loops)]
            self._next += 1
            lp.add(conn)
