"""The sample table of a folder dataset: ``(path, target)`` for every sample,
with the file's size and mtime as the scan found them, held in numpy.

The sample list is kept as one ``uint8`` buffer of relative paths plus
``int64`` offsets, targets, file sizes and mtimes, never as a Python list of
strings (see :mod:`coordl.datasets` for why).  :class:`SampleTable` holds it
and gives the attributes torchvision's folder datasets have over it
(``samples``, ``imgs``, ``targets``) plus ``sizes``, ``mtimes_ns`` and the
``fingerprint`` a cache names its storage after; :class:`FolderSamples` is
the read-only ``samples`` view.  The dataset classes of
:mod:`coordl.datasets` are sample tables; ``FolderSamples`` is public there.
"""
from __future__ import annotations

import hashlib
import operator
import os
from collections.abc import Sequence
from typing import Any, Iterable, Iterator

import numpy as np

from .listing import _split_prefix, _stat_paths

_FINGERPRINT_TAG = b"coordl.datasets.folder/2\0"


class FolderSamples(Sequence):
    """Read-only sequence of ``(path, class_index)`` tuples over a folder
    dataset's numpy storage; what ``dataset.samples`` returns.

    Compares equal to any sequence of the same tuples (a list, say); slicing
    returns a list.
    """

    __slots__ = ("_ds",)

    def __init__(self, dataset: "SampleTable"):
        self._ds = dataset

    def __len__(self) -> int:
        return len(self._ds._targets)

    def __getitem__(self, index):
        ds = self._ds
        if isinstance(index, slice):
            return [(ds._path(i), int(ds._targets[i])) for i in range(*index.indices(len(self)))]
        i = ds._check_index(index)
        return ds._path(i), int(ds._targets[i])

    def __iter__(self) -> Iterator[tuple[str, int]]:
        ds = self._ds
        buf = ds._paths.tobytes()
        offs = ds._offsets.tolist()
        prefix, join, dec = ds._prefix, os.path.join, os.fsdecode
        for k, t in enumerate(ds._targets.tolist()):
            yield join(prefix, dec(buf[offs[k]:offs[k + 1]])), t

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FolderSamples) or isinstance(other, (list, tuple)):
            return len(self) == len(other) and all(
                tuple(a) == tuple(b) for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        n = len(self)
        head = ", ".join(repr(s) for s in self[:3])
        more = f", ... ({n} samples)" if n > 3 else ""
        return f"FolderSamples([{head}{more}])"



def _ro(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


class SampleTable:
    """Numpy-backed ``(path, target)`` storage: the sample table a folder
    dataset is (``coordl.datasets._FolderBase`` adds the two-stage protocol).

    Set by ``_set_table`` (from a scan) or ``_set_samples`` (from
    ``(path, target)`` pairs); ``_store`` is the dataset's remote store, if any.
    """

    _store = None  # an FsspecStore for URL roots (reads through obstore when it can)

    def __getstate__(self) -> dict:
        # the digests are computed when first asked and kept: a cache of this process's, never part of what
        # travels or is compared (share=True keys its group by the pickled dataset, at every pass)
        return {**self.__dict__, "_fingerprint": None, "_sample_digest": None}
    # -- storage ----------------------------------------------------------

    def _set_table(self, prefix: str, names: list[bytes], targets, sizes, mtimes, versions=None) -> None:
        lengths = np.fromiter((len(b) for b in names), dtype=np.int64, count=len(names))
        offsets = np.zeros(len(names) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        self._prefix = prefix
        self._paths = np.frombuffer(b"".join(names), dtype=np.uint8).copy()
        self._offsets = offsets
        self._targets = np.asarray(targets, dtype=np.int64).reshape(-1).copy()
        self._sizes = np.asarray(sizes, dtype=np.int64).reshape(-1).copy()
        self._mtimes = np.asarray(mtimes, dtype=np.int64).reshape(-1).copy()
        # what a remote store reports per object (ETag, version id, ...), as one digest
        self._versions = b""
        if versions is not None:
            h = hashlib.blake2b(digest_size=16)
            for v in versions:
                b = str(v or "").encode()
                h.update(len(b).to_bytes(8, "little"))
                h.update(b)
            self._versions = h.digest()
        self._fingerprint = None
        self._sample_digest = None

    def _set_samples(self, samples: Iterable[tuple[Any, int]], root: str | None) -> None:
        paths, targets = [], []
        for path, target in samples:
            paths.append(os.fsdecode(os.fspath(path)))
            targets.append(operator.index(target))
        sizes, mtimes = _stat_paths(paths)
        prefix, names = _split_prefix(root, paths)
        fsencode = os.fsencode
        self._set_table(prefix, [fsencode(n) for n in names], targets, sizes, mtimes)

    def _check_index(self, index) -> int:
        i = operator.index(index)
        n = len(self._targets)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for {type(self).__name__} of length {n}")
        return i

    def _path(self, i: int) -> str:
        a, b = self._offsets[i], self._offsets[i + 1]
        return os.path.join(self._prefix, os.fsdecode(self._paths[a:b].tobytes()))

    # -- torchvision attributes ---------------------------------------------

    @property
    def samples(self) -> FolderSamples:
        """``(path, class_index)`` for every sample, as a read-only sequence.

        Assigning a sequence of such tuples replaces the samples (the way
        torchvision code takes a subset); sizes and mtimes are read again.
        """
        return FolderSamples(self)

    @samples.setter
    def samples(self, value: Iterable[tuple[Any, int]]) -> None:
        root = getattr(self, "root", None)
        self._set_samples(list(value), os.fspath(root) if root is not None else None)

    imgs = samples

    @property
    def targets(self) -> list[int]:
        """The class index of every sample (a new list on each access).

        Assigning a sequence of ints of the right length replaces the class
        indices, which ``__getitem__`` then returns too (in torchvision the
        ``targets`` list and the targets in ``samples`` are separate copies).
        """
        return self._targets.tolist()

    @targets.setter
    def targets(self, value: Iterable[int]) -> None:
        t = np.asarray([operator.index(v) for v in value], dtype=np.int64)
        if t.shape != self._targets.shape:
            raise ValueError(f"targets should have {len(self._targets)} entries, but got {len(t)}")
        self._targets = t
        self._sample_digest = None

    @property
    def sizes(self) -> np.ndarray:
        """File sizes in bytes when the folder was scanned (-1: unreadable),
        as a read-only int64 array."""
        return _ro(self._sizes)

    @property
    def mtimes_ns(self) -> np.ndarray:
        """File modification times (ns) when the folder was scanned."""
        return _ro(self._mtimes)

    def fingerprint(self) -> str:
        """Hex digest of where the samples are (the resolved root directory,
        or the URL), their paths relative to it, sizes and mtimes, and for a
        remote store the version it reports per object (ETag, version id,
        generation), as recorded by the scan.

        Stable for an unchanged folder, different once a file is added,
        removed, renamed, resized, touched or (remote) re-uploaded, and for
        two copies of a dataset in different places (rescan: create a new
        dataset).  A cache of raw bytes can name its storage after it.  A
        remote store that reports neither mtimes nor versions cannot tell a
        rewritten object of the same size: clear the cache after such a change.
        """
        if self._fingerprint is None:
            h = hashlib.blake2b(digest_size=16)
            h.update(_FINGERPRINT_TAG)
            where = self._where()
            h.update(len(where).to_bytes(8, "little"))
            h.update(where)
            h.update(self._versions)
            h.update(np.int64(len(self._sizes)).astype("<i8").tobytes())
            h.update(self._offsets.astype("<i8").tobytes())
            h.update(self._paths.tobytes())
            h.update(self._sizes.astype("<i8").tobytes())
            h.update(self._mtimes.astype("<i8").tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def sample_digest(self) -> str:
        """Hex digest of what the samples are, wherever the folder lives:
        their paths relative to the root, class indices and file sizes (no
        location, no mtimes).  A loader's state carries it, so a mid-epoch
        state resumes on a copy of the dataset in another place, and never
        on another dataset of the same length."""
        d = getattr(self, "_sample_digest", None)
        if d is None:
            h = hashlib.blake2b(digest_size=16)
            h.update(b"coordl.samples/1\0")
            h.update(np.int64(len(self._sizes)).astype("<i8").tobytes())
            h.update(self._offsets.astype("<i8").tobytes())
            h.update(self._paths.tobytes())
            h.update(self._targets.astype("<i8").tobytes())
            h.update(self._sizes.astype("<i8").tobytes())
            d = self._sample_digest = h.hexdigest()
        return d

    def _where(self) -> bytes:
        """The samples' location for the fingerprint: the URL of a remote
        store, else the resolved prefix directory (or working directory, for
        relative paths under no common prefix)."""
        if self._store is not None:
            return b"url:" + self._store.location().encode()
        if self._prefix:
            return b"dir:" + os.fsencode(os.path.realpath(self._prefix))
        starts = self._paths[self._offsets[:-1][self._offsets[:-1] < len(self._paths)]]
        if (starts != ord("/")).any():
            return b"cwd:" + os.fsencode(os.path.realpath(os.getcwd()))
        return b"abs:"
