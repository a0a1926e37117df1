"""A daemon worker process: fetches and prepares samples into a group's
staging slots.

The daemon starts it with one end of a socket pair (``--fd``) and talks to
it with :mod:`ipc` frames (JSON, descriptors alongside):

* ``{"op": "group", gid, seed, plan, sys_path, cache, stride, digest, code,
  code_desc}`` with two descriptors, the pickled dataset (a memfd a member
  of the same uid sent; the server checked its peer credentials) and the
  group's staging memfd.  The dataset's code identity as unpickled here
  must be ``code`` (:func:`_check_code`), else ``group_failed`` with
  ``code: true`` and the parts that differ.  A worker serves one pool (one
  code, ``sys.path`` and cache directory: ``COORDL_SHM_DIR`` is the jobs').
  A sample whose layout differs from the group's fails with a reason that
  starts with :data:`LAYOUT`.
* ``{"op": "prep", gid, tasks: [[g, slot], ...]}``: for each, read the
  sample at global position ``g`` of the plan (epoch ``g //
  samples_per_epoch``) (node cache, then storage, admitting it), prepare
  it under its own generator (seed, epoch, i) and write it into ``slot``;
  answer ``{"op": "done", items: [{gid, g, ok, info | why}, ...]}``, a few
  samples per message (when nothing else is pending, at once; a finished
  sample is never held back more than half a second: the daemon judges a
  worker's liveness by them).  Reads run
  ahead on a few threads while earlier samples are prepared.
* ``{"op": "drop", gid}``: forget a group.  Node caches it attached stay
  attached until the worker exits: the daemon holds them while it runs, so
  the next wave of jobs finds them warm (``coordl daemon stop`` lets go).

Staging is laid out leaf-major (:func:`staging_bases`): the slots' 64-byte
headers (epoch, position, index, marker) first, then for each leaf of the
group's one-sample layout one region holding that leaf of every slot, slot
after slot.  So samples in consecutive slots are, leaf by leaf, one
contiguous run: a batch of them is a view of staging with no copy (the
daemon puts position ``G`` in the slot after ``G - 1``'s when it is free).  The
worker writes the leaves first and the header last; the server wrote an
invalid header before handing the slot out, so a member that checks the
header before and after its copy never uses a half-written sample.

The worker exits on EOF from the daemon (the kernel closes the socket when
the daemon dies) or on ``{"op": "stop"}``.
"""
from __future__ import annotations

import mmap
import os
import pickle
import selectors
import signal
import struct
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

__all__ = ["HEADER", "HDR", "MARK", "LAYOUT", "CodeMismatch", "describe_layout", "layout_digest", "main",
           "slot_stride", "staging_bases"]

HEADER = 64
_DONE_BATCH = 16  # finished samples reported in one message (fewer wake-ups of the daemon); half of what
                  # it is handed at a time (pool._IN_FLIGHT), so it has work while the daemon answers
_DONE_WAIT = 0.5  # seconds a finished sample waits for others before it is reported: the daemon's
                  # clock of progress (pool.py) sees every finished sample within this
HDR = struct.Struct("<qqqq")   # epoch, global position, index, marker
MARK = 0x636F6F72646C          # "coordl": a complete sample
LAYOUT = "layout: "            # a failure's reason starts with it when the sample's shapes differ


def layout_digest(layout) -> str:
    """Identity of a one-sample layout (structure, dtypes, shapes), the same
    in every process."""
    import hashlib

    parts = [repr(layout.template)] + [f"{l.dtype}|{l.shape}|{l.kind}" for l in layout.leaves]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=12).hexdigest()


def slot_stride(layout) -> int:
    """Staging bytes per slot for a one-sample ``layout``: the header, the
    leaves, and room for aligning each leaf's region (:func:`staging_bases`;
    a group has at least 16 slots)."""
    return (HEADER + layout.nbytes + 4 * len(layout.leaves) + 63) // 64 * 64


