"""Suite-wide fixtures.

Every test runs under a leak check: worker processes (any descendant of the
pytest process) and shared-memory entries that coordl or the test's own
process tree created during the test must be gone shortly after it ends.
Only those count (:func:`coordl.testing.shm_entries`): coordl's names, the
session's ``COORDL_SHM_DIR`` contents and torch's ``torch_<pid>_...``
segments of this process tree; other programs' and other users' entries in
/dev/shm are never blamed.  Leaked processes are killed so later tests start
clean, and the test is failed (reported as an error at its teardown) with the
leaked pids, command lines and shm names.

``COORDL_LEAK_GRACE`` (seconds, default 5) sets how long teardown waits for
stragglers to exit before calling them leaked.

Tests of the node daemon take ``daemon_env``: a daemon of their own, stopped
afterwards (a module sets its deadlines or staging size by overriding
``daemon_settings``).

Node cache segments go to a directory of this session's own
(``COORDL_SHM_DIR``, mode 1777 like /dev/shm, removed at the end; child
processes inherit it), so test runs sharing a machine and a uid never see,
sweep or blame each other's caches.
"""
from __future__ import annotations

import gc
import os
import re
import shutil
import signal
import tempfile

# torch's intra-op threads (libgomp) spin for a while after each parallel
# region before they sleep: with three pytest workers and their children on
# a few cores, that spinning takes CPU the tests need (about half of the CPU
# of tests/test_tv_pixels.py's small ops).  Set before torch loads here, and
# inherited by every child: the same threads, asleep when idle.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import psutil  # noqa: E402
import pytest  # noqa: E402

from coordl.testing import (  # noqa: E402
    describe_processes,
    kill_processes,
    live_children,
    shm_entries,
    stop_daemon,
    wait_no_leaks,
)

LEAK_GRACE = float(os.environ.get("COORDL_LEAK_GRACE", "5"))
_SESSION_SHM = None
_SESSION_RUN = None
_SESSION_SHM_RE = re.compile(r"coordl-test-\d+")


def _leaks(before_pids, before_shm, grace):
    """:func:`wait_no_leaks`, less the session directories of pytest runs
    (another run's, made or removed meanwhile on this machine, is not ours)."""
    procs, shm = wait_no_leaks(before_pids, before_shm, grace=grace)
    return procs, {e for e in shm if not _SESSION_SHM_RE.fullmatch(os.path.basename(e))}


def _remove_dead_sessions_dirs(shm: str = "/dev/shm") -> None:
    """A session killed before its end (a timeout, SIGKILL) cannot remove
    its ``coordl-test-<pid>`` directory: remove every one whose session
    process is gone (a live process of that pid keeps it)."""
    for name in os.listdir(shm):
        if not _SESSION_SHM_RE.fullmatch(name):
            continue
        try:
            os.kill(int(name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(shm, name), ignore_errors=True)
        except PermissionError:   # another user's live process
            pass


def _compile_sources() -> None:
    """Write the bytecode of coordl, the tests' helpers and the benchmarks
    once, before any worker starts.  With PYTHONDONTWRITEBYTECODE set (as on
    this project's machines) no import writes it, so each of the few hundred
    child processes a run starts (jobs, daemons and their workers) compiled
    every coordl module it imports again: about 0.2 s of CPU each.  An
    import still reads a cached file only while it matches its source."""
    import compileall

    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.path.join(os.path.dirname(here), "coordl"), here, os.path.join(os.path.dirname(here), "benchmarks")):
        if os.path.isdir(d):
            compileall.compile_dir(d, quiet=2, workers=1)


