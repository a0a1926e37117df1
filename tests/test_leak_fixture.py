"""The leak-detection helpers and the autouse fixture built on them do catch leaks."""
from __future__ import annotations

import multiprocessing
import os
import shutil
import re
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from coordl.testing import (
    SHM_DIR,
    kill_processes,
    live_children,
    run_in_child,
    shm_entries,
    wait_no_leaks,
)

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]

needs_shm = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _snapshot():
    return {p.pid for p in live_children()}, shm_entries()


def _shm_name() -> str:
    return f"coordl-test-{os.getpid()}-{uuid.uuid4().hex}"


# -- processes ----------------------------------------------------------------

def test_live_children_and_wait_no_leaks_report_a_sleeping_child():
    before_pids, before_shm = _snapshot()
    child = subprocess.Popen(SLEEPER)
    try:
        assert child.pid in {p.pid for p in live_children()}
        procs, shm = wait_no_leaks(before_pids, before_shm, grace=0.5)
        assert [p.pid for p in procs] == [child.pid]
        assert shm == set()
    finally:
        child.kill()
        child.wait()
    assert wait_no_leaks(before_pids, before_shm, grace=2) == ([], set())


def test_live_children_is_recursive():
    code = (
        "import subprocess, sys, time\n"
        f"g = subprocess.Popen({SLEEPER!r})\n"
        "print(g.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    before_pids, before_shm = _snapshot()
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert {child.pid, grandchild} <= {p.pid for p in live_children()}
        assert [p.pid for p in live_children(child.pid)] == [grandchild]
        procs, _ = wait_no_leaks(before_pids, before_shm, grace=0.2)
        assert {p.pid for p in procs} == {child.pid, grandchild}
        kill_processes(procs)
        assert _gone(child.pid) and _gone(grandchild)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert wait_no_leaks(before_pids, before_shm, grace=2) == ([], set())


def _sleep_briefly():
    time.sleep(0.3)


def test_wait_no_leaks_waits_for_children_that_exit_within_grace():
    before_pids, before_shm = _snapshot()
    proc = multiprocessing.get_context("fork").Process(target=_sleep_briefly)
    proc.start()
    # Never joined by us: wait_no_leaks reaps finished multiprocessing children.
    assert wait_no_leaks(before_pids, before_shm, grace=10) == ([], set())
    proc.join()


def test_unreaped_child_is_reported_as_zombie_leak():
    before_pids, before_shm = _snapshot()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        procs, _ = wait_no_leaks(before_pids, before_shm, grace=1.0)
        assert [p.pid for p in procs] == [child.pid]
        assert procs[0].status() == psutil.STATUS_ZOMBIE
    finally:
        child.wait()
    assert wait_no_leaks(before_pids, before_shm, grace=1) == ([], set())


def test_infrastructure_processes_are_not_leaks():
    before_pids, before_shm = _snapshot()
    # Its command line carries a marker of Python's resource tracker.
    fake = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)  # multiprocessing.resource_tracker"]
    )
    try:
        assert wait_no_leaks(before_pids, before_shm, grace=0.2) == ([], set())
        procs, _ = wait_no_leaks(before_pids, before_shm, grace=0.2, ignore=())
        assert [p.pid for p in procs] == [fake.pid]
    finally:
        fake.kill()
        fake.wait()


# -- /dev/shm -------------------------------------------------------------------

@needs_shm
def test_shm_entry_is_reported_until_removed():
    before_pids, before_shm = _snapshot()
    name = _shm_name()
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"x")
    try:
        assert name in shm_entries()
        procs, shm = wait_no_leaks(before_pids, before_shm, grace=0.3)
        assert procs == []
        assert name in shm
    finally:
        os.unlink(path)
    assert name not in shm_entries()
    procs, shm = wait_no_leaks(before_pids, before_shm, grace=0.3)
    assert name not in shm


def test_cache_directory_and_lock_file_left_behind_are_reported(tmp_path, monkeypatch):
    """coordl's per-user cache directory and its lock file count as leaks
    when nothing removes them (they go with the last segment)."""
    from coordl.cache import LOCK_NAME, user_dir

    monkeypatch.setenv("COORDL_SHM_DIR", str(tmp_path))
    before_pids, before_shm = _snapshot()
    os.mkdir(user_dir(), 0o700)
    open(os.path.join(user_dir(), LOCK_NAME), "w").close()
    procs, shm = wait_no_leaks(before_pids, before_shm, grace=0.3)
    assert {user_dir(), os.path.join(user_dir(), LOCK_NAME)} <= shm


