"""The transform split: which part of a sample's prep moves to the device.

A coordl ``Compose`` ending in ``ToTensor`` and ``Normalize`` is split so a
sample leaves prep as uint8 (marked leaves, found by :class:`SplitPrep`), and
:class:`DeviceTail` runs uint8 -> float and ``Normalize`` on the device,
on the copy stream, after the batch's copy (see :mod:`.delivery`).
:func:`split_for_device` decides, per loader, whether a dataset splits.
"""
from __future__ import annotations

import copy
import threading
from collections import abc
from typing import Any, Callable

import torch

__all__ = ["DeviceTail", "SplitPrep", "Split", "split_for_device"]

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

    def __init__(self, normalizes: list, erase_value: tuple | None = None, jitter: bool = False,
                 reciprocal: bool = False) -> None:
        self.normalizes = list(normalizes)
        # the conversion's arithmetic: a multiply by 1/255 (torchvision v2's ToDtype(scale=True)), else a
        # division by 255 (ToTensor's), each a float32 operation with a tensor on the device, as on the CPU
        self.reciprocal = reciprocal
        # a RandomErasing after the conversion: its value (one per channel, or one), set at the rectangles
        # apply() is given (coordl.device.erase)
        self.erase_value = erase_value
        self._erase_on: dict = {}   # device -> the value there
        # ColorJitter's operations, given to apply() per row, applied before converting (coordl.device.jitter)
        self.jitter = jitter
        self._jitter_on: dict = {}  # device -> its DeviceJitter
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
        return {**self.__dict__, "_consts": {}, "_erase_on": {}, "_jitter_on": {}}

    def constants(self, device: torch.device):
        c = self._consts.get(device)
        if c is None:
            c = self._consts[device] = (torch.tensor(1.0 / 255 if self.reciprocal else 255.0, dtype=_F32).to(device),
                                        [(m.to(device), s.to(device)) for m, s in self._pairs])
        return c

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            raise TypeError(f"the device tail converts the uint8 images the split sent, but got {images.dtype}")
        div, pairs = self.constants(images.device)
        x = images.to(_F32).mul_(div) if self.reciprocal else images.to(_F32).div_(div)
        for mean, std in pairs:
            x.sub_(mean).div_(std)
        return x

    def apply(self, batch: Any, paths, after=None) -> Any:
        """``batch`` with the tail applied to the leaf at each of ``paths``
        (the places the split marked, see :class:`SplitPrep`); with
        ``after`` (per row, per path: ``(ops, rects)``), each row's
        ``ColorJitter`` operations applied before (:attr:`jitter`) and its
        erasing's rectangles set after (:attr:`erase_value`)."""
        for k, path in enumerate(paths):
            if after is None:
                batch = _replace_at(batch, path, self)
            else:
                rows = [a[k] for a in after]
                batch = _replace_at(batch, path, lambda x, rows=rows: self._rows(x, rows))
        return batch

    def _rows(self, x: torch.Tensor, rows: list) -> torch.Tensor:
        ops = [o for o, _ in rows]
        if self.jitter and any(ops):
            dj = self._jitter_on.get(x.device)
            if dj is None:
                from .jitter import DeviceJitter

                dj = self._jitter_on[x.device] = DeviceJitter(x.device)
            x = dj(x, ops)
        y = self(x)
        return self.erased(y, [r for _, r in rows]) if self.erase_value is not None else y

    def erased(self, y: torch.Tensor, rows: list, noise: list | None = None) -> torch.Tensor:
        """``y`` (converted) with row ``j``'s rectangles ``rows[j]`` set to
        :attr:`erase_value`, or each to its values ``noise[j][q]`` (on
        ``y``'s device; an erasing of noise) (:func:`coordl.device.erase.erase_rows`)."""
        from .erase import erase_rows, value_on

        if not any(rows):
            return y
        if noise is not None:
            return erase_rows(y, rows, None, noise)
        v = self._erase_on.get(y.device)
        if v is None:
            v = self._erase_on[y.device] = value_on(self.erase_value, y.device)
        return erase_rows(y, rows, v)

    def __repr__(self) -> str:
        return f"DeviceTail(float{', by 1/255' if self.reciprocal else ''}, {self.normalizes!r})"


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
        from ..transforms import ToTensor, run_steps

        img = run_steps(self.transforms, img)

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
    """``(paths, after)``: the paths of the recorded tensors in ``sample``
    (containers as default_collate walks them) and what the tail does to
    each besides converting (``(ops, rects)``), or None when one was
    touched or is not a leaf there."""
    if any(m.__dict__.get("_coordl_touched") for m in cap):
        return None
    ids = {id(m) for m in cap}
    found: set = set()
    paths: list = []
    after: list = []

    def go(x, path):
        if isinstance(x, torch.Tensor):
            if id(x) in ids:
                found.add(id(x))
                paths.append(path)
                after.append(x.__dict__.get("_coordl_after", _NOTHING_AFTER))
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
    return (tuple(paths), tuple(after)) if found == ids else None


