"""The node daemon's process: one per user per node, found at a socket in
the user's private run directory (:func:`coordl.daemon.ipc.run_dir`).

Lifetime, tied to kernel objects:

* **One instance**: the daemon holds an exclusive ``flock`` on
  ``daemon.lock`` for its whole life; a second daemon cannot take it and
  exits at once.  If the daemon is killed the kernel drops the lock, and the
  next start replaces the dead daemon's socket file (nobody answers on it).
* **Detached start** (:func:`start`): ``python -m coordl.daemon.server``
  forks once more and the middle process exits, so the daemon is nobody's
  child (no zombie in a job that outlives it) and has its own session (a
  Ctrl-C in the job's terminal does not reach it).  The starter waits for
  "ready" on a pipe, or for the pipe to close, with a timeout, and then
  reports the daemon's log.
* **Stop**: a ``stop`` request, SIGTERM or SIGINT end the serve loop
  (handlers only set a flag); the daemon removes its socket (if the name
  still names it) before releasing the lock.

Groups of jobs, staging and the worker pool are in :mod:`hub` (protocol)
and :mod:`groups` (policy); the serve loop here only routes events.
"""
from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import sys
import time

from . import ipc
from .hub import DEFAULT_STAGING, Hub

__all__ = ["start", "stop", "status", "serve", "socket_path"]

_TICK = 0.5



def _readable(objs, timeout: float) -> list:
    """Those of ``objs`` (fds or objects with fileno()) readable or at EOF
    within ``timeout`` s.  poll, not select(): the daemon also hosts peer
    servers with thousands of connections, so its descriptors pass 1024."""
    p = select.poll()
    by_fd = {}
    for o in objs:
        fd = o if isinstance(o, int) else o.fileno()
        by_fd[fd] = o
        p.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ in p.poll(max(0, int(timeout * 1000)))]

def _stem() -> str:
    """``daemon``, or ``daemon-<node>`` under ``COORDL_NODE_ID`` (several
    "nodes" on one machine each have their own daemon, as their own caches)."""
    node = os.environ.get("COORDL_NODE_ID")
    if not node:
        return "daemon"
    import re

    return "daemon-" + re.sub(r"[^0-9A-Za-z_.-]", "_", node)[:64]


def socket_path() -> str:
    return os.path.join(ipc.run_dir(), _stem() + ".sock")


def _lock_path() -> str:
    return os.path.join(ipc.run_dir(), _stem() + ".lock")


def _log_path() -> str:
    return os.path.join(ipc.run_dir(), _stem() + ".log")


def status(timeout: float = 5.0) -> dict | None:
    """The running daemon's status, or None if none answers."""
    try:
        with ipc.connect(socket_path(), timeout=timeout) as c:
            c.send({"op": "status"}, timeout=timeout)
            return c.recv(timeout=timeout)[0]
    except (FileNotFoundError, ConnectionError, TimeoutError):
        return None   # none runs, or it is going away (reset mid-answer)


def start(timeout: float = 30.0) -> int:
    """Start the daemon detached unless one runs; its pid."""
    st = status()
    if st is not None:
        return int(st["pid"])
    r, w = os.pipe()
    try:
        log = os.fdopen(os.open(_log_path(), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                                | os.O_CLOEXEC, 0o600), "ab")
        try:
            p = subprocess.Popen([sys.executable, "-m", "coordl.daemon.server", "--ready-fd", str(w)],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(w,),
                                 start_new_session=True)
        finally:
            log.close()
        os.close(w)
        w = -1
        p.wait(timeout)  # the middle process exits as soon as it has forked
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not _readable([r], left):
                raise TimeoutError(f"coordl daemon did not get ready in {timeout:g} s; see {_log_path()}")
            chunk = os.read(r, 64)
            if not chunk:
                break
            line += chunk
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    words = line.split()
    if len(words) == 2 and words[0] in (b"ready", b"running"):
        return int(words[1])
    raise RuntimeError(f"coordl daemon failed to start; its log {_log_path()} ends with:\n{_tail()}")


