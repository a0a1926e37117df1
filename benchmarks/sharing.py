"""Coordinated prep: K independent training jobs on one node, each a
separate process, with and without ``share=True``, measured side by side.

Each job is its own ``python benchmarks/sharing.py --job ...`` process (not a
child loader of this script): ``coordl.ImageFolder`` with RandomResizedCrop(224)
+ flip -> uint8 CHW (``common.coordl_dataset``), 2 workers, batch 64, a trivial
step (``images.float().mean()``; ``--step light``: one pixel row per image, so
that only the loader is measured) with torch at 1 thread, the node cache on
(``--cache-size``) in every job, same seed and shuffle, so with ``share=True``
they form one group at the daemon.  All jobs of a configuration start
together (each builds its loader, says "ready", and waits for "go") and each
prints one JSON line per epoch.  Epoch 0 is the warm-up (workers start, the
node cache fills from storage); ratios use the later epochs.  A job done
with its epochs drops its loader (it leaves its group, as by exiting) and
exits when all are done.

Configurations, all in one run so the ratios are side by side (``--rounds``
repeats the whole list, interleaved, and the table shows medians):

* ``solo`` (K=1, no sharing: the reference), ``K2``, ``K4`` without sharing;
* ``shared-K1``, ``shared-K2``, ``shared-K4`` with ``share=True``;
* ``shared-mixed``: K=4 sharing, batch sizes 32/64/128/256;
* ``shared-fast3`` and ``shared-fast3+slow``: three jobs sharing, then the
  same three plus a fourth whose step sleeps so that it runs at ~1/3 of the
  solo job's speed (sleep per step = 3 x batch / solo images/s: the loader prefetches while the step sleeps, so the sleep alone sets its pace).

Measured per configuration:

* images/s of each job per epoch, and its ratio to the solo job's;
* CPU seconds per epoch of *all* processes (jobs, their workers, the daemon
  and its workers): everything runs in a cgroup v1 ``cpuacct`` group this
  script creates and removes; the daemon is started by a process inside it
  (it inherits the group).  Each job reads ``cpuacct.usage`` at its epoch
  boundaries.  CPU per epoch = the usage from the first job's start of epoch
  1 to the last job's end of the last epoch, over the number of those epochs
  (start-up, warm-up epoch and exit excluded); the per-epoch columns are each
  epoch's own span, first start to last end;
* storage bytes per epoch, page cache dropped before each configuration
  (``echo 3 > /proc/sys/vm/drop_caches``, then the jobs' code is run once on
  a separate tiny dataset and reads its mapped libraries whole, so that
  program files are not counted): the group's blkio counter
  (``blkio.throttle.io_service_bytes``, Read: only these processes) and the
  whole device's (``/sys/block/<dev>/stat``, includes anything else running
  on the machine), over the same spans; the storage target compares the span
  of all epochs (epoch 0 fills the node cache, later epochs read from it);
  and coordl's own counters;
* the steps' own CPU (``thread_time`` around each step) and, sampled from
  /proc, the CPU split into the jobs' main processes, their workers, the
  daemon and its workers: where the CPU goes when the target is missed.

Targets: sharing at K=4 each job >= 0.85x solo (without: ~1/K);
CPU per epoch at K=4 sharing <= 1.15x solo; storage per epoch at K=4 sharing
= solo; with a slow member, the fast members keep >= 0.9x of their speed.

    python benchmarks/sharing.py                       # 1000 generated photos, 3 rounds, ~9 min
    python benchmarks/sharing.py --root /tmp/synth --epochs 3 --rounds 1 --configs solo,K4,shared-K4
    python benchmarks/sharing.py --quick               # tiny smoke run (tests use it)
    python benchmarks/sharing.py --independent --epochs 4 --rounds 2   # the independent check's setup
    python benchmarks/sharing.py --held                # held batches: rows changed under the user (target 0)

``--workers`` is each job's ``num_workers`` (the daemon's pool is what the
sharing jobs brought together: K x workers, capped at the CPUs); ``--stagger``
starts a configuration's jobs that many seconds apart; ``--independent``
is the setup of an independent check of the K=4 target (2,000 generated
ImageNet-sized JPEGs of ~84 KB, batch 64, 2 workers, the sleep step, no node
cache, jobs 0.5 s apart, solo and shared-K4).

``--held`` runs only the held-batches check (:func:`held`): jobs that keep
one batch of every epoch, a view of staging, while they run epochs 0..N-1
twice over a small staging; every kept batch's rows are compared with what
they were when it was handed out, and every epoch with ``share=False``'s.

Writes DIR/sharing.csv (one row per configuration and round),
DIR/sharing_jobs.csv (one row per job and epoch) and DIR/sharing.png
(matplotlib) to ``--out`` (default bench_out/sharing).  The daemon and the
jobs use a private ``COORDL_RUN_DIR`` of this run, so a daemon already
running for this user is neither used nor stopped.  Needs root for the
cgroups and drop_caches; without, CPU and storage columns are left empty.

The ``share=True`` configurations run only if ``coordl.DataLoader`` has a
``share`` parameter.
"""
from __future__ import annotations

import argparse
import csv
import inspect
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _host  # noqa: E402
import cache as cachebench  # noqa: E402  (block-device counters, drop_caches)

# option defaults, and the independent check's setup (--independent): 2,000 ImageNet-sized JPEGs of
# ~84 KB, batch 64, 2 workers, a 10 ms step per batch, no node cache, four jobs started 0.5 s apart
DEFAULTS = {"images": 1000, "mean_kb": 110.0, "batch_size": 64, "workers": 2, "step": "mean",
            "cache_size": "2GiB", "stagger": 0.0, "configs": None}
INDEPENDENT = {"images": 2000, "mean_kb": 84.0, "batch_size": 64, "workers": 2, "step": "sleep",
               "cache_size": "0", "stagger": 0.5, "configs": "solo,shared-K4"}

CONFIGS = ("solo", "K2", "K4", "shared-K1", "shared-K2", "shared-K4", "shared-mixed",
           "shared-fast3", "shared-fast3+slow", "shared-idle")


# ===================================================================== cgroup
def _v1_mount(controller: str) -> str | None:
    """Where the cgroup v1 hierarchy holding ``controller`` is mounted
    (``cpuacct`` may be its own or joined as ``cpu,cpuacct``)."""
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4 and parts[2] == "cgroup" and controller in parts[3].split(","):
                return parts[1]
    return None


def _join(dirs: list[str]) -> None:
    """Move this process into the cgroups ``dirs`` (its children inherit them)."""
    for d in dirs:
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def _cpu_ns(dirs: list[str]) -> int | None:
    for d in dirs:
        if os.path.exists(os.path.join(d, "cpuacct.usage")):
            with open(os.path.join(d, "cpuacct.usage")) as f:
                return int(f.read())
    return None


