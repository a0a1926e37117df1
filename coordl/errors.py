"""coordl's exceptions and warnings."""
from __future__ import annotations

__all__ = ["SampleError", "SkippedSampleWarning", "StateError", "sample_error"]


class SampleError(RuntimeError):
    """A sample could not be read or prepared.

    The message names the sample index and its location (path); the original
    exception is chained as ``__cause__`` (in a worker process its traceback is
    part of the message, as for any error raised in a torch DataLoader worker).
    Pass ``on_error="skip"`` to the loader to skip such samples instead.
    """


class SkippedSampleWarning(UserWarning):
    """Emitted once per sample skipped under ``on_error="skip"``."""


class StateError(ValueError):
    """A state dict cannot be restored into this loader (mismatched settings)."""


def sample_error(stage: str, index: int, where: str, err: BaseException) -> SampleError:
    """The one wording of a bad-sample error: stage, index, location, cause, remedy."""
    return SampleError(
        f"coordl: error {stage} sample {index} ({where}): {type(err).__name__}: {err}. "
        "Fix or remove the file, or pass on_error='skip' to the DataLoader to skip bad samples."
    )
