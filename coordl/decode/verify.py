"""``coordl verify``: find the JPEG files a GPU decoder would decode only in part.

A GPU decoder (nvJPEG) given a JPEG whose entropy-coded data ends early or
is corrupt, its header and end marker intact, decodes it without an error
and leaves the pixels it could not decode undefined, where the CPU path
(libjpeg) fills them gray.  ``COORDL_DEVICE_CHECK_DATA=1`` has a
``decode="device"`` loader's workers check every file at every epoch
(about 0.8 ms of CPU per ImageNet-sized image); this checks a dataset once,
with the same check (:func:`coordl.decode.jpeg.entropy_data_complete`), in
threads (libjpeg-turbo runs without the GIL).

Files that are not JPEGs, CMYK/YCCK JPEGs, and JPEGs without their
end-of-image marker go to the CPU path on the device path anyway: the last
are reported too (cut short: the CPU path decides, with PIL's rules for
truncated files).
"""
from __future__ import annotations

import collections
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

__all__ = ["DAMAGED", "CUT_SHORT", "check_file", "damaged_jpegs"]

DAMAGED = "entropy-coded data ends early or is corrupt (a GPU decoder would leave part of the image undefined)"
CUT_SHORT = "no end-of-image marker (cut short: decoded on the CPU path, which decides)"


def check_file(path: str) -> str | None:
    """Why ``path`` is a damaged JPEG (:data:`DAMAGED`, :data:`CUT_SHORT`),
    or None (a whole JPEG, or not a JPEG the device decodes: a PNG, CMYK).
    OSError when it cannot be read."""
    from . import jpeg

    with open(path, "rb") as f:
        raw = f.read()
    hdr = jpeg._header(raw)
    if hdr is None or hdr[2] not in jpeg._FAST_COLORSPACES:
        return None
    if not jpeg._ends_with_eoi(raw):
        return CUT_SHORT
    return None if jpeg.entropy_data_complete(raw, int(hdr[0]), int(hdr[1])) else DAMAGED


def _files(roots: Iterable[str]) -> Iterator[str]:
    for root in roots:
        if os.path.isfile(root):
            yield root
            continue
        for d, dirs, names in os.walk(root):
            dirs.sort()
            for n in sorted(names):
                yield os.path.join(d, n)


def damaged_jpegs(roots: Iterable[str], threads: int | None = None) -> Iterator[tuple[str, str]]:
    """``(path, why)`` for each damaged JPEG under ``roots`` (folders,
    walked in sorted order, or files), in that order; a file that cannot
    be read is reported with its error."""
    threads = max(1, threads or os.cpu_count() or 1)

    def one(path):
        try:
            return path, check_file(path)
        except OSError as e:
            return path, f"cannot be read ({type(e).__name__}: {e})"

    # a bounded window of files in flight (a dataset of a million files is not a million futures)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="coordl-verify") as pool:
        window: collections.deque = collections.deque()
        for path in _files(roots):
            window.append(pool.submit(one, path))
            if len(window) >= 4 * threads:
                yield from _done(window.popleft())
        while window:
            yield from _done(window.popleft())


def _done(future) -> Iterator[tuple[str, str]]:
    path, why = future.result()
    if why is not None:
        yield path, why
