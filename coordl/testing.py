"""Helpers for coordl's own test suite (and for users testing code built on it).

Two concerns live here:

* :func:`run_in_child` runs a snippet of Python in a fresh interpreter, in its
  own process group, under a hard timeout.  Tests of multiprocess behaviour and
  of crashes go through it, so a hang or a runaway worker can never hang or
  poison the test runner: on timeout the whole group is SIGKILLed and the test
  fails with whatever the child had printed so far.  After
  :func:`start_warm_children` (the test suite starts it once per test
  process) the child is forked from a template that has torch imported,
  which saves each child seconds of imports; it still runs the snippet as
  ``python -c`` would (see :class:`WarmChildren`).

* :func:`live_children`, :func:`shm_entries` and :func:`wait_no_leaks` detect
  worker processes and ``/dev/shm`` entries that outlive the code that created
  them.  ``tests/conftest.py`` wraps them in an autouse fixture.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Iterable, Mapping

import psutil

__all__ = [
    "settle",
    "run_in_child",
    "live_children",
    "shm_entries",
    "wait_no_leaks",
    "kill_processes",
    "describe_processes",
    "INFRASTRUCTURE_MARKERS",
    "SHM_DIR",
    "stop_daemon",
    "start_warm_children",
    "stop_warm_children",
    "WarmChildren",
    "popen",
]

SHM_DIR = "/dev/shm"

# Long-lived helper processes that Python/torch start once per parent process
# and keep for the parent's lifetime by design.  They are not leaks.
INFRASTRUCTURE_MARKERS: tuple[str, ...] = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
    "torch_shm_manager",
)

# The directory that holds the ``coordl`` package, so a child interpreter
# imports the very same coordl as the parent, wherever it was started from.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------
# Running code in a child interpreter
# --------------------------------------------------------------------------

def _child_env(env: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(os.environ if env is None else env)
    parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _PACKAGE_ROOT not in parts:
        parts.insert(0, _PACKAGE_ROOT)
    out["PYTHONPATH"] = os.pathsep.join(parts)
    return out


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                members.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return members


def _kill_group(pgid: int, extra: Iterable[psutil.Process] = ()) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    # Descendants that moved to a group or session of their own escape killpg.
    for p in extra:
        try:
            p.kill()
        except psutil.Error:
            pass


def _as_text(data) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", "replace")
    return data


def run_in_child(
    code: str, timeout: float = 60, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -c code`` in a new process group, with a hard timeout.

    ``sys.executable`` runs the code with stdout and stderr captured as text.
    ``env`` (default: this process' environment) gets the directory holding
    the ``coordl`` package prepended to ``PYTHONPATH``.

    Returns the :class:`subprocess.CompletedProcess` once the child has exited
    and closed its output.  Processes the child left running in its process
    group are killed; their pids are recorded on the result as
    ``result.stragglers`` (a list, normally empty).

    If the child (or a descendant keeping its output open) is still running
    after ``timeout`` seconds, the whole process group and every descendant are
    SIGKILLed and :class:`AssertionError` is raised with the output so far.
    """
    args = [sys.executable, "-c", code]
    proc = popen(   # forked from the warm-child template where one runs
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=_child_env(env),
        start_new_session=True,  # new session => new process group, pgid == pid
    )
    pgid = proc.pid
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        partial_out, partial_err = _as_text(exc.stdout), _as_text(exc.stderr)
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        child_rc = proc.poll()
        tree_desc = describe_processes(tree)
        _kill_group(pgid, tree)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired as exc2:
            # Something outside the group still holds the pipes; give up on
            # them and report what we have.
            out = _as_text(exc2.stdout) or partial_out
            err = _as_text(exc2.stderr) or partial_err
            proc.kill()
            for stream in (proc.stdout, proc.stderr):
                try:
                    stream.close()
                except Exception:
                    pass
            proc.wait(timeout=10)
        state = (
            "was still running"
            if child_rc is None
            else f"had exited with code {child_rc} but its output was held open "
            "by descendants"
        )
        raise AssertionError(
            f"child process timed out after {timeout} s ({state}); the process "
            f"group was killed.\nprocess tree at timeout:\n{tree_desc or '  (none)'}"
            f"\n--- child stdout so far ---\n{out}\n--- child stderr so far ---\n{err}"
        ) from None
    except BaseException:
        _kill_group(pgid)
        proc.wait()
        raise

    stragglers = _group_members(pgid)
    if stragglers:
        _kill_group(pgid, stragglers)
        _wait_dead(stragglers, 5)
    result = subprocess.CompletedProcess(args, proc.returncode, out, err)
    result.stragglers = [p.pid for p in stragglers]  # type: ignore[attr-defined]
    return result


