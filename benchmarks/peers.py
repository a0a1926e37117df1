"""Partitioned cache across nodes: three "nodes" on one machine, each
in its own network namespace, cgroups and node-cache namespace, training
data-parallel over torch.distributed (gloo); a node's cache miss is served
by the peer that holds the sample (``peers="on"``), or read from storage.

Set-up (created here, removed on exit, also on failure, Ctrl-C or SIGTERM):

* network: one namespace per node (``ip netns add``), each joined to a bridge
  in the root namespace by a veth pair; both ends of every veth are limited
  to ``--link-mbit`` (default 1000) with ``tc ... tbf`` (this kernel has no
  netem), so a node sends and receives at ~1 Gbit/s.  Inside a namespace the
  veth is ``cdl0``: gloo uses it (``GLOO_SOCKET_IFNAME``), MASTER_ADDR is
  node 0's address there, and coordl's cache server binds the address that
  routes to MASTER_ADDR (``COORDL_PEER_ADDR`` unset);
* per node a cgroup v1 ``blkio`` group (reads from the dataset's block device
  throttled to ``--read-mbps`` per node, and counted by the kernel:
  ``blkio.throttle.io_service_bytes``), a ``memory`` group (capped at the
  node cache + ``--mem-slack``; the node cache lives in /dev/shm and is
  charged to the group that first touches it, i.e. its node) and, when
  mounted, a ``cpuacct`` group (the node's CPU seconds per epoch);
* per node one rank (``--ranks-per-node``), ``COORDL_NODE_ID`` distinct per
  node (the namespaces share /dev/shm: the node id keeps the caches apart).

Configurations, interleaved round by round (``--rounds``, medians reported):

* ``peers``: node cache per node just over 1/3 of the dataset
  (``--cache-fraction``), ``peers="on"``;
* ``off``: the same caches, ``peers="off"``;
* ``local``: the reference: every node has the whole dataset in its cache
  (cache = 1.1 x dataset, filled before epoch 0 by one pass of a
  single-rank loader on the same cache), ``peers="off"``.

Each configuration starts cold: page cache dropped (``echo 3 >
/proc/sys/vm/drop_caches``), no coordl cache segment of this run left (the
segments go with their last holder; leftovers are removed by name).  Epoch
0 fills the caches; it runs with the storage throttle off (so the run stays
short: it is not measured), and the throttle is set before epoch 1.  The
parent starts every epoch on all nodes at once and reads each node's
blkio counter between epochs (a process inside ``ip netns exec`` no longer
sees /sys/fs/cgroup).  Per node and epoch it records: epoch time, images,
bytes from the local cache / peers / storage by coordl's ``stats()``, and
bytes read from the block device by the node's blkio group, the node's CPU
seconds, and the CPU the rest of the machine used meanwhile (/proc/stat: other
tenants of the cores).  The cluster's epoch time is the slowest node's
(data-parallel training waits for it); a configuration's figure is the median
over epochs >= 1.  A link check (one TCP stream between two namespaces)
runs before the configurations.

Targets: cluster storage bytes per epoch after epoch 1 <= 2% of
the dataset (blkio) against ~0.67 without peers; epoch time with peers <=
1.2x the all-local reference and >= 2x faster than without peers.

    python -m coordl.synth /tmp/peersds3k --images 3000      # ~320 MB
    python benchmarks/peers.py --root /tmp/peersds3k --epochs 5 --rounds 3 --out docs/img   # ~8 min
    python benchmarks/peers.py --quick                       # smoke run: loopback, no root needed

The first-pass and connection targets (``benchmarks/_peers_first_pass.py``; functional counts,
loopback, no root)::

    python benchmarks/peers.py first-pass --nodes 3 --images 3000 --epochs 4   # resume/partial/eval/adopted
    python benchmarks/peers.py connections --nodes 64 --ranks 8 --workers 8     # 4,032 connections on one server

Writes DIR/peers.csv (one row per round, configuration, node and epoch),
DIR/peers_summary.csv (one row per configuration and round) and
DIR/peers.png (per node and epoch: bytes from cache / peers / storage).
``--no-netns`` runs the nodes as plain processes on loopback (no
namespaces, no link limit); ``--no-cgroups`` without cgroups (no throttle,
no blkio counts); ``--quick`` implies both, a tiny dataset and no
drop_caches, so it runs without root (the test suite uses it).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _host  # noqa: E402

CONFIGS = ("peers", "off", "local")
MEM = "/sys/fs/cgroup/memory"
BLKIO = "/sys/fs/cgroup/blkio"
CPUACCT = "/sys/fs/cgroup/cpuacct"
INNER_IF = "cdl0"   # the veth's name inside every namespace


# ======================================================================= job
def job(args) -> int:
    """One rank: build the loader (collective), then one epoch per "go" line
    on stdin, one JSON line per epoch on stdout."""
    import dataclasses
    import datetime

    os.environ["COORDL_NODE_ID"] = args.node
    import torch
    import torch.distributed as dist

    import common
    import coordl

    torch.set_num_threads(1)

    def emit(rec):
        print(json.dumps(rec), flush=True)

    dist.init_process_group("gloo", rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    pre = None
    if args.prefill:
        # the reference: this node's cache gets the whole dataset before
        # epoch 0 (a single-rank pass over every sample; it holds the segment,
        # so the loader below attaches to the same, full cache)
        pre = coordl.DataLoader(common.coordl_dataset(args.root, args.crop), batch_size=args.batch_size,
                                num_workers=args.workers, rank=0, world_size=1, cache_size=args.cache_size,
                                peers="off")
        for _ in pre:
            pass
        emit({"prefilled": pre.stats().bytes_from_storage})
    L = coordl.DataLoader(common.coordl_dataset(args.root, args.crop), batch_size=args.batch_size, shuffle=True,
                          num_workers=args.workers, persistent_workers=args.workers > 0, seed=args.seed,
                          cache_size=args.cache_size, peers=args.peers)
    server = L.peer_server
    emit({"ready": os.getpid(), "server": list(server.address) if server else None})
    for e in range(args.epochs):
        if sys.stdin.readline().strip() != "go":
            return 2   # the benchmark went away
        t0, n, first = time.perf_counter(), 0, None
        for images, _ in L:
            if first is None:
                first = time.perf_counter() - t0
            images[:, :, 0].float().mean()    # a trivial step: the loader is measured
            n += int(images.shape[0])
        dt = time.perf_counter() - t0
        st = L.stats().epochs[-1]
        emit({"epoch": e, "images": n, "seconds": dt, "first_batch_s": first, "stats": dataclasses.asdict(st)})
    emit({"done": os.getpid()})
    sys.stdin.readline()   # "exit": every rank leaves together (the servers serve until then)
    del L, pre
    dist.destroy_process_group()
    return 0


# ==================================================================== set-up
def _run(cmd: list[str], check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {r.returncode}): {r.stderr.strip()}")
    return r


# a bulk TCP transfer between two namespaces: what a link really carries
LINK_RX = """
import socket, sys, time
s = socket.socket(); s.settimeout(30); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.settimeout(30); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if t0 is None:
        t0 = time.perf_counter()
    n += len(b)
