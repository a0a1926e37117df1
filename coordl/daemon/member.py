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
  is never taken for dead), or no sample delivered for ``_STALL`` seconds
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

import collections
import hashlib
import json
import mmap
import os
import pickle
import selectors
import sys
import threading
import time
import warnings
import weakref

import numpy as np
import torch

from ..base import reaper as _reaper
from ..pipeline import collate as _collate
from ..pipeline.engine import _Builder, _make_reader, finish, pass_steps, place
from ..pipeline.modes import PipelineMode
from ..pipeline.prep import SKIP, prep_sample
from ..pipeline.slots import LocalSlots
from ..pipeline.torch_path import Envelope
from ..errors import SampleError
from ..stats import BatchStats
from . import ipc
from .codeid import Unidentified, identity_of
from .worker import HDR, HEADER, MARK, describe_layout, layout_digest, slot_stride, staging_bases

__all__ = ["ShareMode", "SharedIter", "share_requested"]

_STALL = 60.0   # seconds without a sample while the daemon answers pings: give up on it
_RETRY_HUNG = 6  # timeouts before a daemon found hung (same socket) is tried again


def _timeout() -> float:
    from . import server

    return server.answer_timeout()


def share_requested(share) -> bool:
    """``share`` as given, or ``COORDL_SHARE=1`` when it is None."""
    if share is None:
        return os.environ.get("COORDL_SHARE", "") not in ("", "0", "false", "no")
    if not isinstance(share, bool):
        raise ValueError(f"share should be a bool or None, but got share={share!r}")
    return share


def _job_name() -> str:
    name = os.environ.get("COORDL_JOB_NAME")
    if name:
        return name[:200]
    argv = [os.path.basename(sys.argv[0])] + sys.argv[1:] if sys.argv and sys.argv[0] else ["python"]
    return " ".join(argv)[:200]