# --------------------------------------------------------------------------
# Warm children: forked from a template that has torch imported
# --------------------------------------------------------------------------

# The template: imports what nearly every child imports first (torch alone is
# ~3 s of CPU on a small machine), then, per request, forks a waiter that
# forks the child and reports on a status pipe the child's pid, then its raw
# wait status.  The template never waits itself (its waiters are reaped by
# the kernel), so children may run side by side.  The child takes the
# request's stdin/stdout/stderr, a session of its own, the working directory
# and environment, drops out of the loop and runs as ``python -c code`` or
# ``python script args`` would: a fresh ``__main__``, then the interpreter's
# own exit (atexit, joins of non-daemon threads, finalizers).  Requests are
# framed ``<u64 length><json>``, the four descriptors (stdin, stdout,
# stderr, the status pipe's write end) riding on the length.
_TEMPLATE = r"""
import json, os, signal, socket, struct, sys
import numpy, PIL.Image, psutil, torch


def _serve(fd):
    s = socket.socket(fileno=fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)

    def exact(n):
        buf = b""
        while len(buf) < n:
            got = s.recv(n - len(buf))
            if not got:
                os._exit(0)
            buf += got
        return buf

    while True:
        head, fds, _, _ = socket.recv_fds(s, 8, 4)
        if not head:
            os._exit(0)
        if len(head) < 8:
            head += exact(8 - len(head))
        req = json.loads(exact(struct.unpack("<Q", head)[0]))
        if os.fork() != 0:
            for f in fds:
                os.close(f)
            continue
        # the waiter
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        s.close()
        *std, status = fds
        pid = os.fork()
        if pid == 0:
            os.close(status)
            os.setsid()
            for target, f in enumerate(std):
                os.dup2(f, target)
                os.close(f)
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            return req
        for f in std:
            os.close(f)
        try:
            os.write(status, struct.pack("<q", pid))
            os.write(status, struct.pack("<q", os.waitpid(pid, 0)[1]))
        except OSError:
            pass
        os._exit(0)


_req = _serve(int(sys.argv[1]))
import builtins, types
_main = types.ModuleType("__main__")
_main.__builtins__ = builtins
sys.modules["__main__"] = _main
numpy.random.seed()      # a fresh interpreter's global numpy generator is seeded from the OS
if "script" in _req:     # python script args: sys.path starts with the script's directory
    _path = _req["script"]
    sys.argv[:] = _req["argv"]
    sys.path[0] = os.path.dirname(os.path.realpath(_path))
    _main.__file__ = _path
    with open(_path, "rb") as _f:
        _code = compile(_f.read(), _path, "exec")
else:
    sys.argv[:] = _req["argv"]
    _code = compile(_req["code"], "<string>", "exec")
del _req
try:
    exec(_code, _main.__dict__)
except SystemExit:
    raise
except BaseException as e:
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)   # the code's frames, as python prints
    sys.exit(1)
"""

# A warm child's environment may differ from the template's only in these
# (read when used, never while the template imports torch, numpy, PIL).
_WARM_ENV_FREE = ("COORDL_", "PYTEST_")


