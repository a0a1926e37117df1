"""Node cache lifetime: held by flocks, never by pid
tables or clocks; names acted on only while they name the inode held."""
import gc
import os
import signal
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest

import coordl
from coordl import cache as C
from coordl.cache import NodeCache, list_caches
from coordl.testing import run_in_child, settle

from _cache_helpers import check_pass, file_bytes, folder, make_folder

HERE = os.path.dirname(os.path.abspath(__file__))
BIG = 1 << 20


@pytest.fixture
def data(tmp_path):
    root = make_folder(tmp_path / "data")
    ds = folder(root)
    return root, ds, file_bytes(ds)


@pytest.fixture(autouse=True)
def _no_caches_left():
    yield
    settle()
    left = [c.name for c in list_caches()]
    C.clear_caches(force=True)
    assert not left, f"caches left behind: {left}"


# -------------------- loaders made, dropped and collected while the cache lives

@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_recreated_every_epoch_keeps_working_and_stays_warm(data, num_workers):
    """for epoch: loader = DataLoader(...): the old loader, collected after
    the new one attached, must not remove the cache under the new one."""
    root, ds, expected = data
    L = None
    for epoch in range(4):
        L = coordl.DataLoader(folder(root), batch_size=8, num_workers=num_workers, cache_size=BIG)
        settle()  # the previous loader goes now, while this one is attached
        assert check_pass(L, expected) == len(expected)
        if epoch:
            assert L.stats().epochs[0].samples_from_cache == len(expected)
    assert [c.holders for c in list_caches()] == [1]
    del L
    settle()
    assert list_caches() == []  # the last one out removed it


def test_two_loaders_on_one_dataset_in_one_process(data):
    root, ds, expected = data
    a = coordl.DataLoader(folder(root), batch_size=8, num_workers=2, cache_size=BIG)
    b = coordl.DataLoader(folder(root), batch_size=8, num_workers=0, cache_size=BIG)
    check_pass(a, expected)
    check_pass(b, expected)
    assert [c.holders for c in list_caches()] == [2]
    del a
    settle()
    for _ in range(2):
        check_pass(b, expected)
    assert b.stats().epochs[-1].samples_from_cache == len(expected)
    del b
    settle()
    assert list_caches() == []


def test_a_loader_made_after_anothers_del_finds_the_cache_as_the_del_left_it(data):
    """``del a`` then a new loader: a's hold, released by the reaper thread,
    goes before the new loader attaches, however busy the reaper is, so
    the new loader finds the cache gone (the last holder left; no
    ``cache_keep_warm``) every time, not warm or cold by timing."""
    from coordl.base import reaper

    root, ds, expected = data
    a = coordl.DataLoader(folder(root), batch_size=8, cache_size=BIG)
    check_pass(a, expected)
    busy = threading.Event()
    reaper.later(lambda: busy.wait(1.0))    # the reaper held up a moment, as on a loaded machine
    del a
    b = coordl.DataLoader(folder(root), batch_size=8, cache_size=BIG)
    check_pass(b, expected)
    first = b.stats().epochs[0]
    assert (first.samples_from_cache, first.samples_from_storage) == (0, len(expected)), first
    assert [c.holders for c in list_caches()] == [1]
    del b
    settle()


def test_loader_collected_inside_another_attach_does_not_wait_for_itself(data, monkeypatch):
    """The old loader is freed by a garbage collection that runs while the
    new one is attaching (holding the directory lock): its finalizer detaches
    without waiting for the lock its own thread holds."""
    root, ds, expected = data
    monkeypatch.setattr(C.directory, "_LOCK_WAIT", 5.0)
    a = coordl.DataLoader(folder(root), batch_size=8, cache_size=BIG)
    check_pass(a, expected)
    a.cycle = a  # only the cycle collector frees it
    del a
    real = C.node._adopt

    def adopt_after_gc(*args):
        gc.collect()  # the old loader's finalizer runs here, under our directory lock: it only enqueues
        return real(*args)

    monkeypatch.setattr(C.node, "_adopt", adopt_after_gc)
    b = coordl.DataLoader(folder(root), batch_size=8, cache_size=BIG)
    monkeypatch.setattr(C.node, "_adopt", real)
    settle()  # the reaper detaches the old loader once the lock is free
    for _ in range(2):
        check_pass(b, expected)
    assert [c.holders for c in list_caches()] == [1]
    del b
    settle()


