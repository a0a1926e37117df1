"""The native (obstore) read path of URL datasets: same bytes, batches and
error messages as fsspec, and fsspec whenever obstore cannot be used."""
import functools
import http.server
import os
import pickle
import sys
import textwrap
import threading

import pytest

import coordl
from coordl.storage import FsspecStore
from coordl.synth import make_image_folder
from coordl.testing import run_in_child

pytest.importorskip("aiohttp")
pytest.importorskip("obstore")

ODD = "a b+c%.jpg"  # fsspec's HTTP listing percent-encodes it; obstore must get the plain key


class _Server:
    """A local HTTP server that logs who asked for what (obstore's client
    says ``object_store/...``, fsspec's ``... aiohttp/...``)."""

    def __init__(self, root):
        log = self.log = []
        headers = self.headers = []

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                ua = self.headers.get("User-Agent", "")
                log.append((self.path, ua))
                headers.append(self.headers)
                if "/deny/" in self.path or ("refuse-native" in self.path and ua.startswith("object_store")):
                    self.send_error(403)
                    return
                super().do_GET()

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=root))
        self.port = self.srv.server_address[1]
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        if self.thread is not None:
            self.srv.shutdown()
            self.srv.server_close()
            self.thread.join(5)
            self.thread = None

    def sample_gets(self, who):
        return [p for p, ua in self.log if p.endswith(".jpg") and who in ua]


@pytest.fixture
def served(tmp_path, monkeypatch):
    monkeypatch.delenv("COORDL_NATIVE_STORE", raising=False)
    root = tmp_path / "www"
    make_image_folder(str(root / "photos"), num_images=30, num_classes=3, image_size=(64, 48), seed=1)
    src = sorted((root / "photos" / "class_01").iterdir())[0]
    (root / "photos" / "class_01" / ODD).write_bytes(src.read_bytes()[:-7] + b"\xff\xd9odd\xff\xd9")
    server = _Server(str(root))
    yield str(root / "photos"), f"http://127.0.0.1:{server.port}/photos/", server
    server.stop()


def test_native_reads_every_sample_as_fsspec(served, monkeypatch):
    _, url, server = served
    ds = coordl.ImageFolder(url)
    assert ds._store.native
    assert any(p.endswith("a%20b%2Bc%25.jpg") for p, _ in ds.samples)
    got = [ds.raw(i) for i in range(len(ds))]
    assert len(server.sample_gets("object_store")) == len(ds)
    assert not server.sample_gets("aiohttp")
    fs = ds._store.fs
    assert got == [fs.cat_file(p) for p, _ in ds.samples]
    with pytest.raises(AttributeError, match="read through obstore"):
        ds.raw_many  # the fetch threads read one by one: no batches for the engine
    # and with the node cache on, no local page-dropping by the URL's name
    assert ds.raw_uncached == ds.raw and ds.raw_uncached(4) == got[4]
    s2 = pickle.loads(pickle.dumps(ds._store))   # the recipe travels, no obstore store
    assert s2.native and s2._native._store is None and s2.read(ds.samples[3][0]) == got[3]


_LOADER_CHILD = """
import sys
import torch
import coordl
from coordl import transforms as T
local, url, touch_first = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
tf = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.PILToTensor()])
kw = dict(batch_size=8, shuffle=True, seed=3, num_workers=2)
remote = coordl.ImageFolder(url, transform=tf)
assert remote._store.native
if touch_first:   # obstore's runtime starts here, before the workers fork
    remote.raw(0)
a = list(coordl.DataLoader(coordl.ImageFolder(local, transform=tf), **kw))
b = list(coordl.DataLoader(remote, **kw))
assert len(a) == len(b) == 4, (len(a), len(b))
for (xa, ya), (xb, yb) in zip(a, b):
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
print("SAME")
"""


def _loader_in_child(local, url, touch_first):
    code = f"import sys; sys.argv = ['x', {local!r}, {url!r}, {'1' if touch_first else '0'!r}]\n" + _LOADER_CHILD
    r = run_in_child(code, timeout=120)
    assert r.returncode == 0 and "SAME" in r.stdout, r.stdout + r.stderr


