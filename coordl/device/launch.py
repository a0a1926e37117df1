"""Getting the stage's work onto the device, shared by its kernels: small
host arrays copied without a wait (:func:`upload`: the geometry's, the
jitter's and the erasing's per-batch parameters), and Triton kernels
launched on their tensors' device (:func:`launch`)."""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["upload", "launch"]


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


def launch(dev: torch.device, kernel, grid: tuple, args: tuple, kw: dict) -> None:
    """``kernel[grid](*args, **kw)`` on ``dev`` (Triton launches on the
    current device, on its current stream)."""
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            kernel[grid](*args, **kw)
    else:
        kernel[grid](*args, **kw)
