"""The node cache: raw sample bytes in POSIX shared memory, MinIO policy.

One cache per dataset per node, named from the dataset's fingerprint (root,
paths, sizes, mtimes or store versions), so every worker, local rank and job
of one user reading the same files attaches to the same segment, and a
changed dataset never reads stale bytes.

MinIO (CoorDL): admit until full, never evict.  Under per-epoch random order
every reuse interval crosses the epoch boundary, so no policy can hit more
than ``capacity`` bytes per epoch; MinIO gets exactly that, while LRU thrashes.

Where: ``<COORDL_SHM_DIR or /dev/shm>/coordl-<uid>/`` (made 0700 and checked
on every use: a real directory owned by us, no group/other bits), holding
``.lock`` (the directory lock) and one ``cache-<fingerprint>`` file per
dataset; the directory and its lock exist only while a segment does (created ``O_EXCL|O_NOFOLLOW`` 0600, fully reserved with
``posix_fallocate``; an existing one is opened ``O_NOFOLLOW`` and refused
unless it is a regular file of ours with mode 0600).

Segment layout::

    header   (4 KiB)  magic, version, capacity, n, fill, created, keep_warm,
                      orphan_since, counters
    index    n x 4 int64: offset, length, state (0 empty, 1 writing, 2 ready), crc32
    arena    capacity bytes, append-only

Locks (all released by the kernel when their holder dies; see "Node cache"
in docs/architecture.md):

* **Holding** -- every process using a segment has its own open file
  description of it (opened through ``/proc/self/fd``, never by name) with a
  shared ``flock``.  The last one out is whoever can take it exclusively.
  No pid tables, no clocks.
* **Directory lock** -- an exclusive ``flock`` on ``.lock`` serialises
  creating, adopting and unlinking names, and every exclusive attempt on a
  segment, so an attacher can always take its shared lock.  A name is only
  unlinked after checking (under this lock) that it still names the inode
  held by fd.
* **Admission** -- an OFD ``fcntl`` write lock on header bytes 0-7 of the
  process's own description of the segment, held only to reserve arena space
  and mark an entry WRITING.  The writer then holds an OFD lock on the
  entry's 32 index bytes while it copies; an admitter that finds an entry
  WRITING tests that lock: free means the writer died, and the entry may be
  admitted again (its reserved bytes are lost from the budget).
* **Reads are lock-free** -- an entry is visible once its state is READY;
  the writer stores the state after the bytes, offset, length and CRC32 of
  (index, offset, length, bytes).  On x86-64 (TSO) plain stores are seen in
  that order; elsewhere (arm64, POWER: weakly ordered) ``get`` recomputes
  the CRC and treats a mismatch as a miss (see :data:`VALIDATE_READS`).
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import mmap
import os
import platform
import re
import socket
import stat
import struct
import threading
import time
import weakref
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["NodeCache", "CacheInfo", "CacheSecurityError", "list_caches", "clear_caches",
           "reclaim_stale", "shm_root", "user_dir", "shm_free_bytes", "VALIDATE_READS"]

PREFIX = "cache-"
LOCK_NAME = ".lock"
_MAGIC = 0x434F4F52444C4332  # "COORDLC2"
_VERSION = 2
_HEADER = 4096
# header field indices (int64)
(MAGIC, VERSION, CAPACITY, N, FILL, CREATED, KEEP_WARM, ORPHAN_SINCE,
 HITS, MISSES, ADMITTED, FULL, CHECKSUM,
 PEER_IN, PEER_IN_BYTES, PEER_OUT, PEER_OUT_BYTES) = range(17)
EMPTY, WRITING, READY = 0, 1, 2
_ENTRY = 32
_NAME = re.compile(r"^[0-9A-Za-z_.-]{1,200}$")
_LOCK_WAIT = 300.0   # seconds an admission or directory lock may stay busy
_X86 = ("x86_64", "amd64", "i386", "i486", "i586", "i686", "x86")

#: Verify every hit's CRC32 of (index, offset, length, bytes) and treat a
#: mismatch as a miss.  Needed where stores may become visible out of order
#: (every platform but x86); tests set it to exercise the check on x86.
VALIDATE_READS = platform.machine().lower() not in _X86


class CacheSecurityError(PermissionError):
    """An existing cache path is not safely ours (owner, mode, type)."""


def shm_root() -> str:
    """Where per-user cache directories live: ``$COORDL_SHM_DIR`` or /dev/shm."""
    return os.environ.get("COORDL_SHM_DIR") or "/dev/shm"


def user_dir() -> str:
    """This user's cache directory, ``<shm_root>/coordl-<uid>``."""
    return os.path.join(shm_root(), f"coordl-{os.geteuid()}")


