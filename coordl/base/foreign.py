"""Other libraries' classes recognized by their module and name, never
imported (torchvision's folders, timm's dataset), and the checks that say
why such an object cannot be read as raw bytes + prep."""
from __future__ import annotations

from typing import Any

__all__ = ["class_named", "why_overridden", "why_not_callable"]


def class_named(cls: type, module: str, name: str) -> type | None:
    """The class in ``cls``'s MRO defined as ``module.name``, or None."""
    for c in cls.__mro__:
        if c.__module__ == module and c.__name__ == name:
            return c
    return None


def why_overridden(cls: type, base: type, attrs=("__getitem__", "__len__"), what: str = "") -> str | None:
    """Why ``cls`` is not ``base`` for coordl's reading (the first of
    ``attrs`` it overrides, ``what`` naming it), or None."""
    for attr in attrs:
        if getattr(cls, attr) is not getattr(base, attr):
            return (f"{what or cls.__name__} overrides {attr}, which coordl cannot prove equivalent to raw bytes "
                    "+ prep")
    return None


def why_not_callable(obj: Any, attrs=("transform", "target_transform")) -> str | None:
    """Why coordl cannot run ``obj``'s transforms (one set but not
    callable), or None."""
    for attr in attrs:
        fn = getattr(obj, attr, None)
        if fn is not None and not callable(fn):
            return f"its {attr} {fn!r} is not callable, so coordl cannot run it"
    return None
