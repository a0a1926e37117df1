"""Validate ``coordl analyze``'s predictions against independent training loops.

For each kind of step (``--steps``: ``sleep``, an accelerator-like step that
sleeps ``batch / --sleep-rate`` seconds and uses no CPU, and ``cpu``, one
SGD step of a small CNN on the CPU, ``benchmarks/_anval_steps.py``), on a
throttled disk (cgroup v1 ``blkio.throttle.read_bps_device`` on the
dataset's device) and under a memory cap (``memory.limit_in_bytes``):

1. **The analyzer** (``coordl.analyze.analyze``) runs once, in its own
   child cgroup, page cache dropped first, at ``--analyze-workers`` workers
   with prep measured at ``--scaling-workers``.  Its report is kept whole;
   every prediction below is ``coordl.analyze.predict(report, x, w)`` (the
   report's own model: value and interval), computed once, before any
   point is measured.
2. **Independent training loops** (this file's :func:`train`: a plain loop
   over ``coordl.DataLoader``, its own clock, none of the analyzer's pass
   code) at points the analyzer did not measure, each ``--runs`` times, each
   run a fresh process in a fresh cgroup:

   * page cache **dropped** (``echo 3 > /proc/sys/vm/drop_caches``) and a
     node cache of ``x * dataset`` bytes for each ``x`` in ``--fractions``
     under a memory cap of ``x * dataset + --overhead``: epoch 0 fills the
     node cache (MinIO), epochs 1.. read the rest from the throttled disk;
   * page cache **warm** (every file read just before, no node cache): the
     whole dataset in memory, the model's ``x = 1``;

   the warm points at every worker count in ``--workers`` (defaults 1 and
   4; the analyzer runs its loader + step passes at 2, so no point's loader
   + step was measured by it, and 4 workers is beyond every prep count it
   measured).  The dropped points (the slow ones: each run reads the
   dataset through the throttled disk three times) pair each fraction with
   one worker count, rotated between the steps (``--grid paired``, the
   default: with 0.2,0.5 and 1,4 the sleep step gets 20%/1 and 50%/4, the
   CPU step 20%/4 and 50%/1, so each step still has both fractions and
   both counts, and together they cover all four); ``--grid full`` measures
   every pair for every step.  A run's rate is the median of its epochs
   1..; a point's rate is the median of its runs.
3. For each point: predicted [interval], measured, error, and whether the
   interval holds the measurement; the summary counts points within 15%
   and inside their interval.  The interval is the report's: its inputs'
   spread widened by its model error (``model_error``: the larger of 10%
   and the model's error on the analyzer's own cold and cached passes);
   the count inside the inputs-only interval is printed beside it.

Each run's line also gives the host's CPU over it, from ``/proc/stat``:
steal and the CPU used by processes other than ours (a busy machine makes
the figures meaningless; run on a quiet one).

    python -m coordl.synth /tmp/anval --images 1200            # ~130 MB
    python benchmarks/analyze_validate.py --root /tmp/anval --read-mbps 20 --nice -10 --out anval22b.json

About 11 minutes on a 2-core VM (two analyzer runs of ~1 minute, 8 points
x 3 runs of 15-35 s).

Needs root and cgroup v1 (memory, blkio); creates and removes its cgroups.
The outer process imports neither torch nor coordl.
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
STEPS_FILE = os.path.join(HERE, "_anval_steps.py")


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

    kw = {"rate": args.sleep_rate} if args.step == "sleep" else {"step": f"{STEPS_FILE}:cpu_step"}
    r = analyze(args.root, transform=args.transform, batch_size=args.batch_size, workers=args.analyze_workers,
                scaling_workers=[int(w) for w in args.scaling_workers.split(",")], cache="node",
                evict="drop_caches", repeats=args.analyze_repeats, max_samples=args.max_samples,
                log=lambda m: print(m, file=sys.stderr, flush=True), **kw)
    print("REPORT " + json.dumps(r, default=str), flush=True)


def train(root, transform, batch_size, workers, cache_size, step, epochs, max_samples=None):
    """The independent measurement: a plain training loop over a
    ``coordl.DataLoader``, timed with its own clock.  Yields, per epoch,
    ``(samples, seconds, steady_rate)``: the whole epoch, and the rate after
    the first ``max(1, workers)`` batches (the steady state, as a trainer's
    throughput meter that ignores the epoch's ramp would show)."""
    from coordl import DataLoader, ImageFolder
    from coordl.analyze.measure import Subset, make_transform

    ds = ImageFolder(root, transform=make_transform(transform))
    if max_samples and max_samples < len(ds):
        ds = Subset(ds, max_samples)
    loader = DataLoader(ds, batch_size=batch_size, shuffle=True, seed=0, num_workers=workers,
                        cache_size=cache_size or None, persistent_workers=workers > 0)
    skip = max(1, workers)
    for _ in range(epochs):
        t0 = time.perf_counter()
        n = k = n_after = 0
        t_skip = None
        for images, labels in loader:
            step((images, labels))
            n += len(labels)
            k += 1
            if k == skip:
                t_skip = time.perf_counter()
            elif k > skip:
                n_after += len(labels)
        t1 = time.perf_counter()
        yield n, t1 - t0, (n_after / (t1 - t_skip) if t_skip and t1 > t_skip and n_after else n / (t1 - t0))


def child_run(args) -> None:
    _join(args.cgroup, args.nice)
    sys.path.insert(0, HERE)
    import _anval_steps

    step = _anval_steps.SleepStep(args.sleep_rate) if args.step == "sleep" else _anval_steps.cpu_step
    for e, (n, dt, steady) in enumerate(train(args.root, args.transform, args.batch_size, args.w,
                                              args.cache_size, step, args.epochs, args.max_samples)):
        print("EPOCH " + json.dumps({"epoch": e, "samples": n, "seconds": dt, "rate": n / dt,
                                     "steady_rate": steady}), flush=True)


# ------------------------------------------------------------------- parent
class HostCPU:
    """The machine's CPU between two points in time, from ``/proc/stat``'s
    ``cpu`` line and this process's ``RUSAGE_CHILDREN``."""

    def __init__(self):
        self.t = time.monotonic()
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        self.total, self.idle, self.steal = sum(v[:8]), v[3] + v[4], v[7]
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.ours = ru.ru_utime + ru.ru_stime

    def since(self, start: "HostCPU") -> dict:
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


def _model():
    """coordl/analyze/model.py loaded by path (pure arithmetic: keeps torch
    and coordl out of this process)."""
    import importlib.util

    path = os.path.join(os.path.dirname(HERE), "coordl", "analyze", "model.py")
    if not os.path.exists(path):
        import coordl.analyze.model as m
        return m
    spec = importlib.util.spec_from_file_location("_coordl_analyze_model", path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = m  # dataclasses look the module up
    spec.loader.exec_module(m)
    return m


def _spawn(args, kind: str, cgroup: str, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--cgroup", cgroup, "--root", args.root,
           "--transform", args.transform, "--batch-size", str(args.batch_size), "--sleep-rate", str(args.sleep_rate),
           "--epochs", str(args.epochs), "--analyze-repeats", str(args.analyze_repeats), "--nice", str(args.nice),
           "--analyze-workers", str(args.analyze_workers), "--scaling-workers", args.scaling_workers,
           "--step", args.step] + (["--max-samples", str(args.max_samples)] if args.max_samples else []) + extra
    c0 = HostCPU()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
    p.cpu = HostCPU().since(c0)
    return p


def _lines(out: str, tag: str) -> list[dict]:
    return [json.loads(l[len(tag) + 1:]) for l in out.splitlines() if l.startswith(tag + " ")]


def _warm(root: str) -> None:
    """Read every file of the dataset (into the page cache)."""
    for d, _, fs in os.walk(root):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(1 << 20):
                    pass


def measure_point(args, page: str, x: float, w: int, dbytes: int, overhead: int, dev_id: str, bps: int,
                  tag: str) -> dict | None:
    """``args.runs`` independent runs of :func:`train` at one point."""
    from cache import Cgroup, drop_caches

    size = int(x * dbytes) if page == "dropped" else 0
    cap = (size if page == "dropped" else int(dbytes * 1.1)) + overhead
    runs = []
    for k in range(args.runs):
        cg = Cgroup(f"coordl-anval-{os.getpid()}-{tag}-{k}", cap, dev_id, bps)
        try:
            drop_caches()
            if page == "warm":
                _warm(args.root)
            p = _spawn(args, "run", cg.name, ["--w", str(w), "--cache-size", str(size)])
        finally:
            cg.remove()
        eps = _lines(p.stdout, "EPOCH")
        if p.returncode != 0 or len(eps) < 2:
            print(f"  {page} x={x:.0%} w={w} run {k + 1}: failed (exit {p.returncode}; an OOM kill means "
                  f"--overhead is too small)", flush=True)
            return None
        later = eps[1:]
        runs.append({"steady": statistics.median(e["steady_rate"] for e in later),
                     "epoch": statistics.median(e["rate"] for e in later),
                     "epochs": later, "fill": eps[0]["rate"], "cpu": p.cpu})
        print(f"  {page:>7} {x:>5.0%} {w:>3}w  run {k + 1}: {runs[-1]['steady']:.1f}/s steady, "
              f"{runs[-1]['epoch']:.1f}/s whole epochs ({_cpu_text(p.cpu)})", flush=True)
    return {"measured": statistics.median(r["steady"] for r in runs),
            "measured_epoch": statistics.median(r["epoch"] for r in runs), "runs": runs}


def _points(pages: list, fractions: list, workers: list, j: int, grid: str) -> list:
    """The (page cache, cached fraction, workers) points of the ``j``-th
    step: warm at every worker count; dropped at every (fraction, workers)
    pair (``grid="full"``) or at ``max(len)`` pairs, fraction ``i`` with
    worker count ``i + j`` (``"paired"``)."""
    out = []
    for pg in pages:
        if pg == "warm":
            out += [(pg, 1.0, w) for w in workers]
        elif grid == "full":
            out += [(pg, x, w) for w in workers for x in fractions]
        else:
            n = max(len(fractions), len(workers))
            out += sorted({(pg, fractions[i % len(fractions)], workers[(i + j) % len(workers)]) for i in range(n)},
                          key=lambda t: (t[2], t[1]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--read-mbps", type=float, default=20, help="disk read throttle, MB/s (default 20)")
    ap.add_argument("--fractions", default="0.2,0.5", help="node cache sizes (fractions of the dataset) measured "
                                                           "with the page cache dropped (default 0.2,0.5)")
    ap.add_argument("--workers", default="1,4", help="worker counts of the independent loops (default 1,4)")
    ap.add_argument("--grid", choices=("paired", "full"), default="paired",
                    help="dropped-page-cache points: each fraction with one worker count, rotated between the steps "
                         "(paired, default), or every fraction at every worker count (full)")
    ap.add_argument("--pages", default="dropped,warm", help="page cache states: dropped, warm (default both)")
    ap.add_argument("--steps", default="sleep,cpu", help="kinds of step: sleep (accelerator-like), cpu")
    ap.add_argument("--sleep-rate", type=float, default=1200,
                    help="samples/s of the sleep step (default 1200: on a 2-core VM that decodes ~950/s a core it "
                         "binds where the data is in memory and the workers are many, and not at 1 worker)")
    ap.add_argument("--analyze-workers", type=int, default=2, help="the analyzer's --workers (default 2)")
    ap.add_argument("--scaling-workers", default="1,2,3", help="the analyzer's prep worker counts (default 1,2,3)")
    ap.add_argument("--analyze-repeats", type=int, default=3, help="the analyzer's --repeats (default 3)")
    ap.add_argument("--runs", type=int, default=3, help="independent runs per point; the median is compared")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per run (epoch 0 fills; default 3)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--transform", default="rrc224")
    ap.add_argument("--max-samples", type=int, default=None, help="use this many samples (default: all)")
    ap.add_argument("--overhead", default="1GiB", help="memory cap above the node cache (default 1GiB)")
    ap.add_argument("--nice", type=int, default=0, help="niceness of the measured processes (e.g. -10)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per child process")
    ap.add_argument("--target", type=float, default=0.15, help="the error target (default 0.15)")
    ap.add_argument("--out", default="analyze_validate.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--w", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--cache-size", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--step", default="sleep", help=argparse.SUPPRESS)
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
    steps = [s for s in args.steps.split(",") if s]
    pages = [s for s in args.pages.split(",") if s]
    if not set(steps) <= {"sleep", "cpu"} or not steps:
        ap.error(f"--steps should be a list of sleep, cpu, but got --steps={args.steps!r}")
    if not set(pages) <= {"dropped", "warm"} or not pages:
        ap.error(f"--pages should be a list of dropped, warm, but got --pages={args.pages!r}")
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    ov = args.overhead.lower()
    overhead = int(float(ov[:-3]) * units[ov[-3:]]) if ov[-3:] in units else int(ov)
    dbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.root) for f in fs)
    dev, dev_id = _dev_of(args.root)
    fractions = [float(x) for x in args.fractions.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    bps = int(args.read_mbps * 1e6)
    model = _model()
    print(f"dataset {dbytes / MiB:.1f} MiB on /dev/{dev} ({dev_id}); reads throttled to {args.read_mbps:g} MB/s; "
          f"memory cap = node cache + {overhead / MiB:.0f} MiB; {os.cpu_count()} CPUs; steps {', '.join(steps)}; "
          f"{args.runs} runs per point", flush=True)
    t_start, cpu_start = time.time(), HostCPU()
    results, analyzers = [], {}
    for step in steps:
        args.step = step
        cg = Cgroup(f"coordl-anval-{os.getpid()}-a-{step}", int(dbytes * 1.1) + overhead, dev_id, bps)
        try:
            drop_caches()
            p = _spawn(args, "analyze", cg.name, [])
        finally:
            cg.remove()
        reports = _lines(p.stdout, "REPORT")
        if p.returncode != 0 or not reports:
            print(f"the analyzer failed (exit {p.returncode})", file=sys.stderr)
            return 1
        report = reports[0]
        analyzers[step] = {"report": report, "cpu": p.cpu}
        inp = model.inputs_from_dict(report["model"]["inputs"])
        v = report["verdict"]
        print(f"\n{step} step: the analyzer ({report['seconds']:.0f} s; {_cpu_text(p.cpu)}): a "
              f"{report['settings']['step_kind']} step, storage {report['bandwidth']['storage'] / 1e6:.1f} MB/s, "
              f"prep {', '.join(f'{k}w {r:.0f}/s' for k, r in report['rates']['prep'].items())}, step alone "
              f"{report['rates']['ingest']:.0f}/s, Amdahl s {inp.amdahl_s.value:.2f} "
              f"[{inp.amdahl_s.lo:.2f}, {inp.amdahl_s.hi:.2f}], eta {inp.eta.value:.2f}, model error "
              f"{inp.model_error.value:.1%} (its own cold/cached passes: "
              f"{', '.join(f'{k} {v:+.1%}' for k, v in report['check'].get('held_out_errors', {}).items())}); verdict: "
              f"{v['largest'] or 'not waiting for data'}", flush=True)
        points = _points(pages, fractions, workers, steps.index(step), args.grid)
        preds = {pt: model.predict(inp, pt[1], pt[2]) for pt in points}  # all predicted before any is measured
        for pg, x, w in points:
            pred = preds[(pg, x, w)]
            got = measure_point(args, pg, x, w, dbytes, overhead, dev_id, bps, f"{step[0]}{pg[0]}{w}-{x}")
            if got is None:
                continue
            m = got["measured"]
            err = pred["throughput"] / m - 1
            row = {"step": step, "page_cache": pg, "cached_fraction": x, "workers": w, "predicted": pred["throughput"],
                   "lo": pred["lo"], "hi": pred["hi"], "bound": pred["bound"], "measured": m,
                   "measured_whole_epochs": got["measured_epoch"], "error": err,
                   "error_whole_epochs": pred["throughput"] / got["measured_epoch"] - 1,
                   "in_interval": pred["lo"] <= m <= pred["hi"], "lo_inputs": pred.get("lo_inputs", pred["lo"]),
                   "hi_inputs": pred.get("hi_inputs", pred["hi"]), "model_error": pred.get("model_error", 0.0),
                   "runs": got["runs"]}
            row["in_inputs_interval"] = row["lo_inputs"] <= m <= row["hi_inputs"]
            results.append(row)
            print(f"{step:>5} {pg:>7} {x:>5.0%} {w:>3}w  predicted {pred['throughput']:8.1f} "
                  f"[{pred['lo']:.1f}, {pred['hi']:.1f}] {pred['bound']:<7} measured {m:8.1f}  error {err:+6.1%}  "
                  f"{'inside' if row['in_interval'] else 'OUTSIDE'} the interval", flush=True)
    host = HostCPU().since(cpu_start)
    if results:
        within = [r for r in results if abs(r["error"]) <= args.target]
        inside = [r for r in results if r["in_interval"]]
        print(f"\n{'step':>5} {'page':>7} {'cache':>5} {'w':>3} {'predicted [interval]':>28} {'bound':<7} "
              f"{'measured':>9} {'error':>7} {'whole-epoch error':>17}")
        for r in results:
            print(f"{r['step']:>5} {r['page_cache']:>7} {r['cached_fraction']:>5.0%} {r['workers']:>3} "
                  f"{r['predicted']:>10.1f} [{r['lo']:>7.1f}, {r['hi']:>7.1f}] {r['bound']:<7} {r['measured']:>9.1f} "
                  f"{r['error']:>+7.1%} {r['error_whole_epochs']:>+17.1%}")
        print(f"\nwithin {args.target:.0%}: {len(within)} of {len(results)} points (worst |error| "
              f"{max(abs(r['error']) for r in results):.1%}); measurement inside the reported interval: "
              f"{len(inside)} of {len(results)} (inside the inputs-only interval, without the model error: "
              f"{sum(r['in_inputs_interval'] for r in results)})")
        for step in steps:
            sel = [r for r in results if r["step"] == step]
            if sel:
                print(f"  {step} step: worst |error| {max(abs(r['error']) for r in sel):.1%} over {len(sel)} points, "
                      f"{sum(r['in_interval'] for r in sel)} inside their interval; bounds "
                      f"{', '.join(sorted({r['bound'] for r in sel}))}")
    print(f"host over the run ({host['seconds']:.0f} s): steal {host['steal']:.1%}, {host['busy_cores']:.2f} of "
          f"{os.cpu_count()} CPUs busy on average, {host['others_cores']:.2f} of them by other processes")
    with open(args.out, "w") as f:
        json.dump({"dataset_bytes": dbytes, "read_mbps": args.read_mbps, "overhead": overhead, "host_cpu": host,
                   "seconds": time.time() - t_start, "args": vars(args), "analyzers": analyzers,
                   "results": results}, f, indent=1, default=str)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