@needs_shm
def test_shm_entry_removed_during_grace_is_not_a_leak():
    before_pids, before_shm = _snapshot()
    path = os.path.join(SHM_DIR, _shm_name())
    open(path, "wb").close()
    remover = threading.Timer(0.3, os.unlink, args=(path,))
    remover.start()
    try:
        assert wait_no_leaks(before_pids, before_shm, grace=10) == ([], set())
    finally:
        remover.join()


@needs_shm
def test_shm_entry_created_after_first_poll_is_not_blamed():
    before_pids, before_shm = _snapshot()
    name = _shm_name()
    path = os.path.join(SHM_DIR, name)
    creator = threading.Timer(0.2, lambda: open(path, "wb").close())
    creator.start()
    try:
        _, shm = wait_no_leaks(before_pids, before_shm, grace=0.6)
        assert name not in shm
    finally:
        creator.join()
        os.unlink(path)


@needs_shm
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_another_users_shm_entry_is_not_blamed():
    """Another user's /dev/shm entry appearing during a test is not this
    test's leak; one of ours is."""
    before_pids, before_shm = _snapshot()
    theirs, ours = _shm_name(), _shm_name()
    subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "touch",
                    os.path.join(SHM_DIR, theirs)], check=True, timeout=30)
    open(os.path.join(SHM_DIR, ours), "wb").close()
    try:
        _, shm = wait_no_leaks(before_pids, before_shm, grace=0.2)
        assert ours in shm and theirs not in shm
    finally:
        os.unlink(os.path.join(SHM_DIR, theirs))
        os.unlink(os.path.join(SHM_DIR, ours))


@needs_shm
def test_only_coordls_and_this_trees_shm_entries_are_blamed():
    """Another program's entries appearing in /dev/shm during a test (any
    name of its own; torch's ``torch_<pid>_...`` of a process outside this
    tree) are not this test's leaks; coordl's entries and torch entries of
    this process or its children are."""
    before_pids, before_shm = _snapshot()
    tag = uuid.uuid4().hex[:8]
    outsider = os.getppid()  # alive, and not in this process' tree
    child = subprocess.Popen(SLEEPER)
    foreign = [f"psm_{tag}", f"other-program-{tag}", f"sem.mp-{tag}", f"torch_{outsider}_{tag}_0"]
    ours = [_shm_name(), f"torch_{os.getpid()}_{tag}_0", f"torch_{child.pid}_{tag}_1"]
    for name in foreign + ours:
        open(os.path.join(SHM_DIR, name), "wb").close()
    try:
        procs, shm = wait_no_leaks(before_pids, before_shm, grace=0.2)
        assert [p.pid for p in procs] == [child.pid]
        assert shm == set(ours)
        assert not set(foreign) & shm_entries()
    finally:
        child.kill()
        child.wait()
        for name in foreign + ours:
            os.unlink(os.path.join(SHM_DIR, name))


def test_session_shm_dir_contents_are_blamed(tmp_path, monkeypatch):
    """Whatever appears in a COORDL_SHM_DIR of the test's own (not /dev/shm)
    is the test's: it is reported when left behind."""
    monkeypatch.setenv("COORDL_SHM_DIR", str(tmp_path))
    before_pids, before_shm = _snapshot()
    (tmp_path / "cache-left-behind").write_bytes(b"x")
    _, shm = wait_no_leaks(before_pids, before_shm, grace=0.2)
    assert shm == {str(tmp_path / "cache-left-behind")}


# -- run_in_child -------------------------------------------------------------------

def test_run_in_child_returns_completed_process():
    res = run_in_child(
        "import sys, importlib.util as u\n"
        "print(u.find_spec('coordl').submodule_search_locations[0])\n"
        "print('err', file=sys.stderr)\n"
        "sys.exit(3)\n",
        timeout=30,
    )
    assert res.returncode == 3
    # The child imports the same coordl as this process, wherever it started.
    import coordl
    assert res.stdout == os.path.dirname(coordl.__file__) + "\n"
    assert res.stderr == "err\n"
    assert res.stragglers == []


def test_run_in_child_passes_env():
    res = run_in_child(
        "import os; print(os.environ['COORDL_PROBE'])",
        env={**os.environ, "COORDL_PROBE": "hello"},
        timeout=30,
    )
    assert res.returncode == 0 and res.stdout == "hello\n"


