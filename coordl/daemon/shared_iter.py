"""A job's pass over the daemon's staged samples (:class:`SharedIter`):
it asks for this job's positions, takes the samples the daemon prepared
into the group's staging memory and assembles this job's own batches from
them: a batch whose samples sit in consecutive slots, pinned for this job,
is a view of staging through a private copy-on-write mapping (no copy;
:meth:`SharedIter._view`, released when the batch's tensors die), any
other one gets one copy per sample into the batch.  Samples the stream
cannot give are prepared here, exactly as the pipeline would; detaches,
a lost or hung daemon and its restart are handled at the exact sample
where the stream stopped (see :mod:`coordl.daemon.member`, which opens
the stream).
"""
from __future__ import annotations

import collections
import mmap
import os
import selectors
import threading
import time
import warnings
import weakref

import numpy as np
import torch

from ..base import forks as _forks
from ..base import reaper as _reaper
from ..pipeline import collate as _collate
from ..pipeline.engine import _Builder, finish, place
from ..pipeline.modes import PipelineMode
from ..pipeline.prep import SKIP
from ..pipeline.slots import LocalSlots
from ..pipeline.torch_path import Envelope
from ..errors import SampleError
from ..stats import BatchStats
from . import ipc
from .worker import HDR, HEADER, MARK

__all__ = ["SharedIter"]

_STALL = 60.0   # seconds without a sample while the daemon answers pings: give up on it


def _timeout() -> float:
    from . import server

    return server.answer_timeout()


def verify_count() -> int:
    """Samples per pass a sharing job prepares itself to check the daemon's
    (``COORDL_SHARE_VERIFY``, default 2; 0 turns the check off)."""
    raw = os.environ.get("COORDL_SHARE_VERIFY", "2")
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"COORDL_SHARE_VERIFY should be a whole number of samples per pass (0: no check), "
                         f"but got COORDL_SHARE_VERIFY={raw!r}") from None
    return max(0, n)


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


