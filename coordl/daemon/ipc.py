"""Local transport for the node daemon: per-user Unix sockets, peer uid
checked on both ends, bounded framed messages that may carry descriptors.

* **Where**: ``$COORDL_RUN_DIR``, else ``$XDG_RUNTIME_DIR/coordl``, else
  ``/tmp/coordl-<uid>``; created 0700 and checked on every use (a real
  directory, ours, no group/other bits), so another user can neither reach
  a socket in it nor plant one.
* **Who**: both ends read the other's credentials from the kernel
  (``SO_PEERCRED``) and refuse a peer of another uid; the server tells the
  refused client why before closing.
* **What**: a frame is an 8-byte header (magic ``b"CD"``, version, flags,
  body length) and a UTF-8 JSON object of at most :data:`MAX_BODY` bytes,
  with up to :data:`MAX_FDS` descriptors passed alongside (``SCM_RIGHTS``),
  e.g. shared-memory segments.  JSON only: nothing received is unpickled,
  so a malformed or hostile frame can only be refused.  Every receive has a
  timeout; a frame that breaks the rules raises :class:`ProtocolError` and
  the connection is not used again.
"""
from __future__ import annotations

import array
import collections
import errno
import json
import os
import socket
import stat
import struct
import time

__all__ = ["run_dir", "run_dir_path", "listen", "connect", "accept", "Conn", "ProtocolError", "PeerRefused",
           "MAX_BODY", "MAX_FDS"]

MAGIC = b"CD"
VERSION = 1
MAX_BODY = 1 << 20      # bytes of JSON in one frame
MAX_FDS = 16            # descriptors in one frame
_HDR = struct.Struct(">2sBBI")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class ProtocolError(ConnectionError):
    """A frame broke the protocol (magic, version, size, JSON, descriptors)."""


class PeerRefused(PermissionError):
    """The other end of a connection belongs to another user."""


def run_dir_path() -> str:
    """Where :func:`run_dir` is, neither made nor checked (for messages)."""
    path = os.environ.get("COORDL_RUN_DIR")
    if not path:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        path = os.path.join(xdg, "coordl") if xdg else f"/tmp/coordl-{os.geteuid()}"
    return path