def test_run_in_child_timeout_kills_the_whole_group():
    code = (
        "import subprocess, sys, time\n"
        f"g = subprocess.Popen({SLEEPER!r})\n"
        "print('grandchild', g.pid, flush=True)\n"
        "print('stuck', file=sys.stderr, flush=True)\n"
        "time.sleep(120)\n"
    )
    with pytest.raises(AssertionError) as info:
        run_in_child(code, timeout=3)
    msg = str(info.value)
    assert "timed out after 3 s" in msg
    assert "stuck" in msg  # stderr so far
    grandchild = int(msg.split("grandchild ", 1)[1].split()[0])  # stdout so far
    deadline = time.monotonic() + 5
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild)


def test_run_in_child_kills_stragglers_left_in_its_group():
    code = (
        "import subprocess\n"
        f"g = subprocess.Popen({SLEEPER!r}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(g.pid)\n"
    )
    res = run_in_child(code, timeout=30)
    pid = int(res.stdout)
    assert res.returncode == 0
    assert res.stragglers == [pid]
    assert _gone(pid)


PROBE = (
    "import os, sys\n"
    "print(__name__, sys.argv, 'torch' in sys.modules, os.getpgid(0) == os.getpid(), os.getcwd())\n"
    "print(os.environ.get('COORDL_PROBE'), os.environ.get('OTHER_PROBE'))\n"
)


def _run_probe(tmp_path, monkeypatch, **env):
    monkeypatch.chdir(tmp_path)
    res = run_in_child(PROBE, env={**os.environ, **env}, timeout=60)
    assert res.returncode == 0, res.stderr
    head, probes = res.stdout.splitlines()
    return head, probes


def test_a_warm_child_runs_the_code_as_python_c_would(tmp_path, monkeypatch):
    """Forked from the session's template (torch already imported there),
    the child has python -c's __main__ and argv, a session of its own, the
    caller's cwd and the call's COORDL_ variables; an uncaught exception
    prints the code's frames only and exits 1."""
    from coordl import testing

    if testing._warm is None:
        pytest.skip("COORDL_TEST_FRESH_CHILDREN=1: no template")
    head, probes = _run_probe(tmp_path, monkeypatch, COORDL_PROBE="warm")
    assert head == f"__main__ ['-c'] True True {tmp_path}"      # torch imported: forked from the template
    assert probes == "warm None"
    res = run_in_child("def f():\n    raise ValueError('boom')\nf()\n", timeout=60)
    assert res.returncode == 1
    assert res.stderr == ('Traceback (most recent call last):\n  File "<string>", line 3, in <module>\n'
                          '  File "<string>", line 2, in f\nValueError: boom\n')


def test_a_warm_popen_gives_exit_codes_and_signals_as_popen_does(tmp_path):
    """``coordl.testing.popen`` of ``python script.py``: forked from the
    template, run side by side, with Popen's returncode, poll, wait and
    communicate (the ends come from each child's waiter, not waitpid)."""
    import signal

    from coordl import testing

    if testing._warm is None:
        pytest.skip("COORDL_TEST_FRESH_CHILDREN=1: no template")
    script = tmp_path / "job.py"
    script.write_text("import sys, time\nprint(sys.argv[1:], __name__, __file__ == sys.argv[0], flush=True)\n"
                      "if sys.argv[1] == 'sleep':\n    time.sleep(120)\n"
                      "sys.exit(int(sys.argv[1]))\n")
    ps = [testing.popen([sys.executable, str(script), k], stdout=subprocess.PIPE, text=True) for k in ("0", "3")]
    assert all(type(p).__name__ == "_WarmPopen" for p in ps)
    outs = [p.communicate(timeout=60)[0] for p in ps]
    assert [p.returncode for p in ps] == [0, 3]
    assert outs == ["['0'] __main__ True\n", "['3'] __main__ True\n"]
    p = testing.popen([sys.executable, str(script), "sleep"], stdout=subprocess.PIPE, text=True,
                      start_new_session=True)
    try:
        assert p.stdout.readline() == "['sleep'] __main__ True\n"
        assert p.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(0.2)
        os.killpg(p.pid, signal.SIGKILL)
        assert p.wait(30) == -signal.SIGKILL
    finally:
        p.kill()
        p.wait(30)
        p.stdout.close()


def test_a_child_with_other_variables_is_a_fresh_interpreter(tmp_path, monkeypatch):
    """A variable torch or Python may read at start-up differs from the
    template's: the child must be a fresh interpreter (nothing imported)."""
    head, probes = _run_probe(tmp_path, monkeypatch, OTHER_PROBE="fresh")
    assert head == f"__main__ ['-c'] False True {tmp_path}"
    assert probes == "None fresh"


