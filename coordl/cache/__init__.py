"""The node cache: raw sample bytes in POSIX shared memory, one segment per
dataset per user per node, admitted under CoorDL's MinIO policy.

Public (``from coordl.cache import ...``, as when this was one module; also
what ``coordl cache ls/clear``, the daemon and the peers' servers use):
:class:`NodeCache`, :class:`CacheInfo`, :class:`CacheSecurityError`,
:func:`list_caches`, :func:`clear_caches`, :func:`reclaim_stale`,
:func:`shm_root`, :func:`user_dir`, :func:`shm_free_bytes`, :func:`node_id`,
:data:`VALIDATE_READS`.

The modules (private), each importing only those above it:

- ``directory``: this user's directory in /dev/shm, checked on every use,
  and the directory lock (re-entrant, reset in a forked child);
- ``segment``: the segment file format (header, index, arena), checked
  opening and mapping, the admission locks, creating one (with the advice
  when it does not fit);
- ``sweep``: the keep-warm sweep of idle segments, ``list_caches``,
  ``clear_caches``;
- ``node``: :class:`NodeCache` (attach or adopt, get, put, hold, detach,
  fork and exit);
- ``signals``: the SIGTERM exit path that lets a killed process detach.
"""
from .directory import LOCK_NAME, CacheSecurityError, node_id, shm_free_bytes, shm_root, user_dir  # noqa: F401
from .node import VALIDATE_READS, NodeCache, mark_orphaned  # noqa: F401
from .segment import FILL, PREFIX, READY, CacheInfo  # noqa: F401
from .sweep import clear_caches, list_caches, reclaim_stale  # noqa: F401

__all__ = ["NodeCache", "CacheInfo", "CacheSecurityError", "list_caches", "clear_caches",
           "reclaim_stale", "shm_root", "user_dir", "shm_free_bytes", "node_id", "VALIDATE_READS"]
