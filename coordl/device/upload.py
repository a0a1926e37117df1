"""Small host arrays onto the device without a wait (the stage's, the
kernels' and the erasing's per-batch parameters)."""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["upload"]


def upload(arr: np.ndarray, dev: torch.device) -> torch.Tensor:
    """A small host array on ``dev``, in order on its current stream,
    without waiting for that stream: a copy from pageable memory with
    ``non_blocking=False`` synchronizes the stream (the pin thread would
    wait there for the previous batch's work on the GPU, spinning); from
    page-locked memory of torch's caching host allocator it is queued, and
    the allocator keeps the buffer until the copy has run."""
    t = torch.from_numpy(arr)
    if dev.type != "cuda":
        return t
    return t.pin_memory().to(dev, non_blocking=True)
