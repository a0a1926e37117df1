"""The segment file: its layout, checked opening and mapping, the admission
locks on its bytes, and creating one.

A segment is created ``O_EXCL|O_NOFOLLOW`` 0600, fully reserved with
``posix_fallocate``; an existing one is opened ``O_NOFOLLOW`` and refused
unless it is a regular file of ours with mode 0600.

Segment layout::

    header   (4 KiB)  magic, version, capacity, n, fill, created, keep_warm,
                      orphan_since, counters
    index    n x 4 int64: offset, length, state (0 empty, 1 writing, 2 ready), crc32
    arena    capacity bytes, append-only

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
  the CRC and treats a mismatch as a miss (see :data:`coordl.cache.node.VALIDATE_READS`).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import re
import struct
import time
import zlib
from dataclasses import dataclass

import numpy as np

from .directory import (
    _check_stat, _fix_hint, _try_flock, _unlock_and_close, _unlink_if_same, CacheSecurityError, shm_free_bytes,
    shm_root,
    user_dir,
)


__all__ = ["CacheInfo", "PREFIX", "READY", "FILL"]
PREFIX = "cache-"
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


def _now_ms() -> int:
    # CLOCK_BOOTTIME: one clock for every process of the node, never stepped
    # by NTP, and segments do not outlive a reboot anyway.
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * 1000)


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
# Segments: checked opening, mapping, admission locks
# --------------------------------------------------------------------------

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
        _unlock_and_close(t)   # never left held by a child forked meanwhile


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

