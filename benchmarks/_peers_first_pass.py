"""The first-pass and connection targets of benchmarks/peers.py (``first-pass`` and ``connections``).

``first-pass``: N "nodes" as plain processes on loopback (gloo,
``COORDL_NODE_ID`` per node), node caches of ``--cache-fraction`` of the
dataset each (default 0.36: ~1/3 each on 3 nodes), ``peers="on"``, after
each of these starts:

* ``resume``: a mid-epoch resume (half of epoch 0 consumed by a loader
  without cache, its ``state_dict()`` loaded into the cached one): fresh
  caches, the first pass covers half the dataset;
* ``partial``: the first epoch broken off after 2 batches;
* ``eval``: a ``shuffle=False`` evaluation pass over the same dataset and
  caches first (its own loader, built on every rank);
* ``adopted``: caches filled by another job's plan (seed 99, peers off,
  still attached: the segments are adopted as they are).

Per epoch, the cluster's samples and bytes from storage (coordl's own
counters: functional, not timing).  Target: <= 2% of the dataset per epoch
from the first epoch after one full pass over the data (``eval`` and
``adopted``: the first training epoch; ``resume`` and ``partial``: the epoch
after the first full one, which is the one that fills the caches; samples
that were never read cannot be in any cache).

``connections``: one node's peer server (this process) against the load of
64 nodes x 8 ranks x 8 workers (``--nodes --ranks --workers``): every other
node's every fetching process keeps one connection, i.e. (nodes-1) x ranks x
workers connections, opened by ``--procs`` client processes, each asking
membership once and ``--requests`` GETs, with ``--idle`` idle
unauthenticated sockets held open meanwhile.  Reports requests served (must
be all), the server's threads, its process's RSS growth and open
descriptors.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


# ------------------------------------------------------------------ first-pass
def _rank(a) -> int:
    os.environ["COORDL_NODE_ID"] = a.node
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    import torch.distributed as dist

    import common
    import coordl

    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    ds = common.coordl_dataset(a.root, 32)
    kw = dict(batch_size=a.batch_size, num_workers=a.workers, cache_size=a.cache_size)
    hold = None
    if a.scenario == "eval":
        V = coordl.DataLoader(ds, shuffle=False, seed=3, peers="on", **kw)
        for _ in V:
            pass
    elif a.scenario == "adopted":
        hold = coordl.DataLoader(ds, shuffle=True, seed=99, peers="off", **kw)
        for _ in hold:
            pass
    L = coordl.DataLoader(ds, shuffle=True, seed=3, peers="on", **kw)
    # the evaluation loader goes only once the training loader holds the node cache: a cache goes
    # with its last holder, and the reaper thread releases a collected loader's hold at a moment of
    # its own, so deleting it first would leave the training loader a warm or an empty cache by chance
    V = None
    if a.scenario == "resume":
        R = coordl.DataLoader(ds, shuffle=True, seed=3, batch_size=a.batch_size, num_workers=0, peers="off")
        it = iter(R)
        for _ in range(len(R) // 2):
            next(it)
        L.load_state_dict(R.state_dict())
        del it, R
    rows = []
    for epoch in range(a.epochs):
        for k, _b in enumerate(L):
            if a.scenario == "partial" and epoch == 0 and k == 1:
                break
        st = L.stats().epochs[-1]
        rows.append({"epoch": st.epoch, "samples": st.samples, "storage": st.samples_from_storage,
                     "peers": st.samples_from_peers, "bytes_peers": st.bytes_from_peers})
        dist.barrier()
    with open(a.out, "w") as f:
        json.dump(rows, f)
    dist.barrier()
    del L, hold
    dist.destroy_process_group()
    return 0


def first_pass(argv) -> int:
    ap = argparse.ArgumentParser(prog="peers.py first-pass")
    ap.add_argument("--root", default=None)
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--cache-fraction", type=float, default=0.36)
    ap.add_argument("--scenarios", default="resume,partial,eval,adopted")
    ap.add_argument("--out", default=os.path.join("bench_out", "peers"))
    ap.add_argument("--timeout", type=float, default=600)
    # internal
    ap.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scenario", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--node", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cache-size", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rank_job:
        return _rank(a)
    tmp = tempfile.TemporaryDirectory(prefix="coordl-peers19-")
    root = a.root
    if root is None:
        root = os.path.join(tmp.name, "ds")
        subprocess.run([sys.executable, "-m", "coordl.synth", root, "--images", str(a.images)], check=True,
                       capture_output=True, timeout=a.timeout)
    from coordl.datasets import ImageFolder

    ds = ImageFolder(root)
    import numpy as np

    total = int(np.asarray(ds.sizes).clip(min=0).sum())
    n = len(ds)
    cache = int(total * a.cache_fraction) if total else 0
    os.makedirs(a.out, exist_ok=True)
    world = a.nodes * a.ranks_per_node
    results = {}
    ok = True
    for sc in [s for s in a.scenarios.split(",") if s]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        outs = [os.path.join(tmp.name, f"{sc}-{r}.json") for r in range(world)]
        env = {**os.environ, "COORDL_PEER_TIMEOUT": "5", "COORDL_SHM_DIR": os.path.join(tmp.name, f"shm-{sc}")}
        os.makedirs(env["COORDL_SHM_DIR"], exist_ok=True)
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "peers.py"), "first-pass", "--rank-job",
                                   "--scenario", sc, "--rank", str(r), "--world", str(world),
                                   "--node", f"n{r // a.ranks_per_node}", "--port", str(port),
                                   "--cache-size", str(cache), "--root", root, "--epochs", str(a.epochs),
                                   "--workers", str(a.workers), "--batch-size", str(a.batch_size),
                                   "--out", outs[r]], env=env, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        for r, p in enumerate(procs):
            try:
                _o, err = p.communicate(timeout=a.timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise SystemExit(f"{sc}: rank {r} did not finish within {a.timeout:g} s")
            if p.returncode != 0:
                raise SystemExit(f"{sc}: rank {r} failed:\n{err[-3000:]}")
        per = []
        for o in outs:
            with open(o) as f:
                per.append(json.load(f))
        epochs = []
        for e in range(a.epochs):
            storage = sum(p[e]["storage"] for p in per)
            epochs.append({"epoch": per[0][e]["epoch"], "samples": sum(p[e]["samples"] for p in per),
                           "storage": storage, "storage_share": storage / n,
                           "peers": sum(p[e]["peers"] for p in per)})
        first = 0 if sc in ("eval", "adopted") else 2
        worst = max(x["storage_share"] for x in epochs[first:]) if epochs[first:] else float("nan")
        floor = max(0.0, 1.0 - a.nodes * cache / total) if total else 0.0     # max(0, D - N*C) / D
        met = worst <= floor + 0.02
        ok &= met
        results[sc] = {"epochs": epochs, "target_from_epoch_index": first, "worst_storage_share": worst,
                       "floor": floor, "met": met}
        print(f"{sc:8s} " + "  ".join(f"e{x['epoch']}: {x['storage']}/{n} from storage ({x['storage_share']:.1%}), "
                                       f"{x['peers']} from peers" for x in epochs)
              + f"  -> worst from epoch index {first}: {worst:.1%} ({'met' if met else 'MISSED'}: "
                f"floor {floor:.1%} + 2%)")
    with open(os.path.join(a.out, "peers_first_pass.json"), "w") as f:
        json.dump({"nodes": a.nodes, "ranks_per_node": a.ranks_per_node, "images": n, "dataset_bytes": total,
                   "cache_bytes_per_node": cache, "results": results}, f, indent=1)
    tmp.cleanup()
    return 0 if ok else 1


# ------------------------------------------------------------------ connections
def _client(a, addr, secret: bytes, cid: bytes, k: int, q) -> None:
    from coordl.peers import protocol as P

    socks, served, errors = [], 0, []
    try:
        for _ in range(k):
            s = socket.create_connection(addr, timeout=60)
            P.client_handshake(s, secret, cid, 60)
            socks.append(s)
        for s in socks:      # membership once, then GETs, pipelined per connection
            P.send_frame(s, P.HAVEQ, P.pack_haveq(1, a.samples))
            for j in range(a.requests):
                P.send_frame(s, P.GET, P.pack_get(2 + j, [(j * 7) % a.samples]))
        for s in socks:
            _, p = P.recv_frame(s, (P.HAVE,), 60, 60)
            for j in range(a.requests):
                _, p = P.recv_frame(s, (P.ITEM,), 60, 60)
                rid, i, st, data = P.unpack_item(p)
                served += st == P.HERE and rid == 2 + j and len(data) == a.sample_bytes
    except Exception as e:     # counted, reported
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        q.put((served, errors))
        for s in socks:
            s.close()


def connections(argv) -> int:
    ap = argparse.ArgumentParser(prog="peers.py connections")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--procs", type=int, default=16, help="client processes simulating them")
    ap.add_argument("--requests", type=int, default=4, help="GETs per connection")
    ap.add_argument("--idle", type=int, default=300, help="idle unauthenticated sockets held meanwhile")
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--sample-bytes", type=int, default=4096)
    ap.add_argument("--out", default=os.path.join("bench_out", "peers"))
    a = ap.parse_args(argv)
    import multiprocessing as mp
    import resource
    import threading
    import uuid

    import psutil

    from coordl.cache import NodeCache
    from coordl.peers import PeerServer
    from coordl.peers import protocol as P

    conns = (a.nodes - 1) * a.ranks * a.workers
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = conns + a.idle + 512
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SystemExit(f"this needs {need} descriptors, the hard limit is {hard}: raise it (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    secret = os.urandom(32)
    cache = NodeCache.attach("peers-conn-" + uuid.uuid4().hex, a.samples, a.samples * a.sample_bytes + 4096)
    for i in range(a.samples):
        cache.put(i, bytes([i % 251]) * a.sample_bytes)
    me = psutil.Process()
    rss0 = me.memory_info().rss
    srv = PeerServer(cache, secret, "127.0.0.1")
    threads0 = threading.active_count()
    addr = tuple(srv.address)
    idle = [socket.create_connection(addr, timeout=10) for _ in range(a.idle)]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    per = [conns // a.procs + (1 if p < conns % a.procs else 0) for p in range(a.procs)]
    t0 = time.monotonic()
    procs = [ctx.Process(target=_client, args=(a, addr, secret, P.cache_id(cache.name), k, q)) for k in per]
    for p in procs:
        p.start()
    peak_conns = peak_threads = peak_rss = 0
    results = []
    while len(results) < len(procs):
        try:
            results.append(q.get(timeout=0.2))
        except Exception:
            pass
        peak_conns = max(peak_conns, srv.connections)
        peak_threads = max(peak_threads, threading.active_count())
        peak_rss = max(peak_rss, me.memory_info().rss)
    took = time.monotonic() - t0
    for p in procs:
        p.join(30)
    served = sum(r[0] for r in results)
    errors = [e for r in results for e in r[1]]
    out = {"connections": conns, "requests": conns * a.requests, "served": served, "errors": errors[:5],
           "server_threads": srv.threads, "process_threads_peak_added": peak_threads - threads0 + srv.threads,
           "peak_connections": peak_conns, "idle_unauthenticated": a.idle, "evicted_unauthenticated": srv.evicted,
           "refused": srv.refused, "rss_growth_mib": round((peak_rss - rss0) / 2**20, 1),
           "open_fds_peak_est": peak_conns + a.idle, "seconds": round(took, 1)}
    for s in idle:
        s.close()
    srv.close()
    cache.close()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "peers_connections.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    return 0 if served == conns * a.requests and not errors else 1
