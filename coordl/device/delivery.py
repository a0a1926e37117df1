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
import threading
import warnings
from collections import abc
from typing import Any, Callable

import torch

#: Test seam: ``device="cpu"`` runs the whole device path (ring, streams,
#: tail) with :class:`HostStreams` instead of being a no-op.
CPU_TEST_DEVICE = False

__all__ = ["DeviceDelivery", "Staged", "walk", "DeviceTail", "CudaStreams", "HostStreams", "split_for_device",
           "SplitPrep", "Split", "streams_for"]


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


# ---------------------------------------------------------------- the tail
_F32 = torch.float32


class DeviceTail:
    """uint8 -> float in [0, 1] (as ``ToTensor``) then each ``Normalize``, on
    images ``[..., C, H, W]`` on whatever device they are: the operations of
    the CPU path (``x.to(float32).div_(255)`` then ``x.sub_(mean).div_(std)``
    with ``mean``/``std`` float32 tensors of shape ``[C, 1, 1]``), in the same
    order, every one a true IEEE division by a tensor.  On CUDA a division
    by a *CPU scalar* is computed as a multiply by its rounded reciprocal
    (1 ulp off for about half the uint8 values), so the divisor 255 is a
    0-dim tensor on the device: the result is bit-identical to the CPU path.

    Constants are built once per device (no per-batch list -> tensor copies,
    and ``std == 0`` is checked once, on the host, when the tail is made)."""

    def __init__(self, normalizes: list) -> None:
        self.normalizes = list(normalizes)
        self._pairs = []
        for n in self.normalizes:
            mean = torch.tensor(n.mean, dtype=_F32).view(-1, 1, 1)
            std = torch.tensor(n.std, dtype=_F32).view(-1, 1, 1)
            if (std == 0).any():
                raise ValueError(f"std evaluated to zero after conversion to {_F32}, leading to division by zero.")
            self._pairs.append((mean, std))
        self._consts: dict = {}     # device -> (255, [(mean, std), ...]) on that device

    def __getstate__(self):
        # never ship device constants to another process (a worker finishing rows on the CPU)
        return {**self.__dict__, "_consts": {}}

    def constants(self, device: torch.device):
        c = self._consts.get(device)
        if c is None:
            c = self._consts[device] = (torch.tensor(255.0, dtype=_F32).to(device),
                                        [(m.to(device), s.to(device)) for m, s in self._pairs])
        return c

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            raise TypeError(f"the device tail converts the uint8 images the split sent, but got {images.dtype}")
        div, pairs = self.constants(images.device)
        x = images.to(_F32).div_(div)
        for mean, std in pairs:
            x.sub_(mean).div_(std)
        return x

    def apply(self, batch: Any, paths) -> Any:
        """``batch`` with the tail applied to the leaf at each of ``paths``
        (the places the split marked, see :class:`SplitPrep`)."""
        for path in paths:
            batch = _replace_at(batch, path, self)
        return batch

    def __repr__(self) -> str:
        return f"DeviceTail(float, {self.normalizes!r})"


def _replace_at(obj, path: tuple, fn: Callable):
    """``obj`` with ``fn`` applied to the leaf at ``path`` (keys and indices),
    containers along the path copied, never modified."""
    if not path:
        return fn(obj)
    key, rest = path[0], path[1:]
    if isinstance(obj, abc.Mapping):
        if isinstance(obj, abc.MutableMapping):
            clone = copy.copy(obj)
        else:
            clone = dict(obj)
        clone[key] = _replace_at(obj[key], rest, fn)
        return clone if isinstance(obj, abc.MutableMapping) else _rebuild_mapping(obj, clone)
    items = list(obj)
    items[key] = _replace_at(items[key], rest, fn)
    if isinstance(obj, tuple):
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return type(obj)(items) if type(obj) is not list else items
    try:
        return type(obj)(items)
    except TypeError:
        return items


def _rebuild_mapping(obj, d: dict):
    try:
        return type(obj)(d)
    except TypeError:
        return d


# ---------------------------------------------------------------- the split
#
# How the tail finds "exactly the tensors the removed ToTensor/Normalize
# produced" (docs/architecture.md, "Device delivery"): for a pass, the
# pipeline prepares a shallow copy of the dataset whose transform is a
# _SplitCompose.  Inside SplitPrep.prep, _SplitCompose returns the uint8
# image as a _Marked tensor and records it.  After the dataset's own prep
# returned, each recorded tensor must sit in the sample as a leaf, reached
# through the containers default_collate walks, and must not have been
# touched (any torch operation on it other than reading its shape marks it).
# Then the leaves' paths are the sample's marks; otherwise the sample is
# prepared again, unsplit, under the same random state (the CPU path).  The
# engine collates a batch with marks only when every row has the same marks
# (else it converts the marked rows on the CPU first), and the marks travel
# with the batch (BatchStats.device_marks) to the tail.