def shm_free_bytes() -> int:
    st = os.statvfs(shm_root())
    return st.f_bavail * st.f_frsize


def _now_ms() -> int:
    # CLOCK_BOOTTIME: one clock for every process of the node, never stepped
    # by NTP, and segments do not outlive a reboot anyway.
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * 1000)


def node_id() -> str:
    """This node's identity: ``$COORDL_NODE_ID``, else the host name.  Set it
    to run several "nodes" on one machine (each gets its own caches, daemon
    and peer server, as separate machines would)."""
    return os.environ.get("COORDL_NODE_ID") or socket.gethostname()


def _segment_name(fingerprint: str) -> str:
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint should be a non-empty str, but got fingerprint={fingerprint!r}")
    if _NAME.match(fingerprint) and not fingerprint.startswith("."):
        name = PREFIX + fingerprint
    else:
        name = PREFIX + hashlib.blake2b(fingerprint.encode(), digest_size=16).hexdigest()
    node = os.environ.get("COORDL_NODE_ID")
    if node:   # several "nodes" on one machine: one namespace each ("@" never occurs above)
        clean = re.sub(r"[^0-9A-Za-z_.-]", "_", node)[:40]
        if clean != node:
            clean += "." + hashlib.blake2b(node.encode(), digest_size=4).hexdigest()
        name += "@" + clean
    return name


# --------------------------------------------------------------------------
# Checked opening of the user directory, its lock and segments
# --------------------------------------------------------------------------

def _fix_hint(path: str) -> str:
    return (f"Remove it (rm -rf {path}, as its owner or root) and start again; if another user "
            "created it, they may be trying to make your job read their data")


def _check_stat(st, path: str, kind: str) -> None:
    me = os.geteuid()
    if kind == "dir":
        ok_type = stat.S_ISDIR(st.st_mode)
    else:
        ok_type = stat.S_ISREG(st.st_mode)
    problems = []
    if not ok_type:
        problems.append(f"it is not a {'directory' if kind == 'dir' else 'regular file'}")
    if st.st_uid != me:
        problems.append(f"it is owned by uid {st.st_uid}, not by you (uid {me})")
    if st.st_mode & 0o077:
        problems.append(f"its mode is {stat.S_IMODE(st.st_mode):04o}, open to other users (should be "
                        f"{'0700' if kind == 'dir' else '0600'})")
    if problems:
        raise CacheSecurityError(f"coordl node cache: refusing {path}: {'; '.join(problems)}. "
                                 + _fix_hint(path))


def _open_user_dir(create: bool = True) -> int:
    """An fd of this user's cache directory, checked; FileNotFoundError if it
    does not exist and ``create`` is false."""
    root = shm_root()
    path = user_dir()
    if create:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"coordl node cache: {root} does not exist (set COORDL_SHM_DIR to a "
                                    "tmpfs directory, or unset it to use /dev/shm)")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CacheSecurityError(f"coordl node cache: refusing {path}: it is a symlink or not a "
                                     f"directory. " + _fix_hint(path)) from None
        raise
    try:
        _check_stat(os.fstat(fd), path, "dir")
    except BaseException:
        os.close(fd)
        raise
    return fd


class _NoDir(FileNotFoundError):
    """The user's cache directory does not exist (nothing to act on)."""


