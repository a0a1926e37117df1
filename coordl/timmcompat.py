"""timm's image folder dataset on coordl's pipeline, unchanged.

timm's training script builds its dataset with ``timm.data.create_dataset``:
for a folder of images, an ``ImageDataset`` over a ``ReaderImageFolder``
(the reader scans the folder; the dataset opens each file with PIL,
converts it to ``input_img_mode`` and applies ``transform``).  Given one,
``coordl.DataLoader`` runs a :class:`TimmImageFolder` instead, as it runs a
torchvision folder (``coordl.tvcompat.adapt`` makes it): ``raw(i)`` reads the file's
bytes (the node cache, peers and shared reads apply), ``prep`` decodes and
transforms them.  With ``input_img_mode="RGB"`` (timm's default) the
transform is translated as a torchvision one is (timm's
``create_transform`` recipes are torchvision's transforms and timm's own,
which ``coordl.tvcompat`` recognizes), so the fused crop-window decode runs
it; with another mode, or ``load_bytes=True``, the transform runs as
written on what timm gives it.

What timm's ``__getitem__`` does that a plain folder does not is kept: a
file that cannot be opened or decoded (an ``OSError``: PIL's
``UnidentifiedImageError``, a truncated image) is skipped, a warning
logged on timm's logger, and the next index's sample delivered in its
place, up to the dataset's retry count, after which ``RuntimeError`` says
so.  The sample's draws stay those of its own (seed, epoch, index).

timm's ``AugMixDataset`` (its ``train.py`` with ``--aug-splits``, for
AugMix with the JSD loss) over such a dataset runs as
:class:`TimmAugMixFolder`: the folder's sample as above (the transform it
holds, the first of the three ``create_transform(..., separate=True)``
makes, translated and fused), then ``AugMixDataset``'s own
``__getitem__``, as written, on that sample: the clean view normalized, and
``num_splits - 1`` views through its ``augmentation`` then normalized.

Anything else stays on torch's machinery, the reason in
``loader.stats().path_reason``: another reader (a tar file, Hugging Face,
TFDS, WebDataset), a subclass that overrides ``__getitem__`` or
``__len__``, ``additional_features``, an ``AugMixDataset`` over any other
dataset.  Nothing here imports timm: its classes are recognized by module
and name.
"""
from __future__ import annotations

import copy
import functools
import io
import logging
import os
from types import SimpleNamespace
from typing import Any

from PIL import Image

from .base.foreign import class_named, why_not_callable, why_overridden
from .datasets import TwoStageFolder, pil_decode, pil_loader

__all__ = ["TimmAugMixFolder", "TimmImageFolder", "is_timm_augmix", "is_timm_dataset", "why_not", "why_not_augmix"]

_DATASET = ("timm.data.dataset", "ImageDataset")
_AUGMIX = ("timm.data.dataset", "AugMixDataset")
_READER = ("timm.data.readers.reader_image_folder", "ReaderImageFolder")


def is_timm_dataset(obj: Any) -> bool:
    """``obj`` is timm's ``ImageDataset`` or a subclass of it."""
    return class_named(type(obj), *_DATASET) is not None


def is_timm_augmix(obj: Any) -> bool:
    """``obj`` is timm's ``AugMixDataset`` or a subclass of it."""
    return class_named(type(obj), *_AUGMIX) is not None


def why_not_augmix(mix: Any) -> str | None:
    """Why timm's ``AugMixDataset`` ``mix`` cannot run on coordl's pipeline
    (the dataset it wraps aside: :func:`why_not`), or None."""
    cls = type(mix)
    why = why_overridden(cls, class_named(cls, *_AUGMIX))
    if why is not None:
        return why
    splits = getattr(mix, "num_splits", None)
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        return f"its num_splits is {splits!r}, not a whole number of views"
    if splits > 1 and not callable(getattr(mix, "augmentation", None)):
        return "it has no augmentation for its augmented views (its transform was not set to three transforms)"
    if not is_timm_dataset(getattr(mix, "dataset", None)):
        return (f"it wraps {type(getattr(mix, 'dataset', None)).__name__}, not timm's ImageDataset of a folder, "
                "which is what coordl reads under it")
    return None


def why_not(ds: Any) -> str | None:
    """Why timm's ``ds`` cannot run on coordl's pipeline, or None."""
    cls = type(ds)
    why = why_overridden(cls, class_named(cls, *_DATASET))
    if why is not None:
        return why
    reader = getattr(ds, "reader", None)
    rcls = type(reader)
    rbase = class_named(rcls, *_READER)
    if rbase is None:
        return (f"timm's {cls.__name__} reads through {rcls.__name__}, not a folder of image files "
                "(ReaderImageFolder), so coordl has no file bytes to cache and share for it")
    why = why_overridden(rcls, rbase, what=f"its reader {rcls.__name__}")
    if why is not None:
        return why
    retries = getattr(ds, "_max_retries", None)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 1:
        return (f"this timm's {cls.__name__} has no retry count of its own (_max_retries; timm 1.0 and later), "
                "so coordl cannot tell how it skips a file it cannot open")
    if getattr(ds, "additional_features", None) is not None:
        return "it returns additional_features, which coordl's folder does not read"
    why = why_not_callable(ds)
    if why is not None:
        return why
    samples = getattr(reader, "samples", None)
    if not isinstance(samples, (list, tuple)) or not isinstance(getattr(reader, "root", None), (str, os.PathLike)):
        return "its reader has no list of samples under a root"
    return None


