"""The documentation builds with Sphinx, warnings as errors: the API
reference generated from the docstrings (a public name without a
docstring, or a broken reference to one of coordl's names, fails) and the
Markdown guide pages (a link to a missing page fails)."""
import os
import shutil
import subprocess
import sys

import pytest

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")

pytestmark = pytest.mark.timeout(600)


def _build(src, out):
    try:
        import myst_parser  # noqa: F401
        import sphinx  # noqa: F401
    except ImportError as e:  # the [test] extra installs both: the docs build is part of the suite
        pytest.fail(f"the docs build needs Sphinx and myst-parser ({e}); pip install -e '.[test]'")
    return subprocess.run([sys.executable, "-m", "sphinx", "-q", "-E", "-W", "--keep-going", "-n", "-b", "html",
                           src, out], capture_output=True, text=True, timeout=500)


def test_the_docs_build_without_a_warning(tmp_path):
    r = _build(DOCS, str(tmp_path / "html"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert os.path.exists(tmp_path / "html" / "reference" / "loader.html")


def test_a_public_name_without_a_docstring_fails_the_build(tmp_path):
    src = tmp_path / "docs"
    src.mkdir()
    shutil.copy(os.path.join(DOCS, "conf.py"), src / "conf.py")
    (tmp_path / "undocumented_mod.py").write_text('def documented():\n    """Has one."""\n\n\ndef bare():\n    pass\n')
    (src / "index.md").write_text("# t\n\n```{eval-rst}\n.. automodule:: undocumented_mod\n```\n")
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env_path) if p)
    try:
        r = _build(str(src), str(tmp_path / "html"))
    finally:
        os.environ["PYTHONPATH"] = env_path
    assert r.returncode != 0
    assert "undocumented_mod.bare is public but has no docstring" in r.stderr, r.stderr[-3000:]
    assert "documented is public" not in r.stderr.replace("bare is public", "")
