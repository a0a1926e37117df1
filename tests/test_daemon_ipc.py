"""The daemon's local transport (coordl.daemon.ipc): private directory,
peer uid checked on both ends, bounded JSON frames with descriptors."""
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

from coordl.daemon import ipc

SETPRIV = shutil.which("setpriv")
needs_root = pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None,
                                reason="needs root and setpriv to run a peer as another uid")
# the peer runs as `nobody`, who cannot read this interpreter's site-packages:
# it loads ipc.py (standard library only) by path
LOAD_IPC = textwrap.dedent(f"""
    import importlib.util
    _spec = importlib.util.spec_from_file_location("ipc", {os.path.abspath(ipc.__file__)!r})
    ipc = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(ipc)
""")


@pytest.fixture
def rundir(tmp_path, monkeypatch):
    d = tmp_path / "run"
    monkeypatch.setenv("COORDL_RUN_DIR", str(d))
    return d


def _server(path):
    s = ipc.listen(path)
    out = {}

    def serve():
        try:
            with ipc.accept(s, timeout=10) as c:
                msg, fds = c.recv(timeout=10)
                out["msg"], out["data"] = msg, [os.pread(fd, 64, 0) for fd in fds]
                for fd in fds:
                    os.close(fd)
                c.send({"ok": True})
        except BaseException as e:
            out["error"] = e
        finally:
            s.close()

    t = threading.Thread(target=serve)
    t.start()
    return t, out


def test_round_trip_with_descriptors(rundir):
    path = os.path.join(ipc.run_dir(), "d.sock")
    t, out = _server(path)
    fd = os.memfd_create("payload")
    os.write(fd, b"shared bytes")
    with ipc.connect(path) as c:
        c.send({"op": "hello", "n": [1, 2]}, fds=[fd])
        assert c.recv(timeout=10) == ({"ok": True}, [])
    os.close(fd)
    t.join(10)
    assert out["msg"] == {"op": "hello", "n": [1, 2]} and out["data"] == [b"shared bytes"]


def test_directory_is_private_and_socket_is_0600(rundir):
    d = ipc.run_dir()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    path = os.path.join(d, "d.sock")
    s = ipc.listen(path)
    try:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        with pytest.raises(OSError, match="already listens"):
            ipc.listen(path)  # one server per name
    finally:
        s.close()
    s = ipc.listen(path)  # a stale socket file (server gone) is replaced
    s.close()


@pytest.mark.parametrize("how", ["mode", "symlink"])
def test_unsafe_directory_refused(tmp_path, monkeypatch, how):
    d = tmp_path / "run"
    if how == "mode":
        d.mkdir()
        d.chmod(0o777)
    else:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        d.symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv("COORDL_RUN_DIR", str(d))
    with pytest.raises(ipc.PeerRefused, match="refusing the socket directory"):
        ipc.run_dir()


def _raw_client(path, data: bytes):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(data)
    return s


@pytest.mark.parametrize("frame,error", [
    (b"XX\x01\x00\x00\x00\x00\x02{}", ipc.ProtocolError),                                # bad magic
    (struct.pack(">2sBBI", b"CD", 1, 0, ipc.MAX_BODY + 1), ipc.ProtocolError),          # oversized
    (struct.pack(">2sBBI", b"CD", 1, 0, 5) + b"nope!", ipc.ProtocolError),              # not JSON
    (struct.pack(">2sBBI", b"CD", 1, 0, 2) + b"[]", ipc.ProtocolError),                 # not an object
    (struct.pack(">2sBBI", b"CD", 1, 0, 100) + b'{"a":', TimeoutError),                # truncated, open
    (struct.pack(">2sBBI", b"CD", 1, 0, 100) + b'{"a":', ConnectionError),             # truncated, closed
])
def test_bad_frames_are_refused_never_hang(rundir, frame, error):
    path = os.path.join(ipc.run_dir(), "d.sock")
    s = ipc.listen(path)
    try:
        raw = _raw_client(path, frame)
        with ipc.accept(s, timeout=10) as c:
            if error is ConnectionError:
                raw.shutdown(socket.SHUT_WR)
            with pytest.raises(error):
                c.recv(timeout=1.0)
        raw.close()
    finally:
        s.close()


