"""The README's main job, ``coordl demo``, end to end at a small size."""
import os
import re
import subprocess
import sys


def test_demo_runs_and_its_resume_check_passes(tmp_path):
    r = subprocess.run([sys.executable, "-m", "coordl", "demo", "--images", "48", "--epochs", "1",
                        "--workers", "1", "--batch-size", "8"],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    gen = re.search(r"generated 48 photo-like JPEGs in (\S+) ", out)
    assert gen, out
    assert not os.path.exists(gen.group(1))       # the temporary dataset is removed afterwards
    assert re.search(r"torch\.utils\.data\.DataLoader\s+48\s", out), out
    assert re.search(r"coordl\.DataLoader\s+48\s", out), out
    assert "coordl / torch throughput:" in out
    assert "raw bytes" in out and "from the node cache" in out
    assert "identical to an uninterrupted epoch" in out and "MISMATCH" not in out


def test_demo_exits_nonzero_when_its_resume_check_fails(monkeypatch, capsys):
    from coordl import cli, demo

    monkeypatch.setattr(demo, "run_demo", lambda **kw: {"resume_exact": False})
    assert cli.main(["demo", "--images", "8"]) == 1
