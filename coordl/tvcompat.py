"""torchvision datasets and transforms on coordl's pipeline, unchanged.

``coordl.DataLoader(dataset)`` calls :func:`adapt` first.  When ``dataset``
is torchvision's ``DatasetFolder``/``ImageFolder`` (or a subclass that keeps
their ``__getitem__``, ``__len__`` and a known ``loader``), or one of its
datasets of listed image files (``Food101``, ``Flowers102``... :data:`_FILE_LISTS`),
or timm's ``ImageDataset`` (``coordl.timmcompat``), the loader runs a
:class:`TorchvisionFolder` instead: a two-stage copy of it (``raw(i)`` = the
bytes of the file at ``samples[i][0]``, ``prep`` = decode + transform, target
= ``samples[i][1]`` through ``target_transform`` as written), whose transform
is the user's pipeline read from its public attributes (:func:`translate`)
into coordl's own transforms, so the fused crop-window decode runs it.  Its
``CIFAR10``/``CIFAR100`` (images in memory) become a
:class:`TorchvisionArrays`: each image's row of the array is its raw bytes,
and the translated transform runs on its planes.

Nothing here imports torchvision: objects are recognized by the module and
name of their class, and torchvision's functions and classes are looked up in
``sys.modules`` (the user's objects come from there, so it is imported).
torchvision is never modified.

The rules (docs/guide/torchvision.md gives them with the measured tolerances):

* A transform is translated only when coordl's version draws from the same
  distributions (RandomResizedCrop: 10 tries of a uniform area fraction and a
  log-uniform aspect ratio, then the central fallback; RandomCrop: uniform
  offsets; flips: Bernoulli(p)) and computes what torchvision computes, to
  the tolerance docs/guide/torchvision.md states per step.  A resize of the PIL image
  (bilinear or bicubic; PIL always antialiases) is computed with PIL's
  arithmetic on the full-size decode: the same pixels.  A resize of a uint8
  tensor (after ``ToImage``/``PILToTensor``) keeps its own ``antialias`` and
  runs torch's kernel, as torchvision does (v2: the same call; v1 resizes in
  float32 and rounds once, within 1 level of it), except v1's bicubic, whose
  float result without clipping between the passes is up to ~26 levels from
  any uint8 kernel.  Interpolations coordl has no kernel for (box, hamming,
  lanczos), PIL's nearest (other source pixels than torch's), v1's tensor
  bicubic, padding, ``ToDtype`` with a dict, and anything unknown end the
  fused prefix.  The reduced-scale JPEG decode runs only when asked for
  (``translate(..., draft=True)``, the loader's ``jpeg_draft``).
* Whatever follows the fused prefix runs as written, on what it expects: a
  PIL image when the user's pipeline had not converted to a tensor yet, else
  the tensor (a ``tv_tensors.Image`` after ``ToImage``).  Its random draws
  come from torch's and Python's generators (and numpy's, where a step
  may draw from it) seeded from the sample's own generator, so they too
  depend on (seed, epoch, index) only.  A
  constant-value ``RandomErasing`` that is the last step to draw is kept
  apart (``TorchvisionPipeline.erase``): it runs as written, in the same
  seeded scope, after the steps before it, whose conversion stays coordl's.
* Anything coordl cannot prove equivalent stays on torch's machinery: a
  torchvision dataset that is not a folder, a subclass overriding
  ``__getitem__``/``__len__``, a loader other than torchvision's
  ``default_loader``/``pil_loader`` (or the accimage backend), a
  ``transform``/``target_transform`` that is not callable, targets that are
  not class indices.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import numbers
import operator
import os
import random
import sys
import threading
import types
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from . import _rng
from . import datasets as _datasets
from . import timmcompat
from .base.foreign import class_named, instructions, plain_function, why_not_callable, why_overridden
from . import transforms as T
from .datasets import TwoStageFolder, pil_decode
from .decode import jpeg as _jpeg
from .decode.loaders import _is_default_pil_loader
from .decode.tvio import TorchvisionDecode, torchvision_loader
from .base import forks as _forks
from .base import memo as _memo

__all__ = ["Decision", "TorchvisionFolder", "TorchvisionPipeline", "adapt", "translate", "translate_steps",
           "holder_attribute", "from_torchvision", "describe_path", "record_path", "draft_note"]

log = logging.getLogger("coordl.tvcompat")

_FOLDER_MODULE = "torchvision.datasets.folder"


@dataclass(frozen=True)
class Decision:
    """What :func:`adapt` decided: ``path`` is ``"coordl"`` (the dataset runs
    on coordl's pipeline as a :class:`TorchvisionFolder`) or ``"torch"`` (it
    stays on torch's machinery); ``reason`` says why, in words; ``fused``
    names the user's transforms that run on coordl's fused decode path and
    ``as_written`` those that run as the user wrote them."""

    path: str
    reason: str
    fused: tuple[str, ...] = ()
    as_written: tuple[str, ...] = ()


def from_torchvision(obj: Any) -> bool:
    """True when ``obj``'s class or one of its bases comes from torchvision."""
    return any(c.__module__ == "torchvision" or c.__module__.startswith("torchvision.")
               for c in type(obj).__mro__)


def _name(obj: Any) -> str:
    if isinstance(obj, types.FunctionType):      # a def or lambda in a Compose: its own name
        return obj.__name__
    return type(obj.user if isinstance(obj, OnPlanes) else obj).__name__


# ------------------------------------------------------------------ dataset
# torchvision's datasets that are a list of image files and class indices rather than a folder per class:
# the class's name -> (where its list is: files beside labels, or (path, class) pairs; whether it tests its
# transforms by truth, "if self.transform:"; whether it applies them through its joint ``transforms``, the
# StandardTransform of transform and target_transform that torchvision's VisionDataset makes).  Its
# __getitem__ must read exactly the list's names, its decode's (_DECODES: loader(path), or PIL's open and
# convert("RGB") as torchvision before its loader argument did) and its transforms'; OxfordIIITPet's,
# which also picks its target by type, exactly _PETS (one category target type is taken).
_FILES, _PAIRS, _IMGS, _PETS_LIST = ("_image_files", "_labels"), ("_samples",), ("imgs",), ("_images", "_labels")
_FILE_LISTS = {**{name: (_FILES, True, False) for name in ("Food101", "Flowers102", "DTD", "FGVCAircraft",
                                                            "SUN397")},
               "RenderedSST2": (_PAIRS, True, False), "StanfordCars": (_PAIRS, False, False),
               "Imagenette": (_PAIRS, False, False), "GTSRB": (_PAIRS, False, False),
               "Places365": (_IMGS, False, True), "OxfordIIITPet": (_PETS_LIST, False, True)}
_DECODES = (("loader",), ("PIL", "Image", "open", "convert"))
_PETS = {"Image", "open", "_images", "convert", "_target_types", "append", "_labels", "_bin_labels", "_segs", "len",
         "tuple", "transforms"}
_PET_TARGETS = {"category": "_labels", "binary-category": "_bin_labels"}


def _file_list(ds: Any) -> tuple[type, tuple, bool, bool] | None:
    """``(torchvision's class, where its list is, tests by truth, joint)``
    when ``ds`` is one of torchvision's datasets of listed image files
    (:data:`_FILE_LISTS`), else None."""
    for c in type(ds).__mro__:
        if c.__module__.startswith("torchvision.datasets.") and c.__name__ in _FILE_LISTS:
            return (c, *_FILE_LISTS[c.__name__])
    return None


def _reads_as_listed(base: type, where: tuple, joint: bool) -> bool:
    """``base.__getitem__`` reads the list at ``where``, decodes with a
    ``loader`` or PIL's ``convert("RGB")``, then its transforms, and
    nothing else."""
    code = base.__getitem__.__code__
    names = set(code.co_names)
    if where is _PETS_LIST:
        return names == _PETS and "RGB" in code.co_consts
    transforms = ("transforms",) if joint else ("transform", "target_transform")
    return any(names == {*where, *decode, *transforms} and ("loader" in decode or "RGB" in code.co_consts)
               for decode in _DECODES)


def _listed_samples(ds: Any, where: tuple) -> list:
    """The ``(path, class index)`` pairs of a dataset of files listed at ``where``."""
    if where == _FILES:
        return list(zip(ds._image_files, ds._labels, strict=True))
    if where is _PETS_LIST:
        return list(zip(ds._images, getattr(ds, _PET_TARGETS[ds._target_types[0]]), strict=True))
    return list(ds.imgs if where == _IMGS else ds._samples)


def _listed_transforms(ds: Any, by_truth: bool, joint: bool) -> tuple[Any, Any]:
    """``(transform, target_transform)`` a dataset of listed files applies:
    its joint ``transforms``' (a StandardTransform's) where it applies
    those, None for one it tests by truth that is falsy."""
    if joint:
        t = ds.transforms
        return (None, None) if t is None else (t.transform, t.target_transform)
    transform, target = ds.transform, ds.target_transform
    if by_truth:
        transform, target = transform or None, target or None
    return transform, target


def _why_not(ds: Any) -> str | None:
    """Why ``ds`` (a torchvision object) cannot run on coordl's pipeline, or None."""
    cls = type(ds)
    listed = _file_list(ds)
    if listed is not None:
        base, where, _, joint = listed
        why = why_overridden(cls, base)
        if why is not None:
            return why
        if not _reads_as_listed(base, where, joint):
            return (f"this torchvision's {base.__name__}.__getitem__ reads "
                    f"{', '.join(base.__getitem__.__code__.co_names)}, not what coordl reads as raw bytes + prep "
                    f"({', '.join(where)}, a loader or PIL's convert('RGB'), "
                    f"{'transforms' if joint else 'transform, target_transform'})")
        if where is _PETS_LIST and list(getattr(ds, "_target_types", ())) not in ([k] for k in _PET_TARGETS):
            return (f"its target_types {ds._target_types!r} are not one class index (\"category\" or "
                    "\"binary-category\"), so coordl has no class index per file to read")
        if joint:
            t = ds.transforms
            std = class_named(type(t), "torchvision.datasets.vision", "StandardTransform")
            if t is not None and (std is None or type(t).__call__ is not std.__call__):
                return (f"its transforms {_name(t)} take the image and the target together; coordl runs them only "
                        "as torchvision's StandardTransform of a transform and a target_transform (what "
                        "transform= and target_transform= make)")
            if t is not None:
                why = why_not_callable(t)
                if why is not None:
                    return why
        if "loader" not in base.__getitem__.__code__.co_names:
            return why_not_callable(ds)     # PIL's open and convert("RGB"): torchvision's pil_loader
        return _why_not_loader(ds)
    base = class_named(cls, _FOLDER_MODULE, "DatasetFolder")
    if base is None:
        return (f"torchvision's {cls.__name__} is not a DatasetFolder/ImageFolder, so coordl has no file "
                "bytes to cache and share for it")
    # a __getitem__ of its own that reaches torchvision's runs as written (TorchvisionSubclassFolder)
    why = why_overridden(cls, base, attrs=("__len__",) if _own_getitem(cls, base) is not None else
                         ("__getitem__", "__len__"))
    if why is not None:
        return why
    return _why_not_loader(ds)


def _fuses_whole(tf: Any) -> bool:
    """Whether ``tf.from_bytes`` (a folder's translated transform, or a
    device stage's wrapper of it) decodes with coordl's JPEG decode: a
    translation whose fused part coordl runs from the bytes, not one that
    would decode with PIL."""
    fused = tf.fused if type(tf) is TorchvisionPipeline else tf
    if type(fused) is T.Compose:
        return T._fusable(fused.transforms)
    return fused is not None and hasattr(fused, "from_bytes")   # a stage's wrapper: its own CPU path


def _own_getitem(cls: type, base: type) -> Any:
    """torchvision's ``DatasetFolder.__getitem__`` where ``cls`` (a subclass
    of ``base``, that class) overrides it with a Python method of its own
    that reaches it (``super().__getitem__``): :class:`TorchvisionSubclassFolder`
    runs such a method as written.  Else None."""
    fn, theirs = cls.__getitem__, base.__getitem__
    if fn is theirs or not isinstance(fn, types.FunctionType) or not isinstance(theirs, types.FunctionType):
        return None
    if (fn.__module__ or "").split(".")[0] == "torchvision" or "__getitem__" not in fn.__code__.co_names:
        return None
    return theirs


def _why_not_loader(ds: Any) -> str | None:
    """Why ``ds``'s ``loader`` (and transforms) keep it off coordl's pipeline, or None."""
    folder = sys.modules.get(_FOLDER_MODULE)
    loader = getattr(ds, "loader", None)
    if torchvision_loader(loader) is not None:
        return why_not_callable(ds)
    if not _is_default_pil_loader(loader):
        return (f"its loader {loader!r} is not torchvision's default_loader/pil_loader (or a function written as "
                "one: PIL's open, then convert('RGB')), nor torchvision.io's decode_image/read_image (or a "
                "functools.partial of one giving its mode), so coordl cannot decode the file's bytes the same "
                "way (coordl.ImageFolder(..., decode=...) can)")
    if loader is getattr(folder, "default_loader", None):
        tv = sys.modules.get("torchvision")
        backend = tv.get_image_backend() if tv is not None and hasattr(tv, "get_image_backend") else "PIL"
        if backend != "PIL":
            return f"torchvision's image backend is {backend!r}, not PIL"
    return why_not_callable(ds)


class TorchvisionFolder(TwoStageFolder):
    """A torchvision ``DatasetFolder``/``ImageFolder`` as a coordl two-stage
    dataset, made by :func:`adapt`: ``samples``, ``classes``,
    ``class_to_idx``, ``targets``, ``root``, ``loader`` and
    ``target_transform`` as in the original, ``transform`` its translation
    (a coordl ``Compose``, or a :class:`TorchvisionPipeline` when part of it
    runs as written).  Keeps no reference to the original dataset or to the
    transforms it replaced, but for a ``loader`` that is torchvision.io's
    ``decode_image`` or ``read_image`` (:mod:`coordl.decode.tvio`): then the
    translation is given the uint8 tensor that loader returns, and the
    user's transform (``written``) runs as written on the images it returns
    with other than 3 channels (a grey JPEG, a PNG with alpha, under the
    default mode).  Each file is decoded by coordl where that gives
    torchvision's pixels (``TorchvisionDecode.fusable``), else by
    torchvision's function."""

    def __init__(self, dataset: Any, transform: Any, source: str | None = None, written: Any = None):
        tensor = torchvision_loader(dataset.loader)
        super().__init__(dataset, decode=tensor)
        self.transform = transform
        self._source = source or self._source
        self._written = written if tensor is not None else None
        if tensor is not None:
            return          # its loader stays the user's (torchvision's function: pickled by name)
        # coordl's function of the same name and result: the dataset then pickles (workers under
        # spawn, the node daemon) without torchvision whenever its transforms were all translated
        folder = sys.modules.get(_FOLDER_MODULE)
        self.loader = _datasets.default_loader if self.loader is getattr(folder, "default_loader", None) \
            else _datasets.pil_loader

    def _tensor_image(self, raw) -> Any:
        """``_fused_image`` where the loader is torchvision.io's (the stock
        ``_FolderBase._fused_image`` hands it over; the device stage's
        batch reads, which take the PIL loader's folders, know that one)."""
        dec = self._decode
        tf = self.transform
        if tf is not None and tf is self._written:
            return tf(dec(raw))     # a transform of coordl's assigned to loader.dataset: run as assigned
        if dec.fusable(raw):
            try:
                if tf is None:
                    return torch.from_numpy(_jpeg.decode_rgb(raw)).permute(2, 0, 1)
                if _fuses_whole(tf):
                    return tf.from_bytes(raw)
            except Exception:  # noqa: BLE001 - a stream coordl's decode refuses: torchvision's decides, as under torch
                pass
        x = dec(raw)            # torchvision's own decode (and its error)
        if tf is None:
            return x
        if isinstance(x, torch.Tensor):
            planes = getattr(tf, "from_planes", None)
            # an RGB image goes on from its planes (a device split's wrapper, without from_planes, is given the
            # tensor); another goes to decode="device"'s stage, which refuses it, but not to the translation,
            # whose planes are PIL's (an L image's are not a one-channel tensor's)
            rgb = x.dtype == torch.uint8 and x.ndim == 3 and x.shape[0] == 3
            if rgb or (planes is not None and type(tf) not in (T.Compose, TorchvisionPipeline)):
                if planes is None:
                    return tf(x)
                out = planes(x)
                if out is not NotImplemented:
                    return out
        # not an RGB image (a grey or CMYK JPEG, a PNG with alpha): the user's transform as written, on it
        with _rng.seeded_user_steps(T.draws_numpy(self._written)):
            return self._written(x)

    def take_transforms(self, other: Any) -> None:
        super().take_transforms(other)
        self._written = getattr(other, "_written", None)

    def _repr_name(self) -> str:
        return f"{type(self).__name__}(torchvision {self._source})"

    def follow_samples(self, samples) -> None:
        """The user's dataset's ``samples`` list assigned anew since the
        last pass, or an item of it replaced (the loader compares a copy of
        its items each pass): its labels are taken (torch's next pass reads
        them); other files are an error that says to make a new loader."""
        norm = os.path.normpath
        try:
            pairs = [(os.fsdecode(os.fspath(p)), operator.index(t)) for p, t in samples]
        except (TypeError, ValueError) as e:
            raise ValueError(f"the samples of the {self._source} given to this DataLoader changed since the last pass "
                             f"(assigned anew or in place) and are not (path, class index) pairs ({e}): make a new "
                             "DataLoader") from None
        if len(pairs) != len(self) or any(norm(p) != norm(self._path(i)) for i, (p, _) in enumerate(pairs)):
            raise ValueError(f"the samples of the {self._source} given to this DataLoader changed since the last pass "
                             "(assigned anew or in place) to other files: coordl reads a folder's files when the loader "
                             "is made; make a new DataLoader over the changed dataset")
        self._targets = np.asarray([t for _, t in pairs], dtype=np.int64)


class TorchvisionSubclassFolder(TorchvisionFolder):
    """A subclass of torchvision's ``DatasetFolder``/``ImageFolder`` whose
    own ``__getitem__`` calls torchvision's (``super().__getitem__(index)``)
    and adds to it: the widespread ``ImageFolderWithPaths`` returning the
    file's path, or the index, beside the image.  The image is prepared on
    coordl's pipeline as the folder's (its bytes read ahead, cached,
    shared; the transform fused); then the subclass's ``__getitem__`` runs
    as written on a copy of the user's dataset, where torchvision's
    ``DatasetFolder.__getitem__`` reading the sample's own file, the first
    time and from that method only, gets that image through its loader and
    transform (:class:`_Handover`).  Any other read (another index, a second
    call, the subclass's own use of ``self.loader``) runs as written.

    Keeps the user's dataset itself (its lists of samples, and whatever else
    the method reads, as it is when a pass starts its workers: as torch's
    workers get it), and copies it per sample.  The sample is the
    subclass's, so nothing is split for the device and ``decode="device"``
    is refused."""

    #: the sample is more than the transform's output: no device split, no decode="device"
    views_after_transform = True

    def __init__(self, dataset: Any, transform: Any, source: str | None = None, getitem: Any = None,
                 written: Any = None):
        super().__init__(dataset, transform, source, written)
        self._user = dataset
        self._getitem = getitem     # torchvision's DatasetFolder.__getitem__ (pickled by name, for spawn)

    def take_transforms(self, other: "TorchvisionSubclassFolder") -> None:
        super().take_transforms(other)
        self._user = other._user

    def _prep(self, raw, index: int):
        from .transforms import seeded_for

        # the subclass's method may draw too (Python's, numpy's generators): seeded by the sample as the rest
        with seeded_for(self.transform, self.target_transform, self._decode, type(self._user).__getitem__):
            return self._prep_seeded(raw, index)

    def _prep_seeded(self, raw, index: int):
        i = self._check_index(index)
        img = self._fused_image(raw)
        if img is NotImplemented:
            img = self._decode(raw)
            if self.transform is not None:
                img = self.transform(img)
        stand = copy.copy(self._user)
        # another read runs the user's transform as written where the loader is torchvision.io's (the
        # translation is given the loader's tensors only through _tensor_image)
        hand = _Handover(img, stand.samples[i][0], self._getitem.__code__, stand.loader,
                         self.transform if self._written is None else self._written)
        stand.__dict__["loader"] = hand.loader
        if self.transform is not None:
            stand.__dict__["transform"] = hand.transform
        return type(stand).__getitem__(stand, index)


class _Handover:
    """The image coordl prepared, handed to torchvision's
    ``DatasetFolder.__getitem__`` (``code``) when it reads ``path`` the first
    time: its loader gives a token that its transform turns into the image
    (or, without a transform, the image itself).  Every other call runs the
    real loader, and the transform (coordl's translation of the user's) as
    written."""

    __slots__ = ("img", "path", "code", "real_loader", "real_transform", "token")

    def __init__(self, img, path, code, real_loader, real_transform) -> None:
        self.img, self.path, self.code = img, path, code
        self.real_loader, self.real_transform = real_loader, real_transform
        self.token = None

    def loader(self, path):
        if self.token is None and path == self.path and sys._getframe(1).f_code is self.code:
            self.token = object()
            return self.token if self.real_transform is not None else self.img
        return self.real_loader(path)

    def transform(self, x):
        if x is self.token and x is not None:
            return self.img
        return self.real_transform(x)


# torchvision's datasets of images held in memory, a uint8 array of them: the class's name -> (its module;
# what its __getitem__ reads, exactly (one of these): the row and its target, PIL's fromarray (of the row
# transposed from (3, H, W); of a gray row, as mode "L", through torchvision's own helper or PIL's), the
# transforms; the layout of a row; where the targets are)
_MNIST_READS = frozenset({"data", "int", "targets", "numpy", "transform", "target_transform"})
_ARRAYS = {
    "CIFAR10": ("torchvision.datasets.cifar",
                (frozenset({"data", "targets", "Image", "fromarray", "transform", "target_transform"}),), "hwc",
                "targets"),
    **{name: (f"torchvision.datasets.{name.lower()}",
              (frozenset({"data", "int", "labels", "Image", "fromarray", "np", "transpose", "transform",
                          "target_transform"}),), "chw", "labels") for name in ("SVHN", "STL10")},
    "MNIST": ("torchvision.datasets.mnist", (_MNIST_READS | {"_Image_fromarray"}, _MNIST_READS | {"Image", "fromarray"}),
              "gray", "targets")}


def _arrays_base(ds: Any) -> type | None:
    """torchvision's class of ``ds`` in :data:`_ARRAYS` (``CIFAR100`` is a
    ``CIFAR10``), else None."""
    for name, (module, *_) in _ARRAYS.items():
        base = class_named(type(ds), module, name)
        if base is not None:
            return base
    return None


def _why_not_arrays(ds: Any, base: type) -> str | None:
    """Why torchvision's dataset of images in memory ``ds`` cannot run on
    coordl's pipeline, or None."""
    why = why_overridden(type(ds), base)
    if why is not None:
        return why
    _, reads, layout, where = _ARRAYS[base.__name__]
    code = base.__getitem__.__code__
    if set(code.co_names) not in reads or (layout == "gray" and "L" not in code.co_consts):
        return (f"this torchvision's {base.__name__}.__getitem__ reads {', '.join(code.co_names)}, not what coordl "
                f"reads as raw bytes + prep ({', '.join(sorted(reads[0]))})")
    data, targets = getattr(ds, "data", None), getattr(ds, where, None)
    shape = {"hwc": "(N, H, W, 3)", "chw": "(N, 3, H, W)", "gray": "(N, H, W)"}[layout]
    if not (isinstance(data, (np.ndarray, torch.Tensor)) and data.dtype in (np.uint8, torch.uint8)
            and data.ndim == len(shape.split(",")) and (layout == "gray" or data.shape[3 if layout == "hwc" else 1] == 3)):
        return f"its data is not an {shape} uint8 array of {'gray' if layout == 'gray' else 'RGB'} images"
    if targets is None:
        return f"it has no {where} (an unlabeled split)"
    try:
        labels = np.asarray(targets)
    except (TypeError, ValueError):
        labels = None
    if labels is None or labels.ndim != 1 or len(labels) != len(data) or labels.dtype.kind not in "iu":
        return f"its {where} are not one class index per image"
    return why_not_callable(ds)


class TorchvisionArrays:
    """torchvision's ``CIFAR10``/``CIFAR100``, ``SVHN``, ``STL10`` and
    ``MNIST`` (and ``FashionMNIST``, ``KMNIST``, ``EMNIST``: images held in
    memory) as a coordl two-stage dataset, made by :func:`adapt`:
    ``raw(i)`` is image ``i``'s row of the array (its ``H * W * 3`` bytes,
    ``H * W`` for a gray one), ``prep`` applies the translated transform to its
    planes, as torchvision applies the transform to ``Image.fromarray`` of
    the row (the fused steps without a PIL image,
    ``coordl.transforms.apply_to_planes``), and the target is the row's
    class index (``targets[i]``, ``labels[i]``) through
    ``target_transform``.  ``data``, ``targets`` or ``labels``,
    ``classes``, ``class_to_idx``, ``root`` and ``train`` or ``split`` as in
    the original; the array is shared with it, not copied.  No
    ``fingerprint``: there are no stored bytes for the node cache to keep."""

    def __init__(self, dataset: Any, transform: Any, layout: str = "hwc", where: str = "targets"):
        self.data = dataset.data
        setattr(self, where, getattr(dataset, where))        # (a list, an array, a tensor: as the dataset has it)
        self._targets = np.asarray(getattr(dataset, where), dtype=np.int64)
        self._where = where
        self._layout = layout
        self.transform = transform
        self.target_transform = dataset.target_transform
        self.classes = list(getattr(dataset, "classes", []) or [])
        self.class_to_idx = dict(getattr(dataset, "class_to_idx", {}) or {})
        self.root = getattr(dataset, "root", None)
        for name in ("train", "split"):
            if hasattr(dataset, name):
                setattr(self, name, getattr(dataset, name))
        self._source = type(dataset).__name__

    def __len__(self) -> int:
        return len(self.data)

    def follow(self, dataset: Any) -> None:
        """The user's ``dataset``'s images and labels as they are now, as
        torch's next pass reads them (labels corrected between epochs, an
        array assigned anew); the loader calls it when a pass starts, its
        number of images checked first."""
        if dataset.data is not self.data:
            self.data = dataset.data
        given = getattr(dataset, self._where)
        labels = np.asarray(given, dtype=np.int64)     # (a list of 50,000: about 2 ms)
        if not np.array_equal(labels, self._targets):
            self._targets = labels
        setattr(self, self._where, given)

    def _check_index(self, index) -> int:
        i = operator.index(index)
        n = len(self.data)
        if not -n <= i < n:
            raise IndexError(f"index {index} is out of range for {self._source} with {n} images")
        return i % n

    def raw(self, index: int) -> bytearray:
        """Image ``index``'s row of the array, its ``H * W * 3`` bytes (``H * W`` for a gray one)."""
        return bytearray(np.ascontiguousarray(self.data[self._check_index(index)]))   # one copy

    def prep(self, raw, index: int) -> tuple[Any, Any]:
        """``(transform(image), target_transform(target))`` of image
        ``index`` from its bytes ``raw``."""
        with T.seeded_for(self.transform, self.target_transform):
            return self._prep(raw, index)

    def _prep(self, raw, index: int) -> tuple[Any, Any]:
        i = self._check_index(index)
        # (a bytearray from raw(); other bytes, such as a read-only view of shared staging, copied: torch views
        # only writable memory without a warning)
        row = torch.frombuffer(raw if isinstance(raw, bytearray) else bytearray(raw), dtype=torch.uint8)
        if self._layout == "hwc":
            planes = row.view(*self.data.shape[1:3], 3).permute(2, 0, 1)
        elif self._layout == "gray":
            planes = row.view(1, *self.data.shape[1:3])
        else:
            planes = row.view(3, *self.data.shape[2:4])
        fused = getattr(self.transform, "from_planes", None)
        sample = fused(planes) if fused is not None else NotImplemented
        if sample is NotImplemented:
            sample = _to_pil(planes)         # Image.fromarray's image of the row (mode L for a gray one)
            if self.transform is not None:
                sample = self.transform(sample)
        target = int(self._targets[i])
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.prep(self.raw(index), index)

    def take_transforms(self, other: Any) -> None:
        """Run from the next pass what ``other`` (this dataset adapted anew) runs."""
        self.transform, self.target_transform = other.transform, other.target_transform

    def describe(self, index: int) -> str:
        """``CIFAR10[i]``: where sample ``index`` is."""
        return f"{self._source}[{self._check_index(index)}]"

    def __repr__(self) -> str:
        return (f"Dataset {type(self).__name__}(torchvision {self._source})\n    Number of datapoints: {len(self)}"
                f"\n    Transform: {self.transform!r}")


class TorchvisionPipeline:
    """A translated transform with a part that runs as written.

    ``fused``: coordl transforms ending in a tensor conversion, run on the
    fused decode path (or None: decode with PIL).  ``to_pil``: hand the rest a
    PIL image (the user's pipeline had not converted to a tensor yet).
    ``image_type``: wrap the tensor in this class (``tv_tensors.Image``, after
    ``ToImage``).  ``tail``: the user's own transforms, run in order, under
    the sample's generators.  ``post``: the user's transforms after the last
    one that draws random numbers (conversions, ``Normalize``,
    ``ToPureTensor``...): they run after ``tail`` without a generator of
    their own, as coordl's conversion (``post_fused``, a coordl ``Compose``
    of a tensor conversion and ``ToDtype``/``Normalize``, with
    ``post_type`` the class to wrap its result in) when what ``tail`` gave is
    a PIL image, else as written.  ``erase``: a :class:`ErasingOnTensor`, a
    ``RandomErasing`` that is the last step to draw random numbers, run as
    written after ``post`` under the sample's generators (the tail's,
    continued), so that the conversion before it is still coordl's; then
    ``after``, the steps after it (``ToPureTensor``...), as written."""

    def __init__(self, fused: T.Compose | None, to_pil: bool, image_type: type | None, tail: list,
                 post: list = (), post_fused: T.Compose | None = None, post_type: type | None = None,
                 erase: "ErasingOnTensor | None" = None, after: list = ()):
        self.fused, self.to_pil, self.image_type, self.tail = fused, to_pil, image_type, list(tail)
        self.post, self.post_fused, self.post_type = list(post), post_fused, post_type
        self.erase, self.after = erase, list(after)

    def __getstate__(self) -> dict:
        # what jitters() and _numpy() made is a cache of this process's: never part of what travels or is compared
        return {k: v for k, v in self.__dict__.items() if k not in ("_jitters", "_draws_numpy", "_tensor_post")}

    def from_bytes(self, raw) -> Any:
        x = self.fused.from_bytes(raw) if self.fused is not None else NotImplemented
        if x is NotImplemented:
            return self(pil_decode(raw))
        return self._rest(x)

    def from_planes(self, planes: torch.Tensor) -> Any:
        """:meth:`from_bytes` of an image already decoded: its uint8
        ``(C, H, W)`` planes, RGB or L (``coordl.transforms.apply_to_planes``)."""
        x = self.fused.from_planes(planes) if self.fused is not None else NotImplemented
        if x is NotImplemented:
            return self(_to_pil(planes))
        return self._rest(x)

    def __call__(self, img: Any) -> Any:
        return self._rest(self.fused(img) if self.fused is not None else img)

    def _rest(self, x: Any) -> Any:
        return self._through(x)[0]

    def _through(self, x: Any, split: bool = False, jitter_on_device: bool = False) -> tuple[Any, tuple | None]:
        """``x`` (the fused part's result) through the rest, under the
        sample's generators where something draws (the steps as written, the
        erasing): ``(the result, None)``; with ``split``, :meth:`split_rest`'s."""
        seeded = self.erase is not None or bool(self.tail)
        with _rng.seeded_globals(_rng.current(), self._numpy()) if seeded else contextlib.nullcontext():
            if jitter_on_device and isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.ndim == 3 \
                    and x.shape[0] == 3:
                ops = [op for j in self.jitters() for op in j.draw(tuple(x.shape[1:]))]
                return x, (ops, self.erase.draw(*x.shape) if self.erase is not None else [])
            x = self._converted(x, split)
            if split and isinstance(x, torch.Tensor) and x.dtype == torch.uint8:
                return x, ([], self.erase.draw(*x.shape) if self.erase is not None else [])
            if self.erase is not None:
                x = self.erase(x)
        for t in self.after:
            x = t(x)
        return x, None

    def views_of(self, x: torch.Tensor, n: int) -> list:
        """timm's ``AugMixDataset`` views of ``x``, the fused part's uint8
        planes, where ``tail`` is its ``augmentation`` and ``post`` its
        ``normalize`` (:func:`augmix_views`): ``post`` of ``x`` (the clean
        view), then ``n`` times ``tail`` then ``post`` of ``x``, in that
        order, as its ``__getitem__`` makes them of the PIL image; inside
        the sample's generators' scope, opened by the dataset's ``_prep``
        (each view's draws continue the one before's)."""
        return [self._converted(x, tail=False)] + [self._converted(x) for _ in range(n)]

    def _converted(self, x: Any, split: bool = False, tail: bool = True) -> Any:
        """``x`` (the fused part's result) through ``tail`` (unless ``tail``
        is False) and ``post`` (inside the sample's generators' scope); with ``split``
        (:meth:`split_refusal` None), the uint8 RGB planes ``post`` would
        convert where the tail gives an RGB image, the device split's
        ``ToTensor`` and ``Normalize`` left to do."""
        planes = False
        if self.fused is not None:
            if self.to_pil:
                # the PIL image the user's next step expects, held as the fused result's planes until
                # a step needs the PIL object itself (steps with a kernel of coordl's take the planes)
                planes = x.ndim == 3 and x.shape[0] in (1, 3)
                if not planes:
                    x = _to_pil(x)
            elif self.image_type is not None:
                x = x.as_subclass(self.image_type)
        if self.tail and tail:
            x, planes = self._run_steps(x, planes)
        if split:
            if not planes and isinstance(x, Image.Image) and x.mode == "RGB":
                x, planes = T._to_chw(x), True
            if planes and x.shape[0] == 3:
                return x
            if not self.to_pil and isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.ndim == 3 \
                    and x.shape[0] == 3:     # the steps were given the fused uint8 tensor and gave one
                return x.as_subclass(torch.Tensor)
        if planes:
            if self.post and self.post_fused is not None:
                x = T._convert(x, self.post_fused.transforms, False, _ext())
                return x.as_subclass(self.post_type) if self.post_type is not None else x
            x = _to_pil(x)
        if self.post:
            x = self._run_post(x)
        return x

    def _numpy(self) -> bool:
        """Whether a step run as written may draw from numpy's global
        generator (``coordl.transforms.draws_numpy``): then the sample's
        scope seeds it too."""
        got = self.__dict__.get("_draws_numpy")
        if got is None:
            got = self._draws_numpy = any(T.draws_numpy(t) for t in self.tail + self.post + self.after) or (
                self.erase is not None and T.draws_numpy(self.erase.user))
        return got

    def split_refusal(self) -> str | None:
        """Why the device split (``coordl.device.split``) cannot stop this
        pipeline at the uint8 image its conversion scales, or None where it
        can: the user's as-written steps get the fused part's image, and
        what follows them is coordl's ``ToTensor`` then ``Normalize``s (the
        device tail's), then at most a ``RandomErasing`` whose draws coordl
        makes apart from its call (then ``ToPureTensor`` at most)."""
        if self.fused is None or not (self.to_pil or self.on_tensor()):
            return "the steps run as written get a float tensor, not the decoded image"
        if self.erase is not None:
            others = [_name(t) for t in self.after if _name(t) != "ToPureTensor"]
            if others:
                return f"{', '.join(others)} follow {_name(self.erase.user)}"
            if not self.erase.draws_agree():
                return f"{_name(self.erase.user)}'s draws cannot be made apart from its call here"
            if self.erase.noise:
                return f"{_name(self.erase.user)} erases with noise, drawn on the CPU per pixel"
        got = self._normalized()
        if got is None or got[1] is not None:
            return "the steps after the ones run as written are not ToTensor() and Normalize()s"
        return None

    def on_tensor(self) -> bool:
        """Whether the steps run as written get the fused part's uint8
        tensor (a ``PILToTensor`` or ``ToImage`` before the crop: the
        reference presets' ``--backend tensor``)."""
        return self.fused is not None and not self.to_pil and type(self.fused.transforms[-1]) is T.PILToTensor

    def _conversion(self) -> tuple[list, type | None]:
        """``(coordl's steps for post, the class of what they give)`` given
        the uint8 image the steps run as written give: ``post_fused`` for a
        PIL image, :meth:`post_on_tensor`'s for the fused tensor (its class
        the ``tv_tensors.Image`` a ``ToImage`` made, unless a
        ``ToPureTensor`` follows); ``[]`` where they are something else."""
        if self.to_pil:
            return (list(self.post_fused.transforms) if self.post_fused is not None else []), self.post_type
        st = self._tensor_state()
        return ([st.to_tensor] + st.post, st.image_type) if st is not None else ([], None)

    def _normalized(self) -> tuple | None:
        """:meth:`_conversion` where it is coordl's ``ToTensor`` then
        ``Normalize``s, else None."""
        steps, image_type = self._conversion()
        if steps and type(steps[0]) is T.ToTensor and all(type(t) is T.Normalize for t in steps[1:]):
            return steps, image_type
        return None

    def split_conversion(self) -> list:
        """coordl's ``ToTensor`` then ``Normalize``s after the steps run as
        written (:meth:`split_refusal` None)."""
        return self._normalized()[0]

    def split_jitters(self) -> list | None:
        """The ``ColorJitterOnPlanes`` of the steps run as written when they
        are all torchvision ``ColorJitter``s whose draws coordl makes apart
        from their call (:meth:`split_rest` can then draw them and leave
        their arithmetic to the device), else None."""
        js = self.jitters()
        if not self.tail or any(j is None for j in js) or not all(j.draws_agree() for j in js):
            return None
        return js

    def split_rest(self, x: Any, jitter_on_device: bool = False) -> tuple[Any, tuple | None]:
        """For the device split (:meth:`split_refusal` None): ``x``, the fused
        part's result, through the steps run as written, drawing where the
        CPU path draws: ``(the uint8 RGB planes the conversion would scale,
        (ops, rects))``, ``ops`` the jitter's operations the device applies
        before converting (``jitter_on_device``, :meth:`split_jitters`: the
        steps are drawn, not run; else none) and ``rects`` the rectangles
        the erasing sets after it (none without one); or where the steps
        gave another image (a mode L), ``(the CPU path's whole result,
        None)``."""
        return self._through(x, True, jitter_on_device)

    def _run_steps(self, x: Any, planes: bool) -> tuple[Any, bool]:
        for t in self.tail:
            if planes and isinstance(t, OnPlanes) and t.exact():
                x = t.on_planes(x)
                continue
            if planes:
                x, planes = _to_pil(x), False
            x = t(x)
        return x, planes

    def jitters(self) -> list:
        """For each step of :attr:`tail`, its :class:`ColorJitterOnPlanes`
        where it is torchvision's ``ColorJitter`` (:func:`color_jitter_of`),
        its :class:`RandomApplyOnPlanes` where it is a ``RandomApply``
        around one (:func:`random_apply_of`), its :class:`GrayscaleOnPlanes`
        where it is a ``RandomGrayscale`` (:func:`grayscale_of`), the
        policies', one-operation steps', blur's, rotation's and affine
        map's, and AugMix's device counterparts (:func:`policy_of`,
        :func:`random_op_of`, :func:`blur_of`, :func:`geometric_of`,
        :func:`augmix_of`), else None:
        what ``decode="device"`` runs on the device.  Made once (the split
        draws through them for every sample; a policy keeps what it
        recorded of torchvision's geometric calls)."""
        got = self.__dict__.get("_jitters")
        if got is None or len(got) != len(self.tail):
            of = tensor_step_of if self.on_tensor() else device_step_of
            got = self._jitters = [of(t) for t in self.tail]
        return got

    def post_on_tensor(self) -> list | None:
        """coordl's steps for :attr:`post` given a uint8 tensor: ``[ToTensor
        or PILToTensor, Normalize...]`` where they are ``ConvertImageDtype``
        or ``ToDtype(float32, scale=True)`` then ``Normalize``s (then
        ``ToPureTensor``), or nothing (the uint8 image); else None."""
        return (self._conversion()[0] or None) if self.on_tensor() else None

    def _tensor_state(self) -> "_State | None":
        st = _State()
        st.stage, st.to_tensor, st.image_type = "u8", T.PILToTensor(), self.image_type
        if not all(_step(t, st) for t in self.post) or st.geo:
            return None
        return st

    def _run_post(self, x: Any) -> Any:
        if self.post_fused is not None and isinstance(x, Image.Image) and x.mode in ("RGB", "L"):
            x = _pil_through(x, self.post_fused.transforms)
            return x.as_subclass(self.post_type) if self.post_type is not None else x
        if isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.ndim == 3 and x.shape[0] == 3:
            got = self._post_for_tensor()
            if got is not None:       # ConvertImageDtype/ToDtype then Normalizes: coordl's one pass, the same values
                steps, image_type = got
                x = T._convert(x.as_subclass(torch.Tensor).contiguous(), steps, False, _ext())
                return x.as_subclass(image_type) if image_type is not None else x
        for t in self.post:
            x = t(x)
        return x

    def _post_for_tensor(self) -> tuple | None:
        """``(coordl's ToTensor and Normalizes, the class of their result)``
        where :attr:`post` is a conversion of the fused uint8 tensor to
        float and ``Normalize``s (:meth:`on_tensor`), else None; made once."""
        if "_tensor_post" not in self.__dict__:
            self._tensor_post = self._normalized() if self.on_tensor() else None
        return self._tensor_post

    def spec(self) -> tuple:
        spec = ("coordl.tvcompat.TorchvisionPipeline", self.fused.spec() if self.fused is not None else None,
                self.to_pil, T.spec_of(self.image_type) if self.image_type is not None else None,
                tuple(T.spec_of(t) for t in self.tail), tuple(T.spec_of(t) for t in self.post))
        if self.erase is not None:
            spec += (T.spec_of(self.erase.user), tuple(T.spec_of(t) for t in self.after))
        return spec

    def __repr__(self) -> str:
        lines = [f"    fused: {self.fused!r}".replace("\n", "\n    ")] if self.fused is not None else []
        lines += [f"    as written: {t!r}" for t in self.tail]
        lines += [f"    after them, without a generator: {t!r}" for t in self.post]
        if self.erase is not None:
            lines += [f"    then, under the generators of the steps as written: {self.erase.user!r}"]
            lines += [f"    after it: {t!r}" for t in self.after]
        return type(self).__name__ + "(\n" + "\n".join(lines) + "\n)"


def _ext():
    """coordl's compiled decode helpers (None where not built)."""
    from .decode import jpeg as _decode

    return _decode._ext


def _to_pil(x: torch.Tensor) -> Image.Image:
    """The uint8 CHW image ``x`` as a PIL image: its planes merged by PIL
    (a sixth of the time ``Image.fromarray`` takes on the HWC view of a CHW
    tensor, which it copies element by element first)."""
    c, h, w = x.shape
    if c not in (1, 3):
        return Image.fromarray(x.permute(1, 2, 0).numpy())
    a = x.contiguous().numpy()
    planes = [Image.frombuffer("L", (w, h), a[k], "raw", "L", 0, 1) for k in range(c)]
    return planes[0].copy() if c == 1 else Image.merge("RGB", planes)


def _pil_through(img: Image.Image, steps: list) -> torch.Tensor:
    """The PIL image ``img`` (RGB or L) through coordl's ``steps`` (a tensor
    conversion then ``ToDtype``/``Normalize``): read where PIL holds it and
    converted in one pass through the per-channel table of the fused path
    when the result is float32, else step by step."""
    ext = _ext()
    to_float = getattr(ext, "to_float", None) if ext is not None else None
    if to_float is not None and type(steps[0]) is T.ToTensor:
        arr = np.asarray(img)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        lut = T._float_lut(steps, arr.shape[2])
        if lut is not None:
            out = torch.empty((arr.shape[2], arr.shape[0], arr.shape[1]), dtype=torch.float32)
            to_float(arr.transpose(2, 0, 1), lut.numpy(), out.numpy(), False)
            return out
    return T._convert(T._to_chw(img), steps, False, ext)


class OnPlanes:
    """A user's torchvision step where it gets the PIL image that the fused
    path's planes (a uint8 (C, H, W) tensor, C 1 or 3, standing for a mode L
    or RGB image) stand for, run on the planes themselves: its result is the
    planes of the image the user's object would return, from the same torch
    draws in the same order.  Given anything else (a PIL image, a tensor) it
    runs the user's object as written, and so it does everywhere when
    :meth:`exact` is False.  Subclasses: :class:`ColorJitterOnPlanes`,
    :class:`AugMixOnPlanes`."""

    # what path_reason says of it
    how = ""
    # the constructor arguments of the probes :meth:`exact` checks the class with, and the seeds of
    # torch's generator it runs them under on an RGB and an L image
    probes: tuple = ({},)
    seeds: tuple = ((0,), (0,))

    def __init__(self, user: Any, v2: bool):
        self.user, self.v2 = user, v2

    def __call__(self, img: Any) -> Any:
        return self.user(img)

    @classmethod
    def probe(cls, user_cls: type, v2: bool, kw: dict) -> tuple:
        """``(the user's class made with kw, this class over it)``: what
        :meth:`exact` checks on probe images (an ``interpolation`` named by
        its value)."""
        if "interpolation" in kw:
            kw = {**kw, "interpolation": sys.modules["torchvision.transforms"].InterpolationMode(kw["interpolation"])}
        t = user_cls(**kw)
        return t, cls(t, v2)

    def on_planes(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def exact(self) -> bool:
        """Whether the planes give the user's own result in this process
        (checked once per process and class on probe images: the same bytes,
        and the same state of torch's generator after)."""
        return _agrees(type(self), type(self.user), self.v2)

    def spec(self) -> tuple:
        return (f"coordl.tvcompat.{type(self).__name__}", T.spec_of(self.user))

    def __repr__(self) -> str:
        return f"{self.user!r} (on the planes: {self.how})"


class ColorJitterOnPlanes(OnPlanes):
    """torchvision's ``ColorJitter`` (v1 or v2) on the planes: the user's
    object draws the parameters (its own ``get_params``/``make_params``), and
    ``coordl.decode.color`` computes what PIL computes for them (brightness,
    contrast, saturation and hue in the drawn order, bit for bit), with no
    PIL image in between."""

    how = "with its own draws and PIL's arithmetic, computed by coordl on the decoded planes"
    probes = ({"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1},
              {"brightness": (0.0, 2.5), "saturation": (0.0, 0.0), "hue": (-0.5, 0.5)})
    seeds = ((0, 1), (0,))

    def exact(self) -> bool:
        from .decode import color

        return color.exact_kernel() and super().exact()

    def draws_agree(self) -> bool:
        """Whether :meth:`draw` makes the user's class's own draws in this
        process, in its order, leaving torch's generator as its own call
        does (PIL's result of the drawn operations is the user's object's on
        probe images; checked once per process and class, without coordl's
        kernel): what ``decode="device"`` needs of it."""
        return _agrees(type(self), type(self.user), self.v2, draws=True)

    def draw(self, size: tuple | None = None) -> list[tuple[int, float]]:
        """The operations of one call, drawn as the user's object draws them,
        in ``coordl.decode.color.jitter``'s terms."""
        from .decode import color

        t = self.user
        if self.v2:
            p = t.make_params([])
            order, b, c, s, h = (p["fn_idx"], p["brightness_factor"], p["contrast_factor"],
                                 p["saturation_factor"], p["hue_factor"])
        else:
            order, b, c, s, h = t.get_params(t.brightness, t.contrast, t.saturation, t.hue)
        ops = []
        for k in order.tolist():
            if k == 0 and b is not None:
                ops.append((color.BRIGHTNESS, b))
            elif k == 1 and c is not None:
                ops.append((color.CONTRAST, c))
            elif k == 2 and s is not None:
                ops.append((color.SATURATION, s))
            elif k == 3 and h is not None:
                ops.append(_hue_op(h))
        return ops

    def on_planes(self, x: torch.Tensor) -> torch.Tensor:
        from .decode import color

        return torch.from_numpy(color.jitter(x.numpy(), self.draw()))


def _hue_op(h: float) -> tuple:
    """PIL's hue turn for torchvision's ``hue_factor`` ``h``: its shift of
    the 8-bit hue, truncated to int32, then wrapped to uint8."""
    from .decode import color

    if not -0.5 <= h <= 0.5:
        raise ValueError(f"hue_factor ({h}) is not in [-0.5, 0.5].")
    return color.HUE, int(np.int32(h * 255).astype(np.uint8))


class RandomApplyOnPlanes(OnPlanes):
    """torchvision's ``RandomApply`` (v1 or v2) around one ``ColorJitter``
    (timm's ``color_jitter_prob``; the self-supervised recipes'
    ``RandomApply([ColorJitter(...)], p=0.8)``), one ``GaussianBlur``
    (timm's ``gaussian_blur_prob``), or any steps ``decode="device"`` draws
    apart (a rotation, a policy...): its own draw of whether it applies
    (torch's generator, first, with its version's comparison), then the
    inner steps', in order (:class:`ColorJitterOnPlanes` alone on the
    planes; the others on the device only)."""

    def __init__(self, user: Any, v2: bool, inner: "OnPlanes", *more: "OnPlanes"):
        super().__init__(user, v2)
        self.inner, self.inners = inner, (inner, *more)
        self.how = f"applied with probability {user.p}, " + ", then ".join(
            f"the {type(i.user).__name__} {i.how}" for i in self.inners)
        # the inner steps' operations a call, at most; of them parameter slots; numpy's draws among them
        self.most = sum(getattr(i, "most", 4) for i in self.inners)
        self.affines = sum(getattr(i, "affines", 0) for i in self.inners)
        self.draws_numpy = any(getattr(i, "draws_numpy", False) for i in self.inners)
        self.draws_python = any(getattr(i, "draws_python", False) for i in self.inners)

    def _applies(self) -> bool:
        r = torch.rand(1)
        return bool(r < self.user.p) if self.v2 else not bool(self.user.p < r)

    def on_planes(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.on_planes(x) if self._applies() else x

    def draw(self, size: tuple | None = None) -> list[tuple[int, float]]:
        """The operations of one call: none where it does not apply."""
        return [op for i in self.inners for op in i.draw(size)] if self._applies() else []

    def exact(self) -> bool:
        return len(self.inners) == 1 and self.inner.exact() and _agrees(type(self), type(self.user), self.v2)

    def draws_agree(self) -> bool:
        return all(i.draws_agree() for i in self.inners) and _agrees(type(self), type(self.user), self.v2,
                                                                      draws=True)

    @classmethod
    def probe(cls, user_cls: type, v2: bool, kw: dict) -> tuple:
        """A ``RandomApply`` of the user's class around its version's
        ``ColorJitter``, and this class over it."""
        jitter = sys.modules["torchvision.transforms.v2" if v2 else "torchvision.transforms"].ColorJitter
        t = user_cls([jitter(**kw["jitter"])], p=kw["p"])
        return t, cls(t, v2, ColorJitterOnPlanes(t.transforms[0], v2))

    probes = ({"jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1}, "p": 0.6},)
    seeds = ((0, 1, 2, 3, 4, 5), (0, 1))


class GrayscaleOnPlanes(OnPlanes):
    """torchvision's ``RandomGrayscale`` (v1 or v2) on the planes: its draw
    (torch's generator: applied where ``torch.rand(1) < p``), then PIL's
    ``convert("L")`` repeated over three planes, which is PIL's
    ``ImageEnhance.Color`` at factor 0 (a blend at alpha 0 is the grey
    image itself): the colour operation ``(SATURATION, 0.0)`` of
    ``coordl.decode.color``, so that ``decode="device"`` applies it as a
    ``ColorJitter``'s.  An L image stays as it is (after the draw)."""

    how = "with its own draw and PIL's luma, computed by coordl on the decoded planes"
    probes = ({"p": 0.5},)
    seeds = ((0, 1, 2, 3, 4, 5), (0, 1, 2))
    most = 1                # operations per call (ColorJitter: 4)

    def exact(self) -> bool:
        from .decode import color

        return color.exact_kernel() and super().exact()

    def draws_agree(self) -> bool:
        return _agrees(type(self), type(self.user), self.v2, draws=True)

    def draw(self, size: tuple | None = None) -> list[tuple[int, float]]:
        from .decode import color

        return [(color.SATURATION, 0.0)] if bool(torch.rand(1) < self.user.p) else []

    def on_planes(self, x: torch.Tensor) -> torch.Tensor:
        from .decode import color

        ops = self.draw()
        return torch.from_numpy(color.jitter(x.numpy(), ops)) if ops and x.shape[0] == 3 else x


class AugMixOnPlanes(OnPlanes):
    """torchvision's ``AugMix`` (v1 or v2, ``fill=None``) on the planes.  On a
    PIL image it makes a uint8 tensor of it (``pil_to_tensor``: the (C, H, W)
    view of the image's (H, W, C) bytes), augments and mixes that, and makes a
    PIL image of the result; here it is given that very tensor (the same
    values in the same memory layout), and its result is the planes, without
    the two conversions.  Where its draws can be made apart from its call
    (:class:`AugMixDrawnOnPlanes`, checked once per process), an RGB image's
    draws are made so and mixed by ``coordl.decode.augmix``, whose CPU
    tables compute several of its operations faster, the same values."""

    _HOW = ("given the decoded planes as the uint8 tensor it makes of the PIL image (the same layout; no "
            "conversion to PIL and back)")

    def __init__(self, user: Any, v2: bool):
        super().__init__(user, v2)
        self.drawn: "AugMixDrawnOnPlanes | None" = None     # set by exact(), where it gives the user's result
        self._drawn_tried = False

    @property
    def how(self) -> str:
        return AugMixDrawnOnPlanes.how if self.drawn is not None else self._HOW

    def exact(self) -> bool:
        if not super().exact():
            return False
        if not self._drawn_tried:          # once (exact() is asked for every sample)
            self._drawn_tried = True
            try:
                drawn = AugMixDrawnOnPlanes(self.user, self.v2)
            except (TypeError, ValueError, AttributeError):     # chains past a record, another API
                drawn = None
            self.drawn = drawn if drawn is not None and drawn.exact() else None
        return True

    def on_planes(self, x: torch.Tensor) -> torch.Tensor:
        if self.drawn is not None and x.shape[0] == 3:
            return self.drawn.on_planes(x)
        out = self.user(x.permute(1, 2, 0).contiguous().permute(2, 0, 1))
        if not (isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and out.shape == x.shape):
            raise TypeError(f"AugMix gave {type(out).__name__} {getattr(out, 'dtype', '')} for planes of shape "
                            f"{tuple(x.shape)}, not uint8 planes of that shape")
        return out.as_subclass(torch.Tensor)


class _PILCall(Image.Image):
    """A PIL image of a size and mode, without pixels, that records the
    geometric call torchvision's functions make of it (``transform``,
    ``transpose``, ``copy``: what ``Image.rotate`` and torchvision's
    ``affine`` end in) instead of making it: how PIL would be asked to move
    an image's pixels, whatever torchvision version computed the matrix."""

    def __init__(self, size: tuple[int, int], mode: str = "RGB") -> None:
        super().__init__()
        self._size, self._mode = tuple(size), mode
        self.call: tuple | None = None

    def transform(self, size, method, data=None, resample=0, fill=1, fillcolor=None):   # noqa: D102
        self.call = ("transform", tuple(size), int(method), tuple(data or ()), int(resample), fillcolor)
        return self

    def transpose(self, method):   # noqa: D102
        self.call = ("transpose", int(method))
        return self

    def copy(self):   # noqa: D102
        self.call = ("copy",)
        return self

    def filter(self, filter):   # noqa: D102, A002 - PIL's name
        self.call = ("filter", filter)
        return self


class _OpsOnPlanes:
    """For a step whose draws are made apart from its call (:meth:`draw`, in
    ``coordl.decode.color``'s terms): the CPU path computes the drawn
    operations on the fused decode's RGB planes with coordl's kernels
    (``coordl.decode.color.apply_ops``: PIL's bytes), where that is checked
    to give the user's result here."""

    def exact(self) -> bool:
        """Whether :meth:`on_planes` gives the user's own result in this
        process: coordl's kernels are PIL's here, and the draws and their
        operations give what the user's class gives on probe images."""
        from .decode import color

        return color.exact_kernel() and color.exact_ops() and _agrees(type(self), type(self.user), self.v2)

    def on_planes(self, x: torch.Tensor) -> torch.Tensor:
        """The drawn operations computed on RGB planes (no PIL image in
        between); an L image's through the user's object as written."""
        from .decode import color

        if x.shape[0] != 3:
            return T._to_chw(self.user(_to_pil(x)))
        ops = self.draw((int(x.shape[1]), int(x.shape[2])))
        return torch.from_numpy(color.apply_ops(x.numpy(), ops))


class PolicyOnDevice(_OpsOnPlanes, OnPlanes):
    """torchvision's auto-augment policies (v1 or v2; nearest, bilinear or
    bicubic interpolation) on a PIL image, their draws made apart from their call,
    so that ``decode="device"`` (and the device split) run their operations
    on the device (``coordl.device.pil_ops``, ``coordl.device.jitter``).
    The draws are the user's class's own, in its order, from torch's
    generator (:meth:`draw`; each policy's in its subclass); each drawn
    operation becomes PIL's terms (``coordl.decode.color``'s codes):
    brightness, colour, contrast and sharpness factors, posterize's bits,
    solarize's threshold, autocontrast, equalize, invert, and for the
    shears, translations and rotations the very call torchvision makes of
    PIL (its matrix and fill, or a transposition), recorded on a pixel-less
    image (:class:`_PILCall`).  Checked once per process against the user's
    class on probe images (PIL's result of the drawn operations is the
    user's, and torch's generator is left as its call leaves it).  On the
    CPU path (:meth:`on_planes`) the same draws' operations are computed on
    the fused decode's planes by ``coordl.decode.color.apply_ops``, PIL's
    bytes, where that is checked to give the user's result here."""

    how = "its draws made apart from its call, its operations computed with PIL's arithmetic on the device"
    # RGB probes only: the device runs RGB images.  48 seeds draw every operation of each policy (and most
    # with both signs) over its probes; the check runs when a loader is made, at about 1 ms a seed and probe
    seeds = (tuple(range(48)), ())
    most = 1                             # operations per call
    affines = 1                          # of them affine maps, at most
    draws_numpy = False                  # draws from numpy's global generator (timm's)

    def __init__(self, user: Any, v2: bool):
        super().__init__(user, v2)
        self._spaces: dict = {}          # magnitudes by what they depend on (the image's size...)
        self._calls: dict = {}           # (name, magnitude, h, w) -> the operations of a geometric op

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_spaces": {}, "_calls": {}}

    def draws_agree(self) -> bool:
        return _agrees(type(self), type(self.user), self.v2, draws=True)

    def draw(self, size: tuple | None = None) -> list:
        """The operations of one call on an image of ``size`` (h, w), drawn
        as the user's object draws them."""
        h, w = size if size is not None else (0, 0)
        return [op for name, magnitude in self._draws(h, w) for op in self._ops(name, magnitude, h, w)]

    def _draws(self, h: int, w: int) -> list:
        """``[(operation name, magnitude)]`` of one call, in order."""
        raise NotImplementedError

    def _space_v1(self, *args) -> dict:
        """The user's v1 ``_augmentation_space(*args)``, kept (it depends on
        nothing drawn)."""
        return _kept(self._spaces, args, lambda: self.user._augmentation_space(*args))

    def _magnitudes_v2(self, name: str, fn, bins: int, h: int, w: int):
        return _kept(self._spaces, (name, bins, h, w), lambda: fn(bins, h, w))

    def _ops(self, name: str, magnitude: float, h: int, w: int) -> list:
        from .decode import color as C

        simple = {"Brightness": (C.BRIGHTNESS, 1.0 + magnitude), "Color": (C.SATURATION, 1.0 + magnitude),
                  "Contrast": (C.CONTRAST, 1.0 + magnitude), "Sharpness": (C.SHARPNESS, 1.0 + magnitude),
                  "Posterize": (C.POSTERIZE, int(magnitude)),
                  "Solarize": (C.SOLARIZE, 255.0 * magnitude if self.v2 else magnitude),
                  "AutoContrast": (C.AUTOCONTRAST, 0), "Equalize": (C.EQUALIZE, 0), "Invert": (C.INVERT, 0)}
        if name == "Identity":
            return []
        if name in simple:
            return [simple[name]]
        return _kept(self._calls, (name, magnitude, h, w), lambda: self._geometric(name, magnitude, h, w))

    def _geometric(self, name: str, magnitude: float, h: int, w: int) -> list:
        """The operations of the shear, translation or rotation ``name``:
        torchvision's own call of PIL for it, recorded."""
        t, img = self.user, _PILCall((w, h))
        if self.v2:
            fill = dict(t._fill)
            fill[_PILCall] = fill.get(Image.Image, fill.get("others"))
            t._apply_image_or_video_transform(img, name, magnitude, interpolation=t.interpolation, fill=fill)
        else:
            sys.modules["torchvision.transforms.autoaugment"]._apply_op(img, name, magnitude, t.interpolation,
                                                                         t.fill)
        return _affine_op(img.call, w, h, _name(t), name)


# entries a policy keeps of what depends on the image's size (its magnitudes, its geometric calls): images
# of many sizes (no crop before the policy) start the memo again rather than grow it
_KEEP = 4096


def _kept(memo: dict, key: Any, make: Any) -> Any:
    """``memo[key]``, made by ``make()`` when missing (``memo`` emptied
    first when it holds :data:`_KEEP` entries)."""
    return _memo.kept(memo, key, make, _KEEP)


def _affine_op(call: tuple, w: int, h: int, who: str, name: str) -> list:
    """The operations of a geometric call recorded by :class:`_PILCall`:
    ``(AFFINE, (a0..a5, fill, filter))``, ``(PERSPECTIVE, (a0..a7, fill,
    filter))``, ``(TRANSPOSE, method)``, or none (a copy)."""
    from .decode import color as C

    if call is None:
        raise ValueError(f"{who}'s {name} made no call of PIL's transform or transpose")
    if call[0] == "copy":
        return []
    if call[0] == "transpose":
        return [(C.TRANSPOSE, call[1])]
    _, size, method, data, resample, fillcolor = call
    code, n = {int(Image.Transform.AFFINE): (C.AFFINE, 6), int(Image.Transform.PERSPECTIVE): (C.PERSPECTIVE, 8)}.get(
        method, (None, 0))
    if size != (w, h) or code is None or len(data) != n or resample not in _FILTERS:
        raise ValueError(f"{who}'s {name} asks PIL for a transform coordl does not run on the device "
                         f"(size {size}, method {method}, resample {resample})")
    if fillcolor is not None:
        fillcolor = tuple(int(v) for v in (fillcolor if isinstance(fillcolor, tuple) else (fillcolor,) * 3))
    return [(code, (*(float(v) for v in data), fillcolor, resample))]


# PIL's filters the device's affine maps run: nearest, bilinear, bicubic
_FILTERS = (int(Image.Resampling.NEAREST), int(Image.Resampling.BILINEAR), int(Image.Resampling.BICUBIC))
_FILL = [9, 80, 200]


class TrivialAugmentOnDevice(PolicyOnDevice):
    """``TrivialAugmentWide``: one operation a call, its magnitude drawn
    from the bins."""

    probes = ({}, {"num_magnitude_bins": 7}, {"fill": _FILL})

    def _draws(self, h: int, w: int) -> list:
        t = self.user
        if self.v2:
            name, (fn, signed) = t._get_random_item(t._AUGMENTATION_SPACE)
            magnitudes = self._magnitudes_v2(name, fn, t.num_magnitude_bins, h, w)
            if magnitudes is None:
                return [(name, 0.0)]
            magnitude = float(magnitudes[int(torch.randint(t.num_magnitude_bins, ()))])
            if signed and torch.rand(()) <= 0.5:
                magnitude *= -1
            return [(name, magnitude)]
        space = self._space_v1(t.num_magnitude_bins)
        name = list(space)[int(torch.randint(len(space), (1,)).item())]
        magnitudes, signed = space[name]
        magnitude = float(magnitudes[torch.randint(len(magnitudes), (1,), dtype=torch.long)].item()) \
            if magnitudes.ndim > 0 else 0.0
        if signed and torch.randint(2, (1,)):
            magnitude *= -1.0
        return [(name, magnitude)]


class RandAugmentOnDevice(PolicyOnDevice):
    """``RandAugment``: ``num_ops`` operations a call at the one magnitude."""

    probes = ({}, {"num_ops": 3, "magnitude": 20}, {"fill": _FILL, "num_magnitude_bins": 11, "magnitude": 10})

    def __init__(self, user: Any, v2: bool):
        super().__init__(user, v2)
        self.most = self.affines = int(user.num_ops)

    def _draws(self, h: int, w: int) -> list:
        t, out = self.user, []
        for _ in range(t.num_ops):
            if self.v2:
                name, (fn, signed) = t._get_random_item(t._AUGMENTATION_SPACE)
                magnitudes = self._magnitudes_v2(name, fn, t.num_magnitude_bins, h, w)
                magnitude = 0.0
                if magnitudes is not None:
                    magnitude = float(magnitudes[t.magnitude])
                    if signed and torch.rand(()) <= 0.5:
                        magnitude *= -1
            else:
                space = self._space_v1(t.num_magnitude_bins, (h, w))
                name = list(space)[int(torch.randint(len(space), (1,)).item())]
                magnitudes, signed = space[name]
                magnitude = float(magnitudes[t.magnitude].item()) if magnitudes.ndim > 0 else 0.0
                if signed and torch.randint(2, (1,)):
                    magnitude *= -1.0
            out.append((name, magnitude))
        return out


class AutoAugmentOnDevice(PolicyOnDevice):
    """``AutoAugment``: a sub-policy drawn, each of its two operations
    applied with its probability."""

    probes = ({}, {"policy": "CIFAR10"}, {"policy": "SVHN", "fill": _FILL})
    most = affines = 2

    @classmethod
    def probe(cls, user_cls: type, v2: bool, kw: dict) -> tuple:
        kw = dict(kw)
        if "policy" in kw:
            kw["policy"] = sys.modules["torchvision.transforms"].AutoAugmentPolicy[kw["policy"]]
        return super().probe(user_cls, v2, kw)

    def _draws(self, h: int, w: int) -> list:
        t, out = self.user, []
        if self.v2:
            policy = t._policies[int(torch.randint(len(t._policies), ()))]
            for name, probability, magnitude_idx in policy:
                if not torch.rand(()) <= probability:
                    continue
                fn, signed = t._AUGMENTATION_SPACE[name]
                magnitudes = self._magnitudes_v2(name, fn, 10, h, w)
                magnitude = 0.0
                if magnitudes is not None:
                    magnitude = float(magnitudes[magnitude_idx])
                    if signed and torch.rand(()) <= 0.5:
                        magnitude *= -1
                out.append((name, magnitude))
            return out
        transform_id, probs, signs = t.get_params(len(t.policies))
        space = self._space_v1(10, (h, w))
        for i, (name, p, magnitude_id) in enumerate(t.policies[transform_id]):
            if probs[i] <= p:
                magnitudes, signed = space[name]
                magnitude = float(magnitudes[magnitude_id].item()) if magnitude_id is not None else 0.0
                if signed and signs[i] == 0:
                    magnitude *= -1.0
                out.append((name, magnitude))
        return out


_POLICIES = {"TrivialAugmentWide": TrivialAugmentOnDevice, "RandAugment": RandAugmentOnDevice,
             "AutoAugment": AutoAugmentOnDevice}

_TIMM_AA = "timm.data.auto_augment"
# timm's operations (its module's functions) the device runs: the geometric ones through PIL's call
# recorded, the others as coordl.decode.color's codes
_TIMM_GEOMETRIC = frozenset(("rotate", "shear_x", "shear_y", "translate_x_abs", "translate_y_abs", "translate_x_rel",
                             "translate_y_rel"))
_TIMM_OTHERS = frozenset(("auto_contrast", "equalize", "invert", "posterize", "solarize", "solarize_add", "color",
                          "contrast", "brightness", "sharpness", "desaturate", "gaussian_blur", "gaussian_blur_rand"))


class TimmPolicyOnDevice(PolicyOnDevice):
    """timm's ``RandAugment`` and ``AutoAugment`` (``timm.data.auto_augment``:
    ``create_transform(..., auto_augment="rand-m9-mstd0.5-inc1")``, its
    training recipes' ``--aa``) on a PIL image, drawn apart from their call
    as timm draws them: the operations a call applies (numpy's global
    generator for ``RandAugment``'s choice, Python's for ``AutoAugment``'s
    sub-policy), then for each its own draws in ``AugmentOp``'s order
    (Python's generator: whether it applies, the magnitude's noise, the
    sign in its level function, the filter of a geometric one), its
    arguments from its own level function.  The geometric operations are
    timm's very call of PIL, recorded (with the filter it drew: bilinear or
    bicubic by default), and so is the Gaussian blur's filter (with the
    radius ``GaussianBlurRand`` drew: its ``3a`` policy, DeiT III's three
    augmentations); the others are mapped to PIL's terms by timm's function
    (``Desaturate`` a colour enhancement).  Operations the device does not
    run keep the policy as written."""

    probes = ({"config": "rand-m9-mstd0.5-inc1"}, {"config": "rand-m7-n3-mstd1.0", "hparams": {"img_mean": (1, 2, 3)}},
              {"config": "original"}, {"config": "v0r", "hparams": {"interpolation": 0}}, {"config": "3a"},
              {"config": "rand-m9-n2-mstd0.5-t3aw"})
    seeds = (tuple(range(48)), ())      # every operation and filter drawn over the probes
    draws_numpy = True

    def __init__(self, user: Any, v2: bool = False):
        super().__init__(user, False)
        ops = self._all_ops()
        if not ops or any(getattr(op.aug_fn, "__module__", "") != _TIMM_AA
                          or op.aug_fn.__name__ not in _TIMM_GEOMETRIC | _TIMM_OTHERS for op in ops):
            raise ValueError("an operation coordl does not run on the device")
        self.most = self.affines = self._most()

    def _most(self) -> int:
        """The operations a call applies, at most."""
        t = self.user
        return int(t.num_layers) if type(t).__name__ == "RandAugment" else max(len(p) for p in t.policy)

    def _all_ops(self) -> list:
        t = self.user
        return list(t.ops) if type(t).__name__ == "RandAugment" else [op for p in t.policy for op in p]

    @classmethod
    def probe(cls, user_cls: type, v2: bool, kw: dict) -> tuple:
        mod = sys.modules[_TIMM_AA]
        config, hparams = kw["config"], dict(kw.get("hparams", {}))
        t = (mod.rand_augment_transform if config.startswith("rand") else cls._maker(mod))(config, hparams)
        return t, cls(t)

    @staticmethod
    def _maker(mod):
        """timm's function that makes a policy of a probe's config (not
        ``rand``)."""
        return mod.auto_augment_transform

    def draw(self, size: tuple | None = None) -> list:
        import numpy as np

        h, w = size if size is not None else (0, 0)
        t = self.user
        if type(t).__name__ == "RandAugment":
            ops = np.random.choice(t.ops, t.num_layers, replace=t.choice_weights is None, p=t.choice_weights)
        else:
            ops = random.choice(t.policy)
        return [o for op in ops for o in self._op(op, h, w)]

    def _op(self, op: Any, h: int, w: int) -> list:
        """One ``AugmentOp``'s draws, as its call makes them, and its
        operations."""
        from .decode import color as C

        if op.prob < 1.0 and random.random() > op.prob:
            return []
        magnitude = op.magnitude
        if op.magnitude_std > 0:
            if op.magnitude_std == float("inf"):
                magnitude = random.uniform(0, magnitude)
            elif op.magnitude_std > 0:
                magnitude = random.gauss(magnitude, op.magnitude_std)
        upper = op.magnitude_max or sys.modules[_TIMM_AA]._LEVEL_DENOM
        magnitude = max(0., min(magnitude, upper))
        args = op.level_fn(magnitude, op.hparams) if op.level_fn is not None else tuple()
        fn = op.aug_fn.__name__
        if fn in _TIMM_GEOMETRIC:
            img = _PILCall((w, h))
            op.aug_fn(img, *args, **op.kwargs)       # its filter drawn in there, as in its call
            return _affine_op(img.call, w, h, "timm", op.name)
        if fn in ("color", "contrast", "brightness", "sharpness"):
            code = {"color": C.SATURATION, "contrast": C.CONTRAST, "brightness": C.BRIGHTNESS,
                    "sharpness": C.SHARPNESS}[fn]
            return [(code, float(args[0]))]
        if fn == "posterize":
            bits = int(args[0])
            if bits >= 8:
                return []
            from PIL import ImageOps

            ImageOps.posterize(Image.new("L", (1, 1)), bits)     # PIL's own error for bits it refuses
            return [(C.POSTERIZE, bits)]
        if fn == "solarize":
            return [(C.SOLARIZE, args[0])]
        if fn == "desaturate":        # the colour enhancement at 1 - factor, within 0..1
            return [(C.SATURATION, min(1.0, max(0.0, 1.0 - float(args[0]))))]
        if fn in ("gaussian_blur", "gaussian_blur_rand"):
            img = _PILCall((w, h))
            op.aug_fn(img, *args, **op.kwargs)       # its radius drawn in there, as in its call
            return _pil_blur_op(img.call, op.name)
        if fn == "solarize_add":
            if len(args) > 1:
                raise ValueError("timm's solarize_add with a threshold of its own")
            return [(C.SOLARIZE_ADD, int(args[0]))]
        return [({"auto_contrast": C.AUTOCONTRAST, "equalize": C.EQUALIZE, "invert": C.INVERT}[fn], 0)]


class TimmAugMixOnDevice(TimmPolicyOnDevice):
    """timm's ``AugMixAugment`` (``create_transform(...,
    auto_augment="augmix-m3-w3")``, timm's ``--aa augmix-...``; not its
    ``blended`` mode), drawn apart from its call as timm draws it: the
    chains' weights (numpy's Dirichlet, as float32) and the blend's
    (numpy's beta), then for each chain its depth and operations (numpy's
    choice) and each operation's own draws (Python's, as
    :class:`TimmPolicyOnDevice`).  The draws are one operation,
    ``(TIMM_AUGMIX, (m, weights, chains))`` (``coordl.decode.color``), each
    chain PIL's operations; the device runs the chains as any operations,
    then timm's mix (:class:`coordl.device.jitter.DeviceJitter`)."""

    probes = ({"config": "augmix-m3-w3"}, {"config": "augmix-m5-w2-d2-mstd0.5-a0.5"})
    seeds = (tuple(range(60)), ())

    def __init__(self, user: Any, v2: bool = False):
        from .decode.color import AFFINE
        from .device import encoded

        super().__init__(user, False)
        if user.blended or not 1 <= int(user.width) <= 15:
            raise ValueError("timm's blended AugMix, or one of more than 15 chains")
        depth = int(user.depth) if int(user.depth) > 0 else 3
        affine = (AFFINE, (1.0, 0.0, 0.0, 0.0, 1.0, 0.0, None, 0))      # an operation's most fields
        worst = (0.5, (0.5,) * int(user.width), ((affine,) * depth,) * int(user.width))
        if depth > 15 or encoded.timm_augmix_fields(worst) > 7 * encoded.MAX_AFFINES:
            raise ValueError(f"timm's AugMix of {user.width} chains of {depth} operations: more than a record carries")
        self.affines = -(-encoded.timm_augmix_fields(worst) // 7)

    def _most(self) -> int:
        return 1            # one operation: the mix (its chains inside it)

    def _all_ops(self) -> list:
        return list(self.user.ops)

    @staticmethod
    def _maker(mod):
        return mod.augment_and_mix_transform

    def draw(self, size: tuple | None = None) -> list:
        import numpy as np

        from .decode import color as C

        h, w = size if size is not None else (0, 0)
        t = self.user
        weights = np.float32(np.random.dirichlet([t.alpha] * t.width))
        m = np.float32(np.random.beta(t.alpha, t.alpha))
        chains = []
        for _ in weights:
            depth = t.depth if t.depth > 0 else np.random.randint(1, 4)
            ops = np.random.choice(t.ops, depth, replace=True)
            chains.append(tuple(o for op in ops for o in self._op(op, h, w)))
        return [(C.TIMM_AUGMIX, (float(m), tuple(float(v) for v in weights), tuple(chains)))]


def _pil_blur_op(call: tuple | None, name: str) -> list:
    """The operation of an ``Image.filter`` call recorded by
    :class:`_PILCall`: PIL's ``GaussianBlur`` of one radius both ways."""
    from PIL import ImageFilter

    from .decode import color as C

    f = call[1] if call is not None and call[0] == "filter" else None
    if type(f) is not ImageFilter.GaussianBlur:
        raise ValueError(f"timm's {name} made no call of PIL's GaussianBlur filter")
    radius = f.radius
    if isinstance(radius, (tuple, list)):
        if len(radius) != 2 or radius[0] != radius[1]:
            raise ValueError(f"timm's {name} blurs with radii {radius}")
        radius = radius[0]
    return [(C.PIL_BLUR, float(radius))] if radius else []


class _DrawnApart(OnPlanes):
    """A step whose draws ``decode="device"`` makes apart from its call
    (:meth:`draw`), checked against the user's class on probe images; on
    the CPU path it runs as written (or as another :class:`OnPlanes` of its
    own)."""

    def exact(self) -> bool:
        return False

    def draws_agree(self) -> bool:
        return _agrees(type(self), type(self.user), self.v2, draws=True)


class RandomOpOnDevice(_OpsOnPlanes, _DrawnApart):
    """torchvision's one-operation random steps on a PIL image (v1 or v2):
    ``RandomPosterize``, ``RandomSolarize``, ``RandomAdjustSharpness``,
    ``RandomAutocontrast``, ``RandomEqualize``, ``RandomInvert`` (the
    self-supervised recipes' solarization, torchvision's examples).  Their
    one draw (``torch.rand(1) < p``) is made apart from the call, and the
    operation is PIL's (``coordl.decode.color``'s code), computed on the
    device as an auto-augment policy's, and on the CPU path's planes by
    coordl's kernels.  Checked once per process against the user's class on
    probe images."""

    how = "its draw made apart from its call, its operation computed with PIL's arithmetic on the device"
    probes = ({},)
    seeds = (tuple(range(16)), ())
    most = 1
    affines = 0
    # class name -> (the attribute holding the operation's value, or None; coordl.decode.color's code's name)
    KINDS = {"RandomPosterize": ("bits", "POSTERIZE"), "RandomSolarize": ("threshold", "SOLARIZE"),
             "RandomAdjustSharpness": ("sharpness_factor", "SHARPNESS"), "RandomAutocontrast": (None, "AUTOCONTRAST"),
             "RandomEqualize": (None, "EQUALIZE"), "RandomInvert": (None, "INVERT")}
    _PROBE_ARGS = {"RandomPosterize": {"bits": 3}, "RandomSolarize": {"threshold": 100.5},
                   "RandomAdjustSharpness": {"sharpness_factor": 1.7}}

    @classmethod
    def probe(cls, user_cls: type, v2: bool, kw: dict) -> tuple:
        t = user_cls(**cls._PROBE_ARGS.get(user_cls.__name__, {}), p=0.5)
        return t, cls(t, v2)

    def draw(self, size: tuple | None = None) -> list:
        from .decode import color as C

        t = self.user
        if not (bool(torch.rand(1) < t.p) if self.v2 else torch.rand(1).item() < t.p):
            return []
        attr, code = self.KINDS[type(t).__name__]
        value = getattr(t, attr) if attr is not None else 0
        return [(getattr(C, code), int(value) if code == "POSTERIZE" else float(value))]


class BlurOnDevice(_DrawnApart):
    """torchvision's ``GaussianBlur`` (v1 or v2) on a PIL image (timm's
    ``gaussian_blur_prob`` puts one in a ``RandomApply``): its sigma drawn
    apart from its call by the user's own ``get_params``/``make_params``,
    the blur computed on the device (``coordl.device.pil_ops``): on a GPU
    within a level of the CPU path on a few values in a million, its
    convolution's sums in double precision where the CPU path's are single.
    On the CPU path it runs as written."""

    how = "its sigma drawn apart from its call, the blur computed on the device"
    probes = ({"kernel_size": 5, "sigma": (0.1, 2.0)}, {"kernel_size": (3, 7), "sigma": (0.5, 1.5)})
    seeds = (tuple(range(8)), ())
    most = 1
    affines = 1                          # a parameter slot of the record

    def draw(self, size: tuple | None = None) -> list:
        from .decode import color as C

        t = self.user
        if self.v2:
            sx, sy = t.make_params([])["sigma"]
        else:
            sx = sy = t.get_params(t.sigma[0], t.sigma[1])
        kx, ky = t.kernel_size
        return [(C.BLUR, (int(kx), int(ky), float(sx), float(sy), int(self.v2)))]


class GrayscaleOnDevice(_DrawnApart):
    """torchvision's ``Grayscale(num_output_channels=3)`` (v1 or v2): PIL's
    ``convert("L")`` repeated over three planes, the colour operation
    ``(SATURATION, 0.0)`` (as a ``RandomGrayscale`` that applies), on the
    device.  It draws nothing; on the CPU path it runs as written."""

    how = "its grey image computed with PIL's arithmetic on the device"
    probes = ({"num_output_channels": 3},)
    seeds = ((0,), ())
    most = 1
    affines = 0

    def draw(self, size: tuple | None = None) -> list:
        from .decode import color

        return [(color.SATURATION, 0.0)]


class PhotometricOnDevice(_DrawnApart):
    """torchvision v2's ``RandomPhotometricDistort`` (SSD's distortions) and
    ``RandomChannelPermutation`` on a PIL image: the user's own
    ``make_params`` draws (on a stand-in of the image's shape), and the
    operations its ``transform`` applies for them, in its order (brightness;
    contrast before or after saturation and hue, as drawn; the band
    permutation last) become ``coordl.decode.color``'s codes: PIL's
    ``ImageEnhance`` and HSV arithmetic, as a ``ColorJitter``'s, and
    ``PERMUTE``."""

    how = "its draws made apart from its call, its operations computed with PIL's arithmetic on the device"
    seeds = (tuple(range(40)), ())

    def __init__(self, user: Any, v2: bool):
        super().__init__(user, v2)
        self.most = 5 if type(user).__name__ == "RandomPhotometricDistort" else 1
        self.affines = 0

    @classmethod
    def probe(cls, user_cls: type, v2: bool, kw: dict) -> tuple:
        if user_cls.__name__ == "RandomChannelPermutation":
            kw = {}
        return super().probe(user_cls, v2, kw)

    probes = ({}, {"p": 1.0}, {"brightness": (0.2, 1.8), "hue": (-0.5, 0.5), "p": 0.7})

    def draw(self, size: tuple | None = None) -> list:
        from .decode import color as C

        h, w = size if size is not None else (1, 1)
        p = self.user.make_params([torch.empty(1).expand(3, h, w)])
        ops = []
        if "permutation" not in p:                   # RandomPhotometricDistort
            b, c, s, hue = (p[k] for k in ("brightness_factor", "contrast_factor", "saturation_factor", "hue_factor"))
            before = p["contrast_before"]
            if b is not None:
                ops.append((C.BRIGHTNESS, float(b)))
            if c is not None and before:
                ops.append((C.CONTRAST, float(c)))
            if s is not None:
                ops.append((C.SATURATION, float(s)))
            if hue is not None:
                ops.append(_hue_op(hue))
            if c is not None and not before:
                ops.append((C.CONTRAST, float(c)))
            perm = p["channel_permutation"]
        else:
            perm = p["permutation"]
        if perm is not None:
            a, b2, c2 = (int(i) for i in perm)
            ops.append((C.PERMUTE, a * 100 + b2 * 10 + c2))
        return ops


class GeometricOnDevice(_OpsOnPlanes, _DrawnApart):
    """torchvision's ``RandomRotation`` (without ``expand``) and
    ``RandomAffine`` (v1 or v2; nearest, bilinear or bicubic) after the
    crop, on a PIL image: the user's object is called on a pixel-less PIL
    image (:class:`_PILCall`) of the image's size, so its own draws are made
    in its order and the call it would make of PIL's ``transform`` (its
    matrix, fill and filter) is recorded; the device runs that affine map
    with PIL's arithmetic (``coordl.device.pil_ops``), as an auto-augment
    policy's, and on the CPU path's planes by coordl's kernels.  Checked
    once per process against the user's class on probe images."""

    how = "its draws made apart from its call, its affine map computed with PIL's arithmetic on the device"
    seeds = (tuple(range(12)), ())       # RGB probes only: the device runs RGB images
    most = 1
    affines = 1
    maybe = False                        # applied with a probability (a call may leave the image as it is)

    def draw(self, size: tuple | None = None) -> list:
        """The operations of one call on an image of ``size`` (h, w): the
        user's object's own draws, and its call of PIL."""
        h, w = size if size is not None else (0, 0)
        img = _PILCall((w, h))
        if self.user(img) is not img:
            raise ValueError(f"{_name(self.user)} returned another image than PIL's transform of it")
        if img.call is None and self.maybe:        # drawn not to apply
            return []
        return _affine_op(img.call, w, h, _name(self.user), type(self.user).__name__)


class RotationOnDevice(GeometricOnDevice):
    probes = ({"degrees": 30}, {"degrees": (-10, 40), "interpolation": "bilinear", "fill": [9, 80, 200]},
              {"degrees": (90, 90), "interpolation": "bicubic", "center": (3, 4)})


class PerspectiveOnDevice(GeometricOnDevice):
    """``RandomPerspective``: applied with its probability; its map, eight
    coefficients, takes two of a record's parameter slots."""

    how = "its draws made apart from its call, its perspective map computed with PIL's arithmetic on the device"
    probes = ({"p": 0.7}, {"distortion_scale": 0.9, "p": 1.0, "interpolation": "nearest", "fill": [9, 80, 200]},
              {"distortion_scale": 0.3, "p": 0.5, "interpolation": "bicubic", "fill": 40})
    affines = 2
    maybe = True


class AffineOnDevice(GeometricOnDevice):
    probes = ({"degrees": 20, "translate": (0.1, 0.2), "scale": (0.8, 1.2), "shear": 10},
              {"degrees": 0, "shear": (-5, 5, -8, 8), "interpolation": "bilinear", "fill": 17},
              {"degrees": (-30, 30), "scale": (0.5, 1.5), "interpolation": "bicubic", "fill": [1, 2, 3]})


class AugMixOnDevice(_DrawnApart):
    """torchvision's ``AugMix`` (v1 or v2; ``fill=None``, nearest or
    bilinear interpolation, chains that fit a record) on a PIL image (the
    reference classification script's ``--auto-augment augmix``), its draws
    made apart from its call: the two Dirichlet draws of the weights, then
    each chain's depth and its operations' names, magnitudes and signs, from
    torch's generator in the user's object's order, with its own
    augmentation space.  The device mixes the rows with torchvision's own
    functions (``coordl.decode.augmix``).  Checked once per process against
    the user's class on probe images.  On the CPU path it runs as
    :class:`AugMixOnPlanes` (or as written)."""

    how = "its draws made apart from its call, its operations and mix computed on the device"
    probes = ({}, {"severity": 5, "mixture_width": 2, "chain_depth": 2, "alpha": 0.5},
              {"all_ops": False, "interpolation": "nearest", "severity": 10, "mixture_width": 4, "chain_depth": 1},
              {"chain_depth": 3, "mixture_width": 3, "alpha": 2.0})
    seeds = (tuple(range(24)), ())     # RGB probes only: the device runs RGB images
    most = 1
    affines = 2                         # two of the record's parameter slots

    def __init__(self, user: Any, v2: bool):
        from .decode import augmix

        super().__init__(user, v2)
        self.mode = _function_mode(user)
        width, depth = int(user.mixture_width), int(user.chain_depth)
        if not augmix.fits(width, depth if depth > 0 else 3) or not 1 <= int(user.severity) <= 10:
            raise ValueError(f"AugMix with {width} chains of depth {depth}, more than a record carries")
        self._spaces: dict = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_spaces": {}}

    def draw(self, size: tuple | None = None) -> list:
        """The one operation of a call on an image of ``size`` (h, w):
        ``(AUGMIX, value)``, its value ``coordl.decode.augmix``'s."""
        from .decode import augmix
        from .decode.color import AUGMIX

        h, w = size if size is not None else (0, 0)
        t = self.user
        m = t._sample_dirichlet(torch.tensor([t.alpha, t.alpha]).expand(1, -1))
        weights = t._sample_dirichlet(torch.tensor([t.alpha] * t.mixture_width).expand(1, -1)) \
            * m[:, 1].reshape([1, -1])
        chains = []
        for _ in range(t.mixture_width):
            depth = t.chain_depth if t.chain_depth > 0 else int(torch.randint(low=1, high=4, size=(1,)).item())
            chains.append(tuple((augmix.INDEX[name], magnitude) for name, magnitude in
                                (self._one(h, w) for _ in range(depth))))
        return [(AUGMIX, (int(self.v2), self.mode, float(m[0, 0]), tuple(float(v) for v in weights[0]),
                          tuple(chains)))]

    def _one(self, h: int, w: int) -> tuple:
        """One operation's draws: ``(name, magnitude)``."""
        t = self.user
        if self.v2:
            space = t._AUGMENTATION_SPACE if t.all_ops else t._PARTIAL_AUGMENTATION_SPACE
            name, (fn, signed) = t._get_random_item(space)
            magnitudes = _kept(self._spaces, (name, h, w), lambda: fn(t._PARAMETER_MAX, h, w))
            if magnitudes is None:
                return name, 0.0
            magnitude = float(magnitudes[int(torch.randint(t.severity, ()))])
            if signed and torch.rand(()) <= 0.5:
                magnitude *= -1
            return name, magnitude
        key = (h, w)
        space = _kept(self._spaces, key, lambda: t._augmentation_space(t._PARAMETER_MAX, (h, w)))
        name = list(space)[int(torch.randint(len(space), (1,)).item())]
        magnitudes, signed = space[name]
        magnitude = float(magnitudes[torch.randint(t.severity, (1,), dtype=torch.long)].item()) \
            if magnitudes.ndim > 0 else 0.0
        if signed and torch.randint(2, (1,)):
            magnitude *= -1.0
        return name, magnitude


class _OnTensor:
    """A step given the fused path's uint8 tensor rather than a PIL image
    (torchvision's reference presets with ``backend="tensor"`` convert with
    ``PILToTensor`` before the crop), drawn apart from its call.  On a tensor
    torchvision's auto-augment policies and ``AugMix`` draw as on a PIL
    image and apply their operations with torchvision's own tensor
    functions, the ones ``AugMix`` mixes with (``coordl.decode.augmix``); a
    call's operations travel as an ``AUGMIX`` value (:meth:`tensor_ops`).
    Those functions take nearest and bilinear interpolation only, as on a
    tensor torchvision does; a fill is refused.  Checked once per process
    against the user's class called on tensors (:func:`_check_agreement`).
    On the CPU path (:meth:`__call__`, where :meth:`exact`) the same draws'
    operations are computed on the tensor by ``coordl.decode.augmix``: its
    tables and kept grids, torchvision's values."""

    on_tensor = True
    how = ("given the uint8 tensor: its draws made apart from its call, its operations torchvision's own tensor "
           "functions on the device")

    def __init__(self, user: Any, v2: bool):
        super().__init__(user, v2)
        if _has_fill(user, v2):          # the device's functions fill nothing
            raise ValueError(f"{_name(user)} on a tensor with a fill")
        self.mode = _function_mode(user)

    def exact(self) -> bool:
        """Whether :meth:`on_planes` gives the user's call on a uint8 RGB
        tensor in this process (checked once per process and class on probe
        images: the same values, and torch's generator left the same)."""
        return _agrees(type(self), type(self.user), self.v2)

    def on_planes(self, x: torch.Tensor) -> torch.Tensor:
        """The user's call on the uint8 (C, H, W) tensor ``x``: its draws'
        operations mixed by ``coordl.decode.augmix`` (RGB; another image
        through the user's object)."""
        from .decode import augmix

        if x.shape[0] != 3:
            return self.user(x)
        ops = self.draw((int(x.shape[1]), int(x.shape[2])))
        return augmix.on_planes(x, ops[0][1]) if ops else x

    def __call__(self, img: Any) -> Any:
        if type(img) is torch.Tensor and img.dtype == torch.uint8 and img.ndim == 3 and img.shape[0] == 3:
            return self.on_planes(img)
        return self.user(img)


def _function_mode(user: Any) -> int:
    """The index in ``augmix.MODES`` of ``user``'s interpolation, which
    torchvision's tensor functions run (else ValueError)."""
    from .decode import augmix

    mode = getattr(user.interpolation, "value", user.interpolation)
    if mode not in augmix.MODES:
        raise ValueError(f"{_name(user)} interpolating with {mode} on a tensor")
    return augmix.MODES.index(mode)


class _PolicyOnTensor(_OnTensor):
    """An auto-augment policy on a uint8 tensor: the policy's draws (its
    :meth:`PolicyOnDevice._draws`), as one ``AUGMIX`` value of one chain
    weighted 1 over the original image weighted 0 (torchvision's mix of
    that is the chain's result, exactly: a product by 0, one by 1, an
    integer's truncation), ``Identity`` left out."""

    def __init__(self, user: Any, v2: bool):
        from .decode import augmix

        super().__init__(user, v2)
        if not augmix.fits(1, max(self.most, 1)):      # RandAugment(num_ops=0) draws nothing
            raise ValueError(f"{_name(user)} with {self.most} operations a call, more than a record carries")
        self.most, self.affines = 1, 2             # one AUGMIX value: two of the record's parameter slots

    def draw(self, size: tuple | None = None) -> list:
        from .decode import augmix
        from .decode.color import AUGMIX

        h, w = size if size is not None else (0, 0)
        chain = tuple((augmix.INDEX[name], float(m)) for name, m in self._draws(h, w) if name != "Identity")
        return [(AUGMIX, (int(self.v2), self.mode, 0.0, (1.0,), (chain,)))] if chain else []


def _tensor_probes(probes: tuple) -> tuple:
    """A policy's probes without their fill, and one interpolating bilinearly."""
    return tuple({k: v for k, v in p.items() if k != "fill"} for p in probes) + ({"interpolation": "bilinear"},)


class TrivialAugmentOnTensor(_PolicyOnTensor, TrivialAugmentOnDevice):
    probes = _tensor_probes(TrivialAugmentOnDevice.probes)


class RandAugmentOnTensor(_PolicyOnTensor, RandAugmentOnDevice):
    probes = _tensor_probes(RandAugmentOnDevice.probes)


class AutoAugmentOnTensor(_PolicyOnTensor, AutoAugmentOnDevice):
    probes = _tensor_probes(AutoAugmentOnDevice.probes)


class AugMixOnTensor(_OnTensor, AugMixOnDevice):
    """torchvision's ``AugMix`` on a uint8 tensor: its draws and mix as on
    a PIL image (which it makes a tensor of first)."""


class AugMixDrawnOnPlanes(AugMixOnTensor):
    """The CPU path's ``AugMix`` of an RGB image's planes, drawn apart: on a
    PIL image ``AugMix`` mixes the tensor it makes of it
    (:class:`AugMixOnPlanes`), so this is :class:`AugMixOnTensor`'s
    computation on the planes (the user's draws in its order, then
    ``coordl.decode.augmix``'s mix: torchvision's arithmetic, its tables and
    kept grids), checked once per process against the user's call on tensors
    over fewer seeds than the device path's draws (every operation is drawn
    over the probes; the tables and grids are checked apart, for every
    magnitude)."""

    how = ("its draws made apart from its call, its operations and mix computed on the decoded planes with "
           "torchvision's arithmetic (coordl's tables and kept sampling grids where they give its values)")
    seeds = (tuple(range(8)), ())


_ON_TENSOR = {"TrivialAugmentWide": TrivialAugmentOnTensor, "RandAugment": RandAugmentOnTensor,
              "AutoAugment": AutoAugmentOnTensor, "AugMix": AugMixOnTensor}


def tensor_step_of(t: Any) -> "OnPlanes | None":
    """``t``'s counterpart that ``decode="device"`` draws in the worker and
    runs on the device where ``t`` gets the fused path's uint8 tensor:
    torchvision's ``TrivialAugmentWide``, ``RandAugment``, ``AutoAugment``
    or ``AugMix`` (v1 or v2) interpolating with nearest or bilinear, without
    a fill, else None."""
    if isinstance(t, _OnTensor):
        return t
    kind = _kind(t)
    cls = _ON_TENSOR.get(kind[1]) if kind is not None and kind[0] in ("v1", "v2") else None
    if cls is None:
        return None
    try:
        return cls(t, kind[0] == "v2")
    except (TypeError, ValueError, AttributeError):
        return None


def _recognizes(kind: type, *names: str):
    """Makes ``check(t, v2)`` a recognizer ``of(t)``: ``t`` itself where it
    already is a ``kind``; where ``t`` is torchvision's (v1 or v2) step
    named one of ``names`` and ``check`` takes it, ``kind(t, v2)`` (or the
    object ``check`` returned); else None (an attribute missing or of
    another type included: the step runs as written)."""
    def wrap(check):
        @functools.wraps(check)
        def of(t: Any):
            if isinstance(t, kind):
                return t
            k = _kind(t)
            if k is None or k[0] not in ("v1", "v2") or k[1] not in names:
                return None
            v2 = k[0] == "v2"
            try:
                got = check(t, v2)
                return kind(t, v2) if got is True else got or None
            except (TypeError, ValueError, AttributeError):
                return None
        return of
    return wrap


@_recognizes(BlurOnDevice, "GaussianBlur")
def blur_of(t: Any, v2: bool) -> bool:
    """A :class:`BlurOnDevice` over ``t`` when it is torchvision's
    ``GaussianBlur`` (v1 or v2) with odd kernel sizes and a sigma range,
    else None."""
    kx, ky = (int(k) for k in t.kernel_size)
    lo, hi = (float(s) for s in t.sigma)
    return kx % 2 == 1 and ky % 2 == 1 and kx >= 1 and ky >= 1 and 0 < lo <= hi


_GEOMETRIC = {"RandomRotation": RotationOnDevice, "RandomAffine": AffineOnDevice,
              "RandomPerspective": PerspectiveOnDevice}


@_recognizes(PhotometricOnDevice, "RandomPhotometricDistort", "RandomChannelPermutation")
def photometric_of(t: Any, v2: bool) -> bool:
    """A :class:`PhotometricOnDevice` over ``t`` when it is torchvision v2's
    ``RandomPhotometricDistort`` or ``RandomChannelPermutation``, else
    None."""
    return v2


@_recognizes(GrayscaleOnDevice, "Grayscale")
def gray_of(t: Any, v2: bool) -> bool:
    """A :class:`GrayscaleOnDevice` over ``t`` when it is torchvision's
    ``Grayscale`` with three output channels (v1 or v2), else None."""
    return int(t.num_output_channels) == 3


@_recognizes(GeometricOnDevice, *_GEOMETRIC)
def geometric_of(t: Any, v2: bool) -> "GeometricOnDevice | None":
    """A :class:`RotationOnDevice`, :class:`AffineOnDevice` or
    :class:`PerspectiveOnDevice` over ``t`` when it is torchvision's
    ``RandomRotation`` (without ``expand``), ``RandomAffine`` or
    ``RandomPerspective`` (v1 or v2) interpolating with nearest, bilinear or
    bicubic and filling with a value or one per channel (not by type: a v2
    fill dict), else None."""
    mode = getattr(t.interpolation, "value", t.interpolation)
    if mode not in ("nearest", "bilinear", "bicubic") + _FILTERS or getattr(t, "expand", False) \
            or isinstance(t.fill, dict):
        return None
    return _GEOMETRIC[type(t).__name__](t, v2)


@_recognizes(AugMixOnDevice, "AugMix")
def augmix_of(t: Any, v2: bool) -> bool:
    """An :class:`AugMixOnDevice` over ``t`` when it is torchvision's
    ``AugMix`` (v1 or v2, or the CPU path's :class:`AugMixOnPlanes` over
    one) with ``fill=None``, nearest or bilinear interpolation and chains
    that fit a record, else None."""
    return not _has_fill(t, v2)


def _has_fill(t: Any, v2: bool) -> bool:
    """Whether torchvision's ``AugMix`` ``t`` fills (v2: a dict of types)."""
    return t.fill is not None or (v2 and getattr(t, "_fill", {"others": None}) != {"others": None})


@_recognizes(RandomOpOnDevice, *RandomOpOnDevice.KINDS)
def random_op_of(t: Any, v2: bool) -> bool:
    """A :class:`RandomOpOnDevice` over ``t`` when it is one of torchvision's
    one-operation random steps (v1 or v2) with a probability, else None."""
    return 0.0 <= float(t.p) <= 1.0


def policy_of(t: Any) -> "PolicyOnDevice | None":
    """A :class:`PolicyOnDevice` over ``t`` when it is torchvision's
    ``TrivialAugmentWide``, ``RandAugment`` or ``AutoAugment`` (v1 or v2)
    with nearest, bilinear or bicubic interpolation, else None."""
    if isinstance(t, PolicyOnDevice):
        return t
    if type(t).__module__ == _TIMM_AA and type(t).__name__ in ("RandAugment", "AutoAugment", "AugMixAugment"):
        try:
            return (TimmAugMixOnDevice if type(t).__name__ == "AugMixAugment" else TimmPolicyOnDevice)(t)
        except (TypeError, ValueError, AttributeError):
            return None
    kind = _kind(t)
    cls = _POLICIES.get(kind[1]) if kind is not None and kind[0] in ("v1", "v2") else None
    if cls is None:
        return None
    mode = getattr(t, "interpolation", None)
    if getattr(mode, "value", mode) not in ("nearest", "bilinear", "bicubic") + _FILTERS:
        return None
    try:
        return cls(t, kind[0] == "v2")
    except (TypeError, ValueError, AttributeError):
        return None


class ErasingOnTensor:
    """A user's ``RandomErasing`` (torchvision's v1 or v2, or timm's), its
    rectangles (and noise) drawn apart from its call (:meth:`draw_with`),
    so that ``decode="device"`` erases on the device after the conversion.
    Called, it is the user's object (the CPU path runs it as written).
    ``value``: the erased pixels' value, one per channel or one for all
    (float32, as torchvision makes the tensor it writes); ``most``: the
    most rectangles one call erases (timm's ``max_count``); ``noise``:
    None (the value), ``"pixel"`` (torchvision's ``value="random"``, timm's
    ``mode="pixel"``: a standard normal draw of torch's CPU generator per
    channel value) or ``"rand"`` (timm's ``mode="rand"``: one per channel
    and rectangle)."""

    def __init__(self, user: Any, kind: str, value: tuple, most: int = 1, noise: str | None = None):
        self.user, self.kind, self.value, self.most = user, kind, tuple(value), int(most)
        self.noise = noise

    def __call__(self, x: Any) -> Any:
        return self.user(x)

    def draw(self, c: int, h: int, w: int) -> list[tuple[int, int, int, int]]:
        """The rectangles of :meth:`draw_with` (its noise drawn too, and dropped)."""
        return self.draw_with(c, h, w)[0]

    def draw_with(self, c: int, h: int, w: int) -> tuple[list, list | None]:
        """``(rects, noise)``: the rectangles ``(top, left, height, width)``
        one call erases in a (c, h, w) image, drawn from torch's generator
        (torchvision: the user's own ``get_params``/``make_params``) or
        Python's (timm's draws), in the user's object's order, none where
        the draw said no or no rectangle fit in 10 tries; and with
        :attr:`noise`, each rectangle's values (float32 (c, h, w), or
        (c, 1, 1) for ``"rand"``), drawn where the user's object draws
        them, else None."""
        t = self.user
        if self.kind == "timm":
            return self._timm_draw(c, h, w)
        stub = torch.empty(1).expand(c, h, w)        # its shape is all the draws read
        if self.kind == "v2":
            if torch.rand(1) >= t.p:
                return [], None
            p = t.make_params([stub])
            if p["v"] is None:
                return [], None
            return [(p["i"], p["j"], p["h"], p["w"])], ([p["v"]] if self.noise else None)
        if not torch.rand(1) < t.p:
            return [], None
        i, j, eh, ew, v = type(t).get_params(stub, scale=t.scale, ratio=t.ratio,
                                             value=None if self.noise else list(self.value))
        if v is stub:
            return [], None
        return [(i, j, eh, ew)], ([v] if self.noise else None)

    def _timm_draw(self, c: int, h: int, w: int) -> tuple[list, list | None]:
        # timm.data.random_erasing.RandomErasing._erase's draws: the rectangles from Python's generator,
        # the noise (its _get_pixels) from torch's, after each rectangle
        t = self.user
        if random.random() > t.probability:
            return [], None
        count = t.min_count if t.min_count == t.max_count else random.randint(t.min_count, t.max_count)
        out, noise = [], [] if self.noise else None
        for _ in range(count):
            for _attempt in range(10):
                area = random.uniform(t.min_area, t.max_area) * (h * w) / count
                aspect = math.exp(random.uniform(*t.log_aspect_ratio))
                eh, ew = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
                if ew < w and eh < h:
                    top = random.randint(0, h - eh)
                    out.append((top, random.randint(0, w - ew), eh, ew))
                    if self.noise == "pixel":
                        noise.append(torch.empty((c, eh, ew), dtype=torch.float32).normal_())
                    elif self.noise == "rand":
                        noise.append(torch.empty((c, 1, 1), dtype=torch.float32).normal_())
                    break
        return out, noise

    def erase(self, x: torch.Tensor, rects: list, noise: list | None = None) -> torch.Tensor:
        """``x`` (C, H, W) with ``rects`` set to the value (or each to its
        ``noise``), in place."""
        v = torch.tensor(self.value, dtype=torch.float32)[:, None, None]
        for q, (top, left, eh, ew) in enumerate(rects):
            x[..., top:top + eh, left:left + ew] = noise[q] if noise is not None else v
        return x

    def draws_agree(self) -> bool:
        """Whether :meth:`draw` then :meth:`erase` give the user's class's
        own result in this process, leaving torch's and Python's generators
        as its call does (checked once per process and class on probe
        images): what ``decode="device"`` needs of it."""
        key = ("erasing", type(self.user), self.kind)
        ok = _agree.get(key)
        if ok is None:
            with _agree_lock:
                if key not in _agree:
                    _agree[key] = _erasing_agrees(type(self.user), self.kind)
            ok = _agree[key]
        return ok

    def spec(self) -> tuple:
        return ("coordl.tvcompat.ErasingOnTensor", T.spec_of(self.user))

    def __repr__(self) -> str:
        return f"{self.user!r} (erasing with {self.value}, its draws made apart from its call)"


# the probes of ErasingOnTensor.draws_agree: constructor arguments per kind (drawing, not drawing, the
# fallback after 10 tries, several rectangles)
_ERASING_PROBES = {
    "v1": ({"p": 0.6, "value": (0.5, -1.25, 2.0)}, {"p": 1.0, "scale": (0.4, 0.98), "ratio": (0.2, 5.0), "value": 3},
           {"p": 0.7, "value": "random"}),
    "v2": ({"p": 0.6, "value": (0.5, -1.25, 2.0)}, {"p": 1.0, "scale": (0.4, 0.98), "ratio": (0.2, 5.0), "value": 3},
           {"p": 0.7, "value": "random"}),
    "timm": ({"probability": 0.6, "device": "cpu"},
             {"probability": 1.0, "min_area": 0.4, "max_area": 0.98, "max_count": 3, "device": "cpu"},
             {"probability": 0.8, "mode": "pixel", "max_count": 2, "device": "cpu"},
             {"probability": 0.8, "mode": "rand", "max_count": 2, "device": "cpu"}),
}


def _erasing_agrees(cls: type, kind: str) -> bool:
    cpu = torch.default_generator
    state, py_state = cpu.get_state(), random.getstate()
    images = [torch.rand(3, 17, 23, generator=torch.Generator().manual_seed(3)) - 0.5,
              torch.rand(3, 2, 1, generator=torch.Generator().manual_seed(4))]
    try:
        for kw in _ERASING_PROBES[kind]:
            mine = erasing_of(cls(**kw))
            if mine is None:
                raise TypeError("its probe was not recognized")
            for img in images:
                for seed in range(8):
                    cpu.manual_seed(seed)
                    random.seed(seed)
                    want = mine.user(img.clone())
                    after = cpu.get_state(), random.getstate()
                    cpu.manual_seed(seed)
                    random.seed(seed)
                    got = mine.erase(img.clone(), *mine.draw_with(*img.shape))
                    if not (torch.equal(got, want) and torch.equal(cpu.get_state(), after[0])
                            and random.getstate() == after[1]):
                        log.warning("coordl's draws of %s.%s differ from its own here: decode='device' does not "
                                    "run it", cls.__module__, cls.__name__)
                        return False
        return True
    except Exception as e:  # noqa: BLE001 (another version's API)
        log.warning("coordl cannot make the draws of %s.%s apart from its call here (%s: %s): decode='device' "
                    "does not run it", cls.__module__, cls.__name__, type(e).__name__, e)
        return False
    finally:
        cpu.set_state(state)
        random.setstate(py_state)


def erasing_of(t: Any) -> "ErasingOnTensor | None":
    """An :class:`ErasingOnTensor` over ``t`` when it is torchvision's
    ``RandomErasing`` (v1 or v2) with a number, a sequence of numbers or
    ``"random"`` as its value, or timm's (``timm.data.random_erasing``,
    drawing its noise on the CPU); else None (it runs as written)."""
    if isinstance(t, ErasingOnTensor):
        return t
    if type(t).__module__ == "timm.data.random_erasing" and type(t).__name__ == "RandomErasing":
        try:
            if not (1 <= int(t.min_count) <= int(t.max_count)):
                return None
            noise = "pixel" if t.per_pixel else "rand" if t.rand_color else None
            if noise is not None and torch.device(t.device).type != "cpu":
                return None     # its noise drawn on another device's generator: as written
            return ErasingOnTensor(t, "timm", (0.0,), int(t.max_count), noise)
        except (TypeError, ValueError, AttributeError, RuntimeError):
            return None
    kind = _kind(t)
    if kind is None or kind[0] not in ("v1", "v2") or kind[1] != "RandomErasing":
        return None
    value = getattr(t, "value", None)
    if (kind[0] == "v1" and value == "random") or (kind[0] == "v2" and value is None):
        return ErasingOnTensor(t, kind[0], (0.0,), 1, "pixel")
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(v, numbers.Number) and not isinstance(v, bool) for v in value):
        return None
    return ErasingOnTensor(t, kind[0], tuple(float(v) for v in value))


_agree_lock = _forks.worker_safe(threading.Lock())
_agree: dict = {}


def _agrees(kind: type, cls: type, v2: bool, draws: bool = False) -> bool:
    """Whether ``kind`` (an :class:`OnPlanes` class) over the user's class
    ``cls`` gives what ``cls`` gives on PIL images, with the same draws left
    behind on torch's generator: checked once per process on probe images
    (mode RGB and L) for each of ``kind.probes``, the process's generator
    state restored after.  ``draws``: :meth:`ColorJitterOnPlanes.draw`'s
    operations computed by PIL itself in place of the planes (its draws
    alone, whether or not coordl's kernel is PIL's here)."""
    key = (kind, cls, draws)
    ok = _agree.get(key)
    if ok is not None:
        return ok
    with _agree_lock:
        if key not in _agree:
            _agree[key] = _check_agreement(kind, cls, v2, draws)
    return _agree[key]


def _seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _all_states() -> tuple:
    """torch's CPU generator's, Python's and numpy's global states, comparable."""
    kind, keys, pos, gauss, cached = np.random.get_state()
    return torch.default_generator.get_state(), random.getstate(), (kind, keys.tobytes(), pos, gauss, cached)


def _check_agreement(kind: type, cls: type, v2: bool, draws: bool = False) -> bool:
    cpu = torch.default_generator
    state, py_state, np_state = cpu.get_state(), random.getstate(), np.random.get_state()
    rnd = random.Random(5)
    rgb = np.frombuffer(rnd.randbytes(3 * 17 * 23), np.uint8).reshape(17, 23, 3)
    images = [Image.fromarray(rgb), Image.fromarray(np.ascontiguousarray(rgb[:9, :7, 1]))]
    on_tensor = getattr(kind, "on_tensor", False)
    try:
        for kw in kind.probes:
            t, mine = kind.probe(cls, v2, kw)
            for img, seeds in zip(images, kind.seeds):
                for seed in seeds:
                    _seed_all(seed)
                    try:
                        if on_tensor:      # the user's step given the tensor of the image, its result as an image's
                            want = t(T._to_chw(img)).permute(1, 2, 0).numpy()
                            want = want[..., 0] if img.mode == "L" else want
                        else:
                            want = np.asarray(t(img))
                    except Exception as e:  # noqa: BLE001 - the user's call fails here: so must coordl's
                        want = e
                    after = _all_states()
                    _seed_all(seed)
                    try:
                        if draws:
                            from .decode import color

                            got = T._to_chw(color.pil_jitter(img, mine.draw((img.height, img.width)))).numpy()
                        else:
                            got = mine.on_planes(T._to_chw(img)).numpy()
                    except Exception as e:  # noqa: BLE001
                        if isinstance(want, Exception) and type(e) is type(want) and str(e) == str(want):
                            continue            # the same error as the user's call (timm's posterize at 0 bits)
                        raise
                    if isinstance(want, Exception):
                        raise want
                    got = got[0] if img.mode == "L" else got.transpose(1, 2, 0)
                    now = _all_states()
                    if not (np.array_equal(got, want) and torch.equal(now[0], after[0]) and now[1:] == after[1:]):
                        log.warning("coordl's %s differs from %s.%s here: it runs as written", kind.__name__,
                                    cls.__module__, cls.__name__)
                        return False
        return True
    except Exception as e:  # noqa: BLE001 (another torchvision's API): run it as written
        log.warning("coordl's %s cannot run %s.%s here (%s: %s): it runs as written", kind.__name__,
                    cls.__module__, cls.__name__, type(e).__name__, e)
        return False
    finally:
        cpu.set_state(state)
        random.setstate(py_state)
        np.random.set_state(np_state)


# --------------------------------------------------------------- transforms
def _kind(t: Any) -> tuple[str, str] | None:
    """("v1"|"v2"|"timm", class name) for torchvision's own transform
    classes and timm's (``timm.data.transforms``; recognized by the module
    name of the class, so timm is never imported here)."""
    mod = type(t).__module__
    if mod.startswith("torchvision.transforms.v2"):
        return "v2", type(t).__name__
    if mod.startswith("torchvision.transforms."):
        return "v1", type(t).__name__
    if mod == "timm.data.transforms":
        return "timm", type(t).__name__
    return None


def holder_attribute(obj: Any) -> str | None:
    """The name of the attribute ``obj`` only hands its argument to, or None.

    That is the case when ``type(obj).__call__`` is a plain function of
    ``(self, x)`` whose whole body is ``return self.<name>(x)`` (read from its
    bytecode: load self, load the attribute, load x, call with one argument,
    return; nothing else), the class looks attributes up the ordinary way,
    and ``<name>`` is an attribute of the instance itself (not a property or
    other descriptor of the class).  torchvision's reference presets
    (``ClassificationPresetTrain``/``Eval``: ``return self.transforms(img)``)
    are such objects."""
    cls = type(obj)
    fn = getattr(cls, "__call__", None)
    if not plain_function(fn, 2) or cls.__getattribute__ is not object.__getattribute__:
        return None
    me, arg = fn.__code__.co_varnames[:2]
    ops = instructions(fn)
    if len(ops) != 5 or ops[0] != ("LOAD_FAST", me) or ops[2] != ("LOAD_FAST", arg):
        return None
    if ops[1][0] not in ("LOAD_ATTR", "LOAD_METHOD"):
        return None
    if ops[3] != ("CALL", 1) or ops[4][0] != "RETURN_VALUE":
        return None
    attr = ops[1][1]
    if not isinstance(attr, str) or attr not in getattr(obj, "__dict__", {}):
        return None
    desc = type(getattr(cls, attr, None))
    if hasattr(desc, "__set__") or hasattr(desc, "__delete__"):   # a data descriptor wins over the instance
        return None
    return attr


# What the forward of torchvision's classification preset (``weights.transforms()``,
# ``torchvision.transforms._presets.ImageClassification``) reads: resize, center crop, PIL to tensor
# when it is given a PIL image, convert to float, normalize.  Another forward stays as written.
_PRESET_NAMES = frozenset({"F", "resize", "resize_size", "interpolation", "antialias", "center_crop", "crop_size",
                           "isinstance", "Tensor", "pil_to_tensor", "convert_image_dtype", "torch", "float",
                           "normalize", "mean", "std"})


class PresetToTensor:
    """The preset's own conversion step: ``pil_to_tensor`` of a PIL image, a
    tensor as it is (what ``ImageClassification.forward`` does)."""

    def __call__(self, img: Any) -> Any:
        if isinstance(img, torch.Tensor):
            return img
        return sys.modules["torchvision.transforms.functional"].pil_to_tensor(img)

    def __repr__(self) -> str:
        return "PresetToTensor()"


def _preset_steps(t: Any) -> list | None:
    """torchvision's ``ImageClassification`` preset as the v1 steps its
    forward runs (``Resize``, ``CenterCrop``, :class:`PresetToTensor`,
    ``ConvertImageDtype(float)``, ``Normalize``), each called with the
    arguments the forward passes, so the same function calls in the same
    order; None for anything else, a subclass, a forward of other names, or
    a module with forward hooks (those run as written)."""
    cls = type(t)
    if cls.__module__ != "torchvision.transforms._presets" or cls.__name__ != "ImageClassification":
        return None
    v1 = sys.modules.get("torchvision.transforms")
    fwd = getattr(getattr(cls, "forward", None), "__code__", None)
    if v1 is None or fwd is None or set(fwd.co_names) != _PRESET_NAMES:
        return None
    hooks = sys.modules.get("torch.nn.modules.module")
    if any(getattr(t, h, None) for h in ("_forward_hooks", "_forward_pre_hooks")) or any(
            getattr(hooks, h, None) for h in ("_global_forward_hooks", "_global_forward_pre_hooks")):
        return None
    try:
        return [v1.Resize(list(t.resize_size), interpolation=t.interpolation, antialias=t.antialias),
                v1.CenterCrop(list(t.crop_size)), PresetToTensor(), v1.ConvertImageDtype(torch.float),
                v1.Normalize(list(t.mean), list(t.std))]
    except (TypeError, ValueError, AttributeError):
        return None


def converts_to_rgb(fn: Any) -> bool:
    """Whether ``fn`` is a plain function (a ``def`` or a ``lambda``, also
    inside torchvision's ``Lambda``) of one argument whose whole body is
    ``return x.convert("RGB")`` (read from its bytecode: load the argument,
    load its ``convert``, load the constant ``"RGB"``, call with that one
    argument, return; nothing else).  OpenAI's CLIP and open_clip put such a
    function between their crop and ``ToTensor``; on an RGB PIL image PIL's
    ``convert("RGB")`` is a copy, the same pixels."""
    k = _kind(fn)
    if k is not None and k[1] == "Lambda" and k[0] in ("v1", "v2"):
        fn = getattr(fn, "lambd", None)
    if not plain_function(fn, 1):
        return False
    ops = instructions(fn)
    return (len(ops) == 5 and ops[0] == ("LOAD_FAST", fn.__code__.co_varnames[0])
            and ops[1] in (("LOAD_ATTR", "convert"), ("LOAD_METHOD", "convert"))
            and ops[2] == ("LOAD_CONST", "RGB") and ops[3] == ("CALL", 1) and ops[4][0] == "RETURN_VALUE")


def _flatten(transform: Any, through: list | None = None, depth: int = 0) -> list:
    """The steps of ``transform``: a torchvision ``Compose`` is opened, the
    classification preset of torchvision's weights (:func:`_preset_steps`)
    is read as its steps, and an object that only hands its argument to a
    transform it holds (:func:`holder_attribute`) is read through to it (its
    class name then goes to ``through``)."""
    k = _kind(transform)
    if k is not None and k[0] != "timm" and k[1] == "Compose":
        out: list = []
        for t in transform.transforms:
            out.extend(_flatten(t, through, depth + 1))
        return out
    if k is not None and k[1] == "ImageClassification":
        steps = _preset_steps(transform)
        if steps is not None:
            if through is not None:
                through.append(f"{_name(transform)} as {', '.join(_name(s) for s in steps)}")
            return steps
    if k is None and depth < 8 and not isinstance(transform, T.Transform):
        attr = holder_attribute(transform)
        if attr is not None:
            if through is not None:
                through.append(f"{_name(transform)}.{attr}")
            return _flatten(getattr(transform, attr), through, depth + 1)
    return [transform]


def _interp(value: Any, on_pil: bool) -> T.InterpolationMode | None:
    """coordl's interpolation for torchvision's ``value``, or None when coordl's
    fused decode does not compute what torchvision computes with it."""
    name = getattr(value, "value", value)
    if isinstance(name, int) and not isinstance(name, bool):
        try:
            name = T._check_interp(name).value
        except ValueError:
            return None
    if name == "bilinear":
        return T.InterpolationMode.BILINEAR
    # PIL's nearest picks other source pixels than torch's "nearest" and "nearest-exact" do
    # (measured: several levels per pixel on average), so it is run as written
    if name == "nearest" and not on_pil:
        return T.InterpolationMode.NEAREST
    if name == "nearest-exact" and not on_pil:
        return T.InterpolationMode.NEAREST_EXACT
    # bicubic: PIL's on a PIL image (computed exactly); on a uint8 tensor v2 runs torch's uint8
    # kernel, which the fused path runs too, and v1 resizes in float32 without clipping between
    # the passes (up to ~26 levels from the uint8 kernel), which the fused path then does too
    # (the step's _in_float, set by the caller)
    if name == "bicubic":
        return T.InterpolationMode.BICUBIC
    return None


def _size(size: Any) -> Any:
    if isinstance(size, (list, tuple)):
        return size[0] if len(size) == 1 else tuple(size)
    return size


def _ordered(pair: Any) -> bool:
    try:
        return len(pair) == 2 and float(pair[0]) <= float(pair[1])
    except (TypeError, ValueError):
        return False


@dataclass
class _State:
    stage: str = "pil"                  # "pil", "u8" (uint8 tensor) or "float"
    geo: list = None                    # coordl geometric ops, in draw order
    to_tensor: Any = None               # coordl PILToTensor or ToTensor
    post: list = None                   # coordl ToDtype/Normalize
    image_type: type | None = None      # tv_tensors.Image after v2.ToImage
    rgb: bool = True                    # the images are RGB (not gray: torchvision's MNIST family)

    def __post_init__(self):
        self.geo, self.post = [], []


def _step(t: Any, st: _State) -> bool:
    """Translate one torchvision or timm transform into ``st``; False if it cannot be."""
    if type(t) is PresetToTensor:
        if st.stage == "pil":
            st.to_tensor, st.stage = T.PILToTensor(), "u8"
        return st.stage == "u8"           # a uint8 tensor goes on as it is
    if st.stage == "pil" and st.rgb and converts_to_rgb(t):
        return True                       # the fused decode's image is RGB: the same pixels
    kind = _kind(t)
    if kind is None:
        return False
    if kind[0] == "timm":
        return _timm_step(t, kind[1], st)
    _, name = kind
    on_pil = st.stage == "pil"
    geometric_ok = st.stage in ("pil", "u8")
    try:
        if name == "RGB" and kind[0] == "v2" and st.rgb:
            return True         # an RGB image (the fused path's, always) is returned as it is
        if name == "ToPureTensor" and kind[0] == "v2":
            # a plain tensor (or the PIL image, unchanged) from here: drop the tv_tensors wrapper
            st.image_type = None
            return True
        if name in ("RandomResizedCrop", "Resize") and geometric_ok:
            aa = True if on_pil else bool(getattr(t, "antialias", True))
            mode = _interp(t.interpolation, on_pil)
            if mode is None:
                return False
            if name == "RandomResizedCrop":
                if not (_ordered(t.scale) and _ordered(t.ratio)):
                    return False
                step = T.RandomResizedCrop(_size(t.size), tuple(t.scale), tuple(t.ratio), mode, aa)
            else:
                step = T.Resize(_size(t.size), mode, getattr(t, "max_size", None), aa)
            # on a uint8 tensor torchvision resizes with torch's kernel: so does the fused path; v1's
            # bicubic in float32, rounded once
            step._on_tensor = not on_pil
            step._in_float = not on_pil and kind[0] == "v1" and mode is T.InterpolationMode.BICUBIC
            st.geo.append(step)
            return True
        if name == "CenterCrop" and geometric_ok:
            st.geo.append(T.CenterCrop(_size(t.size)))
            return True
        if name == "RandomCrop" and geometric_ok:
            if t.padding is not None or t.pad_if_needed:
                pad = _crop_padding(t, kind[0] == "v2") if on_pil else None
                if pad is None:
                    return False
                st.geo.append(T.RandomCrop(_size(t.size), **pad))
                return True
            st.geo.append(T.RandomCrop(_size(t.size)))
            return True
        if name == "Pad" and on_pil:            # as torchvision pads a PIL image (a v2 fill by type: as written)
            if isinstance(t.fill, dict) or t.fill is None:
                return False
            st.geo.append(T.Pad(t.padding, t.fill, getattr(t.padding_mode, "value", t.padding_mode)))
            return True
        if name == "RandomHorizontalFlip":
            # a flip commutes with the conversions and Normalize that may precede it
            st.geo.append(T.RandomHorizontalFlip(float(t.p)))
            return True
        if name == "RandomVerticalFlip":     # as the horizontal one
            st.geo.append(T.RandomVerticalFlip(float(t.p)))
            return True
        if name == "ToTensor" and on_pil:
            st.to_tensor, st.stage = T.ToTensor(), "float"
            return True
        if name == "PILToTensor" and on_pil:
            st.to_tensor, st.stage = T.PILToTensor(), "u8"
            return True
        if name == "ToImage" and kind[0] == "v2":
            if on_pil:
                st.to_tensor, st.stage = T.PILToTensor(), "u8"
            tvt = sys.modules.get("torchvision.tv_tensors")
            st.image_type = getattr(tvt, "Image", None)
            return True
        if name in ("ToDtype", "ConvertImageDtype") and st.stage in ("u8", "float"):
            dtype = t.dtype
            scale = True if name == "ConvertImageDtype" else bool(t.scale)
            if not isinstance(dtype, torch.dtype):
                return False
            if st.stage == "u8" and dtype == torch.uint8:
                return True
            if not dtype.is_floating_point:
                return False
            # v2's ToDtype (and its ConvertImageDtype) multiply by 1/255 where ToTensor and v1's divide
            recip = kind[0] == "v2"
            if (st.stage == "u8" and scale and not st.post and type(st.to_tensor) is T.PILToTensor
                    and dtype == torch.get_default_dtype()):
                st.to_tensor = T.ToTensor(reciprocal=recip)  # the same arithmetic (and what the device split knows)
            else:
                st.post.append(T.ToDtype(dtype, scale, reciprocal=recip))
            st.stage = "float"
            return True
        if name == "Normalize" and st.stage == "float":
            st.post.append(T.Normalize([float(m) for m in t.mean], [float(v) for v in t.std], bool(t.inplace),
                                       broadcast=kind[0] == "v2"))
            return True
    except (TypeError, ValueError, AttributeError):
        return False  # attributes coordl does not read the same way: run it as written
    return False


def _crop_padding(t: Any, v2: bool) -> dict | None:
    """coordl's ``RandomCrop`` arguments for the padding of torchvision's
    ``t`` on a PIL image, or None where coordl's would pad otherwise: a
    fill by type (v2's dict), or v2 padding both by ``padding`` and where
    needed with a reflection (v2 pads once by the sum; coordl, as v1, pads
    twice, which reflects other pixels)."""
    mode, fill = t.padding_mode, t.fill
    mode = getattr(mode, "value", mode)
    if isinstance(fill, dict) or fill is None:
        return None
    padding = t.padding
    if v2 and padding is not None:          # v2 keeps [left, right, top, bottom]
        left, right, top, bottom = (int(v) for v in padding)
        padding = (left, top, right, bottom)
        if t.pad_if_needed and mode in ("reflect", "symmetric"):
            return None
    return {"padding": padding, "pad_if_needed": bool(t.pad_if_needed), "fill": fill, "padding_mode": mode}


def _timm_step(t: Any, name: str, st: _State) -> bool:
    """timm's transforms (``timm.data.transforms``) where coordl's compute
    the same thing: ``RandomResizedCropAndInterpolation`` (torchvision's
    draw distributions, written with Python's ``random``: uniform area
    fraction, log-uniform aspect ratio, 10 tries, uniform offsets, the same
    central fallback; with ``interpolation="random"`` one of its modes drawn
    uniformly after the box, as timm draws it), ``CenterCropOrPad`` with zero
    constant padding (torchvision's ``CenterCrop``), and the conversions
    ``MaybeToTensor``, ``MaybePILToTensor`` and ``ToTensor``.  The others
    (``ResizeKeepRatio``, whose output size rounds where ``Resize``
    truncates; ``ToNumpy``; random padding and crops) run as written."""
    on_pil = st.stage == "pil"
    geometric_ok = st.stage in ("pil", "u8")
    try:
        if name == "RandomResizedCropAndInterpolation" and geometric_ok:
            if isinstance(t.interpolation, (tuple, list)):   # interpolation="random": drawn per call
                if not t.interpolation:
                    return False
                modes = [_interp(m, on_pil) for m in t.interpolation]
                mode = None if None in modes else tuple(modes)
            else:
                mode = _interp(t.interpolation, on_pil)
            if mode is None or not (_ordered(t.scale) and _ordered(t.ratio)):
                return False
            step = T.RandomResizedCrop(_size(t.size), tuple(t.scale), tuple(t.ratio), mode, True)
            # on a tensor timm calls torchvision's v1 resized_crop: torch's kernel in float32, rounded once
            step._on_tensor = step._in_float = not on_pil
            st.geo.append(step)
            return True
        if name == "CenterCropOrPad" and geometric_ok:
            if t.fill != 0 or t.padding_mode != "constant":
                return False
            st.geo.append(T.CenterCrop(_size(t.size)))
            return True
        if name in ("MaybeToTensor", "MaybePILToTensor"):
            if on_pil:   # a tensor goes through unchanged
                st.to_tensor, st.stage = (T.ToTensor(), "float") if name == "MaybeToTensor" else \
                    (T.PILToTensor(), "u8")
            return True
        if name == "ToTensor" and on_pil:   # timm's: pil_to_tensor, then .to(dtype), unscaled
            dtype = t.dtype
            if not isinstance(dtype, torch.dtype):
                return False
            st.to_tensor, st.stage = T.PILToTensor(), "u8"
            if dtype != torch.uint8:
                if not dtype.is_floating_point:
                    return False
                st.post.append(T.ToDtype(dtype, False))
                st.stage = "float"
            return True
    except (TypeError, ValueError, AttributeError):
        return False
    return False


# Transforms that draw no random numbers: after the last one that does, the rest of an as-written
# part runs without a generator of its own (TorchvisionPipeline.post).
_DETERMINISTIC = {
    "v1": frozenset({"PILToTensor", "ToTensor", "ConvertImageDtype", "Normalize", "ToPILImage", "Grayscale",
                     "CenterCrop", "Resize", "Pad"}),
    "v2": frozenset({"PILToTensor", "ToTensor", "ToImage", "ToPureTensor", "ToDtype", "ConvertImageDtype",
                     "Normalize", "ToPILImage", "Grayscale", "CenterCrop", "Resize", "Pad"}),
    "timm": frozenset({"MaybeToTensor", "MaybePILToTensor", "ToTensor", "ToNumpy", "CenterCropOrPad"}),
}


def _deterministic(t: Any) -> bool:
    k = _kind(t)
    if k is not None and k[1] == "Grayscale" and getattr(t, "num_output_channels", 1) == 3:
        return False       # kept with the steps before it: decode="device" runs it there (GrayscaleOnDevice)
    return k is not None and k[1] in _DETERMINISTIC.get(k[0], ())


def _drawing_end(steps: list) -> int:
    """The length of ``steps`` up to and with the last one that draws."""
    n = len(steps)
    while n > 0 and _deterministic(steps[n - 1]):
        n -= 1
    return n


def _split_post(tail: list) -> tuple[list, list, Any, Any, Any, list]:
    """``(tail, post, post_fused, post_type, erase, after)``: the trailing
    steps of ``tail`` that draw no random numbers move to ``post``; when
    ``post`` is a tensor conversion then ``ToDtype``/``Normalize`` (and
    wrappers), ``post_fused`` is coordl's version of it, for a PIL image.
    When the last step that draws is a ``RandomErasing`` with a constant
    value (:func:`erasing_of`), it is ``erase``, the steps after it
    ``after``, and the split is of the steps before it."""
    n = _drawing_end(tail)
    erase, after = (erasing_of(tail[n - 1]) if n else None), []
    if erase is not None:
        tail, after = tail[:n - 1], tail[n:]
        n = _drawing_end(tail)
    rest, post = tail[:n], tail[n:]
    post_fused = post_type = None
    if post:
        st = _State()
        if all(_step(t, st) for t in post) and not st.geo and st.to_tensor is not None:
            post_fused, post_type = T.Compose([st.to_tensor] + st.post), st.image_type
    return rest, post, post_fused, post_type, erase, after


@_recognizes(ColorJitterOnPlanes, "ColorJitter")
def color_jitter_of(t: Any, v2: bool) -> bool:
    """A :class:`ColorJitterOnPlanes` over ``t`` when it is torchvision's
    ``ColorJitter`` (v1 or v2) with ranges as its constructor makes them
    (whether or not its planes agree with PIL here: :meth:`~OnPlanes.exact`
    says that), else None."""
    for name in ("brightness", "contrast", "saturation", "hue"):
        r = getattr(t, name)
        if r is None:
            continue
        lo, hi = (float(v) for v in r)
        bounds = (-0.5, 0.5) if name == "hue" else (0.0, math.inf)
        if not (bounds[0] <= lo <= hi <= bounds[1] and math.isfinite(hi)):
            return False
    return True


class ChoiceOnDevice(_DrawnApart):
    """torchvision's ``RandomChoice`` and ``RandomOrder`` (v1 or v2) around
    steps :func:`device_step_of` takes: the container's own draw (v1:
    Python's generator, ``random.choices`` of one step with its weights or
    ``random.shuffle`` of the order; v2: torch's, ``multinomial`` or
    ``randperm``), then the chosen step's draws, or every step's in the
    drawn order."""

    seeds = (tuple(range(16)), ())

    def __init__(self, user: Any, v2: bool, *inners: "OnPlanes"):
        super().__init__(user, v2)
        self.inners = inners
        self.order = type(user).__name__ == "RandomOrder"
        self.how = ("in a drawn order: " if self.order else "one drawn of: ") + ", ".join(
            f"the {type(i.user).__name__} {i.how}" for i in inners)
        pick = sum if self.order else max
        self.most = pick(getattr(i, "most", 4) for i in inners)
        self.affines = pick(getattr(i, "affines", 0) for i in inners)
        self.draws_numpy = any(getattr(i, "draws_numpy", False) for i in inners)
        self.draws_python = not v2 or any(getattr(i, "draws_python", False) for i in inners)

    @classmethod
    def probe(cls, user_cls: type, v2: bool, kw: dict) -> tuple:
        """The user's container class around its version's ``ColorJitter``,
        ``RandomGrayscale`` and ``RandomInvert``, and this class over it."""
        M = sys.modules["torchvision.transforms.v2" if v2 else "torchvision.transforms"]
        steps = [M.ColorJitter(0.4, 0.4, 0.4, 0.1), M.RandomGrayscale(0.5), M.RandomInvert(0.5)]
        t = user_cls(steps, p=kw["p"]) if user_cls.__name__ == "RandomChoice" else user_cls(steps)
        return t, cls(t, v2, *(device_step_of(s) for s in steps))

    probes = ({"p": None}, {"p": [0.2, 0.3, 0.5]})

    def draw(self, size: tuple | None = None) -> list:
        n, t = len(self.inners), self.user
        if self.order:
            if self.v2:
                order = [int(i) for i in torch.randperm(n)]
            else:
                order = list(range(n))
                random.shuffle(order)
            return [op for i in order for op in self.inners[i].draw(size)]
        if self.v2:
            i = int(torch.multinomial(torch.tensor(t.p), 1))
        else:
            i = random.choices(range(n), weights=t.p)[0]
        return self.inners[i].draw(size)


@_recognizes(ChoiceOnDevice, "RandomChoice", "RandomOrder")
def choice_of(t: Any, v2: bool) -> "ChoiceOnDevice | None":
    """A :class:`ChoiceOnDevice` over ``t`` when it is torchvision's
    ``RandomChoice`` or ``RandomOrder`` (v1 or v2) around steps
    :func:`device_step_of` takes, else None."""
    steps = [device_step_of(s) for s in t.transforms]
    if not steps or any(s is None for s in steps):
        return None
    return ChoiceOnDevice(t, v2, *steps)


@_recognizes(RandomApplyOnPlanes, "RandomApply")
def random_apply_of(t: Any, v2: bool) -> "RandomApplyOnPlanes | None":
    """A :class:`RandomApplyOnPlanes` over ``t`` when it is torchvision's
    ``RandomApply`` (v1 or v2) around steps :func:`device_step_of` takes
    (one ``ColorJitter`` that :func:`color_jitter_of` takes is also run on
    the CPU path's planes), else None."""
    steps = [device_step_of(s) for s in t.transforms]
    if not steps or any(s is None for s in steps) or not 0.0 <= float(t.p) <= 1.0:
        return None
    return RandomApplyOnPlanes(t, v2, *steps)


def device_step_of(t: Any) -> "OnPlanes | None":
    """``t``'s counterpart that ``decode="device"`` draws in the worker and
    runs on the device (a ``ColorJitter``, a ``RandomApply`` around such
    steps, a ``RandomGrayscale``, an auto-augment policy, a one-operation
    random step, a ``GaussianBlur``, a rotation, affine or perspective map,
    an ``AugMix``, a ``RandomChoice`` or ``RandomOrder`` of such steps, a
    three-channel ``Grayscale``, v2's ``RandomPhotometricDistort`` and
    ``RandomChannelPermutation``), else None."""
    return (color_jitter_of(t) or random_apply_of(t) or grayscale_of(t) or policy_of(t) or random_op_of(t)
            or blur_of(t) or geometric_of(t) or augmix_of(t.user if isinstance(t, AugMixOnPlanes) else t)
            or choice_of(t) or gray_of(t) or photometric_of(t))


@_recognizes(GrayscaleOnPlanes, "RandomGrayscale")
def grayscale_of(t: Any, v2: bool) -> bool:
    """A :class:`GrayscaleOnPlanes` over ``t`` when it is torchvision's
    ``RandomGrayscale`` (v1 or v2) with a probability, else None."""
    return 0.0 <= float(t.p) <= 1.0


# what path_reason says of a step drawn apart (an auto-augment policy, a random rotation...) on the CPU
# path's planes
_DRAWN_ON_PLANES = ("with its own draws, each drawn operation computed with PIL's arithmetic by coordl on the "
                     "decoded planes")


def _drawn_on_planes(t: Any, mine: "_OpsOnPlanes | None") -> Any:
    """``mine`` (the device path's counterpart of ``t``, drawn apart) for the
    CPU path's planes, described so, where it gives ``t``'s result here;
    else ``t``."""
    if mine is None:
        return t
    mine.how = _DRAWN_ON_PLANES
    return mine if mine.exact() else t


# what path_reason says of a policy or AugMix given the fused path's uint8 tensor on the CPU path
_DRAWN_ON_TENSOR = ("given the uint8 tensor: its own draws, its operations and mix computed with torchvision's "
                    "arithmetic (coordl's tables and kept sampling grids where they give its values)")


def _drawn_on_tensor(t: Any) -> Any:
    """``t``, or its :class:`AugMixOnTensor` where ``t`` is torchvision's
    ``AugMix`` given the fused path's plain uint8 tensor and the counterpart
    gives its result here (checked now, once per process).  The
    auto-augment policies given a tensor run as written: one or two
    operations a call, they save 0.1-0.7 ms an image drawn apart, which
    their first-use checks (about 0.25 s) outweigh in runs of thousands of
    images; AugMix saves 1.3-2.5 ms."""
    mine = tensor_step_of(t) if not isinstance(t, OnPlanes) else None
    if not isinstance(mine, AugMixOnTensor):
        return t
    mine.how = _DRAWN_ON_TENSOR
    return mine if mine.exact() else t


def _on_planes(t: Any) -> Any:
    """``t``, or an :class:`OnPlanes` over it when it is torchvision's
    ``ColorJitter`` with ranges as its constructor makes them, its
    ``AugMix`` with ``fill=None``, one of its auto-augment policies (or
    timm's ``RandAugment``/``AutoAugment``: a :class:`PolicyOnDevice`,
    whose :meth:`~PolicyOnDevice.on_planes` is the CPU path's), and the
    planes give its result here
    (checked now, once per process, so that workers forked later inherit the
    answer)."""
    if type(t).__module__ == _TIMM_AA and type(t).__name__ in ("RandAugment", "AutoAugment", "AugMixAugment"):
        return _drawn_on_planes(t, policy_of(t))
    kind = _kind(t)
    if kind is None or kind[0] not in ("v1", "v2"):
        return t
    v2 = kind[0] == "v2"
    try:
        if kind[1] in ("ColorJitter", "RandomApply", "RandomGrayscale"):
            mine = color_jitter_of(t) or random_apply_of(t) or grayscale_of(t)
            if mine is None:
                return t
        elif kind[1] in _POLICIES or kind[1] in RandomOpOnDevice.KINDS or kind[1] in _GEOMETRIC:
            return _drawn_on_planes(t, policy_of(t) or random_op_of(t) or geometric_of(t))
        elif kind[1] == "AugMix":
            # a fill is applied by type (v2: a dict of types), and v1 makes floats of it for a tensor only
            if _has_fill(t, v2):
                return t
            mine = AugMixOnPlanes(t, v2)
        else:
            return t
    except (TypeError, ValueError, AttributeError):
        return t
    return mine if mine.exact() else t


class MultiViews:
    """A user's transform that makes several views of each image (MoCo's
    ``TwoCropsTransform``, SimCLR's view generator, DINO's global and local
    crops), found by :func:`multi_views_of`: its ``__call__`` returns a list
    (or tuple) of what transforms it holds give of the image, one call per
    view in a fixed order.  ``calls``: the attribute each view calls, in
    order; ``views``: each attribute's transform translated as a dataset's
    transform is (:func:`translate`).  The image is decoded once, and each
    view made from its decoded planes in the user's order, each view's draws
    continuing the one before's."""

    def __init__(self, name: str, calls: list, views: dict, kind: type, names: dict):
        self.name, self.calls, self.views, self.kind = name, list(calls), dict(views), kind
        self.names = dict(names)        # attribute -> (its fused steps' names, its as-written steps' names)

    def from_bytes(self, raw) -> Any:
        # the whole image once, as the fused decode decodes one no window fits (coordl.transforms.decode_and_apply)
        return self.from_planes(torch.from_numpy(_jpeg.decode_rgb(raw)).permute(2, 0, 1))

    def from_planes(self, planes: torch.Tensor) -> Any:
        """The views of a decoded image's uint8 ``(C, H, W)`` planes."""
        out = []
        for a in self.calls:
            v = self.views[a]
            got = v.from_planes(planes)         # (a translated view takes the planes, or makes a PIL image of them)
            out.append(v(_to_pil(planes)) if got is NotImplemented else got)
        return self.kind(out)

    def __call__(self, img: Any) -> Any:
        return self.kind([self.views[a](img) for a in self.calls])

    def describe(self, jpeg_draft: bool = False) -> str:
        """The words ``path_reason`` gives for it."""
        parts = []
        for a in dict.fromkeys(self.calls):
            v = self.views[a]
            parts.append(f"{a}: {describe_translation(v, v, *self.names[a], [])}")
        runs = []       # the calls in order, a repeated one counted: "local x 8"
        for a in self.calls:
            if runs and runs[-1][0] == a:
                runs[-1][1] += 1
            else:
                runs.append([a, 1])
        order = ", ".join(a if n == 1 else f"{a} x {n}" for a, n in runs)
        what = (f"{len(self.calls)} views of each image, made as {self.name}.__call__ makes them "
                f"({order}), each from the planes of one decode; {'; '.join(parts)}")
        if jpeg_draft:
            what += "; jpeg_draft=True has no effect: every view is made from one full-size decode"
        return what


class _Call:
    """Stands for a transform a multi-view object holds, in :func:`multi_views_of`'s probe."""

    __slots__ = ("name", "calls")

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def __call__(self, x: Any) -> Any:
        token = object()
        self.calls.append((self.name, x, token))
        return token


def multi_views_of(t: Any, draft: bool = False) -> "MultiViews | None":
    """A :class:`MultiViews` of ``t`` where it is an object of a user's
    class (not torchvision's, timm's or coordl's) whose ``__call__``, run
    on a copy of it whose callable attributes are recording stand-ins and
    given a small RGB PIL image, returns a list or tuple of two or more
    values that are exactly what the stand-ins returned, in the order they
    were called, each called with that image, and draws nothing from
    Python's, numpy's or torch's generators itself (the generators are put
    back after); else None (the object then runs as written)."""
    cls = type(t)
    fn = getattr(cls, "__call__", None)
    if t is None or _kind(t) is not None or isinstance(t, T.Transform) or from_torchvision(t) \
            or cls.__module__.startswith(("coordl.", "timm.")) or not isinstance(fn, types.FunctionType) \
            or cls.__getattribute__ is not object.__getattribute__:
        return None
    own = getattr(t, "__dict__", None)
    names = [k for k, v in own.items() if callable(v) and not isinstance(v, type)] if isinstance(own, dict) else []
    if not names:
        return None
    try:
        probe = copy.copy(t)
    except Exception:  # noqa: BLE001 - an object that does not copy runs as written
        return None
    if probe is t or getattr(probe, "__dict__", None) is own:
        return None
    calls: list = []
    for k in names:
        probe.__dict__[k] = _Call(k, calls)
    img = Image.new("RGB", (8, 8))
    saved = (torch.default_generator.get_state(), random.getstate(), np.random.get_state())
    before = _all_states()
    try:
        out = fn(probe, img)
    except Exception:  # noqa: BLE001 - anything else its __call__ does: it runs as written
        out = None
    finally:
        now = _all_states()
        drew = not (torch.equal(now[0], before[0]) and now[1:] == before[1:])
        torch.default_generator.set_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])
    if drew or type(out) not in (list, tuple) or len(out) < 2 or len(out) != len(calls) \
            or any(o is not tok or x is not img for o, (_, x, tok) in zip(out, calls)):
        return None
    order = [name for name, _, _ in calls]
    views, names = {}, {}
    for a in dict.fromkeys(order):
        v, fused, as_written = translate(getattr(t, a), draft)
        if type(v) is not T.Compose and type(v) is not TorchvisionPipeline:
            return None
        views[a], names[a] = v, (fused, as_written)
    if not any(fused for fused, _ in names.values()):
        return None         # nothing of any view fuses: as written
    return MultiViews(_name(t), order, views, type(out), names)


def translate(transform: Any, draft: bool = False, rgb: bool = True) -> tuple[Any, tuple[str, ...], tuple[str, ...]]:
    """``(coordl transform, fused names, as-written names)`` for a torchvision
    transform (or any callable, or None): the longest prefix coordl can fuse,
    then the rest as written.  ``draft``: let the fused decode start at a
    reduced JPEG DCT scale where the first fused step is a filtered resize
    (``draft=True`` on it; the loader's ``jpeg_draft``).  ``rgb``: the images
    it will be given are RGB (False for gray ones)."""
    return translate_steps(_flatten(transform), draft, rgb) if transform is not None else (None, (), ())


def describe_translation(transform: Any, out: Any, fused: tuple, as_written: tuple, through: list) -> str:
    """The words ``path_reason`` gives for a translated transform."""
    if transform is None:
        return "no transform"
    what = (f"read through {', '.join(through)}; " if through else "") + f"fused {', '.join(fused) or 'nothing'}"
    if as_written:
        what += f"; as written: {', '.join(as_written)}"
        notes = []
        notes += [f"{_name(t)} {t.how}" for t in getattr(out, "tail", ()) if isinstance(t, OnPlanes)]
        post = getattr(out, "post", ())
        if post:
            how = (" (as coordl's conversion when they get a PIL image)"
                   if getattr(out, "post_fused", None) is not None else "")
            notes.append(f"{', '.join(_name(t) for t in post)} without a generator of their own{how}")
        erase = getattr(out, "erase", None)
        if erase is not None:
            notes.append(f"{_name(erase.user)} drawing where the steps before it left the generators")
            if out.after:
                notes.append(f"{', '.join(_name(t) for t in out.after)} without a generator of their own")
        if notes:
            what += f" (of which {'; '.join(notes)})"
    return what


def translate_steps(steps: list, draft: bool = False, rgb: bool = True,
                    tensor: bool = False) -> tuple[Any, tuple[str, ...], tuple[str, ...]]:
    """:func:`translate` of a flat list of steps; ``tensor``: the steps are
    given a uint8 ``(3, H, W)`` tensor (a folder whose loader is
    torchvision.io's ``decode_image``), not a PIL image."""
    st = _State(rgb=rgb)
    if tensor:
        st.stage, st.to_tensor = "u8", T.PILToTensor()     # the decoded planes as a tensor: nothing to convert
    n = 0
    while n < len(steps) and _step(steps[n], st):
        n += 1
    fused_names = tuple(_name(t) for t in steps[:n])
    tail = steps[n:]
    tail_names = tuple(_name(t) for t in tail)
    if not st.geo and st.to_tensor is None:
        # nothing to fuse before the first step coordl cannot express: the user's pipeline as it is
        return TorchvisionPipeline(None, False, None, *_split_post(steps)), (), tuple(_name(t) for t in steps)
    if draft and st.geo and isinstance(st.geo[0], (T.RandomResizedCrop, T.Resize)) and all(
            T._filtered(m, st.geo[0].antialias) for m in T.modes_of(st.geo[0])):
        st.geo[0].draft = True
    if st.to_tensor is None:
        fused = T.Compose(st.geo + [T.PILToTensor()])
        tail = [_on_planes(t) for t in tail]
        return TorchvisionPipeline(fused, True, None, *_split_post(tail)), fused_names, tail_names
    fused = T.Compose(st.geo + [st.to_tensor] + st.post)
    if not tail:
        return fused, fused_names, tail_names
    if st.image_type is None:              # a plain tensor: AugMix's draws made apart, computed quicker
        tail = [_drawn_on_tensor(t) for t in tail]
    return TorchvisionPipeline(fused, False, st.image_type, *_split_post(tail)), fused_names, tail_names


def draft_note(transform: Any) -> str | None:
    """What ``loader.stats().path_reason`` says of the reduced-scale JPEG
    decode for a (translated or coordl) transform, or None when it is off."""
    fused = transform.fused if isinstance(transform, TorchvisionPipeline) else transform
    steps = getattr(fused, "transforms", None) if type(fused) is T.Compose else None
    first = steps[0] if steps and T._fusable(steps) else None
    if first is None or not T._drafts(first):
        return None
    return (f"reduced-scale JPEG decode before {type(first).__name__} (draft): images at least twice "
            "the output size are decoded at 1/2, 1/4 or 1/8 scale, so pixels differ from torchvision's")


def adapt(dataset: Any, jpeg_draft: bool = False) -> tuple[Any, Decision | None]:
    """``(dataset the loader runs, decision)``: ``decision`` is None for
    datasets that come neither from torchvision nor from timm's
    ``ImageDataset`` (``coordl.timmcompat``; returned as they are).
    ``jpeg_draft``: the loader's option of that name (see :func:`translate`).
    torch's ``Subset`` (``random_split``'s parts) of a dataset read on
    coordl's pipeline is a :class:`coordl.subsets.TwoStageSubset` of it, and
    its ``ConcatDataset`` of such datasets a
    :class:`~coordl.subsets.TwoStageConcat` of them."""
    if type(dataset) is torch.utils.data.Subset:   # torch's own: a subclass may pick its samples otherwise
        return _adapt_subset(dataset, jpeg_draft)
    if type(dataset) is torch.utils.data.ConcatDataset:
        return _adapt_concat(dataset, jpeg_draft)
    if timmcompat.is_timm_dataset(dataset):
        return _adapt_timm(dataset, jpeg_draft)
    if timmcompat.is_timm_augmix(dataset):
        why = timmcompat.why_not_augmix(dataset)
        if why is not None:
            return dataset, Decision("torch", f"timm's {type(dataset).__name__}: {why}")
        return _adapt_timm(dataset.dataset, jpeg_draft, mix=dataset)
    base = _arrays_base(dataset)
    if base is not None:
        return _adapt_arrays(dataset, base, jpeg_draft)
    if not from_torchvision(dataset):
        if jpeg_draft:
            warnings.warn("jpeg_draft=True applies to torchvision's ImageFolder/DatasetFolder only and has no "
                          f"effect on {_name(dataset)}: with coordl's transforms pass draft=True to their Resize "
                          "or RandomResizedCrop", stacklevel=3)
        return dataset, None
    why = _why_not(dataset)
    listed = _file_list(dataset)
    if why is None and listed is None and getattr(dataset, "samples", None) is None:
        why = "it has no samples"
    if why is not None:
        return dataset, Decision("torch", why)
    given, target = dataset.transform, None
    if listed is not None:
        given, target = _listed_transforms(dataset, *listed[2:])
    tensor = torchvision_loader(getattr(dataset, "loader", None))
    transform, fused, as_written, through = _translated(given, jpeg_draft, tensor=tensor is not None)
    own = None
    if listed is None:
        base = class_named(type(dataset), _FOLDER_MODULE, "DatasetFolder")
        own = _own_getitem(type(dataset), base) if base is not None else None
    try:
        if own is not None:
            adapted = TorchvisionSubclassFolder(dataset, transform, source=type(dataset).__name__, getitem=own,
                                                written=given)
        else:
            adapted = TorchvisionFolder(dataset if listed is None else _as_folder(dataset, listed[1], given, target),
                                        transform, source=type(dataset).__name__, written=given)
    except (TypeError, ValueError, AttributeError) as e:  # a subclass's make_dataset gave other kinds of samples
        return dataset, Decision("torch", f"its samples are not (path, class index) pairs ({e})")
    what = describe_adapted(given, transform, fused, as_written, through, jpeg_draft, tensor)
    if own is not None:
        what += f"; then {type(dataset).__qualname__}.__getitem__ as written, on each sample's prepared image"
    return adapted, Decision("coordl", f"{_read_as(_name(dataset), arrays=False)}; {what}", fused, as_written)


def _adapt_subset(subset: Any, jpeg_draft: bool) -> tuple[Any, Decision | None]:
    """:func:`adapt` of torch's ``Subset``: a :class:`~coordl.subsets.TwoStageSubset`
    of the dataset inside as adapted, where that one is two-stage."""
    from .protocol import is_two_stage
    from .subsets import TwoStageSubset

    inner, decision = adapt(subset.dataset, jpeg_draft)
    if (decision is not None and decision.path != "coordl") or not is_two_stage(inner):
        if decision is None:
            return subset, None   # torch's machinery, as for any dataset without raw/prep (_torch_reason)
        return subset, Decision("torch", f"a Subset of {_name(subset.dataset)}, which runs on torch's machinery: "
                                         f"{decision.reason}")
    try:
        adapted = TwoStageSubset(inner, subset.indices)
    except (TypeError, ValueError) as e:
        return subset, Decision("torch", f"a Subset whose indices coordl cannot read ({e})")
    if decision is None:
        return adapted, None
    return adapted, Decision("coordl", f"a Subset of {decision.reason}", decision.fused, decision.as_written)


def _adapt_concat(concat: Any, jpeg_draft: bool) -> tuple[Any, Decision | None]:
    """:func:`adapt` of torch's ``ConcatDataset``: a :class:`~coordl.subsets.TwoStageConcat`
    of its parts as adapted, where every one is two-stage."""
    from .protocol import is_two_stage
    from .subsets import TwoStageConcat

    parts, decisions = zip(*(adapt(d, jpeg_draft) for d in concat.datasets)) if concat.datasets else ((), ())
    why = next((f"part {k} ({_name(d)}): {dec.reason}" for k, (d, dec) in enumerate(zip(concat.datasets, decisions))
                if dec is not None and dec.path != "coordl"), None)
    if why is None:
        why = next((f"part {k} ({_name(d)}) has no raw/prep (it is not a two-stage dataset)"
                    for k, (d, p) in enumerate(zip(concat.datasets, parts)) if not is_two_stage(p)), None)
    if why is not None or not parts:
        if all(dec is None for dec in decisions):
            return concat, None   # torch's machinery, as for any dataset without raw/prep (_torch_reason)
        return concat, Decision("torch", f"a ConcatDataset whose {why}: it runs on torch's machinery")
    adapted = TwoStageConcat(parts)
    if all(dec is None for dec in decisions):
        return adapted, None
    said = [dec.reason if dec is not None else f"{_name(d)}, two-stage"
            for d, dec in zip(concat.datasets, decisions)]
    fused = tuple(dict.fromkeys(n for dec in decisions if dec is not None for n in dec.fused))
    as_written = tuple(dict.fromkeys(n for dec in decisions if dec is not None for n in dec.as_written))
    return adapted, Decision("coordl", f"a ConcatDataset of {len(said)}: " + "; and ".join(said), fused, as_written)


def _read_as(name: str, arrays: bool) -> str:
    """How ``path_reason`` says coordl reads torchvision's dataset ``name``."""
    if arrays:
        return f"torchvision's {name} read from its array in memory, transformed by coordl"
    return f"torchvision's {name} read as raw file bytes, decoded by coordl"


def _translated(given: Any, jpeg_draft: bool = False, rgb: bool = True,
                tensor: bool = False) -> tuple[Any, tuple, tuple, list]:
    """``(coordl transform, fused names, as-written names, wrappers read
    through)`` of a dataset's transform ``given`` (:func:`translate_steps`
    of its flattened steps; None for None); ``rgb``: its images are RGB;
    ``tensor``: they come as uint8 tensors (torchvision.io's decode)."""
    through: list = []
    if given is None:
        return None, (), (), through
    views = multi_views_of(given) if rgb and not tensor else None
    if views is not None:
        return (views, tuple(dict.fromkeys(n for f, _ in views.names.values() for n in f)),
                tuple(dict.fromkeys(n for _, w in views.names.values() for n in w)), through)
    return (*translate_steps(_flatten(given, through), jpeg_draft, rgb, tensor), through)


def _adapt_arrays(dataset: Any, base: type, jpeg_draft: bool) -> tuple[Any, Decision]:
    """:func:`adapt` of torchvision's ``CIFAR10``/``CIFAR100``
    (:class:`TorchvisionArrays`)."""
    why = _why_not_arrays(dataset, base)
    if why is not None:
        return dataset, Decision("torch", why)
    transform, fused, as_written, through = _translated(dataset.transform, rgb=_ARRAYS[base.__name__][2] != "gray")
    adapted = TorchvisionArrays(dataset, transform, *_ARRAYS[base.__name__][2:])
    what = describe_translation(dataset.transform, transform, fused, as_written, through)
    if jpeg_draft:
        what += "; jpeg_draft=True has no effect: the images are decoded already"
    return adapted, Decision("coordl", f"{_read_as(_name(dataset), arrays=True)}; {what}", fused, as_written)


def _as_folder(ds: Any, where: tuple, transform: Any, target: Any) -> Any:
    """One of torchvision's datasets of listed files (:func:`_file_list`)
    as the folder :class:`TorchvisionFolder` copies: its ``(path, class
    index)`` pairs as ``samples``, its ``loader`` (PIL's decode to RGB
    where it has none), the transforms it applies
    (:func:`_listed_transforms`), ``root``, ``classes`` and
    ``class_to_idx``."""
    from types import SimpleNamespace

    return SimpleNamespace(samples=_listed_samples(ds, where), loader=getattr(ds, "loader", _datasets.pil_loader),
                           transform=transform, target_transform=target, root=getattr(ds, "root", None),
                           classes=list(getattr(ds, "classes", []) or []),
                           class_to_idx=dict(getattr(ds, "class_to_idx", {}) or {}))


def follow_assigned(loader: Any, jpeg_draft: bool, mine: Any = None) -> bool:
    """A transform the user assigned to ``loader.dataset`` itself (coordl's
    copy of their torchvision dataset: under torch that would be their own
    dataset) since the last pass: a torchvision (or timm) transform, meant
    for what the dataset's own transform gets, is translated as that one is,
    so that it fuses; one of coordl's own, or of a copy coordl did not make
    (timm's dataset's), runs as assigned.  ``path_reason`` says which.
    True when it was translated (the loader then follows the user's object
    changed in place, as its own transform's).  ``mine``: that copy, where
    it is not ``loader.dataset`` itself (the dataset inside a Subset)."""
    mine = loader.dataset if mine is None else mine
    given = mine.transform
    arrays = type(mine) is TorchvisionArrays
    if not arrays and type(mine) is not TorchvisionFolder:
        return False
    rgb = not arrays or mine._layout != "gray"
    jpeg_draft = jpeg_draft and not arrays
    where = _read_as(mine._source, arrays)
    tensor = None if arrays else mine._decode
    tensor = tensor if type(tensor) is TorchvisionDecode else None
    if given is None or type(given).__module__.split(".")[0] == "coordl":
        what = "no transform" if given is None else f"{_name(given)}, coordl's, run as assigned"
        if tensor is not None:
            mine._written = given       # on the loader's tensor, every file (TorchvisionFolder._tensor_image)
            what += " on the tensor of the loader, which decodes every file"
        record_path(loader, Decision("coordl", f"{where}; the transform assigned to loader.dataset: {what}"))
        return False
    transform, fused, as_written, through = _translated(given, jpeg_draft, rgb, tensor is not None)
    mine.transform = transform
    if tensor is not None:
        mine._written = given
    what = describe_translation(given, transform, fused, as_written, through) if arrays else \
        describe_adapted(given, transform, fused, as_written, through, jpeg_draft, tensor)
    record_path(loader, Decision("coordl", f"{where}; the transform assigned to loader.dataset: {what}", fused,
                                 as_written))
    return True


def describe_adapted(given: Any, transform: Any, fused: tuple, as_written: tuple, through: list,
                     jpeg_draft: bool, tensor: "TorchvisionDecode | None" = None) -> str:
    """:func:`describe_translation` of a folder's translated ``transform``
    (from the user's ``given``), with what the reduced-scale JPEG decode
    does or, asked for (``jpeg_draft``), why it does nothing; ``tensor``:
    the folder's loader, where it is torchvision.io's."""
    if isinstance(transform, MultiViews):
        return transform.describe(jpeg_draft)
    what = describe_translation(given, transform, fused, as_written, through)
    if tensor is not None:
        how = ("JPEGs of 3 colour components" + (" or grey" if tensor.mode_name == "RGB" else "")
               + " decoded by coordl (the same pixels, checked here), other files by it"
               if tensor.fused_decode() else "every file decoded by it")
        what = (f"loader {tensor.describe()} ({how}; the transform as written on images of other than 3 "
                f"channels); {what}")
    note = draft_note(transform)
    if note is not None:
        what += f"; {note}"
    elif jpeg_draft:
        what += ("; jpeg_draft=True has no effect: the first fused step is no antialiased bilinear or bicubic "
                 "Resize/RandomResizedCrop, so every image is decoded at full size")
    return what


def _adapt_timm(dataset: Any, jpeg_draft: bool, mix: Any = None) -> tuple[Any, Decision]:
    """:func:`adapt` of timm's ``ImageDataset`` (``coordl.timmcompat``):
    its RGB images' transform translated as a torchvision folder's, any
    other's run as written.  ``mix``: timm's ``AugMixDataset`` wrapping
    ``dataset`` (:class:`~coordl.timmcompat.TimmAugMixFolder`)."""
    why = timmcompat.why_not(dataset)
    if why is not None:
        if mix is not None:
            why = f"timm's {type(mix).__name__} over {type(dataset).__name__}: {why}"
            dataset = mix
        return dataset, Decision("torch", why)
    rgb = getattr(dataset, "input_img_mode", "RGB") == "RGB" and not getattr(dataset, "load_bytes", False)
    if rgb or dataset.transform is None:
        transform, fused, as_written, through = _translated(dataset.transform, jpeg_draft)
    else:
        transform, fused, as_written, through = dataset.transform, (), (_name(dataset.transform),), []
    views = augmix_views(dataset.transform, mix, jpeg_draft) if mix is not None and rgb else None
    try:
        adapted = timmcompat.TimmImageFolder(dataset, transform) if mix is None else \
            timmcompat.TimmAugMixFolder(mix, transform, views)
    except (TypeError, ValueError) as e:
        return dataset if mix is None else mix, \
            Decision("torch", f"its reader's samples are not (path, class index) pairs ({e})")
    if rgb:
        what = describe_adapted(dataset.transform, transform, fused, as_written, through, jpeg_draft)
    else:
        given = "the file's bytes (load_bytes=True)" if dataset.load_bytes else \
            f"images in mode {dataset.input_img_mode!r}"
        what = f"its transform as written, given {given}"
        if jpeg_draft:
            what += "; jpeg_draft=True has no effect: coordl decodes only RGB images itself"
    reason = f"timm's {type(dataset).__name__} read as raw file bytes, decoded by coordl; {what}"
    if mix is not None:
        def named(t):
            steps = getattr(t, "transforms", None)
            return f"{_name(t)}({', '.join(map(_name, steps))})" if isinstance(steps, (list, tuple)) else _name(t)
        views = f"the clean view and {mix.num_splits - 1} through {named(mix.augmentation)}" \
            if mix.num_splits > 1 else "the clean view"
        each = f"each through {named(mix.normalize) if mix.normalize is not None else 'no normalize'}"
        if adapted.views is None:
            reason = f"timm's {type(mix).__name__} over {reason}; then its own __getitem__ as written: {views}, {each}"
        else:
            notes = [f"{_name(t)} {t.how}" for t in adapted.views.tail if isinstance(t, OnPlanes)]
            reason = (f"timm's {type(mix).__name__} over {reason}; then its own __getitem__'s views, made as it "
                      f"makes them of the fused crop's planes: {views}, {each}"
                      + (f" (of which {'; '.join(notes)})" if notes else ""))
    return adapted, Decision("coordl", reason, fused, as_written)


def augmix_views(first: Any, mix: Any, draft: bool = False) -> "TorchvisionPipeline | None":
    """For timm's ``AugMixDataset`` ``mix`` over a folder of RGB images
    whose transform is ``first``: the translation of one view's whole
    pipeline (``first``, then ``mix.augmentation``, then ``mix.normalize``)
    where it splits where those do (``first`` fused whole into the uint8
    planes, the augmentation the steps run after it, the normalize the
    conversion after them), so that :meth:`TorchvisionPipeline.views_of`
    makes the views from the fused crop's planes; else None (its
    ``__getitem__`` then runs as written on the PIL image)."""
    aug, norm = getattr(mix, "augmentation", None), getattr(mix, "normalize", None)
    if first is None or norm is None or (aug is None and mix.num_splits > 1):
        return None
    parts = [_flatten(first), _flatten(aug) if aug is not None else [], _flatten(norm)]
    try:
        out, fused, _ = translate_steps(parts[0] + parts[1] + parts[2], draft)
    except (TypeError, ValueError):
        return None
    if not isinstance(out, TorchvisionPipeline) or out.fused is None or not out.to_pil \
            or len(fused) != len(parts[0]) or len(out.tail) != len(parts[1]) or len(out.post) != len(parts[2]) \
            or out.post_fused is None or out.erase is not None or out.after:
        return None
    return out


def record_path(loader: Any, decision: Decision | None) -> None:
    """Put which machinery runs ``loader``'s passes, and why, into its stats
    (``path``, ``path_reason``) and say it in one debug log line."""
    path, reason = describe_path(loader, decision)
    loader._counters.path, loader._counters.path_reason = path, reason
    log.debug("coordl.DataLoader over %s runs on %s's machinery: %s",
              _name(loader.dataset) if decision is None else "a torchvision dataset", path, reason)


def describe_path(loader: Any, decision: Decision | None) -> tuple[str, str]:
    """``(path, reason)``: which machinery runs the loader's passes and why."""
    from .pipeline.modes import PipelineMode

    mode = loader._mode
    on_pipeline = isinstance(mode, PipelineMode)
    if decision is not None and decision.path == "torch":
        return "torch", decision.reason
    if on_pipeline:
        if getattr(mode, "from_sampler", False):
            order = "in the order of the loader's sampler (read once per pass, as torch reads it)"
            return "coordl", f"{decision.reason}; {order}" if decision is not None else f"two-stage dataset {order}"
        if decision is not None:
            return "coordl", decision.reason
        note = draft_note(getattr(loader.dataset, "transform", None))
        return "coordl", "two-stage dataset in epoch-plan order" + (f"; {note}" if note else "")
    if decision is not None:
        return "torch", (decision.reason + f"; but the passes run on torch's machinery ({mode.name} mode: "
                         "a sampler without a length, or an option coordl's pipeline does not take)")
    return "torch", _torch_reason(loader)


def _torch_reason(loader: Any) -> str:
    """Why a dataset that is not a torchvision folder runs on torch's
    machinery, in words (and, for a wrapper of torchvision folders, what
    keeps coordl's pipeline)."""
    from torch.utils.data import ConcatDataset, IterableDataset, Subset

    ds, mode = loader.dataset, loader._mode
    name = type(ds).__name__
    if mode.name == "tensor-batch":
        return (f"an unmodified {name} with default collation: torch's machinery runs it, one gather per "
                "tensor per batch instead of a __getitem__ per sample (nothing to read ahead or cache)")
    if mode.name == "two-stage-torch":
        if callable(getattr(ds, "raw", None)):
            return (f"{name} is two-stage (raw/prep), but its order comes from a sampler coordl cannot "
                    "read an epoch of ahead (no len()), so torch's machinery runs raw then prep per sample")
        return (f'on_error="skip" over {name}, which has no raw/prep: torch\'s machinery runs '
                "dataset[i] per sample, so that a bad sample can be dropped")
    if isinstance(ds, IterableDataset):
        return f"{name} is an IterableDataset: its own iterator gives the samples, so torch's machinery runs it"
    why = (f"{name} has no raw/prep (it is not a two-stage dataset), so torch's machinery runs "
           "dataset[i] as written")
    # (torch's own Subset and ConcatDataset of folders read on coordl's pipeline, or say why not: _adapt_subset,
    # _adapt_concat; what is left here is a subclass of theirs)
    parts = list(ds.datasets) if isinstance(ds, ConcatDataset) else [ds.dataset] if isinstance(ds, Subset) else []
    folders = [f for f in map(_folder_named, parts) if f is not None]
    if len({owner for owner, _ in folders}) == 1:       # "torchvision's ImageFolder, ImageFolder"
        folders = [f"{folders[0][0]} {', '.join(name for _, name in folders)}"]
    else:
        folders = [f"{owner} {name}" for owner, name in folders]
    if folders:
        kind = "ConcatDataset" if isinstance(ds, ConcatDataset) else "Subset"
        why += (f". It is a subclass of torch's {kind}, of {', '.join(folders)}: coordl reads torch's own "
                f"{kind} of such datasets on its pipeline, not a subclass, which may pick its samples otherwise")
    return why


def _folder_named(ds: Any) -> tuple[str, str] | None:
    """``("torchvision's", "ImageFolder")``, ``("timm's", "ImageDataset")``:
    whose dataset :func:`adapt` would read on coordl's pipeline ``ds`` is,
    and its class's name; else None."""
    if from_torchvision(ds) and (class_named(type(ds), _FOLDER_MODULE, "DatasetFolder") or _file_list(ds)
                                 or _arrays_base(ds)):
        return "torchvision's", _name(ds)
    return ("timm's", _name(ds)) if timmcompat.is_timm_dataset(ds) else None
