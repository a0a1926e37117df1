"""A small HTTP server: the same pipeline over local files and over
``python -m http.server`` (single process, a listen queue of 5), with the
loader's default settings, on both URL read paths (obstore and fsspec).

A fixed 64 requests in flight per worker would overflow that server's
queue; coordl adapts the requests in flight per host (coordl/_remote.py).  This
reports, per read path, images/s over HTTP with the defaults and with
``fetch_threads=8`` (the setting that ran as fast as local files), each as
a ratio of local files' images/s in the same run, and any run that failed.

Each configuration runs in its own process (obstore's runtime does not
survive fork, so one process's reads must not decide how the next one's
workers read).  ``--epochs``: whole passes per configuration; the first
includes the limiter's ramp-up, so images/s are given for all epochs and
for all but the first.

    python -m coordl.synth bench_data/photos --images 2000
    python benchmarks/small_server.py --root bench_data/photos --workers 2 --epochs 3 --rounds 3

Without ``--root`` it makes a dataset of ``--images`` in a temporary folder.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _one(args) -> None:
    """One configuration, in this process: prints one JSON line."""
    import common

    import coordl

    extra = {}
    if args.fetch_threads:
        extra["fetch_threads"] = args.fetch_threads
    out = {"images": 0, "epochs": []}
    try:
        ds = common.coordl_dataset(args.source, size=args.size)
        loader = coordl.DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                                   persistent_workers=args.workers > 0, seed=0, **extra)
        for n, s in common.time_epochs(loader, args.epochs):
            out["epochs"].append([n, s])
        out["native"] = bool(getattr(getattr(ds, "_store", None), "native", False))
    except Exception as e:  # the benchmark reports failures, it does not stop at them
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    print("RESULT " + json.dumps(out), flush=True)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _serve(directory: str):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", directory], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("python -m http.server did not start")
            time.sleep(0.05)


def _run(args, source: str, fetch_threads: int, native: bool) -> dict:
    env = dict(os.environ)
    env["COORDL_NATIVE_STORE"] = "1" if native else "0"
    cmd = [sys.executable, os.path.abspath(__file__), "--one", "--source", source, "--workers", str(args.workers),
           "--batch-size", str(args.batch_size), "--epochs", str(args.epochs), "--size", str(args.size),
           "--fetch-threads", str(fetch_threads)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"epochs": [], "error": f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:] or ''}"}


def _rates(res: dict) -> tuple[float, float]:
    ep = res.get("epochs") or []
    if not ep or "error" in res:
        return float("nan"), float("nan")
    total = sum(n for n, _ in ep) / sum(s for _, s in ep)
    later = ep[1:] or ep
    return total, sum(n for n, _ in later) / sum(s for _, s in later)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", help="an ImageFolder (class folders of JPEGs); default: make one")
    ap.add_argument("--images", type=int, default=2000, help="images to make when --root is not given")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every configuration, report the median")
    ap.add_argument("--size", type=int, default=224, help="crop size of the pipeline")
    ap.add_argument("--paths", default="native,fsspec", help="URL read paths to measure")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per configuration before it counts as failed")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    ap.add_argument("--fetch-threads", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        _one(args)
        return

    tmp = None
    try:
        if args.root:
            root = os.path.abspath(args.root.rstrip("/"))
        else:
            from coordl.synth import make_image_folder

            tmp = tempfile.mkdtemp(prefix="coordl-small-server-")
            root = os.path.join(tmp, "photos")
            make_image_folder(root, num_images=args.images, num_classes=10, image_size=(256, 192), seed=0)
        proc, port = _serve(os.path.dirname(root))
        try:
            url = f"http://127.0.0.1:{port}/{os.path.basename(root)}"
            configs = [("local", "default", root, 0, True)]
            for path in [p.strip() for p in args.paths.split(",") if p.strip()]:
                configs.append((f"http {path}", "default", url, 0, path == "native"))
                configs.append((f"http {path}", "fetch_threads=8", url, 8, path == "native"))
            results = {c[:2]: [] for c in configs}
            for _ in range(args.rounds):   # interleaved, so drift hits every configuration alike
                for name, setting, source, threads, native in configs:
                    results[(name, setting)].append(_run(args, source, threads, native))
        finally:
            proc.kill()
            proc.wait()
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    def med(key, i):
        vals = [_rates(r)[i] for r in results[key]]
        ok = [v for v in vals if v == v]
        return statistics.median(ok) if ok else float("nan")

    local_all, local_later = med(("local", "default"), 0), med(("local", "default"), 1)
    print(f"{'storage':<14} {'settings':<16} {'img/s all':>10} {'img/s 2nd+':>10} {'vs local':>9} "
          f"{'vs local 2nd+':>13}  failed")
    for (name, setting), runs in results.items():
        a, b = med((name, setting), 0), med((name, setting), 1)
        failed = [r["error"] for r in runs if "error" in r]
        print(f"{name:<14} {setting:<16} {a:>10.1f} {b:>10.1f} {a / local_all:>9.2f} {b / local_later:>13.2f}  "
              f"{len(failed)}/{len(runs)}")
        for f in failed[:3]:
            print(f"    {f}")


if __name__ == "__main__":
    main()