def _open_as(mode: str | None, raw) -> Any:
    """timm's decode of a file given its bytes: ``Image.open`` then, with a
    mode, ``convert(mode)`` (every pixel decoded, so a corrupt file fails
    here); without one, the image as opened (decoded when first used)."""
    img = Image.open(io.BytesIO(raw))
    return img.convert(mode) if mode else img


def _as_bytes(raw) -> bytes:
    """``load_bytes=True``: the file's bytes, as ``bytes`` (timm's ``read()``)."""
    return raw if type(raw) is bytes else bytes(raw)


class TimmImageFolder(TwoStageFolder):
    """timm's ``ImageDataset`` over a ``ReaderImageFolder`` as a coordl
    two-stage dataset, made by ``coordl.tvcompat.adapt``: the reader's samples, root
    and ``class_to_idx``, the dataset's ``transform`` (translated where the
    images are RGB) and ``target_transform``; ``filename`` and
    ``filenames`` as timm's.  A sample whose file cannot be opened is
    replaced by the next one's, as timm's dataset does (see the module's
    docstring).  Keeps no reference to the original dataset or reader."""

    def __init__(self, dataset: Any, transform: Any):
        reader = dataset.reader
        mode = getattr(dataset, "input_img_mode", "RGB")
        self.load_bytes = bool(getattr(dataset, "load_bytes", False))
        self.input_img_mode = mode
        if self.load_bytes:
            decode = _as_bytes
        elif mode == "RGB":
            decode = None           # coordl's pil_decode: the fused decode path
        else:
            decode = functools.partial(_open_as, mode or None)
        class_to_idx = dict(getattr(reader, "class_to_idx", {}) or {})
        like = SimpleNamespace(
            samples=reader.samples, loader=pil_loader, transform=transform,
            target_transform=getattr(dataset, "target_transform", None), root=os.fspath(reader.root),
            classes=[c for c, _ in sorted(class_to_idx.items(), key=lambda kv: kv[1])],
            class_to_idx=class_to_idx)
        super().__init__(like, decode)
        self._source = type(dataset).__name__
        self._logger = type(dataset).__module__
        self._retries = int(dataset._max_retries)

    def _repr_name(self) -> str:
        return f"{type(self).__name__}(timm {self._source})"

    # -- timm's skip of a file that cannot be opened -------------------------

    def _opens(self, raw) -> bool:
        """Whether timm's dataset opens (and converts) these bytes."""
        if self.load_bytes:
            return True
        try:
            _open_as(self.input_img_mode or None, raw)
        except OSError:
            return False
        return True

    def _prep_seeded(self, raw, index: int):
        try:
            return super()._prep_seeded(raw, index)
        except Exception as e:  # noqa: BLE001 - timm's own error where its dataset would have opened the file
            if self._opens(raw):
                raise
            first = e
        return self._next_that_opens(self._check_index(index), first)

    def _next_that_opens(self, index: int, error: BaseException):
        """timm's loop after the file of ``index`` failed with ``error``: the
        next index's file, read and opened here, then transformed; each
        failure logged; ``RuntimeError`` after the dataset's retry count."""
        log = logging.getLogger(self._logger)
        n = len(self)
        for _ in range(self._retries - 1):
            log.warning("Skipped sample (index %d). %s", index, error)
            index = (index + 1) % n
            try:
                img = self._decode(self._raw(index))     # timm's open and convert (pil_decode for RGB)
            except OSError as e:
                error = e
                continue
            return self._finish(img, index)
        log.warning("Skipped sample (index %d). %s", index, error)
        raise RuntimeError(f"Failed to load {self._retries} consecutive samples")

    # -- timm's reader's names -----------------------------------------------

    def filename(self, index: int, basename: bool = False, absolute: bool = False) -> str:
        """The file of sample ``index``: relative to the root (default), its
        base name, or its absolute path, as timm's reader names it."""
        path = self._path(self._check_index(index))
        if basename:
            return os.path.basename(path)
        if not absolute:
            return os.path.relpath(path, self.root)
        return path

    def filenames(self, basename: bool = False, absolute: bool = False) -> list[str]:
        """:meth:`filename` of every sample, in order."""
        return [self.filename(i, basename, absolute) for i in range(len(self))]


