"""Parsing sizes such as ``"20GiB"``, ``"512MB"`` or ``"50%"``."""
from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction

import psutil

__all__ = ["parse_size", "env_number", "env_seconds"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z%]*)\s*$")


def parse_size(value, name: str = "cache_size") -> int:
    """Bytes from an int, a string with a unit, or a percentage of available memory.

    ``0`` and ``None`` give 0 (disabled). A size must be a whole number of
    bytes: an int, a float with no fractional part (``2e9``), or a string
    without a unit (or with ``B``) that is whole (``"1.5"`` is refused, not
    truncated to 1 byte). A string with a larger unit may have a fraction
    (``"1.5GiB"``); it is rounded down to whole bytes.
    """
    hint = (f'{name} should be a number of bytes (whole: an int, or a float without a fraction like 2e9), '
            f'a string like "20GiB" or "512MB", or a percentage of available memory like "50%"')
    if value is None:
        return 0
    if isinstance(value, bool):
        raise ValueError(f"{hint}, but got {name}={value!r}")
    if isinstance(value, numbers.Integral):
        if value < 0:
            raise ValueError(f"{hint}, but got {name}={value!r}")
        return int(value)
    if isinstance(value, numbers.Real):
        value_f = float(value)
        if not math.isfinite(value_f) or value_f < 0 or not value_f.is_integer():
            raise ValueError(f"{hint}, but got {name}={value!r}")
        return int(value_f)
    if not isinstance(value, str):
        raise ValueError(f"{hint}, but got {name}={value!r}")
    m = _RE.match(value)
    if not m:
        raise ValueError(f"{hint}, but got {name}={value!r}")
    num, unit = Fraction(m.group(1)), m.group(2).lower()  # exact: "1.1GB" is 1100000000 bytes
    if unit == "%":
        if not 0 <= num <= 100:
            raise ValueError(f"{hint} (0% to 100%), but got {name}={value!r}")
        return int(psutil.virtual_memory().available * num / 100)
    if unit not in _UNITS:
        raise ValueError(f"{hint} (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), but got {name}={value!r}")
    nbytes = num * _UNITS[unit]
    if _UNITS[unit] == 1 and nbytes.denominator != 1:
        raise ValueError(f"{hint}, but got {name}={value!r}")
    return int(nbytes)  # rounds a fraction of a byte down ("1.3KiB" -> 1331)


def env_number(name: str, default: float, minimum: float, *, strict: bool = False,
               what: str = "a number") -> float:
    """A number from the environment variable ``name`` (``default`` when it is
    unset or blank), at least ``minimum`` (above it when ``strict``); a bad
    value's error names the variable and what it should be."""
    import os

    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"{name} should be {what}, but got {name}={v!r}") from None
    if not (x > minimum if strict else x >= minimum):
        raise ValueError(f"{name} should be {'>' if strict else '>='} {minimum:g}, but got {name}={v!r}")
    return x


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable ``name``."""
    return env_number(name, default, 0.0, strict=True, what="a number of seconds")
