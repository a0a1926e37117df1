"""S3 URL datasets against a real S3 API server (moto's server mode, in a
child process on 127.0.0.1), on both read paths: obstore and fsspec (s3fs).
Listing, whole and ranged reads, credentials, and the
errors for a missing bucket, a missing key and refused credentials.

The endpoint reaches both clients the way a user sets it: ``AWS_ENDPOINT_URL``
(botocore, hence s3fs, and coordl's obstore reader honour it)."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

pytest.importorskip("moto")
pytest.importorskip("flask")      # moto's server mode: pip install 'moto[server]'
pytest.importorskip("s3fs")
boto3 = pytest.importorskip("boto3")

import coordl  # noqa: E402
from coordl.storage import remote as _remote  # noqa: E402
from coordl import transforms as T  # noqa: E402
from coordl.storage import FsspecStore  # noqa: E402
from coordl.synth import make_image_folder  # noqa: E402

BUCKET = "coordl-data"
KEY, SECRET = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


class Moto:
    """``python -m moto.server`` on a free port of 127.0.0.1."""

    def __init__(self):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto's server did not start on {self.endpoint}")
                time.sleep(0.1)

    def client(self, service="s3", key=KEY, secret=SECRET):
        return boto3.client(service, endpoint_url=self.endpoint, aws_access_key_id=key,
                            aws_secret_access_key=secret, region_name="us-east-1")

    def enforce_auth(self):
        """From now on moto checks every request's signature and IAM policy."""
        req = urllib.request.Request(self.endpoint + "/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["status"] == "ok"

    def stop(self):
        self.proc.kill()
        self.proc.wait()


def _upload(moto, local_root, bucket=BUCKET, prefix="photos"):
    c = moto.client()
    c.create_bucket(Bucket=bucket)
    for d, _, files in os.walk(local_root):
        for f in files:
            full = os.path.join(d, f)
            rel = os.path.relpath(full, local_root).replace(os.sep, "/")
            c.upload_file(full, bucket, f"{prefix}/{rel}" if prefix else rel)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    local = str(tmp_path_factory.mktemp("s3src") / "photos")
    make_image_folder(local, num_images=40, num_classes=3, image_size=(48, 40), seed=4)
    moto = Moto()
    try:
        _upload(moto, local)
        yield moto, local
    finally:
        moto.stop()


@pytest.fixture(params=["native", "fsspec"])
def env(request, s3, monkeypatch):
    """The S3 endpoint and credentials in the environment, and the read path."""
    moto, local = s3
    if request.param == "native":
        pytest.importorskip("obstore")
        monkeypatch.delenv("COORDL_NATIVE_STORE", raising=False)
    else:
        monkeypatch.setenv("COORDL_NATIVE_STORE", "0")
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
                 "AWS_SHARED_CREDENTIALS_FILE", _remote.ENV_TIMEOUT, _remote.ENV_RETRIES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return request.param, moto, local


def _rel(url):
    return url.split("/photos/", 1)[1]


def test_listing_and_whole_reads_match_local(env):
    path, moto, local = env
    remote = coordl.ImageFolder(f"s3://{BUCKET}/photos", transform=T.PILToTensor())
    assert remote._store.native == (path == "native")
    ref = coordl.ImageFolder(local, transform=T.PILToTensor())
    assert remote.classes == ref.classes
    assert [(_rel(p), t) for p, t in remote.samples] == [(os.path.relpath(p, local), t) for p, t in ref.samples]
    assert [remote.raw(i) for i in range(len(remote))] == [ref.raw(i) for i in range(len(ref))]
    a = list(coordl.DataLoader(ref, batch_size=8, seed=1))
    b = list(coordl.DataLoader(remote, batch_size=8, seed=1))
    assert len(a) == len(b) == 5
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert remote._store.native == (path == "native")   # read on the path it said


def test_ranged_reads(env):
    path, moto, local = env
    store = FsspecStore(f"s3://{BUCKET}/photos")
    url = f"s3://{BUCKET}/photos/class_01/" + sorted(os.listdir(os.path.join(local, "class_01")))[0]
    with open(os.path.join(local, "class_01", url.rsplit("/", 1)[1]), "rb") as f:
        whole = f.read()
    assert store.read(url) == whole
    assert store.read_range(url, 0, 2) == whole[:2] == b"\xff\xd8"     # the JPEG's first marker
    assert store.read_range(url, 100, 160) == whole[100:160]
    assert store.read_range(url, len(whole) - 2, len(whole)) == b"\xff\xd9"
    assert store.native == (path == "native")


def test_missing_key(env):
    path, moto, local = env
    store = FsspecStore(f"s3://{BUCKET}/photos")
    url = f"s3://{BUCKET}/photos/class_00/no-such-key.jpg"
    with pytest.raises(FileNotFoundError) as ei:
        store.read(url)
    assert url in str(ei.value) and "not retried" in str(ei.value)
    with pytest.raises(FileNotFoundError, match="no-such-key"):
        store.read_range(url, 0, 10)


def test_missing_bucket(env):
    path, moto, local = env
    with pytest.raises(FileNotFoundError, match="s3://coordl-no-such-bucket/photos"):
        coordl.ImageFolder("s3://coordl-no-such-bucket/photos")
    store = FsspecStore("s3://coordl-no-such-bucket/photos")
    with pytest.raises(FileNotFoundError, match="s3://coordl-no-such-bucket/photos/a/b.jpg"):
        store.read("s3://coordl-no-such-bucket/photos/a/b.jpg")


def test_missing_prefix_is_an_empty_folder_error(env):
    path, moto, local = env
    with pytest.raises(FileNotFoundError, match=f"s3://{BUCKET}/nothing-here"):
        coordl.ImageFolder(f"s3://{BUCKET}/nothing-here")


def test_credentials_checked_and_refusals_named(tmp_path, monkeypatch, request):
    """moto checking signatures and IAM policies: the right key reads
    (from the environment, or from storage_options), a wrong secret or an
    unknown key is a PermissionError naming the URL, on both paths, and
    is not retried."""
    pytest.importorskip("obstore")
    local = str(tmp_path / "photos")
    make_image_folder(local, num_images=9, num_classes=2, image_size=(24, 24), seed=6)
    moto = Moto()
    request.addfinalizer(moto.stop)
    # classes at the bucket's root: moto 5.2 miscomputes the signature of a listing whose
    # prefix has a "/" (boto3's own list_objects_v2(Prefix="a/") is refused the same way)
    _upload(moto, local, bucket="coordl-private", prefix="")
    iam = moto.client("iam")
    iam.create_user(UserName="reader")
    iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps({
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}]}))
    k = iam.create_access_key(UserName="reader")["AccessKey"]
    moto.enforce_auth()
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
                 "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    url = "s3://coordl-private"
    one = f"{url}/class_00/" + sorted(os.listdir(os.path.join(local, "class_00")))[0]
    with open(os.path.join(local, "class_00", one.rsplit("/", 1)[1]), "rb") as f:
        want = f.read()
    for native in ("1", "0"):
        monkeypatch.setenv("COORDL_NATIVE_STORE", native)
        # the reader's key in the environment
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", k["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", k["SecretAccessKey"])
        ds = coordl.ImageFolder(url)
        assert len(ds) == 9 and ds._store.native == (native == "1")
        assert FsspecStore(url).read(one) == want
        # ... or in storage_options, with nothing usable in the environment
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        opts = {"key": k["AccessKeyId"], "secret": k["SecretAccessKey"]}
        assert FsspecStore(url, opts).read(one) == want
        assert len(coordl.ImageFolder(url, storage_options=opts)) == 9
        # a wrong secret, an unknown key
        for key, secret in ((k["AccessKeyId"], "not-the-secret"), ("AKIAUNKNOWNKEY000000", "wrong")):
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
            with pytest.raises(PermissionError) as ei:
                coordl.ImageFolder(url)
            assert url in str(ei.value) and "credentials" in str(ei.value)
            store = FsspecStore(url)
            failures = _remote.limiter(one).failures
            with pytest.raises(PermissionError) as ei:
                store.read(one)
            assert one in str(ei.value)
            assert _remote.limiter(one).failures == failures   # a refusal is not retried
