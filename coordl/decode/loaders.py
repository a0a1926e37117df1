"""Path loaders and byte decoders for the folder datasets (:mod:`coordl.datasets`).

torchvision's ``loader`` is a function of a *path*; a two-stage dataset needs
a function of the file's *bytes* (``decode``).  Here are both halves and the
glue between them: :func:`read_bytes` (a whole local file in one read),
:func:`pil_decode` (bytes to an RGB PIL image, as torchvision's default
loader returns), the path loaders :func:`pil_loader` and
:func:`default_loader` built from the two, a path loader made from any
decoder (``_DecodingLoader``), and the checks :mod:`coordl.datasets` uses to
tell a default PIL loader and a valid ``decode``.  The public names are
exported by :mod:`coordl.datasets`; users import them from there.
"""
from __future__ import annotations

import io
import os
from typing import Any, Callable

from PIL import Image

_O_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
_CHUNK = 1 << 20
_DEFAULT_LOADER_NAMES = ("default_loader", "pil_loader")


def read_bytes(path: str, drop_cache: bool = False) -> bytes:
    """The whole content of the file at ``path``.

    One ``open``, one ``fstat`` and (normally) one ``read`` into a buffer of
    the file's size; no Python file object.  Raises ``FileNotFoundError``
    (whose message names the path) when the file is missing.  ``drop_cache``:
    then drop the file's pages from the OS page cache, on the same descriptor
    (the bytes are kept elsewhere, e.g. in coordl's node cache).
    """
    fd = os.open(path, _O_FLAGS)
    try:
        data = _read_all(fd)
        if drop_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return data
    finally:
        os.close(fd)


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    data = os.read(fd, size) if size > 0 else b""
    if size > 0 and len(data) == size:
        return data
    # Short read (huge file, network file system) or a size of 0 that may
    # not be true (pseudo files): read on until end of file.
    parts, total = [data], len(data)
    while True:
        chunk = os.read(fd, max(size - total, _CHUNK))
        if not chunk:
            break
        parts.append(chunk)
        total += len(chunk)
    return b"".join(parts)


def pil_decode(raw: bytes) -> Image.Image:
    """Decode image bytes with PIL and convert to RGB, fully.

    ``convert`` loads every pixel, so a truncated or corrupt file raises
    ``OSError`` here rather than later in a transform.
    """
    with Image.open(io.BytesIO(raw)) as img:
        return img.convert("RGB")


def _naming(path: str, decode: Callable[[bytes], Any], raw: bytes) -> Any:
    """``decode(raw)``; a file PIL cannot identify raises PIL's
    ``UnidentifiedImageError`` naming ``path``, as ``Image.open(path)`` does
    in torchvision's loader (decoding bytes, PIL names a BytesIO object)."""
    from PIL import UnidentifiedImageError

    try:
        return decode(raw)
    except UnidentifiedImageError as e:
        if str(path) in str(e):
            raise
        raise UnidentifiedImageError(f"cannot identify image file {str(path)!r}") from e


def pil_loader(path: str) -> Image.Image:
    """Read the image at ``path`` as RGB (a path loader, for torchvision code)."""
    return _naming(path, pil_decode, read_bytes(path))


def default_loader(path: str) -> Image.Image:
    """The default ``ImageFolder`` loader: :func:`pil_loader`."""
    return _naming(path, pil_decode, read_bytes(path))


def _identity(raw: bytes) -> bytes:
    return raw


class _DecodingLoader:
    """A path loader made from a bytes decoder: ``decode(read_bytes(path))``.
    A class rather than a closure so that the dataset still pickles."""

    def __init__(self, decode: Callable[[bytes], Any]):
        self.decode = decode

    def __call__(self, path: str) -> Any:
        return _naming(path, self.decode, read_bytes(path))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.decode!r})"


# The ways of writing torchvision's pil_loader seen in users' code ("open the file, decode it with PIL,
# convert it to RGB"): a user's path loader whose code, read instruction by instruction, is one of these
# (compiled here, by the same interpreter) with the same objects behind its module's names (the builtin
# open, PIL's Image module, whatever the module calls it) decodes as coordl's pil_loader does.
_RGB_LOADERS = (
    "def loader(path):\n    with open(path, 'rb') as f:\n        img = Image.open(f)\n"
    "        return img.convert('RGB')\n",
    "def loader(path):\n    with open(path, 'rb') as f:\n        with Image.open(f) as img:\n"
    "            return img.convert('RGB')\n",
    "def loader(path):\n    with open(path, 'rb') as f:\n        return Image.open(f).convert('RGB')\n",
    "def loader(path):\n    with open(path, 'rb') as f:\n        img = Image.open(f).convert('RGB')\n"
    "    return img\n",
    "def loader(path):\n    with open(path, 'rb') as f:\n        img = Image.open(f).convert('RGB')\n"
    "        return img\n",
    "def loader(path):\n    return Image.open(path).convert('RGB')\n",
)
_rgb_shapes: list | None = None


def _rgb_loader_shapes() -> list:
    global _rgb_shapes
    if _rgb_shapes is None:
        import builtins

        from ..base.foreign import instructions

        shapes = []
        for src in _RGB_LOADERS:
            scope = {"Image": Image, "__builtins__": builtins}
            exec(compile(src, "<coordl's reading of a PIL loader>", "exec"), scope)   # noqa: S102 - our source
            shapes.append(instructions(scope["loader"], resolve=True))
        _rgb_shapes = shapes
    return _rgb_shapes


def _is_default_pil_loader(loader: Any) -> bool:
    """Whether the path loader ``loader`` decodes a file as torchvision's
    ``pil_loader`` does (PIL's decode, converted to RGB): coordl's own
    ``pil_loader``/``default_loader``, torchvision's, or a function of the
    user's whose code is one of the ways of writing it (``_RGB_LOADERS``).
    A function named so that does anything else (a gray ``convert("L")``)
    is not."""
    if loader is pil_loader or loader is default_loader:
        return True
    if getattr(loader, "__module__", None) == "torchvision.datasets.folder":
        return getattr(loader, "__name__", None) in _DEFAULT_LOADER_NAMES
    from ..base.foreign import instructions, plain_function

    if not plain_function(loader, 1):
        return False
    try:
        return instructions(loader, resolve=True) in _rgb_loader_shapes()
    except (ValueError, TypeError):    # code this reading does not know: not recognized
        return False


def _check_decode(decode: Any) -> None:
    if decode is not None and not callable(decode):
        raise TypeError(
            "decode should be a callable taking the file's bytes and returning "
            f"the sample, but got decode={decode!r}"
        )
