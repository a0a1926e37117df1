"""Batches collated in place by hand, as the engine does (for the tests of
``coordl.pipeline.collate``)."""
from __future__ import annotations

import numpy as np

from coordl.pipeline import collate as C


def written(samples: list, order, **layout_kw):
    """``samples`` written into a buffer of their layout (``layout_of(
    samples[0], len(samples), **layout_kw)``) in row ``order``, through
    ``row_targets`` as the engine writes them: ``(layout, buffer, targets)``."""
    lay = C.layout_of(samples[0], len(samples), **layout_kw)
    buf = np.zeros(lay.nbytes, dtype=np.uint8)
    targets = C.views(lay, buf)
    dests = C.row_targets(lay, targets)
    for r in order:
        C.write_row(dests, r, lay.leaves_of(samples[r]))
    return lay, buf, targets