_local = threading.local()

_METADATA = frozenset([torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.dim,
                       torch.Tensor.ndim.__get__, torch.Tensor.numel, torch.Tensor.__len__,
                       torch.Tensor.device.__get__])


class _Marked(torch.Tensor):
    """A uint8 image the split produced, while the dataset's prep runs: any
    torch operation on it but reading its shape marks it touched (the prep
    code computed something from uint8 values the CPU path has as floats)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in _METADATA:
            for a in _flat(args) + _flat(kwargs):
                if type(a) is _Marked:
                    a.__dict__["_coordl_touched"] = True
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _flat(x, out=None) -> list:
    out = [] if out is None else out
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _flat(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _flat(v, out)
    return out


def _unmark(t: torch.Tensor) -> None:
    t.__class__ = torch.Tensor
    t.__dict__.pop("_coordl_touched", None)


class _SplitCompose:
    """The transform of the split's dataset copy: the user's ``Compose``
    without its final ``ToTensor``/``Normalize``s, ending in the uint8 image
    ``ToTensor`` would have scaled.  Outside ``SplitPrep.prep`` (nothing
    records) it is the user's whole transform."""

    def __init__(self, full, k: int) -> None:
        ts = list(full.transforms)
        self.full = full
        self.transforms = ts[:k - 1]
        self.normalizes = ts[k:]

    def __call__(self, img):
        cap = getattr(_local, "capture", None)
        if cap is None:
            return self.full(img)
        for t in self.transforms:
            img = t(img)
        from ..transforms import ToTensor

        x = ToTensor.unscaled(img)          # ToTensor's checks and conversion
        if x.dtype != torch.uint8:
            # ToTensor does not scale it: nothing to do on the device; the CPU path as is
            for n in self.normalizes:
                x = n(x)
            return x
        return _mark(x, cap)

    def from_bytes(self, raw):
        cap = getattr(_local, "capture", None)
        if cap is None:
            return self.full.from_bytes(raw)
        from ..transforms import PILToTensor, decode_and_apply

        x = decode_and_apply(self.transforms + [PILToTensor()], raw)
        if x is NotImplemented or x.dtype != torch.uint8:
            return NotImplemented if x is NotImplemented else self.full.from_bytes(raw)
        return _mark(x, cap)

    def spec(self):
        return self.full.spec()

    def __repr__(self) -> str:
        return f"split({self.full!r})"


def _mark(x: torch.Tensor, cap: list) -> torch.Tensor:
    m = x.as_subclass(_Marked)
    cap.append(m)
    return m


def _find(sample, cap: list):
    """The paths of the recorded tensors in ``sample`` (containers as
    default_collate walks them), or None when one was touched or is not a
    leaf there."""
    if any(m.__dict__.get("_coordl_touched") for m in cap):
        return None
    ids = {id(m) for m in cap}
    found: set = set()
    paths: list = []

    def go(x, path):
        if isinstance(x, torch.Tensor):
            if id(x) in ids:
                found.add(id(x))
                paths.append(path)
            return
        if isinstance(x, (str, bytes)):
            return
        if isinstance(x, abc.Mapping):
            for k, v in x.items():
                go(v, path + (k,))
        elif isinstance(x, abc.Sequence):
            for i, v in enumerate(x):
                go(v, path + (i,))

    go(sample, ())
    return tuple(paths) if found == ids else None


