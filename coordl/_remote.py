"""Kept for the name docs/api.md gives: ``coordl._remote.RemoteStatusError``.
The remote-read policy lives in :mod:`coordl.storage.remote`."""
from .storage.remote import RemoteStatusError  # noqa: F401

__all__ = ["RemoteStatusError"]
