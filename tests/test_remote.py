"""Remote reads against servers that do not keep up: the
concurrent requests to a host adapt, transient failures are retried with
backoff, and what cannot be read says why and what to change.  Every test
runs on both read paths (obstore and fsspec)."""
import functools
import http.server
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

import coordl
from coordl.storage import remote as _remote
from coordl import transforms as T
from coordl.synth import make_image_folder

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ports import free_port  # noqa: E402

pytest.importorskip("aiohttp")

PATHS = ["native", "fsspec"]


@pytest.fixture(params=PATHS)
def read_path(request, monkeypatch):
    if request.param == "native":
        pytest.importorskip("obstore")
        monkeypatch.delenv("COORDL_NATIVE_STORE", raising=False)
    else:
        monkeypatch.setenv("COORDL_NATIVE_STORE", "0")
    for name in (_remote.ENV_TIMEOUT, _remote.ENV_RETRIES, _remote.ENV_MAX_INFLIGHT):
        monkeypatch.delenv(name, raising=False)
    return request.param


def _wait_listening(port, proc=None, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def _batches(ds, **kw):
    return list(coordl.DataLoader(ds, batch_size=16, seed=5, **kw))


def _same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    make_image_folder(str(root / "photos"), num_images=240, num_classes=4, image_size=(40, 32), seed=2)
    return str(root)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_python_http_server_with_default_settings(folder, read_path, num_workers):
    """The real ``python -m http.server`` (queues 5 connections): every
    sample read correctly with the loader's defaults (64 fetch threads per
    worker for obstore), no error."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_listening(port, proc)
        tf = T.PILToTensor()
        remote = coordl.ImageFolder(f"http://127.0.0.1:{port}/photos", transform=tf)
        assert remote._store.native == (read_path == "native")
        local = coordl.ImageFolder(os.path.join(folder, "photos"), transform=tf)
        _same(_batches(local), _batches(remote, num_workers=num_workers))
    finally:
        proc.kill()
        proc.wait()


class _Flaky:
    """An HTTP server over ``root`` that answers some requests with a
    reset connection, a 503 or a 429 (by a fixed rota), counting requests
    per path."""

    def __init__(self, root, rota=("reset", "ok", "503", "ok", "429", "ok", "close", "ok"), first_only=True):
        self.counts = {}
        self.n = 0
        lock = threading.Lock()
        outer = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                with lock:
                    outer.counts[self.path] = outer.counts.get(self.path, 0) + 1
                    what = rota[outer.n % len(rota)] if self.path.endswith(".jpg") else "ok"
                    if first_only and outer.counts[self.path] > 1:
                        what = "ok"   # each path fails at most once: the retry gets it
                    outer.n += 1
                if what == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                elif what == "close":
                    self.close_connection = True
                    self.connection.close()
                elif what in ("503", "429"):
                    self.send_error(int(what))
                else:
                    super().do_GET()

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=root))
        self.port = self.srv.server_address[1]
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.srv.shutdown()
        self.srv.server_close()
        self.thread.join(5)


def test_resets_and_busy_answers_are_retried(folder, read_path):
    """Half the samples' first requests fail transiently (reset, closed,
    503, 429): every sample still arrives, correct, through retries."""
    srv = _Flaky(folder)
    try:
        tf = T.PILToTensor()
        remote = coordl.ImageFolder(f"http://127.0.0.1:{srv.port}/photos", transform=tf)
        local = coordl.ImageFolder(os.path.join(folder, "photos"), transform=tf)
        _same(_batches(local), _batches(remote))
        gets = {p: c for p, c in srv.counts.items() if p.endswith(".jpg")}
        assert len(gets) == len(local)
        assert sum(gets.values()) >= len(local) * 1.4   # the failures were retried, not avoided
        lim = _remote.limiter(f"http://127.0.0.1:{srv.port}/")
        assert lim.failures > 0 and lim.cuts > 0       # and they cut the concurrency
    finally:
        srv.stop()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_retries_draw_nothing_from_pythons_global_generator(folder, read_path, num_workers):
    """The backoff's jitter has a generator of its own: Python's global one
    is the user's (their sampler, their transforms, which coordl seeds per
    sample in the thread that prepares it), and a fetch thread drawing from
    it while a sample's transform runs would change that sample."""
    import random

    srv = _Flaky(folder)
    try:
        def draws(img):                  # a step of the user's that draws from Python's generator
            return torch.tensor([random.random()])

        tf = T.Compose([T.PILToTensor(), draws])
        remote = coordl.ImageFolder(f"http://127.0.0.1:{srv.port}/photos", transform=tf)
        local = coordl.ImageFolder(os.path.join(folder, "photos"), transform=tf)
        random.seed(3)
        state = random.getstate()
        got = _batches(remote, num_workers=num_workers)
        assert random.getstate() == state        # the pass left the user's generator where it was
        _same(_batches(local), got)
        assert sum(c for p, c in srv.counts.items() if p.endswith(".jpg")) > len(local)   # it retried
    finally:
        srv.stop()


