"""Fetch-bound training under a memory cap: page cache (torch, DALI) vs coordl's
MinIO node cache, storage bytes counted by the block device itself.

Each loader runs in its own child process inside a memory + blkio cgroup (v1)
that this script creates and removes: ``memory.limit_in_bytes`` caps page
cache + shared memory + process memory alike, and
``blkio.throttle.read_bps_device`` throttles reads from the dataset's disk.
The page cache is dropped (``echo 3 > /proc/sys/vm/drop_caches``) before
each loader.  Storage bytes per epoch are the device's own sectors-read
counter (``/sys/block/<dev>/stat``), not coordl's.  coordl sizes its cache to
what the cap leaves after its own processes.

    python -m coordl.synth /tmp/big --images 9000          # ~1 GB
    python benchmarks/cache.py --root /tmp/big --cap 1GiB --read-mbps 50

Then a memory check: two coordl loaders in two processes on the same dataset
share one cache (one segment, one copy in the cgroup's shmem counter).
Needs root and cgroup v1 (memory, blkio).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MEM = "/sys/fs/cgroup/memory"
BLKIO = "/sys/fs/cgroup/blkio"


def _dev_of(path: str) -> tuple[str, str]:
    """(block device name, 'major:minor') holding ``path``."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    for name in os.listdir("/sys/block"):
        with open(f"/sys/block/{name}/dev") as f:
            if f.read().strip() == f"{major}:{minor}":
                return name, f"{major}:{minor}"
    # a partition: find its disk
    for name in os.listdir("/sys/block"):
        for part in os.listdir(f"/sys/block/{name}"):
            p = f"/sys/block/{name}/{part}/dev"
            if os.path.exists(p) and open(p).read().strip() == f"{major}:{minor}":
                return name, open(f"/sys/block/{name}/dev").read().strip()
    raise RuntimeError(f"no block device for {path}")


def sectors_read(dev: str) -> int:
    with open(f"/sys/block/{dev}/stat") as f:
        return int(f.read().split()[2])


