"""What the analyzer's passes read: the dataset and transform named by the
user, and the wrappers the passes put around the dataset.

- :func:`load_callable`: ``"package.module:name"`` or
  ``"path/to/file.py:name"`` to the object (a module name imported as
  ``python -m`` would);
- :data:`TRANSFORMS` and :func:`make_transform`: the named transforms
  (``rrc224``, ``rrc224u8``, ``center224``) or a ``"module:callable"``;
- :class:`FetchOnly` (prep replaced by ``len(raw)``: the fetch stage alone)
  and :class:`Subset` (``n`` samples spread over the dataset), both keeping
  the two-stage protocol.

:mod:`coordl.analyze.measure` exports these names too (they were defined
there).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any, Callable

import torch

__all__ = ["load_callable", "make_transform", "TRANSFORMS", "FetchOnly", "Subset"]


def _import_like_python_m(mod_name: str, spec: str, what: str):
    """Import ``mod_name`` with the current directory searched first, as
    ``python -m`` does: the installed ``coordl`` command's ``sys.path`` starts
    with its own bin directory, not the directory it is run from, so
    ``coordl analyze --step mymodel:train_step`` did not find ``./mymodel.py``.
    The directory stays on ``sys.path`` (at the front, as under ``python -m``)
    so worker processes and pickled objects find the module too."""
    import sys

    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise  # the module was found; something it imports is missing: that error is the user's
        raise ValueError(f"{what}={spec!r}: no module named {e.name!r} in the current directory ({cwd}) "
                         f"or on sys.path; run coordl from the directory that holds {e.name}.py, or "
                         f"give a file: {what}=path/to/{mod_name.replace('.', '/')}.py:"
                         f"{spec.rpartition(':')[2]}") from None


def load_callable(spec: str, what: str) -> Callable:
    """``"package.module:name"`` or ``"path/to/file.py:name"`` -> the object.

    A module name is imported as ``python -m`` would: the current directory
    is searched first, then ``sys.path``."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f'{what} should be "module:callable" or "path/to/file.py:callable", but got '
                         f"{what}={spec!r}")
    mod_name, _, attr = spec.rpartition(":")
    if mod_name.endswith(".py"):
        path = os.path.abspath(mod_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{what}={spec!r}: no file {path}")
        modspec = importlib.util.spec_from_file_location(
            "_coordl_analyze_" + os.path.splitext(os.path.basename(path))[0], path)
        module = importlib.util.module_from_spec(modspec)
        modspec.loader.exec_module(module)
    else:
        module = _import_like_python_m(mod_name, spec, what)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{what}={spec!r}: {mod_name} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{what}={spec!r}: {attr} is not callable")
    return obj


def _rrc224():
    from .. import transforms as T
    return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor()])


def _rrc224u8():
    from .. import transforms as T
    return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])


def _center224():
    from .. import transforms as T
    return T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor()])


TRANSFORMS: dict[str, tuple[Callable, str]] = {
    "rrc224": (_rrc224, "RandomResizedCrop(224) + RandomHorizontalFlip() + ToTensor() (float CHW)"),
    "rrc224u8": (_rrc224u8, "RandomResizedCrop(224) + RandomHorizontalFlip() + PILToTensor() (uint8 CHW)"),
    "center224": (_center224, "Resize(256) + CenterCrop(224) + ToTensor() (validation)"),
}


def make_transform(spec: Any):
    """A transform from a name in :data:`TRANSFORMS`, a ``"module:callable"``
    returning one, or a transform object (returned as is)."""
    if spec is None or callable(spec):
        return spec
    if isinstance(spec, str) and spec in TRANSFORMS:
        return TRANSFORMS[spec][0]()
    if isinstance(spec, str) and ":" in spec:
        return load_callable(spec, "transform")()
    raise ValueError(f"transform should be one of {', '.join(TRANSFORMS)} or \"module:callable\", but got "
                     f"transform={spec!r}")


class FetchOnly:
    """``dataset`` with prep replaced by ``len(raw)``: a pass over it times the
    fetch stage alone (same reads, same node cache: same fingerprint)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def raw(self, i: int) -> bytes:
        return self.dataset.raw(i)

    def prep(self, raw: bytes, i: int):
        return torch.tensor(len(raw), dtype=torch.int64)

    def __getitem__(self, i: int):
        return self.prep(self.raw(i), i)

    def __getattr__(self, name: str):
        # fingerprint, sizes, describe, raw_uncached, raw_many: the wrapped dataset's
        if name in ("fingerprint", "sizes", "describe", "raw_uncached", "raw_many"):
            return getattr(self.dataset, name)
        raise AttributeError(name)


class Subset:
    """``n`` samples spread evenly over a two-stage ``dataset`` (every class
    of an ImageFolder is represented), keeping the two-stage protocol."""

    def __init__(self, dataset, n: int):
        total = len(dataset)
        self.dataset = dataset
        self.indices = [i * total // n for i in range(n)]
        sizes = getattr(dataset, "sizes", None)
        if sizes is not None:
            import numpy as np
            self.sizes = np.asarray(sizes)[self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def raw(self, i: int) -> bytes:
        return self.dataset.raw(self.indices[i])

    def prep(self, raw: bytes, i: int):
        return self.dataset.prep(raw, self.indices[i])

    def __getitem__(self, i: int):
        return self.dataset[self.indices[i]]

    def describe(self, i: int) -> str:
        from ..protocol import describe
        return describe(self.dataset, self.indices[i])

    def __getattr__(self, name: str):
        if name == "fingerprint" and callable(getattr(self.dataset, "fingerprint", None)):
            return lambda: f"{self.dataset.fingerprint()}-first-{len(self.indices)}-of-{len(self.dataset)}"
        if name == "raw_uncached" and callable(getattr(self.dataset, "raw_uncached", None)):
            return lambda i: self.dataset.raw_uncached(self.indices[i])
        raise AttributeError(name)
