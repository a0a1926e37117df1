"""This user's cache directory and its lock.

Where: ``<COORDL_SHM_DIR or /dev/shm>/coordl-<uid>/`` (made 0700 and checked
on every use: a real directory owned by us, no group/other bits), holding
``.lock`` (the directory lock) and one ``cache-<fingerprint>`` file per
dataset; the directory and its lock exist only while a segment does.

**Directory lock** -- an exclusive ``flock`` on ``.lock`` serialises
creating, adopting and unlinking names, and every exclusive attempt on a
segment, so an attacher can always take its shared lock.  A name is only
unlinked after checking (under this lock) that it still names the inode
held by fd.  See "Node cache" in docs/architecture.md.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import threading
import time


__all__ = ["CacheSecurityError", "shm_root", "user_dir", "shm_free_bytes", "node_id", "LOCK_NAME"]
LOCK_NAME = ".lock"
_LOCK_WAIT = 300.0   # seconds an admission or directory lock may stay busy


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


def node_id() -> str:
    """This node's identity: ``$COORDL_NODE_ID``, else the host name.  Set it
    to run several "nodes" on one machine (each gets its own caches, daemon
    and peer server, as separate machines would)."""
    return os.environ.get("COORDL_NODE_ID") or socket.gethostname()


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
                _unlock_and_close(fd)
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
                    _unlock_and_close(fd)
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


def _unlock_and_close(fd: int) -> None:
    """Release a flock, then close its descriptor.  Closing alone releases
    it only once every descriptor of its open file description is closed:
    a child forked by another thread while this one held the lock (before
    the fork hook could know the descriptor) would keep it for as long as
    it lives, and every other process would wait on it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


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


def _after_fork_in_child() -> None:
    # the parent's lock state is not the child's
    global _DIR_RLOCK, _dir_depth, _dir_fd
    _DIR_RLOCK = threading.RLock()
    if _dir_fd >= 0:  # the parent's description: its flock stays the parent's
        try:
            os.close(_dir_fd)
        except OSError:
            pass
    _dir_depth, _dir_fd = 0, -1


os.register_at_fork(after_in_child=_after_fork_in_child)
