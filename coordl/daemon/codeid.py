"""The code a dataset runs, as one digest: a group of jobs shares only when
it is the same for every member, and the daemon's workers check that they
run that same code before they prepare a sample for the group.

What decides a prepared sample besides its data and parameters is the code
of the objects that prepare it.  :func:`code_identity` finds that code by
pickling the dataset (what the daemon receives) and noting every class and
function the pickle refers to (the dataset's class, its transforms, nested
objects, their base classes), then the modules they come from, and the
modules *those* reach through their globals (a helper module the
transform calls), and identifies each module:

* a module of the user's (any file outside the standard library and
  site-packages, coordl itself when it runs from a source tree): the
  digest of its source file, and the digest of the code objects of the
  classes and functions the pickle named (so a file edited after the job
  imported it is not mistaken for the code the job runs);
* a module of an installed distribution (site-packages): the
  distribution's name and version;
* the standard library and built-in modules: the Python version.

Always included: the Python version and the versions of coordl, torch,
numpy, pillow and simplejpeg.

Code that cannot be identified (a class defined in ``__main__`` or in a
module without a readable source file) raises :class:`Unidentified`
saying which and why: the job then prepares its own samples.
"""
from __future__ import annotations

import dis
import hashlib
import importlib.util
import io
import os
import pickle
import sys
import sysconfig
import types

__all__ = ["Unidentified", "code_identity", "identity_of"]

_LIBRARIES = ("coordl", "torch", "numpy", "PIL", "simplejpeg")
_MAX_MODULES = 2000


class Unidentified(Exception):
    """The dataset's code cannot be identified (the message says which and why)."""


class _Walker(pickle.Pickler):
    """Pickles to nowhere, noting every class and function referred to."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.seen: dict[int, object] = {}

    def reducer_override(self, obj):
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
            self.seen.setdefault(id(obj), obj)
        else:
            t = type(obj)
            self.seen.setdefault(id(t), t)
        return NotImplemented


def _roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(standard library directories, site-packages directories)."""
    paths = sysconfig.get_paths()
    std = {paths.get("stdlib"), paths.get("platstdlib")}
    site_dirs = {paths.get("purelib"), paths.get("platlib")}
    try:
        import site

        site_dirs.update(site.getsitepackages())
        site_dirs.add(site.getusersitepackages())
    except (AttributeError, ImportError):
        pass
    norm = lambda xs: tuple(sorted({os.path.realpath(x) + os.sep for x in xs if x}))  # noqa: E731
    return norm(std), norm(site_dirs)


_ROOTS = None
_DISTS = None                        # importlib.metadata's map of every distribution (the slow way)
_BESIDE: dict[str, dict] = {}        # site directory -> {top-level name: [name==version, ...]}
_FILE_DIGESTS: dict[tuple, str] = {}
_REFS: dict[tuple, tuple] = {}       # (module, its code objects' ids) -> (codes, imports, names) their code makes


def _dists_beside(site_dir: str) -> dict:
    """``{top-level package: ["name==version", ...]}`` from the ``*.dist-info``
    directories in ``site_dir``: a listing and each one's ``top_level.txt``
    (or, without one, its name), a few milliseconds once per process.
    importlib.metadata's ``packages_distributions`` reads every
    distribution's file list instead (~80 ms of CPU here, once per job join
    and per daemon worker per group), so it is only the fallback."""
    out = _BESIDE.get(site_dir)
    if out is not None:
        return out
    out = {}
    try:
        entries = sorted(os.listdir(site_dir))
    except OSError:
        entries = []
    for e in entries:
        if not e.endswith(".dist-info"):
            continue
        name, _, version = e[:-len(".dist-info")].partition("-")   # {name}-{version}: neither has a '-'
        if not version:
            continue
        try:
            with open(os.path.join(site_dir, e, "top_level.txt")) as f:
                tops = f.read().split()
        except OSError:
            tops = [name]
        for top in tops:
            out.setdefault(top, []).append(f"{name}=={version}")
    _BESIDE[site_dir] = out
    return out