class _DirLock:
    """``with _DirLock(create) as dfd``: a checked fd of this user's cache
    directory, holding the exclusive flock on its ``.lock`` (polled, with a
    deadline).

    The directory and its lock file exist only while the directory holds a
    segment: whoever leaves the lock with no segment left unlinks ``.lock``
    and removes the directory, still holding the flock.  So after taking the
    flock a process checks that its ``.lock`` and directory are still the
    ones at those names; if not (removed or re-created meanwhile), it starts
    over on the current ones, and two processes never hold two different
    "directory locks" at once.  ``create=False`` raises :class:`_NoDir` when
    there is no directory.

    Re-entrant within a thread: the loader's finalizer may detach a cache
    from inside a garbage collection that runs while this thread is already
    attaching (and holds the lock); it must not wait for itself.  Other
    threads queue on the process lock first (their flocks would be separate
    descriptions, so they would exclude each other anyway)."""

    def __init__(self, create: bool = True):
        self.create = create
        self.dfd = -1

    def __enter__(self) -> int:
        global _dir_depth, _dir_fd
        _DIR_RLOCK.acquire()
        try:
            for _attempt in range(1000):
                try:
                    dfd = _open_user_dir(self.create)
                except FileNotFoundError:
                    if not self.create:
                        raise _NoDir(user_dir()) from None
                    if not os.path.isdir(shm_root()):
                        raise
                    continue  # made, then removed as empty by another process before we opened it
                if _dir_depth > 0:  # this thread holds the lock already
                    break
                try:
                    fd = _take_dir_lock(dfd)
                except FileNotFoundError:  # the directory was removed under us: start over
                    os.close(dfd)
                    continue
                if _still_current(dfd, fd):
                    _dir_fd = fd
                    break
                os.close(fd)
                os.close(dfd)
            else:
                raise RuntimeError(f"coordl node cache: {user_dir()} keeps being removed and re-created")
            self.dfd = dfd
            _dir_depth += 1
        except BaseException:
            _DIR_RLOCK.release()
            raise
        return dfd

    def __exit__(self, *exc):
        global _dir_depth, _dir_fd
        try:
            _dir_depth -= 1
            if _dir_depth == 0:
                fd, _dir_fd = _dir_fd, -1
                try:
                    _remove_if_empty(self.dfd, fd)
                finally:
                    os.close(fd)  # releases the flock
        finally:
            os.close(self.dfd)
            _DIR_RLOCK.release()


