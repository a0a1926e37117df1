"""fsspec storage: an ImageFolder served by a local HTTP server."""
import functools
import http.server
import threading

import pytest
import torch

import coordl
from coordl import transforms as T
from coordl.storage import FsspecStore, is_url
from coordl.synth import make_image_folder

pytest.importorskip("aiohttp")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "www"
    make_image_folder(str(root / "photos"), num_images=30, num_classes=3, image_size=(64, 48), seed=1)
    handler = functools.partial(_Quiet, directory=str(root))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield str(root / "photos"), f"http://127.0.0.1:{srv.server_address[1]}/photos/"
    srv.shutdown()
    srv.server_close()
    t.join(5)


def test_is_url():
    assert is_url("http://x/y") and is_url("s3://b/k") and not is_url("/data") and not is_url("file:///d")


def test_image_folder_over_http_matches_local(served):
    local_root, url = served
    tf = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.PILToTensor()])
    local = coordl.ImageFolder(local_root, transform=tf)
    remote = coordl.ImageFolder(url, transform=tf)
    assert remote.classes == local.classes and remote.targets == local.targets
    assert [p.rsplit("/", 2)[-2:] for p, _ in remote.samples] == \
        [p.rsplit("/", 2)[-2:] for p, _ in local.samples]
    assert remote.raw(3) == local.raw(3)
    assert remote.describe(3).startswith("http://127.0.0.1")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_over_http_equals_local(served, num_workers):
    local_root, url = served
    tf = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.PILToTensor()])
    kw = dict(batch_size=8, shuffle=True, seed=3, num_workers=num_workers)
    a = list(coordl.DataLoader(coordl.ImageFolder(local_root, transform=tf), **kw))
    L = coordl.DataLoader(coordl.ImageFolder(url, transform=tf), **kw)
    b = list(L)
    assert len(a) == len(b) == 4
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert L.stats().bytes_from_storage > 0


def test_missing_remote_file_names_url(served):
    import os
    local_root, url = served
    ds = coordl.ImageFolder(url)
    victim = ds.samples[5][0]
    os.unlink(os.path.join(local_root, *victim.rsplit("/", 2)[-2:]))
    with pytest.raises(coordl.SampleError, match="sample 5"):
        list(coordl.DataLoader(ds, batch_size=10, seed=0))


def test_store_pickles_without_filesystem(served):
    import pickle
    _, url = served
    s = FsspecStore(url)
    s.fs
    s2 = pickle.loads(pickle.dumps(s))
    assert s2._fs is None and s2.url == s.url


def test_raw_many_equals_raw_and_reports_missing(served, monkeypatch):
    import os
    monkeypatch.setenv("COORDL_NATIVE_STORE", "0")  # raw_many is fsspec's (obstore reads one by one)
    local_root, url = served
    ds = coordl.ImageFolder(url)
    got = ds.raw_many([0, 5, 7])
    assert got == [ds.raw(0), ds.raw(5), ds.raw(7)]
    victim = ds.samples[7][0]
    os.unlink(os.path.join(local_root, *victim.rsplit("/", 2)[-2:]))
    got = ds.raw_many([5, 7])
    assert got[0] == ds.raw(5) and isinstance(got[1], Exception)
    with pytest.raises(AttributeError):
        coordl.ImageFolder(local_root).raw_many  # local files: one by one