def _dist_versions(top: str, site_dir: str | None = None) -> list[str]:
    """``["name==version", ...]`` of the distributions that install the
    top-level package ``top`` (found in ``site_dir``)."""
    if site_dir is not None:
        found = _dists_beside(site_dir).get(top)
        if found:
            return sorted(set(found))
    global _DISTS
    from importlib import metadata

    if _DISTS is None:
        try:
            _DISTS = metadata.packages_distributions()
        except Exception:   # a broken installation must not break a job: the file digest is used instead
            _DISTS = {}
    out = []
    for name in sorted(set(_DISTS.get(top, ()))):
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except Exception:
            pass
    return out


def _file_digest(path: str) -> str:
    st = os.stat(path)
    k = (path, st.st_mtime_ns, st.st_size, st.st_ino)
    d = _FILE_DIGESTS.get(k)
    if d is None:
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        d = _FILE_DIGESTS[k] = h.hexdigest()
    return d


def _tree_digest(root: str) -> str:
    """Digest of every Python source and extension under ``root``."""
    h = hashlib.blake2b(digest_size=16)
    for d, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith((".py", ".so")):
                p = os.path.join(d, f)
                h.update(os.path.relpath(p, root).encode() + b"\0" + _file_digest(p).encode())
    return h.hexdigest()


def _code_digest(h, co: types.CodeType) -> None:
    """What a code object does, without where it was compiled (file name,
    line numbers): the same for the same source in any process."""
    h.update(co.co_code)
    h.update(repr((co.co_argcount, co.co_posonlyargcount, co.co_kwonlyargcount, co.co_flags,
                   co.co_names, co.co_varnames, co.co_freevars, co.co_cellvars)).encode())
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            _code_digest(h, c)
        else:
            h.update(_const(c).encode())


def _const(c) -> str:
    """A constant's text, the same in every process (a frozenset's order
    follows string hashing, which differs between processes)."""
    if isinstance(c, (frozenset, set)):
        return "{" + ",".join(sorted(_const(x) for x in c)) + "}"
    if isinstance(c, tuple):
        return "(" + ",".join(_const(x) for x in c) + ")"
    if isinstance(c, types.CodeType):
        h = hashlib.blake2b(digest_size=16)
        _code_digest(h, c)
        return h.hexdigest()
    return repr(c)


def _obj_code(h, obj) -> None:
    """The code objects of a function, or of a class's own functions."""
    if isinstance(obj, types.FunctionType):
        _code_digest(h, obj.__code__)
        return
    if isinstance(obj, type):
        for name, v in sorted(vars(obj).items(), key=lambda kv: kv[0]):
            if isinstance(v, (staticmethod, classmethod)):
                v = v.__func__
            elif isinstance(v, property):
                v = v.fget
            if isinstance(v, types.FunctionType):
                h.update(name.encode())
                _code_digest(h, v.__code__)


def _code_refs(co: types.CodeType, imports: list, names: set) -> None:
    """What a code object (and the code nested in it) names: every
    ``import`` it runs, as ``(module, level, fromlist)``, and every global and
    attribute name it loads (``pkg.mod.f()`` names ``pkg``, ``mod`` and ``f``)."""
    names.update(co.co_names)
    consts: list = []
    for ins in dis.get_instructions(co):
        if ins.opname in ("LOAD_CONST", "LOAD_SMALL_INT"):
            consts = (consts + [ins.argval])[-2:]
            continue
        if ins.opname == "IMPORT_NAME":
            level, fromlist = (consts + [0, None])[:2] if len(consts) < 2 else consts
            imports.append((ins.argval, level if isinstance(level, int) else 0,
                            tuple(x for x in (fromlist or ()) if isinstance(x, str) and x != "*")))
        consts = []
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            _code_refs(c, imports, names)


def _module_code(mod: types.ModuleType):
    """The code objects of the classes and functions ``mod`` defines."""
    for v in list(vars(mod).values()):
        if getattr(v, "__module__", None) != mod.__name__:
            continue
        if isinstance(v, types.FunctionType):
            yield v.__code__
        elif isinstance(v, type):
            for a in list(vars(v).values()):
                if isinstance(a, (staticmethod, classmethod)):
                    a = a.__func__
                elif isinstance(a, property):
                    a = a.fget
                if isinstance(a, types.FunctionType):
                    yield a.__code__


