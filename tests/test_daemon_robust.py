"""A node daemon you can leave running:
no client, member or worker can crash or block it, an idle daemon keeps its
workers, a stalled member does not hold another back, a hung worker or a
hung daemon costs a job one short deadline, not a minute.

Each scenario drives real processes (jobs, the daemon, its workers) in a
child with a hard timeout; the deadlines are lowered through the
environment variables the daemon and the jobs read (``COORDL_DAEMON_*``)."""
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from coordl.daemon import ipc
from coordl.daemon import server as S
from coordl.testing import popen

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_share_job.py")
FAST = {"COORDL_DAEMON_TIMEOUT": "2", "COORDL_DAEMON_WORKER_STALL": "2", "COORDL_DAEMON_CLIENT_TIMEOUT": "2"}


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    from coordl.synth import make_image_folder

    root = tmp_path_factory.mktemp("robust") / "photos"
    make_image_folder(root, num_images=24, num_classes=4, image_size=(64, 48), mean_kb=4)
    return str(root)


@pytest.fixture
def daemon_settings():
    """For conftest's ``daemon_env``: the deadlines lowered."""
    return FAST


def _job(root, *extra, env=None):
    return popen([sys.executable, JOB, "--root", root, *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def _lines(p, timeout):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"job pid {p.pid} did not finish in {timeout} s:\n{err[-3000:]}") from None
    assert p.returncode == 0, err
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")], err


_REF = {}


def _digests(root, epochs=2, bs=8):
    """The digests a job without sharing prints (computed here, as the job does)."""
    if (root, epochs, bs) not in _REF:
        import coordl

        sys.path.insert(0, HERE)
        from _share_job import dataset, digest

        ld = coordl.DataLoader(dataset(root, 32), batch_size=bs, seed=7)
        _REF[root, epochs, bs] = [[digest(b) for b in ld] for _ in range(epochs)]
    return _REF[root, epochs, bs]


def _until_step(p, step):
    """The job's lines up to its step ``step`` of epoch 0 (read as they come)."""
    out = []
    for line in p.stdout:
        out.append(json.loads(line))
        if out[-1].get("step", -1) >= step:
            return out
    raise AssertionError(f"job pid {p.pid} ended before its step {step}: {p.stderr.read()[-3000:]}")


def _check(lines, ref):
    got = [[x["digest"] for x in lines if x.get("epoch") == e] for e in range(len(ref))]
    assert got == ref


def _child(code: str, timeout: float, env=None) -> str:
    """Run ``code`` in a fresh interpreter under a hard timeout; its stdout."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


# A member that joined (through the real loader) and then talks raw protocol on its link.
_MEMBER = """
import os, sys, json, time
sys.path.insert(0, {here!r})
from _share_job import dataset
import coordl
ld = coordl.DataLoader(dataset({root!r}, 32), batch_size=8, seed=7, share=True)
it = iter(ld)
next(it)
link = ld._mode.link
assert link is not None, "did not join"
conn = link.conn
"""


def _alive_and_serving(pid, photos):
    """The daemon still runs and still serves a group (a job in this process)."""
    import coordl

    from _share_job import dataset, digest

    st = S.status(timeout=5)
    assert st is not None and st["pid"] == pid, "the daemon died"
    ld = coordl.DataLoader(dataset(photos, 32), batch_size=8, seed=7, share=True)
    assert [digest(b) for b in ld] == _digests(photos, epochs=1)[0]
    assert ld.stats().samples_shared > 0


# ------------------------------------------ members closing or pausing mid-step
def test_member_closing_right_after_a_step_does_not_crash_the_daemon(photos, daemon_env):
    """The daemon answers a step with samples already staged, and the member
    is gone by then: the send fails in the middle of the daemon's pump."""
    pid = S.start()
    code = _MEMBER.format(here=HERE, root=photos) + (
        "time.sleep(1.0)\n"                    # its window is staged by now
        "print('joined', flush=True)\n"
        "sys.stdin.readline()\n"               # the test stops the daemon meanwhile
        "conn.send({'op': 'step', 'pos': 8, 'need': 16, 'release': list(range(8)), 'want': list(range(8, 24))})\n"
        "os._exit(0)\n")
    for _ in range(1):
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            assert p.stdout.readline().strip() == "joined"
            os.kill(pid, signal.SIGSTOP)
            daemon_env.append(pid)
            p.stdin.write("go\n")
            p.stdin.flush()
            p.wait(30)
        finally:
            os.kill(pid, signal.SIGCONT)
            p.kill()
            p.communicate()
        time.sleep(1.0)
        assert S.status() is not None, "the daemon died"
    _alive_and_serving(pid, photos)


def test_daemon_paused_past_the_members_deadline_survives_its_resume(photos, daemon_env):
    ref = _digests(photos)
    pid = S.start()
    job = _job(photos, "--sleep", "0.1")
    first = _until_step(job, 1)
    os.kill(pid, signal.SIGSTOP)
    daemon_env.append(pid)
    lines, err = _lines(job, 45)
    lines = first + lines     # it gives up on the paused daemon after its deadline, exactly
    _check(lines, ref)
    assert "node daemon" in err
    os.kill(pid, signal.SIGCONT)
    time.sleep(1.0)
    _alive_and_serving(pid, photos)


# ----------------------------------------------- receive timeouts, idle workers
def test_recv_without_timeout_waits_past_the_previous_send_timeout():
    a, b = socket.socketpair()
    ca, cb = ipc.Conn(a, 0), ipc.Conn(b, 0)
    try:
        ca.send({"op": "x"}, timeout=0.3)
        cb.recv(timeout=None)
        import threading

        threading.Timer(1.0, lambda: cb.send({"op": "late"})).start()
        assert ca.recv(timeout=None)[0] == {"op": "late"}   # not a TimeoutError after 0.3 s
    finally:
        ca.close()
        cb.close()


def test_idle_daemon_keeps_its_workers(photos, daemon_env):
    """Workers outlive their last message, even past the old idle limit (their
    own send timeout, 30 s, lowered here through the child's ipc module)."""
    import coordl

    from _share_job import dataset

    pid = S.start()
    ld = coordl.DataLoader(dataset(photos, 32), batch_size=8, num_workers=2, seed=7, share=True)
    list(ld)
    del ld
    workers = S.status()["worker_pids"]
    assert workers
    time.sleep(4.0)     # well past the lowered deadlines
    st = S.status()
    assert st["pid"] == pid and st["worker_pids"] == workers
    assert all(psutil.Process(w).status() != psutil.STATUS_ZOMBIE for w in workers)


# ------------------------------------------------------------- a stalled member
def test_a_stalled_member_does_not_block_another_and_is_detached(photos, daemon_env, monkeypatch):
    monkeypatch.setenv("COORDL_STAGING", "40KiB")    # a few slots: batch + window fill staging
    ref = _digests(photos, epochs=2)
    pid = S.start()
    victim = _job(photos, "--sleep", "0.05", "--epochs", "3", "--batch-size", "12")   # batch + window >= slots
    _until_step(victim, 1)
    os.kill(victim.pid, signal.SIGSTOP)      # holds its claims and its window, forever
    daemon_env.append(victim.pid)
    try:
        lines, err = _lines(_job(photos, "--epochs", "2"), 40)
        _check(lines, ref)
        assert "sent nothing" not in err
        g = S.status()["groups"][0]
        stalled = [m for m in g["members"] if m["pid"] == victim.pid]
        assert stalled and not stalled[0]["attached"]    # detached: it no longer holds the others back
    finally:
        victim.kill()
        victim.communicate()
    assert S.status()["pid"] == pid


def test_group_serves_an_urgent_request_past_a_stalled_window():
    from coordl.daemon.groups import Group, Member

    g = Group(1, "k", nslots=4, samples_per_epoch=64)
    stalled, fast = Member(1, 10, "stalled"), Member(2, 11, "fast")
    for m in (stalled, fast):
        g.add(m)
        g.begin_pass(m.mid, 0, 0, 64)
    g.step(1, 0, want=range(0, 4), need=4)          # takes every slot
    for _ in range(4):
        _, task = g.next_task()
        g.done(task[0], True, info=["storage", 1, 0.0, 0.0])
    g.step(1, 0, want=range(4, 12), need=4)         # its window: nothing free
    assert g.next_task()[1] is None                  # (waits for its own releases: fine)
    fast.pos = 20
    acts = g.step(2, 20, want=[20, 21], need=22)     # another member's urgent request
    got = []
    for _ in range(4):
        a, task = g.next_task()
        acts += a
        if task is None:
            break
        got.append(task[0])
        acts += g.done(task[0], True, info=["storage", 1, 0.0, 0.0])
    assert got[:2] == [20, 21]
    assert any(a[0] == "detach" and a[1] is stalled for a in acts)


# -------------------------------------------------- failed joins, client limits
def test_failed_joins_leak_no_descriptors(photos, daemon_env):
    pid = S.start()
    proc = psutil.Process(pid)
    before = proc.num_fds()
    bad = [{"op": "join"}, {"op": "join", "key": "k", "stride": 8, "samples_per_epoch": 1, "seed": 0,
                             "plan": {}, "digest": "d"},
           {"op": "join", "key": "k", "stride": 1 << 44, "samples_per_epoch": 4, "seed": 0, "plan": {},
            "digest": "d"}]
    for _ in range(10):
        for msg in bad:
            fd = os.memfd_create("x")
            try:
                with ipc.connect(S.socket_path()) as c:
                    c.send(msg, fds=[fd, fd] if msg is bad[0] else [fd])
                    try:
                        _, fds = c.recv(timeout=10)
                        for f in fds:
                            os.close(f)
                    except ConnectionError:
                        pass
            finally:
                os.close(fd)
    time.sleep(0.5)
    st = S.status()
    assert st["pid"] == pid and st["groups"] == []
    assert proc.num_fds() <= before + 2, (before, proc.num_fds())


def test_a_thousand_clients_are_refused_not_fatal(photos, daemon_env):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        pytest.skip("the hard descriptor limit is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))   # the daemon inherits it
    try:
        pid = S.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    code = f"""
import os, resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
from coordl.daemon import ipc, server as S
held, refused = [], 0
for k in range(1100):
    try:
        held.append(ipc.connect(S.socket_path(), timeout=30))
    except OSError:
        refused += 1
st = S.status(timeout=10)
print(st is not None and st['pid'] == {pid}, len(held), refused)
"""
    out = _child(code, 90).split()
    print("1100 clients:", out)
    assert out[0] == "True", out      # it answered while 1,100 clients were connected (or refused)
    _alive_and_serving(pid, photos)


def test_clients_past_the_limit_are_told_why(photos, daemon_env, monkeypatch):
    monkeypatch.setenv("COORDL_DAEMON_MAX_CLIENTS", "8")
    pid = S.start()
    held = [ipc.connect(S.socket_path()) for _ in range(8)]
    try:
        time.sleep(0.5)
        with ipc.connect(S.socket_path()) as c:
            # the refusal is written at accept, maybe before the request arrives: ask() reads it then too
            reply, _ = c.ask({"op": "status"}, timeout=10)
        assert reply.get("op") == "refused" and "COORDL_DAEMON_MAX_CLIENTS" in reply["why"], reply
    finally:
        for c in held:
            c.close()
    time.sleep(0.5)
    st = S.status()
    assert st["pid"] == pid and st["max_clients"] == 8


def test_status_stop_and_start_past_the_limit_say_the_daemon_runs_and_why_it_refused(daemon_env, monkeypatch):
    """``coordl daemon status``/``stop`` and a job's start past the client
    limit: the daemon answers at accept and closes, maybe before the request
    arrives; they must report that refusal, not 'no daemon runs' (nor start
    a second one, nor fail with a KeyError)."""
    from coordl import cli

    monkeypatch.setenv("COORDL_DAEMON_MAX_CLIENTS", "4")
    pid = S.start()
    held = [ipc.connect(S.socket_path()) for _ in range(4)]
    try:
        time.sleep(0.5)
        for _ in range(5):    # the refusal may come before or after the request is sent: both ways
            for call in (S.status, S.stop, S.start):
                with pytest.raises(RuntimeError, match="COORDL_DAEMON_MAX_CLIENTS"):
                    call()
        assert cli.main(["daemon", "status"]) == 1
        assert psutil.pid_exists(pid)
    finally:
        for c in held:
            c.close()
    time.sleep(0.5)
    assert S.status()["pid"] == pid


# ----------------------------------- hung workers and daemons, malformed frames
def test_a_hung_daemon_worker_is_replaced_and_its_samples_redone(photos, daemon_env):
    ref = _digests(photos)
    pid = S.start()
    job = _job(photos, "--sleep", "0.1", "--workers", "1")
    first = _until_step(job, 1)
    (victim,) = S.status()["worker_pids"]
    os.kill(victim, signal.SIGSTOP)
    daemon_env.append(victim)
    lines, err = _lines(job, 40)
    lines = first + lines
    _check(lines, ref)
    st = S.status()
    assert st["pid"] == pid and victim not in st["worker_pids"] and st["worker_pids"]
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE


def test_a_hung_daemon_costs_a_job_one_short_deadline(photos, daemon_env):
    ref = _digests(photos, epochs=3)
    pid = S.start()
    os.kill(pid, signal.SIGSTOP)
    daemon_env.append(pid)
    lines, err = _lines(_job(photos, "--epochs", "3"), 40)    # was 60 s + 45 s per later pass
    _check(lines, ref)
    os.kill(pid, signal.SIGCONT)


def test_a_restarted_daemon_is_found_within_one_timeout(photos, daemon_env, tmp_path):
    """Mid-pass: the daemon is SIGKILLed, a new one starts; the job takes
    its stream again within one timeout (2 s here), not at its next epoch."""
    ref = _digests(photos, epochs=1, bs=2)
    pid = S.start()
    # 2 s per step: the new daemon's start (imports, seconds of CPU) on a loaded machine must not
    # outlast the job's epoch, or there is no pass left to rejoin; once it rejoined, the rest of the
    # pass runs without sleeping
    fast = tmp_path / "rejoined"
    job = _job(photos, "--sleep", "2.0", "--sleep-until", str(fast), "--epochs", "1", "--batch-size", "2")
    first = _until_step(job, 1)
    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(10)
    time.sleep(0.5)
    new = S.start()
    seen = False
    # its only epoch still has ~20 s to run: rejoining while it runs is rejoining mid-pass
    # (a deadline of the job's own end, not of the clock, so a loaded machine does not fail it)
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline and not seen and job.poll() is None:
        st = S.status() or {}
        seen = any(m["pid"] == job.pid for g in st.get("groups", []) for m in g["members"])
        time.sleep(0.2)
    fast.touch()
    lines, err = _lines(job, 60)
    _check(first + lines, ref)
    assert new != pid and seen, err


def test_truncated_frames_do_not_block_the_daemon(photos, daemon_env):
    pid = S.start()
    socks = []
    for _ in range(4):   # each announces 1,000 bytes and sends 10
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(S.socket_path())
        s.sendall(b"CD\x01\x00\x00\x00\x03\xe8" + b"{" * 10)
        socks.append(s)
    try:
        st = S.status(timeout=3)      # one client blocking the loop 5 s each would miss this
        assert st is not None and st["pid"] == pid
    finally:
        for s in socks:
            s.close()
    _alive_and_serving(pid, photos)


def test_bad_positions_do_not_use_up_or_crash_workers(photos, daemon_env):
    """Negative and non-integer positions, each from its own member: the
    daemon drops that member; no worker crashes or loses its slots."""
    pid = S.start()
    code = _MEMBER.format(here=HERE, root=photos) + (
        "from coordl.daemon import server as S\n"
        "print(json.dumps(S.status()['worker_pids']), flush=True)\n"
        "bad = [[{'op': 'pass', 'epoch': 0, 'start': -40, 'end': 48},\n"
        "        {'op': 'step', 'pos': -40, 'need': -30, 'release': [], 'want': [-3, -2, -1]}],\n"
        "       [{'op': 'step', 'pos': 8, 'need': 48, 'release': [],\n"
        "         'want': [8.5, 9.5, 10.5, 11.5, 12.5, 13.5, 14.5, 15.5, 16.5]}]]\n"
        "loaders = [ld]\n"
        "for msgs in bad:\n"
        "    if len(loaders) > 1:\n"
        "        ld = coordl.DataLoader(dataset({root!r}, 32), batch_size=8, seed=7, share=True)\n"
        "        it = iter(ld); next(it)\n"
        "    loaders.append(ld)\n"
        "    for msg in msgs:\n"
        "        try:\n"
        "            ld._mode.link.conn.send(msg)\n"
        "        except OSError:\n"
        "            pass\n"
        "time.sleep(1.5)\n"
        "print('sent', flush=True)\n"
        "sys.stdin.readline()\n"        # its members stay (a group whose members all leave is dropped)
        "os._exit(0)\n").replace("{root!r}", repr(photos))
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        first = json.loads(p.stdout.readline())     # before the bad messages
        assert p.stdout.readline().strip() == "sent"
        st = S.status()
        assert first and st["pid"] == pid and st["worker_pids"] == first    # no worker crashed
        _alive_and_serving(pid, photos)       # its workers' slots are not used up
        # (this process runs the same code from another sys.path: its group may get a pool of its own)
        assert set(first) <= set(S.status()["worker_pids"])
    finally:
        p.kill()
        p.communicate()


def test_no_select_in_the_library():
    """select() fails on descriptors past 1024: poll or selectors only."""
    import ast

    import coordl

    top = os.path.dirname(coordl.__file__)
    bad = []
    for d, _, files in os.walk(top):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path) as fh:
                    tree = ast.parse(fh.read())
                for node in ast.walk(tree):
                    if (isinstance(node, ast.Attribute) and node.attr == "select"
                            and isinstance(node.value, ast.Name) and node.value.id == "select"):
                        bad.append(f"{os.path.relpath(path, top)}:{node.lineno}")
    assert not bad, f"select.select in {bad}"


def test_nonblocking_frames_arrive_whole_with_their_descriptors():
    """The daemon's side of a connection: a frame sent in pieces is returned
    once complete, with the descriptors that came with its first byte; a
    queued answer keeps its descriptor even if the sender closes its own."""
    a, b = socket.socketpair()
    ca, cb = ipc.Conn(a, 0), ipc.Conn(b, 0)
    cb.sock.setblocking(False)
    try:
        fd = os.memfd_create("x")
        os.write(fd, b"hello")
        frame = ipc._frame({"op": "join", "pad": "x" * 100}, [fd])
        import array

        a.sendmsg([frame[:5]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        assert cb.read_ready() == [] and cb.partial_since is not None
        a.sendall(frame[5:50])
        assert cb.read_ready() == []
        a.sendall(frame[50:] + ipc._frame({"op": "status"}, []))
        got = cb.read_ready()
        assert [m["op"] for m, _ in got] == ["join", "status"] and len(got[0][1]) == 1 and got[1][1] == []
        assert os.pread(got[0][1][0], 5, 0) == b"hello" and cb.partial_since is None
        os.close(got[0][1][0])
        cb.queue({"op": "joined"}, [fd])
        os.close(fd)                      # the queued copy is its own
        assert cb.write_ready()
        msg, fds = ca.recv(timeout=5)
        assert msg == {"op": "joined"} and os.pread(fds[0], 5, 0) == b"hello"
        os.close(fds[0])
        a.sendall(b"XX\x01\x00\x00\x00\x00\x02{}")
        with pytest.raises(ipc.ProtocolError):
            cb.read_ready()
    finally:
        ca.close()
        cb.close()
