"""The node cache: raw sample bytes in POSIX shared memory, MinIO policy.

One cache per dataset per node, named from the dataset's fingerprint (root,
paths, sizes, mtimes or store versions), so every worker, local rank and job
of one user reading the same files attaches to the same segment, and a
changed dataset never reads stale bytes.

MinIO (CoorDL): admit until full, never evict.  Under per-epoch random order
every reuse interval crosses the epoch boundary, so no policy can hit more
than ``capacity`` bytes per epoch; MinIO gets exactly that, while LRU thrashes.

Holding -- every process using a segment has its own open file
description of it (opened through ``/proc/self/fd``, never by name) with a
shared ``flock``.  The last one out is whoever can take it exclusively.
No pid tables, no clocks.  The directory, its lock and the segment file
format are in :mod:`.directory` and :mod:`.segment`; the sweep of stale
segments in :mod:`.sweep`.
"""
from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import platform
import threading
import weakref

import numpy as np

from .directory import (
    _DirLock, _NoDir, _poll_lock, _same_inode, _try_flock, _unlink_if_same, CacheSecurityError, user_dir,
)
from .segment import (
    _create, _ENTRY, _entry_crc, _header, _HEADER, _idle, _locked_by_other, _map_checked, _now_ms,
    _open_segment, _reopen, _segment_name, _setlk, _VERSION, ADMITTED, CacheInfo, CAPACITY, CHECKSUM,
    FILL, FULL, HITS, KEEP_WARM, MISSES, N, ORPHAN_SINCE, PEER_IN, PEER_IN_BYTES, PEER_OUT,
    PEER_OUT_BYTES, READY, WRITING,
)
from .sweep import _info, _sweep


__all__ = ["NodeCache", "mark_orphaned", "VALIDATE_READS"]

_X86 = ("x86_64", "amd64", "i386", "i486", "i586", "i686", "x86")

#: Verify every hit's CRC32 of (index, offset, length, bytes) and treat a
#: mismatch as a miss.  Needed where stores may become visible out of order
#: (every platform but x86); tests set it to exercise the check on x86.
VALIDATE_READS = platform.machine().lower() not in _X86


_LIVE: "weakref.WeakSet[NodeCache]" = weakref.WeakSet()
_NOCOUNT = np.zeros(32, dtype=np.int64)   # where uncounted lookups count


