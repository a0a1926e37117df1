"""Storage latency: the throughput benchmark with the files served over HTTP
by nginx behind ``tc netem delay``, read through fsspec, each loader compared
with its own local-disk throughput (same run).

Setup (needs root, iproute2, tc and nginx; all traffic stays on the loopback
interface of a network namespace this script creates and removes):

* ``ip netns add coordl-lat-<pid>``; ``lo`` up inside it;
* nginx inside the namespace serves the dataset's parent directory on
  127.0.0.1 with autoindex (fsspec lists folders from it), and holds every
  request ``<ms>`` before its first byte (``echo_sleep``, from Debian's
  libnginx-mod-http-echo).  ``tc netem delay`` would be the usual way, but this
  kernel is built without ``CONFIG_NET_SCH_NETEM`` ("Specified qdisc kind is
  unknown"); a per-request delay in the server is the same first-byte
  latency a remote object store adds, and costs no CPU in a proxy;
* this script re-runs itself inside the namespace to measure.

Loaders over HTTP: torch's DataLoader over a dataset whose ``__getitem__``
reads ``fsspec.open(url)`` (what a torch user writes), DALI with its parallel
``external_source`` reading through fsspec per sample (DALI's documented way
to read from custom storage), coordl with ``ImageFolder("http://...")``.

    python -m coordl.synth bench_data/photos --images 2000
    python benchmarks/latency.py --root bench_data/photos --delay-ms 5 [--rounds 3 --epochs 2]
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _host  # noqa: E402
import common  # noqa: E402

PORT = 18080


class HttpTorchFolder(common.TorchStyleFolder):
    """The torch-style dataset reading each file through fsspec."""

    def __init__(self, root: str, url: str):
        super().__init__(root)
        self.url = url.rstrip("/")
        self.root = os.path.abspath(root)
        self._fs = None

    def __getitem__(self, i: int):
        import io

        import fsspec
        from PIL import Image

        path, target = self.samples[i]
        rel = os.path.relpath(path, self.root)
        with fsspec.open(f"{self.url}/{rel}", "rb") as f:
            img = Image.open(io.BytesIO(f.read())).convert("RGB")
        return common.pil_pipeline(img, self.size), target


class DaliHttp:
    """DALI CPU pipeline fed by a parallel external_source reading over fsspec."""

    def __init__(self, root: str, url: str, batch_size: int, threads: int, size: int = 224):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        files = [os.path.relpath(p, root) for p, _ in common.TorchStyleFolder(root).samples]
        labels = [c for _, c in common.TorchStyleFolder(root).samples]
        source = _HttpSource(url.rstrip("/"), files, labels, batch_size)
        self.n = len(files)

        @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None, seed=1,
                      py_num_workers=threads, py_start_method="spawn")
        def pipe():
            jpegs, lab = fn.external_source(source=source, num_outputs=2, batch=False, parallel=True,
                                            dtype=[types.UINT8, types.INT32])
            return common.dali_prep(jpegs, size), lab

        self.pipe = pipe()
        self.pipe.build()
        self.it = DALIGenericIterator([self.pipe], ["images", "labels"], auto_reset=True)

    def __iter__(self):
        for out in self.it:
            yield out[0]["images"], out[0]["labels"]


class _HttpSource:
    def __init__(self, url, files, labels, batch_size):
        self.url, self.files, self.labels, self.bs = url, files, labels, batch_size

    def __call__(self, info):
        import numpy as np
        import fsspec

        n = len(self.files)
        if info.idx_in_epoch >= n - n % self.bs:  # whole batches only
            raise StopIteration
        k = (info.idx_in_epoch * 7919 + info.epoch_idx * 104729) % n  # a shuffled order
        with fsspec.open(f"{self.url}/{self.files[k]}", "rb") as f:
            data = np.frombuffer(f.read(), dtype=np.uint8)
        return data, np.array([self.labels[k]], dtype=np.int32)


def _loader(kind: str, root: str, url: str | None, workers: int, bs: int):
    import coordl

    if url is None:
        return common.make_loader(kind, root, workers, bs)
    if kind == "torch":
        import torch
        return torch.utils.data.DataLoader(HttpTorchFolder(root, url), batch_size=bs, shuffle=True,
                                           num_workers=workers, persistent_workers=True)
    if kind == "coordl":
        ds = coordl.ImageFolder(url, transform=common.coordl_dataset(root).transform)
        return coordl.DataLoader(ds, batch_size=bs, shuffle=True, num_workers=workers,
                                 persistent_workers=True, seed=0)  # 16 fetch threads for URLs
    if kind == "dali":
        return DaliHttp(root, url, bs, workers)
    raise ValueError(kind)


def inner(args) -> None:
    """Runs inside the namespace: local and HTTP throughput per loader."""
    url = args.url or f"http://127.0.0.1:{PORT}/{os.path.basename(os.path.abspath(args.root))}/"
    common.warm_page_cache(args.root)
    loaders = [l for l in args.loaders.split(",") if l]
    if "dali" in loaders and not common.dali_available():
        loaders.remove("dali")
    rows = []
    for kind in loaders:
        # Both loaders live side by side (persistent workers) and take turns,
        # ``--rounds`` times, in alternating order: this VM's CPU speed drifts
        # by 10-30% from one minute to the next, and a CPU-bound ratio
        # measured as "all local, then all HTTP" measured that drift too.
        Ls = {where: _loader(kind, args.root, u, args.workers, args.batch_size)
              for where, u in (("local", None), ("http", url))}
        for L in Ls.values():
            common.time_epochs(L, 1)  # warm-up: workers started, HTTP connections open
        rates = {"local": [], "http": []}
        for r in range(args.rounds):
            for where in (("local", "http") if r % 2 == 0 else ("http", "local")):
                per = common.time_epochs(Ls[where], args.epochs)
                rates[where].append(sum(n for n, _ in per) / sum(s for _, s in per))
        del Ls
        res = {w: statistics.median(v) for w, v in rates.items()}
        ratios = [h / l for h, l in zip(rates["http"], rates["local"])]
        rows.append({"loader": kind, "local_images_per_s": res["local"], "http_images_per_s": res["http"],
                     "http_over_local": res["http"] / res["local"], "rounds": args.rounds,
                     "round_ratios": " ".join(f"{x:.3f}" for x in ratios)})
        print(f"{kind:<8} local {res['local']:8.1f}/s  http+{args.delay_ms}ms {res['http']:8.1f}/s  "
              f"kept {res['http'] / res['local']:.0%}  (rounds: {' '.join(f'{x:.0%}' for x in ratios)})",
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "latency.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def outer(args) -> int:
    if shutil.which("nginx") is None or shutil.which("ip") is None or \
            not os.path.exists(_host.NGINX_ECHO):
        print("needs root, iproute2 and nginx with the echo module "
              "(apt-get install nginx-light libnginx-mod-http-echo)")
        return 2
    ns = f"coordl-lat-{os.getpid()}"
    tmp = tempfile.mkdtemp(prefix="coordl-lat-")
    www = os.path.dirname(os.path.abspath(args.root))
    conf = os.path.join(tmp, "nginx.conf")
    with open(conf, "w") as f:
        f.write(_host.nginx_conf(tmp, PORT, www, args.delay_ms, workers=2))

    def sh(*cmd, check=True):
        return subprocess.run(cmd, check=check)

    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "nginx", "-c", conf, "-e", os.path.join(tmp, "error.log"))
        time.sleep(0.5)
        print(f"nginx in netns {ns} on 127.0.0.1:{PORT}, every request delayed {args.delay_ms} ms "
              "before its first byte", flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--inner", "--root", os.path.abspath(args.root),
               "--workers", str(args.workers), "--batch-size", str(args.batch_size), "--epochs",
               str(args.epochs), "--rounds", str(args.rounds), "--loaders", args.loaders,
               "--out", os.path.abspath(args.out), "--delay-ms", str(args.delay_ms)]
        return subprocess.run(["ip", "netns", "exec", ns] + cmd).returncode
    finally:
        pidfile = os.path.join(tmp, "nginx.pid")
        if os.path.exists(pidfile):
            subprocess.run(["ip", "netns", "exec", ns, "nginx", "-c", conf, "-s", "stop"], check=False)
            time.sleep(0.3)
        subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--delay-ms", type=float, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs per loader per round")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds (local and HTTP take turns); medians are reported")
    ap.add_argument("--loaders", default="torch,dali,coordl")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--inner", action="store_true",
                    help="measure only, against --url (or the namespace's nginx): no setup")
    ap.add_argument("--url", default=None, help="with --inner: the dataset's URL")
    args = ap.parse_args(argv)
    if args.inner:
        inner(args)
        return 0
    return outer(args)


if __name__ == "__main__":
    sys.exit(main())
