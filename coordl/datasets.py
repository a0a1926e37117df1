"""Folder datasets that follow the two-stage protocol (see ``coordl.protocol``).

:class:`ImageFolder` and :class:`DatasetFolder` have the constructor, the
attributes and the scanning rules of torchvision's classes of the same name,
so they can replace them without other changes.  Two things differ inside:

* **Two stages.**  ``raw(i)`` reads the file's bytes and does nothing else;
  ``prep(raw, i)`` decodes them in memory, applies ``transform`` and
  ``target_transform`` and returns ``(sample, target)``.  ``__getitem__(i)`` is
  ``prep(raw(i), i)``, so under torch's own DataLoader the dataset behaves like
  torchvision's.

* **Numpy storage.**  The sample list is kept as one ``uint8`` buffer of
  relative paths plus ``int64`` offsets, targets, file sizes and mtimes, never
  as a Python list of strings.  Forked DataLoader workers reading a list of a
  million strings touch a million reference counts and so copy every page that
  holds one; reading numpy buffers copies nothing.  The object also pickles to
  a few large buffers (out of band with pickle protocol 5).  ``samples``,
  ``imgs`` and ``targets`` are built on access and look like torchvision's.

Loaders and decoders
--------------------
torchvision's ``loader`` is a function of a *path*.  A two-stage dataset needs
a function of the file's *bytes*, which coordl calls ``decode``:

* default (``loader=None, decode=None``): ``ImageFolder`` decodes with PIL and
  converts to RGB (``pil_decode``), exactly what torchvision's
  ``default_loader`` returns; ``DatasetFolder``'s sample is the file's bytes.
* ``loader`` given, ``decode=None``: if ``loader`` is a default PIL loader
  (``default_loader`` or ``pil_loader``, ours or torchvision's, or a
  function of the user's written as one: PIL's open, then
  ``convert("RGB")``, recognized by its code, not its name) the dataset
  decodes with ``pil_decode``; if it is torchvision.io's ``decode_image``
  or ``read_image`` (or a ``functools.partial`` of one giving its mode),
  with that function's decode of the bytes
  (``coordl.decode.tvio.TorchvisionDecode``).  Otherwise it
  cannot decode bytes: it is **not** two-stage (``raw``/``prep`` raise
  ``AttributeError``, ``coordl.protocol.is_two_stage`` is False) and
  ``__getitem__`` calls ``loader(path)`` like torchvision.
* ``decode`` given: the dataset is two-stage with ``prep`` calling
  ``decode(raw)``.  If ``loader`` is also given it is kept as an attribute but
  not used; ``decode(open(path, 'rb').read())`` must equal ``loader(path)``.

:func:`two_stage` adapts an existing torchvision-style folder dataset
instance the same way.

Where the parts live: the sample table (numpy storage, ``samples``,
``targets``, ``fingerprint``) in ``coordl/storage/table.py``, the folder scan
in ``coordl/storage/listing.py``, the path loaders and ``pil_decode`` in
``coordl/decode/loaders.py``; this module holds the dataset classes (the
two-stage protocol and torchvision's constructors) and exports the public
names of all three.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from .decode.loaders import (  # noqa: F401 (public names of this module)
    _DecodingLoader,
    _check_decode,
    _identity,
    _is_default_pil_loader,
    _naming,
    default_loader,
    pil_decode,
    pil_loader,
    read_bytes,
)
from .decode.tvio import TorchvisionDecode, torchvision_loader
from .storage import FsspecStore, is_url
from .storage.listing import (  # noqa: F401 (public names of this module)
    IMG_EXTENSIONS,
    _scan,
    _split_prefix,
    _stat_paths,
    _validity_check,
    find_classes,
    has_file_allowed_extension,
    is_image_file,
    make_dataset,
)
from .storage.table import FolderSamples, SampleTable  # noqa: F401 (FolderSamples: public here)

__all__ = [
    "IMG_EXTENSIONS",
    "DatasetFolder",
    "ImageFolder",
    "TwoStageFolder",
    "FolderSamples",
    "two_stage",
    "find_classes",
    "make_dataset",
    "has_file_allowed_extension",
    "is_image_file",
    "read_bytes",
    "pil_decode",
    "default_loader",
    "pil_loader",
]


# --------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------

class _FolderBase(SampleTable):
    """The two-stage protocol over a sample table (:class:`~coordl.storage.table.SampleTable`).

    Subclasses set ``root``, ``classes``, ``class_to_idx``, ``transform``,
    ``target_transform``, ``loader`` and ``_decode`` and call ``_set_table``.
    """

    # -- protocol ---------------------------------------------------------

    def _two_stage_ok(self) -> bool:
        if self._decode is None:
            return False
        cls = type(self)
        # A subclass that changes __getitem__ but not prep would be bypassed
        # by a loader that calls raw/prep: then it is not two-stage.
        if cls.__getitem__ is not _FolderBase.__getitem__ and cls.prep is _FolderBase.prep:
            return False
        return True

    def _not_two_stage(self, name: str) -> AttributeError:
        if self._decode is None:
            why = (f"its loader {self.loader!r} reads paths and no decode was given; "
                   "pass decode= (a callable taking the file's bytes and returning the sample)")
        else:
            why = f"{type(self).__name__} overrides __getitem__ but not prep"
        return AttributeError(f"{type(self).__name__} has no {name}: it is not two-stage, because {why}")

    @property
    def raw(self) -> Callable[[int], bytes]:
        """``raw(i)``: the bytes of sample ``i``'s file (I/O only)."""
        if not self._two_stage_ok():
            raise self._not_two_stage("raw")
        return self._raw

    @property
    def prep(self) -> Callable[[bytes, int], tuple[Any, Any]]:
        """``prep(raw, i)``: ``(transform(decode(raw)), target_transform(target))``."""
        if not self._two_stage_ok():
            raise self._not_two_stage("prep")
        return self._prep

    @property
    def is_two_stage(self) -> bool:
        """True when ``raw``/``prep`` are available."""
        return self._two_stage_ok()


    def _read(self, path: str) -> bytes:
        return read_bytes(path) if self._store is None else self._store.read(path)

    def _raw(self, index: int) -> bytes:
        return self._read(self._path(self._check_index(index)))

    @property
    def raw_uncached(self) -> Callable[[int], bytes]:
        """``raw_uncached(i)``: ``raw(i)`` leaving no copy in the OS page
        cache (read when coordl's node cache keeps the bytes): local files
        drop their pages; URLs read through obstore are ``raw`` itself (the
        fetch threads read them one by one and nothing enters the page
        cache).  URLs read through fsspec have none (they are read in
        batches by ``raw_many``)."""
        if not self._two_stage_ok() or (self._store is not None and not self._store.native):
            raise AttributeError(f"{type(self).__name__} has no raw_uncached: remote objects are not "
                                 "in the page cache")
        return self._raw if self._store is not None else self._raw_uncached

    def _raw_uncached(self, index: int) -> bytes:
        return read_bytes(self._path(self._check_index(index)), drop_cache=True)

    @property
    def raw_many(self) -> Callable[[list], list]:
        """``raw_many([i, ...])``: the bytes of several samples (or the error
        for each), fetched concurrently; only for URL roots read through
        fsspec.  Local files and URLs read through obstore (the default for
        http(s)/s3/gs/Azure when it is installed) have none: the fetch
        stage's threads read them one by one, which costs less CPU."""
        if self._store is None or not self._two_stage_ok():
            raise AttributeError(f"{type(self).__name__} has no raw_many: local files are read one by one")
        if self._store.native:
            raise AttributeError(f"{type(self).__name__} has no raw_many: {self.root} is read through obstore, "
                                 "one object per fetch thread (COORDL_NATIVE_STORE=0 reads through fsspec)")
        return self._raw_many

    def _raw_many(self, indices: list) -> list:
        return self._store.read_many([self._path(self._check_index(i)) for i in indices])

    def _prep(self, raw: bytes, index: int) -> tuple[Any, Any]:
        from .transforms import seeded_for

        # callables not coordl's draw from the global generators: seeded by the sample, once for all
        with seeded_for(self.transform, self.target_transform, self._decode):
            return self._prep_seeded(raw, index)

    def _prep_seeded(self, raw: bytes, index: int) -> tuple[Any, Any]:
        i = self._check_index(index)
        sample = self._fused_image(raw)
        if sample is not NotImplemented:
            return sample, self._target(i)
        return self._finish(self._decode(raw), i)

    def _target(self, i: int) -> Any:
        """Sample ``i``'s class index through ``target_transform`` (after the
        transform: its draws come first)."""
        target = int(self._targets[i])
        return self.target_transform(target) if self.target_transform is not None else target

    def _fused_image(self, raw: bytes) -> Any:
        """``transform(decode(raw))`` in one step where coordl's pipeline
        can (see coordl.transforms.decode_and_apply: same draws, no PIL
        image), else NotImplemented."""
        if self._decode is not pil_decode:
            tensor = getattr(self, "_tensor_image", None)   # coordl.tvcompat's folder with torchvision.io's loader
            return tensor(raw) if tensor is not None and type(self._decode) is TorchvisionDecode else NotImplemented
        fused = getattr(self.transform, "from_bytes", None)
        return fused(raw) if fused is not None else NotImplemented

    def _finish(self, sample: Any, i: int) -> tuple[Any, Any]:
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, self._target(i)

    def take_transforms(self, other: Any) -> None:
        """Run from the next pass what ``other`` runs: a copy of the same
        dataset adapted anew (``coordl.tvcompat.adapt``) after the user
        assigned a transform to the original."""
        self.transform, self.target_transform = other.transform, other.target_transform

    def describe(self, index: int) -> str:
        """The path of sample ``index``."""
        return self._path(self._check_index(index))

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        i = self._check_index(index)
        path = self._path(i)
        if self._decode is None:
            return self._finish(self.loader(path), i)
        return _naming(path, lambda raw: self._prep(raw, i), self._read(path))

    def __len__(self) -> int:
        return len(self._targets)

    # -- repr -------------------------------------------------------------

    def _repr_name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        body = [f"Number of datapoints: {len(self)}"]
        root = getattr(self, "root", None)
        if root is not None:
            body.append(f"Root location: {root}")
        for label, fn in (("Transform", self.transform), ("Target transform", self.target_transform)):
            if fn is not None:
                lines = repr(fn).splitlines() or [""]
                body.append(f"{label}: {lines[0]}")
                body.extend("    " + line for line in lines[1:])
        return "\n".join([f"Dataset {self._repr_name()}"] + ["    " + line for line in body])