_NOTHING_AFTER = ((), ())


class SplitPrep:
    """What the pipeline prepares when the transform is split for the
    device: ``prep`` runs the dataset's own ``prep`` with the split
    transform and records where the uint8 images sit (:meth:`take_device_marks`);
    everything else is the dataset's (read through a shallow copy whose
    transform is the split one)."""

    def __init__(self, dataset, split_ds, tail: DeviceTail, erase=None) -> None:
        self._dataset = dataset
        self._split_ds = split_ds
        self._tail = tail
        # a RandomErasing after the conversion (coordl.tvcompat.ErasingOnTensor): its rectangles travel
        self._erase = erase
        self._marks = ((), False)
        self._after = None

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
            found = None
        else:
            found = _find(sample, cap) if cap else ((), ())
        finally:
            _local.capture = None
        for m in cap:
            _unmark(m)
            m.__dict__.pop("_coordl_after", None)
        if found is not None:
            self._marks = (found[0], False)
            self._after = found[1] if (self._erase is not None or self._tail.jitter) and found[0] else None
            return sample
        # the prep code did more with the image than place it: the CPU path, same random state
        _rng.rewind()
        torch.random.set_rng_state(t_state)
        sample = self._dataset.prep(raw, index)
        self._marks = ((), True)
        self._after = None
        return sample

    def take_device_marks(self) -> tuple:
        """(paths of the uint8 images in the last sample, whether it had to
        be prepared again on the CPU path)."""
        m, self._marks = self._marks, ((), False)
        return m

    def take_device_after(self):
        """What the tail does to each image of the last sample besides
        converting, per path of :meth:`take_device_marks`: ``(ops, rects)``,
        its ``ColorJitter`` operations before and its erasing's rectangles
        after; or None (neither, or nothing marked)."""
        a, self._after = self._after, None
        return a

    def finish_on_cpu(self, sample, paths, after=None):
        """``sample`` with the tail applied on the CPU to its images at
        ``paths``, each one's jitter operations and erasing rectangles
        (``after``) with it: exactly the CPU path's values."""
        for k, p in enumerate(paths):
            ops, rects = after[k] if after is not None else _NOTHING_AFTER
            if ops:
                from .jitter import host_jitter

                sample = _replace_at(sample, p, lambda x, ops=ops: torch.from_numpy(host_jitter(x.numpy(), ops)))
            sample = _replace_at(sample, p, self._tail)
            if rects:
                sample = _replace_at(sample, p, lambda x, r=rects: self._erase.erase(x, r))
        return sample


def _split_pipeline(dataset, tf, device, no) -> Split:
    """:func:`split_for_device` of a translated torchvision transform
    (``coordl.tvcompat.TorchvisionPipeline``) whose steps run as written (a
    ``ColorJitter``, ``AugMix``, an auto-augment policy...) come before
    coordl's ``ToTensor`` and ``Normalize``s: the workers stop at the uint8
    image, as for a ``Compose``."""
    why = tf.split_refusal()
    if why is not None:
        return no(why)
    if torch.get_default_dtype() != torch.float32:
        return no("torch's default dtype is not float32")
    conversion = tf.split_conversion()
    normalizes = conversion[1:]
    try:
        tail = DeviceTail(normalizes, reciprocal=bool(getattr(conversion[0], "reciprocal", False)))
    except ValueError as e:
        return no(str(e))
    mine = copy.copy(dataset)
    where = str(device) if device is not None else "the device"
    erase = tf.erase
    if erase is not None:
        tail.erase_value = erase.value
    # the steps as written all colour steps whose draws are made apart (ColorJitter, in a RandomApply or not,
    # RandomGrayscale): drawn in the worker, applied on the device
    jitters = tf.split_jitters()
    tail.jitter = jitters is not None
    mine.transform = _SplitPipeline(tf, tail.jitter)
    names = list(dict.fromkeys(type(j.user).__name__ for j in jitters or ()))
    what = names + ["ToTensor's scaling", f"{len(normalizes)} Normalize"] + (
        [type(erase.user).__name__] if erase is not None else [])
    return Split(SplitPrep(dataset, mine, DeviceTail(tail.normalizes, tail.erase_value, tail.jitter, tail.reciprocal),
                           erase), tail,
                 "split: uint8 images travel" + ("" if tail.jitter else " after the steps run as written")
                 + f"; {', '.join(what[:-1])} and {what[-1]} run on {where}")