def _reached_by_code(mod: types.ModuleType) -> tuple[list[str], list[str]]:
    """Modules ``mod``'s functions reach that its globals do not show:
    ``(imported modules, not yet imported module names)``.

    * an ``import`` inside a function (``from helper import g`` in
      ``__call__``), resolved against ``mod``'s package; a module not
      imported yet in this process is named for its file to be identified
      without importing it;
    * a submodule reached through its package's attribute (``import pkg.mod``
      binds ``pkg``; ``pkg.mod.f()`` reaches ``pkg.mod``): the submodules of
      every package among ``mod``'s globals whose names its code loads."""
    codes = tuple(_module_code(mod))
    key = (mod.__name__, tuple(map(id, codes)))
    got = _REFS.get(key)
    if got is None or got[0] != codes:        # (the code objects kept: their ids stay theirs)
        imports: list = []
        names: set = set()
        for co in codes:
            _code_refs(co, imports, names)
        got = _REFS[key] = (codes, imports, names)
    imports, names = got[1], got[2]
    here, later = [], []
    package = mod.__name__ if hasattr(mod, "__path__") else mod.__name__.rpartition(".")[0]
    for name, level, fromlist in imports:
        try:
            full = importlib.util.resolve_name("." * level + name, package) if level else name
        except (ImportError, ValueError):
            continue
        for cand in (full,) + tuple(f"{full}.{x}" for x in fromlist):
            if cand in sys.modules:
                here.append(cand)
            elif cand == full:
                later.append(cand)
    frontier = [v.__name__ for v in vars(mod).values() if isinstance(v, types.ModuleType) and hasattr(v, "__path__")]
    while frontier:
        p = frontier.pop()
        for n in names:
            sub = f"{p}.{n}"
            if sub in sys.modules and sub not in here:
                here.append(sub)
                frontier.append(sub)
    return here, later


def _unimported_source(name: str) -> str | None:
    """The file module ``name`` would be imported from, found without
    importing anything (None when it cannot be found that way)."""
    parent = name.rpartition(".")[0]
    if parent and parent not in sys.modules:
        return None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError):
        return None
    origin = getattr(spec, "origin", None) if spec is not None else None
    return origin if origin and os.path.isfile(origin) else None


def _kind(mod: types.ModuleType, std, site_dirs) -> tuple[str, str | None]:
    """('builtin'|'stdlib'|'site'|'user', file)."""
    name = mod.__name__
    f = getattr(mod, "__file__", None)
    if not f:
        if name in sys.builtin_module_names or getattr(mod, "__spec__", None) is not None and \
                getattr(mod.__spec__, "origin", None) in ("built-in", "frozen"):
            return "builtin", None
        return "user", None
    real = os.path.realpath(f)
    for s in site_dirs:
        if real.startswith(s):
            return "site", real
    for s in std:
        if real.startswith(s):
            return "stdlib", real
    return "user", real


