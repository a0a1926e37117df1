"""The prep stage's one step, raw bytes -> prepared sample, shared by every
placement: coordl's engine (``engine.Engine``, in workers or inline) and
the torch-machinery adapter (``torch_path.TwoStageFetch``).

It runs ``dataset.prep(raw, i)`` under the sample's own generator (keyed by
seed, epoch and index, so a sample gets the same augmentation wherever and
whenever it is prepared; and by how many times the index came before in
the pass, where a sampler repeats it), times it, counts it, and turns a failure of
either stage (reading, preparing) into the loader's one error policy:
``on_error="raise"`` raises ``SampleError[T]`` naming stage, index and path,
chained from the original; ``"skip"`` records ``(index, path, why)`` in the
batch's stats and returns :data:`SKIP`.
"""
from __future__ import annotations

import time

from .._rng import sample_rng
from ..errors import sample_error
from ..protocol import describe
from ..stats import BatchStats

__all__ = ["SKIP", "prep_sample", "failed"]

SKIP = object()  # what prep_sample returns for a sample skipped under on_error="skip"


def failed(dataset, i: int, stage: str, err: BaseException, stats: BatchStats, on_error: str):
    """A sample's ``stage`` raised ``err``: raise its ``SampleError`` (from
    ``err``), or record the skip and return :data:`SKIP`.  Anything that is not
    an ``Exception`` (``KeyboardInterrupt``) is never skipped."""
    where = describe(dataset, i)
    if on_error == "raise" or not isinstance(err, Exception):
        raise sample_error(stage, i, where, err) from err
    stats.skips.append((i, where, f"{stage}: {type(err).__name__}: {err}"))
    return SKIP


def prep_sample(dataset, seed: int, epoch: int, i: int, raw, read_error: BaseException | None,
                stats: BatchStats, on_error: str, again: int = 0):
    """Sample ``i`` prepared from ``raw`` (or the failure of its read,
    ``read_error``), or :data:`SKIP`; see the module docstring.  ``again``:
    how many times ``i`` came before in the pass (``coordl._rng.derive``)."""
    if read_error is not None:
        return failed(dataset, i, "reading", read_error, stats, on_error)
    t0 = time.perf_counter()
    try:
        with sample_rng(seed, epoch, i, again):
            sample = dataset.prep(raw, i)
    except Exception as e:
        return failed(dataset, i, "preparing", e, stats, on_error)
    stats.prep_s += time.perf_counter() - t0
    stats.samples += 1
    return sample
