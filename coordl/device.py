"""Device delivery: batches copied to the accelerator one batch ahead of the
training step, from a ring of pinned host buffers, on a dedicated stream.

For each batch the loader hands over (``DeviceDelivery.deliver``):

1. take ring slot ``k % ring``; if its previous copy may still be reading
   the slot's pinned buffers, wait for that copy's event (the only host
   wait, and only when the ring has gone round while copies lag);
2. copy the batch's tensors into the slot's pinned buffers (page-locked;
   allocated on first use and when a batch outgrows them);
3. on the copy stream: start the host-to-device copies
   (``non_blocking=True``), run the device tail (uint8 -> float and
   ``Normalize``, when the dataset's transform ends with them) and record
   the slot's event;
4. make the training stream wait for that event (on the device: the host
   does not block) and ``record_stream`` every delivered tensor on it, so the
   caching allocator never hands their memory to another tensor while the
   training stream may still use it.

Steps 1-3 (``stage``) run one batch ahead of the training loop in the pin
thread when the pipeline has workers (``_pin.PinThread`` with a ``stage``
function), step 4 (``hand_over``) in the training loop's thread, whose
current stream is the training stream (streams are per thread).  The copy
of batch ``k+1`` thus runs while the device still computes on batch ``k``;
the training stream can never read an unfinished copy, and no pinned
buffer is overwritten while a copy reads it.

The stream API is behind a seam (:class:`CudaStreams` / :class:`HostStreams`)
so the ring, the reuse rule and the tail are tested on a machine without an
accelerator (``HostStreams``: events that complete when the test says).
Only :class:`CudaStreams` touches ``torch.cuda``, and only when
``torch.cuda.is_available()``.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch

#: Test seam: ``device="cpu"`` runs the whole device path (ring, streams,
#: tail) with :class:`HostStreams` instead of being a no-op.
CPU_TEST_DEVICE = False

__all__ = ["DeviceDelivery", "Staged", "map_tensors", "DeviceTail", "CudaStreams", "HostStreams", "split_for_device", "streams_for"]


# ---------------------------------------------------------------- stream seam
class CudaStreams:
    """torch's CUDA streams and events (public API only)."""

    pin = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._copy = torch.cuda.Stream(device=device)

    def copy_stream(self):
        return self._copy

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use(self, stream):
        return torch.cuda.stream(stream)

    def event(self):
        return torch.cuda.Event()


class _HostEvent:
    """An event of :class:`HostStreams`: complete once ``complete()`` is called
    (or at once with ``auto=True``)."""

    def __init__(self, log: list, auto: bool) -> None:
        self._log = log
        self._auto = auto
        self.recorded = False
        self.done = False

    def record(self, stream=None) -> None:
        self.recorded = True
        self.done = self._auto
        self._log.append(("record", self))

    def query(self) -> bool:
        return self.done or not self.recorded

    def synchronize(self) -> None:
        self._log.append(("synchronize", self))
        self.done = True     # the host waited for it

    def complete(self) -> None:
        self.done = True


class _HostStream:
    def __init__(self, name: str, log: list) -> None:
        self.name = name
        self._log = log

    def wait_event(self, event) -> None:
        self._log.append(("wait_event", self.name, event))


class HostStreams:
    """Streams on the host: the CPU fallback seam of the device path (tests,
    and the CPU "device" of the test hook).  Every call is logged."""

    pin = False

    def __init__(self, auto: bool = True) -> None:
        self.log: list = []
        self._auto = auto
        self._copy = _HostStream("copy", self.log)
        self._current = _HostStream("current", self.log)

    def copy_stream(self):
        return self._copy

    def current_stream(self):
        return self._current

    def use(self, stream):
        import contextlib

        self.log.append(("use", stream.name))
        return contextlib.nullcontext()

    def event(self):
        return _HostEvent(self.log, self._auto)


def streams_for(device: torch.device):
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaStreams(device)
    return HostStreams()


# ---------------------------------------------------------------- the tail
class DeviceTail:
    """uint8 -> float in [0, 1] (as ``ToTensor``) then each ``Normalize``, on
    a batch of images ``[B, C, H, W]``, on whatever device it is: the same
    element-wise operations in the same order as the per-sample transforms,
    so the result is the same as preparing them on the CPU."""

    def __init__(self, normalizes: list) -> None:
        self.normalizes = list(normalizes)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            return images
        x = images.to(torch.get_default_dtype()).div_(255)
        for n in self.normalizes:
            x = n(x)
        return x

    def apply(self, batch: Any) -> Any:
        """The tail on the images of a default-collated batch: the batch
        itself, or the first element of a tuple/list batch."""
        if isinstance(batch, torch.Tensor):
            return self(batch)
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
            items = [self(batch[0]), *batch[1:]]
            if isinstance(batch, list):
                return items
            return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
        return batch

    def __repr__(self) -> str:
        return f"DeviceTail(float, {self.normalizes!r})"


