"""coordl: a drop-in torch DataLoader that stops training from waiting for data.

    from coordl import DataLoader   # instead of torch.utils.data.DataLoader

The names below are imported on first use: a process that only runs the
node daemon's hub or the command line (``coordl daemon status``) never
imports torch.  In a process that has imported torch already, the
DataLoader's module is imported with the package.
"""
from __future__ import annotations

import importlib as _importlib
from importlib import util as _util
import sys as _sys
import types as _types
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_WHERE = {
    "DataLoader": "loader",
    "ImageFolder": "datasets", "DatasetFolder": "datasets",
    "SampleError": "errors", "SkippedSampleWarning": "errors", "StateError": "errors",
    "EpochPlan": "plan", "plan": "plan",
    "TwoStageDataset": "protocol", "is_two_stage": "protocol",
    "EpochStats": "stats", "LoaderStats": "stats",
}

__all__ = [
    "DataLoader", "ImageFolder", "DatasetFolder", "transforms", "plan", "EpochPlan", "TwoStageDataset", "is_two_stage",
    "LoaderStats", "EpochStats", "SampleError", "SkippedSampleWarning", "StateError",
]

if TYPE_CHECKING:  # what static tools see; at run time each is imported where first used
    from . import transforms  # noqa: F401
    from .datasets import DatasetFolder, ImageFolder  # noqa: F401
    from .errors import SampleError, SkippedSampleWarning, StateError  # noqa: F401
    from .loader import DataLoader  # noqa: F401
    from .plan import EpochPlan, plan  # noqa: F401
    from .protocol import TwoStageDataset, is_two_stage  # noqa: F401
    from .stats import EpochStats, LoaderStats  # noqa: F401


def __getattr__(name: str) -> object:
    where = _WHERE.get(name)
    if where is not None:
        # not cached in the package's namespace: what it holds stays the same in every process, whatever
        # each used (the daemon's code identity reads it: coordl.daemon.codeid)
        return getattr(_importlib.import_module("." + where, __name__), name)
    if not name.startswith("_") and _util.find_spec(f"{__name__}.{name}") is not None:
        return _importlib.import_module("." + name, __name__)   # a submodule, as when __init__ imported it
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | {"__version__"} | {k for k, v in globals().items()
                                                   if isinstance(v, _types.ModuleType) and not k.startswith("_")})


class _Package(_types.ModuleType):
    """``coordl.plan`` is the function :func:`coordl.plan.plan`, as it has
    always been, although a module of that name exists: importing the
    module ``coordl.plan`` (which any ``from .plan import ...`` inside the
    package does) would otherwise set the package's attribute to it."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "plan" and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package

if "torch" in _sys.modules:
    # a training process (torch is imported already): the DataLoader class exists from here on, as torch's
    # subclasses do once imported, so that tools which patch every subclass of torch's DataLoader for a
    # while (PyTorch Lightning, around its *_dataloader hooks, to record the arguments each is built with)
    # find it even when the script first names coordl.DataLoader inside such a hook
    _importlib.import_module(".loader", __name__)
