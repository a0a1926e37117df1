"""Node cache against another local user, and dataset identity.  The
attacker really runs as another uid (nobody)."""
import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import pytest

import coordl
from coordl import cache as C
from coordl.testing import settle
from coordl.cache import list_caches

from _cache_helpers import check_pass, file_bytes, folder, make_folder

BIG = 1 << 20
SETPRIV = shutil.which("setpriv")
needs_root = pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None,
                                reason="needs root and setpriv to run an attacker as another uid")
OLD_MAGIC = 0x434F4F52444C4331  # the previous layout's, at /dev/shm/coordl-cache-<fingerprint>

# Plants a segment whose READY entries hold the attacker's bytes, in both the
# previous layout (a predictable top-level name) and the current one (a
# pre-created, world-writable coordl-<victim uid> directory or a symlink).
ATTACKER = textwrap.dedent("""
    import os, struct, sys
    base, victim_uid, fp, n, size, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    init_ticks = int(sys.argv[7])  # public: from /proc/1/stat and the boot time

    def segment(magic, version):
        cap = n * size
        hdr = [0] * 512
        hdr[0], hdr[1], hdr[2], hdr[3], hdr[4] = magic, version, cap, n, cap
        if version == 1:  # the previous layout's owner table: a live owner (init), so no reclaim
            hdr[16], hdr[17] = 1, init_ticks
        index = b"".join(struct.pack("<qqqq", i * size, size, 2, 0) for i in range(n))
        return struct.pack("<512q", *hdr) + index + b"EVIL" * (cap // 4)

    def plant(path, data):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        os.fchmod(fd, 0o666)
        os.write(fd, data)
        os.close(fd)

    plant(os.path.join("/dev/shm", "coordl-cache-" + fp), segment(%d, 1))
    mine = os.path.join(base, "attacker-" + str(os.getuid()))
    os.mkdir(mine); os.chmod(mine, 0o777)
    plant(os.path.join(mine, "cache-" + fp), segment(0x434F4F52444C4332, 2))
    target = os.path.join(base, f"coordl-{victim_uid}")
    if how == "dir":
        os.mkdir(target); os.chmod(target, 0o777)
        plant(os.path.join(target, "cache-" + fp), segment(0x434F4F52444C4332, 2))
    else:
        os.symlink(mine, target)
    print("planted")
""" % OLD_MAGIC)