def split_for_device(dataset) -> tuple[Any, DeviceTail | None]:
    """``(dataset', tail)``: when ``dataset.transform`` is a coordl ``Compose``
    ending in ``ToTensor`` and ``Normalize``s, ``dataset'`` is a shallow copy
    whose transform ends in ``PILToTensor`` instead (uint8 travels to the
    device) and ``tail`` does the rest there.  Otherwise ``(dataset, None)``.
    The user's dataset is never modified."""
    from . import transforms as T

    tf = getattr(dataset, "transform", None)
    if type(tf) is not T.Compose:
        return dataset, None
    ts = list(tf.transforms)
    k = len(ts)
    while k > 0 and type(ts[k - 1]) is T.Normalize:
        k -= 1
    if k == 0 or type(ts[k - 1]) is not T.ToTensor:
        return dataset, None
    if torch.get_default_dtype() != torch.float32:
        return dataset, None
    head = T.Compose(ts[:k - 1] + [T.PILToTensor()])
    mine = copy.copy(dataset)
    mine.transform = head
    return mine, DeviceTail(ts[k:])


# ---------------------------------------------------------------- delivery
def _leaves(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _leaves(v, out)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            _leaves(v, out)
    return out


def map_tensors(obj, fn: Callable):
    """``obj`` (tensors in dicts, lists, tuples, named tuples) with ``fn``
    applied to every tensor; anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


class _Slot:
    __slots__ = ("buffers", "event")

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.event = None       # the event of the last copy that read these buffers


class Staged:
    """A batch whose copy to the device was started (``stage``) but not yet
    handed to the training stream (``hand_over``)."""

    __slots__ = ("batch", "event")

    def __init__(self, batch, event) -> None:
        self.batch = batch
        self.event = event


class DeviceDelivery:
    """Copies batches to ``device`` through a ring of ``ring`` pinned slots
    (see the module doc).  ``streams``: :class:`CudaStreams` for CUDA,
    :class:`HostStreams` for tests; ``tail``: a :class:`DeviceTail` or None."""

    def __init__(self, device: torch.device, streams=None, tail: DeviceTail | None = None, ring: int = 3) -> None:
        if ring < 2:
            raise ValueError(f"ring should be >= 2 (one slot copying, one being filled), but got ring={ring!r}")
        self.device = device
        self.streams = streams if streams is not None else streams_for(device)
        self.tail = tail
        self.slots = [_Slot() for _ in range(ring)]
        self.k = 0
        self.waits = 0          # times the host had to wait for a slot's previous copy

    def _stage(self, slot: _Slot, batch) -> Any:
        """Copy ``batch``'s tensors into ``slot``'s pinned buffers (reused when
        they are large enough)."""
        leaves = _leaves(batch, [])
        bufs = slot.buffers
        while len(bufs) < len(leaves):
            bufs.append(torch.empty(0, dtype=torch.uint8))
        it = iter(range(len(leaves)))

        def put(t: torch.Tensor) -> torch.Tensor:
            j = next(it)
            nbytes = t.numel() * t.element_size()
            buf = bufs[j]
            if buf.numel() < nbytes:
                buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.streams.pin)
                bufs[j] = buf
            view = buf[:nbytes].view(t.dtype).view(t.shape) if nbytes else torch.empty(t.shape, dtype=t.dtype)
            view.copy_(t)
            return view

        return map_tensors(batch, put)

    def stage(self, batch) -> Staged:
        """Start ``batch``'s copy to the device (any thread: the pin thread
        does this one batch ahead of the training loop)."""
        st = self.streams
        slot = self.slots[self.k % len(self.slots)]
        self.k += 1
        if slot.event is not None and not slot.event.query():
            self.waits += 1
            slot.event.synchronize()     # its last copy still reads the pinned buffers
        host = self._stage(slot, batch)
        copy_stream = st.copy_stream()
        with st.use(copy_stream):
            # (copy=True: on the host "device" of the test seam too, never a view of the ring)
            dev = map_tensors(host, lambda t: t.to(self.device, non_blocking=True, copy=True))
            if self.tail is not None:
                dev = self.tail.apply(dev)
            event = st.event()           # one per batch: a later reuse of the slot re-records nothing
            event.record(copy_stream)
        slot.event = event
        return Staged(dev, event)

    def hand_over(self, staged: Staged) -> Any:
        """Give a staged batch to the calling thread's current stream (the
        training stream: per thread, so this runs in the training loop's)."""
        current = self.streams.current_stream()
        current.wait_event(staged.event)   # the training stream never reads an unfinished copy
        for t in _leaves(staged.batch, []):
            if t.device.type != "cpu":
                t.record_stream(current)   # the allocator keeps it until the training stream is done
        return staged.batch

    def deliver(self, batch) -> Any:
        """``stage`` then ``hand_over``, in the calling thread."""
        return self.hand_over(self.stage(batch))


def warn_pin_without_accelerator() -> None:
    warnings.warn("pin_memory=True has no effect: no accelerator is available, so batches stay in "
                  "pageable memory (on a machine with CUDA they are staged in pinned buffers)", stacklevel=4)