class DatasetFolder(_FolderBase):
    """A dataset of files arranged as ``root/<class>/**/<file>``.

    Same arguments, attributes and scanning rules as torchvision's
    ``DatasetFolder``: classes are the sorted subdirectories of ``root``
    (override :meth:`find_classes` to change that), files are walked
    recursively in ``sorted(os.walk(class_dir, followlinks=True))`` order with
    sorted file names, and kept when their name ends with one of
    ``extensions`` (case-insensitive) or when ``is_valid_file(path)`` is true;
    exactly one of the two must be given.  A class folder without a valid file
    is an error unless ``allow_empty``.  Overriding the static method
    :meth:`make_dataset` is honoured too.

    Args:
        root: the dataset's directory.
        loader: a function of a path returning the sample.  ``None``: the
            sample is the file's bytes (torchvision has no such default).
        extensions: allowed file name endings.
        transform: applied to the sample.
        target_transform: applied to the class index.
        is_valid_file: predicate on a file's path, instead of ``extensions``.
        allow_empty: allow class folders without valid files.
        decode: a function of the file's *bytes* returning the sample, which
            makes the dataset two-stage when ``loader`` is a custom path
            loader (see the module docstring).
        storage_options: for a URL root, fsspec's options for its filesystem
            (e.g. ``{"endpoint_url": ..., "key": ..., "secret": ...}`` for
            s3://); the obstore reader takes the same (:doc:`/guide/storage`).

    ``samples``/``imgs`` (``(path, class_index)`` tuples), ``targets``,
    ``sizes`` and ``fingerprint()`` are backed by numpy arrays.
    """

    def __init__(self, root: str | os.PathLike, loader: Callable[[str], Any] | None = None,
                 extensions: str | tuple[str, ...] | None = None,
                 transform: Callable | None = None, target_transform: Callable | None = None,
                 is_valid_file: Callable[[str], bool] | None = None, allow_empty: bool = False,
                 *, decode: Callable[[bytes], Any] | None = None, storage_options: dict | None = None):
        if storage_options and not is_url(root):
            raise ValueError(f"storage_options should be given only with a URL root (s3://, http://, ...), "
                             f"but got root={root!r} and storage_options={storage_options!r}")
        self.root = os.path.expanduser(root) if isinstance(root, str) else root
        self.transform = transform
        self.target_transform = target_transform
        self.extensions = extensions
        self.loader, self._decode = self._resolve_loader(loader, decode)
        if is_url(root):
            self._store = FsspecStore(root, storage_options)
            self._scan_store(extensions, is_valid_file, allow_empty)
            return
        directory = os.path.expanduser(os.fspath(root))
        classes, class_to_idx = self.find_classes(directory)
        if type(self).make_dataset is DatasetFolder.make_dataset:
            scan = _scan(directory, class_to_idx, extensions, is_valid_file, allow_empty)
            self._set_table(directory, scan.rel, scan.targets, scan.sizes, scan.mtimes)
        else:  # a subclass's own make_dataset, as torchvision allows
            samples = self.make_dataset(directory, class_to_idx=class_to_idx, extensions=extensions,
                                        is_valid_file=is_valid_file, allow_empty=allow_empty)
            self._set_samples(samples, directory)
        self.classes = classes
        self.class_to_idx = class_to_idx

    def _scan_store(self, extensions, is_valid_file, allow_empty: bool) -> None:
        """The same rules as the local scan, over an fsspec URL."""
        classes, files = self._store.scan(_validity_check(extensions, is_valid_file))
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {self.root}.")
        class_to_idx = {c: i for i, c in enumerate(classes)}
        empty = set(classes) - {f[1] for f in files}
        if empty and not allow_empty:
            raise FileNotFoundError(
                f"Found no valid file for the classes {', '.join(sorted(empty))} in {self.root}."
                + (f" Supported extensions are: {extensions if isinstance(extensions, str) else ', '.join(extensions)}"
                   if extensions is not None else ""))
        self._set_table(self._store.url, [f[0].encode() for f in files],
                        [class_to_idx[f[1]] for f in files], [f[2] for f in files], [f[3] for f in files],
                        versions=[f[4] for f in files])
        self.classes = classes
        self.class_to_idx = class_to_idx

    def _default_decode(self) -> Callable[[bytes], Any]:
        return _identity

    def _resolve_loader(self, loader, decode):
        _check_decode(decode)
        if decode is not None:
            return (loader if loader is not None else _DecodingLoader(decode)), decode
        if loader is None:
            decode = self._default_decode()
            return (default_loader if decode is pil_decode else _DecodingLoader(decode)), decode
        if _is_default_pil_loader(loader):
            return loader, pil_decode
        tensor = torchvision_loader(loader)     # torchvision.io's decode_image/read_image: the same decode of bytes
        return loader, tensor  # else (None) a custom path loader: not two-stage

    @staticmethod
    def make_dataset(directory: str, class_to_idx: dict[str, int],
                     extensions: str | tuple[str, ...] | None = None,
                     is_valid_file: Callable[[str], bool] | None = None,
                     allow_empty: bool = False) -> list[tuple[str, int]]:
        """The ``(path, class_index)`` list, as torchvision's static method.
        Subclasses may override it; the default is never called by
        ``__init__``, which scans straight into numpy arrays."""
        if class_to_idx is None:
            raise ValueError("The class_to_idx parameter cannot be None.")
        return make_dataset(directory, class_to_idx, extensions, is_valid_file, allow_empty)

    def find_classes(self, directory: str | os.PathLike) -> tuple[list[str], dict[str, int]]:
        """Sorted class folder names and their indices; see :func:`find_classes`."""
        return find_classes(directory)


