"""The two steps every optional C extension of this package goes through
before its front module (``jpeg``, ``resample``, ``color``) uses it.

- :func:`load`: the compiled module, or None where it was not built (``pip
  install`` builds it only where a C compiler, and for ``_jpegcrop`` the
  libjpeg headers, are there); the front then runs PIL or decodes whole
  JPEGs, and says so at debug level.
- :func:`once`: the check that the extension reproduces the installed PIL,
  run by the first caller only, once per process, whichever thread asks.
"""
from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType
from typing import Any, Callable

__all__ = ["load", "once"]


def load(name: str, log: logging.Logger, without: str) -> ModuleType | None:
    """``coordl.decode.<name>``, or None (logged to ``log`` at debug level
    with ``without``, what runs instead) where it cannot be imported."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError as e:  # not built here
        log.debug("coordl.decode.%s is not available (%s): %s", name, e, without)
        return None


def once(memo: list, lock: threading.Lock, check: Callable[[], Any]) -> Any:
    """``check()``'s result, kept in ``memo`` (a list, empty until the
    first call, then holding the result): other threads wait on ``lock``
    while the first one checks.  Callers pass their module's list, so that
    emptying it (tests do) runs the check again."""
    if not memo:
        with lock:
            if not memo:
                memo.append(check())
    return memo[0]