def staging_bases(layout, nslots: int, size: int) -> list[int]:
    """Where each leaf's region starts in staging of ``nslots`` slots and
    ``size`` bytes: after the headers, 64-byte aligned, ``nslots`` samples'
    worth of that leaf each (slot ``s``'s leaf at ``base + s * leaf.nbytes``)."""
    off = nslots * HEADER
    out = []
    for leaf in layout.leaves:
        off = (off + 63) // 64 * 64
        out.append(off)
        off += nslots * leaf.nbytes
    if off > size:
        raise ValueError(f"staging of {size} bytes cannot hold {nslots} samples of {off // max(nslots, 1)} bytes")
    return out


class _Group:
    def __init__(self, msg: dict, fds: list[int], caches: dict) -> None:
        dfd, sfd = fds
        try:
            self._setup(msg, dfd, sfd, caches)
        except BaseException:
            try:
                os.close(sfd)
            except OSError:
                pass   # closed already (mapped)
            raise

    def _setup(self, msg: dict, dfd: int, sfd: int, caches: dict) -> None:
        try:   # pread: every worker's descriptor shares one file offset with the hub's
            size = os.fstat(dfd).st_size
            parts, off = [], 0
            while off < size:
                chunk = os.pread(dfd, min(size - off, 1 << 24), off)
                if not chunk:
                    break
                parts.append(chunk)
                off += len(chunk)
            blob = b"".join(parts)
        finally:
            os.close(dfd)
        for p in reversed(msg.get("sys_path") or []):
            if isinstance(p, str) and p not in sys.path:
                sys.path.insert(0, p)
        # the bytes come from a process of this same user (SO_PEERCRED-checked by the server)
        self.dataset = pickle.loads(blob)
        _check_code(self.dataset, msg)
        self.seed = int(msg["seed"])
        self.stride = int(msg["stride"])
        self.nslots = int(msg["slots"])
        self.bases = None   # leaf regions of staging, from the first sample's layout
        self.digest = msg["digest"]
        self.first_layout = str(msg.get("layout") or "another layout")[:300]
        size = os.fstat(sfd).st_size
        self.mm = mmap.mmap(sfd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.cache = None
        c = msg.get("cache")
        if c:
            self.cache = caches.get(c["fingerprint"])
            if self.cache is None:
                from ..cache import NodeCache

                self.cache = caches[c["fingerprint"]] = NodeCache.from_spec(c)
        from ..pipeline.engine import _make_reader

        self.peers = None
        if msg.get("peers") and self.cache is not None:   # (from a same-uid member, as the dataset)
            from ..peers.client import PeerClient

            try:
                self.peers = PeerClient.from_json(msg["peers"])
            except (KeyError, TypeError, ValueError):
                self.peers = None   # unusable: storage it is
        self.read, _ = _make_reader(self.dataset, self.cache, self.peers)
        self.layout = None
        self.rows = None    # per leaf, its staging region by slot (numpy, over mm), from the first sample
        from ..plan import EpochPlan

        p = msg["plan"]
        self.plan = EpochPlan(num_samples=int(p["num_samples"]), seed=self.seed, batch_size=None,
                              shuffle=bool(p["shuffle"]), drop_last=bool(p["drop_last"]),
                              rank=int(p["rank"]), world_size=int(p["world_size"]))
        self.n = self.plan.samples_per_epoch
        self._order = (-1, None)
        os.close(sfd)

    def index(self, g: int) -> tuple[int, int]:
        """(epoch, dataset index) of global position ``g``."""
        epoch, pos = divmod(g, self.n)
        if self._order[0] != epoch:
            self._order = (epoch, self.plan.indices(epoch))
            if self.peers is not None:
                self.peers.new_epoch()    # peers down last epoch get another chance
        return epoch, int(self._order[1][pos])

    def close(self) -> None:
        self.rows = None    # (they view mm)
        try:
            self.mm.close()
        except BufferError:
            pass   # the node cache stays: the daemon holds it while it runs (worker exit closes it)


class CodeMismatch(Exception):
    """This worker imported other code than the group's members run."""


def _check_code(dataset, msg: dict) -> None:
    """Prepare for a group only with the code its members run: the identity
    of the dataset as unpickled here (the modules this worker imported
    from the group's sys.path, its library versions) must be the one the
    members computed (``coordl.daemon.codeid``)."""
    want = msg.get("code")
    if not want:
        raise CodeMismatch("the job sent no code identity")
    from .codeid import Unidentified, identity_of

    try:
        have, desc = identity_of(dataset)
    except Unidentified as e:
        raise CodeMismatch(f"the daemon's worker cannot identify the dataset's code: {e}") from None
    if have != want:
        theirs = list(msg.get("code_desc") or [])
        diff = [d for d in desc if d not in theirs] + [d for d in theirs if d not in desc]
        names = sorted({d.split(" ")[0] for d in diff})
        raise CodeMismatch(
            "the daemon's workers would run other code than this job: "
            + (", ".join(names[:8]) or "the code") + " differ between the job and what the worker imports "
            "(a module edited after the job imported it, or a daemon started from another environment); "
            "restart the job to share, or stop the daemon (coordl daemon stop) if its environment differs")


def describe_layout(layout) -> str:
    """A one-sample layout for messages: each leaf's kind, dtype and shape."""
    if layout is None:
        return "no fixed layout"
    return ", ".join(f"{l.kind} {l.dtype} {tuple(l.shape)}" if l.kind in ("tensor", "numpy") else l.kind
                     for l in layout.leaves)


_describe = describe_layout


def _write(grp: _Group, slot: int, sample, epoch: int, g: int, i: int) -> str | None:
    """Write ``sample`` into ``slot``; a reason when it does not fit the layout."""
    import numpy as np

    from ..pipeline import collate as _collate

    layout = grp.layout
    if layout is None:
        layout = _collate.layout_of(sample, 1)
        if layout is None or layout_digest(layout) != grp.digest:
            return LAYOUT + f"sample {i}: {_describe(layout)}; the first: {grp.first_layout}"
        grp.bases = staging_bases(layout, grp.nslots, len(grp.mm))
        grp.layout = layout
    leaves = layout.leaves_of(sample)
    if leaves is None:
        return LAYOUT + f"sample {i}: {_describe(_collate.layout_of(sample, 1))}; the first: {_describe(layout)}"
    if grp.rows is None:   # per leaf, its region of staging as (slots, bytes per sample): a row per slot
        whole = np.frombuffer(grp.mm, dtype=np.uint8)
        grp.rows = [whole[b0:b0 + grp.nslots * leaf.nbytes].reshape(grp.nslots, leaf.nbytes)
                    for leaf, b0 in zip(layout.leaves, grp.bases)]
        del whole
    for rows, leaf, x in zip(grp.rows, layout.leaves, leaves):
        if leaf.nbytes:
            rows[slot] = _collate.leaf_bytes(x, leaf)   # one memcpy, no tensor made per sample
    HDR.pack_into(grp.mm, slot * HEADER, epoch, g, i, MARK)
    return None


def main(fd: int) -> int:
    from . import ipc
    import socket

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(1)
    from ..pipeline.prep import prep_sample
    from ..stats import BatchStats

    conn = ipc.Conn(socket.socket(fileno=fd), os.getppid())
    groups: dict[int, _Group] = {}
    caches: dict = {}   # fingerprint -> NodeCache, held while the daemon runs, across groups
    reads = ThreadPoolExecutor(4, thread_name_prefix="coordl-daemon-read")
    pending: list = []   # (task, group, read future) in arrival order
    replies: list = []   # finished samples not reported yet
    first_t = 0.0        # when the oldest of them finished

    def flush() -> None:
        if replies:   # no deadline: the daemon reads whenever it runs (it may be stopped a while)
            conn.send({"op": "done", "items": replies[:]}, timeout=None)
            replies.clear()

    poller = selectors.DefaultSelector()
    poller.register(conn.sock, selectors.EVENT_READ)
    conn.send({"op": "hello"}, timeout=None)   # imports done: from here the daemon times its progress

    def read(grp, i):
        t0 = time.perf_counter()
        try:
            data, src = grp.read(i)
            return data, src, None, time.perf_counter() - t0
        except BaseException as e:  # reported with the sample
            return None, None, e, time.perf_counter() - t0

    try:
        while True:
            if pending and not poller.select(0):
                msg, fds = None, []      # nothing new: prepare the oldest read
            else:                        # idle: wait for the daemon as long as it takes (EOF when it dies)
                msg, fds = conn.recv(timeout=None)
            if msg is not None:
                op = msg.get("op")
                if op == "stop":
                    return 0
                if op == "group":
                    try:
                        groups[int(msg["gid"])] = _Group(msg, fds, caches)
                        conn.send({"op": "group_ok", "gid": msg["gid"]}, timeout=None)
                    except BaseException as e:
                        if isinstance(e, KeyboardInterrupt):
                            raise
                        conn.send({"op": "group_failed", "gid": msg["gid"],
                                   "code": isinstance(e, CodeMismatch),
                                   "why": str(e) if isinstance(e, CodeMismatch) else f"{type(e).__name__}: {e}"},
                          timeout=None)
                    continue
                for f in fds:
                    os.close(f)
                if op == "drop":
                    grp = groups.pop(int(msg["gid"]), None)
                    if grp is not None:
                        grp.close()
                    continue
                if op == "prep":
                    grp = groups.get(int(msg["gid"]))
                    for g, slot in msg["tasks"]:
                        if grp is None:
                            replies.append({"gid": msg["gid"], "g": g, "ok": False,
                                            "why": "the worker has no such group"})
                            continue
                        try:   # (the daemon checks positions; a bad one is failed here, never fatal)
                            bad_slot = type(slot) is not int or not 0 <= slot < grp.nslots
                            if type(g) is not int or g < 0 or bad_slot:
                                raise ValueError(f"bad task {[g, slot]!r}")
                            epoch, i = grp.index(g)
                        except (ValueError, TypeError, IndexError) as e:
                            replies.append({"gid": msg["gid"], "g": g, "ok": False, "why": f"{e}"})
                            continue
                        task = {"gid": msg["gid"], "g": int(g), "slot": int(slot), "epoch": epoch, "i": i}
                        pending.append((task, grp, reads.submit(read, grp, i)))
                    if not pending:
                        flush()
                continue
            msg, grp, fut = pending.pop(0)
            data, src, err, fetch_s = fut.result()
            g, i, epoch = int(msg["g"]), int(msg["i"]), int(msg["epoch"])
            reply = {"gid": msg["gid"], "g": g}
            if err is not None:
                reply.update(ok=False, why=f"reading: {type(err).__name__}: {err}")
            else:
                st = BatchStats()
                t0 = time.perf_counter()
                try:
                    sample = prep_sample(grp.dataset, grp.seed, epoch, i, data, None, st, "raise")
                    why = _write(grp, int(msg["slot"]), sample, epoch, g, i)
                except BaseException as e:
                    if isinstance(e, KeyboardInterrupt):
                        raise
                    why = f"preparing: {type(e).__name__}: {e}"
                if why is None:
                    reply.update(ok=True, info=[src, len(data), fetch_s, time.perf_counter() - t0])
                else:
                    reply.update(ok=False, why=why)
            data = None
            if not replies:
                first_t = time.monotonic()
            replies.append(reply)
            if not pending or len(replies) >= _DONE_BATCH or time.monotonic() - first_t >= _DONE_WAIT:
                flush()
    except (ConnectionError, OSError):
        return 0  # the daemon is gone
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        reads.shutdown(wait=False, cancel_futures=True)
        for grp in groups.values():
            grp.close()
        for c in caches.values():
            c.close()


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[sys.argv.index("--fd") + 1])))
