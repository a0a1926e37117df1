"""The node cache: raw sample bytes in POSIX shared memory, MinIO policy.

One cache per dataset per node, named from the dataset's fingerprint (paths,
sizes, mtimes), so every worker, local rank and job reading the same files
attaches to the same segment, and a changed dataset never reads stale bytes.

MinIO (CoorDL): admit until full, never evict.  Under per-epoch random order
every reuse interval crosses the epoch boundary, so no policy can hit more
than ``capacity`` bytes per epoch; MinIO gets exactly that, while LRU thrashes.

Segment layout (``/dev/shm/coordl-cache-<fingerprint>``)::

    header   (4 KiB)  magic, version, capacity, n, fill, created, keep_warm,
                      last_detach, counters; owner table (pid, start time)
    index    n x 4 int64: offset, length, state (0 empty, -pid writing, 2 ready), crc32
    arena    capacity bytes, append-only

* **Reads are lock-free**: an entry is visible once its state is READY, and
  the writer stores the state only after the bytes, offset and length (x86
  and arm64 keep that store order for a single writer thread; numpy writes
  are plain stores).
* **Admission** takes an ``fcntl`` byte-range lock on the segment only to
  reserve arena space and mark the entry WRITING, then copies without the
  lock.  The lock is released by the kernel if its holder dies, so SIGKILL
  can never wedge it; an entry left WRITING by a dead writer is never read
  (no torn entry is visible) and may be admitted again later.
* **Lifetime**: each attached process registers (pid, process start time) in
  the owner table.  The segment is unlinked when the last owner detaches
  (after ``keep_warm`` seconds, if set, by the next start), and any start
  reclaims segments whose owners are all dead (SIGKILLed jobs).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import re
import struct
import threading
import time
import zlib
from dataclasses import dataclass

import numpy as np
import psutil

__all__ = ["NodeCache", "CacheInfo", "list_caches", "clear_caches", "reclaim_stale", "SHM_DIR"]

SHM_DIR = "/dev/shm"
PREFIX = "coordl-cache-"
_MAGIC = 0x434F4F52444C4331  # "COORDLC1"
_VERSION = 1
_HEADER = 4096
_OWNERS = 200           # owner slots (pid, start ticks)
_H = 16                 # int64 header fields before the owner table
# header field indices
MAGIC, VERSION, CAPACITY, N, FILL, CREATED, KEEP_WARM, LAST_DETACH, HITS, MISSES, ADMITTED, FULL, CHECKSUM = range(13)
EMPTY, READY = 0, 2   # state; a negative state is WRITING by process -state
_NAME = re.compile(r"^coordl-cache-[0-9a-f]{8,64}$")


def _start_ticks(pid: int) -> int:
    try:
        return int(psutil.Process(pid).create_time() * 100)
    except psutil.Error:
        return -1


def _alive(pid: int, ticks: int) -> bool:
    return pid > 0 and _start_ticks(pid) == ticks


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class CacheInfo:
    """What ``coordl cache ls`` shows about one cache."""

    name: str
    capacity: int
    filled: int
    samples: int
    cached: int
    hits: int
    misses: int
    owners: tuple[int, ...]
    full: bool


class NodeCache:
    """A MinIO cache of raw sample bytes shared by every process on the node.

    ``NodeCache.attach(fingerprint, n, capacity)`` creates the segment or
    attaches to the existing one (whose capacity then wins).  Objects pickle
    to (name) and re-attach in the receiving process.
    """

    def __init__(self, name: str, fd: int, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self._fd = fd
        self._mm = mm
        self._owner = owner
        self._pid = os.getpid()
        self._tlock = threading.Lock()
        self._lfd = -1
        self._lpid = None
        hdr = np.frombuffer(mm, dtype=np.int64, count=_HEADER // 8)
        self._hdr = hdr
        self.capacity = int(hdr[CAPACITY])
        self.n = int(hdr[N])
        self._index = np.frombuffer(mm, dtype=np.int64, count=self.n * 4, offset=_HEADER).reshape(self.n, 4)
        self._arena_off = _HEADER + self.n * 32
        self._arena = np.frombuffer(mm, dtype=np.uint8, count=self.capacity, offset=self._arena_off)
        self.checksum = bool(hdr[CHECKSUM])

    # ------------------------------------------------------------ lifecycle
    @classmethod
    def attach(cls, fingerprint: str, n: int, capacity: int, *, checksum: bool = False,
               keep_warm: float = 0.0, register: bool = True) -> "NodeCache":
        reclaim_stale()
        name = PREFIX + fingerprint
        path = os.path.join(SHM_DIR, name)
        total = _HEADER + n * 32 + capacity
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            created = True
        except FileExistsError:
            fd = os.open(path, os.O_RDWR)
            created = False
        try:
            if created:
                free = shm_free_bytes()
                if total > free:
                    raise MemoryError(
                        f"cache_size={capacity} bytes does not fit in {SHM_DIR}: {free} bytes free. "
                        f"Pass a smaller cache_size (e.g. cache_size={max(0, free - _HEADER - n * 32) // 2**20}MiB), "
                        f"or enlarge {SHM_DIR} (mount -o remount,size=<bytes> {SHM_DIR}; "
                        "in Docker: --shm-size)")
                os.ftruncate(fd, total)
                mm = mmap.mmap(fd, total)
                hdr = np.frombuffer(mm, dtype=np.int64, count=_HEADER // 8)
                hdr[VERSION], hdr[CAPACITY], hdr[N] = _VERSION, capacity, n
                hdr[CREATED], hdr[KEEP_WARM] = int(time.time()), int(keep_warm * 1000)
                hdr[CHECKSUM] = int(checksum)
                if register:  # own it before it becomes visible, or a concurrent
                    hdr[_H], hdr[_H + 1] = os.getpid(), _start_ticks(os.getpid())  # start reclaims it
                hdr[MAGIC] = _MAGIC  # last: attachers wait for it
                del hdr
            else:
                deadline = time.monotonic() + 10
                while os.fstat(fd).st_size < _HEADER:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cache segment {path} was never initialized; remove it "
                                           f"(coordl cache clear {name})")
                    time.sleep(0.01)
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size)
                hdr = np.frombuffer(mm, dtype=np.int64, count=_HEADER // 8)
                while hdr[MAGIC] != _MAGIC:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cache segment {path} was never initialized; remove it "
                                           f"(coordl cache clear {name})")
                    time.sleep(0.01)
                if hdr[N] != n:
                    raise RuntimeError(f"cache segment {path} holds {int(hdr[N])} samples, but the dataset has "
                                       f"{n}: a fingerprint collision; remove it (coordl cache clear {name})")
                del hdr
        except BaseException:
            os.close(fd)
            if created:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise
        cache = cls(name, fd, mm, owner=register)
        if register and not created:
            cache._register()
        return cache

    def __reduce__(self):
        return (_reattach, (self.name, self.n))

    def _lock(self):
        """Exclusive admission lock, across threads and processes.

        An open-file-description (OFD) lock on a descriptor this process
        opened itself: unlike ``lockf`` locks, which belong to the process,
        it is not dropped when some other descriptor of the file is closed
        (Python's mmap keeps a dup and closes it when collected, at any
        time), it gives no false EDEADLK between threads, and it is not
        shared with forked children (each process opens its own).  Threads
        of one process share the descriptor, so they queue on a process-local
        lock first.  The kernel drops the lock if the process dies.
        """
        fd = self._lock_fd()
        self._tlock.acquire()
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _flock(fcntl.F_WRLCK))
        except BaseException:
            self._tlock.release()
            raise

    def _unlock(self):
        try:
            fcntl.fcntl(self._lfd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK))
        finally:
            self._tlock.release()

    def _lock_fd(self) -> int:
        pid = os.getpid()
        if self._lpid != pid:
            with _FORK_SAFE[0]:
                if self._lpid != pid:  # first use in this process (or after fork)
                    self._tlock = threading.Lock()
                    self._lfd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDWR)
                    self._lpid = pid
        return self._lfd

    def _owners(self) -> np.ndarray:
        return self._hdr[_H:_H + 2 * _OWNERS].reshape(_OWNERS, 2)

    def _register(self) -> None:
        me, ticks = os.getpid(), _start_ticks(os.getpid())
        self._lock()
        try:
            owners = self._owners()
            for k in range(_OWNERS):
                pid, t = int(owners[k, 0]), int(owners[k, 1])
                if pid == 0 or not _alive(pid, t):
                    owners[k, 0], owners[k, 1] = me, ticks
                    return
            raise RuntimeError(f"cache {self.name} has {_OWNERS} live users; detach some jobs")
        finally:
            self._unlock()

    def close(self) -> None:
        """Detach; the last owner out unlinks the segment (unless keep_warm)."""
        if self._mm is None or os.getpid() != self._pid:
            return
        last = False
        if self._owner:
            self._lock()
            try:
                owners = self._owners()
                me = os.getpid()
                for k in range(_OWNERS):
                    if owners[k, 0] == me:
                        owners[k, 0] = owners[k, 1] = 0
                live = [k for k in range(_OWNERS) if owners[k, 0] and _alive(int(owners[k, 0]), int(owners[k, 1]))]
                self._hdr[LAST_DETACH] = int(time.time() * 1000)
                last = not live and self._hdr[KEEP_WARM] == 0
                if last:
                    try:
                        os.unlink(os.path.join(SHM_DIR, self.name))
                    except OSError:
                        pass
            finally:
                self._unlock()
        self._hdr = self._index = self._arena = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it
        os.close(self._fd)
        if self._lpid == os.getpid() and self._lfd >= 0:
            os.close(self._lfd)
        self._mm = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------ data
    def get(self, i: int):
        """The cached bytes of sample ``i`` (a copy), or None.  Lock-free."""
        e = self._index[i]
        if e[2] != READY:
            self._hdr[MISSES] += 1  # racy counter: statistics only
            return None
        off, length = int(e[0]), int(e[1])
        data = self._arena[off:off + length].tobytes()
        if self.checksum and (zlib.crc32(data) & 0xFFFFFFFF) != int(e[3]):
            raise RuntimeError(f"coordl cache {self.name}: checksum mismatch for sample {i}; "
                               f"clear the cache (coordl cache clear {self.name})")
        self._hdr[HITS] += 1
        return data

    def put(self, i: int, data) -> bool:
        """Admit sample ``i`` if there is room and nobody has (MinIO: never evict)."""
        length = len(data)
        if self._hdr[FULL] or self._index[i, 2] == READY:
            return False
        self._lock()
        try:
            e = self._index[i]
            state = int(e[2])  # read once: a writer may finish (-> READY) meanwhile
            if state == READY or (state < 0 and psutil.pid_exists(-state)):
                return False  # cached, or being written by a live process
            fill = int(self._hdr[FILL])
            if fill + length > self.capacity:
                self._hdr[FULL] = 1
                return False
            self._hdr[FILL] = fill + length
            e[2] = -os.getpid()  # WRITING, by this process
        finally:
            self._unlock()
        self._arena[fill:fill + length] = np.frombuffer(data, dtype=np.uint8)
        e[0], e[1] = fill, length
        e[3] = zlib.crc32(data) & 0xFFFFFFFF if self.checksum else 0
        e[2] = READY  # last store: the entry becomes visible
        self._hdr[ADMITTED] += 1
        return True

    def info(self) -> CacheInfo:
        return _info(self.name, self._hdr, self._index)


def _flock(kind: int) -> bytes:
    # struct flock on Linux: short type, short whence, (pad), off_t start, off_t len, pid_t pid, (pad)
    return struct.pack("hhxxxxqqixxxx", kind, os.SEEK_SET, 0, 8, 0)


_FORK_SAFE = [threading.Lock()]
os.register_at_fork(after_in_child=lambda: _FORK_SAFE.__setitem__(0, threading.Lock()))


def _reattach(name: str, n: int) -> NodeCache:
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, os.fstat(fd).st_size)
    return NodeCache(name, fd, mm, owner=False)


def _info(name, hdr, index) -> CacheInfo:
    owners = hdr[_H:_H + 2 * _OWNERS].reshape(_OWNERS, 2)
    live = tuple(int(p) for p, t in owners if p and _alive(int(p), int(t)))
    return CacheInfo(name=name, capacity=int(hdr[CAPACITY]), filled=int(hdr[FILL]), samples=int(hdr[N]),
                     cached=int((index[:, 2] == READY).sum()), hits=int(hdr[HITS]), misses=int(hdr[MISSES]),
                     owners=live, full=bool(hdr[FULL]))


def _open_readonly(name: str):
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < _HEADER:
            return None, None
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.int64, count=_HEADER // 8)


def _segments():
    """(name, mapping, header) of every initialized coordl cache in /dev/shm."""
    for name in sorted(os.listdir(SHM_DIR)):
        if not _NAME.match(name):
            continue
        try:
            mm, hdr = _open_readonly(name)
        except OSError:
            continue
        if hdr is not None and hdr[MAGIC] == _MAGIC:
            yield name, mm, hdr


def list_caches() -> list[CacheInfo]:
    out = []
    for name, mm, hdr in _segments():
        n = int(hdr[N])
        index = np.frombuffer(mm, dtype=np.int64, count=n * 4, offset=_HEADER).reshape(n, 4)
        out.append(_info(name, hdr, index))
    return out


def clear_caches(name: str | None = None, force: bool = False) -> list[str]:
    """Unlink caches (all, or ``name``); in-use ones only with ``force``.
    Processes attached keep their mapping until they detach."""
    removed = []
    for info in list_caches():
        if name is not None and info.name != name:
            continue
        if info.owners and not force:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, info.name))
            removed.append(info.name)
        except OSError:
            pass
    return removed


def reclaim_stale() -> list[str]:
    """Unlink caches whose owners are all dead and whose keep-warm time is over."""
    removed = []
    now_ms = int(time.time() * 1000)
    for name, _mm, hdr in _segments():
        owners = hdr[_H:_H + 2 * _OWNERS].reshape(_OWNERS, 2)
        if any(p and _alive(int(p), int(t)) for p, t in owners):
            continue
        if int(hdr[LAST_DETACH]) + int(hdr[KEEP_WARM]) > now_ms:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    return removed