# ----------------------------- clear(force=True) and re-creation while jobs run

@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_clear_force_and_recreate_while_jobs_run_never_mixes_samples(data, ctx):
    """`coordl cache clear --force` unlinks the segment under running loaders
    and another loader re-creates the name: every process keeps admitting
    into, and locking, the inode it maps, so every delivered sample is its
    own file's bytes (all samples have the same length)."""
    from coordl.cli import main

    root, ds, expected = data
    kw = dict(batch_size=8, cache_size=BIG)
    a = coordl.DataLoader(folder(root), num_workers=0, **kw)            # admits in this process
    # new workers each pass; a spawned one is a fresh interpreter (seconds of imports): one is enough there
    b = coordl.DataLoader(folder(root), num_workers=2 if ctx == "fork" else 1, multiprocessing_context=ctx, **kw)
    it = iter(a)
    next(it)  # a has admitted (and locked) through its own description
    del it
    assert main(["cache", "clear", "--force"]) == 0
    assert list_caches() == []
    c = coordl.DataLoader(folder(root), num_workers=0, **kw)            # re-creates the name
    errors = []

    def run_a():
        try:
            for _ in range(3):
                check_pass(a, expected)
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=run_a)
    t.start()
    for _ in range(3):
        check_pass(b, expected)
        check_pass(c, expected)
    t.join(120)
    assert not t.is_alive() and not errors, errors
    assert b.stats().epochs[-1].samples_from_cache == len(expected)
    del a, b, c
    settle()


# ---------------------------------------- clock steps and the holders' liveness

def test_clock_step_does_not_make_live_holders_look_dead(data, monkeypatch):
    """Another job's attach, the sweep and `coordl cache clear` after the
    wall clock jumped (and psutil's start times with it) leave a live job's
    cache alone: nothing about holding depends on clocks or pids."""
    from coordl.cli import main

    root, ds, expected = data
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {HERE!r})
        import coordl
        from _cache_helpers import folder, file_bytes, check_pass
        ds = folder({root!r})
        L = coordl.DataLoader(ds, batch_size=8, cache_size={BIG})
        check_pass(L, file_bytes(ds))
        print("attached", flush=True)
        sys.stdin.readline()
        check_pass(L, file_bytes(ds))
        print("from cache", L.stats().epochs[1].samples_from_cache, flush=True)
    """)
    import subprocess
    from coordl.testing import _child_env
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_child_env(None))
    try:
        assert p.stdout.readline().strip() == "attached", p.stderr.read()
        names = [c.name for c in list_caches()]
        assert len(names) == 1
        monkeypatch.setattr(time, "time", lambda: 4e9)
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: 4e9)
        other = NodeCache.attach("feedc10c", 4, 1000)  # another job starts: sweeps
        C.reclaim_stale()
        assert main(["cache", "clear"]) == 0
        assert names[0] in [c.name for c in list_caches()]
        other.close()
        monkeypatch.undo()
        out, err = p.communicate("go\n", timeout=60)
        assert f"from cache {len(expected)}" in out, out + err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# -------------------------------- killed and exiting jobs, signals, torn writes

def _job(root, body, keep_warm=0, fp_root=None):
    return textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {HERE!r})
        import coordl
        from _cache_helpers import folder, file_bytes, check_pass
        ds = folder({root!r})
        L = coordl.DataLoader(ds, batch_size=8, cache_size={BIG}, cache_keep_warm={keep_warm})
    """) + textwrap.dedent(body)