def test_loader_workers_read_natively_same_batches(served):
    local, url, server = served
    os.unlink(os.path.join(local, "class_01", ODD))  # not in the local twin
    _loader_in_child(local, url, touch_first=False)
    assert len(server.sample_gets("object_store")) == 30   # every sample, from the workers
    assert not server.sample_gets("aiohttp")


def test_workers_forked_after_obstore_started_read_through_fsspec(served):
    """obstore's runtime does not survive fork(): a worker forked after the
    parent used it would block forever in its first read."""
    local, url, server = served
    os.unlink(os.path.join(local, "class_01", ODD))
    _loader_in_child(local, url, touch_first=True)
    assert len(server.sample_gets("object_store")) == 1   # the parent's raw(0)
    assert len(server.sample_gets("aiohttp")) == 30


def _error(fn):
    try:
        fn()
    except Exception as e:
        return e
    raise AssertionError("no error")


def test_missing_object_same_error_as_fsspec(served, monkeypatch):
    local, url, _ = served
    ds = coordl.ImageFolder(url)
    monkeypatch.setenv("COORDL_NATIVE_STORE", "0")
    ds_fsspec = coordl.ImageFolder(url)
    assert ds._store.native and not ds_fsspec._store.native
    victim = ds.samples[5][0]
    os.unlink(os.path.join(local, *victim.rsplit("/", 2)[-2:]))
    native = _error(lambda: ds._store.read(victim))
    fsspec_ = _error(lambda: ds_fsspec._store.read(victim))
    assert type(native) is type(fsspec_) is FileNotFoundError and str(native) == str(fsspec_)
    assert victim in str(native) and "not retried" in str(native)   # a 404 is not transient

    def message(d):
        with pytest.raises(coordl.SampleError, match="sample 5") as ei:
            list(coordl.DataLoader(d, batch_size=10, seed=0))
        assert isinstance(ei.value, FileNotFoundError)
        return str(ei.value)

    native_msg = message(ds)
    assert native_msg == message(ds_fsspec)
    assert victim in native_msg


def test_server_gone_is_a_connection_error_naming_the_host(served):
    _, url, server = served
    ds = coordl.ImageFolder(url)
    server.stop()
    path = ds.samples[2][0]
    native = _error(lambda: ds._store.read(path))
    fsspec_ = _error(lambda: ds._store.fs.cat_file(path))
    host = f"127.0.0.1:{server.port}"
    assert isinstance(native, ConnectionError) and isinstance(fsspec_, OSError)   # aiohttp's is an OSError
    assert host in str(native) and path in str(native) and host in str(fsspec_)
    with pytest.raises(coordl.SampleError, match=f"sample .*Cannot connect to host {host}"):
        list(coordl.DataLoader(ds, batch_size=10, seed=0))


def test_refused_object_reads_through_fsspec(served):
    local, url, server = served
    # a 403 for every client: fsspec's own error, and obstore stays on
    os.makedirs(os.path.join(local, "class_00", "deny"))
    with open(os.path.join(local, "class_00", "deny", "x.jpg"), "wb") as f:
        f.write(b"x")
    store = FsspecStore(url)
    e = _error(lambda: store.read(url + "class_00/deny/x.jpg"))
    assert type(e).__name__ == "ClientResponseError" and "403" in str(e)
    assert store.native
    # refused to obstore only (its credentials differ from fsspec's): fsspec reads it, and from then on
    with open(os.path.join(local, "class_00", "refuse-native.jpg"), "wb") as f:
        f.write(b"ok")
    assert store.read(url + "class_00/refuse-native.jpg") == b"ok"
    assert not store.native


def test_fallback_when_obstore_is_absent(served, monkeypatch):
    _, url, server = served
    monkeypatch.setitem(sys.modules, "obstore", None)   # import obstore -> ImportError
    ds = coordl.ImageFolder(url)
    assert not ds._store.native
    assert ds.raw_many([0, 1]) == [ds.raw(0), ds.raw(1)]
    assert not server.sample_gets("object_store") and server.sample_gets("aiohttp")