class _Unset:
    def __repr__(self) -> str:
        return "<IMG_EXTENSIONS unless is_valid_file is given>"


_UNSET: Any = _Unset()


class ImageFolder(DatasetFolder):
    """torchvision's ``ImageFolder``: images in ``root/<class>/**/<file>``,
    returned as ``(transform(rgb_pil_image), target_transform(class_index))``.

    Same positional arguments as torchvision's (``root, transform,
    target_transform, loader, is_valid_file, allow_empty``); ``extensions``
    (default ``IMG_EXTENSIONS``, or none when ``is_valid_file`` is given),
    ``decode`` and ``storage_options`` (for a URL root) are keyword-only.  With the default loader the dataset is
    two-stage: ``raw`` reads the file, ``prep`` decodes it with PIL
    (``pil_decode``) and applies the transforms.  See
    :class:`DatasetFolder` and the module docstring for ``loader``/``decode``.
    """

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None,
                 target_transform: Callable | None = None,
                 loader: Callable[[str], Any] | None = None,
                 is_valid_file: Callable[[str], bool] | None = None, allow_empty: bool = False,
                 *, extensions: str | tuple[str, ...] | None = _UNSET,
                 decode: Callable[[bytes], Any] | None = None, storage_options: dict | None = None):
        if extensions is _UNSET:
            extensions = IMG_EXTENSIONS if is_valid_file is None else None
        super().__init__(root, loader, extensions, transform=transform,
                         target_transform=target_transform, is_valid_file=is_valid_file,
                         allow_empty=allow_empty, decode=decode, storage_options=storage_options)

    def _default_decode(self) -> Callable[[bytes], Any]:
        return pil_decode