def _read_bytes(dirs: list[str], dev_id: str) -> int | None:
    """Bytes read from device ``dev_id`` by the processes of the blkio group."""
    for d in dirs:
        p = os.path.join(d, "blkio.throttle.io_service_bytes")
        if os.path.exists(p):
            with open(p) as f:
                for line in f:
                    w = line.split()
                    if len(w) == 3 and w[0] == dev_id and w[1] == "Read":
                        return int(w[2])
            return 0
    return None


def _sweep_stale(prefix: str = "coordl-sharing-") -> list[str]:
    """Remove the cgroups a killed earlier run left behind: ``<prefix><pid>-*``
    whose pid is no longer alive and that hold no process (the kernel refuses
    to remove one that does).  What was removed."""
    removed = []
    for controller in ("cpuacct", "blkio"):
        root = _v1_mount(controller)
        if root is None or not os.path.isdir(root):
            continue
        for name in os.listdir(root):
            m = re.match(re.escape(prefix) + r"(\d+)-", name)
            if not m or os.path.exists(f"/proc/{m.group(1)}"):
                continue
            path = os.path.join(root, name)
            if not _host.cgroup_pids([path]):
                _host.rmdir_retry(path, tries=5)
                if not os.path.exists(path):
                    removed.append(path)
    return removed