# ------------------------------------------------------------------- child
def child(args) -> None:
    """Runs one loader inside the cgroups; prints JSON lines per epoch."""
    for root in (MEM, BLKIO):
        with open(os.path.join(root, args.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    import psutil

    import common

    dev, _ = _dev_of(args.root)
    extra = {}
    if args.loader == "coordl":
        rss = psutil.Process().memory_info().rss
        per_worker, slots, ahead, margin = 32 << 20, 48 << 20, 16 << 20, 128 << 20
        cache = args.cap - rss - args.workers * per_worker - slots - ahead - margin
        if args.cache_size:
            cache = args.cache_size
        extra = {"cache_size": max(cache, 0), "read_ahead": ahead}
        print(json.dumps({"cache_size": extra["cache_size"], "rss": rss}), flush=True)
    L = common.make_loader(args.loader, args.root, args.workers, args.batch_size, **extra)
    for e in range(args.epochs):
        s0, t0, n = sectors_read(dev), time.perf_counter(), 0
        for images, _ in L:
            n += int(images.shape[0])
        dt = time.perf_counter() - t0
        rec = {"epoch": e, "images": n, "seconds": dt, "storage_bytes": (sectors_read(dev) - s0) * 512}
        if args.loader == "coordl":
            st = L.stats().epochs[-1]
            rec.update(coordl_storage_bytes=st.bytes_from_storage, coordl_cache_bytes=st.bytes_from_cache)
        print(json.dumps(rec), flush=True)
    if args.loader == "coordl" and L._cache is not None:
        # the device floor: the uncached files, in whole file-system blocks
        # (a device reads blocks, so a 110 KB file costs 112 KiB on average)
        from coordl.cache import READY
        idx = L._cache._index
        floor = sum(os.stat(L.dataset.describe(i)).st_blocks * 512
                    for i in range(len(L.dataset)) if idx[i, 2] != READY)
        print(json.dumps({"device_floor": floor}), flush=True)
    if args.hold:
        time.sleep(args.hold)


# ------------------------------------------------------------------- parent
class Cgroup:
    def __init__(self, name: str, cap: int, dev_id: str, read_bps: int):
        self.name = name
        for root in (MEM, BLKIO):
            os.makedirs(os.path.join(root, name), exist_ok=True)
        self._w(MEM, "memory.limit_in_bytes", str(cap))
        self._w(BLKIO, "blkio.throttle.read_bps_device", f"{dev_id} {read_bps}")

    def _w(self, root, key, value):
        with open(os.path.join(root, self.name, key), "w") as f:
            f.write(value)

    def stat(self, key: str) -> int:
        with open(os.path.join(MEM, self.name, "memory.stat")) as f:
            for line in f:
                k, v = line.split()
                if k == key:
                    return int(v)
        return 0

    def remove(self):
        from _host import rmdir_retry

        for root in (MEM, BLKIO):
            rmdir_retry(os.path.join(root, self.name))


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def run_loader(args, loader: str, cg: Cgroup, hold: float = 0):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--loader", loader, "--cgroup", cg.name,
           "--root", args.root, "--cap", str(args.cap), "--workers", str(args.workers),
           "--batch-size", str(args.batch_size), "--epochs", str(args.epochs), "--hold", str(hold),
           "--cache-size", str(args.cache_size)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def parse(out: str):
    recs = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    info = next((r for r in recs if "cache_size" in r), None)
    floor = next((r for r in recs if "device_floor" in r), None)
    if info is not None and floor is not None:
        info.update(floor)
    return [r for r in recs if "epoch" in r], info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--cap", default="1GiB", help="memory cap of each loader's cgroup")
    ap.add_argument("--read-mbps", type=float, default=50, help="disk read throttle, MB/s")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--loaders", default="torch,dali,coordl")
    ap.add_argument("--cache-size", type=int, default=0,
                    help="coordl's cache in bytes (default: the cap minus coordl's own processes)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--loader", help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", help=argparse.SUPPRESS)
    ap.add_argument("--hold", type=float, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from coordl.base.units import parse_size

    args.cap = parse_size(args.cap, "cap") if not str(args.cap).isdigit() else int(args.cap)
    if args.child:
        child(args)
        return 0
    import common

    dev, dev_id = _dev_of(args.root)
    dataset = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.root) for f in fs)
    print(f"dataset {dataset / 2**20:.0f} MiB on /dev/{dev} ({dev_id}); cap {args.cap / 2**20:.0f} MiB per "
          f"loader cgroup; reads throttled to {args.read_mbps:.0f} MB/s; {args.workers} workers, "
          f"{args.epochs} epochs", flush=True)
    loaders = [l for l in args.loaders.split(",") if l]
    if "dali" in loaders and not common.dali_available():
        loaders.remove("dali")
    rows = {}
    for loader in loaders:
        cg = Cgroup(f"coordl-bench-{os.getpid()}-{loader}", args.cap, dev_id, int(args.read_mbps * 1e6))
        try:
            drop_caches()
            p = run_loader(args, loader, cg)
            out, _ = p.communicate()
            epochs, info = parse(out)
            if p.returncode != 0 or not epochs:
                print(f"{loader}: failed (exit {p.returncode}; an OOM kill means the cap is too small)")
                continue
            rows[loader] = (epochs, info)
            for r in epochs:
                extra = ""
                if "coordl_storage_bytes" in r:
                    extra = (f"  (coordl's counters: storage {r['coordl_storage_bytes'] / 2**20:.0f} MiB, "
                             f"cache {r['coordl_cache_bytes'] / 2**20:.0f} MiB)")
                print(f"{loader:<7} epoch {r['epoch']}: {r['images'] / r['seconds']:7.1f} images/s, "
                      f"device read {r['storage_bytes'] / 2**20:7.1f} MiB{extra}", flush=True)
            if info:
                print(f"{loader:<7} cache_size {info['cache_size'] / 2**20:.0f} MiB "
                      f"(cap minus its own processes)")
        finally:
            cg.remove()
    print()
    later = {k: v[0][1:] for k, v in rows.items()}
    rate = {k: sum(r["images"] for r in v) / sum(r["seconds"] for r in v) for k, v in later.items() if v}
    for k, v in later.items():
        if not v:
            continue
        per_epoch = sum(r["storage_bytes"] for r in v) / len(v)
        line = f"{k:<7} epochs 2+: {rate[k]:7.1f} images/s, {per_epoch / 2**20:7.1f} MiB read per epoch"
        if k == "coordl" and rows[k][1]:
            info = rows[k][1]
            floor = dataset - info["cache_size"]
            line += (f" (dataset - cache = {floor / 2**20:.0f} MiB: {per_epoch / max(floor, 1) - 1:+.1%}")
            if "device_floor" in info:
                dev_floor = info["device_floor"]
                line += (f"; the uncached files in whole blocks = {dev_floor / 2**20:.1f} MiB: "
                         f"{per_epoch / max(dev_floor, 1) - 1:+.2%}")
            line += ")"
        print(line)
    if "coordl" in rate:
        for k in rate:
            if k != "coordl":
                print(f"coordl / {k} throughput: {rate['coordl'] / rate[k]:.2f}x")

    # one copy per node: two coordl processes on the same dataset
    if "coordl" in loaders:
        cg = Cgroup(f"coordl-bench-{os.getpid()}-shared", 2 * args.cap, dev_id, int(args.read_mbps * 1e6))
        try:
            drop_caches()
            a = run_loader(args, "coordl", cg, hold=5)
            b = run_loader(args, "coordl", cg, hold=5)
            time.sleep(2)
            peak_shm, segs, seg_bytes = 0, set(), 0
            while a.poll() is None or b.poll() is None:
                peak_shm = max(peak_shm, cg.stat("total_shmem") or cg.stat("shmem"))
                from coordl.cache import PREFIX, user_dir
                try:
                    now = {n for n in os.listdir(user_dir()) if n.startswith(PREFIX)}
                except FileNotFoundError:
                    now = set()
                segs |= now
                for n in now:
                    try:
                        seg_bytes = max(seg_bytes, os.stat(os.path.join(user_dir(), n)).st_blocks * 512)
                    except OSError:
                        pass
                time.sleep(0.2)
            ia = parse(a.stdout.read())[1]
            b.stdout.read()
            cap_a = ia["cache_size"] if ia else 0
            print(f"\ntwo coordl processes, same dataset: {len(segs)} cache segment(s), resident "
                  f"{seg_bytes / 2**20:.0f} MiB (cache_size {cap_a / 2**20:.0f} MiB); all shared memory "
                  f"charged to their cgroup at peak: {peak_shm / 2**20:.0f} MiB = that one cache + both "
                  f"loaders' batch slots")
        finally:
            cg.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
