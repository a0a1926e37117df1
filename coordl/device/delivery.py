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
   ``Normalize``) on the leaves the split marked (the batch's
   ``BatchStats.device_marks``, see "the split" below) and record the
   slot's event;
4. make the training stream wait for that event (on the device: the host
   does not block) and ``record_stream`` every delivered tensor on it, so the
   caching allocator never hands their memory to another tensor while the
   training stream may still use it.

Steps 1-3 (``stage``) run one batch ahead of the training loop in the pin
thread when the pipeline has workers (``pin.PinThread`` with a ``stage``
function), step 4 (``hand_over``) in the training loop's thread, whose
current stream is the training stream (streams are per thread).  The copy
of batch ``k+1`` thus runs while the device still computes on batch ``k``;
the training stream can never read an unfinished copy, and no pinned
buffer is overwritten while a copy reads it.

Batches of torch's machinery (plain map-style datasets, ``TensorDataset``)
skip the ring (``send``): the loader has torch's iterator pin them (torch's
pin thread, off the training thread), and the copy starts from torch's
page-locked batch; nothing is copied twice.  Which containers are walked
(to copy, pin, ``record_stream``) follows torch's ``pin_memory`` exactly
(:func:`walk`).

The stream API is behind a seam (:class:`CudaStreams` / :class:`HostStreams`)
so the ring, the reuse rule and the tail are tested on a machine without an
accelerator (``HostStreams``: events that complete when the test says).
Only :class:`CudaStreams` touches ``torch.cuda``, and only when
``torch.cuda.is_available()``.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from collections import abc
from typing import Any, Callable

import torch

from .split import DeviceTail, Split, SplitPrep, _replace_at, split_for_device  # noqa: F401  (re-exported)

#: Test seam: ``device="cpu"`` runs the whole device path (ring, streams,
#: tail) with :class:`HostStreams` instead of being a no-op.
CPU_TEST_DEVICE = False

__all__ = ["DeviceDelivery", "Staged", "walk", "DeviceTail", "CudaStreams", "HostStreams", "split_for_device",
           "SplitPrep", "Split", "streams_for"]


# ---------------------------------------------------------------- stream seam
class CudaStreams:
    """torch's CUDA streams and events (public API only)."""

    pin = True

    #: the copy stream's priority (lower is higher; torch maps it into the device's range): the
    #: loader's copies, geometry and conversion are few, short and on the training step's critical
    #: path, so the GPU schedules them ahead of the training kernels that fill it
    PRIORITY = -1

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._copy = torch.cuda.Stream(device=device, priority=self.PRIORITY)

    def copy_stream(self):
        return self._copy

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use(self, stream):
        return torch.cuda.stream(stream)

    def event(self):
        # blocking: a host wait on it (a ring slot whose copy still runs) sleeps until the GPU is done,
        # instead of keeping a core busy polling (coordl.device.waits)
        return torch.cuda.Event(blocking=True)


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


# ------------------------------------------------------- torch's container rules
def walk(data, on_tensor: Callable, on_object: Callable, on_other: Callable | None = None):
    """``data`` rebuilt with ``on_tensor`` applied to each tensor and
    ``on_object`` to each object with a ``pin_memory()`` method, walking
    exactly the containers torch's ``pin_memory`` walks (torch 2.13,
    ``torch/utils/data/_utils/pin_memory.py``): a Mapping (a mutable one is
    copied with ``copy.copy`` and updated, another rebuilt as
    ``type(data)({...})``, a plain dict when either raises TypeError); a
    namedtuple (``type(data)(*items)``); any other tuple
    (``type(data)(items)``); a Sequence other than str/bytes (a mutable one
    copied and assigned item by item, another rebuilt as ``type(data)([...])``,
    a list on TypeError).  Anything else (dataclasses included, which torch
    does not walk either) is returned as it is, after ``on_other(data)``."""
    def go(x):
        if isinstance(x, torch.Tensor):
            return on_tensor(x)
        if hasattr(x, "pin_memory"):
            return on_object(x)
        if isinstance(x, (str, bytes)):
            return x
        if isinstance(x, abc.Mapping):
            try:
                if isinstance(x, abc.MutableMapping):
                    clone = copy.copy(x)
                    clone.update({k: go(v) for k, v in x.items()})
                    return clone
                return type(x)({k: go(v) for k, v in x.items()})
            except TypeError:
                return {k: go(v) for k, v in x.items()}
        if isinstance(x, tuple):
            if hasattr(x, "_fields"):
                return type(x)(*(go(v) for v in x))
            return type(x)(go(v) for v in x)
        if isinstance(x, abc.Sequence):
            try:
                if isinstance(x, abc.MutableSequence):
                    clone = copy.copy(x)
                    for i, v in enumerate(x):
                        clone[i] = go(v)
                    return clone
                return type(x)([go(v) for v in x])
            except TypeError:
                return [go(v) for v in x]
        if on_other is not None:
            on_other(x)
        return x

    return go(data)


_warned_types: set = set()


