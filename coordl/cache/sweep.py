"""Finding and removing this user's caches: the keep-warm sweep of idle
segments (run by every attach, by ``coordl cache clear`` and
:func:`reclaim_stale`), and :func:`list_caches` for ``coordl cache ls``.

A segment is idle when no process holds its shared ``flock``; an idle one
is removed once its keep-warm time, counted from when it was first seen
idle, is over (``clear``: at once).  Names are unlinked under the directory
lock, and only while they still name the inode opened.
"""
from __future__ import annotations

import os

import numpy as np

from .directory import _DirLock, _NoDir, _unlink_if_same, CacheSecurityError
from .segment import (
    _HEADER, _idle, _map_checked, _now_ms, _open_segment, CacheInfo, CAPACITY, FILL, FULL, HITS,
    KEEP_WARM, MISSES, N, ORPHAN_SINCE, PEER_IN, PEER_IN_BYTES, PEER_OUT, PEER_OUT_BYTES, PREFIX, READY,
)


__all__ = ["list_caches", "clear_caches", "reclaim_stale"]

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