# -- the autouse fixture itself, exercised in an inner pytest run -------------

INNER_TESTS = '''
import os, subprocess, sys

def test_leaks_a_process():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.environ["PIDFILE"], "w") as f:
        f.write(str(p.pid))

def test_leaks_shm():
    open(os.path.join("/dev/shm", os.environ["SHM_NAME"]), "wb").close()

def test_foreign_shm_entries_are_not_this_tests():
    # as other programs would, while this test runs: left in place at its end
    for name in os.environ["FOREIGN_SHM"].split():
        open(os.path.join("/dev/shm", name), "wb").close()

def test_clean():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''


@needs_shm
def test_autouse_fixture_fails_leaking_tests_and_kills_leaked_processes(tmp_path: Path):
    inner = tmp_path / "inner"
    inner.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), inner / "conftest.py")
    (inner / "test_inner.py").write_text(INNER_TESTS)
    (inner / "pytest.ini").write_text("[pytest]\n")
    pidfile = tmp_path / "pid"
    shm_name = _shm_name()
    tag = uuid.uuid4().hex[:8]
    # the inner pytest's parent (this process) is not in the inner run's tree
    foreign = [f"other-program-{tag}", f"torch_{os.getpid()}_{tag}_0"]
    env = {
        **os.environ,
        "PIDFILE": str(pidfile),
        "SHM_NAME": shm_name,
        "FOREIGN_SHM": " ".join(foreign),
        "COORDL_LEAK_GRACE": "0.5",
    }
    code = textwrap.dedent(
        f"""
        import sys, pytest
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-c", {str(inner / 'pytest.ini')!r},
                              "--rootdir", {str(inner)!r}, {str(inner)!r}]))
        """
    )
    try:
        res = run_in_child(code, timeout=120, env=env)
    finally:
        shm_path = os.path.join(SHM_DIR, shm_name)
        shm_existed = os.path.exists(shm_path)
        if shm_existed:
            os.unlink(shm_path)
        for name in foreign:
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
    out = res.stdout + res.stderr
    leaked_pid = int(pidfile.read_text())
    assert res.returncode == 1, out
    assert "4 passed, 2 errors" in out, out
    assert "test_foreign_shm_entries_are_not_this_tests" not in out.split("short test summary", 1)[-1], out
    assert "ERROR at teardown of test_leaks_a_process" in out, out
    assert "ERROR at teardown of test_leaks_shm" in out, out
    assert "test_clean" not in out.split("short test summary", 1)[-1], out
    assert f"pids [{leaked_pid}]" in out, out
    assert "time.sleep(120)" in out, out  # the command line is named
    assert shm_name in out, out
    assert shm_existed  # the fixture reports shm leaks but does not delete them
    # The fixture killed the leaked process itself; run_in_child found nothing left.
    assert res.stragglers == []
    assert _gone(leaked_pid)


@needs_shm
def test_a_killed_test_session_leaves_no_session_directory_behind(tmp_path: Path):
    """A pytest session makes /dev/shm/coordl-test-<its pid> for the caches
    its tests create and removes it when it ends; a session killed before its
    end (a timeout, SIGKILL) cannot.  The next session removes the directory
    of every session whose process is gone, so none pile up in /dev/shm."""
    inner = tmp_path / "inner"
    inner.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), inner / "conftest.py")
    (inner / "test_inner.py").write_text(
        "import os, signal\n"
        "def test_killed():\n"
        "    print('dir', os.environ['COORDL_SHM_DIR'], flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    (inner / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k not in ("COORDL_SHM_DIR", "COORDL_TEST_SESSION_DIRS")}
    args = ["-q", "-s", "-p", "no:cacheprovider", "-c", str(inner / "pytest.ini"), "--rootdir", str(inner)]
    killed = run_in_child(f"import sys, pytest\nsys.exit(pytest.main({args + [str(inner)]!r}))", timeout=120, env=env)
    left = re.search(r"dir (\S+)", killed.stdout).group(1)
    assert os.path.basename(left).startswith("coordl-test-") and os.path.isdir(left), killed.stdout
    (inner / "test_inner.py").write_text("def test_nothing():\n    pass\n")
    after = run_in_child(f"import sys, pytest\nsys.exit(pytest.main({args + [str(inner)]!r}))", timeout=120, env=env)
    assert after.returncode == 0, after.stdout + after.stderr
    assert not os.path.exists(left), f"{left} is still in /dev/shm after the next session"