def test_sigkilled_job_restart_adopts_its_warm_cache(data):
    root, ds, expected = data
    r = run_in_child(_job(root, """
        check_pass(L, file_bytes(ds))
        os.kill(os.getpid(), signal.SIGKILL)
    """), timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    [left] = list_caches()  # nobody detached it
    assert left.cached == len(expected)
    r = run_in_child(_job(root, """
        check_pass(L, file_bytes(ds))
        print("from cache", L.stats().epochs[0].samples_from_cache)
    """), timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"from cache {len(expected)}" in r.stdout  # the restart started warm
    assert list_caches() == []  # and its normal exit removed it (no keep-warm)


@pytest.mark.parametrize("drop", ["del", "exit"])
def test_job_exiting_right_after_dropping_persistent_workers_removes_its_cache(data, drop):
    """A script that drops its loader (or just ends) right before exiting:
    the finalizers only enqueue the pool's stop and the cache's detach, and
    the process exits at once.  The exit must still stop the workers while
    the trainer lives, so they are not orphans, and the last one out
    removes the segment (no keep-warm asked)."""
    root, ds, expected = data
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {HERE!r})
        import coordl
        from _cache_helpers import folder, file_bytes, check_pass
        L = coordl.DataLoader(folder({root!r}), batch_size=8, cache_size={BIG}, num_workers=2,
                              persistent_workers=True)
        check_pass(L, file_bytes(L.dataset))
        print("pids", *[p.pid for p in L._mode.pool.procs], flush=True)
    """) + ("from coordl.base import reaper as _reaper\nimport time\n"
            "_reaper.later(lambda: time.sleep(1))  # the reaper is busy when the script ends\n"
            "del L\n" if drop == "del" else "")
    r = run_in_child(code, timeout=120)
    assert r.returncode == 0, r.stderr
    import psutil
    for pid in map(int, r.stdout.split("pids", 1)[1].split()):
        try:
            psutil.Process(pid).wait(timeout=15)
        except psutil.NoSuchProcess:
            pass
    assert list_caches() == []


@pytest.mark.parametrize("keep_warm", [0, 3600])
def test_ownerless_cache_of_another_dataset_removed_after_keep_warm(data, tmp_path, keep_warm):
    root, ds, expected = data
    r = run_in_child(_job(root, """
        check_pass(L, file_bytes(ds))
        os.kill(os.getpid(), signal.SIGKILL)
    """, keep_warm=keep_warm), timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    [killed] = list_caches()
    other = NodeCache.attach("feed0the4", 4, 1000)  # another dataset's job starts
    names = [c.name for c in list_caches()]
    assert (killed.name in names) == (keep_warm > 0)
    other.close()
    from coordl.cli import main
    assert main(["cache", "clear"]) == 0  # explicit: idle caches go, kept warm or not
    assert list_caches() == []


def test_sigterm_runs_the_exit_path_and_still_dies_of_sigterm(data):
    root, ds, expected = data
    code = _job(root, """
        try:
            while True:
                check_pass(L, file_bytes(ds))
                print("epoch", flush=True)
        finally:
            print("finally ran", flush=True)
    """)
    import subprocess
    from coordl.testing import _child_env
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_child_env(None), start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "epoch", p.stderr.read()
        assert len(list_caches()) == 1
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -signal.SIGTERM, err
    assert "finally ran" in out
    assert list_caches() == []  # detached on the way out: nothing left pinned


def test_own_sigterm_handler_is_left_alone(data):
    root, ds, expected = data
    code = textwrap.dedent("""
        import signal, sys
        def mine(signum, frame):
            print("mine", flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, mine)
    """) + _job(root, """
        check_pass(L, file_bytes(ds))
        assert signal.getsignal(signal.SIGTERM) is mine
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    """)
    r = run_in_child(code, timeout=120)
    assert r.returncode == 3 and "mine" in r.stdout, r.stderr
    assert list_caches() == []


# ---------------------------------------------------------------- kill a real put()

# Counts the C calls one put() makes (each is a kill point); {name} is the
# segment's fingerprint.
_CALLS_IN_PUT = """
def calls_in_put():
    c = NodeCache.attach("{name}", 4, 10**5)
    n = [0]
    def prof(frame, event, arg):
        if event == "c_call":
            n[0] += 1
    sys.setprofile(prof)
    c.put(1, b"b" * 50)
    sys.setprofile(None)
    c.close()
    return n[0]

def kill_at_call(k):  # SIGKILL this process at its k-th C call from now on
    n = [0]
    def prof(frame, event, arg):
        if event == "c_call":
            n[0] += 1
            if n[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)
    sys.setprofile(prof)
"""

_KILL_IN_PUT = """
import os, signal, sys
from coordl.cache import NodeCache, list_caches
""" + _CALLS_IN_PUT.format(name="feedca11") + """
steps = calls_in_put()
assert steps >= 5, steps
for k in range(1, steps + 1):
    pid = os.fork()
    if pid == 0:  # the writer: killed at its k-th C call inside put()
        c = NodeCache.attach("feedca11", 4, 10**5)
        assert c.put(0, b"a" * 100)
        kill_at_call(k)
        c.put(1, b"b" * 50)
        os._exit(3)  # not reached
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (k, status)
    c = NodeCache.attach("feedca11", 4, 10**5)  # the restart adopts the ownerless segment
    assert c.get(0) == b"a" * 100, k
    assert c.get(1) in (None, b"b" * 50), k   # never torn
    c.put(1, b"b" * 50)  # the admission lock is free; a dead writer's entry is admitted again
    assert c.get(1) == b"b" * 50, k
    c.close()
    assert list_caches() == [], k
print("steps", steps)
"""


def test_writer_killed_at_every_step_of_put_leaves_no_torn_entry():
    """SIGKILL a process inside a real put(), at each C call it makes in
    turn: the entry is never READY with wrong bytes, the admission lock is
    not left held, and the entry can be admitted again by the next job,
    which adopts the ownerless segment."""
    r = run_in_child(_KILL_IN_PUT, timeout=120)
    assert r.returncode == 0 and "steps" in r.stdout, r.stdout + r.stderr


_KILL_PARENT_IN_PUT = """
import os, select, signal, sys
from coordl import cache as C
from coordl.cache import NodeCache, list_caches
C._LOCK_WAIT = 10.0  # a lock kept alive by a dead parent would show as a TimeoutError, soon
""" + _CALLS_IN_PUT.format(name="feedf0f0") + """

steps = calls_in_put()
for k in range(1, steps + 1):
    C.clear_caches(force=True)  # a worker that found everything cached never held it: left ownerless
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the parent job: attaches, forks a worker, is killed inside put()
        c = NodeCache.attach("feedf0f0", 4, 10**5)
        assert c.put(0, b"a" * 100)
        if os.fork() == 0:  # the worker: inherits the cache object
            os.read(go_r, 1)  # until its parent is dead
            try:
                c.put(1, b"b" * 50)
                ok = c.get(1) == b"b" * 50 and c.get(0) == b"a" * 100
                c.close()
                os.write(res_w, b"ok" if ok else b"wrong")
            except BaseException as e:
                os.write(res_w, repr(e).encode()[:200])
            os._exit(0)
        kill_at_call(k)
        c.put(1, b"b" * 50)
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), (k, status)
    os.write(go_w, b"g")
    ready, _, _ = select.select([res_r], [], [], 60)
    assert ready, f"step {k}: the worker hung after its parent died"
    got = os.read(res_r, 300)
    assert got == b"ok", (k, got)
    for fd in (go_r, go_w, res_r, res_w):
        os.close(fd)