def pytest_configure(config):
    global _SESSION_SHM, _SESSION_RUN
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _compile_sources()
    # pytest-xdist's workers inherit the controller's environment: each
    # worker takes directories of its own, so that parallel tests never see,
    # sweep, stop or blame each other's caches and node daemons.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    ours = os.environ.get("COORDL_TEST_SESSION_DIRS") == "1"
    if ("COORDL_SHM_DIR" not in os.environ or (worker and ours)) and os.path.isdir("/dev/shm"):
        _remove_dead_sessions_dirs()
        _SESSION_SHM = f"/dev/shm/coordl-test-{os.getpid()}"
        os.makedirs(_SESSION_SHM, exist_ok=True)
        os.chmod(_SESSION_SHM, 0o1777)
        os.environ["COORDL_SHM_DIR"] = _SESSION_SHM
        os.environ["COORDL_TEST_SESSION_DIRS"] = "1"
    if worker and "COORDL_RUN_DIR" not in os.environ:
        _SESSION_RUN = tempfile.mkdtemp(prefix=f"coordl-run-{worker}-")
        os.environ["COORDL_RUN_DIR"] = _SESSION_RUN
    config.addinivalue_line(
        "markers",
        "allow_leaks: skip the per-test check for leaked processes and /dev/shm entries",
    )


