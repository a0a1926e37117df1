"""The MinIO node cache in shared memory."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import coordl
from coordl import cache as C
from coordl.testing import settle
from coordl.cache import NodeCache, list_caches
from coordl.plan import plan
from toydata import TwoStageToy

HERE = os.path.dirname(os.path.abspath(__file__))


class Fingerprinted(TwoStageToy):
    """Toy two-stage dataset with a fingerprint and variable-size samples."""

    def __init__(self, n, tag="a", **kw):
        super().__init__(n, **kw)
        self.tag = tag
        self.sizes = np.array([32 + (i % 5) * 8 for i in range(n)], dtype=np.int64)

    def fingerprint(self):
        return f"feed{self.tag.encode().hex()}{self.n:08x}"

    def raw(self, i):
        return super().raw(i) + bytes(int(self.sizes[i]) - 32)


@pytest.fixture(autouse=True)
def _no_caches_left():
    yield
    settle()
    left = [c.name for c in list_caches() if c.name.startswith("cache-feed")]
    for name in left:
        os.unlink(os.path.join(C.user_dir(), name))
    assert not left, f"caches left behind: {left}"


def _epochs(L, n):
    for _ in range(n):
        for _b in L:
            pass
    return L.stats().epochs


@pytest.mark.parametrize("num_workers", [0, 2])
def test_minio_exact_hit_miss_accounting_against_the_plan(num_workers):
    ds = Fingerprinted(60)
    cap = int(ds.sizes[:30].sum())  # about half the bytes
    L = coordl.DataLoader(ds, batch_size=4, shuffle=True, seed=1, num_workers=num_workers, cache_size=cap,
                          persistent_workers=num_workers > 0, fetch_threads=1 if num_workers == 0 else 4)
    eps = _epochs(L, 3)
    order = plan(60, 1, 0).tolist()
    # epoch 0: everything from storage; MinIO admits in read order until full.
    # With several workers reads interleave, so compute the admitted set from the cache itself.
    info = L._cache.info()
    cached = [i for i in range(60) if L._cache._index[i, 2] == C.READY]
    assert info.cached == len(cached) and sum(int(ds.sizes[i]) for i in cached) == info.filled <= cap
    if num_workers == 0:  # one reader thread: the admitted set is a prefix of epoch 0's order
        acc, prefix = 0, []
        for i in order:
            if acc + ds.sizes[i] > cap:
                break
            acc += int(ds.sizes[i])
            prefix.append(i)
        assert sorted(cached) == sorted(prefix)
    assert eps[0].samples_from_storage == 60 and eps[0].samples_from_cache == 0
    total = int(ds.sizes.sum())
    for e in eps[1:]:  # never evicted: exactly the cached samples hit, every later epoch
        assert e.samples_from_cache == len(cached)
        assert e.bytes_from_cache == info.filled
        assert e.bytes_from_storage == total - info.filled
    del L
    settle()


def test_two_loaders_share_one_cache():
    ds = Fingerprinted(40, tag="b")
    cap = int(ds.sizes.sum())
    a = coordl.DataLoader(ds, batch_size=5, seed=0, cache_size=cap)
    _epochs(a, 1)
    b = coordl.DataLoader(Fingerprinted(40, tag="b"), batch_size=5, seed=0, cache_size=cap)
    eps = _epochs(b, 1)
    assert eps[0].samples_from_cache == 40 and eps[0].bytes_from_storage == 0
    names = [c.name for c in list_caches() if c.name.startswith("cache-feed")]
    assert len(names) == 1 and list_caches()[0].holders == 2  # one hold per attached loader
    del a, b
    settle()
    assert not [c for c in list_caches() if c.name.startswith("cache-feed")]


def test_fingerprint_change_means_new_cache():
    a = coordl.DataLoader(Fingerprinted(20, tag="c"), batch_size=5, seed=0, cache_size=10_000)
    _epochs(a, 1)
    b = coordl.DataLoader(Fingerprinted(20, tag="d"), batch_size=5, seed=0, cache_size=10_000)
    eps = _epochs(b, 1)
    assert eps[0].samples_from_cache == 0
    assert len([c for c in list_caches() if c.name.startswith("cache-feed")]) == 2
    del a, b


def test_dev_shm_too_small_is_a_clear_error_before_training():
    with pytest.raises(MemoryError, match=r"does not fit in .*cache_size=.*--shm-size"):
        coordl.DataLoader(Fingerprinted(10, tag="e"), batch_size=2, seed=0,
                          cache_size=C.shm_free_bytes() + (1 << 30))
    assert not [c for c in list_caches() if c.name.startswith("cache-feed")]


def test_dataset_without_fingerprint_refused():
    with pytest.raises(ValueError, match="fingerprint"):
        coordl.DataLoader(TwoStageToy(10), batch_size=2, seed=0, cache_size="1MiB")


def test_checksum_mode_detects_corruption():
    ds = Fingerprinted(10, tag="f")
    L = coordl.DataLoader(ds, batch_size=5, seed=0, cache_size=10_000, cache_checksum=True)
    _epochs(L, 1)
    cache = L._cache
    off = int(cache._index[3, 0])
    cache._arena[off] ^= 0xFF  # flip a byte behind the cache's back
    with pytest.raises(RuntimeError, match="checksum mismatch for sample 3"):
        cache.get(3)
    del L, cache


def test_get_into_is_get_with_one_copy():
    """``get_into`` copies an entry into the caller's array: a hit gives
    ``get``'s bytes; a miss, another length or (with checksums) a corrupt
    entry is what ``get`` makes of it, and the hit and miss counters agree."""
    import numpy as np

    from coordl.cache import node as C

    ds = Fingerprinted(10, tag="g")
    L = coordl.DataLoader(ds, batch_size=5, seed=0, cache_size=10_000, cache_checksum=True)
    _epochs(L, 1)
    cache = L._cache
    want = cache.get(3)
    out = np.zeros(len(want), dtype=np.uint8)
    hits, misses = int(cache._hdr[C.HITS]), int(cache._hdr[C.MISSES])
    assert cache.get_into(3, out) and out.tobytes() == want
    assert not cache.get_into(3, np.zeros(len(want) + 1, dtype=np.uint8))     # another length
    assert (int(cache._hdr[C.HITS]), int(cache._hdr[C.MISSES])) == (hits + 1, misses + 1)
    off = int(cache._index[4, 0])
    cache._arena[off] ^= 0xFF
    with pytest.raises(RuntimeError, match="checksum mismatch for sample 4"):
        cache.get_into(4, np.zeros(int(cache._index[4, 1]), dtype=np.uint8))
    del L, cache


def test_concurrent_admission_from_many_processes():
    """Three processes of four threads each admit the same 20,000 small
    samples at once: every sample is admitted exactly once (the arena's fill
    is the exact total), entries are whole and checksums verify.  Without a
    process-local lock in front of the fcntl lock, threads of one process
    both "hold" it and some samples are admitted twice."""
    n = 20000
    code = textwrap.dedent(f"""
        import sys, os, threading
        sys.path.insert(0, {HERE!r})
        from coordl.cache import NodeCache
        c = NodeCache.attach("feed0c0c0c0c", {n}, 10**6, checksum=True)
        start = int(sys.argv[1])

        def admit(offset):  # several threads per process, like fetch threads
            for k in range({n}):
                i = (start + offset + k) % {n}
                c.put(i, bytes([i % 251]) * (10 + i % 7))

        ts = [threading.Thread(target=admit, args=(o,)) for o in (0, 5000, 10000, 15000)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        print("ok")
        sys.stdout.flush()
        os._exit(0)
    """)
    owner = NodeCache.attach("feed0c0c0c0c", n, 10**6, checksum=True)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(s)], stdout=subprocess.PIPE, text=True)
             for s in (0, 7000, 13000)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(o.strip() == "ok" for o in outs)
    total = sum(10 + i % 7 for i in range(n))
    assert int(owner._hdr[C.FILL]) == total  # each sample admitted exactly once
    for i in range(0, n, 7):
        assert owner.get(i) == bytes([i % 251]) * (10 + i % 7)
    owner.close()


def test_keep_warm_keeps_cache_after_last_detach():
    a = coordl.DataLoader(Fingerprinted(10, tag="g"), batch_size=5, seed=0, cache_size=10_000,
                          cache_keep_warm=3600)
    _epochs(a, 1)
    del a
    settle()
    caches = [c for c in list_caches() if c.name.startswith("cache-feed")]
    assert len(caches) == 1 and caches[0].cached == 10 and not caches[0].in_use
    b = coordl.DataLoader(Fingerprinted(10, tag="g"), batch_size=5, seed=0, cache_size=10_000)
    assert _epochs(b, 1)[0].samples_from_cache == 10  # a back-to-back job starts warm
    del b
    settle()
    assert C.clear_caches(caches[0].name) == [caches[0].name]  # kept warm until cleared


def test_cache_cli(capsys):
    from coordl.cli import main

    a = coordl.DataLoader(Fingerprinted(10, tag="h"), batch_size=5, seed=0, cache_size=10_000)
    _epochs(a, 1)
    assert main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    name = [c.name for c in list_caches() if c.name.startswith("cache-feed")][0]
    line = [ln for ln in out.splitlines() if name in ln][0]
    assert "10/10" in line and line.split()[-1] == "1"  # one holder: this process
    assert main(["cache", "clear", name]) == 0
    assert "in use" in capsys.readouterr().out and os.path.exists(os.path.join(C.user_dir(), name))
    assert main(["cache", "clear", name, "--force"]) == 0
    assert not os.path.exists(os.path.join(C.user_dir(), name))
    del a


def test_entry_with_wrong_length_is_not_served():
    """Length is always verified against the dataset's file sizes: a bad
    entry is read from storage instead (and the sample stays correct)."""
    ds = Fingerprinted(8, tag="i")
    L = coordl.DataLoader(ds, batch_size=4, seed=0, cache_size=10_000)
    first = [x[:, 0].clone() for x, _ in L]
    L._cache._index[2, 1] -= 1  # an entry one byte short
    second = [x[:, 0].clone() for x, _ in L]
    assert all(torch.equal(a, b) for a, b in zip(first, second)) and len(second) == 2
    assert L.stats().epochs[1].samples_from_cache == 7
    del L


def test_storage_reads_drop_their_pages_on_the_reads_own_descriptor(tmp_path):
    """With the node cache on, a miss is read once through raw_uncached (which
    drops the page-cache copy on the descriptor it read from), never through
    raw plus a second open of the file."""
    from _cache_helpers import as_tensor, file_bytes, make_folder

    root = make_folder(tmp_path / "data", n=24)
    calls = {"raw": 0, "uncached": 0}

    class Counting(coordl.DatasetFolder):
        def _raw(self, i):
            calls["raw"] += 1
            return super()._raw(i)

        def _raw_uncached(self, i):
            calls["uncached"] += 1
            return super()._raw_uncached(i)

    ds = Counting(str(root), extensions=(".bin",), decode=as_tensor)
    assert ds.raw_uncached(3) == ds.raw(3) == file_bytes(ds)[3]
    calls.update(raw=0, uncached=0)
    L = coordl.DataLoader(ds, batch_size=4, cache_size=1 << 20)
    for _ in range(2):
        for _batch in L:
            pass
    assert calls == {"raw": 0, "uncached": 24}  # epoch 1 misses all, epoch 2 hits all
    del L
    settle()


def test_no_room_advice_fits_what_the_cache_directory_is(tmp_path, monkeypatch):
    """A COORDL_SHM_DIR that is a plain folder on a disk: no remount advice,
    but that it is not in memory and how to put the cache in memory.  A
    full tmpfs: remount it bigger (Docker's --shm-size only for /dev/shm)."""
    disk = tmp_path / "plain"
    disk.mkdir()
    on_disk = subprocess.run(["stat", "-f", "-c", "%T", str(disk)], capture_output=True, text=True)
    if on_disk.returncode != 0 or on_disk.stdout.strip() in ("tmpfs", "ramfs"):
        pytest.skip("the temporary directory is on a tmpfs here (or stat -f is missing)")
    with monkeypatch.context() as m:
        m.setenv("COORDL_SHM_DIR", str(disk))
        with pytest.raises(MemoryError, match="does not fit in") as info:
            coordl.DataLoader(Fingerprinted(10, tag="g"), batch_size=2, seed=0,
                              cache_size=C.shm_free_bytes() + (1 << 30))
    msg = str(info.value)
    assert "remount" not in msg and "--shm-size" not in msg, msg
    assert "not a memory filesystem" in msg and "COORDL_SHM_DIR" in msg and "tmpfs" in msg, msg
    with pytest.raises(MemoryError) as info:  # the session's COORDL_SHM_DIR, a folder in /dev/shm
        coordl.DataLoader(Fingerprinted(10, tag="g"), batch_size=2, seed=0,
                          cache_size=C.shm_free_bytes() + (1 << 30))
    mnt, fstype = C.segment._mount_of(C.shm_root())
    if fstype == "tmpfs":
        assert f"mount -o remount,size=<bytes> {mnt}" in str(info.value), str(info.value)
        assert ("--shm-size" in str(info.value)) == (mnt == "/dev/shm")
    assert not [c for c in list_caches() if c.name.startswith("cache-feed")]


def test_cache_help_names_the_directory_in_effect(tmp_path, monkeypatch, capsys):
    """``coordl cache --help`` showed /dev/shm whatever COORDL_SHM_DIR said."""
    from coordl import cli

    monkeypatch.setenv("COORDL_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at hyphens, paths included
    for argv in (["cache", "--help"], ["--help"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert os.path.join(str(tmp_path), f"coordl-{os.geteuid()}", "cache-*") in out, out
        assert "/dev/shm/coordl-" not in out