def test_a_server_that_refuses_until_it_starts(folder, read_path, monkeypatch):
    """Connection refused (nothing listens yet): retried with backoff until
    the server is up."""
    srv = _Flaky(folder, rota=("ok",))
    tf = T.PILToTensor()
    try:
        remote = coordl.ImageFolder(f"http://127.0.0.1:{srv.port}/photos", transform=tf)
    finally:
        srv.stop()   # listed; now gone: the port refuses
    port = srv.port
    monkeypatch.setenv(_remote.ENV_RETRIES, "8")
    later = {}

    def start():
        time.sleep(0.4)
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=folder)
        handler.func.log_message = lambda *a: None
        s = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        later["srv"] = s
        s.serve_forever()

    t = threading.Thread(target=start, daemon=True)
    t.start()
    try:
        path = remote.samples[7][0]
        with open(os.path.join(folder, "photos", *path.rsplit("/", 2)[-2:]), "rb") as f:
            assert remote._store.read(path) == f.read()
        assert _remote.limiter(path).failures >= 1
    finally:
        t.join(0.1)
        while "srv" not in later and t.is_alive():
            time.sleep(0.05)
        if "srv" in later:
            later["srv"].shutdown()
            later["srv"].server_close()
        t.join(5)


class _Stall:
    """Lists like an HTTP server (the index pages come from ``listing``),
    then takes every sample request and never answers it."""

    def __init__(self, folder):
        outer = self
        self.conns = []

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path.endswith(".jpg"):
                    outer.conns.append(self.connection)
                    time.sleep(30)   # a stalled backend; the daemon thread dies with the server
                    return
                super().do_GET()

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=folder))
        self.srv.daemon_threads = True
        self.port = self.srv.server_address[1]
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.srv.shutdown()
        for c in list(self.conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.srv.server_close()
        self.thread.join(5)


def test_a_stalled_server_ends_in_a_timeout_naming_url_and_remedy(folder, read_path, monkeypatch):
    """Every request hangs: the pass ends soon after 2x the timeout (not
    one timeout per sample) with a TimeoutError naming the URL, what was in
    flight and what to change, never "fix or remove the file"."""
    monkeypatch.setenv(_remote.ENV_TIMEOUT, "0.5")
    monkeypatch.setenv(_remote.ENV_RETRIES, "1")
    srv = _Stall(folder)
    try:
        ds = coordl.ImageFolder(f"http://127.0.0.1:{srv.port}/photos", transform=T.PILToTensor())
        with pytest.raises(coordl.SampleError) as ei:
            _batches(ds)
        e = ei.value
        # not one timeout per sample: once the host failed everything for 2x the timeout,
        # the rest were not sent
        assert len(srv.conns) < len(ds) // 2
        msg = str(e)
        assert isinstance(e, TimeoutError), repr(e)
        assert f"http://127.0.0.1:{srv.port}/photos/class_" in msg       # the URL
        assert "in flight" in msg and "fetch_threads=" in msg and _remote.ENV_TIMEOUT in msg
        assert "2 attempt(s)" in msg or "has failed for" in msg   # its own retries, or the host's
        assert "Fix or remove the file" not in msg
    finally:
        srv.stop()


def test_missing_object_is_not_retried_and_says_so(folder, read_path):
    srv = _Flaky(folder, rota=("ok",))
    try:
        ds = coordl.ImageFolder(f"http://127.0.0.1:{srv.port}/photos")
        victim = ds.samples[3][0]
        os.rename(os.path.join(folder, "photos", *victim.rsplit("/", 2)[-2:]), os.path.join(folder, "gone.jpg"))
        try:
            with pytest.raises(FileNotFoundError) as ei:
                ds._store.read(victim)
            assert victim in str(ei.value) and "not retried" in str(ei.value)
            path = "/" + victim.split("/", 3)[3]
            assert srv.counts[path] == 1
            with pytest.raises(coordl.SampleError, match="not retried.*Fix or remove the file"):
                list(coordl.DataLoader(ds, batch_size=8, seed=0))
        finally:
            os.rename(os.path.join(folder, "gone.jpg"), os.path.join(folder, "photos", *victim.rsplit("/", 2)[-2:]))
    finally:
        srv.stop()


# -- the limiter itself -----------------------------------------------------------------

def _done(lim, latency, ok=1, congested=0, busy=True):
    k, ticket = lim.acquire()
    t0, epoch, _ = ticket
    lim.release(k, (time.monotonic() - latency, epoch, busy), ok=ok, congested=congested)


def test_limiter_grows_while_latency_holds_and_backs_off():
    lim = _remote.HostLimiter("http://x", initial=4, maximum=64)
    for _ in range(40):
        _done(lim, 0.010)
    assert lim.limit == 44   # slow start: +1 per success (x2 per round trip)
    grown = lim.limit
    _done(lim, 0.010, ok=0, congested=1)   # a refusal or timeout halves it
    assert lim.limit == pytest.approx(grown / 2)
    assert not lim.slow_start
    half = lim.limit
    for _ in range(50):
        _done(lim, 0.010)
    assert half < lim.limit < half + 2     # after slow start: slowly (at most +1 per round trip)
    before = lim.limit
    for _ in range(20):
        _done(lim, 0.200)   # 20x the latency: requests queue at the server
    assert lim.limit < before
    low = lim.limit
    for _ in range(20):
        _done(lim, 0.200, busy=False)
    assert lim.limit <= low   # never grows while latency does not hold


def test_limiter_does_not_grow_unused_and_caps_waiters():
    lim = _remote.HostLimiter("http://x", initial=4, maximum=64)
    for _ in range(50):
        _done(lim, 0.010, busy=False)
    assert lim.limit == 4   # nobody waited: no reason to allow more
    taken = [lim.acquire() for _ in range(4)]
    got = []
    t = threading.Thread(target=lambda: got.append(lim.acquire()), daemon=True)
    t.start()
    time.sleep(0.2)
    assert not got and lim.waiting == 1     # the fifth waits for a slot
    k, ticket = taken.pop()
    lim.release(k, ticket, ok=1)
    t.join(5)
    assert got and lim.inflight == 4
    for k, ticket in taken + got:
        lim.release(k, ticket, ok=1)
    assert lim.inflight == 0


def test_fixed_limit_from_the_environment(monkeypatch):
    monkeypatch.setenv(_remote.ENV_MAX_INFLIGHT, "3")
    lim = _remote.limiter(f"http://fixed-{os.getpid()}-{time.monotonic_ns()}:1/")
    assert lim.limit == 3
    for _ in range(30):
        _done(lim, 0.01)
    _done(lim, 0.01, ok=0, congested=1)
    assert lim.limit == 3


def test_classify():
    assert _remote.classify(TimeoutError()) == "timeout"
    assert _remote.classify(ConnectionRefusedError()) == "connect"
    assert _remote.classify(ConnectionResetError()) == "reset"
    assert _remote.classify(_remote.RemoteStatusError("x", 503)) == "status"
    assert _remote.classify(FileNotFoundError("x")) is None
    assert _remote.classify(PermissionError("x")) is None
    assert _remote.classify(ValueError("x")) is None

    class Resp(Exception):
        def __init__(self, status):
            self.status = status
    assert _remote.classify(Resp(429)) == "status" and _remote.classify(Resp(404)) is None
