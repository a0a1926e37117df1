"""The code identity of a dataset (coordl.daemon.codeid), in process: what
changes it and what cannot be identified."""
import importlib
import os
import sys

import pytest

from coordl.daemon.codeid import Unidentified, identity_of

SRC = """\
import helper_{tag}


class MyAug:
    def __init__(self):
        self.k = 3

    def __call__(self, x):
        return {body}


class Box:
    def __init__(self, t):
        self.transform = t
"""
HELPER = "def twice(x):\n    return {body}\n"


def _load(tmp_path, tag, body="x", helper="x * 2"):
    d = tmp_path / tag
    d.mkdir(exist_ok=True)
    (d / f"aug_{tag}.py").write_text(SRC.format(tag=tag, body=body))
    (d / f"helper_{tag}.py").write_text(HELPER.format(body=helper))
    sys.path.insert(0, str(d))
    try:
        importlib.invalidate_caches()
        for m in (f"aug_{tag}", f"helper_{tag}"):
            sys.modules.pop(m, None)
        mod = importlib.import_module(f"aug_{tag}")
    finally:
        sys.path.remove(str(d))
    return mod


@pytest.fixture(autouse=True)
def _forget_modules():
    yield
    for m in [m for m in sys.modules if m.startswith(("aug_", "helper_"))]:
        del sys.modules[m]


def test_same_code_same_identity_and_any_change_differs(tmp_path):
    a = _load(tmp_path, "a")
    one, desc = identity_of(a.Box(a.MyAug()))
    assert identity_of(a.Box(a.MyAug()))[0] == one
    assert any(d.startswith("aug_a ") for d in desc) and any(d.startswith("helper_a ") for d in desc)
    assert any(d.startswith("torch ") for d in desc) and any(d.startswith("numpy ") for d in desc)
    b = _load(tmp_path, "a", body="x + 1")                     # the module edited
    assert identity_of(b.Box(b.MyAug()))[0] != one
    c = _load(tmp_path, "a", helper="x * 3")                  # a module it reaches, edited
    assert identity_of(c.Box(c.MyAug()))[0] != one


def test_running_code_counts_not_only_the_file(tmp_path):
    a = _load(tmp_path, "r")
    before = identity_of(a.Box(a.MyAug()))[0]
    (tmp_path / "r" / "aug_r.py").write_text(SRC.format(tag="r", body="x"))   # same text: same identity
    assert identity_of(a.Box(a.MyAug()))[0] == before
    a.MyAug.__call__.__code__ = (lambda self, x: -x).__code__                # the code in memory changed
    assert identity_of(a.Box(a.MyAug()))[0] != before


class InMain:
    pass


def test_main_and_sourceless_modules_cannot_be_identified(monkeypatch):
    import types

    monkeypatch.setattr(InMain, "__module__", "__main__")
    monkeypatch.setattr(sys.modules["__main__"], "InMain", InMain, raising=False)
    with pytest.raises(Unidentified, match="__main__"):
        identity_of(InMain())
    mod = types.ModuleType("nofile_mod")
    exec("class K:\n    pass\n", mod.__dict__)
    mod.K.__module__ = "nofile_mod"
    monkeypatch.setitem(sys.modules, "nofile_mod", mod)
    with pytest.raises(Unidentified, match="no source file"):
        identity_of(mod.K())


def test_library_versions_are_part_of_it():
    import coordl
    from coordl import transforms as T

    ds = coordl.ImageFolder.__new__(coordl.ImageFolder)
    ds.__dict__["transform"] = T.Compose([T.PILToTensor()])
    _, desc = identity_of(ds)
    names = {d.split(" ")[0] for d in desc}
    assert {"python", "coordl", "torch", "numpy", "PIL", "simplejpeg"} <= names
    assert any(d.startswith("coordl.transforms ") or d.startswith("coordl source") for d in desc)


