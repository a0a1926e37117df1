"""Sizes (cache_size, read_ahead) are whole numbers of bytes.

A float ``cache_size=1.5`` used to be truncated to 1 byte without a word.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from coordl import DataLoader
from coordl.base.units import parse_size


@pytest.mark.parametrize("name", ["cache_size", "read_ahead"])
@pytest.mark.parametrize("value", [1.5, "1.5", "1.5B", 0.5, 1e9 + 0.5, float("inf"), float("nan"), -1.0])
def test_size_that_is_not_whole_bytes_is_refused(name, value):
    ds = torch.utils.data.TensorDataset(torch.arange(4))
    with pytest.raises(ValueError) as info:
        DataLoader(ds, **{name: value})
    msg = str(info.value)
    assert msg.startswith(f"{name} should be ") and msg.endswith(f"but got {name}={value!r}"), msg


@pytest.mark.parametrize("value,expected", [
    (2e9, 2_000_000_000),            # a whole float: accepted
    (np.float64(4096.0), 4096),
    (np.int64(4096), 4096),
    ("1.5GiB", 3 << 29),             # a fraction with a unit is fine
    ("1.1GB", 1_100_000_000),        # exact, no float rounding
    ("1.3KiB", 1331),                # rounded down to whole bytes
    ("64MiB", 64 << 20),
    ("10", 10), ("10B", 10), (" 3 MB ", 3_000_000),
    (0, 0), (None, 0), (0.0, 0),
])
def test_whole_sizes_are_accepted(value, expected):
    assert parse_size(value, "cache_size") == expected
    assert parse_size(value, "read_ahead") == expected


def test_whole_float_read_ahead_reaches_the_loader():
    ds = torch.utils.data.TensorDataset(torch.arange(4))
    assert DataLoader(ds, read_ahead=2e6)._read_ahead == 2_000_000
