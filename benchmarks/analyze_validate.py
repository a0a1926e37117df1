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

**Side by side (``--interleave K``, default 5).**  On a VM a CPU-bound rate
drifts by up to 30% from one minute to the next, and the analyzer's prep
passes run minutes before the loaders are measured, so a prep-bound
prediction compared that way measures the drift as much as the model.  For
each point the analyzer predicts prep-bound (``--interleave-points all``:
every point), the script instead runs K pairs, each pair two child
processes one after the other, each in a fresh cgroup set up as above:

(a) the analyzer's own prep measurement at ``w`` workers
    (``coordl.analyze.measure_prep``: the code ``analyze()`` measures
    ``P(w)`` with, same repeats, from a filled node cache), and
(b) the loader at ``(x, w)``: epoch 0 fills the node cache, epoch 1 is
    timed (one steady-state epoch).

Pairs alternate their order (a b, b a, a b, ...) so a steady drift does not
favour one side.  The prediction stays the analyzer's model, ``min(fetch(x),
P(w), G)`` with fetch from the analyzer's ``S_bw``/``C_bw``, now with
``P(w)`` = the median of the K (a) runs; "measured" is the median of the K
(b) epochs.  Every pair is printed with its own ratio (the prediction from
that pair's ``P(w)`` over that pair's epoch); the spread of those ratios
says how much the machine moved within a pair.  ``--interleave 0`` is the
earlier mode (section 8's first figures in docs/benchmarks.md).

Each child's line also gives the host's CPU over its run, from
``/proc/stat``: steal (time the hypervisor gave our vCPUs to someone else)
and the CPU used by processes other than ours (busy minus the children's
own ``getrusage`` time); the whole run's totals are printed at the end.

The page cache does not help the measured runs: with a node cache on,
coordl reads storage through ``raw_uncached`` (pages dropped on the read's
own descriptor), and ``x = 0`` is run with a 1 MiB cache for the same
reason; the device's sectors-read counter per epoch confirms it
("device MiB/epoch" should be about ``(1 - x) * dataset``).  The memory cap
is the cache plus ``--overhead`` for the processes.

    python -m coordl.synth /tmp/anval --images 1200            # ~130 MB
    python benchmarks/analyze_validate.py --root /tmp/anval --read-mbps 20 --nice -10
    python benchmarks/analyze_validate.py ... --interleave 0   # the earlier mode, no side-by-side

Needs root and cgroup v1 (memory, blkio); creates and removes its cgroups.
The outer process imports neither torch nor coordl (it stays out of the
measurement).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
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


def child_prep(args) -> None:
    _join(args.cgroup, args.nice)
    from coordl.analyze import measure_prep

    r = measure_prep(args.root, transform=args.transform, batch_size=args.batch_size, workers=[args.w],
                     cache="node", repeats=args.analyze_repeats,
                     log=lambda m: print(m, file=sys.stderr, flush=True))
    print("PREP " + json.dumps(r, default=str), flush=True)


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
class HostCPU:
    """The machine's CPU between two points in time, from ``/proc/stat``'s
    ``cpu`` line (all CPUs) and this process's ``RUSAGE_CHILDREN`` (the CPU
    our measured children and their workers used, once waited for)."""

    def __init__(self):
        self.t = time.monotonic()
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        self.total, self.idle, self.steal = sum(v[:8]), v[3] + v[4], v[7]
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.ours = ru.ru_utime + ru.ru_stime

    def since(self, start: "HostCPU") -> dict:
        """``steal``: share of all CPU time the hypervisor gave away;
        ``busy_cores``: CPUs busy on average (steal excluded);
        ``others_cores``: of those, what was not our children's."""
        tick = os.sysconf("SC_CLK_TCK")
        dt = max(self.t - start.t, 1e-9)
        total = max(self.total - start.total, 1)
        steal = self.steal - start.steal
        busy = (total - (self.idle - start.idle) - steal) / tick
        ours = self.ours - start.ours
        return {"seconds": dt, "steal": steal / total, "busy_cores": busy / dt, "ours_cores": ours / dt,
                "others_cores": max(busy - ours, 0.0) / dt}


def _cpu_text(c: dict) -> str:
    return f"steal {c['steal']:.1%}, others {c['others_cores']:.2f} cores"


def _spawn(args, kind: str, cgroup: str, extra: list[str], epochs: int | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--cgroup", cgroup, "--root", args.root,
           "--transform", args.transform, "--batch-size", str(args.batch_size), "--rate", str(args.rate),
           "--workers", args.workers, "--epochs", str(args.epochs if epochs is None else epochs),
           "--analyze-repeats", str(args.analyze_repeats), "--nice", str(args.nice)] + extra
    c0 = HostCPU()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
    p.cpu = HostCPU().since(c0)
    return p


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


def predict(report: dict, x: float, w: int, prep_at_w: float | None = None) -> dict:
    """The analyzer's model for ``x`` cached and ``w`` workers from its
    report; ``prep_at_w``: a ``P(w)`` measured again (side by side) instead
    of the report's."""
    model = _model()

    n, d = report["dataset"]["samples"], report["dataset"]["bytes"]
    bw, rt = report["bandwidth"], report["rates"]
    prep = {int(k): v for k, v in rt["prep"].items()}
    if prep_at_w is not None:
        prep[w] = prep_at_w
    f = model.fetch_rate(n, d, min(x, 1.0), bw["cache"], bw["storage"])
    p = model.prep_rate_at(w, prep, report["settings"]["cpus"])
    t = model.predict(f, p, rt["ingest"])
    return {"fetch": f, "prep": p, "throughput": t, "bound": "fetch" if t == f else "prep" if t == p else "ingest"}


def _median(vals: list[float]) -> float:
    return statistics.median(vals) if vals else float("nan")


def interleaved(args, report: dict, x: float, frac: float, size: int, w: int, prep_cap: int, overhead: int,
                dev_id: str, bps: int, tag: str) -> dict | None:
    """``args.interleave`` pairs of (a) the analyzer's prep pass at ``w``
    workers and (b) one steady-state epoch of the loader at ``(x, w)``,
    alternating which goes first; the row compares the medians."""
    from cache import Cgroup, drop_caches

    pairs = []
    for k in range(args.interleave):
        order = ("prep", "run") if k % 2 == 0 else ("run", "prep")
        got = {}
        for kind in order:
            cap = prep_cap if kind == "prep" else size + overhead
            cg = Cgroup(f"coordl-anval-{os.getpid()}-{tag}-{w}-{x}-{k}{kind[0]}", cap, dev_id, bps)
            try:
                drop_caches()
                p = _spawn(args, kind, cg.name, ["--w", str(w), "--cache-size", str(size)], epochs=2)
            finally:
                cg.remove()
            if kind == "prep":
                recs = _lines(p.stdout, "PREP")
                if p.returncode != 0 or not recs:
                    print(f"{x:>6.0%} {w:>7}  pair {k + 1}: the prep child failed (exit {p.returncode})", flush=True)
                    return None
                got["prep"] = {"rate": recs[0]["prep"][str(w)], "rates": recs[0]["passes"][f"prep_{w}w"]["rates"],
                               "cpu": p.cpu}
            else:
                epochs = _lines(p.stdout, "EPOCH")
                if p.returncode != 0 or len(epochs) < 2:
                    print(f"{x:>6.0%} {w:>7}  pair {k + 1}: the loader failed (exit {p.returncode}; an OOM kill "
                          f"means --overhead is too small)", flush=True)
                    return None
                got["run"] = {"rate": epochs[1]["rate"], "fill_rate": epochs[0]["rate"],
                              "bytes_cache": epochs[1]["bytes_cache"], "device_bytes": epochs[1]["device_bytes"],
                              "cpu": p.cpu}
        pred = predict(report, frac, w, got["prep"]["rate"])
        ratio = pred["throughput"] / got["run"]["rate"]
        pair = {"pair": k, "order": list(order), "prep_rate": got["prep"]["rate"], "prep_rates": got["prep"]["rates"],
                "predicted": pred["throughput"], "bound": pred["bound"], "measured": got["run"]["rate"],
                "ratio": ratio, "hit_bytes": got["run"]["bytes_cache"], "device_bytes": got["run"]["device_bytes"],
                "cpu_prep": got["prep"]["cpu"], "cpu_run": got["run"]["cpu"]}
        pairs.append(pair)
        print(f"{'':>6} {'':>7}  pair {k + 1} ({order[0]} first): P({w}) {pair['prep_rate']:.1f}/s -> predicted "
              f"{pair['predicted']:.1f} {pair['bound']}, measured {pair['measured']:.1f}, ratio "
              f"{ratio:.3f}; prep: {_cpu_text(pair['cpu_prep'])}; loader: {_cpu_text(pair['cpu_run'])}",
              flush=True)
    p_med = _median([q["prep_rate"] for q in pairs])
    pred = predict(report, frac, w, p_med)
    measured = _median([q["measured"] for q in pairs])
    ratios = sorted(q["ratio"] for q in pairs)
    devb = [q["device_bytes"] for q in pairs if q["device_bytes"] is not None]
    return {"mode": "interleaved", "pairs": pairs, "prep_median": p_med, "predicted": pred,
            "measured": measured, "error": pred["throughput"] / measured - 1,
            "ratio": {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1],
                      "spread": ratios[-1] - ratios[0]},
            "epoch_rates": [q["measured"] for q in pairs],
            "hit_bytes_per_epoch": _median([q["hit_bytes"] for q in pairs]),
            "device_bytes_per_epoch": _median(devb)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--read-mbps", type=float, default=20, help="disk read throttle, MB/s (default 20)")
    ap.add_argument("--fractions", default="0,0.5,0.9", help="node cache sizes as fractions of the dataset")
    ap.add_argument("--workers", default="1,2", help="worker counts")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=4,
                    help="epochs per measured run (epoch 0 fills the cache; a side-by-side pair's loader runs 2)")
    ap.add_argument("--rate", type=float, default=1e6, help="ingestion rate of the simulated step (samples/s)")
    ap.add_argument("--transform", default="rrc224")
    ap.add_argument("--overhead", default="1GiB", help="memory cap above the node cache (default 1GiB)")
    ap.add_argument("--repeats", type=int, default=1, help="whole validations to run (analyzer included)")
    ap.add_argument("--analyze-repeats", type=int, default=3,
                    help="the analyzer's repeats of each in-memory pass, median used (default 3)")
    ap.add_argument("--nice", type=int, default=0,
                    help="nice increment of the measured processes (negative, as root: less disturbed by other "
                         "work on a shared machine; default 0)")
    ap.add_argument("--interleave", type=int, default=5, metavar="K",
                    help="for each prep-bound point, K pairs of (the analyzer's prep pass at w workers, one "
                         "steady-state epoch of the loader), side by side, medians compared (default 5; 0: the "
                         "earlier mode, the analyzer's P(w) from its one run against 3 epochs run minutes later)")
    ap.add_argument("--interleave-points", choices=("prep", "all"), default="prep",
                    help="which points --interleave measures side by side: those the analyzer predicts "
                         "prep-bound (default) or all of them")
    ap.add_argument("--out", default="analyze_validate.json")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--child", choices=("analyze", "prep", "run"), help=argparse.SUPPRESS)
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
    if args.child == "prep":
        child_prep(args)
        return 0
    if args.interleave < 0:
        ap.error(f"--interleave should be a number of pairs >= 0, but got --interleave={args.interleave}")

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
    mode = (f"side by side: {args.interleave} pairs per {'prep-bound ' if args.interleave_points == 'prep' else ''}"
            f"point" if args.interleave else "analyzer first, then the loaders (no side by side)")
    print(f"mode: {mode}", flush=True)
    cpu_start = HostCPU()
    results = []
    for rep in range(args.repeats):
        prep_cap = int(dbytes * 1.1) + overhead  # the analyzer's cgroup: the whole dataset in the node cache
        cg = Cgroup(f"coordl-anval-{os.getpid()}-a{rep}", prep_cap, dev_id, bps)
        try:
            drop_caches()
            p = _spawn(args, "analyze", cg.name, [])
        finally:
            cg.remove()
        reports = _lines(p.stdout, "REPORT")
        if p.returncode != 0 or not reports:
            print(f"analyzer failed (exit {p.returncode})", file=sys.stderr)
            return 1
        report, analyzer_cpu = reports[0], p.cpu
        rt, bw = report["rates"], report["bandwidth"]
        print(f"\nrun {rep + 1}: analyzer: storage {bw['storage'] / 1e6:.1f} MB/s, cache {bw['cache'] / 1e6:.0f} MB/s, "
              f"prep {', '.join(f'{k}w {v:.0f}/s' for k, v in rt['prep'].items())}, cold {rt['cold']:.0f}/s, "
              f"cached {rt['cached']:.0f}/s, fetch stall {report['stalls']['fetch']:.0%}, prep stall "
              f"{report['stalls']['prep']:.0%} ({report['seconds']:.0f} s; {_cpu_text(analyzer_cpu)})", flush=True)
        print(f"{'cache':>6} {'workers':>7} {'predicted':>10} {'bound':>6} {'measured':>9} {'error':>7} "
              f"{'best ep':>8} {'error':>7} {'hit MiB/ep':>10} {'device MiB/ep':>13}", flush=True)
        for w in workers:
            for x in fractions:
                size = max(int(x * dbytes), MiB)
                pred = predict(report, size / dbytes, w)
                if args.interleave and (args.interleave_points == "all" or pred["bound"] == "prep"):
                    t0 = time.time()
                    print(f"{x:>6.0%} {w:>7} {pred['throughput']:>10.1f} {pred['bound']:>6}  (the analyzer's run; "
                          f"now {args.interleave} pairs side by side)", flush=True)
                    row = interleaved(args, report, x, size / dbytes, size, w, prep_cap, overhead, dev_id, bps,
                                      f"r{rep}")
                    if row is None:
                        continue
                    row.update({"repeat": rep, "cached_fraction": x, "cache_size": size, "workers": w,
                                "analyzer_predicted": pred, "seconds": time.time() - t0})
                    results.append(row)
                    r, q = row["ratio"], row["predicted"]
                    print(f"{x:>6.0%} {w:>7} {q['throughput']:>10.1f} {q['bound']:>6} {row['measured']:>9.1f} "
                          f"{row['error']:>+7.1%} {'':>8} {'':>7} {row['hit_bytes_per_epoch'] / MiB:>10.1f} "
                          f"{row['device_bytes_per_epoch'] / MiB:>13.1f}   medians; pair ratios {r['min']:.3f}.."
                          f"{r['max']:.3f} (spread {r['spread']:.3f})", flush=True)
                    continue
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
                row = {"repeat": rep, "mode": "sequential", "cached_fraction": x, "cache_size": size, "workers": w,
                       "predicted": pred, "measured": measured, "epoch_rates": [e["rate"] for e in later],
                       "error": err, "best_epoch": best, "error_best_epoch": err_best,
                       "hit_bytes_per_epoch": hit, "device_bytes_per_epoch": devb, "seconds": time.time() - t0,
                       "cpu": p.cpu}
                results.append(row)
                print(f"{x:>6.0%} {w:>7} {pred['throughput']:>10.1f} {pred['bound']:>6} {measured:>9.1f} "
                      f"{err:>+7.1%} {best:>8.1f} {err_best:>+7.1%} {hit / MiB:>10.1f} {devb / MiB:>13.1f}   "
                      f"{_cpu_text(p.cpu)}", flush=True)
        results.append({"repeat": rep, "analyzer": report, "cpu": analyzer_cpu})
    host = HostCPU().since(cpu_start)
    rows = [r for r in results if "error" in r]
    if rows:
        worst = max(abs(r["error"]) for r in rows)
        mean = sum(abs(r["error"]) for r in rows) / len(rows)
        print(f"\nprediction error: mean |error| {mean:.1%}, worst {worst:.1%} over {len(rows)} runs "
              f"(target <= 15%)")
        for bound in ("fetch", "prep", "ingest"):
            for mode in ("sequential", "interleaved"):
                sel = [r for r in rows if r["predicted"]["bound"] == bound and r["mode"] == mode]
                if not sel:
                    continue
                line = (f"  {bound}-bound, {mode}: mean |error| {sum(abs(r['error']) for r in sel) / len(sel):.1%}, "
                        f"worst {max(abs(r['error']) for r in sel):.1%} over {len(sel)}")
                if mode == "sequential":
                    line += f"; against each run's best epoch: worst {max(abs(r['error_best_epoch']) for r in sel):.1%}"
                else:
                    line += (f" (medians of {args.interleave} pairs); per-pair ratios "
                             f"{min(r['ratio']['min'] for r in sel):.3f}..{max(r['ratio']['max'] for r in sel):.3f}, "
                             f"widest spread within a point {max(r['ratio']['spread'] for r in sel):.3f}")
                print(line)
    print(f"host over the run ({host['seconds']:.0f} s): steal {host['steal']:.1%} of CPU time, "
          f"{host['busy_cores']:.2f} of {os.cpu_count()} CPUs busy on average, "
          f"{host['others_cores']:.2f} of them by processes other than ours")
    with open(args.out, "w") as f:
        json.dump({"dataset_bytes": dbytes, "read_mbps": args.read_mbps, "overhead": overhead,
                   "interleave": args.interleave, "interleave_points": args.interleave_points, "host_cpu": host,
                   "results": results}, f, indent=1, default=str)
    print(f"results: {args.out}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
