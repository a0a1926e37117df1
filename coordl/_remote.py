"""The name ``coordl._remote.RemoteStatusError`` (docs/guide/storage.md gives it).
The remote-read policy lives in :mod:`coordl.storage.remote`."""
from .storage.remote import RemoteStatusError  # noqa: F401

__all__ = ["RemoteStatusError"]
