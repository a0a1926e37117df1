"""The node cache: raw sample bytes in POSIX shared memory, one segment per
dataset per user per node, admitted under CoorDL's MinIO policy.

Public (``from coordl.cache import ...``; also what ``coordl cache list/clear``
and the peers' servers use): :class:`NodeCache`, :class:`CacheInfo`,
:class:`CacheSecurityError`, :func:`list_caches`, :func:`clear_caches`,
:func:`reclaim_stale`, :func:`shm_root`, :func:`user_dir`,
:func:`shm_free_bytes`, :func:`node_id`, :data:`VALIDATE_READS`.

The modules (private):

- ``node``: :class:`NodeCache` (attach, get, put, hold, detach, fork);
- ``signals``: the SIGTERM exit path that lets a killed process detach.
"""
from .node import (  # noqa: F401
    FILL, LOCK_NAME, PREFIX, READY, VALIDATE_READS, CacheInfo, CacheSecurityError, NodeCache, clear_caches,
    list_caches, mark_orphaned, node_id, reclaim_stale, shm_free_bytes, shm_root, user_dir,
)

__all__ = ["NodeCache", "CacheInfo", "CacheSecurityError", "list_caches", "clear_caches",
           "reclaim_stale", "shm_root", "user_dir", "shm_free_bytes", "node_id", "VALIDATE_READS"]
