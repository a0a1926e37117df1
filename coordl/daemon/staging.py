"""What one sharing group holds in the kernel: the pickled dataset (an fd
the daemon's workers load it from) and the staging memory (a memfd, 0600,
mapped here and passed by fd to the workers that write prepared samples and
the jobs that read them).  Its lifetime is the group's: ``close()`` when the
group ends releases both.

It sits below the hub and the worker pools, which both act on it, so neither
has to import the other for it."""
from __future__ import annotations

import mmap
import os

from .groups import Group

__all__ = ["GroupRes"]


class GroupRes:
    """The kernel objects of one group: the dataset pickle and the staging memfd."""

    def __init__(self, group: Group, join: dict, dataset_fd: int, stride: int) -> None:
        self.group = group
        self.join = join
        self.dataset_fd = dataset_fd
        self.stride = stride
        self.staging_fd = os.memfd_create(f"coordl-staging-{group.gid}", os.MFD_CLOEXEC)
        try:
            os.fchmod(self.staging_fd, 0o600)
            size = group.nslots * stride
            os.ftruncate(self.staging_fd, size)
            self.mm = mmap.mmap(self.staging_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:   # a join that fails here leaves nothing behind (the caller closes dataset_fd)
            os.close(self.staging_fd)
            raise
        self.pool = None             # the worker pool (pool.py) that prepares its samples, once placed
        self.broken: str | None = None
        self.permanent = False       # broken for good (code or sample shapes), else retried at the next pass
        self.ready: set = set()      # workers that set the group up
        self.pending: set = set()    # workers it was sent to, not answered yet
        self.failures = 0            # setup failures since the group last worked (or was retried)
        self.broken_at = -1          # the latest epoch of a member when it broke: retried after it
        self.retries: dict[int, int] = {}    # G -> times a worker died or hung with it
        self.lost_at: float | None = None    # when its last ready worker went (none ready since)

    def close(self) -> None:
        self.mm.close()
        os.close(self.staging_fd)
        os.close(self.dataset_fd)
