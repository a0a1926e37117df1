"""Small host helpers the benchmarks share that import neither torch nor
coordl (safe in a benchmark's outer process, whose own CPU and memory must
stay out of the measurement)."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time

__all__ = ["rmdir_retry", "pyplot", "JsonJob", "cgroup_pids", "medians_by_config"]


def rmdir_retry(path: str, tries: int = 50) -> None:
    """Remove an (empty) cgroup directory, retrying while the kernel still
    counts processes that just exited in it; a missing one is fine."""
    for _ in range(tries):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a message) when
    matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return None
    return plt


class JsonJob:
    """A child process (its own process group) whose stdout carries one JSON
    record per line, read on a thread onto a queue; its stderr goes to
    ``log_path``; ``say`` writes a word to its stdin."""

    def __init__(self, cmd: list[str], env: dict, log_path: str):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                  text=True, env=env, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.recs: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for line in self.p.stdout:
                if line.startswith("{"):
                    try:
                        self.lines.put(json.loads(line))
                    except ValueError:
                        pass  # somebody else's output
        finally:
            self.lines.put(None)  # end of its output

    def arrived(self):
        """The records read since the last call (None once: its output ended)."""
        while True:
            try:
                yield self.lines.get_nowait()
            except queue.Empty:
                return

    def say(self, word: str) -> None:
        try:
            self.p.stdin.write(word + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def stderr_tail(self, n: int = 3000) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def kill(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)  # the job and its workers
        except ProcessLookupError:
            pass
        self.p.wait()

    def close(self) -> None:
        """Killed if still running; its log closed."""
        if self.p.poll() is None:
            self.kill()
        self.log.close()


def cgroup_pids(dirs: list[str]) -> set[int]:
    """The processes in any of the cgroup v1 directories ``dirs`` (as the kernel lists them)."""
    out = set()
    for d in dirs:
        try:
            with open(os.path.join(d, "cgroup.procs")) as f:
                out |= {int(x) for x in f.read().split()}
        except FileNotFoundError:
            pass
    return out


def medians_by_config(rows: list[dict]) -> list[tuple[list[dict], dict]]:
    """Per configuration (in first-seen order): its rows, and one row whose
    float fields are the medians over them (NaNs left out) and ``rounds``."""
    import statistics

    out = []
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == name]
        m = dict(rs[0])
        for k, v in rs[0].items():
            if isinstance(v, float):
                vals = [r[k] for r in rs if r[k] == r[k]]
                m[k] = statistics.median(vals) if vals else float("nan")
        m["rounds"] = len(rs)
        out.append((rs, m))
    return out


NGINX_ECHO = "/usr/lib/nginx/modules/ngx_http_echo_module.so"


def nginx_conf(tmp: str, port: int, www: str, delay_ms: float = 0, workers: int = 1) -> str:
    """An nginx config serving ``www`` on 127.0.0.1:``port`` with autoindex
    (fsspec lists folders from it), sendfile, keep-alive and an open-file
    cache (descriptors and sizes kept between requests, as a production file
    server is set up: the server shares the loaders' cores here, so its
    per-request CPU is kept to what serving costs); with
    ``delay_ms`` every request waits that long before its first byte
    (``echo_sleep``, Debian's libnginx-mod-http-echo: ``NGINX_ECHO``)."""
    if delay_ms:
        load = f"load_module {NGINX_ECHO};"
        location = (f"location / {{ echo_sleep {delay_ms / 1000}; echo_exec @files; }}\n"
                    "        location @files { autoindex on; }")
    else:
        load, location = "", "location / { autoindex on; }"
    return f"""{load}
worker_processes {workers};
pid {tmp}/nginx.pid;
error_log {tmp}/error.log;
daemon on;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nodelay on;
    open_file_cache max=20000 inactive=300s;
    open_file_cache_valid 300s;
    keepalive_requests 100000;
    server {{
        listen 127.0.0.1:{port};
        root {www};
        {location}
    }}
}}
"""