def test_the_same_in_every_process_whatever_the_hash_seed(tmp_path):
    """Set constants (``x in {"a", "b"}``) print in an order that follows
    string hashing; the identity must not."""
    import subprocess

    (tmp_path / "setconst.py").write_text(
        "class Aug:\n    def __call__(self, x):\n        return x if x in {'alpha', 'beta', 'gamma', 'delta'} else 0\n")
    code = ("import sys; sys.path.insert(0, %r)\n"
            "import setconst\n"
            "from coordl.daemon.codeid import identity_of\n"
            "print(identity_of(setconst.Aug())[0])\n" % str(tmp_path))
    out = set()
    for seed in ("1", "2", "3"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": seed})
        assert r.returncode == 0, r.stderr
        out.add(r.stdout.strip())
    assert len(out) == 1, out


def test_a_helper_module_edited_after_import_differs_from_a_fresh_import(tmp_path):
    a = _load(tmp_path, "h")
    box = a.Box(a.MyAug())
    before = identity_of(box)[0]
    (tmp_path / "h" / "helper_h.py").write_text(HELPER.format(body="x * 5"))   # edited on disk only
    stale = identity_of(box)[0]
    fresh = _load(tmp_path, "h", helper="x * 5")
    assert stale != before                                   # the file changed
    assert stale != identity_of(fresh.Box(fresh.MyAug()))[0]  # and this process does not run it


def test_installed_distributions_are_named_from_their_dist_info_as_importlib_names_them(tmp_path):
    # the cheap lookup (dist-info listing and top_level.txt) must name the same
    # distribution and version as importlib.metadata's scan of every file list
    from importlib import metadata

    import numpy
    import PIL
    import torch

    from coordl.daemon import codeid

    std, site_dirs = codeid._roots()
    pd = metadata.packages_distributions()
    for mod in (numpy, torch, PIL):
        top = mod.__name__
        f = os.path.realpath(mod.__file__)
        site = next(d for d in site_dirs if f.startswith(d))
        got = codeid._dist_versions(top, site)
        want = sorted(f"{n}=={metadata.version(n)}" for n in set(pd[top]))
        assert got and [g.split("==")[1] for g in got] == [w.split("==")[1] for w in want], (top, got, want)
    # a dist-info without top_level.txt names its own package; an unknown one finds nothing there
    site = tmp_path / "site"
    (site / "fancy_pkg-1.2.3.dist-info").mkdir(parents=True)
    (site / "other-0.1.dist-info").mkdir()
    (site / "other-0.1.dist-info" / "top_level.txt").write_text("oth\nother_two\n")
    codeid._BESIDE.pop(str(site), None)
    beside = codeid._dists_beside(str(site))
    assert beside == {"fancy_pkg": ["fancy_pkg==1.2.3"], "oth": ["other==0.1"], "other_two": ["other==0.1"]}


def _write_tree(root, files: dict):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _fresh_import(root, name, drop=()):
    sys.path.insert(0, str(root))
    try:
        importlib.invalidate_caches()
        for m in [m for m in sys.modules if m.split(".")[0] in drop]:
            del sys.modules[m]
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(root))


def test_a_submodule_reached_through_its_package_attribute_counts(tmp_path):
    """``import pkg.mod`` then ``pkg.mod.f()``: the module's global is the
    package, the code reaches the submodule by attribute; editing the
    submodule changes the identity."""
    files = {"aug_pkgattr.py": "import helper_pkg.ops\n\n\nclass Aug:\n"
                               "    def __call__(self, x):\n        return helper_pkg.ops.f(x)\n",
             "helper_pkg/__init__.py": "", "helper_pkg/ops.py": "def f(x):\n    return x + 1\n"}
    _write_tree(tmp_path, files)
    a = _fresh_import(tmp_path, "aug_pkgattr", drop=("aug_pkgattr", "helper_pkg"))
    one, desc = identity_of(a.Aug())
    assert any(d.startswith("helper_pkg.ops ") for d in desc), desc
    (tmp_path / "helper_pkg" / "ops.py").write_text("def f(x):\n    return x + 140\n")
    b = _fresh_import(tmp_path, "aug_pkgattr", drop=("aug_pkgattr", "helper_pkg"))
    assert identity_of(b.Aug())[0] != one


@pytest.mark.parametrize("imported_before", [True, False])
def test_a_module_imported_inside_a_method_counts(tmp_path, imported_before):
    """``from helper_inner import g`` inside ``__call__``: the module is not
    among the module's globals, and may not be imported yet when the job
    joins; editing it changes the identity either way."""
    files = {"aug_inner.py": "class Aug:\n    def __call__(self, x):\n"
                             "        from helper_inner import g\n        return g(x)\n",
             "helper_inner.py": "def g(x):\n    return x * 2\n"}
    _write_tree(tmp_path, files)

    def ident():
        a = _fresh_import(tmp_path, "aug_inner", drop=("aug_inner", "helper_inner"))
        sys.path.insert(0, str(tmp_path))
        try:
            if imported_before:
                a.Aug()(1)
            return identity_of(a.Aug())
        finally:
            sys.path.remove(str(tmp_path))

    one, desc = ident()
    assert any(d.startswith("helper_inner ") for d in desc), desc
    (tmp_path / "helper_inner.py").write_text("def g(x):\n    return x * 3\n")
    assert ident()[0] != one
