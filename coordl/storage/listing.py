"""Listing a folder of samples by torchvision's rules: class folders in
sorted order, files filtered by extension or ``is_valid_file``, walked in a
stable order (symlinked directories followed once), with sizes and mtimes
for the dataset's fingerprint.  :mod:`coordl.datasets` builds its datasets
on these and exports the public names (``find_classes``, ``make_dataset``,
``has_file_allowed_extension``, ``is_image_file``, ``IMG_EXTENSIONS``)."""
from __future__ import annotations

import os
from typing import Callable, Iterable

__all__ = ["IMG_EXTENSIONS", "find_classes", "make_dataset", "has_file_allowed_extension", "is_image_file"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


# --------------------------------------------------------------------------
# Scanning (torchvision's rules)
# --------------------------------------------------------------------------

def has_file_allowed_extension(filename: str, extensions: str | Iterable[str]) -> bool:
    """True when ``filename`` ends with one of ``extensions``, ignoring case
    (of both: torchvision lowers only the file name)."""
    ends = extensions.lower() if isinstance(extensions, str) else tuple(e.lower() for e in extensions)
    return filename.lower().endswith(ends)


def is_image_file(filename: str) -> bool:
    """True when ``filename`` has one of :data:`IMG_EXTENSIONS`."""
    return has_file_allowed_extension(filename, IMG_EXTENSIONS)


def find_classes(directory: str | os.PathLike) -> tuple[list[str], dict[str, int]]:
    """The sorted names of the subdirectories of ``directory`` and a mapping
    from each name to its index."""
    directory = os.fspath(directory)
    with os.scandir(directory) as it:
        classes = sorted(entry.name for entry in it if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
    return classes, {name: i for i, name in enumerate(classes)}


def _validity_check(extensions, is_valid_file) -> Callable[[str], bool]:
    if (extensions is None) == (is_valid_file is None):
        raise ValueError(
            "exactly one of extensions and is_valid_file must be given, but got "
            f"extensions={extensions!r} and is_valid_file={is_valid_file!r}"
        )
    if extensions is not None:
        ends = extensions.lower() if isinstance(extensions, str) else tuple(e.lower() for e in extensions)
        return lambda path: path.lower().endswith(ends)
    return is_valid_file


def _walk_sorted(top: str, rel_top: str) -> list[tuple[str, str, list[str]]]:
    """``(dirpath, reldir, filenames)`` for every directory under ``top``,
    ordered like ``sorted(os.walk(top, followlinks=True))``.

    Like ``os.walk`` it follows symbolic links to directories and skips
    directories it cannot list.  Unlike it, a link back to an ancestor
    directory is not followed again (os.walk would recurse until the path is
    too long).
    """
    out: list[tuple[str, str, list[str]]] = []

    def visit(path: str, rel: str, ancestors: frozenset) -> None:
        try:
            it = os.scandir(path)
        except OSError:
            return
        subdirs: list[tuple[str, tuple[int, int] | None]] = []
        files: list[str] = []
        with it:
            for entry in it:
                try:
                    is_dir = entry.is_dir()
                except OSError:
                    is_dir = False
                if not is_dir:
                    files.append(entry.name)
                    continue
                key = None
                try:
                    st = entry.stat()
                    key = (st.st_dev, st.st_ino)
                except OSError:
                    pass
                subdirs.append((entry.name, key))
        out.append((path, rel, files))
        for name, key in subdirs:
            if key is not None and key in ancestors:
                continue  # a link to an ancestor: a loop
            visit(os.path.join(path, name), os.path.join(rel, name),
                  ancestors | {key} if key is not None else ancestors)

    try:
        st = os.stat(top)
        start = frozenset({(st.st_dev, st.st_ino)})
    except OSError:
        start = frozenset()
    visit(top, rel_top, start)
    out.sort(key=lambda t: t[0])
    return out


class _Scan:
    """Result of a scan: parallel lists, turned into arrays by ``_Table``."""

    __slots__ = ("rel", "targets", "sizes", "mtimes")

    def __init__(self):
        self.rel: list[bytes] = []
        self.targets: list[int] = []
        self.sizes: list[int] = []
        self.mtimes: list[int] = []


def _scan(directory: str, class_to_idx: dict[str, int], extensions=None,
          is_valid_file=None, allow_empty: bool = False) -> _Scan:
    """The valid files of each class folder, in torchvision's order, with
    their paths relative to ``directory``, sizes and mtimes (ns)."""
    if not class_to_idx:
        raise ValueError("class_to_idx must have at least one entry to collect any samples.")
    valid = _validity_check(extensions, is_valid_file)
    scan = _Scan()
    found: set[str] = set()
    fsencode = os.fsencode
    for target_class in sorted(class_to_idx):
        class_index = class_to_idx[target_class]
        target_dir = os.path.join(directory, target_class)
        if not os.path.isdir(target_dir):
            continue
        for dirpath, reldir, fnames in _walk_sorted(target_dir, target_class):
            for fname in sorted(fnames):
                path = os.path.join(dirpath, fname)
                if not valid(path):
                    continue
                try:
                    st = os.stat(path)
                    size, mtime = st.st_size, st.st_mtime_ns
                except OSError:  # a dangling link: raw() will say so
                    size, mtime = -1, 0
                scan.rel.append(fsencode(os.path.join(reldir, fname)))
                scan.targets.append(class_index)
                scan.sizes.append(size)
                scan.mtimes.append(mtime)
                found.add(target_class)
    empty = set(class_to_idx) - found
    if empty and not allow_empty:
        msg = (f"Found no valid file for the classes {', '.join(sorted(empty))} "
               f"in {directory}.")
        if extensions is not None:
            exts = extensions if isinstance(extensions, str) else ", ".join(extensions)
            msg += f" Supported extensions are: {exts}"
        else:
            msg += " (no file passed is_valid_file)"
        raise FileNotFoundError(msg)
    return scan


def make_dataset(directory: str | os.PathLike, class_to_idx: dict[str, int] | None = None,
                 extensions: str | tuple[str, ...] | None = None,
                 is_valid_file: Callable[[str], bool] | None = None,
                 allow_empty: bool = False) -> list[tuple[str, int]]:
    """torchvision's ``make_dataset``: the list of ``(path, class_index)`` of
    the valid files under ``directory``.  (The datasets themselves never build
    this list; it is here for code that calls the function.)"""
    directory = os.path.expanduser(os.fspath(directory))
    if class_to_idx is None:
        _, class_to_idx = find_classes(directory)
    scan = _scan(directory, class_to_idx, extensions, is_valid_file, allow_empty)
    return [(os.path.join(directory, os.fsdecode(r)), t) for r, t in zip(scan.rel, scan.targets)]


def _stat_paths(paths: list[str]) -> tuple[list[int], list[int]]:
    sizes, mtimes = [], []
    for p in paths:
        try:
            st = os.stat(p)
            sizes.append(st.st_size)
            mtimes.append(st.st_mtime_ns)
        except OSError:
            sizes.append(-1)
            mtimes.append(0)
    return sizes, mtimes


def _split_prefix(root: str | None, paths: list[str]) -> tuple[str, list[str]]:
    """``(prefix, names)`` with ``os.path.join(prefix, name) == path`` for
    every path: names relative to ``root`` when all paths lie under it, else
    the paths themselves under an empty prefix."""
    if root:
        head = root if root.endswith(os.sep) else root + os.sep
        n = len(head)
        rel = []
        join = os.path.join
        for p in paths:
            if not p.startswith(head):
                break
            r = p[n:]
            if not r or join(root, r) != p:
                break
            rel.append(r)
        else:
            return root, rel
    return "", list(paths)
