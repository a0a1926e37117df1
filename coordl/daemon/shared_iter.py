"""A job's pass over the daemon's staged samples (:class:`SharedIter`):
it asks for this job's positions, takes the samples the daemon prepared
into the group's staging memory and assembles this job's own batches from
them: a batch whose samples sit in consecutive slots, pinned for this job,
is a view of staging through a private copy-on-write mapping (no copy;
:meth:`SharedIter._view`, its pins given back when the batch's tensors
die; pins are counted, see :class:`_Link`), any other one gets one copy
per sample into the batch.  A pass gives back what it was given and did
not use when it ends, however it ends (:class:`_PassState`).  Samples the stream
cannot give are prepared here, exactly as the pipeline would; detaches,
a lost or hung daemon and its restart are handled at the exact sample
where the stream stopped (see :mod:`coordl.daemon.member`, which opens
the stream).
"""
from __future__ import annotations

import functools
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

    Pins.  A batch handed out as a view of staging (zero-copy) needs its
    slots pinned at the daemon until its tensors die; the daemon also drops
    every pin of a connection when it closes, so while views live the
    connection stays open (:meth:`close` defers to the last view).  The
    link mirrors the daemon's pins for this connection, counted per
    (position, slot): ``pins``, what the daemon said it pinned and was not
    given back yet, and ``held``, how many of those live views use.  A view
    takes one spare pin of each of its positions (:meth:`take_view`) and
    gives it back when it dies (:meth:`view_gone`); a pass done with a
    position it did not view gives back the pin it was given of it, if any
    (:meth:`_PassState.done`, :meth:`finish`: a spare one, never one a live
    view uses).  So a position viewed a second time while a first
    view of it lives (the job runs an epoch again, or rolls back, holding a
    batch of it) holds two pins, and its slot stays until both views are
    gone; a pass that ends early gives back every pin of its read-ahead,
    and never one a live view uses.  Pins given back go out with the
    running pass's next message, or at once (:meth:`post`; what the socket
    does not take then, the reaper thread sends as it does) when a view
    dies while no pass runs, or a pass is left.

    Reading.  What the daemon sends is read without blocking
    (:meth:`pump`: the frames that are complete; a partial one waits in the
    connection, so a daemon that stops mid-frame cannot hold the job) and
    routed by the pass it is tagged with: the current pass's deliveries go
    to its ``got``; what comes for a pass that is over is given back at
    once.  Only the process that connected talks on the connection: a
    forked child inherits it but never reads, writes or gives back pins."""

    _CARRY = ("step", "end", "release")   # messages that carry pins given back

    def __init__(self, conn: ipc.Conn, mm: mmap.mmap, stride: int, gid: int, nslots: int, bases,
                 fd: int) -> None:
        self.conn, self.mm, self.stride, self.gid = conn, mm, stride, gid
        conn.sock.setblocking(False)           # reads and writes never wait in the socket (pump, send)
        self.nslots, self.bases = nslots, bases
        self.fd = fd                           # the staging memfd: batches map their runs of it privately
        self.alive = True
        self.closing = False
        self.views = 0                         # batches that view staging, alive
        self.viewed = 0                        # slots they view
        self.pins: dict = {}                   # (G, slot) -> pins the daemon holds for this connection
        self.held: dict = {}                   # (G, slot) -> of those, pins live views use
        self.unpin: list = []                  # positions whose pin was given back, to tell the daemon
        self.passes = 0                        # pass numbers given out
        self.current: _PassState | None = None   # the pass whose deliveries are read into its ``got``
        self.pid = os.getpid()
        self._lock = threading.Lock()          # the pins, the views and the current pass
        self._wlock = threading.Lock()         # one writer of frames at a time
        self._rlock = threading.Lock()         # one reader
        from . import server

        self.sid = server.socket_id()   # the daemon's socket file: a daemon started in its place has another

    # ------------------------------------------------------------ pins
    def told(self, keys) -> None:
        """The daemon pinned ``keys`` ((G, slot) each, once per pin)."""
        with self._lock:
            pins = self.pins
            for k in keys:
                pins[k] = pins.get(k, 0) + 1

    def finish(self, keys) -> None:
        """A pass is done with ``keys`` without viewing them: a spare pin of
        each (one no live view uses), if there is one, is given back."""
        with self._lock:
            pins, held = self.pins, self.held
            for k in keys:
                c = pins.get(k, 0)
                if c > held.get(k, 0):
                    _less(pins, k, c)
                    self.unpin.append(k[0])

    def take_view(self, keys) -> bool:
        """A view of ``keys`` takes one spare pin of each; False (nothing
        taken) when one of them has none: not pinned for this job, or its
        pins back other live views."""
        with self._lock:
            pins, held = self.pins, self.held
            if any(pins.get(k, 0) <= held.get(k, 0) for k in keys):
                return False
            for k in keys:
                held[k] = held.get(k, 0) + 1
            self.views += 1
            self.viewed += len(keys)
            return True

    def untake(self, keys) -> None:
        """A view taken with :meth:`take_view` was not made after all."""
        with self._lock:
            for k in keys:
                _less(self.held, k, self.held[k])
            self.views -= 1
            self.viewed -= len(keys)

    def view_gone(self, keys: list) -> None:
        """A batch viewing staging was collected (run by the reaper thread):
        its pins are given back with the running pass's next message, at
        once when no pass runs, or by closing."""
        if os.getpid() != self.pid:
            return       # a forked child's copy of the batch: the pins are the parent's
        with self._lock:
            self.views -= 1
            self.viewed -= len(keys)
            for k in keys:
                _less(self.held, k, self.held[k])
                _less(self.pins, k, self.pins[k])
                self.unpin.append(k[0])
            last = self.views == 0 and self.closing
            idle = self.current is None
        if last:
            self._close_now()
        elif idle:
            self.post()

    def _take_unpin(self) -> list:
        with self._lock:
            out, self.unpin = self.unpin, []
        return out

    # ------------------------------------------------------------ passes
    def begin(self) -> "_PassState":
        """A new pass: its number, and what the daemon sends for it (from
        here on its thread reads the connection: :meth:`pump`)."""
        with self._rlock, self._lock:
            self.passes += 1
            st = self.current = _PassState(self, self.passes)
        return st

    # ------------------------------------------------------------ writing
    def send(self, msg: dict, timeout: float) -> None:
        """Send ``msg`` (with the pins given back so far, if it carries
        them) from the pass's thread; wait until it is out.  ``TimeoutError``
        when the daemon does not take it in ``timeout`` seconds (the
        connection is then not used again)."""
        if os.getpid() != self.pid:
            raise ConnectionError("coordl: the connection to the node daemon belongs to the parent process")
        with self._wlock:
            if msg.get("op") in self._CARRY:
                msg["unpin"] = msg.get("unpin", []) + self._take_unpin()
            self.conn.queue(msg)
            deadline = time.monotonic() + timeout
            poller = None
            try:
                while not self.conn.write_ready():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.alive = False
                        raise TimeoutError(f"coordl: the node daemon (pid {self.conn.peer_pid}) took no message "
                                           f"for {timeout:g} s")
                    if poller is None:
                        poller = selectors.DefaultSelector()
                        poller.register(self.conn.sock, selectors.EVENT_WRITE)
                    poller.select(min(left, 1.0))
            finally:
                if poller is not None:
                    poller.close()

    #: how long the reaper keeps retrying what :meth:`post` could not send at once
    POST_RETRY_S = 60.0

    def post(self, msg: dict | None = None) -> None:
        """Send ``msg`` (or else a ``release``) with the pins given back so
        far, from any thread, waiting at most a second for the connection.
        What the socket does not take now (the daemon reads late), or all of
        it when another thread's write holds the connection past that second
        (a pass's thread waiting on a slow daemon), the reaper thread sends
        as the socket takes it, trying again every few tens of milliseconds
        for :attr:`POST_RETRY_S` (then it goes out before the next message):
        a job between passes may send nothing for long, and its pins would
        stay.  Nothing when the connection is closed or belongs to the
        parent process."""
        self._post(msg, time.monotonic() + self.POST_RETRY_S, 1.0)

    def _post(self, msg: dict | None, until: float, lock_wait: float) -> None:
        if os.getpid() != self.pid:
            return
        if not self._wlock.acquire(timeout=lock_wait):
            self._again(msg, until)     # (unpins taken by the pass's next message go with it instead)
            return
        try:
            if self.conn.fileno() < 0:
                return
            if msg is None:
                msg = {"op": "release"}
            msg["unpin"] = msg.get("unpin", []) + self._take_unpin()
            if msg["op"] != "release" or msg["unpin"]:
                self.conn.queue(msg)
            if self.conn.write_ready():
                return
        except (OSError, ValueError):
            return   # the connection broke: the pass that uses it finds out
        finally:
            self._wlock.release()
        self._again(None, until)        # the rest waits in the connection: send it as the socket takes it

    def _again(self, msg: dict | None, until: float) -> None:
        """:meth:`_post` again later, in the reaper thread (not where it
        would run at once: interpreter exit, a forked child)."""
        if time.monotonic() < until and self.conn.fileno() >= 0 and _reaper.running():
            _reaper.later(functools.partial(self._retry, msg, until))

    def _retry(self, msg: dict | None, until: float) -> None:
        """In the reaper: wait up to 50 ms for the socket to take more
        (the lock, in :meth:`_post`), then post again."""
        if msg is None and self.conn.pending_out:
            try:
                with selectors.DefaultSelector() as sel:
                    sel.register(self.conn.sock, selectors.EVENT_WRITE)
                    sel.select(0.05)
            except (OSError, ValueError):
                return   # closed meanwhile
        self._post(msg, until, 0.05)

    # ------------------------------------------------------------ reading
    def pump(self, wait: bool = True, idle: bool = False) -> int:
        """Read and route what the daemon sent, without waiting for more;
        the number of frames read (0 without reading when ``wait`` is False
        and another thread reads, or when ``idle`` and a pass runs: its
        thread reads, and a frame taken from under its wait would delay
        it).  ``ConnectionError`` on EOF or a bad frame."""
        if os.getpid() != self.pid or not self._rlock.acquire(blocking=wait):
            return 0
        try:
            if idle and self.current is not None:
                return 0
            n = 0
            while True:
                frames = self.conn.read_ready(limit=256)
                n += len(frames)
                for msg, fds in frames:
                    for fd in fds:
                        os.close(fd)
                    self._route(msg)
                if len(frames) < 256:
                    return n
        finally:
            self._rlock.release()

    def _route(self, msg: dict) -> None:
        op = msg.get("op")
        st = self.current
        if st is not None and msg.get("pass") != st.pid:
            st = None                  # for a pass that is over
        if op == "ready":
            items = msg.get("items") or []
            pinned = [(int(it[0]), int(it[1])) for it in items if len(it) > 4 and it[4]]
            made = [(int(x[0]), int(x[1])) for x in msg.get("pins") or ()]
            self.told(pinned + made)
            if st is None:
                self.finish(pinned + made)    # nobody takes these any more
                return
            got, late = st.got, []
            for it in items:
                g = int(it[0])
                if g in got:               # (never asked twice in a pass; given back if it were)
                    if len(it) > 4 and it[4]:
                        late.append((g, int(it[1])))
                else:
                    got[g] = it
                    if len(it) > 4 and it[4]:
                        st.pinned.add((g, int(it[1])))
            for k in made:                 # a claim that became a pin after the pass was done with it
                it = got.get(k[0])
                if it is None or int(it[1]) != k[1]:
                    late.append(k)
                else:
                    st.pinned.add(k)
            if late:
                self.finish(late)
            st.heard += 1
        elif op == "detach":
            if st is not None:
                st.detach = msg

    # ------------------------------------------------------------ closing
    def close(self) -> None:
        self.alive = False
        with self._lock:
            st, self.current = self.current, None
            if st is not None:
                st.ended = True
            if self.views:   # batches still view staging: closing would free their slots at the daemon
                self.closing = True
                return
        self._close_now()

    def _close_now(self) -> None:
        with self._wlock:
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


def _less(counts: dict, k, c: int) -> None:
    if c > 1:
        counts[k] = c - 1
    else:
        del counts[k]


class _PassState:
    """What the daemon sent for one pass of a loader (``got``: deliveries
    not used yet; ``detach``: a detach not acted on yet), and its end,
    which comes once, from the pass's thread or (a pass left and
    collected) the reaper's."""

    def __init__(self, link: _Link, pid: int) -> None:
        self.link, self.pid = link, pid
        self.got: dict[int, list] = {}
        self.pinned: set = set()       # (G, slot) of ``got`` delivered pinned (or pinned since)
        self.release: list[int] = []   # claims it used, to give back with its next message
        self.detach: dict | None = None
        self.heard = 0                 # messages of deliveries read for it
        self.ended = False

    def end(self, complete: bool = False, extra: dict | None = None, wait: bool = True) -> None:
        """Tell the daemon this pass is over (``complete``: it ran to its end,
        and the next epoch will likely follow), giving back the claims and
        the spare pins of what it was given and did not use; the batches it
        handed out keep theirs.  ``wait``: from the pass's thread (waits
        until the message is out; ``OSError`` if it cannot be); else from
        any thread, never waiting."""
        link = self.link
        if os.getpid() != link.pid:
            return       # a forked child's copy: the pass is the parent's
        with link._lock:
            if self.ended:
                return
            self.ended = True
            if link.current is self:
                link.current = None
        try:   # deliveries already on their way for it: read now, and given back with the rest
            link.pump(wait=wait, idle=not wait)
        except (OSError, ValueError):
            pass
        got, self.got = self.got, {}
        self.done([(g, int(it[1])) for g, it in got.items()])
        msg = {"op": "end", "pass": self.pid, "complete": complete, "release": self.release + list(got)}
        self.release = []
        if extra:
            msg.update(extra)
        if wait:
            link.send(msg, timeout=10.0)
        else:
            link.post(msg)

    def done(self, keys) -> None:
        """This pass is done with ``keys`` ((G, slot) of its deliveries),
        without viewing them: the pins it was given of them go back (a spare
        one of each: one a live view uses never does)."""
        mine = [k for k in keys if k in self.pinned]
        self.pinned.difference_update(mine)
        if mine:
            self.link.finish(mine)

    def drop(self) -> None:
        """The connection is gone: nothing more to tell."""
        self.ended = True
        self.got.clear()
        self.pinned.clear()
        self.release = []


