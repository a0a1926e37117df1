"""Client CPU per sample of coordl's remote read path: fsspec (aiohttp) vs
the native obstore reader, through the real fetch stage with the loader's
default threads (fsspec: 16 threads, each given batches of up to 8 through
``read_many``; obstore: 64 threads, one object each).

The files are served on 127.0.0.1 by nginx (``sendfile``, keep-alive; with
``--delay-ms`` every request waits that long before its first byte, which
needs libnginx-mod-http-echo) or, without nginx, by Python's http.server in
another process.  CPU is this process's user+system time
(``getrusage(RUSAGE_SELF)``: every thread, obstore's runtime included) per
sample read; the server's CPU is not counted.  The two paths alternate,
``--rounds`` times each, and the medians are printed.

    python benchmarks/remote_cpu.py                      # 800 synthetic ~110 KB JPEGs
    python benchmarks/remote_cpu.py --root bench_data/photos --delay-ms 5
"""
from __future__ import annotations

import argparse
import os
import queue
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _host  # noqa: E402


PY_SERVER = """
import functools, http.server, sys
class H(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive, as a real object store
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])),
                                functools.partial(H, directory=sys.argv[1])).serve_forever()
"""

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the HTTP server did not listen on 127.0.0.1:{port} within {timeout} s")


class Server:
    def __init__(self, www: str, delay_ms: float, kind: str):
        self.port = _free_port()
        self.tmp = tempfile.mkdtemp(prefix="coordl-rcpu-")
        self.proc = None
        self.conf = None
        if kind == "auto":
            kind = "nginx" if shutil.which("nginx") else "python"
        if delay_ms and (kind != "nginx" or not os.path.exists(_host.NGINX_ECHO)):
            raise SystemExit("--delay-ms needs nginx with the echo module (apt-get install nginx libnginx-mod-http-echo)")
        self.kind = kind
        if kind == "nginx":
            self.conf = os.path.join(self.tmp, "nginx.conf")
            with open(self.conf, "w") as f:
                f.write(_host.nginx_conf(self.tmp, self.port, www, delay_ms))
            subprocess.run(["nginx", "-c", self.conf, "-e", os.path.join(self.tmp, "error.log")], check=True)
        else:
            self.proc = subprocess.Popen([sys.executable, "-c", PY_SERVER, www, str(self.port)])
        _wait_port(self.port)

    def close(self) -> None:
        if self.conf is not None and os.path.exists(os.path.join(self.tmp, "nginx.pid")):
            subprocess.run(["nginx", "-c", self.conf, "-s", "stop"], check=False)
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def one_pass(ds, threads: int, passes: int) -> tuple[float, float, float, int]:
    """(user s, system s, wall s, samples) for ``passes`` reads of every
    sample through the engine's reader and fetch stage."""
    from coordl.pipeline.engine import _make_reader
    from coordl.pipeline.readahead import Fetcher

    read, read_many = _make_reader(ds, None)
    order = [((p, i), i) for p in range(passes) for i in range(len(ds))]
    out: queue.Queue = queue.Queue()
    (u0, s0), t0 = _cpu(), time.perf_counter()
    f = Fetcher(read, order, out, threads=threads, budget_bytes=64 << 20, read_many=read_many)
    for _ in range(len(order)):
        got = out.get(timeout=120)
        if getattr(got, "error", None) is not None or not hasattr(got, "data"):
            raise RuntimeError(f"read failed: {getattr(got, 'error', got)!r}")
        f.release(got.nbytes)
    f.close()
    f.join()
    (u1, s1), t1 = _cpu(), time.perf_counter()
    return u1 - u0, s1 - s0, t1 - t0, len(order)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="an ImageFolder tree (default: --images synthetic JPEGs)")
    ap.add_argument("--images", type=int, default=800, help="synthetic images without --root")
    ap.add_argument("--delay-ms", type=float, default=0)
    ap.add_argument("--server", choices=["auto", "nginx", "python"], default="auto")
    ap.add_argument("--threads", type=int, default=16, help="fetch threads reading through fsspec")
    ap.add_argument("--native-threads", type=int, default=64, help="fetch threads reading through obstore")
    ap.add_argument("--passes", type=int, default=3, help="reads of the whole dataset per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    import coordl

    made = None
    root = args.root
    if root is None:
        from coordl.synth import make_image_folder
        made = tempfile.mkdtemp(prefix="coordl-rcpu-data-")
        root = make_image_folder(os.path.join(made, "photos"), num_images=args.images, num_classes=4)
    root = os.path.abspath(root)
    server = Server(os.path.dirname(root), args.delay_ms, args.server)
    try:
        url = f"http://127.0.0.1:{server.port}/{os.path.basename(root)}/"
        dsets = {}
        for name, env in (("fsspec", "0"), ("obstore", "1")):
            os.environ["COORDL_NATIVE_STORE"] = env
            dsets[name] = coordl.ImageFolder(url)
        if not dsets["obstore"]._store.native:
            raise SystemExit("obstore is not installed (pip install obstore): nothing to compare")
        kb = statistics.mean(os.path.getsize(os.path.join(root, *p.rsplit("/", 2)[-2:]))
                             for p, _ in dsets["fsspec"].samples) / 1e3
        print(f"{len(dsets['fsspec'])} files, mean {kb:.0f} KB, {server.kind} "
              f"server, delay {args.delay_ms} ms, fetch threads: fsspec {args.threads}, obstore {args.native_threads}",
              flush=True)
        threads = {"fsspec": args.threads, "obstore": args.native_threads}
        for name, ds in dsets.items():   # warm: connections, runtimes
            one_pass(ds, threads[name], 1)
        res = {k: [] for k in dsets}
        for _ in range(args.rounds):
            for name, ds in dsets.items():
                u, s, w, n = one_pass(ds, threads[name], args.passes)
                res[name].append((u / n * 1e6, s / n * 1e6, w / n * 1e6))
        for name, rows in res.items():
            u, s, w = (statistics.median(r[k] for r in rows) for k in range(3))
            tot = statistics.median(r[0] + r[1] for r in rows)
            print(f"{name:8s} CPU {tot:6.0f} us/sample (user {u:5.0f}, system {s:5.0f}); wall {w:6.0f} us/sample; "
                  f"rounds: {', '.join(f'{r[0] + r[1]:.0f}' for r in rows)}", flush=True)
    finally:
        server.close()
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