def run_dir(create: bool = True) -> str:
    """This user's private directory for coordl's sockets (checked); with
    ``create=False`` a missing one raises ``FileNotFoundError``."""
    path = run_dir_path()
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    st = os.lstat(path)
    problems = []
    if not stat.S_ISDIR(st.st_mode):
        problems.append("it is a symlink or not a directory")
    if st.st_uid != os.geteuid():
        problems.append(f"it is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        problems.append(f"its mode is {stat.S_IMODE(st.st_mode):04o}, open to other users (should be 0700)")
    if problems:
        raise PeerRefused(f"coordl: refusing the socket directory {path}: {'; '.join(problems)}. Remove it "
                          "(as its owner or root) or set COORDL_RUN_DIR to a private directory; if another "
                          "user created it, they may be trying to intercept your jobs")
    return path


def _peer_uid(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def listen(path: str, backlog: int = 64) -> socket.socket:
    """A listening socket at ``path`` (0600).  A stale socket file left by a
    dead server is replaced; a live one is an error (one server per name)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        old = os.umask(0o177)
        try:
            s.bind(path)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            if _answers(path):
                raise OSError(errno.EADDRINUSE, f"a server already listens on {path}") from None
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
                raise PeerRefused(f"coordl: refusing to replace {path}: not a socket of yours") from None
            os.unlink(path)
            s.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        s.listen(backlog)
    except BaseException:
        s.close()
        raise
    return s


def _answers(path: str) -> bool:
    t = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    t.settimeout(1.0)
    try:
        t.connect(path)
        return True
    except OSError:
        return False
    finally:
        t.close()


def accept(server: socket.socket, timeout: float | None = None) -> "Conn":
    """The next client, if it is this user's; another user's is told why
    and refused (:class:`PeerRefused`, its connection closed)."""
    server.settimeout(timeout)
    s, _ = server.accept()
    pid, uid = _peer_uid(s)
    if uid != os.geteuid():
        c = Conn(s, pid)
        try:   # a short deadline: the refused client cannot hold the server
            c.send({"error": f"refused: this coordl server belongs to uid {os.geteuid()}, you are uid {uid}"},
                   timeout=0.5)
        except OSError:
            pass
        c.close()
        raise PeerRefused(f"coordl: refused a connection from pid {pid} of uid {uid}")
    return Conn(s, pid)


def connect(path: str, timeout: float = 10.0) -> "Conn":
    """Connect to the server at ``path``, refusing one run by another user."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    deadline = time.monotonic() + timeout
    try:
        while True:
            s.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                s.connect(path)
                break
            except BlockingIOError:   # the server's listen backlog is full: it is busy, not gone
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"coordl: the server at {path} did not accept a connection within "
                                       f"{timeout:g} s (its queue of connections stayed full)") from None
                time.sleep(0.02)
        pid, uid = _peer_uid(s)
        if uid != os.geteuid():
            raise PeerRefused(f"coordl: the server at {path} (pid {pid}) belongs to uid {uid}, not to you "
                              f"(uid {os.geteuid()}); refusing to talk to it")
    except BaseException:
        s.close()
        raise
    return Conn(s, pid)


class Conn:
    """One connection: :meth:`send` and :meth:`recv` of framed messages."""

    def __init__(self, sock: socket.socket, peer_pid: int) -> None:
        self.sock = sock
        self.peer_pid = peer_pid
        # non-blocking use (the daemon): a partial frame in, frames waiting to go out
        self._rbuf = bytearray()
        self._rfds: list[int] = []
        self._rlen: int | None = None      # body length of the frame being read (header done)
        self.partial_since: float | None = None   # when the incomplete frame in _rbuf began
        self._out: collections.deque = collections.deque()   # [memoryview, [dup'd fds]]
        self.out_bytes = 0
        self.on_close = None               # called once, before the socket closes (the owner unregisters it)
        self._reg_fd: int | None = None    # the descriptor the owner's poller knows it by

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        cb, self.on_close = self.on_close, None
        if cb is not None:
            cb(self)
        for fd in self._rfds:
            os.close(fd)
        self._rfds = []
        while self._out:
            for fd in self._out.popleft()[1]:
                os.close(fd)
        self.out_bytes = 0
        self.sock.close()

    # ------------------------------------------------------------ non-blocking
    # The daemon's side: one owner thread polls many connections, so no call
    # below waits.  ``queue`` + ``write_ready`` send; ``read_ready`` returns the
    # complete frames that have arrived and keeps a partial one for later.
    def queue(self, msg: dict, fds=()) -> None:
        """Queue ``msg`` (descriptors duplicated now: the caller may close
        its own at once); :meth:`write_ready` sends what the socket takes."""
        data = _frame(msg, fds)
        dup = [os.dup(fd) for fd in fds]
        self._out.append([memoryview(data), dup])
        self.out_bytes += len(data)

    @property
    def pending_out(self) -> bool:
        return bool(self._out)

    def write_ready(self) -> bool:
        """Send what the socket takes now, without waiting; True when all is out."""
        while self._out:
            item = self._out[0]
            data, fds = item
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            try:
                n = self.sock.sendmsg([data], anc, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return False
            for fd in fds:       # they went with the first byte
                os.close(fd)
            item[1] = []
            self.out_bytes -= n
            if n < len(data):
                item[0] = data[n:]
                return False
            self._out.popleft()
        return True

    def read_ready(self, limit: int = 64) -> list[tuple[dict, list[int]]]:
        """The complete frames that have arrived (at most ``limit``), without
        waiting.  ``ConnectionError`` on EOF, ``ProtocolError`` on a bad
        frame (descriptors of a partial frame are closed with the connection)."""
        out: list = []
        space = socket.CMSG_SPACE(MAX_FDS * 4)
        try:
            while len(out) < limit:
                need = (_HDR.size if self._rlen is None else _HDR.size + self._rlen) - len(self._rbuf)
                try:   # never past this frame: descriptors then belong to the frame being read
                    data, anc, flags, _ = self.sock.recvmsg(need, space, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                for level, kind, payload in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        got = array.array("i")
                        got.frombytes(payload[: len(payload) - len(payload) % 4])
                        self._rfds.extend(got)
                if flags & socket.MSG_CTRUNC or len(self._rfds) > MAX_FDS:
                    raise ProtocolError(f"more than {MAX_FDS} descriptors in one frame")
                if not data:
                    raise ConnectionError(f"coordl: pid {self.peer_pid} closed the connection")
                if not self._rbuf:
                    self.partial_since = time.monotonic()
                self._rbuf += data
                if self._rlen is None:
                    if len(self._rbuf) < _HDR.size:
                        continue
                    magic, version, _flags, length = _HDR.unpack(bytes(self._rbuf[:_HDR.size]))
                    if magic != MAGIC or version != VERSION:
                        raise ProtocolError(f"bad frame header {bytes(self._rbuf[:_HDR.size])!r}")
                    if length > MAX_BODY:
                        raise ProtocolError(f"frame of {length} bytes announced, over the limit of {MAX_BODY}")
                    self._rlen = length
                if len(self._rbuf) < _HDR.size + self._rlen:
                    continue
                body = bytes(self._rbuf[_HDR.size:])
                fds, self._rfds = self._rfds, []
                self._rbuf.clear()
                self._rlen = None
                self.partial_since = None
                try:
                    msg = json.loads(body)
                    if not isinstance(msg, dict):
                        raise ValueError(f"a JSON object expected, got {type(msg).__name__}")
                except (UnicodeDecodeError, ValueError) as e:
                    for fd in fds:
                        os.close(fd)
                    raise ProtocolError(f"frame body is not a JSON object: {e}") from None
                out.append((msg, fds))
        except BaseException:
            for _, fds in out:
                for fd in fds:
                    os.close(fd)
            raise
        return out

    def __enter__(self) -> "Conn":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send(self, msg: dict, fds=(), timeout: float | None = 30.0) -> None:
        fds = list(fds)
        data = _frame(msg, fds)
        self.sock.settimeout(timeout)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        sent = self.sock.sendmsg([data], anc)
        if sent < len(data):
            self.sock.sendall(data[sent:])

    def ask(self, msg: dict, fds=(), timeout: float | None = 30.0) -> tuple[dict, list[int]]:
        """Send ``msg`` and return the answer.  A server that refuses a
        client at once (past its client limit) writes why and closes, maybe
        before the request arrives: the send then fails with a broken pipe,
        but the refusal is still there to read, so it is read."""
        try:
            self.send(msg, fds, timeout)
        except (BrokenPipeError, ConnectionResetError):
            pass    # recv gives the answer written before the close, or ConnectionError on a bare EOF
        return self.recv(timeout)

    def recv(self, timeout: float | None = 30.0) -> tuple[dict, list[int]]:
        """The next message and the descriptors that came with it (the
        caller owns them).  ``ConnectionError`` on EOF, ``TimeoutError`` when
        nothing complete arrives in time, ``ProtocolError`` on a bad frame."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fds: list[int] = []
        try:
            head = self._read(_HDR.size, deadline, fds)
            magic, version, _flags, length = _HDR.unpack(head)
            if magic != MAGIC or version != VERSION:
                raise ProtocolError(f"bad frame header {head!r} (magic {MAGIC!r}, version {VERSION} expected)")
            if length > MAX_BODY:
                raise ProtocolError(f"frame of {length} bytes announced, over the limit of {MAX_BODY}")
            body = self._read(length, deadline, fds)
            try:
                msg = json.loads(body)
            except (UnicodeDecodeError, ValueError) as e:
                raise ProtocolError(f"frame body is not JSON: {e}") from None
            if not isinstance(msg, dict):
                raise ProtocolError(f"frame body should be a JSON object, but got {type(msg).__name__}")
            return msg, fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _read(self, n: int, deadline, fds: list[int]) -> bytes:
        buf = bytearray()
        space = socket.CMSG_SPACE(MAX_FDS * 4)
        while len(buf) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"coordl: no complete message from pid {self.peer_pid} in time")
                self.sock.settimeout(left)
            else:   # no deadline: wait as long as it takes (not the last send's timeout)
                self.sock.settimeout(None)
            try:
                data, anc, flags, _ = self.sock.recvmsg(n - len(buf), space)
            except socket.timeout:
                raise TimeoutError(f"coordl: no complete message from pid {self.peer_pid} in time") from None
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(payload[: len(payload) - len(payload) % 4])
                    fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError(f"more than {MAX_FDS} descriptors in one frame")
            if len(fds) > MAX_FDS:
                raise ProtocolError(f"more than {MAX_FDS} descriptors in one frame")
            if not data:
                raise ConnectionError(f"coordl: pid {self.peer_pid} closed the connection")
            buf += data
        return bytes(buf)


def _frame(msg: dict, fds) -> bytes:
    if not isinstance(msg, dict):
        raise TypeError(f"msg should be a dict, but got msg={type(msg).__name__}")
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_BODY:
        raise ValueError(f"message of {len(body)} bytes is over the frame limit of {MAX_BODY}")
    if len(fds) > MAX_FDS:
        raise ValueError(f"{len(fds)} descriptors in one message, over the limit of {MAX_FDS}")
    return _HDR.pack(MAGIC, VERSION, 0, len(body)) + body