class NodeCache:
    """A MinIO cache of raw sample bytes shared by every process on the node.

    ``NodeCache.attach(fingerprint, n, capacity)`` creates the segment or
    attaches to the existing one (whose capacity then wins).  The object
    works in forked children (each takes its own hold on first use) and
    pickles by passing the segment's file descriptor (spawn/forkserver
    workers), never by name.
    """

    def __init__(self, name: str, fd: int, mm: mmap.mmap, *, checksum: bool, keep_warm: float) -> None:
        self.name = name
        self._fd = fd
        st = os.fstat(fd)
        self._dev, self._ino = st.st_dev, st.st_ino
        self._mm = mm
        self._keep_warm = float(keep_warm)
        hdr = _header(mm)
        self._hdr = hdr
        self.capacity = int(hdr[CAPACITY])
        self.n = int(hdr[N])
        self._index = np.frombuffer(mm, dtype=np.int64, count=self.n * 4, offset=_HEADER).reshape(self.n, 4)
        self._arena_off = _HEADER + self.n * _ENTRY
        self._arena = np.frombuffer(mm, dtype=np.uint8, count=self.capacity, offset=self._arena_off)
        self.checksum = bool(checksum) or bool(hdr[CHECKSUM])
        # per-process hold: own description with a shared flock, admission locks
        self._hpid = None
        self._pfd = -1
        self._tlock = threading.Lock()
        self._writing: set[int] = set()
        self._closed = False
        _LIVE.add(self)

    # ------------------------------------------------------------ lifecycle
    @classmethod
    def attach(cls, fingerprint: str, n: int, capacity: int, *, checksum: bool = False,
               keep_warm: float = 0.0) -> "NodeCache":
        """Create this dataset's segment, or adopt the existing one (held by
        others, or left ownerless by a crash: torn entries are never READY).
        Removes idle segments of other datasets whose keep-warm time is over."""
        name = _segment_name(fingerprint)
        total = _HEADER + n * _ENTRY + capacity
        from .signals import install_sigterm_exit
        install_sigterm_exit()
        with _DirLock() as dfd:
            _sweep(dfd, keep=name)
            for _attempt in range(3):
                fd, mm = _adopt(dfd, name, n)
                if fd is None:
                    fd, mm = _create(dfd, name, n, capacity, total, checksum)
                try:
                    cache = cls(name, fd, mm, checksum=checksum, keep_warm=keep_warm)
                except BaseException:
                    os.close(fd)
                    raise
                try:
                    cache._hold()
                except BaseException:
                    cache.close()
                    raise
                if _same_inode(dfd, name, fd):
                    break
                # A garbage collection during this attach ran a finalizer
                # that detached the segment's last other holder in this
                # process, and it removed the name: start over.
                cache.close()
            else:
                raise RuntimeError(f"coordl node cache {os.path.join(user_dir(), name)} keeps "
                                   "disappearing while attaching; is something removing it?")
            # the longest keep-warm any user asked for sticks to the segment
            cache._hdr[KEEP_WARM] = max(int(cache._hdr[KEEP_WARM]), int(keep_warm * 1000))
            cache._hdr[ORPHAN_SINCE] = 0
        return cache

    @classmethod
    def from_spec(cls, spec: dict) -> "NodeCache":
        """Attach by the description another process of this user sent
        (``DataLoader._cache_spec``: fingerprint, n, capacity, checksum,
        keep_warm), as the node daemon and its workers do."""
        return cls.attach(str(spec["fingerprint"]), int(spec["n"]), int(spec["capacity"]),
                          checksum=bool(spec.get("checksum")), keep_warm=float(spec.get("keep_warm", 0)))

    def _hold(self) -> None:
        """Take this process's hold: a new description of the segment with a
        shared flock (attachers take it under the directory lock, so it
        cannot meet an exclusive one; forked children take theirs while the
        parent's hold keeps every exclusive attempt out)."""
        pfd = _reopen(self._fd)
        try:
            _poll_lock(lambda: _try_flock(pfd, fcntl.LOCK_SH), f"cache segment {self.path}")
        except BaseException:
            os.close(pfd)
            raise
        self._pfd = pfd
        self._hpid = os.getpid()
        if self._in_worker_process():
            # worker processes leave through os._exit: multiprocessing's exit
            # hook is where they can detach (and unlink, if they are last)
            from multiprocessing import util
            util.Finalize(None, self.detach, exitpriority=0)

    @staticmethod
    def _in_worker_process() -> bool:
        import multiprocessing
        return multiprocessing.parent_process() is not None

    def _ensure_held(self) -> None:
        if self._hpid != os.getpid():
            with _FORK_LOCK:
                if self._hpid != os.getpid():
                    if self._closed:
                        raise ValueError(f"coordl node cache {self.name} is closed")
                    self._hold()

    def _after_fork_in_child(self) -> None:
        # The parent's description carries its flock and OFD locks; keeping it
        # open here would keep the parent's locks alive after the parent died.
        if self._pfd >= 0:
            try:
                os.close(self._pfd)
            except OSError:
                pass
        self._pfd = -1
        self._hpid = None
        self._tlock = threading.Lock()
        self._writing = set()

    @property
    def path(self) -> str:
        return os.path.join(user_dir(), self.name)

    def __reduce__(self):
        from multiprocessing.reduction import DupFd
        return (_from_fd, (DupFd(self._fd), self.name, self._dev, self._ino, self.checksum, self._keep_warm))

    def detach(self) -> None:
        """Give up this process's hold (the mapping stays until :meth:`close`).
        Whoever can then take the segment's flock exclusively was the last
        holder: it unlinks the name (if it still names this segment), or with
        ``keep_warm`` leaves it for that long."""
        with _FORK_LOCK:
            if self._hpid != os.getpid() or self._pfd < 0:
                return
            try:
                self._leave()
            finally:
                os.close(self._pfd)
                self._pfd = -1
                self._hpid = None

    def close(self) -> None:
        """Detach this process and unmap the segment (once, whichever thread
        calls first: the reaper, or the exit hook)."""
        with _FORK_LOCK:
            if self._closed:
                return
            self._closed = True
            self.detach()
            _LIVE.discard(self)
            self._hdr = self._index = self._arena = None
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with it
            os.close(self._fd)

    def _leave(self) -> None:
        if _ORPHANED[0]:
            return  # our main process died: leave the segment as it left it (adoptable)
        try:
            with _DirLock(create=False) as dfd:
                # a failed SH->EX upgrade drops our shared lock: fine, we are leaving
                if not _try_flock(self._pfd, fcntl.LOCK_EX):
                    return
                if int(self._hdr[KEEP_WARM]) > 0:
                    self._hdr[ORPHAN_SINCE] = _now_ms()
                else:
                    _unlink_if_same(dfd, self.name, self._pfd)
                fcntl.flock(self._pfd, fcntl.LOCK_UN)  # before the directory lock goes
        except (_NoDir, CacheSecurityError):
            return  # the directory is gone or not ours any more: nothing to unlink

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------ data
    def get(self, i: int, count: bool = True, verify: bool = False):
        """The cached bytes of sample ``i`` (a copy), or None.  Lock-free.
        ``count=False``: not a hit or miss of this node (a peer's request).
        ``verify=True``: check the entry's CRC32 whatever ``checksum`` says
        (what a peer server sends must not spread a corrupt entry)."""
        return self._copy(i, None, count, verify)

    def get_into(self, i: int, out: np.ndarray) -> bool:
        """:meth:`get` into ``out`` (a uint8 array of the entry's length,
        e.g. a batch's slot): one copy, not two.  False (``out`` unspecified)
        when ``get`` would return None or the entry has another length."""
        return self._copy(i, out, True, False) is not None

    def _copy(self, i: int, out, count: bool, verify: bool):
        e = self._index[i]
        hdr = self._hdr if count else _NOCOUNT
        if e[2] != READY:
            hdr[MISSES] += 1  # racy counter: statistics only
            return None
        off, length, crc = int(e[0]), int(e[1]), int(e[3])
        if off < 0 or length < 0 or off + length > self.capacity or (out is not None and out.size != length):
            hdr[MISSES] += 1
            return None
        if out is None:
            data = self._arena[off:off + length].tobytes()
        else:
            out[:] = self._arena[off:off + length]
            data = out
        if (VALIDATE_READS or self.checksum or verify) and _entry_crc(i, off, length, data) != crc:
            if self.checksum and not verify:
                self._check_corrupt(i)
            hdr[MISSES] += 1
            return None  # published out of order (weak memory order): a miss
        hdr[HITS] += 1
        return data

    def held(self) -> np.ndarray:
        """``held()[i]``: sample ``i`` is in the cache (a snapshot; bool array
        of ``n``), what a peer server tells other nodes at each epoch start."""
        return self._index[:, 2] == READY

    @property
    def admitted(self) -> int:
        """Entries admitted so far (grows only: a changed value means more held)."""
        return int(self._hdr[ADMITTED])

    @property
    def free_bytes(self) -> int:
        """Arena bytes not yet reserved (0 once full)."""
        return 0 if self._hdr[FULL] else max(0, self.capacity - int(self._hdr[FILL]))

    def note_peer_in(self, nbytes: int) -> None:
        """A sample of ``nbytes`` came to this node from a peer (racy counter)."""
        self._hdr[PEER_IN] += 1
        self._hdr[PEER_IN_BYTES] += nbytes

    def note_peer_out(self, nbytes: int) -> None:
        """This node served a sample of ``nbytes`` to a peer (racy counter)."""
        self._hdr[PEER_OUT] += 1
        self._hdr[PEER_OUT_BYTES] += nbytes

    def _check_corrupt(self, i: int) -> None:
        os.sched_yield()  # a syscall: any store still in flight is visible now
        e = self._index[i]
        off, length, crc = int(e[0]), int(e[1]), int(e[3])
        if 0 <= off and 0 <= length and off + length <= self.capacity:
            if _entry_crc(i, off, length, self._arena[off:off + length].tobytes()) == crc:
                return
        raise RuntimeError(f"coordl node cache {self.path}: checksum mismatch for sample {i}; "
                           f"clear the cache (coordl cache clear --force {self.name})")

    def put(self, i: int, data) -> bool:
        """Admit sample ``i`` if there is room and nobody has (MinIO: never evict)."""
        length = len(data)
        if self._hdr[FULL] or self._index[i, 2] == READY:
            return False
        self._ensure_held()
        pfd = self._pfd
        ent = _HEADER + i * _ENTRY
        e = self._index[i]
        with self._tlock:  # threads share this process's description (and its locks)
            _poll_lock(lambda: _setlk(pfd, fcntl.F_WRLCK, 0, 8), f"the admission lock of {self.path}")
            try:
                state = int(e[2])
                if state == READY:
                    return False
                if state == WRITING:
                    if i in self._writing or _locked_by_other(pfd, ent, _ENTRY):
                        return False  # being written by a live thread or process
                    # Lock free: the writer died, or it finished (it stores
                    # READY before it unlocks) since we read the state.
                    if int(e[2]) == READY:
                        return False
                fill = int(self._hdr[FILL])
                if fill + length > self.capacity:
                    self._hdr[FULL] = 1
                    return False
                if not _setlk(pfd, fcntl.F_WRLCK, ent, _ENTRY):
                    return False  # a writer took it between our test and now: cannot happen under the lock
                self._hdr[FILL] = fill + length
                e[2] = WRITING
                self._writing.add(i)
            finally:
                _setlk(pfd, fcntl.F_UNLCK, 0, 8)
        try:
            self._arena[fill:fill + length] = np.frombuffer(data, dtype=np.uint8)
            e[0], e[1] = fill, length
            e[3] = _entry_crc(i, fill, length, data)
            e[2] = READY  # last store: the entry becomes visible
            self._hdr[ADMITTED] += 1
        finally:
            with self._tlock:
                self._writing.discard(i)
                _setlk(pfd, fcntl.F_UNLCK, ent, _ENTRY)
        return True

    def info(self) -> CacheInfo:
        return _info(self.name, self._hdr, self._index, self._fd, None)