def _write_all(fd: int, data: bytes) -> None:
    os.lseek(fd, 0, os.SEEK_SET)
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class SharedIter:
    """One pass that takes prepared samples from the daemon's stream."""

    def __init__(self, mode: PipelineMode, loader, epoch: int, steps: list[int]) -> None:   # mode: the ShareMode
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
        self.verify = self._verify_positions(verify_count())
        self._send({"op": "pass", "epoch": epoch, "start": self.flat[0], "end": self.base + self.n})
        self.attached = True

    def _verify_positions(self, nv: int) -> set:
        """Positions whose staged samples this pass checks against its own
        prep: the first it takes from the stream (so a wrong group is found
        before its first batch is handed out) and the rest spread over the
        pass."""
        first = self.mode._first[0] if self.mode._first is not None else None
        cand = [g for g in self.flat if g != first]
        if nv <= 0 or not cand:
            return set()
        return {cand[(j * len(cand)) // nv] for j in range(nv)}

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

    def _still_run(self, s0: int, gs: list[int]) -> bool:
        """Slots ``s0, s0 + 1, ...`` hold positions ``gs``, complete: their
        headers read at once (what :meth:`_still` checks one by one)."""
        link = self.mode.link
        if link is None:
            return False
        n = len(gs)
        h = np.frombuffer(link.mm, dtype="<i8", count=n * (HEADER // 8), offset=s0 * HEADER)
        try:
            h = h.reshape(n, HEADER // 8)
            g = np.asarray(gs, dtype=np.int64)
            return bool((h[:, 1] == g).all() and (h[:, 3] == MARK).all()
                        and (h[:, 2] == self.order[g - self.base]).all())
        finally:
            del h

    def _assemble(self, k: int, rows: list[int], gs: list[int]) -> Envelope:
        """Batch ``k`` from staged samples (one byte copy each) and samples
        prepared here, with the engine's own placing and finishing, so the
        batch is the one ``share=False`` builds."""
        mode, loader = self.mode, self.loader
        l1 = self.layout1
        n = len(rows)
        if self.verify:
            self._check_batch(rows, gs)
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


    # ------------------------------------------------------------ the check
    def _check_batch(self, rows: list[int], gs: list[int]) -> None:
        """The staged samples of this batch that are to be checked, each
        against this job's own prep of it, bit for bit; the first mismatch
        ends sharing for this loader before the batch is built (so no batch
        found wrong is handed out)."""
        for p, g in zip(rows, gs):
            if g not in self.verify or g not in self.got:
                continue
            self.verify.discard(g)
            i = int(self.order[p])
            why = self._check(g, i, self.got[g])
            if why is not None:
                self._mismatch(g, i, why)
                return

    def _check(self, g: int, i: int, item) -> str | None:
        """None when the staged sample at position ``g`` (index ``i``) is the
        one this job prepares, bit for bit (or cannot be compared: not staged
        complete any more); else what differs."""
        got = self._slot_rows(item, g)
        if got is None:
            return None
        sbuf, base = got
        st = BatchStats()
        try:
            mine = self.mode.prep_here(self.loader, self.epoch, i, st)
        except Exception as e:   # the daemon prepared what this job cannot
            return f"this job's own prep of it raised {type(e).__name__}: {e}"
        finally:
            self.loader._counters.samples_verified += 1
        if mine is SKIP:
            return "this job's own prep of it skipped it (on_error='skip')"
        why = _differs(self.layout1, mine, sbuf)
        if not self._still(base, g):
            return None          # the slot was reused while it was read: no verdict
        return why

    def _mismatch(self, g: int, i: int, what: str) -> None:
        """The daemon's sample is not this job's: stop sharing for this loader
        (a warning says what differed), and take nothing more from the
        stream; the batch being built and the rest are prepared here."""
        ds = self.loader.dataset
        where = ds.describe(i) if callable(getattr(ds, "describe", None)) else f"{type(ds).__name__}[{i}]"
        why = (f"the node daemon's sample {i} ({where}) of epoch {self.epoch} differs from this job's own: "
               f"{what}. Its workers run other code or data than this job (a module edited after they "
               "imported it, a data file read at import, a value this job set at run time): the group's "
               "code identity cannot see everything that decides a sample")
        self.mode.off = why
        self._leave()
        self.got.clear()
        self.mode.drop_link()
        self.attached = False
        warnings.warn(f"coordl: share=True: {why}; this loader prepares its own samples from here on (no "
                      "batch found wrong was handed out)", stacklevel=5)

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
        if link.viewed + n > view_room(link.nslots, max(n, self.plan.batch_size or 0)):
            return None
        items = [self.got.get(g) for g in gs]
        if any(it is None or not it[2] for it in items):
            return None
        s0 = int(items[0][1])
        if s0 < 0 or s0 + n > link.nslots or any(int(it[1]) != s0 + j for j, it in enumerate(items)):
            return None
        if not self._still_run(s0, gs):
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
        st.zero_copy = 1
        self.mode.count(st)
        return Envelope(_collate.build(self.layout1.template, leaves), self.epoch, st, k)


def _leaf_bytes(x, leaf) -> np.ndarray:
    """A sample's leaf as the bytes staging holds for it (uint8)."""
    if isinstance(x, torch.Tensor):
        return x.detach().contiguous().view(-1).view(torch.uint8).numpy() if x.numel() else np.empty(0, np.uint8)
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    return np.asarray([x], dtype={"int": np.int64, "float": np.float64, "bool": np.bool_}[leaf.kind]).view(np.uint8)


def _differs(layout1, sample, staged: list) -> str | None:
    """None when ``sample`` (this job's) is what ``staged`` (the leaves'
    bytes in a slot) holds; else what differs, in words."""
    leaves: list = []
    try:
        template = _collate._flatten(sample, leaves)
    except _collate._Unsupported:
        return "this job's sample has no fixed layout"
    if template != layout1.template or len(leaves) != len(layout1.leaves):
        return "this job's sample has another structure"
    for k, (x, leaf, a) in enumerate(zip(leaves, layout1.leaves, staged)):
        if not _collate._same(x, leaf):
            return f"leaf {k} has another dtype or shape"
        mine = _leaf_bytes(x, leaf)
        if mine.nbytes != a.nbytes:
            return f"leaf {k} has another size"
        if np.array_equal(mine, a):
            continue
        dt = torch.empty(0, dtype=leaf.dtype).numpy().dtype if leaf.dtype != torch.bfloat16 else np.uint16
        m, t = mine.view(dt), np.asarray(a).view(dt)
        bad = m != t
        detail = f"{int(bad.sum())} of {bad.size} values differ"
        if dt.kind in "iuf":
            diff = np.abs(m[bad].astype(np.float64) - t[bad].astype(np.float64))
            detail += f", by up to {diff.max():g}"
        return f"leaf {k} ({leaf.kind} {str(leaf.dtype).replace('torch.', '')} {list(leaf.shape)}): {detail}"
    return None


def view_room(nslots: int, batch: int) -> int:
    """Slots of staging a job may view at once: a job holding many batches
    copies the rest.  An eighth of staging, or three batches (the one the
    user holds, the one being built, and the one before, whose release the
    reaper thread may not have carried out yet) within the quarter the
    daemon lets a job pin, whichever is more: a large batch next to a small
    staging is not copied every other time."""
    return max(nslots // 8, min(3 * batch, nslots // 4))


_PAGE = mmap.PAGESIZE
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)   # Linux >= 5.14

# The private mappings of staging that live batches view, until a fork makes
# them private pages (_forking); weak: a mapping goes with its last view.
_live: weakref.WeakSet = weakref.WeakSet()


def _forking() -> None:
    """Before a fork (``base.forks`` hook, under its lock): every live view
    of staging gets its own pages.  A private mapping reads staging's own
    pages until written, so after the fork the parent's and the child's
    batches would both change when the daemon reuses the slots, which it
    does once the parent's batch dies (the pins are the parent's).  Writing
    faults copy each page (``MADV_POPULATE_WRITE``: no byte changes); the
    child then shares those copies with the parent, copy-on-write, and
    staging's later contents reach neither.  Costs one copy of the batches
    alive at the fork (at most what a job may view: ``view_room``)."""
    for m in list(_live):
        try:
            m.madvise(_POPULATE_WRITE)
        except (OSError, ValueError):   # an older kernel: touch each page with its own byte
            try:
                a = np.frombuffer(m, dtype=np.uint8)
                a[::_PAGE] = a[::_PAGE].copy()
                del a
            except ValueError:
                pass   # closed: nothing views it any more
        _live.discard(m)


_forks.on_fork(_forking)


def _private_views(layout1, link: _Link, s0: int, n: int) -> tuple[list, list]:
    """Each leaf of slots ``s0 .. s0 + n - 1`` as a ``(n, *shape)`` tensor
    over a private (copy-on-write) mapping of its run of staging: reading
    costs no copy (the pages are staging's own until written), and a job
    that writes into its batch in place writes into its own copy of those
    pages, never into staging that other jobs read.  Also the uint8 arrays
    that own the mappings (they go with the last tensor over them).  A
    fork gives the mappings private pages first (:func:`_forking`)."""
    leaves, bufs, maps = [], [], []
    for leaf, b0 in zip(layout1.leaves, link.bases):
        per = leaf.nbytes
        if not per:
            leaves.append(torch.empty((n,) + tuple(leaf.shape), dtype=leaf.dtype))
            continue
        start, end = b0 + s0 * per, b0 + (s0 + n) * per
        off = start // _PAGE * _PAGE
        m = mmap.mmap(link.fd, end - off, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=off)
        maps.append(m)
        buf = np.frombuffer(m, dtype=np.uint8)
        bufs.append(buf)
        leaves.append(torch.from_numpy(buf[start - off:]).view(leaf.dtype).view((n,) + tuple(leaf.shape)))
    with _forks.lock:   # seen by a fork's hook, or made after the fork
        _live.update(maps)
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
