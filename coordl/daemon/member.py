"""The job's side of coordinated prep (``DataLoader(..., share=True)``).

:class:`ShareMode` is ``PipelineMode`` with one difference: a pass first
tries the node daemon.  If the daemon runs (or can be started) and the
dataset can be sent to it, the pass is a :class:`SharedIter`, which takes
samples the daemon prepared into the group's staging memory and assembles
this job's own batches from them: a batch whose samples sit in consecutive
slots, pinned for this job, is a view of staging through a private
copy-on-write mapping (no copy; :meth:`SharedIter._view`), any other one
gets one copy per sample into the batch.
Samples the stream cannot give (the first one, which fixes the layout;
failures; anything after a detach or after the daemon died) are prepared
here, exactly as the pipeline would, so a job gets bit-identical batches
with or without the daemon: sharing changes who computes, never what.

Fallbacks, all at the exact sample where the stream stopped:

* ``detach`` from the daemon (this job fell further behind than staging
  holds): the rest of the pass runs on the job's own pipeline (node cache
  still used); the next pass rejoins.
* EOF on the socket (the daemon died), or no answer to a ping within
  ``COORDL_DAEMON_TIMEOUT`` seconds (default 10: a stopped or hung daemon;
  one that is alive but busy serving others answers pings at once, so it
  is never taken for dead), or no sample delivered for
  ``shared_iter._STALL`` seconds
  while it answers: the same, and the next pass connects again, starting
  a new daemon if none runs.  A daemon found hung is not asked again for
  ``_RETRY_HUNG`` timeouts, unless its socket changed.  A pass that lost
  its daemon looks once per timeout for one started in its place (a new
  socket file) and takes the rest of the pass from it
  (:meth:`SharedIter._rejoin`): a restarted daemon is found within one
  timeout.
* The dataset cannot be pickled, its code cannot be identified
  (:mod:`codeid`: a class from ``__main__``, a module without a source),
  or its samples have no fixed layout: one warning, and this loader never
  asks again.  The daemon ends the group for good (with one warning) when
  its worker runs other code than this job or samples vary in shape, and
  for now (warned once per cause; the next pass tries again) when no
  worker could set the group up.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import pickle
import sys
import time
import warnings
import weakref


from ..base import reaper as _reaper
from ..pipeline import collate as _collate
from ..pipeline.engine import _make_reader, pass_steps
from ..pipeline.modes import PipelineMode
from ..pipeline.prep import SKIP, prep_sample
from ..errors import SampleError
from ..stats import BatchStats
from . import ipc
from .codeid import Unidentified, identity_of
from .worker import describe_layout, layout_digest, slot_stride, staging_bases
from .shared_iter import SharedIter, _Link, _timeout, _write_all

__all__ = ["ShareMode", "SharedIter", "share_requested"]

_RETRY_HUNG = 6  # timeouts before a daemon found hung (same socket) is tried again


def share_requested(share) -> bool:
    """``share`` as given, or ``COORDL_SHARE=1`` when it is None."""
    if share is None:
        return os.environ.get("COORDL_SHARE", "") not in ("", "0", "false", "no")
    if not isinstance(share, bool):
        raise ValueError(f"share should be a bool or None, but got share={share!r}")
    return share


def _digest(blob: bytes) -> str:
    return hashlib.blake2b(blob, digest_size=20).hexdigest()


def _job_name() -> str:
    name = os.environ.get("COORDL_JOB_NAME")
    if name:
        return name[:200]
    argv = [os.path.basename(sys.argv[0])] + sys.argv[1:] if sys.argv and sys.argv[0] else ["python"]
    return " ".join(argv)[:200]


class ShareMode(PipelineMode):
    """coordl's pipeline, with samples from the node daemon when it can."""

    name = "pipeline+share"

    def __init__(self) -> None:
        super().__init__()
        self.link: _Link | None = None
        self.off: str | None = None       # why this loader does not share (permanently)
        self.layout1 = None               # one-sample layout (from the first sample prepared here)
        self.shared = 0                   # samples taken from the stream, over the loader's life
        self.self_prepared = 0
        self._reader = None
        self._first: tuple | None = None  # (G, sample) prepared here to learn the layout
        self.told: set[str] = set()       # reasons of the daemon's temporary failures already warned about
        self._hung: tuple | None = None   # (socket id, when) of a daemon that did not answer
        self._last_box: list | None = None   # the latest SharedIter's pass (its _PassState, in a box)
        self._joined: str | None = None   # the digest of the pickled dataset of the last join (and layout1)
        self._started = None   # with persistent workers: the dataset they prepare, as they started (a copy)

    def start_pass(self, loader, epoch: int, start: int, skip: frozenset):
        self._stop_pin_thread()
        self._end_last_pass()
        it = None
        if self.off is None:
            it = self._shared_iter(loader, epoch, start, skip)
        if it is None:
            return super().start_pass(loader, epoch, start, skip)
        return self._pin(loader, it)

    def _end_last_pass(self) -> None:
        """A new pass begins while the last one was left unfinished (its
        iterator still referenced): that one ends now, giving back what the
        daemon pinned for its read-ahead (the batches it handed out keep
        theirs), and takes nothing more from the stream."""
        box, self._last_box = self._last_box, None
        st = box[0] if box is not None else None
        if st is None or st.ended:
            return
        try:
            st.end()
        except (OSError, ValueError):
            self.drop_link()     # the daemon does not read: the next pass connects again

    def adopt_seed(self, loader, seed: int) -> None:
        super().adopt_seed(loader, seed)
        self.drop_link()            # the group is keyed by the seed
        self.layout1 = None
        self._started = None        # the workers start again, with the dataset as it is then

    def pass_dataset(self, loader):
        """The dataset this pass prepares, here and in the daemon: as it is
        now (a transform changed in place or assigned since the last pass is
        this one's); with persistent workers, the copy made when they
        started, as torch's persistent workers keep the dataset they were
        started with.  Shared or not, the same samples."""
        if not (loader.persistent_workers and loader.num_workers):
            return loader.dataset
        pool = self.pool
        if pool is not None and not pool.closed:
            return self.pool_split.dataset
        if self._started is None:
            try:
                self._started = pickle.loads(pickle.dumps(loader.dataset, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception:
                return loader.dataset   # it cannot be sent to the daemon: the workers, forked, copy it
        return self._started

    def _new_split(self, loader):
        if loader.persistent_workers and loader.num_workers:
            return loader._split_for_pass(dataset=self.pass_dataset(loader))
        return super()._new_split(loader)

    def drop_link(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    # ------------------------------------------------------------ helpers
    def count(self, st: BatchStats) -> None:
        """Add a batch's samples to the totals this loader reports to the daemon."""
        self.shared += st.shared
        self.self_prepared += st.samples - st.shared

    def reader(self, loader):
        if self._reader is None:
            self._reader = _make_reader(self.pass_dataset(loader), loader._cache, loader._peers)[0]
        return self._reader

    def prep_here(self, loader, epoch: int, i: int, st: BatchStats):
        """Sample ``i`` of ``epoch`` read and prepared in this process."""
        t0 = time.perf_counter()
        try:
            data, src = self.reader(loader)(i)
            err = None
        except Exception as e:
            data, src, err = None, None, e
        st.fetch_s += time.perf_counter() - t0
        if err is None:
            st.record_read(src, len(data))
        return prep_sample(self.pass_dataset(loader), loader.seed, epoch, i, data, err, st, loader.on_error)

    def _shared_iter(self, loader, epoch: int, start: int, skip: frozenset):
        plan = loader.plan
        steps = pass_steps(plan.num_batches, start, skip)
        if not steps:
            return None
        if self.link is not None and not self.link.alive:
            self.drop_link()
        pickled = self._blob(loader)
        if pickled is None:
            return None
        if self.link is not None and pickled[1] != self._joined:
            # the dataset changed since the group was joined (a transform changed in place or assigned, as
            # progressive resizing does): the group of the dataset as it is now, with its own layout
            self.drop_link()
        if self.link is None and self._hung is not None:
            from . import server

            if (server.socket_id() == self._hung[0]
                    and time.monotonic() - self._hung[1] < _RETRY_HUNG * _timeout()):
                return None      # the same daemon did not answer a moment ago: not another timeout now
            self._hung = None
        if self.link is None and not self._connect(loader, epoch, steps[0], pickled):
            return None
        try:
            return SharedIter(self, loader, epoch, steps)
        except (OSError, ConnectionError) as e:
            self.drop_link()
            warnings.warn(f"coordl: share=True: lost the node daemon ({e}); this pass prepares in the job",
                          stacklevel=4)
            return None

    def _blob(self, loader) -> tuple[bytes, str] | None:
        """The pass's dataset pickled for the daemon, and its digest (hashed
        once a pass: an ImageNet-sized table pickles to about 70 MB), or None
        (with one warning, and this loader never asks again) when it cannot be."""
        try:
            blob = pickle.dumps(self.pass_dataset(loader), protocol=pickle.HIGHEST_PROTOCOL)
            return blob, _digest(blob)
        except Exception as e:
            self.off = (f"the dataset cannot be pickled for the daemon ({type(e).__name__}: {e}): define "
                        "every function it holds (its transform's steps included) with def at module level "
                        "(or as a class with __call__), not as a lambda or inside another function")
            warnings.warn(f"coordl: share=True: {self.off}; this loader prepares in the job", stacklevel=5)
            return None

    def _connect(self, loader, epoch: int, first_step: int, pickled: tuple[bytes, str] | None = None) -> bool:
        from . import server

        plan = loader.plan
        ds = self.pass_dataset(loader)
        if pickled is None:
            pickled = self._blob(loader)
            if pickled is None:
                return False
        blob, digest_of_blob = pickled
        if digest_of_blob != self._joined:   # another dataset (or transform) than the last join's
            self.layout1, self._first, self._reader = None, None, None
            self._joined = digest_of_blob
        if self.layout1 is None:
            bs = plan.batch_size or 1
            pos = first_step * bs if plan.batch_size else first_step
            i = int(plan.indices(epoch)[pos])
            st = BatchStats()
            try:
                sample = self.prep_here(loader, epoch, i, st)
            except SampleError:
                return False     # the pass raises it where it belongs
            if sample is SKIP:
                return False
            layout = _collate.layout_of(sample, 1)
            if layout is None:
                self.off = (f"samples of {type(ds).__name__} have no fixed layout of tensors, arrays "
                            "and numbers, so they cannot be staged")
                warnings.warn(f"coordl: share=True: {self.off}; this loader prepares in the job", stacklevel=5)
                return False
            self.layout1 = layout
            self._first = (epoch * plan.samples_per_epoch + pos, sample, st)
        try:   # the code the dataset and its transforms run: a group runs one code
            code, code_desc = identity_of(ds)
        except Exception as e:
            if not isinstance(e, Unidentified):
                e = f"{type(e).__name__}: {e}"
            self.off = f"cannot tell which code the dataset runs ({e})"
            warnings.warn(f"coordl: share=True: {self.off}; this loader prepares in the job", stacklevel=5)
            return False
        digest = layout_digest(self.layout1)
        fp = ds.fingerprint() if callable(getattr(ds, "fingerprint", None)) else ""
        cache = loader._cache_spec()
        from ..cache import shm_root

        shm_dir = os.path.abspath(shm_root())
        if cache is not None:
            cache["shm_dir"] = shm_dir
        key = hashlib.blake2b(json.dumps([
            code, fp, self._joined, plan.seed,
            plan.shuffle, plan.rank, plan.world_size, plan.num_samples,
            plan.drop_last if plan.world_size > 1 else False, digest, shm_dir]).encode(),
            digest_size=20).hexdigest()
        stride = slot_stride(self.layout1)
        msg = {"op": "join", "key": key, "name": _job_name(), "num_workers": loader.num_workers,
               "seed": plan.seed, "digest": digest, "stride": stride,
               "samples_per_epoch": plan.samples_per_epoch, "dataset": repr(ds)[:200],
               "plan": {"num_samples": plan.num_samples, "shuffle": plan.shuffle, "rank": plan.rank,
                        "world_size": plan.world_size, "drop_last": plan.drop_last},
               "sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path], "cache": cache,
               "code": code, "code_desc": code_desc, "shm_dir": shm_dir,
               "layout": describe_layout(self.layout1)}
        if loader._peers is not None:   # the daemon's workers read through the other nodes' caches too
            loader._peers.start(epoch)
            msg["peers"] = loader._peers.to_json()
        fd = os.memfd_create("coordl-dataset", os.MFD_CLOEXEC)
        conn = None
        try:
            os.fchmod(fd, 0o600)
            _write_all(fd, blob)
            try:
                t = _timeout()
                server.start(answer=t)
                conn = ipc.connect(server.socket_path(), timeout=t)
                reply, fds = conn.ask(msg, fds=[fd], timeout=t)
            except (OSError, ConnectionError, TimeoutError, RuntimeError) as e:
                if conn is not None:
                    conn.close()
                if isinstance(e, TimeoutError):
                    self._hung = (server.socket_id(), time.monotonic())
                warnings.warn(f"coordl: share=True: cannot reach the node daemon ({e}); this pass "
                              "prepares in the job and the next one tries again", stacklevel=5)
                return False
            if reply.get("op") != "joined" or len(fds) != 1:
                for f in fds:
                    os.close(f)
                conn.close()
                warnings.warn(f"coordl: share=True: the node daemon refused this job: "
                              f"{reply.get('why', reply)}; this pass prepares in the job", stacklevel=5)
                return False
            sfd = fds[0]
            try:
                st = os.fstat(sfd)
                if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                    raise ipc.PeerRefused(f"coordl: refusing staging memory of uid {st.st_uid}, "
                                          f"mode {st.st_mode & 0o777:o}")
                # read here for the headers and copies (writable only so torch can view it for a copy;
                # this side never writes); batches view it through private mappings
                mm = mmap.mmap(sfd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                os.set_inheritable(sfd, False)
            except BaseException:
                os.close(sfd)
                raise
            try:
                nslots = int(reply["slots"])
                bases = staging_bases(self.layout1, nslots, st.st_size)
            except (KeyError, TypeError, ValueError) as e:
                mm.close()
                os.close(sfd)
                conn.close()
                warnings.warn(f"coordl: share=True: the node daemon's staging does not fit this job ({e}); "
                              "this pass prepares in the job", stacklevel=5)
                return False
            link = self.link = _Link(conn, mm, int(reply["stride"]), int(reply["gid"]), nslots, bases, sfd)
            _reaper.start()
            # a collected loader leaves its group: the reaper closes the socket (finalizers only enqueue)
            weakref.finalize(self, _reaper.later, link.close)
            return True
        finally:
            os.close(fd)