print(n * 8 / (time.perf_counter() - t0) / 1e6, flush=True)
"""
LINK_TX = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30); buf = bytes(1 << 20); t0 = time.perf_counter()
while time.perf_counter() - t0 < float(sys.argv[3]):
    c.sendall(buf)
c.close()
"""


class Net:
    """Namespaces, a bridge, veth pairs and their tbf qdiscs; ``remove()``
    undoes whatever was made (deleting a namespace deletes its veth end and
    the pair with it)."""

    def __init__(self, tag: str, nodes: int, mbit: float, subnet: int):
        self.tag = tag
        self.bridge = f"cdlb{tag}"
        self.netns = [f"coordl-peers-{tag}-n{k}" for k in range(nodes)]
        self.outer = [f"cdl{tag}n{k}" for k in range(nodes)]
        self.addrs = [f"10.213.{subnet}.{k + 2}" for k in range(nodes)]
        self.made: list[tuple[str, str]] = []
        rate = f"{mbit:g}mbit"
        # tbf: the bucket must hold at least a timer tick's worth at the rate
        burst = f"{max(64, int(mbit * 1e6 / 8 / 250 / 1024) * 2)}kb"
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", "20ms"]
        self.tbf = " ".join(tbf[1:])
        try:
            self._make(tbf)
        except BaseException:   # a half-made network is undone here: the caller never gets it
            self.remove()
            raise

    def _make(self, tbf: list[str]) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self.made.append(("link", self.bridge))
        _run(["ip", "link", "set", self.bridge, "up"])
        for ns, out, addr in zip(self.netns, self.outer, self.addrs):
            _run(["ip", "netns", "add", ns])
            self.made.append(("netns", ns))
            _run(["ip", "link", "add", out, "type", "veth", "peer", "name", INNER_IF, "netns", ns])
            self.made.append(("link", out))
            _run(["ip", "link", "set", out, "master", self.bridge])
            _run(["ip", "link", "set", out, "up"])
            _run(["tc", "qdisc", "add", "dev", out] + tbf)             # to the node
            x = ["ip", "netns", "exec", ns]
            _run(x + ["ip", "addr", "add", f"{addr}/24", "dev", INNER_IF])
            _run(x + ["ip", "link", "set", INNER_IF, "up"])
            _run(x + ["ip", "link", "set", "lo", "up"])
            _run(x + ["tc", "qdisc", "add", "dev", INNER_IF] + tbf)    # from the node

    def measure(self, seconds: float = 2.0) -> float:
        """Mbit/s of one TCP stream from node 1 to node 0 over the bridge."""
        rx = subprocess.Popen(["ip", "netns", "exec", self.netns[0], sys.executable, "-c", LINK_RX, self.addrs[0]],
                              stdout=subprocess.PIPE, text=True)
        try:
            port = rx.stdout.readline().strip()
            _run(["ip", "netns", "exec", self.netns[1], sys.executable, "-c", LINK_TX, self.addrs[0], port,
                  str(seconds)])
            return float(rx.communicate(timeout=30)[0].strip())
        finally:
            if rx.poll() is None:
                rx.kill()
                rx.wait()

    def remove(self) -> None:
        for kind, name in reversed(self.made):
            if kind == "netns":
                _run(["ip", "netns", "del", name], check=False)
            else:
                _run(["ip", "link", "del", name], check=False)
        self.made.clear()


