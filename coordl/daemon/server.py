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
import selectors
import signal
import subprocess
import sys
import time

from ..base.units import env_seconds as _env_seconds
from . import ipc
from .hub import DEFAULT_STAGING, Hub

__all__ = ["start", "stop", "status", "serve", "socket_path"]

_TICK = 0.5


def _stem() -> str:
    """``daemon``, or ``daemon-<node>`` under ``COORDL_NODE_ID`` (several
    "nodes" on one machine each have their own daemon, as their own caches)."""
    node = os.environ.get("COORDL_NODE_ID")
    if not node:
        return "daemon"
    import re

    return "daemon-" + re.sub(r"[^0-9A-Za-z_.-]", "_", node)[:64]


def socket_path(create: bool = True) -> str:
    """The daemon's socket; ``create=False`` (asking for a daemon, not
    starting one): a missing run directory raises ``FileNotFoundError``
    instead of being made."""
    return os.path.join(ipc.run_dir(create), _stem() + ".sock")


def socket_name() -> str:
    """Where the daemon's socket is or would be (for messages: nothing is
    made or checked)."""
    return os.path.join(ipc.run_dir_path(), _stem() + ".sock")


def _lock_path() -> str:
    return os.path.join(ipc.run_dir(), _stem() + ".lock")


def _log_path() -> str:
    return os.path.join(ipc.run_dir(), _stem() + ".log")


def status(timeout: float = 5.0) -> dict | None:
    """The running daemon's status, or None if none answers; ``Refused``
    (a ``RuntimeError``) if one runs but refuses new clients (past its limit)."""
    try:
        return _probe(timeout)
    except TimeoutError:
        return None   # one runs, but does not answer (stopped, hung)


class Refused(RuntimeError):
    """The daemon runs but refused this client (past its client limit)."""


def _answer(c: ipc.Conn, msg: dict, timeout: float) -> dict:
    """``msg``'s answer; ``Refused`` when the daemon refused this client
    (it writes why at accept and closes, maybe before the request arrives:
    ``ask`` reads that answer even when the send broke)."""
    reply = c.ask(msg, timeout=timeout)[0]
    if reply.get("op") == "refused":
        raise Refused(f"the coordl daemon at {socket_name()} runs but refused this client: {reply.get('why')}")
    return reply


def _probe(timeout: float) -> dict | None:
    """The daemon's status; None if none runs; ``TimeoutError`` if one
    holds the socket but does not answer within ``timeout``; ``Refused`` if
    it runs but refuses new clients."""
    try:
        with ipc.connect(socket_path(create=False), timeout=timeout) as c:
            return _answer(c, {"op": "status"}, timeout)
    except TimeoutError:
        raise TimeoutError(f"the coordl daemon at {socket_name()} does not answer within {timeout:g} s "
                           "(stopped or hung; `coordl daemon status`, or kill it and the next job starts "
                           "a new one)") from None
    except (FileNotFoundError, ConnectionError):
        return None   # none runs, or it is going away (reset mid-answer)


def answer_timeout() -> float:
    """Seconds a job gives the daemon to answer (``COORDL_DAEMON_TIMEOUT``,
    default 10): past it, a daemon that holds its socket is taken as hung."""
    return _env_seconds("COORDL_DAEMON_TIMEOUT", 10.0)