@pytest.fixture
def base(monkeypatch):
    """A fresh shared tmpfs directory (1777, like /dev/shm) as COORDL_SHM_DIR."""
    # inside this session's own directory (tests/conftest.py), so that a
    # parallel worker's leak check never sees it appear in /dev/shm
    parent = os.environ.get("COORDL_SHM_DIR") or "/dev/shm"
    path = os.path.join(parent, f"coordl-sectest-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    os.chmod(path, 0o1777)
    monkeypatch.setenv("COORDL_SHM_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def data(tmp_path):
    root = make_folder(tmp_path / "data", n=24)
    os.chmod(tmp_path, 0o755)
    ds = folder(root)
    return root, ds, file_bytes(ds)


def _attack(base, ds, how):
    import psutil

    fp = ds.fingerprint()
    init_ticks = str(int(psutil.Process(1).create_time() * 100))
    r = subprocess.run([SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c",
                        ATTACKER, base, str(os.geteuid()), fp, str(len(ds)), "256", how, init_ticks],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0 and "planted" in r.stdout, r.stderr
    return os.path.join("/dev/shm", "coordl-cache-" + fp)


@needs_root
@pytest.mark.parametrize("how", ["dir", "symlink"])
def test_segment_planted_by_another_user_is_refused_never_read(base, data, how):
    root, ds, expected = data
    old = _attack(base, ds, how)
    try:
        try:
            L = coordl.DataLoader(folder(root), batch_size=8, cache_size=BIG)
        except PermissionError as e:
            msg = str(e)
            assert os.path.join(base, f"coordl-{os.geteuid()}") in msg and "Remove it" in msg, msg
            assert ("owned by uid 65534" in msg) if how == "dir" else ("symlink" in msg), msg
        else:  # an implementation that ignores the planted segment must still deliver true bytes
            for _ in range(2):
                check_pass(L, expected)
            del L
            settle()
    finally:
        if os.path.lexists(old):
            os.unlink(old)


@pytest.mark.parametrize("problem", ["owner", "mode", "symlink"])
def test_existing_segment_with_wrong_owner_mode_or_symlink_is_refused(base, data, problem):
    """Our own directory, but a segment in it that is not a 0600 regular file
    of ours (left by an older version, a root tool, or a copy): refused with
    the path and the fix, never mapped."""
    root, ds, expected = data
    d = C.user_dir()
    os.mkdir(d, 0o700)
    path = os.path.join(d, C.segment._segment_name(ds.fingerprint()))
    if problem == "symlink":
        other = os.path.join(base, "elsewhere")
        open(other, "wb").close()
        os.symlink(other, path)
    else:
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
        if problem == "owner":
            os.chmod(path, 0o600)
            os.chown(path, 65534, 65534)
        else:
            os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="refusing .*" + os.path.basename(path)):
        coordl.DataLoader(folder(root), batch_size=8, cache_size=BIG)


def test_user_directory_is_private_and_segments_are_0600(base, data):
    root, ds, expected = data
    L = coordl.DataLoader(folder(root), batch_size=8, cache_size=BIG)
    check_pass(L, expected)
    d = C.user_dir()
    st = os.lstat(d)
    assert st.st_uid == os.geteuid() and (st.st_mode & 0o777) == 0o700
    [name] = [c.name for c in list_caches()]
    st = os.lstat(os.path.join(d, name))
    assert st.st_uid == os.geteuid() and (st.st_mode & 0o777) == 0o600
    del L
    settle()
    assert list_caches() == []


# ----------------------------- dataset identity: one cache per copy and version

def test_two_copies_of_a_dataset_get_different_caches(tmp_path):
    a = make_folder(tmp_path / "a", n=16, seed=1)
    b = str(tmp_path / "b")
    shutil.copytree(a, b)
    # same relative paths, sizes and mtimes: only the location differs
    for dirpath, _, files in os.walk(a):
        for f in files:
            src = os.path.join(dirpath, f)
            st = os.stat(src)
            os.utime(os.path.join(b, os.path.relpath(src, a)), ns=(st.st_atime_ns, st.st_mtime_ns))
    with open(os.path.join(b, "class0", "s00000.bin"), "r+b") as f:  # one file differs in content only
        f.write(b"\xff" * 16)
    st = os.stat(os.path.join(a, "class0", "s00000.bin"))
    os.utime(os.path.join(b, "class0", "s00000.bin"), ns=(st.st_atime_ns, st.st_mtime_ns))
    da, db = folder(a), folder(b)
    assert da.fingerprint() != db.fingerprint()
    La = coordl.DataLoader(da, batch_size=4, cache_size=BIG)
    check_pass(La, file_bytes(da))
    Lb = coordl.DataLoader(db, batch_size=4, cache_size=BIG)
    check_pass(Lb, file_bytes(db))  # b's own bytes, not a's cached ones
    assert Lb.stats().epochs[0].samples_from_cache == 0
    # the same folder reached through a symlink is the same dataset
    os.symlink(a, tmp_path / "link")
    assert folder(tmp_path / "link").fingerprint() == da.fingerprint()
    del La, Lb
    settle()


def test_remote_store_version_is_part_of_the_fingerprint():
    """A store reporting no mtime but an ETag: an object re-uploaded with the
    same size is a different dataset."""
    fsspec = pytest.importorskip("fsspec")
    from fsspec.implementations.memory import MemoryFileSystem

    class Versioned(MemoryFileSystem):
        protocol = "coordlversioned"
        root_marker = "/"
        etags: dict = {}

        @classmethod
        def _strip_protocol(cls, path):
            if path.startswith("coordlversioned://"):
                path = path[len("coordlversioned://"):]
            return super()._strip_protocol(path)

        def _as_s3(self, d):  # no mtime, an ETag per file
            d = {k: v for k, v in d.items() if k not in ("created", "mtime")}
            if d.get("type") == "file":
                d["ETag"] = self.etags.get(d["name"].lstrip("/"), "")
            return d

        def ls(self, path, detail=True, **kw):
            out = super().ls(path, detail=detail, **kw)
            return [self._as_s3(d) for d in out] if detail else out

        def info(self, path, **kw):
            return self._as_s3(super().info(path, **kw))

        def find(self, path, maxdepth=None, withdirs=False, detail=False, **kw):
            out = super().find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kw)
            return {k: self._as_s3(v) for k, v in out.items()} if detail else out

    fsspec.register_implementation("coordlversioned", Versioned, clobber=True)
    fs = Versioned()
    key = f"ds{uuid.uuid4().hex[:8]}"
    try:
        fs.pipe(f"/{key}/c0/x.bin", b"a" * 64)
        fs.pipe(f"/{key}/c1/y.bin", b"b" * 64)
        Versioned.etags = {f"{key}/c0/x.bin": "e1", f"{key}/c1/y.bin": "e2"}
        url = f"coordlversioned://{key}"
        first = coordl.DatasetFolder(url, extensions=(".bin",), decode=bytes).fingerprint()
        assert coordl.DatasetFolder(url, extensions=(".bin",), decode=bytes).fingerprint() == first
        fs.pipe(f"/{key}/c0/x.bin", b"z" * 64)  # re-uploaded: same name and size
        Versioned.etags[f"{key}/c0/x.bin"] = "e3"
        assert coordl.DatasetFolder(url, extensions=(".bin",), decode=bytes).fingerprint() != first
    finally:
        fs.rm(f"/{key}", recursive=True)
