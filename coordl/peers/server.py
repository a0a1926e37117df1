"""A node's cache server: answers other nodes' requests for raw sample
bytes from this node's cache (:class:`coordl.cache.NodeCache`).

One per node per loader, in the process that holds the node's lowest rank
(``rendezvous.py`` decides).  An accept thread and one thread per
connection; connections are few (one per peer worker process), and each
thread spends its time in ``recv``/``sendall`` with the GIL released.

Every connection must complete the handshake within ``handshake_timeout``;
an established one is closed after ``idle_timeout`` without a request (the
client reconnects when it needs to), and a frame must arrive whole within
``body_timeout`` of its first byte.  Anything malformed closes that
connection and only that one; the server itself never stops for a client.
"""
from __future__ import annotations

import os
import select
import socket
import threading

from . import protocol as P

__all__ = ["PeerServer"]

MIN_SECRET = 16     # bytes: anything shorter can be guessed, and b"" lets anyone in


class PeerServer:
    """Serve ``cache`` to clients that know ``secret``, on ``(host, port)``
    (port 0: any free port; see :attr:`address`).  ``key`` is what clients
    name the cache by (the dataset fingerprint, the same on every node;
    default: the cache's name)."""

    def __init__(self, cache, secret: bytes, host: str, port: int = 0, *, key: str | None = None,
                 handshake_timeout: float = 5.0,
                 idle_timeout: float = 300.0, body_timeout: float = 30.0, max_connections: int = 256) -> None:
        if not host or host in ("0.0.0.0", "::"):
            raise ValueError(f"host should be one interface's address (never every interface), but got "
                             f"host={host!r}; set COORDL_PEER_ADDR")
        if len(secret) < MIN_SECRET:
            raise ValueError(f"secret should be at least {MIN_SECRET} random bytes (the job's secret), but got "
                             f"a secret of {len(secret)} bytes")
        self.cache = cache
        self._secret = bytes(secret)
        self._cid = P.cache_id(key if key is not None else cache.name)   # what clients ask for by name
        self._n = int(cache.n)
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.body_timeout = body_timeout
        self.max_connections = max_connections
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(128)
        except BaseException:
            self._sock.close()
            raise
        self.address = self._sock.getsockname()[:2]
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._threads: set[threading.Thread] = set()
        self._closed = False
        # statistics (this server's; the cache header has node-wide ones)
        self.samples_served = 0
        self.bytes_served = 0
        self.absent = 0
        self.refused = 0
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
            conns = list(self._conns.values())
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accept.join(timeout)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)
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
        with self._lock:
            return len(self._conns)

    @property
    def threads(self) -> int:
        with self._lock:
            return len(self._threads)

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
            with self._lock:
                if self._closed or len(self._conns) >= self.max_connections:
                    self.refused += 1
                    conn.close()
                    continue
                t = threading.Thread(target=self._serve, args=(conn,), name="coordl-peer-conn", daemon=True)
                try:
                    # under the lock: close() joins only started threads
                    t.start()
                except RuntimeError:    # no thread to be had (memory, limits): refuse this one
                    self.refused += 1
                    conn.close()
                    continue
                self._conns[conn.fileno()] = conn
                self._threads.add(t)

    def _serve(self, conn: socket.socket) -> None:
        fd = conn.fileno()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            P.server_handshake(conn, self._secret, self._cid, self.handshake_timeout)
            while not self._closed:
                _, payload = P.recv_frame(conn, (P.GET,), self.idle_timeout, self.body_timeout)
                rid, indices = P.unpack_get(payload)
                for i in indices:
                    if i >= self._n:
                        raise P.ProtocolError(f"sample {i} out of range (n={self._n})")
                    self._send_one(conn, rid, i)
        except (P.ProtocolError, OSError, ValueError):
            pass    # that client is gone or broke the protocol: drop it, keep serving the others
        finally:
            with self._lock:
                self._conns.pop(fd, None)
                self._threads.discard(threading.current_thread())
            try:
                # the connection itself, not just our descriptor: a process
                # forked from ours (a loader worker) holds a copy of it
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                conn.close()
            except OSError:
                pass

    def _send_one(self, conn: socket.socket, rid: int, i: int) -> None:
        try:
            data = self.cache.get(i, count=False)   # a peer's lookup: not this node's hit or miss
        except Exception:   # an unreadable entry is as good as absent
            data = None
        if data is None or len(data) > P.MAX_SAMPLE:
            self.absent += 1
            P.send_frame(conn, P.ITEM, P.pack_item_header(rid, i, P.ABSENT))
            return
        P.send_frame(conn, P.ITEM, P.pack_item_header(rid, i, P.HERE), data)
        self.samples_served += 1
        self.bytes_served += len(data)
        note = getattr(self.cache, "note_peer_out", None)
        if note is not None:
            note(len(data))
