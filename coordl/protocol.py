"""The two-stage sample protocol.

A map-style dataset is *two-stage* when it exposes

``raw(i) -> bytes``
    The sample's stored bytes, exactly as they are in storage (an encoded JPEG,
    a serialized record).  I/O only, no decoding: coordl caches and shares
    these bytes, so they must not depend on the epoch or on randomness.

``prep(raw, i) -> sample``
    Decode and augment ``raw`` into what ``__getitem__(i)`` would return.  CPU
    only, no I/O.  Random augmentations must draw from
    ``coordl.transforms``' generators (or ``coordl._rng.current()``) so that a
    sample's augmentation is a pure function of (seed, epoch, index).

and optionally

``describe(i) -> str``
    A human-readable location of the sample (a path), used in error messages.

``raw_many([i, ...]) -> [bytes | Exception, ...]``
    Several samples' bytes in one call, for storage that fetches many objects
    concurrently (``ImageFolder`` over an fsspec URL has it); the fetch stage
    then batches reads that are already admitted.

``raw_uncached(i) -> bytes``
    ``raw(i)`` leaving no copy in the OS page cache; the fetch stage uses it
    when the node cache keeps the bytes (``ImageFolder`` over local files has
    it: it drops the pages on the read's own descriptor).

``fingerprint() -> str`` and ``sizes`` (int64 array)
    Identity of the stored bytes (needed for the node cache, which is named
    after it) and the file sizes (used to budget read-ahead and to verify
    cache entries).

``__len__`` is required; ``__getitem__(i)`` should equal ``prep(raw(i), i)``
so the dataset also works under torch's own DataLoader.

``coordl.ImageFolder`` implements the protocol; ``coordl.datasets.two_stage``
adapts a torchvision-style ``ImageFolder``/``DatasetFolder``.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["TwoStageDataset", "is_two_stage", "describe"]


@runtime_checkable
class TwoStageDataset(Protocol):
    """A map-style dataset whose samples come in two stages, ``raw`` then
    ``prep`` (the module's description says what each must and must not
    do, and the optional methods coordl uses when present)."""

    def __len__(self) -> int: ...

    def raw(self, index: int) -> bytes:
        """Sample ``index``'s stored bytes, exactly as in storage: I/O only."""
        ...

    def prep(self, raw: bytes, index: int) -> Any:
        """``raw`` decoded and augmented into what ``dataset[index]`` returns: CPU only."""
        ...


def is_two_stage(dataset: Any) -> bool:
    """True when ``dataset`` implements ``raw``, ``prep`` and ``__len__``."""
    return (
        callable(getattr(dataset, "raw", None))
        and callable(getattr(dataset, "prep", None))
        and hasattr(dataset, "__len__")
    )


def describe(dataset: Any, index: int) -> str:
    """Where sample ``index`` lives, for error messages."""
    fn = getattr(dataset, "describe", None)
    if callable(fn):
        try:
            return str(fn(index))
        except Exception:  # describing must never mask the real error
            pass
    return f"{type(dataset).__name__}[{index}]"
