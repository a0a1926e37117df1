"""A bounded memo: what a function makes per key, kept until the memo holds
as many entries as its limit, then emptied and started again (keys that
depend on an image's size, of which a dataset without a crop has many)."""
from __future__ import annotations

from typing import Any, Callable

_MISSING = object()


def kept(memo: dict, key: Any, make: Callable[[], Any], limit: int) -> Any:
    """``memo[key]``, made by ``make()`` when missing (``memo`` emptied
    first when it holds ``limit`` entries); None is a value like any other."""
    got = memo.get(key, _MISSING)
    if got is _MISSING:
        if len(memo) >= limit:
            memo.clear()
        got = memo[key] = make()
    return got
