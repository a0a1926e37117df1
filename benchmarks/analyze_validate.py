"""Validate ``coordl analyze``'s predictions against measured throughput.

On a throttled disk (cgroup v1 ``blkio.throttle.read_bps_device`` on the
dataset's device) and under a memory cap (``memory.limit_in_bytes``), this
script

1. runs the analyzer (``coordl.analyze.analyze``) once, inside the cgroup,
   measuring storage and cache bandwidth, prep rates at the worker counts
   and (with ``--rate``) a fixed ingestion rate;
2. predicts the throughput of a ``coordl.DataLoader`` whose node cache
   holds a fraction ``x`` of the dataset (``cache_size = x * dataset
   bytes``) with ``w`` workers: ``min(N / T_fetch(x), P(w), G)``;
3. measures it: a fresh loader per ``(x, w)`` in a fresh cgroup, page cache
   dropped first, epoch 0 fills the node cache (MinIO), epochs 1.. are
   timed (steady state, as the analyzer times its passes);
4. prints predicted, measured and the error, and writes JSON.

The page cache does not help the measured runs: with a node cache on,
coordl reads storage through ``raw_uncached`` (pages dropped on the read's
own descriptor), and ``x = 0`` is run with a 1 MiB cache for the same
reason; the device's sectors-read counter per epoch confirms it
("device MiB/epoch" should be about ``(1 - x) * dataset``).  The memory cap
is the cache plus ``--overhead`` for the processes.

    python -m coordl.synth /tmp/anval --images 1200            # ~130 MB
    python benchmarks/analyze_validate.py --root /tmp/anval --read-mbps 20

Needs root and cgroup v1 (memory, blkio); creates and removes its cgroups.
The outer process imports neither torch nor coordl (it stays out of the
measurement).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MiB = 2 ** 20


# ------------------------------------------------------------------- children
def _join(cgroup: str, nice: int = 0) -> None:
    from cache import BLKIO, MEM

    if nice:
        os.nice(nice)  # inherited by the loader's workers
    for root in (MEM, BLKIO):
        with open(os.path.join(root, cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def child_analyze(args) -> None:
    _join(args.cgroup, args.nice)
    from coordl.analyze import analyze

    workers = [int(w) for w in args.workers.split(",")]
    r = analyze(args.root, transform=args.transform, batch_size=args.batch_size, workers=max(workers),
                rate=args.rate, scaling_workers=workers, cache="node", evict="drop_caches",
                repeats=args.analyze_repeats,
                log=lambda m: print(m, file=sys.stderr, flush=True))
    print("REPORT " + json.dumps(r, default=str), flush=True)


def child_run(args) -> None:
    _join(args.cgroup, args.nice)
    from coordl import DataLoader, ImageFolder
    from coordl.analyze.measure import DeviceCounter, RateStep, make_transform, run_pass

    ds = ImageFolder(args.root, transform=make_transform(args.transform))
    L = DataLoader(ds, batch_size=args.batch_size, shuffle=True, seed=0, num_workers=args.w,
                   cache_size=args.cache_size, persistent_workers=args.w > 0)
    dev = DeviceCounter(ds.describe(0))
    step = RateStep(args.rate)
    for e in range(args.epochs):
        r = run_pass(L, step, device=dev)
        r["epoch"] = e
        print("EPOCH " + json.dumps(r), flush=True)


# ------------------------------------------------------------------- parent
def _spawn(args, kind: str, cgroup: str, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--cgroup", cgroup, "--root", args.root,
           "--transform", args.transform, "--batch-size", str(args.batch_size), "--rate", str(args.rate),
           "--workers", args.workers, "--epochs", str(args.epochs),
           "--analyze-repeats", str(args.analyze_repeats), "--nice", str(args.nice)] + extra
    return subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.timeout)


def _lines(out: str, tag: str) -> list[dict]:
    return [json.loads(l[len(tag) + 1:]) for l in out.splitlines() if l.startswith(tag + " ")]


def _model():
    """coordl/analyze/model.py loaded by path: pure arithmetic, and importing
    it this way keeps torch and coordl out of this (outer) process."""
    import importlib.util

    path = os.path.join(os.path.dirname(HERE), "coordl", "analyze", "model.py")
    if not os.path.exists(path):
        import coordl.analyze.model as m  # an installed coordl
        return m
    spec = importlib.util.spec_from_file_location("_coordl_analyze_model", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def predict(report: dict, x: float, w: int) -> dict:
    model = _model()

    n, d = report["dataset"]["samples"], report["dataset"]["bytes"]
    bw, rt = report["bandwidth"], report["rates"]
    prep = {int(k): v for k, v in rt["prep"].items()}
    f = model.fetch_rate(n, d, min(x, 1.0), bw["cache"], bw["storage"])
    p = model.prep_rate_at(w, prep, report["settings"]["cpus"])
    t = model.predict(f, p, rt["ingest"])
    return {"fetch": f, "prep": p, "throughput": t, "bound": "fetch" if t == f else "prep" if t == p else "ingest"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--read-mbps", type=float, default=20, help="disk read throttle, MB/s (default 20)")
    ap.add_argument("--fractions", default="0,0.5,0.9", help="node cache sizes as fractions of the dataset")
    ap.add_argument("--workers", default="1,2", help="worker counts")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=4, help="epochs per measured run (epoch 0 fills the cache)")
    ap.add_argument("--rate", type=float, default=1e6, help="ingestion rate of the simulated step (samples/s)")
    ap.add_argument("--transform", default="rrc224")
    ap.add_argument("--overhead", default="1GiB", help="memory cap above the node cache (default 1GiB)")
    ap.add_argument("--repeats", type=int, default=1, help="whole validations to run (analyzer included)")
    ap.add_argument("--analyze-repeats", type=int, default=3,
                    help="the analyzer's repeats of each in-memory pass, fastest kept (default 3)")
    ap.add_argument("--nice", type=int, default=0,
                    help="nice increment of the measured processes (negative, as root: less disturbed by other "
                         "work on a shared machine; default 0)")
    ap.add_argument("--out", default="analyze_validate.json")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--child", choices=("analyze", "run"), help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", help=argparse.SUPPRESS)
    ap.add_argument("--w", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--cache-size", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "analyze":
        child_analyze(args)
        return 0
    if args.child == "run":
        child_run(args)
        return 0

    from cache import Cgroup, _dev_of, drop_caches

    if os.geteuid() != 0 or not os.path.isdir("/sys/fs/cgroup/blkio"):
        print("analyze_validate.py needs root and cgroup v1 (memory, blkio)", file=sys.stderr)
        return 2
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    ov = args.overhead.lower()
    overhead = int(float(ov[:-3]) * units[ov[-3:]]) if ov[-3:] in units else int(ov)
    dbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.root) for f in fs)
    dev, dev_id = _dev_of(args.root)
    fractions = [float(x) for x in args.fractions.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    bps = int(args.read_mbps * 1e6)
    print(f"dataset {dbytes / MiB:.1f} MiB on /dev/{dev} ({dev_id}); reads throttled to {args.read_mbps:g} MB/s; "
          f"memory cap = node cache + {overhead / MiB:.0f} MiB; ingestion rate {args.rate:g}/s; "
          f"{os.cpu_count()} CPUs (shared: expect noise); nice {args.nice:+d}", flush=True)
    results = []
    for rep in range(args.repeats):
        cg = Cgroup(f"coordl-anval-{os.getpid()}-a{rep}", int(dbytes * 1.1) + overhead, dev_id, bps)
        try:
            drop_caches()
            p = _spawn(args, "analyze", cg.name, [])
        finally:
            cg.remove()
        reports = _lines(p.stdout, "REPORT")
        if p.returncode != 0 or not reports:
            print(f"analyzer failed (exit {p.returncode})", file=sys.stderr)
            return 1
        report = reports[0]
        rt, bw = report["rates"], report["bandwidth"]
        print(f"\nrun {rep + 1}: analyzer: storage {bw['storage'] / 1e6:.1f} MB/s, cache {bw['cache'] / 1e6:.0f} MB/s, "
              f"prep {', '.join(f'{k}w {v:.0f}/s' for k, v in rt['prep'].items())}, cold {rt['cold']:.0f}/s, "
              f"cached {rt['cached']:.0f}/s, fetch stall {report['stalls']['fetch']:.0%}, prep stall "
              f"{report['stalls']['prep']:.0%} ({report['seconds']:.0f} s)", flush=True)
        print(f"{'cache':>6} {'workers':>7} {'predicted':>10} {'bound':>6} {'measured':>9} {'error':>7} "
              f"{'best ep':>8} {'error':>7} {'hit MiB/ep':>10} {'device MiB/ep':>13}", flush=True)
        for w in workers:
            for x in fractions:
                size = max(int(x * dbytes), MiB)
                pred = predict(report, size / dbytes, w)
                cg = Cgroup(f"coordl-anval-{os.getpid()}-r{rep}-{w}-{x}", size + overhead, dev_id, bps)
                try:
                    drop_caches()
                    t0 = time.time()
                    p = _spawn(args, "run", cg.name, ["--w", str(w), "--cache-size", str(size)])
                finally:
                    cg.remove()
                epochs = _lines(p.stdout, "EPOCH")
                if p.returncode != 0 or len(epochs) < 2:
                    print(f"{x:>6.0%} {w:>7}  run failed (exit {p.returncode}; an OOM kill means --overhead is "
                          f"too small)", flush=True)
                    continue
                later = epochs[1:]
                measured = sum(e["rate"] for e in later) / len(later)
                hit = sum(e["bytes_cache"] for e in later) / len(later)
                devb = [e["device_bytes"] for e in later if e["device_bytes"] is not None]
                devb = sum(devb) / len(devb) if devb else float("nan")
                err = pred["throughput"] / measured - 1
                best = max(e["rate"] for e in later)  # the least disturbed epoch
                err_best = pred["throughput"] / best - 1
                row = {"repeat": rep, "cached_fraction": x, "cache_size": size, "workers": w, "predicted": pred,
                       "measured": measured, "epoch_rates": [e["rate"] for e in later], "error": err,
                       "best_epoch": best, "error_best_epoch": err_best,
                       "hit_bytes_per_epoch": hit, "device_bytes_per_epoch": devb, "seconds": time.time() - t0}
                results.append(row)
                print(f"{x:>6.0%} {w:>7} {pred['throughput']:>10.1f} {pred['bound']:>6} {measured:>9.1f} "
                      f"{err:>+7.1%} {best:>8.1f} {err_best:>+7.1%} {hit / MiB:>10.1f} {devb / MiB:>13.1f}", flush=True)
        results.append({"repeat": rep, "analyzer": report})
    rows = [r for r in results if "error" in r]
    if rows:
        worst = max(abs(r["error"]) for r in rows)
        mean = sum(abs(r["error"]) for r in rows) / len(rows)
        print(f"\nprediction error: mean |error| {mean:.1%}, worst {worst:.1%} over {len(rows)} runs "
              f"(target <= 15%)")
        for bound in ("fetch", "prep", "ingest"):
            sel = [r for r in rows if r["predicted"]["bound"] == bound]
            if sel:
                print(f"  {bound}-bound predictions: mean |error| {sum(abs(r['error']) for r in sel) / len(sel):.1%}, "
                      f"worst {max(abs(r['error']) for r in sel):.1%} over {len(sel)}; against each run's best "
                      f"epoch: worst {max(abs(r['error_best_epoch']) for r in sel):.1%}")
    with open(args.out, "w") as f:
        json.dump({"dataset_bytes": dbytes, "read_mbps": args.read_mbps, "overhead": overhead,
                   "results": results}, f, indent=1, default=str)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