def _abandon(box: list) -> None:
    """A pass left and collected (run by the reaper): its end, never waiting."""
    st = box[0]
    if st is not None:
        st.end(wait=False)


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
        self._viewed: list = []   # positions the batch just built views (their pins go when it dies)
        self.local = None     # the job's own pipeline, after a detach
        self._lost_sid = None  # the socket (device, inode) of a daemon this pass lost
        self._looked = 0.0     # when it last looked for a daemon started in that one's place
        self._tries: dict = {}   # socket id -> failed joins of a daemon found in that one's place
        self.window = max(32, min(1024, 2 * (bs or 1) * max(1, loader.prefetch_factor or 2) // 2))
        link = mode.link
        self.window = min(self.window, max(4, link.mm.size() // link.stride // 4))
        self.layout1 = mode.layout1
        # the batch's template where it is collated in place: default_collate's, or that of timm's fast_collate
        # for its samples (a uint8 image and a class index)
        l1 = self.layout1
        self.template = None if l1 is None else l1.template if _collate.is_default_collate(loader.collate_fn) \
            else _collate.as_pair(l1.template, [(x.dtype, x.shape, x.kind) for x in l1.leaves]) \
            if _collate.is_fast_collate(loader.collate_fn) else None
        self.in_place = self.template is not None and bs is not None
        self.verify = self._verify_positions(verify_count())
        # this pass's end, once, however it ends: run out (``_leave``), left for a new pass
        # (``ShareMode.start_pass``), or left and collected (the reaper, through this box)
        self._box: list = [None]
        weakref.finalize(self, _reaper.later, functools.partial(_abandon, self._box))
        mode._last_box = self._box
        self._begin(link)

    def _begin(self, link: _Link) -> None:
        """Start this pass (from the cursor) in ``link``'s stream."""
        st = self._box[0] = link.begin()
        self.got = st.got
        self._send({"op": "pass", "pass": st.pid, "epoch": self.epoch, "start": self.flat[self.cursor],
                    "end": self.base + self.n})

    @property
    def state(self) -> "_PassState | None":
        return self._box[0]

    @property
    def attached(self) -> bool:
        """Whether this pass takes samples from the daemon's stream."""
        st = self._box[0]
        return st is not None and not st.ended

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
            self._quit()
            return
        try:
            link.send(msg, timeout=10.0)
        except (OSError, ValueError) as e:
            self._lost(f"the node daemon closed the connection or took nothing ({e})",
                       hung=isinstance(e, TimeoutError))

    def _quit(self) -> None:
        """The stream is gone for this pass (no link): nothing more to tell."""
        st = self._box[0]
        if st is not None:
            st.drop()

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
        self._quit()

    def _leave(self, complete: bool = False) -> None:
        """Tell the daemon this pass is over (``complete``: it ran to its end,
        and the next epoch will likely follow); what it was given and did not
        use is given back (:meth:`_PassState.end`)."""
        st = self._box[0]
        if st is None or st.ended:
            return
        try:
            st.end(complete, {"shared": self.mode.shared, "self": self.mode.self_prepared})
        except (OSError, ValueError) as e:
            self._lost(f"the node daemon closed the connection or took nothing ({e})",
                       hung=isinstance(e, TimeoutError))

    def _receive(self, block: bool) -> None:
        """Take in everything the daemon sent that can be read now (never
        waiting for a frame to complete); when ``block``, wait, with
        liveness checks, until something came for this pass."""
        link = self.mode.link
        st = self._box[0]
        if link is None or st is None or st.ended:
            self._quit()
            return
        t = _timeout()
        ping_every = max(0.05, t / 4)
        start = heard = pinged = time.monotonic()
        seen = st.heard
        poller = None
        try:
            while True:
                try:
                    n = link.pump()
                except (OSError, ValueError) as e:
                    self._lost(f"lost the node daemon (pid {link.conn.peer_pid}): {e}")
                    return
                now = time.monotonic()
                if n:
                    heard = now
                if st.detach is not None:
                    self._detached(st.detach)
                    return
                if not block or st.heard != seen or st.ended:
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
                if poller is None:
                    poller = selectors.DefaultSelector()
                    poller.register(link.conn.sock, selectors.EVENT_READ)
                poller.select(min(ping_every, 1.0))
        finally:
            if poller is not None:
                poller.close()

    def _detached(self, msg: dict) -> None:
        """The daemon detached this pass: the rest of it is prepared here."""
        self._box[0].detach = None
        why = msg.get("why", "")
        self._leave()
        if msg.get("permanent"):   # a detach for being slow is normal: stats() counts it
            self.mode.off = why
            self.mode.drop_link()
            warnings.warn(f"coordl: share=True: {why}; this loader prepares its own samples from here "
                          "on (nothing lost or repeated)", stacklevel=5)
        elif msg.get("warn") and why not in self.mode.told:   # the group failed for now: once per cause
            self.mode.told.add(why)
            warnings.warn(f"coordl: share=True: {why} (nothing lost or repeated)", stacklevel=5)

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
        st = self._box[0]
        if self.attached:
            end = min(len(self.flat), self.cursor + len(rows) + self.window)
            want = [g for g in self.flat[self.asked:end] if g != first]  # that one was prepared here
            self.asked = max(self.asked, end)
            nxt = self.rows[self.idx + 1] if self.idx + 1 < len(self.rows) else rows
            link = self.mode.link
            msg = {"op": "step", "pass": st.pid, "pos": want_g[0], "need": want_g[-1] + 1,
                   "release": st.release, "want": want, "shared": self.mode.shared,
                   "self": self.mode.self_prepared}
            st.release = []
            if self.in_place and link is not None:   # this batch and the next may be views of staging
                room = link.nslots // 8
                hi = self.base + nxt[-1] + 1
                if hi - want_g[0] > room:
                    hi = want_g[-1] + 1
                if hi - want_g[0] <= room:
                    msg["pin"] = [want_g[0], hi]
            self._send(msg)
            # what is on the socket already: the pins of this batch were asked with the last one, and
            # their answer may have come after the samples (a job whose samples were staged before it
            # asked waits for nothing); read before deciding to copy
            self._receive(block=False)
            while self.attached and any(g not in self.got and g != first for g in want_g):
                self._receive(block=True)
        self.idx += 1
        self.cursor += len(rows)
        self._viewed = []
        try:
            env = self._assemble(k, rows, want_g)
        finally:
            viewed = set(self._viewed)
            done = []
            for g in want_g:
                item = self.got.pop(g, None)
                if item is not None and g not in viewed:
                    done.append((g, int(item[1])))
            st = self._box[0]
            if done and st is not None:
                if not st.ended:
                    st.release.extend(g for g, _ in done)
                st.done(done)
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
        self.cursor = self.asked = sum(len(r) for r in self.rows[:self.idx])
        mode._last_box = self._box
        self._begin(link)
        return self.attached

    def _go_local(self) -> None:
        """The rest of the pass on this job's own pipeline, from the next step."""
        self._leave()
        self.got.clear()
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
            b.layout = _collate.Layout(self.template, [_collate._Leaf(x.dtype, x.shape, x.kind) for x in l1.leaves], n)
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
        out = finish(b, loader.collate_fn, self.plan.batch_size, _SLOTS, key=(loader.seed, self.epoch))
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
        self._quit()
        warnings.warn(f"coordl: share=True: {why}; this loader prepares its own samples from here on (no "
                      "batch found wrong was handed out)", stacklevel=5)

    def _view(self, k: int, gs: list[int]):
        """Batch ``k`` as a view of staging, no copy, when its samples are all
        staged, complete, pinned for this job and in consecutive slots (the
        daemon puts position G in the slot after G - 1's when it can): each
        leaf of the batch is then one contiguous run of staging.  The view
        takes a pin of each of its slots that no other live view uses
        (:meth:`_Link.take_view`) and keeps it until the batch's tensors are
        all gone (a finalizer on the arrays they view; then given back at
        once, or by the connection's close).  None: build it by copying."""
        link = self.mode.link
        n = len(gs)
        if link is None or not n or gs[-1] - gs[0] != n - 1:
            return None
        if link.viewed + n > view_room(link.nslots, max(n, self.plan.batch_size or 0)):
            return None
        items = [self.got.get(g) for g in gs]
        if any(it is None or not it[2] for it in items):
            return None
        s0 = int(items[0][1])
        if s0 < 0 or s0 + n > link.nslots or any(int(it[1]) != s0 + j for j, it in enumerate(items)):
            return None
        keys = [(g, s0 + j) for j, g in enumerate(gs)]
        if not link.take_view(keys):
            return None
        try:
            if not self._still_run(s0, gs):
                raise ValueError("not staged complete")
            leaves, bufs = _private_views(self.layout1, link, s0, n)
        except (OSError, ValueError):
            link.untake(keys)
            return None
        gone = _Gone(link, keys, len(bufs))
        for buf in bufs:
            weakref.finalize(buf, _reaper.later, gone)
        del bufs
        self._viewed = list(gs)
        ps = self._box[0]
        if ps is not None:
            ps.pinned.difference_update(keys)   # its pins are the view's now
        st = BatchStats()
        for it in items:
            source, nbytes, fetch_s, prep_s = it[3]
            st.record_read(source, int(nbytes))
            st.fetch_s += float(fetch_s)
            st.prep_s += float(prep_s)
        st.samples = st.shared = n
        st.zero_copy = 1
        self.mode.count(st)
        return Envelope(_collate.build(self.template, leaves), self.epoch, st, k)


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
        mine = _collate.leaf_bytes(x, leaf)
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
    last one gone gives back the pins of its slots."""

    def __init__(self, link: _Link, keys: list, left: int) -> None:
        self.link, self.keys, self.left = link, keys, left
        if not left:
            link.view_gone(keys)

    def __call__(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.link.view_gone(self.keys)


_SLOTS = LocalSlots()   # a fresh buffer per batch: the user may keep a batch as long as it likes


def _sample_from(layout1, leaves) -> object:
    """A staged sample rebuilt with the types ``prep`` returned (tuples stay
    tuples, numbers stay Python or numpy numbers, arrays stay arrays)."""
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
        elif leaf.kind == "npscalar":
            out.append(t.numpy().copy()[()])
        else:
            out.append(bool(t.item()))
    return _collate._unflatten(layout1.template, iter(out), as_sample=True)
