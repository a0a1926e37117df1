"""Where sample bytes come from when they are not cached: local files or any
fsspec URL, with obstore on the hot path for http(s), s3, gs and Azure.

Public (``from coordl.storage import ...``, as when this was one module):
:func:`is_url`, :class:`FsspecStore`; and :class:`RemoteStatusError`, the
error a remote read raises for a 5xx/429 after its retries.

The modules (private):

- ``fsspec_store``: :class:`FsspecStore` (listing any fsspec URL; reading
  what obstore can't);
- ``obstore_store``: the obstore reader and its error mapping;
- ``remote``: per-host concurrency, retries and deadlines, and the words of
  remote errors, shared by both readers.
- ``listing``: a local folder of samples listed by torchvision's rules
  (class folders, extensions, a stable walk, sizes and mtimes); the names
  :mod:`coordl.datasets` exports from it are public there;
- ``table``: the sample table a folder dataset is (paths, targets, sizes
  and mtimes in numpy; ``samples``, ``targets``, ``fingerprint``).
"""
from .fsspec_store import FsspecStore, is_url, refused  # noqa: F401
from .remote import RemoteStatusError  # noqa: F401

__all__ = ["is_url", "FsspecStore", "RemoteStatusError"]
