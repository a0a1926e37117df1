"""Loading torchvision in the test suite (tests and benchmarks only).

The PyPI torchvision wheel that matches torch 2.13 ships compiled operators
(``torchvision/_C.so``: nms, roi_align, ...) built against torch's CUDA
build.  Beside the CPU build of torch they fail to load, which torchvision
tolerates, except for two import-time fake-tensor registrations
(``torch.library.register_fake("torchvision::nms")`` and ``"::qnms"`` in
``torchvision/_meta_registrations.py``) that raise ``RuntimeError: operator
torchvision::nms does not exist``; so ``import torchvision`` raises.

:func:`import_torchvision` imports it as it is when that works (a CUDA
build, or a CPU wheel of torchvision).  Otherwise it declares the schemas of
those two operators, without any kernel, in the ``torchvision`` operator
namespace, so that the registrations find them, and imports again.  Calling
``torchvision.ops.nms`` then raises (no kernel), as the operators were
unusable anyway; datasets and transforms never call them.  Nothing of
torchvision is modified.  coordl itself never does this: the library only
reads torchvision objects the user already made.
"""
from __future__ import annotations

import sys

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_keep = []  # the Library objects must outlive the import (their definitions go with them)


def import_torchvision():
    """``torchvision``, or None when it is not installed."""
    try:
        import torchvision
        return torchvision
    except ImportError:
        return None
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]  # the half-imported package
    import torch.library

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        try:
            lib.define(schema)
        except RuntimeError:  # already defined (a partial earlier load)
            pass
    _keep.append(lib)
    import torchvision
    return torchvision
