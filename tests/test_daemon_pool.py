"""The node daemon's worker pool: its size is what the sharing jobs brought
(the sum of their ``num_workers``, a job with none counting as one, at most
``COORDL_DAEMON_MAX_WORKERS``), it follows jobs joining and leaving, and a
worker that makes no progress on a sample a job waits for costs that job a
few seconds, not the stall deadline.

Each scenario drives real processes (jobs, the daemon, its workers); every
wait on them has a deadline, and the fixture stops the daemon and reaps
what a failed test left."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from coordl.daemon import server as S
from coordl.testing import popen

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_share_job.py")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    from coordl.synth import make_image_folder

    root = tmp_path_factory.mktemp("pool") / "photos"
    make_image_folder(root, num_images=24, num_classes=4, image_size=(64, 48), mean_kb=4)
    return str(root)


@pytest.fixture
def daemon_settings():
    """For conftest's ``daemon_env``: a job gives up on a silent daemon in 2 s."""
    return {"COORDL_DAEMON_TIMEOUT": "2"}


def _job(root, *extra):
    return popen([sys.executable, JOB, "--root", root, *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _pool(st):
    """The one pool's record in a status (None before a job joined)."""
    pools = [p for p in st.get("pools", []) if p["groups"]]
    return pools[0] if pools else None


def _until(what, cond, timeout):
    """Poll the daemon's status until ``cond(status)``; the last status."""
    deadline = time.monotonic() + timeout
    while True:
        st = S.status(timeout=5)
        if cond(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s; the daemon's status: {json.dumps(st)[:3000]}")
        time.sleep(0.2)


def _workers(st) -> int:
    """Workers of the group's pool, as ``coordl daemon status`` shows them."""
    groups = st.get("groups") or []
    return len(groups[0]["worker_pids"]) if groups else 0


def _members(st) -> int:
    groups = st.get("groups") or []
    return len(groups[0]["members"]) if groups else 0


def test_the_pool_is_the_sum_of_what_the_jobs_brought_and_follows_them(photos, daemon_env, monkeypatch):
    """Four jobs with num_workers 1, 1, 1 and 0 bring 4 workers (a job with
    none counts as one: its main process would have prepared); the pool
    shrinks as jobs leave (idle workers retire, none is stopped mid-task)."""
    monkeypatch.setenv("COORDL_DAEMON_MAX_WORKERS", "8")   # (this machine may have fewer CPUs than brought)
    S.start()
    jobs = {}
    for nw in ("1", "1", "1", "0"):
        p = _job(photos, "--workers", nw, "--epochs", "100000", "--sleep", "0.2")
        daemon_env.append(p)
        jobs.setdefault(nw, []).append(p)
    st = _until("four jobs joined and a pool of 4", lambda st: _members(st) == 4 and _workers(st) == 4, 120)
    pool = _pool(st)
    assert pool["brought"] == 4 and pool["target"] == 4 and len(pool["workers"]) == 4
    assert sorted(m["num_workers"] for m in st["groups"][0]["members"]) == [0, 1, 1, 1]
    for nw, left in (("1", 3), ("0", 2), ("1", 1)):
        p = jobs[nw].pop()
        p.kill()
        p.communicate()
        _until(f"a pool of {left} after a job with num_workers={nw} left",
               lambda st: _members(st) == left and _workers(st) == left, 60)
    for p in daemon_env:
        p.kill()
        p.communicate()
    daemon_env.clear()
    # the last job gone, the pool keeps what it had (warm, for the next run of this code)
    st = _until("the group gone", lambda st: not st["groups"], 60)
    assert len(st["worker_pids"]) == 1


def _fake_hub(max_workers, pools):
    """A hub (no process started) whose pools hold groups of members with
    these ``num_workers``: ``{pool key: [[nw, ...] per group], ...}``."""
    from types import SimpleNamespace

    from coordl.daemon.groups import Group, Member
    from coordl.daemon.hub import Hub
    from coordl.daemon.pool import _Pool

    hub = Hub(staging_bytes=1 << 20, log=lambda s: None)
    hub.max_workers = max_workers
    gid = 0
    for key, groups in pools.items():
        pool = hub.pools[key] = _Pool(key, {})
        for nws in groups:
            gid += 1
            g = Group(gid, str(gid), nslots=16, samples_per_epoch=10)
            for j, nw in enumerate(nws):
                g.add(Member(j, 100 + j, "job", nw))
            hub.groups[gid] = SimpleNamespace(group=g, permanent=False)
            pool.gids.add(gid)
    return hub


def test_pool_sizes_sum_what_was_brought_capped_and_shared_by_what_each_brought():
    assert _fake_hub(16, {"a": [[3, 3, 3, 3]]})._targets() == {"a": 12}     # four jobs x 3: 12, not 3
    assert _fake_hub(16, {"a": [[11, 11, 11, 11]]})._targets() == {"a": 16}  # at most the cap
    assert _fake_hub(16, {"a": [[0, 0], [2]]})._targets() == {"a": 4}        # groups of one code add up
    # two codes over the cap share it in proportion to what each brought, at least one each
    assert _fake_hub(8, {"a": [[6, 6]], "b": [[4]]})._targets() == {"a": 6, "b": 2}
    assert _fake_hub(2, {"a": [[12]], "b": [[0]], "c": [[1]]})._targets() == {"a": 1, "b": 1, "c": 1}
    hub = _fake_hub(16, {"a": [[2]], "idle": []})
    assert hub._targets() == {"a": 2}             # a pool without groups keeps what it has


_REF = {}


def _digests(root, epochs):
    if (root, epochs) not in _REF:
        import coordl

        sys.path.insert(0, HERE)
        from _share_job import dataset, digest

        ld = coordl.DataLoader(dataset(root, 32), batch_size=8, seed=7)
        _REF[root, epochs] = [[digest(b) for b in ld] for _ in range(epochs)]
    return _REF[root, epochs]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_hung_worker_costs_a_waiting_job_seconds_not_the_stall_deadline(photos, daemon_env, workers):
    """SIGSTOP a daemon worker while a job iterates, the stall deadline at its
    default (30 s): the job's batches are bit-identical, no batch keeps it
    waiting anywhere near that deadline (another worker, or the job itself,
    prepares what the stopped one holds), and the stopped worker is killed
    and replaced."""
    epochs = 12
    ref = _digests(photos, epochs)
    S.start()
    job = _job(photos, "--sleep", "0.3", "--workers", str(workers), "--epochs", str(epochs))
    daemon_env.append(job)
    lines = []
    for line in job.stdout:                       # epoch 0, step 1: the job takes batches from the stream
        lines.append(json.loads(line))
        if lines[-1].get("step", -1) >= 1:
            break
    else:
        raise AssertionError(f"the job ended early: {job.stderr.read()[-3000:]}")
    # every worker ready and idle (the job's pass is staged ahead): the stopped one gets the next pass's samples
    st = _until(f"{workers} daemon worker(s) ready and idle",
                lambda st: _pool(st) is not None and len(_pool(st)["workers"]) == workers
                and all(w["ready"] and not w["samples"] for w in _pool(st)["workers"]), 120)
    victim = _pool(st)["workers"][0]["pid"]
    os.kill(victim, signal.SIGSTOP)
    daemon_env.append(victim)
    try:
        out, err = job.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        job.kill()
        out, err = job.communicate()
        raise AssertionError(f"the job did not finish in 90 s:\n{err[-3000:]}") from None
    assert job.returncode == 0, err[-3000:]
    after = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    lines += after
    got = [[x["digest"] for x in lines if x.get("epoch") == e] for e in range(epochs)]
    assert got == ref
    waits = [x["wait"] for x in after if "wait" in x]     # (the first batches waited for the daemon's start)
    assert max(waits) < 15.0, f"a batch kept the job waiting {max(waits):.1f} s (the stall deadline is 30 s)"
    st = S.status()
    assert victim not in st["worker_pids"] and st["worker_pids"]
    assert st["workers_replaced"] >= 1
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(240)
def test_a_slow_sample_is_prepared_by_the_waiting_job_and_its_worker_goes_on(daemon_env, monkeypatch, tmp_path):
    """A worker that runs but takes long over one sample (8 s of CPU here) is
    not hung: after ``COORDL_DAEMON_WORKER_WAIT`` (1 s here) the job waiting
    for that sample prepares it itself, and the worker is neither killed nor
    replaced."""
    import coordl

    sys.path.insert(0, HERE)
    from _share_datasets import SlowInWorker

    monkeypatch.setenv("COORDL_DAEMON_WORKER_WAIT", "1")
    n, slow, flag = 48, 29, str(tmp_path / "slow")
    ref_ld = coordl.DataLoader(SlowInWorker(n, slow, 8.0, flag), batch_size=8, seed=5)
    S.start()
    ld = coordl.DataLoader(SlowInWorker(n, slow, 8.0, flag), batch_size=8, seed=5, share=True)
    for _ in range(6):              # until the daemon's worker has started and serves the job
        list(ld)
        if ld.stats().epochs[-1].samples_shared >= n - 2:
            break
    else:
        raise AssertionError(f"the daemon's worker never served the job: {ld.stats()}")
    for _ in range(len(ld.stats().epochs) + 1):
        ref = [b[0].clone() for b in ref_ld]        # (the batches of the epoch measured below)
    workers = S.status()["worker_pids"]
    open(flag, "w").close()         # from here sample 29 takes the worker 8 s of CPU
    got, waits = [], []
    it = iter(ld)
    while True:
        t0 = time.monotonic()
        b = next(it, None)
        if b is None:
            break
        waits.append(time.monotonic() - t0)
        got.append(b[0].clone())
    del it, b
    assert len(got) == len(ref) and all(torch.equal(x, y) for x, y in zip(got, ref))
    assert max(waits) < 6.0, waits                  # not the 8 s (or more) the worker takes over it
    assert ld.stats().epochs[-1].samples_shared > 0
    st = S.status()
    assert st["worker_pids"] == workers and st["workers_replaced"] == 0
    time.sleep(9.0)                                 # the slow sample done: the same worker goes on
    st = S.status()
    assert st["worker_pids"] == workers and st["workers_replaced"] == 0
    assert psutil.Process(workers[0]).status() != psutil.STATUS_ZOMBIE