class JobGroup:
    """One cpuacct (+ blkio) cgroup per configuration, created and removed
    here.  Its member list is the kernel's, so everything started in it (jobs,
    their workers, the daemon and its workers) can be found and killed."""

    def __init__(self, name: str):
        self.dirs: list[str] = []
        for controller in ("cpuacct", "blkio"):
            root = _v1_mount(controller)
            if root is None:
                continue
            path = os.path.join(root, name)
            os.mkdir(path)
            self.dirs.append(path)
        if _cpu_ns(self.dirs) is None:
            self.remove()
            raise OSError("no cgroup v1 cpuacct controller is mounted")

    def cpu_ns(self) -> int | None:
        return _cpu_ns(self.dirs)

    def read_bytes(self, dev_id: str) -> int | None:
        return _read_bytes(self.dirs, dev_id)

    def pids(self) -> set[int]:
        return _host.cgroup_pids(self.dirs)

    def kill_all(self, timeout: float = 10.0) -> list[str]:
        """SIGKILL whatever is still in the group; the command lines killed."""
        killed = []
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return killed
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {sorted(pids)} would not leave cgroup {self.dirs}")
            for pid in pids:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                    os.kill(pid, signal.SIGKILL)
                    killed.append(f"{pid} {cmd}")
                except (ProcessLookupError, FileNotFoundError):
                    pass
            time.sleep(0.1)

    def wait_empty(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.pids():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def remove(self) -> None:
        for path in self.dirs:
            _host.rmdir_retry(path)


ROLES = ("jobs' main", "jobs' workers", "daemon", "daemon workers", "other")


class CpuByRole:
    """Per-process CPU of the cgroup's members, sampled from /proc a few times
    a second, so the total the cgroup counts can be split by role: the jobs'
    main processes, their workers, the daemon, its workers.  Approximate (a
    process's last ~0.25 s before it exits can be missed); the cgroup's own
    counter stays the figure of record."""

    TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, cg: "JobGroup"):
        self.cg = cg
        self.samples: dict[int, list[tuple[float, float]]] = {}
        self.info: dict[int, tuple[int, str]] = {}  # pid -> (ppid, cmdline)

    def sample(self) -> None:
        for pid in self.cg.pids():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                t = time.monotonic()
                fields = stat[stat.rindex(")") + 2:].split()
                cpu = (int(fields[11]) + int(fields[12])) / self.TICK
                if pid not in self.info:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                    self.info[pid] = (int(fields[1]), cmd)
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue
            self.samples.setdefault(pid, []).append((t, cpu))

    def role(self, pid: int) -> str:
        chain = []  # pid, its parent, ... as far as the group's processes go
        while pid in self.info and pid not in chain:
            chain.append(pid)
            pid = self.info[pid][0]
        for marks, top, below in ((("coordl.daemon.server", "coordl.daemon.worker"), "daemon", "daemon workers"),
                                  (("sharing.py --job",), "jobs' main", "jobs' workers")):
            hits = [i for i, p in enumerate(chain) if any(m in self.info[p][1] for m in marks)]
            if hits:  # the outermost one is the main process; anything under it its worker
                outer = chain[hits[-1]]
                return top if outer == chain[0] and marks[0] in self.info[outer][1] else below
        return "other"

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each role used from ``t0`` to ``t1``."""
        def at(series, t):
            return max((c for ts, c in series if ts <= t), default=0.0)
        out = dict.fromkeys(ROLES, 0.0)
        for pid, series in self.samples.items():
            out[self.role(pid)] += at(series, t1) - at(series, t0)
        return out


# ======================================================================== job
STEPS = {
    # the mean over the batch: converts every pixel to float, ~0.5 ms
    # of CPU per 224x224 image here, a quarter of what preparing it costs
    "mean": lambda images: images.float().mean(),
    # the CPU step (the same work, its result taken to Python)
    "cpu": lambda images: float(images.float().mean()),
    # the stand-in for an accelerator: 10 ms per batch of 64, CPU left to the loader
    "sleep": lambda images: time.sleep(0.010 * int(images.shape[0]) / 64),
    # one pixel row per image: the loader alone is measured
    "light": lambda images: images[:, :, 0].float().mean(),
}


def job(args) -> int:
    """One training job: build the loader, wait for "go", run the epochs,
    print one JSON line per epoch, wait for "exit"."""
    dirs = [d for d in args.cgroup_dirs.split(",") if d]
    _join(dirs)  # first, so workers (and a daemon this job might start) inherit it
    import dataclasses

    import common
    import coordl
    import torch

    # the step runs in this thread alone, so thread_time() is its whole CPU
    # (and K jobs' intra-op pools do not oversubscribe the cores)
    torch.set_num_threads(1)
    dev = args.dev
    extra = {"cache_size": args.cache_size} if args.cache_size not in ("", "0", "none") else {}
    params = inspect.signature(coordl.DataLoader).parameters
    if "share" in params:
        extra["share"] = bool(args.share)
        if args.share and "job_name" in params:  # the name `coordl daemon status` shows
            extra["job_name"] = args.job_name
    elif args.share:
        raise SystemExit("this coordl has no DataLoader(share=...)")
    L = common.make_loader("coordl", args.root, args.workers, args.batch_size, seed=args.seed, **extra)

    def emit(rec):
        print(json.dumps(rec), flush=True)

    def probe():
        return {"t": time.monotonic(), "cpu_ns": _cpu_ns(dirs),
                "cg_read": _read_bytes(dirs, args.dev_id) if args.dev_id else None,
                "dev_read": cachebench.sectors_read(dev) * 512 if dev else None}

    emit({"ready": os.getpid()})
    if sys.stdin.readline().strip() != "go":
        return 2  # the benchmark went away
    step = STEPS[args.step]
    batch = None
    import zlib

    import numpy as np
    go = time.monotonic()
    for e in range(args.epochs):
        p0, n, step_cpu = probe(), 0, 0.0
        # bit-identity: CRC-32 of the epoch's images and labels as one byte stream each, the same
        # whatever the batch size (CRC-32 streams), so every job's epoch must match the solo job's
        crc_x = crc_y = 0
        check = args.check == "all" or (args.check == "warmup" and e == 0)
        first_batch_s = None
        for batch in L:
            if first_batch_s is None and e == 0:
                first_batch_s = time.monotonic() - go
            c0 = time.thread_time()
            step(batch[0])  # the trivial step: the loader is the bottleneck
            step_cpu += time.thread_time() - c0
            n += int(batch[0].shape[0])
            if check:   # (a contiguous batch is hashed where it lies: no copy)
                crc_x = zlib.crc32(memoryview(np.ascontiguousarray(batch[0].numpy())).cast("B"), crc_x)
                crc_y = zlib.crc32(batch[1].numpy().astype("<i8").tobytes(), crc_y)
            if args.sleep:
                time.sleep(args.sleep)
        p1 = probe()
        st = L.stats()
        rec = {"epoch": e, "images": n, "seconds": p1["t"] - p0["t"], "start": p0, "end": p1,
               "step_cpu_s": step_cpu, "stats": dataclasses.asdict(st.epochs[-1]) if st.epochs else {},
               "crc": f"{crc_x:08x}{crc_y:08x}" if check else None, "first_batch_s": first_batch_s}
        emit(rec)
    totals = dataclasses.asdict(L.stats())
    totals.pop("epochs", None)
    # a finished job leaves its group as a real one would (its loader and
    # workers go), but its interpreter's exit waits until every job is done
    del L, batch
    import gc
    gc.collect()
    if args.warm_maps:
        _read_mapped_files()
    emit({"done": os.getpid(), "stats": totals})
    sys.stdin.readline()
    return 0


def _read_mapped_files() -> None:
    """Read every file this process has mapped (the interpreter, torch's and
    numpy's libraries, the decoder) whole, into the page cache: a process that
    touches other pages of them later then finds them there."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                paths.add(parts[5].strip())
    for path in sorted(paths):
        try:
            with open(path, "rb") as fh:
                while fh.read(1 << 20):
                    pass
        except OSError:
            pass


def daemon_start(args) -> int:
    """Start the daemon from inside the cgroup (it inherits it) and say its pid."""
    _join([d for d in args.cgroup_dirs.split(",") if d])
    from coordl.daemon import server

    print(json.dumps({"daemon": server.start()}), flush=True)
    return 0


# ===================================================================== parent
class Job(_host.JsonJob):
    def __init__(self, cmd: list[str], env: dict, log_path: str):
        super().__init__(cmd, env, log_path)
        self.ready = self.done = False

    def pump(self) -> None:
        for rec in self.arrived():
            if rec is None:
                if not self.done:
                    raise RuntimeError(f"job {self.p.pid} exited early (status {self.p.poll()}); "
                                       f"its stderr:\n{self.stderr_tail()}")
                continue
            self.ready |= "ready" in rec
            self.done |= "done" in rec
            self.recs.append(rec)

    def epochs(self) -> list[dict]:
        return [r for r in self.recs if "epoch" in r]

    def totals(self) -> dict:
        return next((r["stats"] for r in self.recs if "done" in r), {})


def _wait(jobs: list[Job], what: str, deadline: float) -> None:
    while not all(getattr(j, what) for j in jobs):
        for j in jobs:
            j.pump()
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs not {what} within the time limit (--timeout)")
        time.sleep(0.05)


def run_config(args, name: str, specs: list[dict], share: bool, ctx: dict) -> dict:
    """Run one configuration: ``specs`` = one dict (batch_size, sleep) per job."""
    tag = f"coordl-sharing-{os.getpid()}-{name.replace('+', '-')}"
    cg = None
    if ctx["cgroups"]:
        try:
            cg = JobGroup(tag)
        except OSError as e:
            print(f"  (no cgroup: {e}; CPU and storage columns stay empty)")
            ctx["cgroups"] = False
    dirs = ",".join(cg.dirs) if cg else ""
    env = _child_env()
    jobs: list[Job] = []
    snapshots: list[dict] = []
    by_role = None
    daemon_pid = None
    ok = False
    try:
        if ctx["drop"]:
            cachebench.drop_caches()
            _prime(args, ctx, env)
        if share:
            # cwd: `python -m coordl.daemon.server` must not import a coordl that happens to be in our cwd
            r = subprocess.run([sys.executable, __file__, "--daemon-start", "--cgroup-dirs", dirs], env=env,
                               capture_output=True, text=True, timeout=60, cwd=ctx["tmp"])
            if r.returncode != 0:
                raise RuntimeError(f"daemon start failed:\n{r.stdout}{r.stderr}")
            daemon_pid = json.loads(r.stdout.strip().splitlines()[-1])["daemon"]
            if cg and daemon_pid not in cg.pids():
                print(f"  warning: the daemon (pid {daemon_pid}) is not in the benchmark's cgroup: "
                      "its CPU is not counted")
        for i, spec in enumerate(specs):
            cmd = [sys.executable, __file__, "--job", "--root", args.root, "--workers", str(args.workers),
                   "--batch-size", str(spec["batch_size"]), "--epochs", str(args.epochs),
                   "--seed", str(args.seed), "--cache-size", args.cache_size, "--sleep", str(spec["sleep"]),
                   "--job-name", f"{name}-{i}", "--cgroup-dirs", dirs, "--step", args.step, "--dev", ctx["dev"] or "",
                   "--dev-id", ctx["dev_id"] or "", "--check", args.check]
            if share:
                cmd.append("--share")
            jobs.append(Job(cmd, env, os.path.join(ctx["tmp"], f"{tag}-{i}.log")))
        deadline = time.monotonic() + args.timeout
        _wait(jobs, "ready", deadline)
        by_role = CpuByRole(cg) if cg else None
        for i, j in enumerate(jobs):
            if i and args.stagger:      # --stagger: the jobs start one after another
                time.sleep(args.stagger)
            j.say("go")
        last_status = last_sample = 0.0
        while not all(j.done for j in jobs):
            for j in jobs:
                j.pump()
            if by_role and time.monotonic() - last_sample > 0.25:
                last_sample = time.monotonic()
                by_role.sample()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: jobs not done within --timeout={args.timeout:g} s")
            if share and time.monotonic() - last_status > 1.0:
                last_status = time.monotonic()
                from coordl.daemon import server
                try:
                    st = server.status(timeout=2.0)
                except Exception as e:  # noqa: BLE001 - the figure is informative only
                    st = {"error": repr(e)}
                if st:
                    snapshots.append(st)
            time.sleep(0.05)
        for j in jobs:
            j.say("exit")
        for j in jobs:
            j.p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if j.p.returncode != 0:
                raise RuntimeError(f"job {j.p.pid} exit status {j.p.returncode}:\n{j.stderr_tail()}")
        if share:
            from coordl.daemon import server
            server.stop(timeout=30)
        if cg and not cg.wait_empty(10):
            left = cg.kill_all()
            print(f"  warning: still in the cgroup 10 s after the jobs and the daemon exited, killed: {left}")
        ok = True
    finally:
        for j in jobs:
            j.close()
        if not ok and share:
            try:
                from coordl.daemon import server
                server.stop(timeout=10)
            except Exception:  # noqa: BLE001 - the cgroup kill below ends it anyway
                pass
        if cg:
            killed = cg.kill_all()
            if killed and ok:
                print(f"  warning: killed leftovers {killed}")
            cg.remove()
    left = _cache_segments()
    if left:
        print(f"  warning: cache segments still present after {name}: {left} (the next configuration "
              "may start with a warm node cache)")
    return {"name": name, "share": share, "specs": specs, "jobs": [(j.epochs(), j.totals()) for j in jobs],
            "daemon_pid": daemon_pid, "status": snapshots, "by_role": by_role}


def run_idle(args, ctx: dict) -> tuple[float, float]:
    """A job that warms the daemon (its workers, the node cache),
    a new job at once (warm start), the daemon idle ``--idle`` seconds, then
    a new job: each new job's seconds from "go" to its first batch."""
    env = _child_env()
    r = subprocess.run([sys.executable, __file__, "--daemon-start", "--cgroup-dirs", ""], env=env,
                       capture_output=True, text=True, timeout=60, cwd=ctx["tmp"])
    if r.returncode != 0:
        raise RuntimeError(f"daemon start failed:\n{r.stdout}{r.stderr}")
    from coordl.daemon import server

    def one(tag: str) -> float:
        cmd = [sys.executable, __file__, "--job", "--root", args.root, "--workers", str(args.workers),
               "--batch-size", str(args.batch_size), "--epochs", "1", "--seed", str(args.seed),
               "--cache-size", args.cache_size, "--job-name", tag, "--step", args.step, "--share"]
        j = Job(cmd, env, os.path.join(ctx["tmp"], f"idle-{tag}.log"))
        try:
            deadline = time.monotonic() + args.timeout
            _wait([j], "ready", deadline)
            j.say("go")
            _wait([j], "done", deadline)
            j.say("exit")
            j.p.wait(timeout=60)
            return float(j.epochs()[0]["first_batch_s"])
        finally:
            j.close()

    try:
        one("warm-up")
        warm = one("warm")
        time.sleep(args.idle)
        st = server.status(timeout=10) or {}
        idle = one("after-idle")
        print(f"  shared-idle: daemon workers after {args.idle:g} s idle: {st.get('worker_pids')}", flush=True)
        return warm, idle
    finally:
        server.stop(timeout=30)


def _child_env() -> dict:
    """The environment of the jobs and the daemon: they import the coordl
    this script imported (its directory first on PYTHONPATH), whatever their
    working directory."""
    import coordl

    env = dict(os.environ)
    env.pop("COORDL_SHARE", None)  # each job says share= itself
    top = os.path.dirname(os.path.dirname(os.path.abspath(coordl.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([top] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _prime(args, ctx: dict, env: dict) -> None:
    """After drop_caches, run the jobs' code once on a separate tiny dataset,
    outside the cgroup, and read every file it mapped: the program files
    (python, torch, numpy, the decoder) come back into the page cache whole,
    so the storage read inside the epochs is the dataset's, not pages of
    libraries faulted in by workers and the daemon."""
    cmd = [sys.executable, __file__, "--job", "--root", ctx["primer"], "--workers", str(args.workers),
           "--batch-size", "4", "--epochs", "1", "--seed", str(args.seed), "--cache-size", "0", "--warm-maps"]
    r = subprocess.run(cmd, input="go\nexit\n", capture_output=True, text=True, env=env, timeout=120,
                       start_new_session=True)
    if r.returncode != 0:
        raise RuntimeError(f"the page-cache primer failed:\n{r.stderr[-3000:]}")


def _cache_segments() -> list[str]:
    from coordl.cache import PREFIX, user_dir
    try:
        return sorted(n for n in os.listdir(user_dir()) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


# ================================================================== summaries
def _window(jobs_epochs: list[list[dict]], first: int, last: int, key: str) -> float | None:
    """Counter ``key`` from the first job's start of epoch ``first`` to the last
    job's end of epoch ``last``: one span, so work is counted once even where
    the jobs' epochs overlap."""
    starts = [ep[first]["start"] for ep in jobs_epochs if len(ep) > first]
    ends = [ep[last]["end"] for ep in jobs_epochs if len(ep) > last]
    if not starts or not ends or any(p[key] is None for p in starts + ends):
        return None
    return max(ends, key=lambda p: p["t"])[key] - min(starts, key=lambda p: p["t"])[key]


def summarize(res: dict, args, solo_rate: float | None) -> tuple[dict, list[dict]]:
    jobs_epochs = [ep for ep, _ in res["jobs"]]
    measured = range(1, args.epochs) if args.epochs > 1 else range(args.epochs)
    rates, job_rows = [], []
    for i, (eps, totals) in enumerate(res["jobs"]):
        spec = res["specs"][i]
        m = [eps[e] for e in measured]
        rate = sum(r["images"] for r in m) / sum(r["seconds"] for r in m)
        rates.append(rate)
        for r in eps:
            st = r.get("stats", {})
            job_rows.append({"config": res["name"], "share": int(res["share"]), "K": len(res["jobs"]),
                             "job": i, "batch_size": spec["batch_size"], "slow": int(spec["sleep"] > 0),
                             "epoch": r["epoch"], "images": r["images"], "seconds": round(r["seconds"], 4),
                             "images_per_s": round(r["images"] / r["seconds"], 2),
                             "samples_shared": st.get("samples_shared", ""),
                             "samples_self_prepared": st.get("samples_self_prepared", ""),
                             "coordl_storage_bytes": st.get("bytes_from_storage", ""),
                             "coordl_cache_bytes": st.get("bytes_from_cache", "")})
    fast = [r for r, s in zip(rates, res["specs"]) if not s["sleep"]]
    cpu = [_window(jobs_epochs, e, e, "cpu_ns") for e in range(args.epochs)]
    cg_read = [_window(jobs_epochs, e, e, "cg_read") for e in range(args.epochs)]
    dev_read = [_window(jobs_epochs, e, e, "dev_read") for e in range(args.epochs)]
    shared = sum(t.get("samples_shared", 0) or 0 for _, t in res["jobs"])
    selfp = sum(t.get("samples_self_prepared", 0) or 0 for _, t in res["jobs"])
    has_split = any("samples_shared" in t for _, t in res["jobs"])
    row = {"config": res["name"], "share": int(res["share"]), "K": len(res["jobs"]),
           "batch_sizes": "/".join(str(s["batch_size"]) for s in res["specs"]),
           "slow_jobs": sum(1 for s in res["specs"] if s["sleep"]),
           "job_images_per_s": "/".join(f"{r:.1f}" for r in rates),
           "mean_images_per_s": statistics.mean(rates), "min_fast_images_per_s": min(fast),
           "mean_fast_images_per_s": statistics.mean(fast),
           "min_ratio_vs_solo": min(fast) / solo_rate if solo_rate else float("nan"),
           "mean_ratio_vs_solo": statistics.mean(fast) / solo_rate if solo_rate else float("nan")}
    for e in range(args.epochs):
        row[f"cpu_s_epoch{e}"] = cpu[e] / 1e9 if cpu[e] is not None else float("nan")
        row[f"storage_mib_epoch{e}"] = cg_read[e] / 2**20 if cg_read[e] is not None else float("nan")
        row[f"device_mib_epoch{e}"] = dev_read[e] / 2**20 if dev_read[e] is not None else float("nan")
    if res["by_role"] is not None:
        # over the fast jobs' measured epochs (a slow job's tail would spread them thin)
        fast_eps = [ep for ep, s in zip(jobs_epochs, res["specs"]) if not s["sleep"]]
        starts = [ep[measured[0]]["start"]["t"] for ep in fast_eps]
        ends = [ep[measured[-1]]["end"]["t"] for ep in fast_eps]
        for k, v in res["by_role"].between(min(starts), max(ends)).items():
            row[f"cpu_s_per_epoch {k}"] = v / len(measured)
    m_cpu = _window(jobs_epochs, measured[0], measured[-1], "cpu_ns")
    row["cpu_s_per_epoch"] = m_cpu / len(measured) / 1e9 if m_cpu is not None else float("nan")
    # the training steps' own CPU (all jobs), so the loader's share can be told apart
    row["step_cpu_s_per_epoch"] = sum(ep[e]["step_cpu_s"] for ep in jobs_epochs for e in measured) / len(measured)
    all_read = _window(jobs_epochs, 0, args.epochs - 1, "cg_read")
    row["storage_mib_all_epochs"] = all_read / 2**20 if all_read is not None else float("nan")
    all_dev = _window(jobs_epochs, 0, args.epochs - 1, "dev_read")
    row["device_mib_all_epochs"] = all_dev / 2**20 if all_dev is not None else float("nan")
    row["coordl_storage_mib"] = sum(t.get("bytes_from_storage", 0) for _, t in res["jobs"]) / 2**20
    row["shared_fraction"] = shared / (shared + selfp) if has_split and shared + selfp else float("nan")
    groups = [len(g.get("members", [])) for st in res["status"] for g in (st.get("groups") or [])]
    row["daemon_max_group"] = max(groups) if groups else (0 if res["share"] else "")
    # per epoch, the CRC of every job (one value if all jobs got the same samples)
    crcs = [{ep[e].get("crc") for ep in jobs_epochs if len(ep) > e} for e in range(args.epochs)]
    row["images_per_epoch"] = jobs_epochs[0][0]["images"] if jobs_epochs and jobs_epochs[0] else 0
    row["epoch_crcs"] = "/".join(",".join(sorted(str(c) for c in cs)) for cs in crcs)
    return row, job_rows


def _groups_seen(snapshots: list[dict]) -> str:
    """What ``coordl daemon status`` showed while the jobs ran (polled each second)."""
    if not snapshots:
        return "no status answered"
    errors = [st["error"] for st in snapshots if "error" in st]
    ok = [st for st in snapshots if "error" not in st]
    if not ok:
        return f"status failed: {errors[-1]}"
    sizes = max((sorted((len(g.get("members", [])) for g in st.get("groups") or []), reverse=True)
                 for st in ok), default=[])
    workers = max(len(st.get("worker_pids") or []) for st in ok)
    prepared = max((sum(g.get("prepared", 0) for g in st.get("groups") or []) for st in ok), default=0)
    detaches = max((sum(g.get("detaches", 0) for g in st.get("groups") or []) for st in ok), default=0)
    return (f"largest groups seen {sizes or 'none'}, up to {workers} daemon worker(s), "
            f"{prepared} samples prepared by the last poll, {detaches} detaches")


# ===================================================================== report
def _median_rows(rows: list[dict]) -> list[dict]:
    out = []
    for rs, m in _host.medians_by_config(rows):
        per_job = [[float(x) for x in r["job_images_per_s"].split("/")] for r in rs]
        m["job_images_per_s"] = "/".join(f"{statistics.median(v):.1f}" for v in zip(*per_job))
        out.append(m)
    return out


def _f(x, fmt):
    return "-" if x is None or x == "" or (isinstance(x, float) and x != x) else format(x, fmt)


def report(rows: list[dict], job_rows: list[dict], args, share_ok: bool) -> None:
    med = _median_rows(rows)
    last = args.epochs - 1
    print(f"\n{'config':<19}{'K':>2}{'batch':>15}{'images/s per job':>26}{'min/solo':>9}{'mean/solo':>10}"
          f"{'CPU s/ep':>9}{'CPU/solo':>9}{'MiB ep0':>8}{f'MiB ep{last}':>8}{'dev ep0':>8}{'shared':>7}")
    solo = next((r for r in med if r["config"] == "solo"), None)
    for r in med:
        cpu_ratio = r["cpu_s_per_epoch"] / solo["cpu_s_per_epoch"] if solo else float("nan")
        print(f"{r['config']:<19}{r['K']:>2}{r['batch_sizes']:>15}{r['job_images_per_s']:>26}"
              f"{_f(r['min_ratio_vs_solo'], '.2f'):>9}{_f(r['mean_ratio_vs_solo'], '.2f'):>10}"
              f"{_f(r['cpu_s_per_epoch'], '.2f'):>9}{_f(cpu_ratio, '.2f'):>9}"
              f"{_f(r['storage_mib_epoch0'], '.1f'):>8}{_f(r[f'storage_mib_epoch{last}'], '.1f'):>8}"
              f"{_f(r['device_mib_epoch0'], '.1f'):>8}{_f(r['shared_fraction'], '.0%'):>7}")
    if len(rows) > len(med):
        print(f"(medians of {med[0]['rounds']} rounds; per job: each job's median)")
    print("images/s: epochs 1.. (epoch 0 is warm-up); CPU s/ep: all processes in the cgroup per epoch; "
          "MiB: read from storage by the cgroup's processes; dev: the whole device; shared: samples "
          "received shared / all")

    if any(f"cpu_s_per_epoch {ROLES[0]}" in r for r in med):
        print("\nCPU s per epoch by process (sampled from /proc; the cgroup's total above is the figure of record):")
        print(f"{'config':<19}" + "".join(f"{k:>16}" for k in ROLES) + f"{'sum':>8}{'cgroup':>8}"
              f"{'of which steps':>16}")
        for r in med:
            vals = [r.get(f"cpu_s_per_epoch {k}", float("nan")) for k in ROLES]
            print(f"{r['config']:<19}" + "".join(f"{_f(v, '.2f'):>16}" for v in vals)
                  + f"{_f(sum(vals), '.2f'):>8}{_f(r['cpu_s_per_epoch'], '.2f'):>8}"
                  f"{_f(r['step_cpu_s_per_epoch'], '.2f'):>16}")
        print(f"(of which steps: the jobs' training steps (--step {args.step}), the CPU time of the thread "
              "running them, torch at 1 thread in the jobs' main processes)")

    by = {r["config"]: r for r in med}

    def ratio(a, b, key):
        if a in by and b in by and by[b][key] and by[b][key] == by[b][key]:
            return by[a][key] / by[b][key]
        return None

    print("\ntargets:")
    if not share_ok:
        print("  sharing: not run: this coordl.DataLoader has no share= parameter")
    lines = []
    if "shared-K4" in by:
        x = by["shared-K4"]["min_ratio_vs_solo"]
        lines.append(("each job at K=4 with sharing >= 0.85x solo", x, x >= 0.85))
    for k in ("K2", "K4"):
        if k in by:
            x = by[k]["mean_ratio_vs_solo"]
            lines.append((f"without sharing at {k[1:]} jobs: ~1/{k[1:]} (report)", x, None))
    if "shared-mixed" in by:
        x = by["shared-mixed"]["min_ratio_vs_solo"]
        lines.append((f"batch sizes {by['shared-mixed']['batch_sizes']} sharing: each job vs solo (report)",
                      x, None))
    x = ratio("shared-K4", "solo", "cpu_s_per_epoch")
    if x is not None:
        lines.append(("CPU s per epoch, K=4 sharing / solo <= 1.15", x, x <= 1.15))
    if "shared-K4" in by and "solo" in by:
        a = by["shared-K4"]["cpu_s_per_epoch"] - by["shared-K4"]["step_cpu_s_per_epoch"]
        b = by["solo"]["cpu_s_per_epoch"] - by["solo"]["step_cpu_s_per_epoch"]
        if b > 0:
            lines.append(("  the same without the training steps' CPU (report)", a / b, None))
    x = ratio("shared-K4", "solo", "storage_mib_all_epochs")
    if x is not None:
        lines.append(("storage bytes over the epochs, K=4 sharing / solo = 1", x, abs(x - 1) <= 0.05))
    x = ratio("shared-fast3+slow", "shared-fast3", "mean_fast_images_per_s")
    if x is not None:
        lines.append(("fast members with a 1/3-speed member / without it >= 0.9", x, x >= 0.9))
    # the slowest job vs solo, the CPU bound, bit-identity, idle start
    if "shared-K4" in by:
        x = by["shared-K4"]["min_ratio_vs_solo"]
        if args.step == "sleep":    # the target's step; with another step it is a report
            lines.append(("slowest of K=4 sharing / solo >= 0.9 (step sleep)", x, x >= 0.9))
        else:
            lines.append((f"slowest of K=4 sharing / solo (step {args.step}; report)", x, None))
    if "shared-mixed" in by:
        x = by["shared-mixed"]["min_ratio_vs_solo"]
        lines.append(("slowest of mixed batch sizes sharing / solo >= 0.9", x, x >= 0.9))
    if "solo" in by and "shared-K4" in by:
        so = by["solo"]
        secs = 1.0 / so["mean_images_per_s"]          # solo seconds per image
        step_per_img = so["step_cpu_s_per_epoch"]
        prep_per_epoch = so["cpu_s_per_epoch"] - step_per_img
        if prep_per_epoch == prep_per_epoch and prep_per_epoch > 0:
            cores = len(os.sched_getaffinity(0))
            # K jobs sharing need one prep and K steps per epoch; on `cores` cores that takes at least
            # (prep + K * step) / cores seconds; solo took images * secs
            images = so["images_per_epoch"]
            bound = min(1.0, images * secs * cores / (prep_per_epoch + 4 * step_per_img))
            lines.append((f"K=4 CPU-seconds bound on {cores} cores vs solo (report)", bound, None))
            x = by["shared-K4"]["min_ratio_vs_solo"]
            lines.append((f"slowest of K=4 sharing / that bound (step {args.step}; report)",
                          x / bound, None))
    if "solo" in by:
        ref = by["solo"]["epoch_crcs"]
        same = all(r["epoch_crcs"] == ref for r in med if r.get("epoch_crcs") and "," not in r["epoch_crcs"])
        one = all("," not in r.get("epoch_crcs", "") for r in med)
        lines.append(("every job's batches bit-identical to solo (1 = yes)",
                      float(same and one), same and one))
    idle_line(args, lines)
    if args.check != "all":
        lines.append(({"warmup": "  (bit-identity hashed in epoch 0, the warm-up; --check all: every epoch)",
                       "none": "  (bit-identity not checked: --check none)"}[args.check], float("nan"), None))
    for text, x, met in lines:
        if x != x:
            met = None
        verdict = "" if met is None else ("  met" if met else "  NOT met")
        print(f"  {text:<62}{_f(x, '.2f'):>6}{verdict}")

    os.makedirs(args.out, exist_ok=True)
    for fname, data in (("sharing.csv", rows), ("sharing_jobs.csv", job_rows)):
        path = os.path.join(args.out, fname)
        keys = list(dict.fromkeys(k for r in data for k in r))
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            for r in data:
                w.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
        print(f"wrote {path}")
    plot(med, args)


def idle_line(args, lines: list) -> None:
    """The idle target: first batch after the daemon idled / warm start."""
    got = getattr(args, "idle_results", None)
    if not got:
        return
    warm = statistics.median(w for w, _ in got)
    idle = statistics.median(i for _, i in got)
    x = idle / warm if warm > 0 else float("nan")
    lines.append((f"first batch after {args.idle:g} s idle / warm start <= 2 "
                  f"({idle:.2f} s / {warm:.2f} s)", x, x <= 2))


def plot(med: list[dict], args) -> None:
    plt = _host.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for share, names, color, label in ((0, ("solo", "K2", "K4"), "#888", "without sharing"),
                                       (1, ("shared-K1", "shared-K2", "shared-K4"), "#1f77b4", "share=True")):
        rs = [r for r in med if r["config"] in names]
        if not rs:
            continue
        ks = [r["K"] for r in rs]
        ax.plot(ks, [r["mean_images_per_s"] for r in rs], "-o", color=color, label=f"{label} (mean per job)")
        for r in rs:
            per_job = [float(x) for x in r["job_images_per_s"].split("/")]
            ax.scatter([r["K"]] * len(per_job), per_job, color=color, s=10, alpha=0.5)
    solo = next((r for r in med if r["config"] == "solo"), None)
    if solo:
        ax.axhline(0.85 * solo["mean_images_per_s"], color="#1f77b4", ls=":", lw=1, label="0.85x solo")
        ax.plot([1, 2, 4], [solo["mean_images_per_s"] / k for k in (1, 2, 4)], ":", color="#888", lw=1,
                label="solo / K")
    ax.set_xticks([1, 2, 4])
    ax.set_xlabel("concurrent jobs K")
    ax.set_ylabel("images/s per job")
    ax.set_ylim(bottom=0)
    ax.set_title(f"per-job throughput, {args.workers} workers each, batch {args.batch_size}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = os.path.join(args.out, "sharing.png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    print(f"wrote {png}")


# ======================================================================= held batches
def held(args) -> int:
    """The held-batches target: 0 rows of a kept batch changed.

    ``--held-jobs`` loaders (members of one group, in this process) run
    ``--epochs`` epochs, then the same epochs again (``set_epoch`` from 0),
    over a staging of ``--held-staging`` (small, so the daemon reuses slots
    every few epochs).  Each keeps the second batch of every epoch it runs
    (the first batch of a loader's first pass holds a sample it prepared
    itself, so the second is the first that can be a view of staging) and,
    after every epoch, compares the rows of everything it keeps with copies
    made when they were handed out.  Running an epoch again views the kept
    batches' positions a second time: the case that breaks uncounted pins.
    Every epoch is also checked against ``share=False`` (CRC-32 of its
    images and labels).  Returns 1 if a row changed or an epoch differs."""
    import zlib

    import common
    import coordl
    import torch
    from coordl.daemon import server

    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory(prefix="coordl-sharing-held-")
    os.environ["COORDL_RUN_DIR"] = os.path.join(tmp.name, "run")
    os.mkdir(os.environ["COORDL_RUN_DIR"], 0o700)
    os.environ["COORDL_STAGING"] = args.held_staging
    try:
        from coordl.synth import make_image_folder

        root = args.root
        if root is None:
            root = os.path.join(tmp.name, "photos")
            make_image_folder(root, num_images=args.images, num_classes=10, seed=0, image_size=(96, 72))

        def loader(share):
            ds = common.coordl_dataset(root, size=args.held_crop)
            return coordl.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers, seed=args.seed,
                                     share=share)

        def crc(batches, keep=None):
            """CRC-32 of an epoch's images and labels; ``keep(k, batch)`` sees each batch first."""
            cx = cy = 0
            for k, (x, y) in enumerate(batches):
                if keep is not None:
                    keep(k, (x, y))
                cx = zlib.crc32(x.contiguous().numpy().tobytes(), cx)
                cy = zlib.crc32(y.numpy().astype("<i8").tobytes(), cy)
            return cx, cy

        ref_loader = loader(False)
        ref = []
        for e in range(args.epochs):
            ref_loader.set_epoch(e)
            ref.append(crc(ref_loader))
        del ref_loader
        t0 = time.monotonic()
        jobs = [loader(True) for _ in range(args.held_jobs)]
        kept = []          # (job, epoch, round, batch, copy of it when handed out, a view of staging)
        changed = differ = 0
        for rnd in range(2):
            for e in range(args.epochs):
                for j, ld in enumerate(jobs):
                    ld.set_epoch(e)
                    seen = []

                    def keep(k, b):
                        if k < 2:
                            seen.append(ld.stats().batches_zero_copy)   # views so far, this batch included
                        if k == 1:
                            kept.append((j, e, rnd, b, (b[0].clone(), b[1].clone()), seen[1] == seen[0] + 1))

                    differ += crc(ld, keep) != ref[e]
                for _, _, _, b, c, _ in kept:
                    changed += int(((b[0] != c[0]).flatten(1).any(1) | (b[1] != c[1])).sum())
        seconds = time.monotonic() - t0
        views = sum(1 for x in kept if x[5])
        rows = sum(int(x[3][0].shape[0]) for x in kept)
        zero_copy = sum(ld.stats().batches_zero_copy for ld in jobs)
        batches = sum(ld.stats().batches for ld in jobs)
        print(f"held batches: {changed} changed rows of {rows} rows in {len(kept)} kept batches ({views} views of "
              f"staging), checked after every epoch; {args.held_jobs} jobs x epochs 0..{args.epochs - 1} twice, "
              f"batch {args.batch_size}, {args.held_crop}x{args.held_crop} crops, staging {args.held_staging}; "
              f"{zero_copy} of {batches} batches views; epochs differing from share=False: {differ} "
              f"({seconds:.0f} s)", flush=True)
        del kept, jobs
        return 0 if changed == 0 and differ == 0 and views > 0 else 1
    finally:
        server.stop()
        tmp.cleanup()


# ======================================================================= main
def plan_configs(args, share_ok: bool) -> list[tuple[str, list[dict], bool]]:
    b = args.batch_size
    mixed = [b // 2, b, 2 * b, 4 * b]
    table = {
        "solo": ([b], False), "K2": ([b] * 2, False), "K4": ([b] * 4, False),
        "shared-K1": ([b], True), "shared-K2": ([b] * 2, True), "shared-K4": ([b] * 4, True),
        "shared-mixed": (mixed, True), "shared-fast3": ([b] * 3, True), "shared-fast3+slow": ([b] * 4, True),
        "shared-idle": ([b], True),
    }
    out = []
    for name in args.configs.split(","):
        if name not in table:
            raise SystemExit(f"--configs should list names from {','.join(CONFIGS)}, but got {name!r}")
        sizes, share = table[name]
        if share and not share_ok:
            continue
        out.append((name, [{"batch_size": s, "sleep": 0.0} for s in sizes], share))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="ImageFolder root (default: generate --images photos)")
    ap.add_argument("--images", type=int, default=None, help="images to generate when --root is not given "
                    "(default 1000)")
    ap.add_argument("--mean-kb", type=float, default=None,
                    help="mean JPEG size of the generated images (KB, default 110)")
    ap.add_argument("--stagger", type=float, default=None,
                    help="seconds between the starts of a configuration's jobs (default: all at once)")
    ap.add_argument("--independent", action="store_true",
                    help="the independent check's setup: 2,000 ImageNet-sized JPEGs of ~84 KB, batch 64, "
                         "2 workers, the sleep step, no node cache, jobs started 0.5 s apart, configurations "
                         "solo,shared-K4; options given as well take precedence")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per job; epoch 0 is the warm-up")
    ap.add_argument("--workers", type=int, default=None, help="num_workers of every job, default 2 (the daemon "
                    "runs what the sharing jobs brought: K x this, at most the CPUs)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="batch of every job, default 64 (mixed: /2, x1, x2, x4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-size", default=None, help='node cache of every job ("0": off; default 2GiB)')
    ap.add_argument("--rounds", type=int, default=3, help="repeat all configurations (medians reported)")
    ap.add_argument("--configs", default=None, help=f"default: {','.join(CONFIGS)}")
    ap.add_argument("--step", choices=sorted(STEPS), default=None,
                    help="the jobs' training step: mean = images.float().mean() (default), light = the mean "
                         "of one pixel row per image (the loader alone)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per configuration before killing it")
    ap.add_argument("--no-drop-caches", action="store_true", help="keep the page cache between configurations")
    ap.add_argument("--out", default=os.path.join("bench_out", "sharing"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    ap.add_argument("--idle", type=float, default=60.0, help="shared-idle: seconds the daemon idles before a new job")
    ap.add_argument("--check", choices=("warmup", "all", "none"), default="warmup",
                    help="bit-identity CRCs of every job's batches: in the warm-up epoch (default: hashing "
                         "takes ~3 ms of CPU per batch of 64 in every job, which the timed epochs would "
                         "take from the loader), in every epoch, or none")
    ap.add_argument("--no-check", action="store_true", help="the same as --check none")
    ap.add_argument("--held", action="store_true",
                    help="run only the held-batches check (--epochs: 6 unless given; see held())")
    ap.add_argument("--held-jobs", type=int, default=2, help="--held: loaders sharing one group")
    ap.add_argument("--held-staging", default="16MiB", help="--held: the group's staging (COORDL_STAGING)")
    ap.add_argument("--held-crop", type=int, default=64, help="--held: crop size of the samples")
    # internal: one job process, or the daemon starter
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--daemon-start", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--share", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job-name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--cgroup-dirs", default="", help=argparse.SUPPRESS)
    ap.add_argument("--dev", default="", help=argparse.SUPPRESS)
    ap.add_argument("--dev-id", default="", help=argparse.SUPPRESS)
    ap.add_argument("--warm-maps", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for k, v in (INDEPENDENT if args.independent else DEFAULTS).items():   # what the command line does not say
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.configs = args.configs or ",".join(CONFIGS)
    if args.no_check:
        args.check = "none"
    if args.job:
        return job(args)
    if args.daemon_start:
        return daemon_start(args)
    if args.held:
        if "--epochs" not in (argv if argv is not None else sys.argv[1:]):
            args.epochs = 6
        if "--batch-size" not in (argv if argv is not None else sys.argv[1:]):
            args.batch_size = 16
        if args.quick:   # staging wraps within the run: 96 samples of 32x32 an epoch, ~165 slots
            args.images, args.epochs, args.workers = 96, 3, 1
            args.held_crop, args.held_staging = 32, "512KiB"
        return held(args)
    if args.quick:
        args.images, args.batch_size, args.epochs, args.workers, args.rounds = 48, 8, 2, 1, 1
        args.cache_size = "64MiB"  # the budget is reserved in /dev/shm up front
        args.timeout = min(args.timeout, 180)
        args.idle = min(args.idle, 2.0)

    import coordl

    share_ok = "share" in inspect.signature(coordl.DataLoader).parameters
    configs = plan_configs(args, share_ok)
    is_root = os.geteuid() == 0
    tmp = tempfile.TemporaryDirectory(prefix="coordl-sharing-")
    # a private run directory: our daemon is nobody else's, and theirs is not ours
    os.environ["COORDL_RUN_DIR"] = os.path.join(tmp.name, "run")
    os.mkdir(os.environ["COORDL_RUN_DIR"], 0o700)
    try:
        from coordl.synth import make_image_folder
        if args.root is None:
            args.root = os.path.join(tmp.name, "photos")
            kw = {"image_size": (96, 72)} if args.quick else {"mean_kb": args.mean_kb}
            make_image_folder(args.root, num_images=args.images, num_classes=10, seed=0, **kw)
        primer = os.path.join(tmp.name, "primer")
        make_image_folder(primer, num_images=8, num_classes=2, image_size=(96, 72), seed=1)
        try:
            dev, dev_id = cachebench._dev_of(args.root)
        except (RuntimeError, OSError):
            dev, dev_id = None, None
        if is_root and _v1_mount("cpuacct") is not None:
            for path in _sweep_stale():
                print(f"removed {path}: left by an earlier run that was killed")
        ctx = {"cgroups": is_root and _v1_mount("cpuacct") is not None, "drop": is_root and not args.no_drop_caches,
               "dev": dev, "dev_id": dev_id, "tmp": tmp.name, "primer": primer}
        n_files = sum(len(f) for _, _, f in os.walk(args.root))
        nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.root) for f in fs)
        print(f"dataset {args.root}: {n_files} files, {nbytes / 2**20:.1f} MiB on /dev/{dev}; {args.workers} "
              f"workers, batch {args.batch_size} and step {args.step!r} per job, {args.epochs} epochs (epoch 0 warm-up), node cache "
              f"{args.cache_size}, jobs started {args.stagger:g} s apart, {os.cpu_count()} cores; page cache dropped before each configuration: "
              f"{'yes' if ctx['drop'] else 'no'}; cgroup CPU/storage accounting: "
              f"{'yes, groups coordl-sharing-%d-*' % os.getpid() if ctx['cgroups'] else 'no (needs root and cgroup v1 cpuacct)'}",
              flush=True)
        if not share_ok:
            print("coordl.DataLoader has no share= parameter: running the configurations without sharing only")
        rows, job_rows, failed = [], [], []
        for rnd in range(args.rounds):
            solo_rate = None
            for name, specs, share in configs:
                if name == "shared-fast3+slow":
                    if solo_rate is None:
                        print(f"  {name}: skipped (needs the solo configuration for the slow job's sleep)")
                        continue
                    # runs at ~1/3 of solo: each step takes 3x a solo step
                    specs[-1]["sleep"] = 3 * specs[-1]["batch_size"] / solo_rate
                t0 = time.monotonic()
                if name == "shared-idle":
                    try:
                        warm, idle = run_idle(args, ctx)
                    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:
                        failed.append(f"round {rnd} {name}: {e}")
                        print(f"  round {rnd} {name:<18} FAILED: {e}", flush=True)
                        continue
                    args.idle_results = getattr(args, "idle_results", []) + [(warm, idle)]
                    print(f"  round {rnd} {name:<18} first batch: warm start {warm:.2f} s, after {args.idle:g} s "
                          f"idle {idle:.2f} s ({time.monotonic() - t0:.0f} s)", flush=True)
                    continue
                try:
                    res = run_config(args, name, specs, share, ctx)
                except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:
                    # its processes are gone (run_config kills the cgroup); the others still run
                    failed.append(f"round {rnd} {name}: {e}")
                    print(f"  round {rnd} {name:<18} FAILED: {e}", flush=True)
                    continue
                row, jrows = summarize(res, args, solo_rate)
                if name == "solo":
                    solo_rate = row["mean_images_per_s"]
                    row["min_ratio_vs_solo"] = row["mean_ratio_vs_solo"] = 1.0
                row["round"] = rnd
                for r in jrows:
                    r["round"] = rnd
                rows.append(row)
                job_rows.extend(jrows)
                extra = f", sleep {specs[-1]['sleep'] * 1e3:.0f} ms/step in the slow job" if specs[-1]["sleep"] else ""
                if share:
                    extra += f", daemon pid {res['daemon_pid']}: {_groups_seen(res['status'])}"
                print(f"  round {rnd} {name:<18} {row['job_images_per_s']:>28} images/s per job "
                      f"({time.monotonic() - t0:.0f} s{extra})", flush=True)
        if not rows:
            lines = []
            idle_line(args, lines)
            for text, x, met in lines:
                print(f"  {text:<62}{_f(x, '.2f'):>6}{'  met' if met else '  NOT met'}")
            if not lines:
                print("nothing ran")
            return 1 if failed or not lines else 0
        report(rows, job_rows, args, share_ok)
        if failed:
            print("\nfailed configurations:\n  " + "\n  ".join(failed))
            return 1
    finally:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