class _WarmUnavailable(Exception):
    """The template did not take the request (it exited): a fresh interpreter runs it."""


class _Status:
    """The read end of a waiter's status pipe: the child's pid, then its raw
    wait status (as ``os.waitpid`` gives it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.eof = False

    def _fill(self, want: int, block: bool, deadline: float | None = None) -> bool:
        os.set_blocking(self.fd, block and deadline is None)
        while len(self.buf) < want and not self.eof:
            try:
                got = os.read(self.fd, want - len(self.buf))
            except BlockingIOError:
                if not block or (deadline is not None and time.monotonic() > deadline):
                    return False
                time.sleep(0.002)
                continue
            if not got:
                self.eof = True
            self.buf += got
        return len(self.buf) >= want

    def pid(self, timeout: float) -> int:
        if not self._fill(8, True, time.monotonic() + timeout):
            raise TimeoutError("the warm-child template did not fork")
        return _unpack(self.buf[:8])

    def status(self, block: bool) -> int | None:
        """The raw wait status, or None (not yet, with ``block`` False).  A
        waiter gone without one (killed): SIGKILL's."""
        if not self._fill(16, block):
            return None
        return _unpack(self.buf[8:16]) if len(self.buf) >= 16 else signal.SIGKILL

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _unpack(b: bytes) -> int:
    return struct.unpack("<q", b)[0]