def stop(timeout: float = 30.0) -> bool:
    """Ask the running daemon to stop and wait until it has (False: none ran)."""
    try:
        with ipc.connect(socket_path(), timeout=timeout) as c:
            c.send({"op": "stop"}, timeout=timeout)
            c.recv(timeout=timeout)
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    fd = os.open(_lock_path(), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        deadline = time.monotonic() + timeout
        while True:  # the daemon holds the lock until it is gone
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"coordl daemon did not stop in {timeout:g} s") from None
                time.sleep(0.05)
    finally:
        os.close(fd)


def _tail(n: int = 2000) -> str:
    try:
        with open(_log_path(), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no log)"


def serve(ready_fd: int | None = None, staging_bytes: int | None = None) -> int:
    """Run the daemon in this process until stopped."""
    lock = os.open(_lock_path(), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another daemon runs: say so, and who
        os.close(lock)
        st = status()
        if ready_fd is not None:
            os.write(ready_fd, f"running {st['pid'] if st else 0}\n".encode())
        return 0
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))  # only a flag; the loop acts
    path = socket_path()
    server = ipc.listen(path)  # under the lock: nobody else replaces the name meanwhile
    mine = os.stat(path)
    started = time.time()
    conns: dict[int, ipc.Conn] = {}
    hub = Hub(staging_bytes if staging_bytes is not None else _staging_default())
    try:
        if ready_fd is not None:
            os.write(ready_fd, f"ready {os.getpid()}\n".encode())
            os.close(ready_fd)
        while not stopping:
            workers = [w.conn for w in hub.workers]
            ready = _readable([server] + list(conns.values()) + workers, _TICK)
            for x in ready:
                if x is server:
                    try:
                        c = ipc.accept(server, timeout=_TICK)
                    except (ipc.PeerRefused, OSError) as e:
                        print(f"coordl daemon: {e}", file=sys.stderr, flush=True)
                        continue
                    conns[c.fileno()] = c
                    continue
                w = hub.is_worker(x)
                if w is not None:
                    try:
                        msg, fds = x.recv(timeout=10.0)
                    except (ConnectionError, TimeoutError, OSError):
                        hub.worker_gone(w)
                        continue
                    hub.worker_msg(w, msg, fds)
                    continue
                if conns.get(x.fileno()) is not x:
                    continue  # closed while handling an earlier event of this round
                try:
                    msg, fds = x.recv(timeout=5.0)
                    op = msg.get("op")
                    if op == "status":
                        for fd in fds:
                            os.close(fd)
                        x.send({"pid": os.getpid(), "uptime": time.time() - started,
                                "clients": len(conns), **hub.status()})
                    elif op == "stop":
                        for fd in fds:
                            os.close(fd)
                        x.send({"ok": True})
                        stopping.append(True)
                    else:
                        hub.member_msg(x, msg, fds)
                except (ConnectionError, TimeoutError, OSError):
                    conns.pop(x.fileno(), None)
                    hub.member_gone(x)
                    x.close()
                except (KeyError, ValueError, TypeError, AttributeError) as e:
                    # a malformed message (fields missing or of the wrong type): that client goes, the daemon stays
                    print(f"coordl daemon: dropping pid {x.peer_pid}: bad message: {type(e).__name__}: {e}",
                          file=sys.stderr, flush=True)
                    try:
                        x.send({"op": "error", "why": f"bad message: {type(e).__name__}: {e}"}, timeout=1.0)
                    except OSError:
                        pass
                    conns.pop(x.fileno(), None)
                    hub.member_gone(x)
            for fd in [fd for fd, c in conns.items() if c.sock.fileno() < 0]:
                del conns[fd]   # a member the hub dropped
            hub.pump()
    finally:
        hub.stop()
        for c in conns.values():
            c.close()
        server.close()
        try:  # remove the socket only while the name is still the one we bound
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(path)
        except OSError:
            pass
        os.close(lock)
    return 0


def _staging_default() -> int:
    v = os.environ.get("COORDL_STAGING")
    if not v:
        return DEFAULT_STAGING
    from .._units import parse_size

    return parse_size(v, "COORDL_STAGING")


def _main(argv: list[str]) -> int:
    ready_fd = int(argv[argv.index("--ready-fd") + 1]) if "--ready-fd" in argv else None
    if "--foreground" not in argv:
        if os.fork() > 0:
            os._exit(0)  # the middle process: the daemon is nobody's child
        os.setsid()
        os.chdir("/")
    return serve(ready_fd)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