def identity_of(obj) -> tuple[str, list[str]]:
    """``(digest, description)`` of the code ``obj`` (a dataset) runs; the
    description lists each part (for messages and tests)."""
    global _ROOTS
    if _ROOTS is None:
        _ROOTS = _roots()
    std, site_dirs = _ROOTS
    w = _Walker()
    try:
        w.dump(obj)
    except Exception as e:
        raise Unidentified(f"cannot walk the dataset's objects ({type(e).__name__}: {e})") from None
    named = [o for o in w.seen.values() if getattr(o, "__module__", None)]
    classes = [o for o in named if isinstance(o, type)]
    for c in list(classes):
        for b in c.__mro__[1:]:
            if b is not object and all(b is not x for x in named):
                named.append(b)
    code = hashlib.blake2b(digest_size=16)
    for o in sorted(named, key=lambda o: (str(o.__module__), str(getattr(o, "__qualname__", "")))):
        mod = o.__module__
        if mod == "__main__":
            raise Unidentified(f"{getattr(o, '__qualname__', o)!s} is defined in __main__, which the daemon's "
                               "workers cannot import; define it in an importable module")
        if mod in ("builtins",):
            continue
        code.update(f"{mod}.{getattr(o, '__qualname__', '')}\n".encode())
        _obj_code(code, o)
    parts: dict[str, str] = {}
    todo = sorted({str(o.__module__) for o in named if o.__module__ != "builtins"})
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name == "__main__":
            continue     # reached through a module's globals only (what is pickled from it was refused above)
        if len(seen) > _MAX_MODULES:
            raise Unidentified(f"the dataset's code reaches more than {_MAX_MODULES} modules")
        mod = sys.modules.get(name)
        if mod is None:   # an extension type naming a module it is not importable as: its package decides
            top = name.partition(".")[0]
            if top != name and top in sys.modules:
                todo.append(top)
                continue
            raise Unidentified(f"module {name} (of the dataset's code) is not imported in this process")
        kind, f = _kind(mod, std, site_dirs)
        if kind in ("builtin", "stdlib"):
            continue
        if kind == "site":
            top = name.partition(".")[0]
            vers = _dist_versions(top, next((d for d in site_dirs if f.startswith(d)), None))
            if vers:
                parts.setdefault(top, " ".join(vers))
                continue
        if f is None:
            raise Unidentified(f"module {name} (of the dataset's code) has no source file")
        try:
            parts[name] = _file_digest(f)
        except OSError as e:
            raise Unidentified(f"cannot read {f}, the source of module {name}: {e}") from None
        if kind == "user" and f.endswith(".py"):
            # the code this process runs from it (the file may have been edited since it was imported)
            h = hashlib.blake2b(digest_size=16)
            for k, v in sorted(vars(mod).items(), key=lambda kv: kv[0]):
                if isinstance(v, (type, types.FunctionType)) and getattr(v, "__module__", None) == name:
                    h.update(k.encode())
                    _obj_code(h, v)
            parts[name] += " " + h.hexdigest()
            # (coordl from a source tree: its whole tree's digest is part of the identity already)
            if name.partition(".")[0] not in _LIBRARIES:
                here, later = _reached_by_code(mod)
                todo.extend(here)
                for m in later:
                    src = _unimported_source(m)
                    if src is None or m in parts:
                        continue
                    real = os.path.realpath(src)
                    if real.startswith(std):
                        continue
                    site_dir = next((d for d in site_dirs if real.startswith(d)), None)
                    if site_dir is not None:       # an installed distribution: its name and version
                        top = m.partition(".")[0]
                        vers = _dist_versions(top, site_dir)
                        if vers:
                            parts.setdefault(top, " ".join(vers))
                            continue
                    try:
                        parts[m] = "not imported " + _file_digest(real)
                    except OSError:
                        pass
        pkg = name + "." if hasattr(mod, "__path__") else None
        for v in list(vars(mod).values()):    # what this module reaches: its imports, classes and functions
            if isinstance(v, types.ModuleType):
                # a package's submodules are its attributes once anything imported them: only
                # what the package's own code names counts (the same in every process)
                if pkg is None or not v.__name__.startswith(pkg):
                    todo.append(v.__name__)
            elif isinstance(v, (type, types.FunctionType)):
                m = getattr(v, "__module__", None)
                if isinstance(m, str) and m != "builtins" and m in sys.modules:
                    todo.append(m)
    libs = [f"python {sys.version.split()[0]} {sys.implementation.name}"]
    for name in _LIBRARIES:
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = __import__(name)
            except ImportError:
                libs.append(f"{name} (none)")
                continue
        libs.append(f"{name} {getattr(mod, '__version__', getattr(mod, 'VERSION', '?'))}")
        if name == "coordl" and _kind(mod, std, site_dirs)[0] == "user":
            libs.append(f"coordl source {_tree_digest(os.path.dirname(mod.__file__))}")   # run from a source tree
    desc = libs + [f"{k} {v}" for k, v in sorted(parts.items())] + [f"code {code.hexdigest()}"]
    return hashlib.blake2b("\n".join(desc).encode(), digest_size=20).hexdigest(), desc


def code_identity(obj) -> str:
    """The digest of :func:`identity_of`."""
    return identity_of(obj)[0]