class _Link:
    """One loader's connection to the daemon and the group's staging memory.

    Batches handed out as views of staging (zero-copy) pin their slots at
    the daemon until they are released; the daemon also drops every pin of
    a connection when it closes.  So while views live the connection stays
    open (:meth:`close` defers to the last view): a slot a batch views is
    never reused under it."""

    def __init__(self, conn: ipc.Conn, mm: mmap.mmap, stride: int, gid: int, nslots: int, bases,
                 fd: int) -> None:
        self.conn, self.mm, self.stride, self.gid = conn, mm, stride, gid
        self.nslots, self.bases = nslots, bases
        self.fd = fd                           # the staging memfd: batches map their runs of it privately
        self.alive = True
        self.closing = False
        self.views = 0                         # batches that view staging, alive
        self.viewed = 0                        # slots they view
        self.freed: collections.deque = collections.deque()   # positions of views gone, to release
        self._lock = threading.Lock()
        from . import server

        self.sid = server.socket_id()   # the daemon's socket file: a daemon started in its place has another

    def viewing(self, n: int) -> None:
        with self._lock:
            self.views += 1
            self.viewed += n

    def view_gone(self, gs: list) -> None:
        """A batch viewing staging was collected (run by the reaper thread):
        its slots are released with the next message, or by closing."""
        with self._lock:
            self.views -= 1
            self.viewed -= len(gs)
            last = self.views == 0 and self.closing
            if not last:
                self.freed.extend(gs)
        if last:
            self._close_now()

    def take_freed(self) -> list:
        out = []
        while True:
            try:
                out.append(self.freed.popleft())
            except IndexError:
                return out

    def close(self) -> None:
        self.alive = False
        with self._lock:
            if self.views:   # batches still view staging: closing would free their slots at the daemon
                self.closing = True
                return
        self._close_now()

    def _close_now(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.mm.close()
        except BufferError:
            pass  # a batch still views it; the mapping goes with the last view


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

    def start_pass(self, loader, epoch: int, start: int, skip: frozenset):
        self._stop_pin_thread()
        it = None
        if self.off is None:
            it = self._shared_iter(loader, epoch, start, skip)
        if it is None:
            return super().start_pass(loader, epoch, start, skip)
        return self._pin(loader, it)

    def adopt_seed(self, loader, seed: int) -> None:
        super().adopt_seed(loader, seed)
        self.drop_link()            # the group is keyed by the seed
        self.layout1 = None

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
            self._reader = _make_reader(loader.dataset, loader._cache, loader._peers)[0]
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
        return prep_sample(loader.dataset, loader.seed, epoch, i, data, err, st, loader.on_error)

    def _shared_iter(self, loader, epoch: int, start: int, skip: frozenset):
        plan = loader.plan
        steps = pass_steps(plan.num_batches, start, skip)
        if not steps:
            return None
        if self.link is not None and not self.link.alive:
            self.drop_link()
        if self.link is None and self._hung is not None:
            from . import server

            if (server.socket_id() == self._hung[0]
                    and time.monotonic() - self._hung[1] < _RETRY_HUNG * _timeout()):
                return None      # the same daemon did not answer a moment ago: not another timeout now
            self._hung = None
        if self.link is None and not self._connect(loader, epoch, steps[0]):
            return None
        try:
            return SharedIter(self, loader, epoch, steps)
        except (OSError, ConnectionError) as e:
            self.drop_link()
            warnings.warn(f"coordl: share=True: lost the node daemon ({e}); this pass prepares in the job",
                          stacklevel=4)
            return None

    def _connect(self, loader, epoch: int, first_step: int) -> bool:
        from . import server

        plan = loader.plan
        ds = loader.dataset
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
        try:
            blob = pickle.dumps(ds, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            self.off = f"the dataset cannot be pickled for the daemon ({type(e).__name__}: {e})"
            warnings.warn(f"coordl: share=True: {self.off}; this loader prepares in the job", stacklevel=5)
            return False
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
            code, fp, hashlib.blake2b(blob, digest_size=20).hexdigest(), plan.seed,
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
                conn.send(msg, fds=[fd], timeout=t)
                reply, fds = conn.recv(timeout=t)
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


def _write_all(fd: int, data: bytes) -> None:
    os.lseek(fd, 0, os.SEEK_SET)
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class SharedIter:
    """One pass that takes prepared samples from the daemon's stream."""

    def __init__(self, mode: ShareMode, loader, epoch: int, steps: list[int]) -> None:
        self.mode, self.loader, self.epoch = mode, loader, epoch
        plan = loader.plan
        self.plan = plan
        self.n = plan.samples_per_epoch
        self.base = epoch * self.n
        self.order = plan.indices(epoch)
        bs = plan.batch_size
        self.steps = steps
        self.rows = [list(range(k * bs, min((k + 1) * bs, self.n))) if bs else [k] for k in steps]
        self.flat = [self.base + p for r in self.rows for p in r]
        self.idx = 0          # next step (index into steps)
        self.cursor = 0       # index into flat of the next batch's first position
        self.asked = 0        # flat[:asked] were asked for
        self.got: dict[int, list] = {}
        self.release: list[int] = []
        self.pins: list = []      # [lo, hi) ranges the daemon pinned for this job (latest last)
        self._viewed: list = []   # positions the batch just built views (released when it dies)
        self.local = None     # the job's own pipeline, after a detach
        self._lost_sid = None  # the socket (device, inode) of a daemon this pass lost
        self._looked = 0.0     # when it last looked for a daemon started in that one's place
        self._tries: dict = {}   # socket id -> failed joins of a daemon found in that one's place
        self.window = max(32, min(1024, 2 * (bs or 1) * max(1, loader.prefetch_factor or 2) // 2))
        link = mode.link
        self.window = min(self.window, max(4, link.mm.size() // link.stride // 4))
        self.layout1 = mode.layout1
        self.in_place = _collate.is_default_collate(loader.collate_fn) and bs is not None
        self._send({"op": "pass", "epoch": epoch, "start": self.flat[0], "end": self.base + self.n})
        self.attached = True

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self.plan.num_batches

    def worker_processes(self) -> list:
        return self.local.worker_processes() if self.local is not None else []

    def shutdown_workers(self) -> None:
        if self.local is not None:
            self.local.shutdown_workers()
        self._leave()

    # ------------------------------------------------------------ link
    def _send(self, msg: dict) -> None:
        link = self.mode.link
        if link is None or not link.alive:
            self.attached = False
            return
        try:
            link.conn.send(msg, timeout=10.0)
        except (OSError, ValueError):
            self._lost("the node daemon closed the connection")

    def _lost(self, why: str, hung: bool = False) -> None:
        from . import server

        link = self.mode.link
        self._lost_sid = (link.sid if link is not None else None) or server.socket_id() or (0, 0, 0)
        self._looked = time.monotonic()
        if hung:
            self.mode._hung = (self._lost_sid, time.monotonic())
        if self.mode.link is not None:
            warnings.warn(f"coordl: share=True: {why}; this job prepares its own samples from here "
                          "(nothing lost or repeated) and reconnects at its next epoch, or as soon as "
                          "a new daemon runs", stacklevel=4)
            self.mode.drop_link()
        self.attached = False

    def _leave(self, complete: bool = False) -> None:
        """Tell the daemon this pass is over (``complete``: it ran to its end,
        and the next epoch will likely follow)."""
        if self.attached:
            self._send({"op": "end", "complete": complete, "shared": self.mode.shared,
                        "self": self.mode.self_prepared, "release": self._unused()})
            self.attached = False

    def _unused(self) -> list:
        """What to release when the pass stops taking from the stream: what
        was released already, what views gave back, and what it was given
        and will not use (pinned items stay pinned until released)."""
        link = self.mode.link
        out = self.release + list(self.got) + (link.take_freed() if link is not None else [])
        self.release = []
        self.got.clear()
        return out

    def _receive(self, block: bool) -> None:
        """Take in what the daemon sent; wait (with liveness checks) when ``block``."""
        link = self.mode.link
        if link is None:
            self.attached = False
            return
        t = _timeout()
        ping_every = max(0.05, t / 4)
        start = heard = pinged = time.monotonic()
        poller = selectors.DefaultSelector()
        poller.register(link.conn.sock, selectors.EVENT_READ)
        try:
            while True:
                r = poller.select(min(ping_every, 1.0) if block else 0)
                now = time.monotonic()
                if not r:
                    if not block:
                        return
                    if now - heard >= t:     # it did not even answer a ping: stopped or hung
                        self._lost(f"the node daemon (pid {link.conn.peer_pid}) did not answer for {t:g} s "
                                   "(COORDL_DAEMON_TIMEOUT)", hung=True)
                        return
                    if now - start >= _STALL:  # it answers, but our samples do not come
                        self._lost(f"the node daemon (pid {link.conn.peer_pid}) delivered nothing for "
                                   f"{_STALL:g} s")
                        return
                    if now - max(heard, pinged) >= ping_every:
                        pinged = now          # liveness by progress: are you there, busy with others?
                        self._send({"op": "ping"})
                        if not self.attached:
                            return
                    continue
                try:
                    msg, fds = link.conn.recv(timeout=t)
                except (ConnectionError, TimeoutError, OSError) as e:
                    self._lost(f"lost the node daemon (pid {link.conn.peer_pid}): {e}",
                               hung=isinstance(e, TimeoutError))
                    return
                heard = time.monotonic()
                for fd in fds:
                    os.close(fd)
                op = msg.get("op")
                if op == "pong":
                    continue
                break
        finally:
            poller.close()
        if op == "ready":
            for item in msg["items"]:
                self.got[int(item[0])] = item
            if msg.get("pinned"):
                self.pins = self.pins[-3:] + [(int(msg["pinned"][0]), int(msg["pinned"][1]))]
        elif op == "detach":
            why = msg.get("why", "")
            self._send({"op": "end", "shared": self.mode.shared, "self": self.mode.self_prepared,
                        "release": self._unused()})
            self.attached = False
            if msg.get("permanent"):   # a detach for being slow is normal: stats() counts it
                self.mode.off = why
                self.mode.drop_link()
                warnings.warn(f"coordl: share=True: {why}; this loader prepares its own samples from here "
                              "on (nothing lost or repeated)", stacklevel=4)
            elif msg.get("warn") and why not in self.mode.told:   # the group failed for now: once per cause
                self.mode.told.add(why)
                warnings.warn(f"coordl: share=True: {why} (nothing lost or repeated)", stacklevel=4)
            return
        return

    # ------------------------------------------------------------ batches
    def __next__(self) -> Envelope:
        if self.local is not None and not self._rejoin():
            env = next(self.local)
            self.idx += 1
            return env
        if self.idx >= len(self.steps):
            self._leave(complete=True)
            raise StopIteration
        k, rows = self.steps[self.idx], self.rows[self.idx]
        want_g = [self.base + p for p in rows]
        first = self.mode._first[0] if self.mode._first is not None else None
        if self.attached:
            end = min(len(self.flat), self.cursor + len(rows) + self.window)
            want = [g for g in self.flat[self.asked:end] if g != first]  # that one was prepared here
            self.asked = max(self.asked, end)
            nxt = self.rows[self.idx + 1] if self.idx + 1 < len(self.rows) else rows
            link = self.mode.link
            msg = {"op": "step", "pos": want_g[0], "need": want_g[-1] + 1,
                   "release": self.release + (link.take_freed() if link is not None else []),
                   "want": want, "shared": self.mode.shared, "self": self.mode.self_prepared}
            if self.in_place and link is not None:   # this batch and the next may be views of staging
                room = link.nslots // 8
                hi = self.base + nxt[-1] + 1
                if hi - want_g[0] > room:
                    hi = want_g[-1] + 1
                if hi - want_g[0] <= room:
                    msg["pin"] = [want_g[0], hi]
            self._send(msg)
            self.release = []
            while self.attached and any(g not in self.got and g != first for g in want_g):
                self._receive(block=True)
        self.idx += 1
        self.cursor += len(rows)
        self._viewed = []
        try:
            env = self._assemble(k, rows, want_g)
        finally:
            viewed = set(self._viewed)
            for g in want_g:
                if self.got.pop(g, None) is not None and g not in viewed:
                    self.release.append(g)
        if not self.attached and self.idx < len(self.steps) and self.local is None:
            self._go_local()
        return env

    def _rejoin(self) -> bool:
        """After losing the daemon mid-pass: once per ``COORDL_DAEMON_TIMEOUT``,
        look for a daemon started in its place (a new socket file); if one
        runs, join it and take the rest of the pass from its stream, from
        the next step (the batches the own pipeline prepared ahead are
        dropped: they are the same batches).  So a restarted daemon is found
        within one timeout, not at the next epoch."""
        if self._lost_sid is None or self.idx >= len(self.steps) or not self.loader.in_order:
            return False
        now = time.monotonic()
        if now - self._looked < _timeout():
            return False
        self._looked = now
        from . import server

        sid = server.socket_id()
        mode = self.mode
        if sid is None or sid == self._lost_sid or mode.off is not None or mode.link is not None:
            return False
        if not mode._connect(self.loader, self.epoch, self.steps[self.idx]):
            # a daemon that has just bound its socket may not accept yet: a few tries, one per timeout
            self._tries[sid] = self._tries.get(sid, 0) + 1
            if self._tries[sid] >= 3:
                self._lost_sid = sid
            return False
        self.local.shutdown_workers()
        self.local = None
        self._lost_sid = None
        link = mode.link
        self.window = min(self.window, max(4, link.mm.size() // link.stride // 4))
        self.got.clear()
        self.release = []
        self.pins = []
        self.cursor = self.asked = sum(len(r) for r in self.rows[:self.idx])
        self.attached = True
        self._send({"op": "pass", "epoch": self.epoch, "start": self.flat[self.cursor], "end": self.base + self.n})
        return self.attached

    def _go_local(self) -> None:
        """The rest of the pass on this job's own pipeline, from the next step."""
        self._leave()
        self.got.clear()
        self.pins = []
        done = frozenset(range(self.plan.num_batches)) - frozenset(self.steps[self.idx:])
        self.local = PipelineMode._pipeline_iter(self.mode, self.loader, self.epoch, self.steps[self.idx], done)

    def _slot_rows(self, item, g: int):
        """``(the staged sample's leaves as uint8 arrays, header offset)``, or
        None if the slot does not hold position ``g`` complete (then it is
        prepared here)."""
        link = self.mode.link
        if link is None or not item[2]:
            return None
        slot = int(item[1])
        base = slot * HEADER
        if not 0 <= slot < link.nslots or not self._still(base, g):
            return None
        return [np.frombuffer(link.mm, dtype=np.uint8, count=ls.nbytes, offset=b0 + slot * ls.nbytes)
                for ls, b0 in zip(self.layout1.leaves, link.bases)], base

    def _still(self, base: int, g: int) -> bool:
        """The slot at ``base`` holds position ``g``, complete (its header)."""
        link = self.mode.link
        return link is not None and HDR.unpack_from(link.mm, base)[1:] == (g, int(self.order[g - self.base]), MARK)

    def _assemble(self, k: int, rows: list[int], gs: list[int]) -> Envelope:
        """Batch ``k`` from staged samples (one byte copy each) and samples
        prepared here, with the engine's own placing and finishing, so the
        batch is the one ``share=False`` builds."""
        mode, loader = self.mode, self.loader
        l1 = self.layout1
        n = len(rows)
        if self.in_place:
            env = self._view(k, gs)
            if env is not None:
                return env
        b = _Builder(k, [int(self.order[p]) for p in rows], copy=not self.in_place)
        st = b.stats
        if not b.copy:   # the batch layout is the one-sample layout, n rows
            b.layout = _collate.Layout(l1.template, [_collate._Leaf(x.dtype, x.shape, x.kind) for x in l1.leaves], n)
            b.slot, buf = _SLOTS.acquire(b.layout.nbytes)
            b.targets = _collate.views(b.layout, buf)
        for j, (i, g) in enumerate(zip(b.indices, gs)):
            item = self.got.get(g)
            src = self._slot_rows(item, g) if item is not None else None
            if src is not None:
                sbuf, base = src
                if b.copy:
                    b.samples[j] = _sample_from(l1, [
                        (torch.from_numpy(a).view(ls.dtype) if ls.nbytes else torch.empty((0,), dtype=ls.dtype))
                        .view(tuple(ls.shape)) for a, ls in zip(sbuf, l1.leaves)])
                else:   # row j of each leaf <- the slot's bytes: plain memcpy, no torch threads
                    for lb, ls, a in zip(b.layout.leaves, l1.leaves, sbuf):
                        per = ls.nbytes
                        b.slot[lb.offset + j * per:lb.offset + (j + 1) * per] = a
                del sbuf
                if self._still(base, g):
                    b.ok[j] = True
                    source, nbytes, fetch_s, prep_s = item[3]
                    st.samples += 1
                    st.shared += 1
                    st.record_read(source, int(nbytes))
                    st.fetch_s += float(fetch_s)
                    st.prep_s += float(prep_s)
                    continue
            first = mode._first
            if first is not None and first[0] == g:
                mode._first = None
                sample = first[1]
                st.add(first[2])
            else:
                try:
                    sample = mode.prep_here(loader, self.epoch, i, st)
                except SampleError as e:
                    mode.count(st)
                    e.coordl_step = k    # the step is used up: the loader's state counts it
                    raise
            if sample is not SKIP:
                place(b, j, sample, _SLOTS)
        mode.count(st)
        out = finish(b, loader.collate_fn, self.plan.batch_size, _SLOTS)
        if out[0] == "empty":
            return Envelope(None, self.epoch, st, k)
        if out[0] == "obj":
            return Envelope(out[1], self.epoch, st, k)
        return Envelope(_collate.build(b.layout.template, _collate.views(b.layout, b.slot, out[1])),
                        self.epoch, st, k)


    def _view(self, k: int, gs: list[int]):
        """Batch ``k`` as a view of staging, no copy, when its samples are all
        staged, complete, pinned for this job and in consecutive slots (the
        daemon puts position G in the slot after G - 1's when it can): each leaf of the batch is
        then one contiguous run of staging.  The slots stay pinned until the
        batch's tensors are all gone (a finalizer on the array they view;
        then released with the next message, or by the connection's close).
        None: build it by copying."""
        link = self.mode.link
        n = len(gs)
        if link is None or not n or gs[-1] - gs[0] != n - 1:
            return None
        if not any(lo <= gs[0] and gs[-1] < hi for lo, hi in self.pins):
            return None
        if link.viewed + n > link.nslots // 8:   # a job holding many batches copies the rest
            return None
        items = [self.got.get(g) for g in gs]
        if any(it is None or not it[2] for it in items):
            return None
        s0 = int(items[0][1])
        if s0 < 0 or s0 + n > link.nslots or any(int(it[1]) != s0 + j for j, it in enumerate(items)):
            return None
        if not all(self._still((s0 + j) * HEADER, g) for j, g in enumerate(gs)):
            return None
        try:
            leaves, bufs = _private_views(self.layout1, link, s0, n)
        except (OSError, ValueError):
            return None
        link.viewing(n)
        gone = _Gone(link, list(gs), len(bufs))
        for buf in bufs:
            weakref.finalize(buf, _reaper.later, gone)
        del bufs
        self._viewed = list(gs)
        st = BatchStats()
        for it in items:
            source, nbytes, fetch_s, prep_s = it[3]
            st.record_read(source, int(nbytes))
            st.fetch_s += float(fetch_s)
            st.prep_s += float(prep_s)
        st.samples = st.shared = n
        self.mode.count(st)
        return Envelope(_collate.build(self.layout1.template, leaves), self.epoch, st, k)


_PAGE = mmap.PAGESIZE


def _private_views(layout1, link: _Link, s0: int, n: int) -> tuple[list, list]:
    """Each leaf of slots ``s0 .. s0 + n - 1`` as a ``(n, *shape)`` tensor
    over a private (copy-on-write) mapping of its run of staging: reading
    costs no copy (the pages are staging's own until written), and a job
    that writes into its batch in place writes into its own copy of those
    pages, never into staging that other jobs read.  Also the uint8 arrays
    that own the mappings (they go with the last tensor over them)."""
    leaves, bufs = [], []
    for leaf, b0 in zip(layout1.leaves, link.bases):
        per = leaf.nbytes
        if not per:
            leaves.append(torch.empty((n,) + tuple(leaf.shape), dtype=leaf.dtype))
            continue
        start, end = b0 + s0 * per, b0 + (s0 + n) * per
        off = start // _PAGE * _PAGE
        m = mmap.mmap(link.fd, end - off, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=off)
        buf = np.frombuffer(m, dtype=np.uint8)
        bufs.append(buf)
        leaves.append(torch.from_numpy(buf[start - off:]).view(leaf.dtype).view((n,) + tuple(leaf.shape)))
    return leaves, bufs


class _Gone:
    """Counts a zero-copy batch's mappings down (in the reaper thread); the
    last one gone releases its slots."""

    def __init__(self, link: _Link, gs: list, left: int) -> None:
        self.link, self.gs, self.left = link, gs, left
        if not left:
            link.view_gone(gs)

    def __call__(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.link.view_gone(self.gs)


_SLOTS = LocalSlots()   # a fresh buffer per batch: the user may keep a batch as long as it likes


def _sample_from(layout1, leaves) -> object:
    """A staged sample rebuilt with the types ``prep`` returned (tuples stay
    tuples, numbers stay Python numbers, arrays stay arrays)."""
    out = []
    for leaf, t in zip(layout1.leaves, leaves):
        if leaf.kind == "tensor":
            out.append(t.clone())
        elif leaf.kind == "numpy":
            out.append(t.numpy().copy())
        elif leaf.kind == "int":
            out.append(int(t.item()))
        elif leaf.kind == "float":
            out.append(float(t.item()))
        else:
            out.append(bool(t.item()))
    return _collate._unflatten(layout1.template, iter(out), as_sample=True)
