"""The documentation builds with Sphinx, warnings as errors: the API
reference generated from the docstrings (a public name without a
docstring, or a broken reference to one of coordl's names, fails) and the
Markdown guide pages (a link to a missing page fails)."""
import os
import re
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


def _docstring_parameters(doc: str) -> set[str]:
    """The names of a docstring's "Keyword-only extras:" definition list (a
    term line indented 4 spaces, its description 8)."""
    block = doc.split("Keyword-only extras:", 1)[1]
    names = set()
    for line in block.splitlines():
        if line.startswith("    ") and not line.startswith("     ") and line.strip():
            term = line.strip()
            if not re.fullmatch(r"\w+(, \w+)*", term):
                break   # the list has ended: a paragraph at the same indent
            names |= set(term.split(", "))
    return names


def test_every_parameter_coordl_adds_to_the_loader_is_in_its_reference():
    """The reference is generated from DataLoader's docstring: each keyword
    coordl adds to torch's signature has an entry there."""
    import inspect

    import torch

    import coordl

    ours = set(inspect.signature(coordl.DataLoader.__init__).parameters)
    extra = ours - set(inspect.signature(torch.utils.data.DataLoader.__init__).parameters)
    documented = _docstring_parameters(coordl.DataLoader.__doc__)
    assert extra and extra <= documented, sorted(extra - documented)


def test_the_docstring_parameter_reader_sees_a_missing_entry():
    doc = "x\n\n    Keyword-only extras:\n\n    seed\n        s.\n    rank, world_size\n        r.\n\n    Prose.\n"
    assert _docstring_parameters(doc) == {"seed", "rank", "world_size"}


def _environment_variables_read() -> set[str]:
    """Every ``COORDL_*`` name in the package's source (the variables it
    reads, and names it mentions to users)."""
    names = set()
    for d, _, files in os.walk(os.path.join(os.path.dirname(DOCS), "coordl")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f)) as fh:
                    names |= set(re.findall(r"\bCOORDL_[A-Z0-9_]*[A-Z0-9]\b", fh.read()))
    return names - {"COORDL_SHM_PREFIX"}   # a constant of coordl.testing, not a variable


def test_every_environment_variable_is_on_the_environment_page():
    with open(os.path.join(DOCS, "reference", "environment.md")) as f:
        page = f.read()
    listed = set(re.findall(r"`(COORDL_[A-Z0-9_]+)`", page))
    read = _environment_variables_read()
    assert read, "no COORDL_ variable found in the source: the scan is broken"
    assert not read - listed, f"add these to docs/reference/environment.md: {sorted(read - listed)}"