def _take_dir_lock(dfd: int) -> int:
    path = os.path.join(user_dir(), LOCK_NAME)
    fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        _check_stat(os.fstat(fd), path, "file")
        _poll_lock(lambda: _try_flock(fd, fcntl.LOCK_EX), f"the directory lock {path}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _still_current(dfd: int, lock_fd: int) -> bool:
    """Whether the directory held by ``dfd`` is still this user's cache
    directory and ``lock_fd`` still its ``.lock`` (call holding the flock)."""
    try:
        now = os.stat(user_dir(), follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(dfd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino) and _same_inode(dfd, LOCK_NAME, lock_fd)


def _remove_if_empty(dfd: int, lock_fd: int) -> None:
    """Holding the directory lock: with no segment left, unlink ``.lock``
    and remove the directory (if the names still name what we hold), so
    nothing of coordl stays in /dev/shm once no cache exists."""
    if os.listdir(dfd) != [LOCK_NAME] or not _still_current(dfd, lock_fd):
        return
    os.unlink(LOCK_NAME, dir_fd=dfd)
    try:
        os.rmdir(user_dir())
    except OSError:
        pass  # someone put something in meanwhile: it stays, and so does the directory


_DIR_RLOCK = threading.RLock()
_dir_depth = 0
_dir_fd = -1


def _try_flock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _poll_lock(try_once, what: str, timeout: float | None = None) -> None:
    if try_once():
        return
    timeout = _LOCK_WAIT if timeout is None else timeout
    deadline = time.monotonic() + timeout
    delay = 1e-4
    while not try_once():
        if time.monotonic() > deadline:
            raise TimeoutError(f"coordl node cache: {what} has been held by another process for "
                               f"{timeout:g} s; is a job stopped (SIGSTOP, debugger)? Resume or kill it")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def _open_segment(dfd: int, name: str, write: bool = True) -> int:
    """Open an existing segment without following symlinks; refuse it unless
    it is a regular file of ours with no group/other bits."""
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(name, flags, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            path = os.path.join(user_dir(), name)
            raise CacheSecurityError(f"coordl node cache: refusing {path}: it is a symlink. "
                                     + _fix_hint(path)) from None
        raise
    try:
        _check_stat(os.fstat(fd), os.path.join(user_dir(), name), "file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reopen(fd: int, flags: int = os.O_RDWR) -> int:
    """A new open file description of the inode ``fd`` refers to (never by name)."""
    return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)


def _idle(fd: int) -> bool:
    """True if nobody holds the segment (call under the directory lock)."""
    t = _reopen(fd, os.O_RDONLY)
    try:
        return _try_flock(t, fcntl.LOCK_EX)
    finally:
        os.close(t)


def _same_inode(dfd: int, name: str, fd: int) -> bool:
    try:
        a = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    b = os.fstat(fd)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _unlink_if_same(dfd: int, name: str, fd: int) -> bool:
    """Unlink ``name`` if it still names the inode held by ``fd`` (call
    under the directory lock)."""
    if not _same_inode(dfd, name, fd):
        return False
    os.unlink(name, dir_fd=dfd)
    return True


def _header(mm) -> np.ndarray:
    return np.frombuffer(mm, dtype=np.int64, count=_HEADER // 8)


def _map_checked(fd: int, path: str, write: bool = True):
    """(mapping, header) of an initialised segment, or (None, None)."""
    size = os.fstat(fd).st_size
    if size < _HEADER:
        return None, None
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
    mm = mmap.mmap(fd, size, prot=prot)
    hdr = _header(mm)
    if int(hdr[MAGIC]) != _MAGIC or int(hdr[VERSION]) != _VERSION:
        return mm, None
    n, cap = int(hdr[N]), int(hdr[CAPACITY])
    if n < 0 or cap < 0 or _HEADER + n * _ENTRY + cap != size:
        return mm, None
    return mm, hdr


# --------------------------------------------------------------------------
# Lock helpers (OFD byte-range locks)
# --------------------------------------------------------------------------

def _flock_struct(kind: int, start: int, length: int) -> bytes:
    # struct flock on Linux: short type, short whence, (pad), off_t start, off_t len, pid_t pid, (pad)
    return struct.pack("hhxxxxqqixxxx", kind, os.SEEK_SET, start, length, 0)


def _setlk(fd: int, kind: int, start: int, length: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock_struct(kind, start, length))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def _locked_by_other(fd: int, start: int, length: int) -> bool:
    r = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock_struct(fcntl.F_WRLCK, start, length))
    return struct.unpack_from("h", r)[0] != fcntl.F_UNLCK


def _entry_crc(i: int, off: int, length: int, data) -> int:
    return zlib.crc32(data, zlib.crc32(struct.pack("<qqq", i, off, length))) & 0xFFFFFFFF


# --------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------

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
    holders: int     # processes holding it, as the kernel counts them (-1: unknown)
    in_use: bool
    full: bool
    peer_in: int = 0          # samples this node got from peers
    peer_in_bytes: int = 0
    peer_out: int = 0         # samples this node served to peers
    peer_out_bytes: int = 0


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
        e = self._index[i]
        hdr = self._hdr if count else _NOCOUNT
        if e[2] != READY:
            hdr[MISSES] += 1  # racy counter: statistics only
            return None
        off, length, crc = int(e[0]), int(e[1]), int(e[3])
        if off < 0 or length < 0 or off + length > self.capacity:
            hdr[MISSES] += 1
            return None
        data = self._arena[off:off + length].tobytes()
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
    global _FORK_LOCK, _DIR_RLOCK, _dir_depth, _dir_fd
    _FORK_LOCK = threading.RLock()
    _DIR_RLOCK = threading.RLock()
    if _dir_fd >= 0:  # the parent's description: its flock stays the parent's
        try:
            os.close(_dir_fd)
        except OSError:
            pass
    _dir_depth, _dir_fd = 0, -1
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


_MEMORY_FS = ("tmpfs", "ramfs", "hugetlbfs")


def _mount_of(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) of the filesystem holding ``path``,
    from /proc/self/mountinfo; ("", "") where that cannot be read."""
    target = os.path.realpath(path)
    best = ("", "")
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        left, sep, right = line.partition(" - ")
        parts = left.split()
        if not sep or len(parts) < 5 or not right:
            continue
        mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best[0]):  # the last of equal mount points is the one on top
            best = (mnt, right.split()[0])
    return best


def _room_advice(root: str) -> str:
    """How to make room in ``root``, for what it is: a tmpfs (/dev/shm, or
    another memory filesystem: remount it bigger) or a folder on a disk
    filesystem (no remount: its space is the disk's, and a cache there is
    not in memory)."""
    mnt, fstype = _mount_of(root)
    if fstype in _MEMORY_FS:
        docker = "; in Docker: --shm-size" if mnt == "/dev/shm" else ""
        return (f"free space in {root} (coordl cache clear), or enlarge the {fstype} mounted at {mnt} "
                f"(mount -o remount,size=<bytes> {mnt}{docker})")
    what = f"a folder on {fstype} (mounted at {mnt})" if fstype else "not on a filesystem known here"
    return (f"free space in {root} (coordl cache clear), or set COORDL_SHM_DIR to a directory on a "
            f"tmpfs (or unset it to use /dev/shm): {root} is {what}, not a memory filesystem, so its "
            "free space is the disk's and a node cache there is not held in memory")


def _create(dfd: int, name: str, n: int, capacity: int, total: int, checksum: bool):
    def no_room():
        free = shm_free_bytes()
        return MemoryError(
            f"coordl node cache: cache_size={capacity} bytes (plus {total - capacity} bytes of index) "
            f"does not fit in {shm_root()}: {free} bytes free. Pass a smaller cache_size (e.g. "
            f"cache_size=\"{max(0, free - _HEADER - n * _ENTRY) // 2 // 2**20}MiB\"), "
            f"{_room_advice(shm_root())}")

    if total > shm_free_bytes():
        raise no_room()  # cheap early answer; the reservation below is the real check
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        os.fchmod(fd, 0o600)
        try:
            # a reservation (ftruncate alone is sparse): two jobs racing for the
            # last free memory get a clean error here, never SIGBUS while filling
            os.posix_fallocate(fd, 0, total)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                raise
            os.ftruncate(fd, 0)
            raise no_room() from None
        mm = mmap.mmap(fd, total)
        hdr = _header(mm)
        hdr[VERSION], hdr[CAPACITY], hdr[N] = _VERSION, capacity, n
        hdr[CREATED] = _now_ms()
        hdr[CHECKSUM] = int(checksum)
        hdr[MAGIC] = _MAGIC  # last (we hold the directory lock, so nobody looks before)
        del hdr
        return fd, mm
    except BaseException:
        try:
            _unlink_if_same(dfd, name, fd)
        finally:
            os.close(fd)
        raise


def _sweep(dfd: int, keep: str | None = None, *, everything: bool = False, force: bool = False,
           only: str | None = None) -> list[str]:
    """Under the directory lock: remove idle segments whose keep-warm time
    (counted from when they were first seen idle) is over.  ``everything``
    ignores keep-warm, ``force`` also removes held ones, ``only`` restricts
    to one name.  Returns the names removed."""
    removed = []
    now = _now_ms()
    for name in sorted(os.listdir(dfd)):
        if not name.startswith(PREFIX) or name == keep or (only is not None and name != only):
            continue
        try:
            fd = _open_segment(dfd, name)
        except (OSError, CacheSecurityError):
            continue  # not ours to judge; attach of that name refuses it loudly
        try:
            idle = _idle(fd)
            if not idle and not force:
                continue
            if idle and not everything:
                mm, hdr = _map_checked(fd, name)
                if hdr is not None:
                    since = int(hdr[ORPHAN_SINCE])
                    if since == 0:  # first seen ownerless (its holders were killed)
                        hdr[ORPHAN_SINCE] = since = now
                    keep_ms = int(hdr[KEEP_WARM])
                    del hdr
                    mm.close()
                    if now - since < keep_ms:
                        continue
                elif mm is not None:
                    mm.close()
            if _unlink_if_same(dfd, name, fd):
                removed.append(name)
        finally:
            os.close(fd)
    return removed


def _flock_holders() -> dict[tuple[int, int, int], int]:
    """(major, minor, inode) -> number of flock holders, from /proc/locks
    (holders in other pid namespaces may be missing)."""
    out: dict[tuple[int, int, int], int] = {}
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if "->" in parts:
                    continue  # a waiter
                if len(parts) < 6 or parts[1] != "FLOCK":
                    continue
                try:
                    ma, mi, ino = parts[5].split(":")
                    key = (int(ma, 16), int(mi, 16), int(ino))
                except ValueError:
                    continue
                out[key] = out.get(key, 0) + 1
    except OSError:
        pass
    return out


def _info(name, hdr, index, fd, holders) -> CacheInfo:
    st = os.fstat(fd)
    if holders is None:
        holders = _flock_holders()
    count = holders.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino), 0)
    return CacheInfo(name=name, capacity=int(hdr[CAPACITY]), filled=int(hdr[FILL]), samples=int(hdr[N]),
                     cached=int((index[:, 2] == READY).sum()), hits=int(hdr[HITS]), misses=int(hdr[MISSES]),
                     holders=count, in_use=count > 0, full=bool(hdr[FULL]),
                     peer_in=int(hdr[PEER_IN]), peer_in_bytes=int(hdr[PEER_IN_BYTES]),
                     peer_out=int(hdr[PEER_OUT]), peer_out_bytes=int(hdr[PEER_OUT_BYTES]))


def list_caches() -> list[CacheInfo]:
    """This user's caches."""
    out = []
    try:
        with _DirLock(create=False) as dfd:
            holders = _flock_holders()
            for name in sorted(os.listdir(dfd)):
                if not name.startswith(PREFIX):
                    continue
                try:
                    fd = _open_segment(dfd, name, write=False)
                except (OSError, CacheSecurityError):
                    continue
                try:
                    mm, hdr = _map_checked(fd, name, write=False)
                    if hdr is None:
                        if mm is not None:
                            mm.close()
                        continue
                    n = int(hdr[N])
                    index = np.frombuffer(mm, dtype=np.int64, count=n * 4, offset=_HEADER).reshape(n, 4)
                    info = _info(name, hdr, index, fd, holders)
                    if not info.in_use and not _idle(fd):  # holders outside our pid namespace
                        info = CacheInfo(**{**info.__dict__, "holders": -1, "in_use": True})
                    out.append(info)
                    del hdr, index
                    mm.close()
                finally:
                    os.close(fd)
    except _NoDir:
        return []
    return out


def clear_caches(name: str | None = None, force: bool = False) -> list[str]:
    """Unlink this user's idle caches (all, or ``name``), keep-warm or not;
    in-use ones too with ``force`` (their holders keep their mapping and
    keep reading and writing that same memory until they detach)."""
    return _locked_sweep(everything=True, force=force, only=name)


def reclaim_stale() -> list[str]:
    """Unlink this user's idle caches whose keep-warm time is over (what
    every attach does for the other datasets' caches)."""
    return _locked_sweep()


def _locked_sweep(**how) -> list[str]:
    try:
        with _DirLock(create=False) as dfd:
            return _sweep(dfd, **how)
    except _NoDir:
        return []
