"""The repository holds coordl's own sources only (issue 21, 15)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tracked() -> list[str]:
    r = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("not a git checkout")
    return r.stdout.splitlines()


def test_no_third_party_packages_are_committed():
    """A 2.9 MB py-spy wheel sat at the repository root; packages come from pip."""
    packed = [p for p in _tracked() if p.endswith((".whl", ".tar.gz", ".zip", ".egg", ".so"))]
    assert packed == []


def test_no_module_calls_itself_work_in_progress():
    stale = [str(p.relative_to(ROOT)) for p in (ROOT / "coordl").rglob("*.py")
             if "work in progress" in p.read_text().lower()]
    assert stale == []