class SplitPrep:
    """What the pipeline prepares when the transform is split for the
    device: ``prep`` runs the dataset's own ``prep`` with the split
    transform and records where the uint8 images sit (:meth:`take_device_marks`);
    everything else is the dataset's (read through a shallow copy whose
    transform is the split one)."""

    def __init__(self, dataset, split_ds, tail: DeviceTail) -> None:
        self._dataset = dataset
        self._split_ds = split_ds
        self._tail = tail
        self._marks = ((), False)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            target = self.__dict__["_split_ds"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(target, name)

    def __len__(self) -> int:
        return len(self._split_ds)

    def describe(self, index: int) -> str:
        fn = getattr(self._dataset, "describe", None)
        return str(fn(index)) if callable(fn) else f"{type(self._dataset).__name__}[{index}]"

    def prep(self, raw, index: int):
        from .. import _rng

        t_state = torch.random.get_rng_state()      # (3 us; the per-sample generator is rewound by key)
        cap: list = []
        _local.capture = cap
        try:
            sample = self._split_ds.prep(raw, index)
        except Exception:
            if not any(m.__dict__.get("_coordl_touched") for m in cap):
                raise               # the dataset's own error
            sample = None           # it failed on the uint8 image: the CPU path below
            paths = None
        else:
            paths = _find(sample, cap) if cap else ()
        finally:
            _local.capture = None
        for m in cap:
            _unmark(m)
        if paths is not None:
            self._marks = (paths, False)
            return sample
        # the prep code did more with the image than place it: the CPU path, same random state
        _rng.rewind()
        torch.random.set_rng_state(t_state)
        sample = self._dataset.prep(raw, index)
        self._marks = ((), True)
        return sample

    def take_device_marks(self) -> tuple:
        """(paths of the uint8 images in the last sample, whether it had to
        be prepared again on the CPU path)."""
        m, self._marks = self._marks, ((), False)
        return m

    def finish_on_cpu(self, sample, paths):
        """``sample`` with the tail applied on the CPU to its images at
        ``paths``: exactly the CPU path's values."""
        for p in paths:
            sample = _replace_at(sample, p, self._tail)
        return sample


class Split:
    """The device split of one pass: ``dataset`` is what the pipeline
    prepares (a :class:`SplitPrep`, or the user's dataset), ``tail`` the
    device tail (None: nothing split) and ``note`` what stats() says."""

    __slots__ = ("dataset", "tail", "note")

    def __init__(self, dataset, tail, note: str) -> None:
        self.dataset, self.tail, self.note = dataset, tail, note


def split_for_device(dataset, device=None) -> Split:
    """The split for the dataset's transform *now* (made at each pass, so
    ``dataset.transform = ...`` between passes takes effect): when it is a
    coordl ``Compose`` ending in ``ToTensor`` and ``Normalize``s, the
    pipeline prepares a :class:`SplitPrep` (uint8 images travel) and the
    tail does the rest on the device.  Otherwise the dataset as it is.  The
    user's dataset is never modified."""
    from .. import transforms as T

    def no(why: str) -> Split:
        return Split(dataset, None, f"not split ({why}): images are converted on the CPU")

    tf = getattr(dataset, "transform", None)
    if type(tf) is not T.Compose:
        return no("the dataset's transform is not a coordl.transforms.Compose")
    ts = list(tf.transforms)
    k = len(ts)
    while k > 0 and type(ts[k - 1]) is T.Normalize:
        k -= 1
    if k == 0 or type(ts[k - 1]) is not T.ToTensor:
        return no("the transform does not end with ToTensor() and Normalize()s")
    if torch.get_default_dtype() != torch.float32:
        return no("torch's default dtype is not float32")
    try:
        tail = DeviceTail(ts[k:])
    except ValueError as e:
        return no(str(e))
    mine = copy.copy(dataset)
    mine.transform = _SplitCompose(tf, k)
    where = str(device) if device is not None else "the device"
    return Split(SplitPrep(dataset, mine, tail), tail,
                 f"split: uint8 images travel; ToTensor's scaling and {len(ts) - k} Normalize run on {where}")


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

    def _start_copy(self, host, paths) -> Staged:
        st = self.streams
        copy_stream = st.copy_stream()
        with st.use(copy_stream):
            # (copy=True: on the host "device" of the test seam too, never a view of the source)
            dev = walk(host, lambda t: t.to(self.device, non_blocking=True, copy=True), lambda o: o,
                       _warn_unwalked)
            if paths and self.tail is not None:
                dev = self.tail.apply(dev, paths)
            event = st.event()           # one per batch: a later reuse of the slot re-records nothing
            event.record(copy_stream)
        return Staged(dev, event)

    def stage(self, batch, paths=()) -> Staged:
        """Start ``batch``'s copy to the device through the pinned ring (any
        thread: the pin thread does this one batch ahead of the training
        loop); the tail converts the images at ``paths`` there."""
        slot = self.slots[self.k % len(self.slots)]
        self.k += 1
        if slot.event is not None and not slot.event.query():
            self.waits += 1
            slot.event.synchronize()     # its last copy still reads the pinned buffers
        staged = self._start_copy(self._stage(slot, batch), paths)
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

    def deliver(self, batch, paths=()) -> Any:
        """``stage`` then ``hand_over``, in the calling thread."""
        return self.hand_over(self.stage(batch, paths))

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