def _warn_unwalked(x) -> None:
    """A dataclass in a batch stays where it is (torch's pin_memory does not
    walk dataclasses, and coordl follows it): say so once per type."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in _warned_types:
        _warned_types.add(type(x))
        warnings.warn(
            f"device=: a {type(x).__name__} (a dataclass) in the batch is delivered as it is, its tensors "
            "on the CPU: torch's pin_memory does not walk dataclasses, and neither does coordl. Give "
            f"{type(x).__name__} pin_memory() and to(device, non_blocking=False) methods, or return a dict "
            "or a namedtuple", stacklevel=6)


def _move_object(obj, device: torch.device):
    """An object with ``pin_memory()`` (torch's rule for custom batches) goes
    to the device through its own ``to()``."""
    to = getattr(obj, "to", None)
    if not callable(to):
        raise TypeError(
            f"device={str(device)!r}: the batch holds a {type(obj).__name__}, which has pin_memory() but no "
            f"to(): coordl cannot move it to the device. Give {type(obj).__name__} a "
            "to(device, non_blocking=False) method, or pass device=None and move it yourself")
    return to(device, non_blocking=True)


# ---------------------------------------------------------------- delivery
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
        self.sent = 0           # batches of torch's machinery sent without the ring

    def _stage(self, slot: _Slot, batch) -> Any:
        """Copy ``batch``'s tensors into ``slot``'s pinned buffers (reused when
        they are large enough); objects with ``pin_memory()`` pin themselves
        (torch's rule)."""
        bufs = slot.buffers
        count = [0]
        pin = self.streams.pin

        def put(t: torch.Tensor) -> torch.Tensor:
            j = count[0]
            count[0] += 1
            if j == len(bufs):
                bufs.append(torch.empty(0, dtype=torch.uint8))
            nbytes = t.numel() * t.element_size()
            buf = bufs[j]
            if buf.numel() < nbytes:
                buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
                bufs[j] = buf
            view = buf[:nbytes].view(t.dtype).view(t.shape) if nbytes else torch.empty(t.shape, dtype=t.dtype)
            view.copy_(t)
            return view

        return walk(batch, put, (lambda o: o.pin_memory()) if pin else (lambda o: o))

    def _start_copy(self, host, paths, after=None) -> Staged:
        st = self.streams
        copy_stream = st.copy_stream()
        with st.use(copy_stream):
            # (copy=True: on the host "device" of the test seam too, never a view of the source)
            dev = walk(host, lambda t: t.to(self.device, non_blocking=True, copy=True), lambda o: o,
                       _warn_unwalked)
            if paths and self.tail is not None:
                dev = self.tail.apply(dev, paths, after)
            event = st.event()           # one per batch: a later reuse of the slot re-records nothing
            event.record(copy_stream)
        return Staged(dev, event)

    def stage(self, batch, paths=(), after=None, replace=None) -> Staged:
        """Start ``batch``'s copy to the device through the pinned ring (any
        thread: the pin thread does this one batch ahead of the training
        loop); the tail converts the images at ``paths`` there (with each
        row's jitter operations and erasing rectangles ``after``, per row,
        per path).
        ``replace``: ``{path: tensor}`` already on the device, made on the
        copy stream, that take the places of the leaves at those paths
        (``decode="device"``: the images in place of their records)."""
        slot = self.slots[self.k % len(self.slots)]
        self.k += 1
        if slot.event is not None and not slot.event.query():
            self.waits += 1
            slot.event.synchronize()     # its last copy still reads the pinned buffers
        staged = self._start_copy(self._stage(slot, batch), paths, after)
        for path, image in (replace or {}).items():
            # made on the copy stream before this copy: the staged batch's event covers them too
            staged.batch = _replace_at(staged.batch, path, lambda _record, image=image: image)
        slot.event = staged.event
        return staged

    def hand_over(self, staged: Staged) -> Any:
        """Give a staged batch to the calling thread's current stream (the
        training stream: per thread, so this runs in the training loop's).
        Objects with ``pin_memory()`` are moved here, by their own ``to()``,
        on the training stream (their tensors cannot be ``record_stream``ed)."""
        current = self.streams.current_stream()
        current.wait_event(staged.event)   # the training stream never reads an unfinished copy

        def keep(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "cpu":
                t.record_stream(current)   # the allocator keeps it until the training stream is done
            return t

        return walk(staged.batch, keep, lambda o: _move_object(o, self.device))

    def deliver(self, batch, paths=(), after=None) -> Any:
        """``stage`` then ``hand_over``, in the calling thread."""
        return self.hand_over(self.stage(batch, paths, after))

    def send(self, batch) -> Any:
        """A batch from torch's machinery to the device without the ring:
        torch's pin thread already put it in page-locked memory (the loader
        asks torch's iterator to pin when the device is CUDA), so the copy
        starts straight from it on the copy stream; the host memory stays
        valid until the copy ends (torch's caching host allocator records
        the copy's stream).  No second host copy, nothing staged here."""
        self.sent += 1
        return self.hand_over(self._start_copy(batch, ()))


def map_tensors(obj, fn: Callable):
    """``obj`` with ``fn`` applied to every tensor, walking torch's pin_memory
    containers (:func:`walk`); objects are left as they are."""
    return walk(obj, fn, lambda o: o)


def warn_pin_without_accelerator() -> None:
    warnings.warn("pin_memory=True has no effect: no accelerator is available, so batches stay in "
                  "pageable memory (on a machine with CUDA they are staged in pinned buffers)", stacklevel=4)