def test_fallback_when_turned_off(served, monkeypatch):
    _, url, server = served
    monkeypatch.setenv("COORDL_NATIVE_STORE", "0")
    ds = coordl.ImageFolder(url)
    assert not ds._store.native
    ds.raw(0)
    with pytest.raises(AttributeError):
        ds.raw_uncached   # fsspec URLs are read in batches (raw_many)
    assert not server.sample_gets("object_store") and server.sample_gets("aiohttp")


def test_fallback_for_schemes_and_options_obstore_lacks(served, monkeypatch):
    _, url, server = served
    assert not FsspecStore("memory://bucket/data").native
    from coordl.storage import obstore_store as _native_store
    assert _native_store.plan("ftp://host/data") is None
    assert not FsspecStore(url, {"client_kwargs": {"trust_env": True}}).native  # no obstore equivalent
    store = FsspecStore(url, {"headers": {"X-Coordl-Test": "yes"}, "block_size": 0})
    assert store.native
    ds = coordl.ImageFolder(url)
    assert store.read(ds.samples[0][0]) == ds.raw(0)
    assert server.headers[-2].get("X-Coordl-Test") == "yes"   # the option reached obstore's request
    s3 = _native_store.plan("s3://bucket/prefix", {"key": "K", "secret": "S", "endpoint_url": "http://minio:9000",
                                                   "client_kwargs": {"region_name": "eu-west-1"}, "anon": False})
    assert s3.config == {"access_key_id": "K", "secret_access_key": "S", "endpoint": "http://minio:9000",
                         "region": "eu-west-1", "skip_signature": False}
    assert s3.client == {"allow_http": True}
    assert _native_store.plan("s3://bucket/prefix", {"config_kwargs": {"max_pool_connections": 64}}) is None
    assert _native_store.plan("gcs://bucket/p", {"token": "anon"}).config == {"skip_signature": True}


def test_loader_gives_native_reads_more_fetch_threads(served, monkeypatch):
    _, url, _ = served
    ds = coordl.ImageFolder(url)
    assert coordl.DataLoader(ds, batch_size=4)._fetch_threads == 64   # one object per thread
    assert coordl.DataLoader(ds, batch_size=4, fetch_threads=5)._fetch_threads == 5
    monkeypatch.setenv("COORDL_NATIVE_STORE", "0")
    assert coordl.DataLoader(coordl.ImageFolder(url), batch_size=4)._fetch_threads == 16  # batches of 8 each


def test_remote_cpu_benchmark_runs():
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "remote_cpu.py")
    code = (f"import sys; sys.argv = [{script!r}, '--images', '24', '--rounds', '1', '--passes', '1', "
            f"'--server', 'python']; import runpy; runpy.run_path({script!r}, run_name='__main__')")
    r = run_in_child(code, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.split()}
    assert "us/sample" in lines["fsspec"] and "us/sample" in lines["obstore"], r.stdout


class _Stall:
    """A TCP server that accepts connections and never answers."""

    def __init__(self):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)   # held open, never read or written

    def stop(self):
        for c in self.conns:
            c.close()
        self.sock.close()
        self.thread.join(5)


def test_a_stalled_server_is_a_timeout_error_as_with_fsspec():
    """A server that takes the connection and never answers: the native read
    ends in ``TimeoutError`` naming the URL (what aiohttp raises through
    fsspec), after its retries, not a hang."""
    import aiohttp
    import fsspec

    from coordl.storage.obstore_store import Native

    srv = _Stall()
    try:
        base = f"http://127.0.0.1:{srv.port}/photos"
        native = Native(base, "http", {}, {"allow_http": True, "timeout": "1s"})
        url = base + "/class_00/x.jpg"
        e = _error(lambda: native.read("class_00/x.jpg", url))
        assert isinstance(e, TimeoutError), repr(e)
        assert str(e).startswith(f"Timed out reading {url}")
        fs = fsspec.filesystem("http", client_kwargs={"timeout": aiohttp.ClientTimeout(total=1)},
                               skip_instance_cache=True)
        assert isinstance(_error(lambda: fs.cat_file(url)), TimeoutError)
    finally:
        srv.stop()
