"""The node daemon's process lifecycle (coordl.daemon.server): one per user,
detached, found by its socket, stopped by request or signal, replaced after
a crash."""
import os
import signal
import stat
import threading

import psutil
import pytest

from coordl.daemon import server as S


@pytest.fixture
def rundir(tmp_path, monkeypatch):
    d = tmp_path / "run"
    monkeypatch.setenv("COORDL_RUN_DIR", str(d))
    pids = []
    yield d, pids
    S.stop(timeout=10)
    for pid in pids:  # a test that failed half-way must not leave a daemon behind
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def _gone(pid, timeout=15):
    try:
        p = psutil.Process(pid)
        p.wait(timeout)  # reaped by whoever adopted it, or a zombie of nobody we know
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return p.status() == psutil.STATUS_ZOMBIE
    return True


def test_asking_for_a_daemon_creates_no_run_directory(rundir):
    """status() and stop() where no daemon ever ran leave no directory
    behind (a test's run directory under /tmp stayed, empty, after every
    run of the suite)."""
    d, _ = rundir
    assert S.status() is None
    assert S.stop(timeout=5) is False
    assert not d.exists()


def test_start_status_stop(rundir):
    d, pids = rundir
    assert S.status() is None
    pid = S.start()
    pids.append(pid)
    p = psutil.Process(pid)
    assert p.ppid() != os.getpid()  # detached: nobody's child here
    assert os.getsid(pid) != os.getsid(0)  # its own session
    st = S.status()
    assert st["pid"] == pid and st["groups"] == []
    assert stat.S_IMODE(os.stat(S.socket_path()).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert S.start() == pid  # one per user: a second start finds it
    assert S.stop() is True
    assert _gone(pid)
    assert not os.path.exists(S.socket_path())
    assert S.status() is None and S.stop() is False


def test_concurrent_starts_make_one_daemon(rundir):
    _, pids = rundir
    got = []
    ts = [threading.Thread(target=lambda: got.append(S.start())) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    pids.extend(got)
    assert len(got) == 4 and len(set(got)) == 1, got
    assert S.status()["pid"] == got[0]


def test_sigkilled_daemon_is_replaced_by_the_next_start(rundir):
    _, pids = rundir
    pid = S.start()
    pids.append(pid)
    os.kill(pid, signal.SIGKILL)
    assert _gone(pid)
    assert os.path.exists(S.socket_path())  # its socket file stays, answered by nobody
    assert S.status() is None
    new = S.start()
    pids.append(new)
    assert new != pid and S.status()["pid"] == new


def test_sigterm_stops_the_daemon_cleanly(rundir):
    _, pids = rundir
    pid = S.start()
    pids.append(pid)
    os.kill(pid, signal.SIGTERM)
    assert _gone(pid)
    assert not os.path.exists(S.socket_path())  # removed on the way out
    assert S.status() is None


def test_a_start_beside_a_daemon_not_yet_answering_waits_for_it(rundir):
    """The lock is held by a daemon that does not answer yet (between taking
    it and listening): a start then must not report pid 0.  It waits; when
    the holder goes without ever answering, it becomes the daemon itself."""
    import fcntl

    _, pids = rundir
    fd = os.open(S._lock_path(), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    got = []
    t = threading.Thread(target=lambda: got.append(S.start(timeout=60)))
    t.start()
    try:
        t.join(2.0)
        assert not got, f"start() returned {got} while the lock's holder had not answered"
    finally:
        os.close(fd)          # the holder goes without answering
    t.join(60)
    pids.extend(got)
    assert got and got[0] > 0 and S.status()["pid"] == got[0], got
