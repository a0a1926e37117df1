"""Where a worker's time goes, per sample: a py-spy profile of coordl's
workers in steady state, split by stage.

The loader runs the throughput benchmark's pipeline (RandomResizedCrop(224) +
flip -> uint8 CHW, 2 workers, batch 64, warm page cache) for a few epochs;
py-spy samples every worker for ``--seconds`` while the process CPU time and
the samples delivered are counted over the same window.

Two views per worker:

* the prep thread (the worker's main thread), every non-idle py-spy sample
  attributed to the outermost coordl stage on its stack: decode, resize,
  copy into the slot, collate/finish, stats, messages, event loop, other;
  in microseconds per sample (count / rate / samples delivered);
* the fetch threads: the samples where they hold the GIL (``--gil``), by
  stage (reading, admission/wake-ups), also per sample: time the prep thread
  cannot run Python.

Needs root (or ptrace permission) and py-spy (``pip install py-spy``).

    python -m coordl.synth bench_data/photos --images 1000
    python benchmarks/profile_worker.py --root bench_data/photos --seconds 10
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psutil  # noqa: E402

import common  # noqa: E402

# (stage, frame-name fragments); the first stage whose fragment appears on
# the stack, outermost call first, takes the sample.
PREP_STAGES = [
    ("decode", ("decode_rgb", "decode_crop", "_decode.py")),
    ("resize", ("_resize_tensor", "interpolate", "pil_resize", "_resample")),
    ("copy into slot", ("Engine._place", "place (coordl/_engine.py")),
    ("collate/finish", ("Engine._finish",)),
    ("stats", ("coordl/stats.py",)),
    ("transform other", ("decode_and_apply", "coordl/transforms.py", "prep_sample")),
    ("fetch release / wake-ups", ("Fetcher.release", "Condition.notify")),
    ("messages", ("send (", "announce", "Connection.", "send_handle", "WorkerSlots")),
    ("event loop", ("_worker_main", "Engine.pump", "Engine.on_fetched", "Queue.get")),
]
FETCH_STAGES = [
    ("read", ("read_bytes", "_read_all", "read_many", "cached", "storage.py")),
    ("admission / wake-ups", ("Fetcher._admit", "Condition.", "Fetcher.release")),
    ("hand-off (queue put)", ("Queue.put",)),
    ("fetch loop other", ("Fetcher._run",)),
]
IDLE_LEAVES = ("Condition.wait", "Queue.get", "select (", "_worker_main.<locals>.watch_control",
               "Event.wait", "sleep (")


def _stage(frames: list[str], table) -> str:
    for name, frags in table:
        for fr in frames:
            if any(f in fr for f in frags):
                return name
    return "other"


def parse(path: str, gil: bool):
    """{thread kind: Counter(stage -> samples)} from a py-spy raw profile
    recorded with ``--threads``."""
    out = {"prep": collections.Counter(), "fetch": collections.Counter(), "other": collections.Counter()}
    with open(path) as f:
        for line in f:
            stack, n = line.rstrip("\n").rsplit(" ", 1)
            frames = stack.split(";")
            thread, frames = frames[0], frames[1:]
            if not gil and frames and any(frames[-1].startswith(leaf) for leaf in IDLE_LEAVES):
                continue  # a blocking wait py-spy did not mark idle
            if "coordl-fetch" in thread:
                out["fetch"][_stage(frames, FETCH_STAGES)] += int(n)
            elif "MainThread" in thread or "_worker_main" in stack:
                out["prep"][_stage(frames, PREP_STAGES)] += int(n)
            else:
                out["other"]["other"] += int(n)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--rate", type=int, default=250)
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)
    if shutil.which("py-spy") is None:
        print("py-spy is needed: pip install py-spy", file=sys.stderr)
        return 2
    common.warm_page_cache(args.root)
    loader = common.make_loader("coordl", args.root, args.workers, args.batch_size)
    delivered = [0]
    stop = threading.Event()

    def consume():
        while not stop.is_set():
            for batch in loader:
                delivered[0] += len(batch[1])
                if stop.is_set():
                    break

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    while delivered[0] < 2 * len(loader.dataset):  # a warm epoch and then some: steady state
        time.sleep(0.2)
    me = psutil.Process()
    workers = [c for c in me.children() if c.cmdline() and "py-spy" not in c.cmdline()[0]]
    tmp = tempfile.mkdtemp(prefix="coordl-prof-")
    rows = {}
    for gil in (False, True):
        cpu0 = {w.pid: sum(w.cpu_times()[:2]) for w in workers}
        n0, t0 = delivered[0], time.perf_counter()
        procs = []
        for w in workers:
            out = os.path.join(tmp, f"{w.pid}-{int(gil)}.txt")
            cmd = ["py-spy", "record", "-p", str(w.pid), "-d", str(int(args.seconds)), "-r", str(args.rate),
                   "-f", "raw", "-o", out, "--nonblocking", "--threads"] + (["--gil"] if gil else [])
            procs.append((w.pid, out, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        for _, _, p in procs:
            p.wait()
        n1, t1 = delivered[0], time.perf_counter()
        cpu1 = {w.pid: sum(w.cpu_times()[:2]) for w in workers}
        per_worker = (n1 - n0) / len(workers)  # samples each worker prepared in the window
        for pid, out, _ in procs:
            prof = parse(out, gil)
            r = rows.setdefault(pid, {"cpu_us": 1e6 * (cpu1[pid] - cpu0[pid]) / per_worker,
                                      "rate": (n1 - n0) / (t1 - t0)})
            r["gil" if gil else "active"] = {k: {s: 1e6 * c / args.rate / per_worker for s, c in v.items()}
                                             for k, v in prof.items()}
    stop.set()
    t.join(timeout=60)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"# profile {args.label}: {args.workers} workers, batch {args.batch_size}, {args.seconds:.0f} s "
          f"per view, py-spy {args.rate} Hz; microseconds per sample per worker")
    for pid, r in rows.items():
        print(f"\nworker pid {pid}: {r['rate']:.0f} samples/s delivered (all workers), "
              f"process CPU {r['cpu_us']:.0f} us/sample")
        prep = r["active"]["prep"]
        print(f"  prep thread (non-idle samples): {sum(prep.values()):.0f} us/sample")
        for s, v in sorted(prep.items(), key=lambda kv: -kv[1]):
            print(f"    {s:<26} {v:7.0f}")
        fetch = r["gil"]["fetch"]
        print(f"  fetch threads holding the GIL: {sum(fetch.values()):.0f} us/sample")
        for s, v in sorted(fetch.items(), key=lambda kv: -kv[1]):
            print(f"    {s:<26} {v:7.0f}")
        g = r["gil"]["prep"]
        print(f"  prep thread holding the GIL: {sum(g.values()):.0f} us/sample "
              f"(Python outside decode/resize: {sum(v for s, v in g.items() if s not in ('decode', 'resize')):.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
