"""Where a node's cache server runs: in the node daemon when one runs (it
outlives the job's processes' churn and keeps serving threads out of the
training process), else in the node's lowest rank's process.

:class:`DaemonHosted` asks the daemon to serve (``{"op": "peer_serve"}``
over the user's private socket, SO_PEERCRED-checked, carrying the job
secret) and keeps that connection open: the daemon serves exactly as long
as the connection lives, so a job killed with SIGKILL stops its server with
it (the kernel closes the socket).  If the daemon dies (even SIGKILL), a
watcher thread sees that connection reach EOF at once and brings the server
back on the same address, in this process (:meth:`ensure`), so the other nodes, which retry a failed peer one timeout
later, are served again within about one timeout; :meth:`ensure` also runs
at each pass start.
"""
from __future__ import annotations

import os
import select
import threading
import warnings

__all__ = ["start_server", "DaemonHosted"]


class DaemonHosted:
    """The node's cache server, run by the node daemon for this job."""

    def __init__(self, cache, cache_spec: dict, secret: bytes, host: str, port: int, start_daemon: bool) -> None:
        self.cache = cache           # this process's own hold, for serving here if the daemon cannot
        self.cache_spec = dict(cache_spec)
        self._secret = bytes(secret)
        self.host = host
        self.conn = None
        self.local = None            # a PeerServer in this process, after the daemon went away
        self._lock = threading.RLock()
        self._closed = False
        self.restarts = 0
        self.address = self._ask(port, start_daemon)
        self._wake_r, self._wake_w = os.pipe()
        self._watch = threading.Thread(target=self._watch_loop, name="coordl-peer-watch", daemon=True)
        self._watch.start()

    def _watch_loop(self) -> None:
        """Serve again as soon as the daemon's connection ends (its death)."""
        while not self._closed:
            with self._lock:
                conn = self.conn
            p = select.poll()
            p.register(self._wake_r, select.POLLIN)
            if conn is not None:
                p.register(conn.sock, select.POLLIN)
            ready = {fd for fd, _ in p.poll(None if conn is not None else 1000)}
            if self._closed or self._wake_r in ready:
                return
            if (conn is not None and ready) or (conn is None and self.local is None):
                try:
                    self.ensure()
                except Exception as e:     # never silent: said, and retried at the next pass start
                    warnings.warn(f"coordl: serving this node's cache again failed ({e})", stacklevel=1)
            if self.local is not None:
                return                     # served from this process now: nothing left to watch

    def _ask(self, port: int, start_daemon: bool):
        from ..daemon import ipc
        from ..daemon import server as daemon

        if start_daemon:
            daemon.start()
        conn = ipc.connect(daemon.socket_path(), timeout=10.0)
        try:
            conn.send({"op": "peer_serve", "cache": self.cache_spec, "secret": self._secret.hex(),
                       "host": self.host, "port": port}, timeout=10.0)
            reply, fds = conn.recv(timeout=30.0)
            for fd in fds:
                os.close(fd)
        except BaseException:
            conn.close()
            raise
        if reply.get("op") != "serving":
            conn.close()
            raise ConnectionError(f"the node daemon would not serve peers: {reply.get('why', reply)}")
        self.conn = conn
        return tuple(reply["address"])

    @property
    def in_daemon(self) -> bool:
        return self.local is None

    def alive(self) -> bool:
        if self.local is not None:
            return True
        if self.conn is None:
            return False
        try:
            p = select.poll()     # (poll, not select: descriptors past 1024)
            p.register(self.conn.sock, select.POLLIN)
            r = p.poll(0)
        except (OSError, ValueError):
            return False
        return not r    # the daemon never writes again on this connection: readable means EOF

    def ensure(self) -> None:
        """If the daemon serving us died, serve again on the same address."""
        with self._lock:
            if self._closed or self.alive():
                return
            self.restarts += 1
            self._ensure()

    def _ensure(self) -> None:
        # The daemon died: serve from this process at once, on the same
        # address (a new daemon takes seconds to start; this takes
        # milliseconds, and the other nodes retry a failed peer one timeout
        # later).  A daemon that is already running again is asked only if
        # this process cannot bind the port.
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        port = int(self.address[1])
        from .server import PeerServer

        try:
            self.local = PeerServer(self.cache, self._secret, self.host, port, key=self.cache_spec["fingerprint"])
            return
        except (OSError, ValueError) as e:
            why = e
        try:
            self._ask(port, start_daemon=False)
        except (OSError, ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
            warnings.warn(f"coordl: cannot serve this node's cache to peers again ({why}; {e}); the "
                          "other nodes read its samples from storage", stacklevel=3)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._watch is not threading.current_thread():
            self._watch.join(10)
        with self._lock:
            if self.conn is not None:
                self.conn.close()
                self.conn = None
            if self.local is not None:
                self.local.close()
                self.local = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _daemon_running() -> bool:
    from ..daemon import server as daemon

    try:
        return daemon.status(timeout=2.0) is not None
    except (OSError, ConnectionError, TimeoutError, ValueError):
        return False


def start_server(cache, cache_spec: dict, secret: bytes, host: str, port: int, share: bool):
    """This node's cache server: in the node daemon when one runs (or this
    job shares prep, which starts it), else a :class:`PeerServer` here."""
    if share or _daemon_running():
        try:
            return DaemonHosted(cache, cache_spec, secret, host, port, start_daemon=share)
        except (OSError, ConnectionError, TimeoutError, RuntimeError, KeyError, ValueError) as e:
            warnings.warn(f"coordl: the node daemon cannot serve peers ({e}); serving from this process",
                          stacklevel=3)
    from .server import PeerServer

    return PeerServer(cache, secret, host, port, key=cache_spec["fingerprint"])