# The modules that take longest, longest first (seconds of one worker in a
# loaded `-n 3` run on 2 cores, from --durations=0; those over 15 s).  Under
# `--dist loadfile` a module runs on one worker from start to end and the
# suite lasts as long as its busiest worker:
# these go first and the many short modules fill in around them (setup.cfg
# turns off xdist's own order, by number of tests, which put them last).
LONG_MODULES = [
    "test_benchmarks.py", "test_device_geometry_kernel.py", "test_share.py", "test_benchmarks_sharing.py",
    "test_daemon_robust.py", "test_device_policy.py", "test_daemon_pool.py", "test_peers.py", "test_share_code.py",
    "test_resume.py", "test_analyze.py", "test_readme.py", "test_cache_lifetime.py", "test_torchvision.py",
    "test_peers_protocol.py", "test_device_jitter.py", "test_pin.py", "test_pipeline_lifetime.py",
    "test_conformance.py", "test_share_pins.py", "test_worker_device_state.py", "test_remote.py",
    "test_native_store.py", "test_leak_fixture.py", "test_dropin.py", "test_seed_agreement.py", "test_sampler.py",
    "test_s3.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: k for k, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: each module's order kept


def pytest_unconfigure(config):
    if _SESSION_SHM is not None:
        shutil.rmtree(_SESSION_SHM, ignore_errors=True)
        os.environ.pop("COORDL_SHM_DIR", None)
    if _SESSION_RUN is not None:
        shutil.rmtree(_SESSION_RUN, ignore_errors=True)
        os.environ.pop("COORDL_RUN_DIR", None)


@pytest.fixture(scope="session", autouse=True)
def _warm_children():
    """``run_in_child`` forks its children from a template with torch
    imported (coordl.testing.WarmChildren): a hundred children a run each
    skip ~3 s of CPU of imports.  Started before any test, so the template is
    no test's leak.  ``COORDL_TEST_FRESH_CHILDREN=1``: every child a fresh
    interpreter."""
    from coordl import testing

    if os.environ.get("COORDL_TEST_FRESH_CHILDREN") == "1":
        yield
        return
    testing.start_warm_children()
    yield
    testing.stop_warm_children()


@pytest.fixture(autouse=True)
def _no_leaked_processes_or_shm(request):
    if request.node.get_closest_marker("allow_leaks"):
        yield
        return
    before_pids = {p.pid for p in live_children()}
    before_shm = shm_entries()
    yield
    from coordl.base import reaper as _reaper
    _reaper.flush(LEAK_GRACE)  # clean-ups the test's finalizers handed to the reaper
    procs, shm = _leaks(before_pids, before_shm, 0)
    if procs or shm:
        # Iterators caught in reference cycles shut their workers down only
        # when collected: collect now rather than blame a later test.  (A full
        # collection costs ~0.1 s with torch loaded, so only when needed.)
        gc.collect()
        procs, shm = _leaks(before_pids, before_shm, LEAK_GRACE)
    if not procs and not shm:
        return
    report = [f"test leaked resources (still present {LEAK_GRACE:g} s after it ended):"]
    if procs:
        report.append(f"processes (pids {sorted(p.pid for p in procs)}):")
        report.append(describe_processes(procs))
        kill_processes(procs)
    if shm:
        report.append(f"/dev/shm entries: {sorted(shm)}")
    pytest.fail("\n".join(report), pytrace=False)


@pytest.fixture(scope="session")
def tv():
    """torchvision, loaded as tests/_torchvision.py does; the test is
    skipped where it is not installed."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _torchvision import import_torchvision

    tv = import_torchvision()
    if tv is None:
        pytest.skip("torchvision is not installed (pip install coordl[test])")
    return tv


@pytest.fixture(scope="session")
def photo_folder(tmp_path_factory):
    """``make(name, **kw)``: a folder of synthetic photos
    (``coordl.synth.make_image_folder(root, **kw)``) under a temporary
    directory named ``name``; its path."""
    from coordl.synth import make_image_folder

    def make(name: str, **kw) -> str:
        root = tmp_path_factory.mktemp(name) / "photos"
        make_image_folder(str(root), **kw)
        return str(root)

    return make


@pytest.fixture
def cpu_device(monkeypatch):
    """The CPU stands in for the device (``coordl.device.delivery.CPU_TEST_DEVICE``):
    the device path runs here as on a GPU, ``device="cpu"``."""
    from coordl.device import delivery

    monkeypatch.setattr(delivery, "CPU_TEST_DEVICE", True)


@pytest.fixture
def exact(monkeypatch):
    """``decode="device"``'s CPU stand-in with libjpeg's interpolated chroma
    upsampling (the CPU path decodes at full size): both decode the same
    pixels, so what remains is the resize's float-vs-uint8 rounding (at most
    1 level): any other difference is a wrong crop, size or flip."""
    from coordl.device import decode as DD

    orig = DD.decoder_for
    monkeypatch.setattr(DD, "decoder_for", lambda dev, **kw: DD.HostDecoder(dev, fancy_upsampling=True)
                        if dev.type == "cpu" else orig(dev))


@pytest.fixture
def no_accelerator(monkeypatch):
    """This process behaves as on a machine without an accelerator, also where
    one is present: torch's and coordl's pinning decisions both ask
    ``torch.accelerator.is_available()`` (and CUDA's own test answers alike)."""
    import torch

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _processes(pids) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


# the sharing knobs of the shell that runs the suite that a daemon test must not inherit
_DAEMON_KNOBS = ("COORDL_STAGING", "COORDL_SHARE", "COORDL_DAEMON_MAX_CLIENTS", "COORDL_DAEMON_WORKER_STALL",
                 "COORDL_DAEMON_WORKER_WAIT", "COORDL_DAEMON_MAX_WORKERS")


@pytest.fixture
def daemon_settings() -> dict:
    """The environment ``daemon_env`` sets for the test's daemon and jobs;
    a module overrides this fixture (shorter deadlines, a staging size)."""
    return {}


@pytest.fixture
def daemon_env(tmp_path, monkeypatch, daemon_settings):
    """A private run directory (each test has its own node daemon), none of
    the shell's sharing knobs but ``daemon_settings``, and the daemon and its
    workers gone afterwards.

    Yields a list for what the test must not leave behind: the jobs it
    started (``Popen``: killed) and the pids it stopped with SIGSTOP
    (continued, then waited for; killed after 10 s).  A daemon process still
    there 15 s after the daemon was stopped is killed and fails the test."""
    monkeypatch.setenv("COORDL_RUN_DIR", str(tmp_path / "run"))
    for k in _DAEMON_KNOBS:
        monkeypatch.delenv(k, raising=False)
    for k, v in daemon_settings.items():
        monkeypatch.setenv(k, v)
    procs = []
    yield procs
    stopped = [p for p in procs if isinstance(p, int)]
    for p in procs:
        if isinstance(p, int):
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
        else:
            p.kill()
            p.communicate()
    left = stop_daemon()
    for pid in stopped:
        try:
            p = psutil.Process(pid)
            try:
                p.wait(10)
            except psutil.TimeoutExpired:
                p.kill()
        except psutil.NoSuchProcess:
            pass
    kill_processes(_processes(left))
    assert not left, f"daemon processes left behind (killed now): {left}"