class _Prepared:
    """Stands for the dataset inside ``AugMixDataset.__getitem__``: what
    coordl's folder prepared for the index, handed back as is."""

    __slots__ = ("sample",)

    def __init__(self, sample: tuple) -> None:
        self.sample = sample

    def __getitem__(self, index: int) -> tuple:
        return self.sample

    def __len__(self) -> int:
        return 1


class TimmAugMixFolder(TimmImageFolder):
    """timm's ``AugMixDataset`` over an ``ImageDataset`` of a folder (see
    the module's docstring): :class:`TimmImageFolder`'s sample, then the
    wrapper's own ``__getitem__`` on it, with its ``augmentation``,
    ``normalize`` and ``num_splits``.  All of a sample's draws (the fused
    crop and flip, each view's augmentation) come from its (seed, epoch,
    index).  Keeps a copy of the wrapper without the dataset it wraps.

    ``views``: one view's whole pipeline translated
    (:func:`coordl.tvcompat.augmix_views`), or None: where it is given and
    the wrapper's ``__getitem__`` makes its views as timm's does
    (:func:`makes_views_as_timm`, checked once per class), the views are
    made from the fused crop's uint8 planes (the augmentation's steps with
    a kernel of coordl's on the planes, the conversions coordl's), with
    the same draws in the same order and the same values as its
    ``__getitem__`` on the PIL image; a sample the fused decode does not
    take runs that ``__getitem__`` as written.

    ``decode="device"`` and the device split do not apply: each sample is
    several views, made on the CPU."""

    #: the sample is more than the transform's output: no device split
    views_after_transform = True

    def __init__(self, mix: Any, transform: Any, views: Any = None):
        super().__init__(mix.dataset, transform)
        self._mix = copy.copy(mix)      # timm's own object, its __getitem__ run as written
        self._mix.__dict__["dataset"] = None
        self._source = f"{type(mix).__name__} of {self._source}"
        self.views = views if views is not None and makes_views_as_timm(self._mix) else None

    @property
    def num_splits(self) -> int:
        """The views of each sample: the clean one and ``num_splits - 1`` augmented."""
        return self._mix.num_splits

    @property
    def augmentation(self) -> Any:
        return self._mix.augmentation

    @property
    def normalize(self) -> Any:
        return self._mix.normalize

    def take_transforms(self, other: "TimmAugMixFolder") -> None:
        """The first transform and the wrapper's augmentation, normalize and views."""
        super().take_transforms(other)
        self._mix = other._mix
        self.views = other.views

    def _prep(self, raw, index: int):
        from .transforms import seeded_for

        mix = self._mix
        with seeded_for(self.transform, self.target_transform, self._decode, mix.augmentation, mix.normalize):
            return self._prep_seeded(raw, index)

    def _prep_seeded(self, raw, index: int):
        views = self.views
        if views is not None and self._decode is pil_decode:
            try:
                x = views.fused.from_bytes(raw)
            except Exception as e:  # noqa: BLE001 - as TimmImageFolder._prep_seeded: timm's skip, or the error
                if self._opens(raw):
                    raise
                return self._mixed(self._next_that_opens(self._check_index(index), e), index)
            if x is not NotImplemented:
                target = self._target(self._check_index(index))
                return tuple(views.views_of(x, self._mix.num_splits - 1)), target
        return self._mixed(super()._prep_seeded(raw, index), index)

    def _mixed(self, sample: tuple, index: int):
        """The wrapper's own ``__getitem__``, as written, on the folder's ``sample``."""
        mix = copy.copy(self._mix)
        mix.__dict__["dataset"] = _Prepared(sample)
        return type(mix).__getitem__(mix, index)


_MAKES_VIEWS: dict = {}


def makes_views_as_timm(mix: Any) -> bool:
    """Whether the ``__getitem__`` of ``mix``'s class (timm's
    ``AugMixDataset``'s, or a subclass's that keeps it) makes its views as
    :meth:`TimmAugMixFolder._prep_seeded` makes them from the planes: of the
    dataset's ``(x, y)``, ``normalize(x)``, then for each other view
    ``normalize(augmentation(x))``, in that order, returned as ``(tuple of
    the views, y)``.  Checked once per class on recording stand-ins."""
    cls = type(mix)
    got = _MAKES_VIEWS.get(cls)
    if got is None:
        calls: list = []

        def aug(v):
            calls.append("a")
            return ("a", v)

        def norm(v):
            calls.append("n")
            return ("n", v)

        probe = copy.copy(mix)
        probe.__dict__.update(dataset=_Prepared(("x", "y")), augmentation=aug, normalize=norm, num_splits=3)
        try:
            out = cls.__getitem__(probe, 0)
        except Exception:  # noqa: BLE001 - anything else: its own code runs as written
            out = None
        want = ((("n", "x"), ("n", ("a", "x")), ("n", ("a", "x"))), "y")
        got = _MAKES_VIEWS[cls] = out == want and type(out[0]) is tuple and calls == ["n", "a", "n", "a", "n"]
    return got