C.clear_caches(force=True)
print("steps", steps)
"""


def test_forked_worker_outlives_its_parent_killed_at_every_step_of_put():
    """The parent dies (SIGKILL) at each C call of a real put(), possibly
    holding the admission or an entry lock; its forked worker, which
    inherited the cache object, then admits and reads without hanging:
    the parent's locks died with it (the worker closed its copy of the
    parent's description at fork and took its own)."""
    r = run_in_child(_KILL_PARENT_IN_PUT, timeout=240)
    assert r.returncode == 0 and "steps" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------- entries published out of order

def test_entry_published_out_of_order_is_a_miss_not_wrong_data(monkeypatch):
    """What a reader on a weakly ordered CPU can see: READY before the
    offset/bytes.  With read validation (on by default off x86) such an
    entry is a miss."""
    monkeypatch.setattr(C.node, "VALIDATE_READS", True, raising=False)
    c = NodeCache.attach("feed0de4", 4, 1000)
    try:
        assert c.put(0, b"a" * 100)
        # entry 2 READY, its offset still pointing at sample 0's bytes
        c._index[2, 0], c._index[2, 1], c._index[2, 2] = c._index[0, 0], 100, C.READY
        assert c.get(2) is None
        # entry 3 READY with the right offset/length/CRC, bytes not landed yet
        fill = int(c._hdr[C.FILL])
        c._index[3, :] = (fill, 100, C.READY, C.segment._entry_crc(3, fill, 100, b"c" * 100))
        assert c.get(3) is None
        c._arena[fill:fill + 100] = np.frombuffer(b"c" * 100, dtype=np.uint8)  # the stores land
        assert c.get(3) == b"c" * 100
        assert c.get(0) == b"a" * 100
    finally:
        c.close()


