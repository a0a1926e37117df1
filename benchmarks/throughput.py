"""Images/s of torch's DataLoader, DALI (CPU), SPDL and coordl on the same JPEG
folder, same pipeline (RandomResizedCrop(224) + flip -> uint8 CHW), same
number of workers/threads, warm page cache, one run side by side.

Also measures each loader's single-core in-process prep rate, so the table
shows efficiency = throughput / (workers x single-core rate), and the peak
memory of coordl's whole loader (main + workers) against its budget.

    python -m coordl.synth bench_data/photos --images 2000
    python benchmarks/throughput.py --root bench_data/photos --epochs 3
    python benchmarks/throughput.py --quick          # tiny smoke run (tests use it)

Writes bench_out/throughput.csv and bench_out/throughput.png.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psutil  # noqa: E402

import _host  # noqa: E402
import common  # noqa: E402


class PeakMemory:
    """Samples USS of this process (above a baseline) plus its children."""

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.me = psutil.Process()
        self.base = self.me.memory_full_info().uss
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        total = max(0, self.me.memory_full_info().uss - self.base)
        for c in self.me.children(recursive=True):
            try:
                total += c.memory_full_info().uss
            except psutil.Error:
                pass
        return total

    def _run(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self._sample())
            except psutil.Error:
                pass
            time.sleep(self.interval)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def run(args) -> list[dict]:
    loaders = [l for l in args.loaders.split(",") if l]
    if "dali" in loaders and not common.dali_available():
        print("DALI is not installed (pip install -e '.[dali]'): skipping it")
        loaders.remove("dali")
    if "spdl" in loaders and not common.spdl_available():
        print("SPDL is not installed, or FFmpeg's shared libraries are missing (pip install spdl; "
              "apt-get install libavcodec59 libavformat59 libavfilter8 libswscale6): skipping it")
        loaders.remove("spdl")
    nbytes = common.warm_page_cache(args.root)
    n_files = sum(len(f) for _, _, f in os.walk(args.root))
    print(f"dataset: {args.root}: {n_files} files, {nbytes / 2**20:.1f} MiB "
          f"(mean {nbytes / max(1, n_files) / 1024:.0f} KiB), page cache warm")
    print(f"workers/threads: {args.workers}, batch size {args.batch_size}, {args.epochs} epochs "
          f"(first epoch excluded as warm-up), median of {args.rounds} interleaved round(s)")
    results = {k: [] for k in loaders}
    singles = {k: [] for k in loaders}
    for _ in range(args.rounds):  # interleaved, so drift hits every loader alike
        for kind in loaders:
            L = common.make_loader(kind, args.root, args.workers, args.batch_size)
            per_epoch = common.time_epochs(L, args.epochs + 1)[1:]
            results[kind].append(sum(n for n, _ in per_epoch) / sum(s for _, s in per_epoch))
            del L
            # the single-core rate right after, so efficiency compares like with like
            singles[kind].append(common.single_core_rate(kind, args.root, args.single_n))
    peak = {}
    for kind in loaders:  # memory in a separate pass: sampling /proc costs CPU
        L = common.make_loader(kind, args.root, args.workers, args.batch_size)
        with PeakMemory() as pm:
            common.time_epochs(L, 1)
        peak[kind] = pm.peak
        if kind == "coordl" and getattr(L, "_pool", None) is not None:
            slots = sum(mm.size() for _, mm in L._pool.maps.values())
            budget = L._read_ahead
            print(f"coordl memory (main above baseline + workers, USS): peak {pm.peak / 2**20:.1f} MiB = "
                  f"read-ahead budget {budget / 2**20:.0f} MiB + batch slots {slots / 2**20:.1f} MiB "
                  f"+ {(pm.peak - budget - slots) / 2**20:.1f} MiB rest (worker interpreters, decode buffers)")
        del L
    rows = []
    for kind in loaders:
        single = statistics.median(singles[kind])
        thr = statistics.median(results[kind])
        rows.append({"loader": kind, "images_per_s": thr, "single_core_images_per_s": single,
                     "efficiency": thr / (args.workers * single), "peak_mem_mib": peak[kind] / 2**20})
    base = {r["loader"]: r["images_per_s"] for r in rows}
    for r in rows:
        r["vs_torch"] = r["images_per_s"] / base["torch"] if "torch" in base else float("nan")
        r["vs_dali"] = r["images_per_s"] / base["dali"] if "dali" in base else float("nan")
        r["vs_spdl"] = r["images_per_s"] / base["spdl"] if "spdl" in base else float("nan")
    return rows


def report(rows: list[dict], args) -> None:
    print(f"\n{'loader':<10}{'images/s':>10}{'1-core/s':>10}{'effic.':>8}{'vs torch':>10}{'vs DALI':>9}"
          f"{'vs SPDL':>9}{'peak MiB':>10}")
    for r in rows:
        print(f"{r['loader']:<10}{r['images_per_s']:>10.1f}{r['single_core_images_per_s']:>10.1f}"
              f"{r['efficiency']:>8.0%}{r['vs_torch']:>10.2f}{r['vs_dali']:>9.2f}{r['vs_spdl']:>9.2f}"
              f"{r['peak_mem_mib']:>10.1f}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "throughput.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"\nwrote {path}")
    plt = _host.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["loader"] for r in rows]
    ax.bar(names, [r["images_per_s"] for r in rows], color=[{"torch": "#888", "dali": "#76b900", "spdl": "#9467bd"}.get(n, "#1f77b4") for n in names])
    ax.bar(names, [args.workers * r["single_core_images_per_s"] for r in rows], fill=False,
           edgecolor="black", linestyle="--", label="workers x single-core rate")
    ax.set_ylabel("images/s")
    ax.set_title(f"RandomResizedCrop(224)+flip, {args.workers} workers, warm cache")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = os.path.join(args.out, "throughput.png")
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="ImageFolder root (default: generate one)")
    ap.add_argument("--images", type=int, default=2000, help="images to generate when --root is not given")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--single-n", type=int, default=400, help="samples for the single-core rate")
    ap.add_argument("--loaders", default=",".join(common.LOADERS))
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    args = ap.parse_args(argv)
    tmp = None
    if args.quick:
        args.images, args.epochs, args.batch_size, args.single_n, args.rounds = 48, 1, 8, 16, 1
    if args.root is None:
        from coordl.synth import make_image_folder
        tmp = tempfile.TemporaryDirectory(prefix="coordl-bench-")
        args.root = os.path.join(tmp.name, "photos")
        kw = {"image_size": (96, 72)} if args.quick else {}
        make_image_folder(args.root, num_images=args.images, num_classes=10, seed=0, **kw)
    try:
        report(run(args), args)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