def test_too_many_descriptors_refused_and_closed(rundir):
    path = os.path.join(ipc.run_dir(), "d.sock")
    s = ipc.listen(path)
    fds = [os.memfd_create("x") for _ in range(ipc.MAX_FDS + 4)]
    before = len(os.listdir("/proc/self/fd"))
    try:
        raw = _raw_client(path, b"")
        body = b"{}"
        import array
        raw.sendmsg([struct.pack(">2sBBI", b"CD", 1, 0, len(body)) + body],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        with ipc.accept(s, timeout=10) as c:
            with pytest.raises(ipc.ProtocolError, match="descriptors"):
                c.recv(timeout=5)
        raw.close()
    finally:
        for fd in fds:
            os.close(fd)
        s.close()
    assert len(os.listdir("/proc/self/fd")) <= before  # nothing received was leaked


def _as_nobody(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                           sys.executable, "-c", code, *args],
                          capture_output=True, text=True, timeout=timeout)


@needs_root
def test_client_of_another_user_is_refused_even_if_it_can_reach_the_socket():
    """A socket another user could reach (mode opened by hand): the server
    still refuses the peer by its kernel credentials and says why."""
    d = tempfile.mkdtemp(prefix="coordl-ipc-test-", dir="/tmp")
    try:
        os.chmod(d, 0o755)
        path = os.path.join(d, "d.sock")
        s = ipc.listen(path)
        os.chmod(path, 0o666)
        out = {}

        def serve():
            try:
                ipc.accept(s, timeout=30)
            except BaseException as e:
                out["error"] = e

        t = threading.Thread(target=serve)
        t.start()
        r = _as_nobody(LOAD_IPC + textwrap.dedent("""
            import sys, socket
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(sys.argv[1])
            c = ipc.Conn(s, 0)
            print(c.recv(timeout=10)[0])
        """), path)
        t.join(30)
        s.close()
        assert isinstance(out.get("error"), ipc.PeerRefused), out
        assert "refused" in r.stdout, r.stdout + r.stderr
    finally:
        shutil.rmtree(d)


@needs_root
def test_server_of_another_user_is_refused_by_the_client():
    d = tempfile.mkdtemp(prefix="coordl-ipc-test-", dir="/tmp")
    try:
        os.chmod(d, 0o1777)
        path = os.path.join(d, "d.sock")
        p = subprocess.Popen([SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                              sys.executable, "-c", LOAD_IPC + textwrap.dedent("""
            import os, sys
            s = ipc.listen(sys.argv[1])
            os.chmod(sys.argv[1], 0o666)
            print("ready", flush=True)
            s.settimeout(30)
            try:
                c, _ = s.accept()
                c.recv(1)
            except OSError:
                pass
        """), path], stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            with pytest.raises(ipc.PeerRefused, match="belongs to uid"):
                ipc.connect(path)
        finally:
            p.kill()
            p.wait(10)
            p.stdout.close()
    finally:
        shutil.rmtree(d)


def test_an_answer_written_before_the_server_closed_is_read_even_if_the_request_cannot_go():
    """A daemon past its client limit writes why it refuses and closes at
    accept, maybe before the job's request arrives: the job's send then
    fails with a broken pipe, and it used to report "cannot reach the node
    daemon (Broken pipe)" instead of the daemon's reason."""
    a, b = socket.socketpair()
    server, client = ipc.Conn(a, 0), ipc.Conn(b, 0)
    server.send({"op": "refused", "why": "too many clients (COORDL_DAEMON_MAX_CLIENTS=8)"})
    server.close()
    with pytest.raises(BrokenPipeError):     # what a plain send does now
        client.send({"op": "join"})
    client.close()
    c2a, c2b = socket.socketpair()
    server, client = ipc.Conn(c2a, 0), ipc.Conn(c2b, 0)
    server.send({"op": "refused", "why": "too many clients (COORDL_DAEMON_MAX_CLIENTS=8)"})
    server.close()
    reply, fds = client.ask({"op": "join"}, timeout=5)
    assert reply == {"op": "refused", "why": "too many clients (COORDL_DAEMON_MAX_CLIENTS=8)"} and fds == []
    client.close()
    # a bare close (nothing written) is still a lost connection, not an answer
    c3a, c3b = socket.socketpair()
    c3a.close()
    with pytest.raises(ConnectionError):
        ipc.Conn(c3b, 0).ask({"op": "join"}, timeout=5)
    c3b.close()
