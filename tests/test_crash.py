"""Crash tests: each scenario runs in a child process with a hard timeout."""
import os
import textwrap

from coordl.testing import run_in_child

HERE = __file__.rsplit("/", 1)[0]


def _child(body: str, timeout: float = 90):
    code = f"import sys; sys.path.insert(0, {HERE!r})\n" + textwrap.dedent(body)
    return run_in_child(code, timeout=timeout)


def test_sigkilled_worker_raises_naming_pid_no_hang():
    r = _child("""
        import os, signal, time, psutil
        from coordl import DataLoader
        from toydata import TwoStageToy
        L = DataLoader(TwoStageToy(400, delay=0.01), batch_size=4, num_workers=2, seed=0, timeout=60)
        it = iter(L)
        next(it)
        victim = psutil.Process().children()[0].pid
        os.kill(victim, signal.SIGKILL)
        t0 = time.time()
        try:
            for _ in it:
                pass
        except RuntimeError as e:
            print("RAISED", victim, time.time() - t0)
            print(str(e))
        else:
            print("NO ERROR")
    """)
    assert r.returncode == 0, r.stderr
    first, msg = r.stdout.split("\n", 1)
    assert first.startswith("RAISED"), r.stdout
    victim = first.split()[1]
    assert victim in msg, msg


def test_worker_exiting_mid_batch_raises():
    """A worker that dies inside prep (os._exit) is reported, not waited on."""
    r = _child("""
        import os
        import torch
        from coordl import DataLoader
        from toydata import TwoStageToy

        class Dies(TwoStageToy):
            def prep(self, raw, i):
                if i == 13:
                    os._exit(3)
                return super().prep(raw, i)

        L = DataLoader(Dies(64), batch_size=4, num_workers=2, seed=0)
        try:
            n = sum(1 for _ in L)
        except RuntimeError as e:
            print("RAISED", "exited unexpectedly" in str(e) or "exit code" in str(e))
        else:
            print("NO ERROR", n)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("RAISED True"), r.stdout


VICTIM = """
import os, signal, sys, torch
sys.path.insert(0, sys.argv[1])
from coordl import DataLoader
from toydata import TwoStageToy
L = DataLoader(TwoStageToy(60), batch_size=4, shuffle=True, seed=3, num_workers=2)
seen = []
for k, (x, y) in enumerate(L):
    seen.append(x[:, 0].tolist())
    if k == 6:
        torch.save({"loader": L.state_dict(), "seen": seen}, sys.argv[2])
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_resume_in_new_process_after_kill(tmp_path):
    """Training killed with SIGKILL right after saving state; a new process
    resumes, and the batches before and after equal one uninterrupted epoch."""
    ckpt = tmp_path / "ckpt.pt"
    r = run_in_child(
        f"import subprocess, sys; p = subprocess.run([sys.executable, '-c', {VICTIM!r}, {HERE!r}, "
        f"{str(ckpt)!r}], timeout=60); print('rc', p.returncode)", timeout=90)
    assert "rc -9" in r.stdout, r.stdout + r.stderr
    r = _child(f"""
        import torch
        from coordl import DataLoader
        from toydata import TwoStageToy
        ck = torch.load({str(ckpt)!r})
        L = DataLoader(TwoStageToy(60), batch_size=4, shuffle=True, seed=3, num_workers=2)
        L.load_state_dict(ck["loader"])
        rest = [x[:, 0].tolist() for x, y in L]
        ref = [x[:, 0].tolist() for x, y in DataLoader(TwoStageToy(60), batch_size=4, shuffle=True, seed=3)]
        print("exact", ck["seen"] + rest == ref, len(ck["seen"]))
    """)
    assert r.returncode == 0, r.stderr
    assert "exact True 7" in r.stdout, r.stdout + r.stderr


def test_sigkilled_trainer_leaves_no_workers_and_its_cache_is_reclaimed():
    """kill -9 the training process mid-epoch: its workers exit (they watch a
    pidfd of the main process), and the next start removes its orphaned node cache."""
    import psutil

    from coordl import cache as C

    r = _child("""
        import os, signal, numpy as np, psutil
        from coordl import DataLoader
        from toydata import TwoStageToy

        class Printed(TwoStageToy):
            sizes = np.full(400, 256, dtype=np.int64)
            def fingerprint(self):
                return "feedd1e5d1e5"
            def raw(self, i):
                return super().raw(i) * 8

        L = DataLoader(Printed(400, delay=0.005), batch_size=4, num_workers=2, seed=0, cache_size=200_000)
        it = iter(L)
        next(it)
        print("workers", *[c.pid for c in psutil.Process().children()], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert r.returncode == -9, r.stderr
    pids = [int(p) for p in r.stdout.split("workers", 1)[1].split()]
    assert len(pids) == 2
    for p in pids:
        try:
            psutil.Process(p).wait(timeout=10)
        except psutil.NoSuchProcess:
            pass
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    name = "cache-feedd1e5d1e5"
    assert os.path.exists(os.path.join(C.user_dir(), name))  # nobody detached it
    assert name in C.reclaim_stale()  # the next start's sweep (no keep-warm asked)
    assert not os.path.exists(os.path.join(C.user_dir(), name))


def test_a_worker_killed_by_a_signal_other_than_sigkill_is_reported_without_the_oom_hint():
    """SIGABRT (a C++ exception, CUDA in a forked worker) names the signal and
    points at the worker's stderr; only SIGKILL suggests the OOM killer."""
    r = _child("""
        import os, signal
        from coordl import DataLoader
        from toydata import TwoStageToy

        class Dies(TwoStageToy):
            def prep(self, raw, i):
                if i == 13:
                    os.kill(os.getpid(), int(os.environ["SIG"]))
                return super().prep(raw, i)

        for sig in ("SIGABRT", "SIGSEGV", "SIGKILL"):
            os.environ["SIG"] = str(int(getattr(signal, sig)))
            try:
                sum(1 for _ in DataLoader(Dies(64), batch_size=4, num_workers=2, seed=0))
            except RuntimeError as e:
                print(sig, "|", str(e).replace(chr(10), " "))
            else:
                print(sig, "| NO ERROR")
    """)
    assert r.returncode == 0, r.stderr
    lines = dict(x.split(" | ", 1) for x in r.stdout.splitlines() if " | " in x)
    assert set(lines) == {"SIGABRT", "SIGSEGV", "SIGKILL"}, r.stdout
    for sig, msg in lines.items():
        assert f"killed by signal: {sig}" in msg, msg
        assert ("OOM" in msg) == (sig == "SIGKILL"), msg
    assert "stderr" in lines["SIGABRT"], lines["SIGABRT"]
