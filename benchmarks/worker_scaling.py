"""Where a worker's CPU goes as workers are added: images/s, CPU per image
split between the main process and the workers, the workers' context
switches per image and their fetch threads, for fetch threads added on
demand (``adaptive``, the loader's behaviour) against a fixed count
started with every pass (``fixed``: the behaviour before on-demand threads).

Each measurement is a fresh process (its own rusage): a persistent-worker
loader over ``--root`` with the throughput benchmark's pipeline
(RandomResizedCrop(224) + flip + ToTensor + Normalize), batch 64, for
``--epochs`` epochs, the first included (the workers' start is the same in
both modes); the workers' CPU and context switches come from
``RUSAGE_CHILDREN`` once they have exited.  Modes and worker counts take
turns within each round; medians over ``--rounds``.

    python -m coordl.synth /tmp/synth --images 2000
    python benchmarks/worker_scaling.py --root /tmp/synth --workers 1,2 --rounds 3
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

FIELDS = ("images_per_s", "main_ms", "workers_ms", "total_ms", "voluntary", "involuntary", "fetch_threads")


def inner(args) -> None:
    import torch  # noqa: F401 - imported before the clock starts, as a training script has it

    import coordl
    from coordl import transforms as T
    from coordl.pipeline import engine, readahead

    if args.mode == "fixed":   # every pass starts all its fetch threads
        class Fixed(readahead.Fetcher):
            def __init__(self, *a, start_threads=None, **kw):
                super().__init__(*a, **kw)
        engine.Fetcher = Fixed
    tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = coordl.ImageFolder(args.root, tf)
    s0, c0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    L = coordl.DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.w,
                          persistent_workers=True, fetch_threads=args.fetch_threads)
    t0 = time.perf_counter()
    n, threads = 0, 0
    for e in range(args.epochs):
        for k, (x, y) in enumerate(L):
            n += len(y)
            if e == args.epochs - 1 and k == min(10, len(L) // 2):   # mid-epoch: threads each worker started
                threads = max(s["fetch_threads"] for s in L._mode.pool.worker_stats())
    wall = time.perf_counter() - t0
    del L, x, y
    import gc
    gc.collect()
    time.sleep(0.3)
    s1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)

    def d(a, b, f):
        return getattr(b, f) - getattr(a, f)
    main = 1e3 * (d(s0, s1, "ru_utime") + d(s0, s1, "ru_stime")) / n
    work = 1e3 * (d(c0, c1, "ru_utime") + d(c0, c1, "ru_stime")) / n
    print("RESULT " + json.dumps({
        "images_per_s": n / wall, "main_ms": main, "workers_ms": work, "total_ms": main + work,
        "voluntary": d(c0, c1, "ru_nvcsw") / n, "involuntary": d(c0, c1, "ru_nivcsw") / n,
        "fetch_threads": threads}), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--modes", default="adaptive,fixed")
    ap.add_argument("--fetch-threads", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON of every run")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="adaptive", help=argparse.SUPPRESS)
    ap.add_argument("--w", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inner:
        inner(args)
        return 0
    workers = [int(w) for w in args.workers.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    runs: dict = {}
    print(f"cpus {os.cpu_count()}, batch {args.batch_size}, {args.epochs} epochs, fetch_threads "
          f"{args.fetch_threads}, {args.rounds} rounds", flush=True)
    for r in range(args.rounds):
        for w in workers:
            for m in (modes if r % 2 == 0 else modes[::-1]):   # which mode runs first alternates
                cmd = [sys.executable, os.path.abspath(__file__), "--inner", "--root", args.root, "--mode", m,
                       "--w", str(w), "--fetch-threads", str(args.fetch_threads),
                       "--batch-size", str(args.batch_size), "--epochs", str(args.epochs)]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
                line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    print(out.stdout + out.stderr, file=sys.stderr)
                    return 1
                res = json.loads(line[7:])
                runs.setdefault(f"{m} {w}", []).append(res)
                print(f"round {r + 1}: {m:<8} {w:>2} workers  {res['images_per_s']:7.1f} images/s  "
                      f"{res['total_ms']:.2f} CPU ms/image  switches/image {res['voluntary']:.2f} vol "
                      f"{res['involuntary']:.2f} invol  fetch threads {res['fetch_threads']}", flush=True)
    print(f"\nmedians of {args.rounds} rounds")
    print(f"{'mode':<9}{'workers':>8}{'images/s':>10}{'main ms':>9}{'workers ms':>11}{'total ms':>10}"
          f"{'vol/img':>9}{'invol/img':>10}{'fetch thr':>10}")
    for key, rs in runs.items():
        m, w = key.split()
        med = {f: statistics.median(r[f] for r in rs) for f in FIELDS}
        print(f"{m:<9}{w:>8}{med['images_per_s']:>10.1f}{med['main_ms']:>9.2f}{med['workers_ms']:>11.2f}"
              f"{med['total_ms']:>10.2f}{med['voluntary']:>9.2f}{med['involuntary']:>10.2f}"
              f"{med['fetch_threads']:>10.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