# --------------------------------------------------------------------------
# Adapter for torchvision-style instances
# --------------------------------------------------------------------------

class TwoStageFolder(_FolderBase):
    """A two-stage copy of a torchvision-style folder dataset; made by
    :func:`two_stage`.

    Holds the samples in numpy arrays and keeps no reference to the original
    dataset (whose Python lists forked workers would copy).  ``transform``,
    ``target_transform``, ``loader``, ``classes``, ``class_to_idx`` and
    ``root`` are taken from the original.
    """

    def __init__(self, dataset: Any, decode: Callable[[bytes], Any] | None = None):
        for name in ("samples", "loader"):
            if not hasattr(dataset, name):
                raise TypeError(
                    "two_stage expects a torchvision-style ImageFolder/DatasetFolder "
                    f"(with samples, loader, transform, target_transform), but {type(dataset).__name__} "
                    f"has no {name!r}")
        loader = dataset.loader
        _check_decode(decode)
        if decode is None and not _is_default_pil_loader(loader):
            decode = torchvision_loader(loader)     # torchvision.io's decode_image/read_image, of the bytes
        if decode is None:
            if not _is_default_pil_loader(loader):
                raise TypeError(
                    "decode should be a callable taking the file's bytes and returning the "
                    f"sample, because dataset.loader={loader!r} reads paths, but got decode=None")
            decode = pil_decode
        self._decode = decode
        self.loader = loader
        self.transform = getattr(dataset, "transform", None)
        self.target_transform = getattr(dataset, "target_transform", None)
        self.root = getattr(dataset, "root", None)
        self.extensions = getattr(dataset, "extensions", None)
        self.classes = list(getattr(dataset, "classes", []))
        self.class_to_idx = dict(getattr(dataset, "class_to_idx", {}))
        self._source = type(dataset).__name__
        root = self.root
        if isinstance(root, str):
            root = os.path.expanduser(root)
        self._set_samples(dataset.samples, os.fspath(root) if root is not None else None)

    def _repr_name(self) -> str:
        return f"{type(self).__name__}({self._source})"


def two_stage(dataset: Any, decode: Callable[[bytes], Any] | None = None) -> TwoStageFolder:
    """Make a torchvision-style ``ImageFolder``/``DatasetFolder`` two-stage.

    ``dataset`` needs ``samples`` (``(path, class_index)`` pairs), ``loader``,
    ``transform`` and ``target_transform``.  When its loader is torchvision's
    default (``default_loader`` or ``pil_loader``, or a function written as
    one: PIL's open, then ``convert("RGB")``) the bytes are decoded with PIL
    to RGB; for any other loader pass ``decode``, a
    callable taking the file's bytes and returning what ``loader(path)``
    returns.  Returns a new :class:`TwoStageFolder`; ``dataset`` is not
    modified.
    """
    return TwoStageFolder(dataset, decode)