# ------------------------------------------ a full /dev/shm, racing directories

_RACER = """
import sys
from coordl.cache import NodeCache
try:
    c = NodeCache.attach(sys.argv[1], 16, 5 << 20)
except MemoryError as e:
    print("attach-error", e, flush=True)
    sys.exit(0)
print("attached", flush=True)
sys.stdin.readline()
for i in range(16):
    c.put(i, bytes([i]) * ((5 << 20) // 16))
print("filled", c.info().filled, flush=True)
c.close()
"""

_RACE = """
import subprocess, sys
ps = [subprocess.Popen([sys.executable, "-c", %r, fp], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True) for fp in ("feedaaaa", "feedbbbb")]
first = [p.stdout.readline().strip() for p in ps]  # both have attached (or failed) before either fills
for p in ps:
    if p.poll() is None:
        p.stdin.write("go\\n")
        p.stdin.flush()
for p, line in zip(ps, first):
    out, err = p.communicate(timeout=60)
    print("RESULT", p.returncode, "|", line, "|", out.strip(), "|", err.strip()[-300:], flush=True)
""" % _RACER


def _can_unshare():
    import shutil
    import subprocess
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30)
    return r.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare -m for a private small /dev/shm")
def test_two_jobs_racing_for_a_full_dev_shm_get_clean_outcomes():
    """/dev/shm of 8 MiB, two jobs of 5 MiB each attach before either fills:
    the space is reserved at attach, so one gets a MemoryError naming the
    remedy and the other fills its whole cache; nobody dies of SIGBUS."""
    code = ("import os\n"
            f"os.execvp('unshare', ['unshare', '-m', 'sh', '-c', "
            f"'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec \"$0\" -c \"$1\"', {sys.executable!r}, {_RACE!r}])\n")
    r = run_in_child(code, timeout=180, env=dict(os.environ, COORDL_SHM_DIR="/dev/shm"))
    assert r.returncode == 0, r.stdout + r.stderr
    results = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert len(results) == 2, r.stdout + r.stderr
    assert not any(ln.split()[1] != "0" for ln in results), results  # -7 would be SIGBUS
    filled = [ln for ln in results if f"filled {5 << 20}" in ln]
    refused = [ln for ln in results if "attach-error" in ln]
    assert len(filled) == 1 and len(refused) == 1, results
    assert "does not fit in /dev/shm" in refused[0] and "cache_size=" in refused[0] \
        and "--shm-size" in refused[0], refused


# ---------------------------------------------------------------- nothing left in /dev/shm