class _SplitPipeline:
    """:class:`_SplitCompose` for a translated torchvision pipeline
    (:func:`_split_pipeline`): its fused part, then its as-written steps,
    ending in the uint8 image its conversion would scale
    (``TorchvisionPipeline.split_rest``).  Outside ``SplitPrep.prep`` it is
    the whole pipeline."""

    def __init__(self, full, jitter_on_device: bool = False) -> None:
        self.full = full
        self.jitter_on_device = jitter_on_device

    def __call__(self, img):
        cap = getattr(_local, "capture", None)
        if cap is None:
            return self.full(img)
        return self._marked(*self.full.split_rest(self.full.fused(img), self.jitter_on_device), cap)

    def from_bytes(self, raw):
        cap = getattr(_local, "capture", None)
        if cap is None:
            return self.full.from_bytes(raw)
        x = self.full.fused.from_bytes(raw)
        if x is NotImplemented:
            from ..datasets import pil_decode

            return self(pil_decode(raw))
        return self._marked(*self.full.split_rest(x, self.jitter_on_device), cap)

    @staticmethod
    def _marked(x, after, cap: list):
        # the uint8 planes are the device's to convert (jitter, erase); anything else is the CPU path's result
        if after is None:
            return x
        m = _mark(x, cap)
        if after[0] or after[1]:
            m.__dict__["_coordl_after"] = after
        return m

    def spec(self):
        return self.full.spec()

    def __repr__(self) -> str:
        return f"split({self.full!r})"


class Split:
    """The device split of one pass: ``dataset`` is what the pipeline
    prepares (a :class:`SplitPrep`, a ``DecodePrep``, or the user's
    dataset), ``tail`` the device tail (None: nothing split), ``note`` what
    stats() says and ``decode`` the ``DecodePlan`` with ``decode="device"``."""

    __slots__ = ("dataset", "tail", "note", "decode")

    def __init__(self, dataset, tail, note: str, decode=None) -> None:
        self.dataset, self.tail, self.note = dataset, tail, note
        self.decode = decode    # decode="device": the coordl.device.encoded.DecodePlan the pass runs


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

    if getattr(dataset, "views_after_transform", False):
        return no(f"{type(dataset).__name__}'s samples are made after its transform, on the CPU (several views, "
                  "or a subclass's own __getitem__)")
    tf = getattr(dataset, "transform", None)
    if type(tf).__name__ == "MultiViews":      # a user's transform of several views (coordl.tvcompat)
        return no(f"{tf.name} makes {len(tf.calls)} views of each image, on the CPU")
    if type(tf).__name__ == "TorchvisionPipeline":     # a translated torchvision transform (coordl.tvcompat)
        return _split_pipeline(dataset, tf, device, no)
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
        tail = DeviceTail(ts[k:], reciprocal=bool(getattr(ts[k - 1], "reciprocal", False)))
    except ValueError as e:
        return no(str(e))
    mine = copy.copy(dataset)
    mine.transform = _SplitCompose(tf, k)
    where = str(device) if device is not None else "the device"
    # The prep side (shipped to worker processes) gets a tail of its own: the
    # delivery's tail holds constants on the device once a batch went through
    # it, and nothing a worker receives may reach device state.
    return Split(SplitPrep(dataset, mine, DeviceTail(tail.normalizes, reciprocal=tail.reciprocal)), tail,
                 f"split: uint8 images travel; ToTensor's scaling and {len(ts) - k} Normalize run on {where}")