class WarmChildren:
    """What :func:`run_in_child` and :func:`popen` fork their children
    from, once :func:`start_warm_children` started it: a template process
    with torch, numpy, PIL and psutil imported, so a child skips seconds of
    imports.  A call whose environment differs from the template's in
    anything but ``COORDL_*``/``PYTEST_*`` variables starts a fresh
    interpreter instead."""

    def __init__(self) -> None:
        self.env = _child_env(None)
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _TEMPLATE, str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.sock = mine
        self.lock = threading.Lock()     # one request on the socket at a time
        self.broken = False

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a child with environment ``env`` may be forked from the
        template (it is running, and ``env`` differs from its own only in
        ``COORDL_*``/``PYTEST_*`` variables)."""
        if self.broken or self.proc.poll() is not None:
            return False
        keys = set(env) | set(self.env)
        return all(env.get(k) == self.env.get(k) for k in keys if not k.startswith(_WARM_ENV_FREE))

    def close(self) -> None:
        """Stop the template (it exits when its socket closes) and reap it."""
        self.broken = True
        try:
            self.sock.close()
        finally:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def start(self, req: dict, std: list[int]) -> tuple[int, _Status]:
        """Fork a child for ``req`` with ``std`` as its stdin, stdout and
        stderr (this process keeps its own copies): (its pid, its status).
        ``_WarmUnavailable`` when the template does not answer."""
        body = json.dumps(req).encode()
        status_r, status_w = os.pipe()
        try:
            with self.lock:
                socket.send_fds(self.sock, [struct.pack("<Q", len(body))], [*std, status_w])
                self.sock.sendall(body)
        except OSError as e:
            self.broken = True
            os.close(status_r)
            raise _WarmUnavailable(str(e)) from e
        finally:
            os.close(status_w)
        st = _Status(status_r)
        try:
            return st.pid(30), st
        except BaseException as e:
            self.broken = True
            st.close()
            raise _WarmUnavailable(str(e)) from e


class _WarmPopen(subprocess.Popen):
    """A :class:`subprocess.Popen` of ``python script args`` or ``python -c
    code args`` whose process is forked from the warm-child template: it is
    not this process' child, so its end comes from its waiter's status pipe
    instead of ``waitpid``."""

    def __init__(self, warm: WarmChildren, args, **kw) -> None:
        self._warm = warm
        self._st: _Status | None = None
        super().__init__(args, **kw)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        std = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
               errwrite if errwrite != -1 else 2]
        req = {"code": args[2], "argv": ["-c", *args[3:]]} if args[1] == "-c" else \
            {"script": args[1], "argv": list(args[1:])}
        req.update(cwd=os.fspath(cwd) if cwd else os.getcwd(), env=dict(env))
        try:
            self.pid, self._st = self._warm.start(req, std)
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _waitpid(self, pid, flags):
        sts = self._st.status(block=not flags & os.WNOHANG)
        return (0, 0) if sts is None else (self.pid, sts)

    def _try_wait(self, wait_flags):
        return self._waitpid(self.pid, wait_flags)

    def _internal_poll(self, _deadstate=None, **_kw):
        return super()._internal_poll(_deadstate, _waitpid=self._waitpid)

    def __del__(self, *a, **kw):
        super().__del__(*a, **kw)
        if self.returncode is not None and self._st is not None:
            self._st.close()


def popen(args, **kw) -> subprocess.Popen:
    """``subprocess.Popen(args, **kw)``; for ``[sys.executable, script.py,
    *args]`` or ``[sys.executable, "-c", code, *args]`` with only pipes,
    ``env``, ``cwd`` and ``start_new_session``, once
    :func:`start_warm_children` started the template, the process is forked
    from it (always in a session of its own).  The same object otherwise:
    ``poll``, ``wait``, ``communicate``, ``kill``, ``pid``."""
    warm = _warm
    simple = set(kw) <= {"stdin", "stdout", "stderr", "text", "env", "cwd", "start_new_session", "bufsize"}
    if (warm is not None and simple and isinstance(args, (list, tuple)) and len(args) >= 2
            and args[0] == sys.executable
            and (str(args[1]).endswith(".py") or (args[1] == "-c" and len(args) >= 3))):
        env = _child_env(kw.get("env"))
        if warm.serves(env):
            try:
                return _WarmPopen(warm, [str(a) for a in args], **{**kw, "env": env})
            except _WarmUnavailable:
                pass
    return subprocess.Popen(args, **kw)


_warm: WarmChildren | None = None


def start_warm_children() -> WarmChildren:
    """Have :func:`run_in_child` fork its children from a template with torch
    imported (see :class:`WarmChildren`), until :func:`stop_warm_children`.
    For a test session: the template lives as long as the session."""
    global _warm
    if _warm is None:
        _warm = WarmChildren()
    return _warm


def stop_warm_children() -> None:
    """Stop the template of :func:`start_warm_children`: children are fresh
    interpreters again."""
    global _warm
    warm, _warm = _warm, None
    if warm is not None:
        warm.close()


# --------------------------------------------------------------------------
# Leak detection
# --------------------------------------------------------------------------

def live_children(pid: int | None = None) -> list[psutil.Process]:
    """Every descendant of ``pid`` (default: this process), recursively.

    Zombies (exited but not yet reaped) are included: they are children
    nobody joined.
    """
    try:
        return psutil.Process(os.getpid() if pid is None else pid).children(
            recursive=True
        )
    except psutil.NoSuchProcess:
        return []


# coordl's own names directly in /dev/shm: its per-user cache directory
# (``coordl-<uid>``, when COORDL_SHM_DIR is unset) and every name its tests
# make (``coordl-test-...``): all start with "coordl".
COORDL_SHM_PREFIX = "coordl"

# torch's shared-memory names: ``/torch_<pid>_<random>_<counter>`` (ATen's
# NewProcessWideShmHandle, used by the file_system sharing strategy and, for
# the moment between shm_open and unlink, by file_descriptor), so the pid of
# the process that made it is in the name.
_TORCH_SHM = re.compile(r"torch_(\d+)_")


def _tree_pids(pid: int | None = None) -> set[int]:
    """``pid`` (default: this process) and every live descendant of it."""
    root = os.getpid() if pid is None else pid
    return {root} | {p.pid for p in live_children(root)}


def shm_entries(pids: Iterable[int] | None = None) -> set[str]:
    """The shared-memory entries coordl or this process tree made, by name:

    * in ``/dev/shm``, entries of this user named ``coordl*`` (coordl's cache
      directory when ``COORDL_SHM_DIR`` is unset; its tests' names; not
      ``coordl-<uid>`` when ``COORDL_SHM_DIR`` is set elsewhere: that is
      the cache directory of the user's other coordl programs), and
      torch's ``torch_<pid>_...`` whose pid is in ``pids`` (default: this
      process and its live descendants);
    * the full paths of coordl's cache directory (``coordl.cache.user_dir()``,
      wherever ``COORDL_SHM_DIR`` puts it) and of everything in it, the lock
      file included: coordl leaves none of them once no cache exists; and,
      when ``COORDL_SHM_DIR`` names a directory other than /dev/shm (a test
      session's own), the full paths of this user's entries in it.

    Anything else in /dev/shm (other programs', other users', another test
    run's) is not listed: a leak check built on this blames only what coordl
    or the code under test created.
    """
    from .cache import shm_root, user_dir

    me = os.geteuid()
    tree = _tree_pids() if pids is None else set(pids)
    out: set[str] = set()

    def mine(path: str) -> bool:
        try:
            return os.lstat(path).st_uid == me
        except OSError:
            return False

    root = shm_root()
    elsewhere = os.path.realpath(root) != os.path.realpath(SHM_DIR)
    # with COORDL_SHM_DIR elsewhere, /dev/shm/coordl-<uid> is the cache
    # directory of this user's *other* coordl programs, not of this code
    others = f"coordl-{me}" if elsewhere else None
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        names = []
    for name in names:
        m = _TORCH_SHM.match(name)
        ours = ((name.startswith(COORDL_SHM_PREFIX) and name != others)
                or (m is not None and int(m.group(1)) in tree))
        if ours and mine(os.path.join(SHM_DIR, name)):
            out.add(name)
    dirs = [root, user_dir()] if elsewhere else [user_dir()]
    for d in dirs:
        try:
            names = os.listdir(d)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        if d != root:
            out.add(d)
        for name in names:
            path = os.path.join(d, name)
            if mine(path):
                out.add(path)
    return out


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()
    except psutil.Error:
        return "?"


def _is_infrastructure(p: psutil.Process, markers: Iterable[str]) -> bool:
    cmd = _cmdline(p)
    return any(m in cmd for m in markers)


def _key(p: psutil.Process):
    try:
        return (p.pid, p.create_time())
    except psutil.Error:
        return (p.pid, None)


def wait_no_leaks(
    before_children_pids: Iterable[int],
    before_shm: Iterable[str],
    grace: float = 5.0,
    *,
    ignore: Iterable[str] = INFRASTRUCTURE_MARKERS,
    pid: int | None = None,
) -> tuple[list[psutil.Process], set[str]]:
    """Wait up to ``grace`` seconds for new descendants and shm entries to go.

    ``before_children_pids`` and ``before_shm`` are snapshots taken earlier
    with :func:`live_children` and :func:`shm_entries`.  A process or
    shared-memory entry is *leaked* if it is new and stays present through
    every poll until the grace period ends; something that appears only after
    the first poll is not blamed.  Only coordl's entries and torch's entries
    of this process tree count (:func:`shm_entries`; the tree is ``pid``, the
    processes in ``before_children_pids`` and every descendant seen while
    waiting): another program's or another user's entry is never blamed.
    Descendants whose command line contains one of ``ignore`` (Python's
    resource tracker and forkserver, torch's shm manager) are never leaks.

    Returns ``(leaked_processes, leaked_shm_names)``; both empty when clean.
    """
    before_pids = set(before_children_pids)
    before_names = set(before_shm)
    tree = set(before_pids)
    ignore = tuple(ignore)
    deadline = time.monotonic() + max(0.0, grace)
    delay = 0.02
    cand_procs: dict | None = None
    cand_shm: set[str] | None = None
    while True:
        kids = live_children(pid)
        procs = {
            _key(p): p
            for p in kids
            if p.pid not in before_pids and not _is_infrastructure(p, ignore)
        }
        # torch_<pid>_ names of every process of the tree seen so far count
        tree |= {os.getpid() if pid is None else pid} | {p.pid for p in kids}
        names = shm_entries(tree) - before_names
        if cand_procs is None:
            cand_procs, cand_shm = procs, names
        else:
            cand_procs = {k: v for k, v in cand_procs.items() if k in procs}
            cand_shm &= names
        if not cand_procs and not cand_shm:
            return [], set()
        if time.monotonic() >= deadline:
            return list(cand_procs.values()), set(cand_shm)
        if cand_procs:
            # Finished multiprocessing children become zombies until someone
            # polls them; active_children() reaps ours without side effects.
            multiprocessing.active_children()
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.25)


def describe_processes(procs: Iterable[psutil.Process]) -> str:
    """One line per process: pid, parent, status, name and command line.

    A forked worker shares its parent's command line; its name (torch's
    workers call themselves ``pt_data_worker``) tells them apart.
    """
    lines = []
    for p in procs:
        try:
            with p.oneshot():
                status, name, ppid = p.status(), p.name(), p.ppid()
        except psutil.Error:
            status, name, ppid = "gone", "?", "?"
        lines.append(f"  pid {p.pid} (parent {ppid}) [{status}] {name}: {_cmdline(p)}")
    return "\n".join(lines)


def kill_processes(procs: Iterable[psutil.Process], timeout: float = 5.0) -> None:
    """SIGKILL ``procs`` and their descendants and wait for them to exit."""
    victims: dict[int, psutil.Process] = {}
    for p in procs:
        try:
            for c in p.children(recursive=True):
                victims.setdefault(c.pid, c)
        except psutil.Error:
            pass
        victims.setdefault(p.pid, p)
    for p in victims.values():
        try:
            p.kill()
        except psutil.Error:
            pass
    _wait_dead(victims.values(), timeout)
    multiprocessing.active_children()  # reap multiprocessing children we own


def _wait_dead(procs: Iterable[psutil.Process], timeout: float) -> None:
    """Wait until every process has exited (zombies count as exited).

    Unlike ``psutil.wait_procs`` this never reaps: reaping a child behind the
    back of the ``multiprocessing.Process`` that owns it makes that object
    believe the child is alive forever.
    """
    pending = list(procs)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        still = []
        for p in pending:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    still.append(p)
            except psutil.Error:
                pass
        pending = still
        if pending:
            time.sleep(0.02)


def settle(timeout: float = 10.0) -> None:
    """Collect garbage and wait until the clean-ups it enqueued have run.

    coordl's finalizers only enqueue (a dropped loader's cache detach, a
    dropped pass's worker stop); its reaper thread acts.  Code that must see
    the result (a test checking that the last loader out removed its cache)
    calls this after dropping its last reference.
    """
    import gc

    from .base import reaper as _reaper

    gc.collect()
    if not _reaper.flush(timeout):
        raise TimeoutError(f"coordl's reaper did not finish its clean-ups within {timeout} s")


def stop_daemon(timeout: float = 20.0, wait: float = 15.0) -> list[int]:
    """Stop the node daemon of this environment (``COORDL_RUN_DIR``) if one
    runs, and wait for it and its workers to exit; the pids still alive
    after ``wait`` seconds each (a test fixture asserts there are none)."""
    import psutil

    from .daemon import server

    st = server.status()
    pids = [st["pid"]] + st.get("worker_pids", []) if st else []
    server.stop(timeout=timeout)
    left = []
    for pid in pids:
        try:
            psutil.Process(pid).wait(wait)
        except psutil.NoSuchProcess:
            pass
        except psutil.TimeoutExpired:
            left.append(pid)
    return left