def _machine_busy() -> float:
    """CPU seconds the whole machine has been busy (all processes, /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")   # minus idle and iowait


def _blkio_read(path: str, dev_id: str) -> int:
    with open(os.path.join(path, "blkio.throttle.io_service_bytes")) as f:
        for line in f:
            w = line.split()
            if len(w) == 3 and w[0] == dev_id and w[1] == "Read":
                return int(w[2])
    return 0


class NodeGroup:
    """One node's memory + blkio (+ cpuacct, when mounted) cgroups (v1)."""

    def __init__(self, name: str, mem_cap: int, dev_id: str):
        self.mem = os.path.join(MEM, name)
        self.blk = os.path.join(BLKIO, name)
        self.cpu = os.path.join(CPUACCT, name) if _v1("cpuacct") else None
        self.dev_id = dev_id
        self.dirs: list[str] = []
        try:
            for d in (self.mem, self.blk, self.cpu):
                if d:
                    os.mkdir(d)
                    self.dirs.append(d)
        except BaseException:
            self.remove()
            raise
        with open(os.path.join(self.mem, "memory.limit_in_bytes"), "w") as f:
            f.write(str(mem_cap))

    def throttle(self, bps: int) -> None:
        with open(os.path.join(self.blk, "blkio.throttle.read_bps_device"), "w") as f:
            f.write(f"{self.dev_id} {bps}")   # 0 removes the limit

    def read_bytes(self) -> int:
        return _blkio_read(self.blk, self.dev_id)

    def cpu_seconds(self) -> tuple[float, float] | None:
        """(all, kernel) CPU seconds of the node's processes so far."""
        if not self.cpu:
            return None
        with open(os.path.join(self.cpu, "cpuacct.usage")) as f:
            total = int(f.read()) / 1e9
        with open(os.path.join(self.cpu, "cpuacct.stat")) as f:
            kernel = next(int(l.split()[1]) for l in f if l.startswith("system")) / os.sysconf("SC_CLK_TCK")
        return total, kernel

    def peak_memory(self) -> int:
        with open(os.path.join(self.mem, "memory.max_usage_in_bytes")) as f:
            return int(f.read())

    def oom_kills(self) -> int:
        try:
            with open(os.path.join(self.mem, "memory.oom_control")) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def pids(self) -> set[int]:
        return _host.cgroup_pids(self.dirs)

    def kill_all(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {sorted(pids)} would not leave cgroup {self.mem}")
            for pid in pids:   # members of our own group, as the kernel lists them
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def remove(self) -> None:
        for d in reversed(self.dirs):
            _host.rmdir_retry(d)
        self.dirs.clear()


# ====================================================================== jobs
class Job(_host.JsonJob):
    """One rank's process; its JSON lines arrive on a queue."""

    def __init__(self, cmd: list[str], env: dict, log_path: str):
        super().__init__(cmd, env, log_path)
        self.eof = False

    def pump(self) -> None:
        for rec in self.arrived():
            if rec is None:
                self.eof = True
            else:
                self.recs.append(rec)

    def has(self, key: str, value=None) -> bool:
        return any(key in r and (value is None or r[key] == value) for r in self.recs)


def _wait_all(jobs: list[Job], key: str, value, deadline: float, what: str) -> None:
    while not all(j.has(key, value) for j in jobs):
        for j in jobs:
            j.pump()
            if j.eof and not j.has(key, value):
                raise RuntimeError(f"rank process {j.p.pid} exited (status {j.p.wait()}) before {what}; "
                                   f"its stderr:\n{j.stderr_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank reached {what} within --timeout")
        time.sleep(0.02)


def _child_env() -> dict:
    """The ranks import the coordl this script imported."""
    import coordl

    env = dict(os.environ)
    for k in ("COORDL_PEERS", "COORDL_PEER_ADDR", "COORDL_SHARE", "COORDL_NODE_ID"):
        env.pop(k, None)
    top = os.path.dirname(os.path.dirname(os.path.abspath(coordl.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([top, HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                      if p])
    return env


def _segment_names(root: str, nodes: list[str]) -> list[str]:
    """The node-cache segment of each of this run's nodes (a segment is named
    after the dataset and COORDL_NODE_ID)."""
    import coordl
    from coordl.cache.segment import _segment_name

    fp = coordl.ImageFolder(root).fingerprint()
    saved = os.environ.get("COORDL_NODE_ID")
    try:
        names = []
        for node in nodes:
            os.environ["COORDL_NODE_ID"] = node
            names.append(_segment_name(fp))
        return names
    finally:
        if saved is None:
            os.environ.pop("COORDL_NODE_ID", None)
        else:
            os.environ["COORDL_NODE_ID"] = saved


def _clear_segments(names: list[str]) -> list[str]:
    """Remove this run's segments that nobody holds any more (a killed
    configuration's: a segment normally goes with its last holder)."""
    from coordl.cache import clear_caches

    return [r for name in names for r in clear_caches(name)]


def run_config(args, ctx: dict, name: str, rnd: int) -> dict:
    """One configuration: start every node's ranks, run the epochs in lock
    step, record per node and epoch.  Everything it starts is gone when it
    returns or raises."""
    n_nodes, rpn = args.nodes, args.ranks_per_node
    world = n_nodes * rpn
    local = name == "local"
    cache = ctx["cache_local"] if local else ctx["cache_part"]
    node_ids = ctx["node_ids"]
    segments = ctx["segments"]
    groups: list[NodeGroup | None] = [None] * n_nodes
    jobs: list[Job] = []
    env = _child_env()
    port = ctx["port"] + 1 + (rnd * len(CONFIGS) + CONFIGS.index(name)) % 500
    master = ctx["net"].addrs[0] if ctx["net"] else "127.0.0.1"
    out = {"name": name, "round": rnd, "epochs": [], "peak_mem": [None] * n_nodes, "servers": []}
    ok = False
    try:
        _clear_segments(segments)
        if ctx["drop"]:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
        if ctx["cgroups"]:
            for k in range(n_nodes):
                groups[k] = NodeGroup(f"coordl-peers-{ctx['tag']}-{name}-{rnd}-n{k}",
                                      cache + ctx["mem_slack"], ctx["dev_id"])
        for k in range(n_nodes):
            for r in range(rpn):
                rank = k * rpn + r
                cmd = [sys.executable, os.path.abspath(__file__), "--job", "--root", args.root,
                       "--rank", str(rank), "--world", str(world), "--node", node_ids[k],
                       "--workers", str(args.workers), "--batch-size", str(args.batch_size),
                       "--epochs", str(args.epochs), "--cache-size", str(cache), "--seed", str(args.seed),
                       "--crop", str(args.crop), "--peers", "on" if name == "peers" else "off",
                       "--timeout", str(args.timeout)]
                if local:
                    cmd.append("--prefill")
                e = dict(env, MASTER_ADDR=master, MASTER_PORT=str(port))
                if ctx["net"]:
                    e["GLOO_SOCKET_IFNAME"] = INNER_IF
                    cmd = ["ip", "netns", "exec", ctx["net"].netns[k]] + cmd
                else:
                    e["GLOO_SOCKET_IFNAME"] = "lo"
                if groups[k]:
                    # join the node's cgroups before exec, so the rank and all it
                    # starts are in them (inside the namespace /sys/fs/cgroup is gone)
                    dirs = groups[k].dirs
                    cmd = (["sh", "-c", 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1/cgroup.procs" || '
                            'exit 97; shift; n=$((n - 1)); done; exec "$@"', "sh", str(len(dirs))] + dirs + cmd)
                jobs.append(Job(cmd, e, os.path.join(ctx["tmp"], f"{name}-{rnd}-rank{rank}.log")))
        deadline = time.monotonic() + args.timeout
        _wait_all(jobs, "ready", None, deadline, "a built loader")
        out["servers"] = [next(r["server"] for r in j.recs if "ready" in r) for j in jobs]
        out["prefilled"] = [next((r["prefilled"] for r in j.recs if "prefilled" in r), None) for j in jobs]
        for e in range(args.epochs):
            if e == 1 and ctx["cgroups"]:
                for g in groups:
                    g.throttle(int(args.read_mbps * 1e6))
            before = [g.read_bytes() if g else None for g in groups]
            cpu0 = [g.cpu_seconds() if g else None for g in groups]
            busy0 = _machine_busy()
            for j in jobs:
                j.say("go")
            _wait_all(jobs, "epoch", e, time.monotonic() + args.timeout, f"the end of epoch {e}")
            after = [g.read_bytes() if g else None for g in groups]
            cpu1 = [g.cpu_seconds() if g else None for g in groups]
            busy = _machine_busy() - busy0
            ours = sum(c1[0] - c0[0] for c0, c1 in zip(cpu0, cpu1) if c0 is not None)
            for k in range(n_nodes):
                recs = [next(r for r in j.recs if r.get("epoch") == e) for j in jobs[k * rpn:(k + 1) * rpn]]
                st = [r["stats"] for r in recs]
                out["epochs"].append({
                    "config": name, "round": rnd, "node": k, "epoch": e,
                    "images": sum(r["images"] for r in recs), "seconds": max(r["seconds"] for r in recs),
                    "first_batch_s": max(r["first_batch_s"] or 0.0 for r in recs),
                    "cache_bytes": sum(s["bytes_from_cache"] for s in st),
                    "peer_bytes": sum(s["bytes_from_peers"] for s in st),
                    "storage_bytes": sum(s["bytes_from_storage"] for s in st),
                    "peer_samples": sum(s["samples_from_peers"] for s in st),
                    "storage_samples": sum(s["samples_from_storage"] for s in st),
                    "blkio_bytes": (after[k] - before[k]) if groups[k] else "",
                    "cpu_seconds": round(cpu1[k][0] - cpu0[k][0], 3) if cpu0[k] is not None else "",
                    "cpu_kernel_seconds": round(cpu1[k][1] - cpu0[k][1], 3) if cpu0[k] is not None else "",
                    "throttled": int(bool(groups[k]) and e >= 1),
                    # CPU the rest of the machine used meanwhile (other tenants of the 2 cores)
                    "others_cpu_seconds": round(busy - ours, 3) if cpu0[k] is not None else ""})
        _wait_all(jobs, "done", None, time.monotonic() + args.timeout, "the end")
        for j in jobs:
            j.say("exit")
        for j in jobs:
            j.p.wait(timeout=60)
            if j.p.returncode != 0:
                raise RuntimeError(f"rank process {j.p.pid} exit status {j.p.returncode}:\n{j.stderr_tail()}")
        out["peak_mem"] = [g.peak_memory() if g else None for g in groups]
        ok = True
    finally:
        for j in jobs:
            j.close()
        for g in groups:
            if g:
                if not ok and g.oom_kills():
                    print(f"  {g.mem}: {g.oom_kills()} OOM kill(s): raise --mem-slack", flush=True)
                g.kill_all()
                g.remove()
        left = _clear_segments(segments)
        if left and ok:
            print(f"  warning: cache segments left after {name}, removed: {left}", flush=True)
    return out


# ================================================================== summary
def summarize(res: dict, args, dataset_bytes: int) -> dict:
    eps = res["epochs"]
    measured = [e for e in range(args.epochs) if e >= 1] or [0]
    # the storage target counts "after epoch 1": epochs >= 2 when there are any
    later = [e for e in measured if e >= 2] or measured

    def cluster(key, es):
        vals = [r[key] for r in eps if r["epoch"] in es]
        if any(v == "" for v in vals):
            return float("nan")
        return sum(vals) / len(es)

    times = [max(r["seconds"] for r in eps if r["epoch"] == e) for e in measured]
    others = [next(r["others_cpu_seconds"] for r in eps if r["epoch"] == e) for e in measured]
    images = {e: sum(r["images"] for r in eps if r["epoch"] == e) for e in range(args.epochs)}
    return {"config": res["name"], "round": res["round"],
            "epoch_seconds": statistics.median(times),
            "others_cpu_s_per_s": (statistics.mean(o / t for o, t in zip(others, times))
                                   if all(o != "" for o in others) else float("nan")),
            "blkio_frac": cluster("blkio_bytes", later) / dataset_bytes,
            "blkio_frac_ep1": cluster("blkio_bytes", [measured[0]]) / dataset_bytes,
            "storage_frac": cluster("storage_bytes", later) / dataset_bytes,
            "peer_frac": cluster("peer_bytes", later) / dataset_bytes,
            "cache_frac": cluster("cache_bytes", later) / dataset_bytes,
            "blkio_mib_ep0": cluster("blkio_bytes", [0]) / 2**20,
            "cpu_s_per_epoch": cluster("cpu_seconds", measured),
            "cpu_kernel_s_per_epoch": cluster("cpu_kernel_seconds", measured),
            "images_per_epoch": "/".join(str(images[e]) for e in range(args.epochs)),
            "peak_mem_mib": "/".join("-" if m is None else f"{m / 2**20:.0f}" for m in res["peak_mem"])}


def _f(x, fmt):
    return "-" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def report(rows: list[dict], args, dataset_bytes: int, n_images: int) -> list[str]:
    med = [m for _rs, m in _host.medians_by_config(rows)]
    print(f"\n{'config':<8}{'round':>6}{'epoch s':>9}{'blkio/D':>9}{'ep1':>7}{'coordl storage/D':>17}"
          f"{'peers/D':>9}{'cache/D':>9}{'MiB ep0':>9}{'CPU s':>7}{'kernel':>7}{'others':>7}  images per epoch  peak MiB per node")
    for r in rows + [dict(m, round="med") for m in med]:
        print(f"{r['config']:<8}{str(r['round']):>6}{_f(r['epoch_seconds'], '.2f'):>9}"
              f"{_f(r['blkio_frac'], '.3f'):>9}{_f(r['blkio_frac_ep1'], '.3f'):>7}{_f(r['storage_frac'], '.3f'):>17}"
              f"{_f(r['peer_frac'], '.3f'):>9}{_f(r['cache_frac'], '.3f'):>9}{_f(r['blkio_mib_ep0'], '.1f'):>9}{_f(r['cpu_s_per_epoch'], '.1f'):>7}{_f(r['cpu_kernel_s_per_epoch'], '.1f'):>7}{_f(r['others_cpu_s_per_s'], '.2f'):>7}"
              f"  {r['images_per_epoch']:<17} {r['peak_mem_mib']}")
    print("epoch s: the slowest node's epoch, median of epochs >= 1; X/D: cluster bytes per epoch over the "
          "dataset's bytes, epochs >= 2 (ep1: epoch 1, blkio); blkio: read from the block device by the nodes' "
          "cgroups; coordl storage/peers/cache: coordl's stats(); CPU s (kernel): all nodes' processes per epoch >= 1 (cpuacct), of which in the kernel; others: cores the rest of the machine kept busy meanwhile")
    by = {m["config"]: m for m in med}
    lines = []
    bad = [r for r in rows if any(int(x) != n_images for x in r["images_per_epoch"].split("/"))]
    if bad:
        lines.append(f"NOT exactly once: epochs without {n_images} images in {[(r['config'], r['round']) for r in bad]}")
    if "peers" in by:
        x = by["peers"]["blkio_frac"]
        if x != x:
            x, src = by["peers"]["storage_frac"], "coordl stats(); no blkio counters in this mode"
        else:
            src = "blkio"
        lines.append(f"cluster storage per epoch with peers <= 2% of the dataset: {_f(x, '.2%')} ({src}) "
                     f"-> {'met' if x <= 0.02 else 'NOT met'}")
    if "off" in by:
        x = by["off"]["blkio_frac"]
        if x != x:
            x = by["off"]["storage_frac"]
        lines.append(f"without peers (report, ~0.67 expected): {_f(x, '.3f')} of the dataset per epoch")
    if "peers" in by and "local" in by:
        x = by["peers"]["epoch_seconds"] / by["local"]["epoch_seconds"]
        lines.append(f"epoch time peers / all-local <= 1.2: {x:.2f} -> {'met' if x <= 1.2 else 'NOT met'}")
    if "peers" in by and "off" in by:
        x = by["off"]["epoch_seconds"] / by["peers"]["epoch_seconds"]
        lines.append(f"epoch time without peers / with peers >= 2: {x:.2f} -> {'met' if x >= 2 else 'NOT met'}")
    if args.no_cgroups or args.no_netns:
        lines.append("(storage not throttled or links not limited in this mode: the targets do not apply)")
    print("\ntargets:\n  " + "\n  ".join(lines))
    return lines


def plot(epoch_rows: list[dict], args, path: str, dataset_bytes: int) -> None:
    plt = _host.pyplot()
    if plt is None:
        return
    configs = list(dict.fromkeys(r["config"] for r in epoch_rows))
    rnd0 = min(r["round"] for r in epoch_rows)
    fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 4), sharey=True, squeeze=False)
    colors = {"cache": "#4c72b0", "peers": "#55a868", "storage": "#c44e52"}
    for ax, name in zip(axes[0], configs):
        rs = sorted((r for r in epoch_rows if r["config"] == name and r["round"] == rnd0),
                    key=lambda r: (r["epoch"], r["node"]))
        xs, labels = [], []
        for i, r in enumerate(rs):
            x = 1.5 * i + r["epoch"]   # room for the blkio bar, a gap between epochs
            xs.append(x)
            labels.append(f"e{r['epoch']}\nn{r['node']}")
            bottom = 0.0
            for key, col in (("cache_bytes", "cache"), ("peer_bytes", "peers"), ("storage_bytes", "storage")):
                v = r[key] / 2**20
                ax.bar(x, v, bottom=bottom, color=colors[col], label=col if i == 0 else None)
                bottom += v
            if r["blkio_bytes"] != "":   # a thin bar beside: what the node's block device read
                ax.bar(x + 0.5, r["blkio_bytes"] / 2**20, width=0.2, color="black",
                       label="read from its block device (blkio)" if i == 0 else None)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(f"{name} (round {rnd0})")
        ax.set_ylabel("MiB per node per epoch")
        ax.legend(fontsize=7)
    fig.suptitle(f"{args.nodes} nodes, dataset {dataset_bytes / 2**20:.0f} MiB: bytes each node got from its "
                 "cache / peers / storage (coordl stats), and read from its block device", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


# ====================================================================== main
def _v1(controller: str) -> bool:
    with open("/proc/mounts") as f:
        return any(len(p) >= 4 and p[2] == "cgroup" and controller in p[3].split(",")
                   and p[1] == f"/sys/fs/cgroup/{controller}" for p in (l.split() for l in f))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("first-pass", "connections"):     # first pass and connections (_peers_first_pass.py)
        import _peers_first_pass as i19

        return (i19.first_pass if argv[0] == "first-pass" else i19.connections)(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="ImageFolder root (default: generate --images photos)")
    ap.add_argument("--images", type=int, default=1500, help="images to generate when --root is not given")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=4, help="epochs per configuration; epoch 0 fills the caches")
    ap.add_argument("--workers", type=int, default=1, help="loader workers per rank")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--crop", type=int, default=64, help="RandomResizedCrop size (small: cheaper prep)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-fraction", type=float, default=0.36,
                    help="node cache per node, as a fraction of the dataset's bytes (peers, off)")
    ap.add_argument("--read-mbps", type=float, default=3.0, help="storage read throttle per node, MB/s (epochs >= 1)")
    ap.add_argument("--link-mbit", type=float, default=1000, help="each node's link, Mbit/s (tc tbf)")
    ap.add_argument("--mem-slack", default="1GiB", help="memory cap per node = its node cache + this")
    ap.add_argument("--rounds", type=int, default=2, help="repeat all configurations, interleaved")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--timeout", type=float, default=300, help="seconds for any one step of a configuration")
    ap.add_argument("--no-netns", action="store_true", help="nodes as plain processes on loopback")
    ap.add_argument("--no-cgroups", action="store_true", help="no cgroups: no throttle, no blkio counts")
    ap.add_argument("--no-drop-caches", action="store_true")
    ap.add_argument("--out", default=os.path.join("bench_out", "peers"))
    ap.add_argument("--quick", action="store_true", help="tiny smoke run on loopback, no root needed")
    # internal: one rank
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--node", default="", help=argparse.SUPPRESS)
    ap.add_argument("--cache-size", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--peers", default="off", help=argparse.SUPPRESS)
    ap.add_argument("--prefill", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        return job(args)
    if args.quick:
        args.images, args.epochs, args.rounds, args.batch_size, args.workers = 60, 3, 1, 4, 0
        args.no_netns = args.no_cgroups = args.no_drop_caches = True
        args.timeout = min(args.timeout, 120)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"--configs should list names from {','.join(CONFIGS)}, but got {c!r}")
    need_root = not (args.no_netns and args.no_cgroups and args.no_drop_caches)
    if need_root and os.geteuid() != 0:
        raise SystemExit("peers.py needs root for network namespaces, cgroups and drop_caches; run it as root, "
                         "or pass --no-netns --no-cgroups --no-drop-caches (or --quick)")
    if not args.no_cgroups:
        missing = [c for c in ("memory", "blkio") if not _v1(c)]
        if missing:
            raise SystemExit(f"cgroup v1 controller(s) {missing} are not mounted at /sys/fs/cgroup/<controller>; "
                             "pass --no-cgroups to run without throttle and blkio counts")
    from coordl.base.units import parse_size

    mem_slack = parse_size(args.mem_slack, "mem_slack")
    tag = str(os.getpid() % 100000)
    tmp = tempfile.TemporaryDirectory(prefix="coordl-peers-")
    net = None
    interrupted = []

    def on_term(signum, frame):   # SIGTERM: unwind like Ctrl-C, so the finally blocks clean up
        interrupted.append(signum)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        from coordl.synth import make_image_folder
        if args.root is None:
            args.root = os.path.join(tmp.name, "photos")
            kw = {"image_size": (96, 72)} if args.quick else {}
            make_image_folder(args.root, num_images=args.images, num_classes=10, seed=0, **kw)
        args.root = os.path.abspath(args.root)
        import cache as cachebench
        try:
            dev, dev_id = cachebench._dev_of(args.root)
        except (RuntimeError, OSError):
            dev, dev_id = None, None
        if not args.no_cgroups and dev_id is None:
            raise SystemExit(f"no block device holds {args.root} (tmpfs?): blkio cannot throttle or count its "
                             "reads; put the dataset on a disk or pass --no-cgroups")
        files = [os.path.join(d, f) for d, _, fs in os.walk(args.root) for f in fs]
        n_images = len(files)
        dataset_bytes = sum(os.path.getsize(p) for p in files)
        cache_part = int(dataset_bytes * args.cache_fraction)
        ctx = {"tag": tag, "tmp": tmp.name, "node_ids": [f"pb{tag}n{k}" for k in range(args.nodes)],
               "cache_part": cache_part, "cache_local": int(dataset_bytes * 1.1) + (1 << 20),
               "mem_slack": mem_slack, "dev_id": dev_id, "cgroups": not args.no_cgroups,
               "drop": not args.no_drop_caches, "port": 20000 + os.getpid() % 20000, "net": None}
        ctx["segments"] = _segment_names(args.root, ctx["node_ids"])
        if not args.no_netns:
            net = Net(tag, args.nodes, args.link_mbit, subnet=int(tag) % 200 + 20)
            ctx["net"] = net
            try:
                mbit = net.measure() if args.nodes > 1 else float("nan")
                print(f"link check: one TCP stream node 1 -> node 0: {mbit:.0f} Mbit/s", flush=True)
            except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as e:
                print(f"link check failed ({e}): the links' rate is not verified", flush=True)
        print(f"dataset {args.root}: {n_images} files, {dataset_bytes / 2**20:.1f} MiB on /dev/{dev}; "
              f"{args.nodes} nodes x {args.ranks_per_node} rank(s), {args.workers} worker(s) per rank, batch "
              f"{args.batch_size}, crop {args.crop}, {args.epochs} epochs (epoch 0 fills the caches); node cache "
              f"{cache_part / 2**20:.1f} MiB ({args.cache_fraction:.0%} of the dataset; local: "
              f"{ctx['cache_local'] / 2**20:.1f} MiB); "
              + (f"namespaces {net.netns[0]}.., links {net.tbf}; " if net else "loopback, no link limit; ")
              + (f"storage throttled to {args.read_mbps:g} MB/s per node from epoch 1, memory cap node cache "
                 f"+ {mem_slack / 2**20:.0f} MiB; " if ctx["cgroups"] else "no cgroups; ")
              + f"page cache dropped per configuration: {'yes' if ctx['drop'] else 'no'}; {os.cpu_count()} cores",
              flush=True)
        rows, epoch_rows, failed = [], [], []
        for rnd in range(args.rounds):
            for name in configs:
                t0 = time.monotonic()
                try:
                    res = run_config(args, ctx, name, rnd)
                except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:
                    failed.append(f"round {rnd} {name}: {e}")
                    print(f"  round {rnd} {name:<6} FAILED: {e}", flush=True)
                    continue
                row = summarize(res, args, dataset_bytes)
                rows.append(row)
                epoch_rows.extend(res["epochs"])
                per_ep = "  ".join(
                    f"e{e}: {max(r['seconds'] for r in res['epochs'] if r['epoch'] == e):.1f} s "
                    f"{sum(r['storage_bytes'] for r in res['epochs'] if r['epoch'] == e) / 2**20:.0f}/"
                    f"{sum(r['peer_bytes'] for r in res['epochs'] if r['epoch'] == e) / 2**20:.0f} MiB"
                    for e in range(args.epochs))
                print(f"  round {rnd} {name:<6} ({time.monotonic() - t0:.0f} s)  per epoch, slowest node, "
                      f"cluster storage/peer MiB: {per_ep}", flush=True)
                if name == "peers" and rnd == 0:
                    print(f"  peer servers at {', '.join(f'{h}:{p}' for h, p in filter(None, res['servers']))}",
                          flush=True)
        if not rows:
            print("nothing ran")
            return 1
        report(rows, args, dataset_bytes, n_images)
        os.makedirs(args.out, exist_ok=True)
        for path, data in ((os.path.join(args.out, "peers.csv"), epoch_rows),
                           (os.path.join(args.out, "peers_summary.csv"), rows)):
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(data[0]))
                w.writeheader()
                w.writerows(data)
            print(f"wrote {path}")
        plot(epoch_rows, args, os.path.join(args.out, "peers.png"), dataset_bytes)
        if failed:
            print("\nfailed configurations:\n  " + "\n  ".join(failed))
            return 1
    except KeyboardInterrupt:
        print(f"interrupted ({'SIGTERM' if interrupted else 'Ctrl-C'}): cleaning up", file=sys.stderr)
        return 130
    finally:
        if net is not None:
            net.remove()
        tmp.cleanup()
        signal.signal(signal.SIGTERM, old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
