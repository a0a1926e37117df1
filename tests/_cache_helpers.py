"""A small on-disk folder dataset for the node cache tests: every file has
the same size (so a cache mix-up passes any length check) and random bytes
(so it cannot pass a content check).  Importable by spawned workers."""
from __future__ import annotations

import os

import numpy as np
import torch

import coordl


def make_folder(root, n: int = 96, size: int = 256, classes: int = 2, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    for c in range(classes):
        os.makedirs(os.path.join(root, f"class{c}"), exist_ok=True)
    for i in range(n):
        with open(os.path.join(root, f"class{i % classes}", f"s{i:05d}.bin"), "wb") as f:
            f.write(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return str(root)


def as_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def folder(root) -> coordl.DatasetFolder:
    return coordl.DatasetFolder(str(root), extensions=(".bin",), decode=as_tensor)


def file_bytes(ds) -> list[bytes]:
    """Each sample's file contents, read from disk, in dataset order."""
    out = []
    for path, _ in ds.samples:
        with open(path, "rb") as f:
            out.append(f.read())
    return out


def check_pass(loader, expected: list[bytes]) -> int:
    """Iterate one pass of an unshuffled loader; every delivered sample must
    be its own file's bytes.  Returns the number of samples checked."""
    k = 0
    for x, _y in loader:
        for row in x:
            got = bytes(row.numpy())
            assert got == expected[k], f"sample {k} delivered another sample's bytes"
            k += 1
    assert k == len(expected)
    return k