# Re-entrant for the same reason as _DirLock: a finalizer run by a garbage
# collection inside _ensure_held may detach another cache.
_FORK_LOCK = threading.RLock()
_ORPHANED = [False]


def mark_orphaned() -> None:
    """This process is a worker whose main process died (SIGKILL, OOM).  Its
    holds are then dropped without the last-out step: a segment the main
    process left behind stays for a restarting job to adopt (or for the
    keep-warm sweep), exactly as if the workers had died with it."""
    _ORPHANED[0] = True


def _after_fork_in_child() -> None:
    global _FORK_LOCK
    _FORK_LOCK = threading.RLock()
    for c in list(_LIVE):
        c._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_all() -> None:
    from ..base import reaper as _reaper
    _reaper.flush(30.0)  # clean-ups enqueued before exit (pool stops, detaches) go first
    for c in list(_LIVE):
        try:
            c.close()
        except Exception:
            pass


def _from_fd(dupfd, name: str, dev: int, ino: int, checksum: bool, keep_warm: float) -> NodeCache:
    fd = dupfd.detach()
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (dev, ino):
            raise RuntimeError(f"coordl node cache {name}: the descriptor passed to this process is "
                               f"not the segment it was sent as")
        mm, hdr = _map_checked(fd, name)
        if hdr is None:
            raise RuntimeError(f"coordl node cache {name}: the segment passed to this process is not initialised")
        del hdr
        cache = NodeCache(name, fd, mm, checksum=checksum, keep_warm=keep_warm)
    except BaseException:
        os.close(fd)
        raise
    cache._ensure_held()
    return cache


def _adopt(dfd: int, name: str, n: int):
    """(fd, mapping) of this dataset's existing segment, or (None, None) if
    there is none (an uninitialised one left by a crashed creator is removed)."""
    try:
        fd = _open_segment(dfd, name)
    except FileNotFoundError:
        return None, None
    try:
        mm, hdr = _map_checked(fd, os.path.join(user_dir(), name))
        if hdr is None:
            if mm is not None:
                mm.close()
            if not _idle(fd):
                raise RuntimeError(f"coordl node cache {os.path.join(user_dir(), name)} is in use but not a "
                                   f"coordl {_VERSION} segment (another coordl version?); stop the jobs using "
                                   f"it or remove it (coordl cache clear --force {name})")
            _unlink_if_same(dfd, name, fd)
            os.close(fd)
            return None, None
        if int(hdr[N]) != n:
            have = int(hdr[N])
            del hdr
            mm.close()
            raise RuntimeError(f"coordl node cache {os.path.join(user_dir(), name)} holds {have} samples, but "
                               f"the dataset has {n}: a fingerprint collision; remove it "
                               f"(coordl cache clear --force {name})")
        del hdr
        return fd, mm
    except BaseException:
        os.close(fd)
        raise