def socket_id() -> tuple[int, int, int] | None:
    """(device, inode, change time in ns) of the daemon's socket file: a new
    daemon binds a new one.  The time is part of it because a file system
    gives a freed inode number to the next file it makes (the socket of a
    daemon started right after one was SIGKILLed often has the same one)."""
    try:
        st = os.stat(socket_path(create=False))
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def start(timeout: float = 30.0, answer: float | None = None) -> int:
    """Start the daemon detached unless one runs; its pid.  One that holds
    the socket but does not answer in ``answer`` s (default :func:`timeout`)
    raises ``TimeoutError`` (a second daemon could not take its place)."""
    st = _probe(answer if answer is not None else answer_timeout())
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
            poller = selectors.DefaultSelector()
            poller.register(r, selectors.EVENT_READ)
            try:
                got = left > 0 and poller.select(left)
            finally:
                poller.close()
            if not got:
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
        with ipc.connect(socket_path(create=False), timeout=timeout) as c:
            _answer(c, {"op": "stop"}, timeout)
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
    """Run the daemon in this process until stopped.

    One owner thread, every socket non-blocking behind one ``selectors``
    poller (epoll: no limit on descriptor numbers).  Nothing a client, a
    member or a worker does can make this loop wait: a frame is taken only
    once it is complete (a partial one is kept, and the client dropped if it
    stays partial for ``COORDL_DAEMON_CLIENT_TIMEOUT`` s), answers are queued
    and sent as the socket takes them (a client whose unsent answers pass
    :data:`_OUT_LIMIT` is dropped), and a worker that makes no progress on
    its samples within ``COORDL_DAEMON_WORKER_STALL`` s is replaced
    (:meth:`Hub.check_workers`).  Clients past :func:`_max_clients` are told
    why and refused."""
    lock = os.open(_lock_path(), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    # Another daemon holds the lock: say so, and who, once it answers (it may have taken the lock and
    # not listen yet: a concurrent start).  If it goes without answering, the lock is ours.
    deadline = time.monotonic() + answer_timeout()
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            st = status()
            if st is not None or time.monotonic() > deadline:
                os.close(lock)
                if st is None:
                    print(f"coordl daemon: another process holds {_lock_path()} and did not answer in "
                          f"{answer_timeout():g} s", file=sys.stderr, flush=True)
                    return 1   # start() says it failed, with this log line
                if ready_fd is not None:
                    os.write(ready_fd, f"running {st['pid']}\n".encode())
                return 0
            time.sleep(0.05)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))  # only a flag; the loop acts
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    max_clients = _max_clients()
    path = socket_path()
    server = ipc.listen(path, backlog=256)  # under the lock: nobody else replaces the name meanwhile
    server.setblocking(False)
    mine = os.stat(path)
    started = time.time()
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ, None)
    conns: dict[int, ipc.Conn] = {}      # fd -> a client (job, member, status/stop caller)
    masks: dict[int, int] = {}            # fd -> events registered
    kinds: dict[int, str] = {}            # fd -> "client" | "worker"
    client_timeout = _env_seconds("COORDL_DAEMON_CLIENT_TIMEOUT", 10.0)
    hub = Hub(staging_bytes if staging_bytes is not None else _staging_default())

    def unregister(c: ipc.Conn) -> None:
        fd = getattr(c, "_reg_fd", None)
        if fd is None:
            return
        c._reg_fd = None
        conns.pop(fd, None)
        masks.pop(fd, None)
        kinds.pop(fd, None)
        try:
            sel.unregister(fd)
        except (KeyError, ValueError):
            pass

    def register(c: ipc.Conn, kind: str) -> None:
        fd = c.fileno()
        c.sock.setblocking(False)
        c._reg_fd = fd
        c.on_close = unregister           # whoever closes it (hub or loop), it leaves the poller first
        kinds[fd] = kind
        masks[fd] = selectors.EVENT_READ
        sel.register(fd, selectors.EVENT_READ, c)
        if kind == "client":
            conns[fd] = c

    def drop(c: ipc.Conn, why: str | None = None) -> None:
        if why:
            print(f"coordl daemon: dropping pid {c.peer_pid}: {why}", file=sys.stderr, flush=True)
        hub.member_gone(c)                # closes it (and so unregisters it)
        c.close()

    def accept() -> None:
        for _ in range(64):               # a burst at a time; the rest next round
            try:
                c = ipc.accept(server, timeout=0.0)
            except (BlockingIOError, InterruptedError, TimeoutError):
                return
            except ipc.PeerRefused as e:
                print(f"coordl daemon: {e}", file=sys.stderr, flush=True)
                continue
            except OSError as e:          # out of descriptors: refuse by not accepting for a moment
                print(f"coordl daemon: cannot accept a client: {e}", file=sys.stderr, flush=True)
                return
            if len(conns) >= max_clients:
                try:
                    c.sock.setblocking(False)
                    c.queue({"op": "refused", "why": f"the coordl daemon serves {len(conns)} clients, its "
                                                     f"limit (COORDL_DAEMON_MAX_CLIENTS={max_clients}); "
                                                     "this job prepares its own samples"})
                    c.write_ready()
                except OSError:
                    pass
                c.close()
                continue
            register(c, "client")

    def client_msgs(c: ipc.Conn) -> None:
        for msg, fds in c.read_ready():
            if c._reg_fd is None:         # dropped by an earlier message of this round
                for fd in fds:
                    os.close(fd)
                continue
            op = msg.get("op")
            if op in ("status", "stop", "ping"):
                for fd in fds:
                    os.close(fd)
                if op == "status":
                    hub.reply(c, {"pid": os.getpid(), "uptime": time.time() - started,
                                  "clients": len(conns), "max_clients": max_clients, **hub.status()})
                elif op == "ping":
                    hub.reply(c, {"op": "pong", **hub.progress_of(c)})
                else:
                    hub.reply(c, {"ok": True})
                    stopping.append(True)
            else:
                try:
                    hub.member_msg(c, msg, fds)
                except (KeyError, ValueError, TypeError, AttributeError) as e:
                    # a malformed message (fields missing or of the wrong type): that client goes, the daemon stays
                    hub.reply(c, {"op": "error", "why": f"bad message: {type(e).__name__}: {e}"})
                    c.write_ready()
                    drop(c, f"bad message: {type(e).__name__}: {e}")
                    return

    last = time.monotonic()
    try:
        if ready_fd is not None:
            os.write(ready_fd, f"ready {os.getpid()}\n".encode())
            os.close(ready_fd)
        while not stopping:
            for w in hub.workers:         # (new or replaced workers join the poller here)
                if getattr(w.conn, "_reg_fd", None) is None and w.conn.fileno() >= 0:
                    register(w.conn, "worker")
            for fd, c in list(conns.items()) + [(w.conn._reg_fd, w.conn) for w in hub.workers]:
                want = selectors.EVENT_READ | (selectors.EVENT_WRITE if c.pending_out else 0)
                if fd is not None and masks.get(fd) != want:
                    masks[fd] = want
                    sel.modify(fd, want, c)
            events = sel.select(_TICK)
            now = time.monotonic()
            if now - last > 2 * _TICK + 1.0:   # this process did not run (stopped): no clock ran on others
                hub.paused(now - last)
                for c in conns.values():
                    if c.partial_since is not None:
                        c.partial_since += now - last
            for key, mask in events:
                c = key.data
                if c is None:
                    accept()
                    continue
                if getattr(c, "_reg_fd", None) != key.fd:
                    continue              # closed while handling an earlier event of this round
                w = hub.is_worker(c)
                try:
                    if mask & selectors.EVENT_WRITE:
                        c.write_ready()
                    if mask & selectors.EVENT_READ:
                        if w is not None:
                            for msg, fds in c.read_ready():
                                hub.worker_msg(w, msg, fds)
                        else:
                            client_msgs(c)
                except (ConnectionError, OSError) as e:
                    if w is not None:
                        hub.worker_gone(w)
                    else:
                        drop(c, None if isinstance(e, ConnectionError) and not isinstance(e, ipc.ProtocolError)
                             else f"{type(e).__name__}: {e}")
                except Exception as e:   # a bug must cost that client, not the daemon
                    import traceback

                    traceback.print_exc()
                    if w is not None:
                        hub.worker_gone(w)
                    else:
                        drop(c, f"internal error: {type(e).__name__}: {e}")
            for c in list(conns.values()):   # partial frames left hanging, answers nobody reads
                if c.partial_since is not None and now - c.partial_since > client_timeout:
                    drop(c, f"an incomplete message for {client_timeout:g} s")
                elif c.out_bytes > _OUT_LIMIT:
                    drop(c, f"{c.out_bytes} bytes of answers it does not read")
            try:
                hub.check_workers()
                hub.pump()
                for c in list(conns.values()) + [w.conn for w in hub.workers]:
                    if c.pending_out and c.fileno() >= 0:
                        try:
                            c.write_ready()
                        except OSError:
                            pass          # its next read reports it
            except Exception:
                import traceback

                traceback.print_exc()
            last = time.monotonic()
    finally:
        hub.stop()
        for c in list(conns.values()):
            c.close()
        sel.close()
        server.close()
        try:  # remove the socket only while the name is still the one we bound
            now_st = os.stat(path)
            if (now_st.st_dev, now_st.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(path)
        except OSError:
            pass
        os.close(lock)
    return 0


_OUT_LIMIT = 8 << 20   # bytes of unsent answers to one client before it is dropped


def _max_clients() -> int:
    """Clients served at once: ``COORDL_DAEMON_MAX_CLIENTS``, else what the
    descriptor limit allows (raised to its hard limit first), leaving room
    for groups, workers and caches.  Past it, new clients are refused."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 16
    want = min(want, 1 << 16)
    if soft == resource.RLIM_INFINITY or soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    room = max(16, (min(soft, 1 << 16) - 256) // 2)
    v = os.environ.get("COORDL_DAEMON_MAX_CLIENTS")
    if v:
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"COORDL_DAEMON_MAX_CLIENTS should be an integer, but got {v!r}") from None
        return max(1, min(n, room))
    return room


def _staging_default() -> int:
    v = os.environ.get("COORDL_STAGING")
    if not v:
        return DEFAULT_STAGING
    from ..base.units import parse_size

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