def test_nothing_of_coordl_left_in_shm_once_no_cache_exists(data, tmp_path, monkeypatch):
    """The per-user directory and its lock file go with the last segment:
    after a loader is dropped, after a job exits, after a failed attach, and
    after `coordl cache clear` of a killed job's cache, the shm root holds
    nothing of coordl."""
    from coordl.cli import main

    root, ds, expected = data
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("COORDL_SHM_DIR", str(shm))
    L = coordl.DataLoader(folder(root), batch_size=8, num_workers=2, cache_size=BIG)
    check_pass(L, expected)
    assert os.listdir(shm) == [f"coordl-{os.geteuid()}"]
    del L
    settle()
    assert os.listdir(shm) == []

    r = run_in_child(_job(root, "check_pass(L, file_bytes(ds))\n"), timeout=120)
    assert r.returncode == 0, r.stderr
    assert os.listdir(shm) == []

    with pytest.raises(MemoryError):
        NodeCache.attach("feedb16", 4, 1 << 62)  # does not fit: refused at attach
    assert os.listdir(shm) == []

    r = run_in_child(_job(root, """
        check_pass(L, file_bytes(ds))
        os.kill(os.getpid(), signal.SIGKILL)
    """), timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert len(list_caches()) == 1  # left for a restart to adopt
    assert main(["cache", "clear"]) == 0
    assert os.listdir(shm) == []


_CHURN = """
import os, sys, traceback
from coordl.cache import NodeCache


def churn(who, rounds):
    for r in range(rounds):
        c = NodeCache.attach("feedc4u4", 8, 10_000)
        for i in range(8):
            c.put(i, bytes([i]) * (100 + i))
        for i in range(8):
            got = c.get(i)
            assert got in (None, bytes([i]) * (100 + i)), (who, r, i, got[:8])
        c.close()  # often the last one out: the directory goes, and the next attach re-creates it


pids = []
for who in range(3):   # forked after the imports: the three start their loops together
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            churn(who, 40)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    pids.append(pid)
print("exit codes", [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])
"""


def test_directory_created_and_removed_concurrently_keeps_the_lock_exclusive(tmp_path, monkeypatch):
    """Processes attaching and leaving in a loop make and remove the user
    directory and its lock file over and over: every attach must find a
    directory to work in, and no entry may ever hold another's bytes.  (The
    three processes are forked from one interpreter: separate processes with
    descriptors and locks of their own, one interpreter's start.)"""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("COORDL_SHM_DIR", str(shm))
    r = run_in_child(_CHURN, timeout=120)
    assert r.returncode == 0 and "exit codes [0, 0, 0]" in r.stdout, r.stdout + r.stderr[-3000:]
    assert os.listdir(shm) == []


def test_a_child_forked_while_the_directory_lock_is_held_does_not_keep_it():
    """A worker forked by the main thread while another thread (the reaper
    detaching a cache) held the directory lock, before the fork hook knew
    its descriptor, inherited the lock's open file description; the holder
    released the lock by closing its descriptor, which leaves the lock held
    while the child lives: every attach and detach on the node then waited
    on it (a job hung at exit for minutes).  The lock is released
    explicitly, so the child's copy holds nothing."""
    out = run_in_child(textwrap.dedent("""
        import fcntl, os, time
        from coordl.cache import directory as d

        with d._DirLock() as dfd:
            held, d._dir_fd = d._dir_fd, -1     # the fork hook does not know it yet
            pid = os.fork()
            if pid == 0:
                time.sleep(10)                  # a worker that keeps running
                os._exit(0)
            d._dir_fd = held
            fd = os.open(os.path.join(d.user_dir(), d.LOCK_NAME), os.O_RDWR)   # a description of our own
        try:
            print("FREE", d._try_flock(fd, fcntl.LOCK_EX))
        finally:
            os.close(fd)
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    """), timeout=60)
    assert "FREE True" in out.stdout, out.stdout + out.stderr
