"""Delivery onto the accelerator: the last stage, in the main process.

The modules (private):

- ``delivery``: the ring of pinned host buffers, the copy stream and its
  events, ``record_stream``; torch's pin_memory container rules; the
  host-stream seam the CPU tests use;
- ``split``: the transform split (uint8 leaves prepared on the CPU, marked)
  and the device tail (float conversion and Normalize on the device);
- ``pin``: the pin thread (with worker processes) and inline pinning
  (``num_workers=0``) for ``pin_memory=True``;
- ``encoded``, ``decode``: ``decode="device"``, the prep side (which
  transforms the device runs, the records and compressed bytes a sample
  carries) and the main process's stage (batched GPU decode, crop,
  resize, flip, the tail, the fallbacks); ``decoders``: the JPEG
  decoders it calls (torchvision's, nvImageCodec's, several sharing a
  batch, a CPU decoder standing in for tests); ``geometry_kernel``: a
  batch's crop and resize in one Triton launch;
- ``waits``: how the process's threads wait for the GPU
  (``COORDL_CUDA_WAIT``: the device's scheduling flag, through the driver).

Public names (``from coordl.device import ...``, the names ``coordl.device``
had as one module): :class:`DeviceDelivery`, :class:`Staged`, :func:`walk`,
:class:`DeviceTail`, :class:`CudaStreams`, :class:`HostStreams`,
:func:`split_for_device`, :class:`SplitPrep`, :class:`Split`,
:func:`streams_for`.  Users reach all of this through
``DataLoader(device=..., decode=...)``.
"""
from .delivery import (  # noqa: F401
    CudaStreams, DeviceDelivery, HostStreams, Staged, map_tensors, streams_for, walk, warn_pin_without_accelerator,
)
from .split import DeviceTail, Split, SplitPrep, split_for_device  # noqa: F401

__all__ = ["DeviceDelivery", "Staged", "walk", "DeviceTail", "CudaStreams", "HostStreams", "split_for_device",
           "SplitPrep", "Split", "streams_for"]
