"""A group's staging and schedule, as plain data: who wants which sample,
which slot holds it, what to prepare next and whom to detach.  No I/O here:
the server (``server.py``) feeds events in and carries out the actions that
come back, so the policy is tested without processes (tests/test_daemon_groups.py).

Positions.  Members of a group share the epoch plan, so a sample is named by
its *global position* ``G = epoch * samples_per_epoch + position``; the same
``G`` is the same prepared sample for every member (same index, same
augmentation).

A staged sample (``Item``) is kept while someone may still take it:

* *claimed*: delivered to a member that has not released it yet, or wanted
  by a member that is waiting for it;
* *held*: an attached member has not reached it yet (``G >= m.pos``), in
  this pass or in a later epoch, so a slower member takes what a faster one
  caused to be prepared, across any number of epoch boundaries, for as long
  as staging holds it.  (Holding only the next epoch made a member more
  than an epoch behind have samples prepared twice while it was still well
  inside the staging bound: measured, a 1/3-speed member cost the fast ones
  12-25% of their speed without ever being detached.)

Bounded staging, no lockstep.  Staging has a fixed number of slots.  When a
sample must be prepared and no slot is free, the room is made by detaching
the member furthest behind (unless it is the one asking): everything kept
for it, claims included, is dropped and it prepares for itself until its
next pass (members check a slot's header around each copy, so a revoked
slot is never mistaken for their sample).  A
fast member therefore runs ahead of a slow one by at most the staging size
and is never held back beyond it.  If the one asking is itself furthest
behind, samples held only for it far ahead are dropped instead (it will ask
for them again).  If every slot is claimed and the asker needs the sample
now (it is in the batch it assembles), the largest other holder is
detached (a slow or stalled member), or the asker itself when nobody else
holds anything: no wait in the daemon can become a deadlock.

Pins.  A member that hands out views of staging (zero-copy batches) asks
that what it is given of a range of positions be *pinned*: kept in its slot
whatever happens (a detach, the end of its pass) until the member gives the
pin back or its connection closes.  Pins are counted per member and
position: a member given the same position twice while it still views it
(it runs an epoch again, or rolls back with ``load_state_dict``, while
holding a batch of it) holds two pins, and the slot stays until both are
given back.  Each delivery says whether it pinned, and the member gives
back exactly the pins it was told of.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

__all__ = ["Group", "Member", "Item"]


@dataclass
class Item:
    slot: int
    state: str = "prep"        # "prep" (a worker has it), "ready", "failed"
    why: str = ""              # for "failed"
    info: list = field(default_factory=list)  # [source, nbytes, fetch_s, prep_s] when ready


@dataclass
class Member:
    mid: int
    pid: int
    name: str
    num_workers: int = 0
    attached: bool = False     # in the shared stream for its current pass
    epoch: int = -1
    pos: int = 0               # lowest global position of its pass it may still take
    end: int = 0               # end of its current pass (exclusive)
    want: set = field(default_factory=set)     # asked for, not delivered yet
    claims: set = field(default_factory=set)   # delivered, not released yet
    shared: int = 0            # samples it reports taken from the stream
    self_prepared: int = 0     # samples it reports it prepared itself
    need: int = 0              # end of the batch it is assembling now (it waits for what is below)
    short: int = 0             # of ``want``, how many are in [pos, need): what it still waits for now
    pinned: dict = field(default_factory=dict)  # G -> pins: deliveries never revoked until unpinned, counted
    pin: tuple = (0, 0)        # positions [lo, hi) that are pinned as they are delivered to it
    pass_id: int = 0           # the job's number for its current pass (the server tags what it sends with it)


def _may_pin(pin, m: Member, nslots: int) -> bool:
    """Whether ``m`` may pin ``pin``: at most a quarter of staging's slots
    pinned per member (views included, a position it pins already counted
    once), so a member that stops reading leaves the others room."""
    lo, hi = pin
    if not 0 <= hi - lo <= nslots // 4:
        return False
    pinned = m.pinned
    return len(pinned) + sum(1 for g in range(lo, hi) if g not in pinned) <= nslots // 4


class _FreeSlots:
    """The free slots of staging: a set for membership, and a heap beside it
    (entries of slots taken since are skipped when they surface) so the
    lowest free slot costs O(log n), not a scan of thousands per sample."""

    def __init__(self, n: int) -> None:
        self._set = set(range(n))
        self._heap = list(range(n))
        self._n = n

    def __contains__(self, slot: int) -> bool:
        return slot in self._set

    def __bool__(self) -> bool:
        return bool(self._set)

    def __len__(self) -> int:
        return len(self._set)

    def add(self, slot: int) -> None:
        if slot not in self._set:
            self._set.add(slot)
            heapq.heappush(self._heap, slot)
            if len(self._heap) > 2 * self._n:     # mostly stale entries: start again from the set
                self._heap = sorted(self._set)

    def discard(self, slot: int) -> None:
        self._set.discard(slot)

    def lowest(self) -> int:
        while self._heap[0] not in self._set:
            heapq.heappop(self._heap)
        return self._heap[0]


class Group:
    """One group's staging slots, items, members and queue of work.

    Methods return *actions* for the server to carry out:
    ``("deliver", member, [G, ...])``, ``("detach", member)``.  Work to hand
    to workers comes from :meth:`next_task`.
    """

    def __init__(self, gid: int, key: str, nslots: int, samples_per_epoch: int, compact: int = 256) -> None:
        if nslots < 1:
            raise ValueError(f"nslots should be >= 1, but got nslots={nslots!r}")
        self.gid = gid
        self.key = key
        self.nslots = nslots
        self.n = max(1, samples_per_epoch)
        self.free = _FreeSlots(nslots)
        self.compact = max(1, compact)   # slots a run of positions walks through before turning back
        self.items: dict[int, Item] = {}
        self.members: dict[int, Member] = {}
        self._queue: list[int] = []            # heap of positions to prepare
        self._queued: set[int] = set()
        self.prepared = 0                      # samples prepared by the group's workers
        self.detaches = 0

    # ---------------------------------------------------------------- members
    def add(self, m: Member) -> None:
        self.members[m.mid] = m

    def remove(self, mid: int) -> list:
        """A member left (or died): drop everything it held."""
        m = self.members.pop(mid, None)
        if m is not None:
            m.want.clear()
            m.short = 0
            m.claims.clear()
            m.pinned.clear()    # its connection closed: no view of staging is left in it
            m.attached = False
        self.gc()
        return []

    def begin_pass(self, mid: int, epoch: int, start: int, end: int) -> list:
        """Member ``mid`` starts a pass over global positions [start, end)."""
        m = self.members[mid]
        m.claims.clear()
        m.want.clear()
        m.short = 0
        m.attached = True
        m.pin = (0, 0)
        m.epoch, m.pos, m.end = epoch, start, end
        self.gc()
        return []

    def end_pass(self, mid: int, complete: bool = False) -> list:
        """Member ``mid``'s pass is over.  After a ``complete`` pass it is
        expected to run the next epoch, so what the others prepare of that
        epoch is kept for it (a slower member then shares across epoch
        boundaries); otherwise (it was detached, or stopped early) it leaves
        the stream until its next pass."""
        m = self.members[mid]
        m.want.clear()
        m.short = 0
        m.claims.clear()
        if complete and m.attached:
            m.epoch += 1
            m.pos, m.end = m.end, m.end + self.n
            m.need = m.pos
        else:
            m.attached = False
        self.gc()
        return []

    def release(self, mid: int, gs=(), unpin=()) -> None:
        """Member ``mid`` no longer uses its claims of ``gs``, and gives back
        one pin of each of ``unpin`` (a position twice: two pins)."""
        m = self.members[mid]
        gs = [g for g in gs if g in m.claims]
        for g in gs:
            m.claims.discard(g)
        self.gc(gs + self._unpin(m, unpin))

    def unpin(self, mid: int, gs) -> None:
        """One pin of each of ``gs`` given back (by member ``mid``, or for it:
        pins it was never told of)."""
        m = self.members.get(mid)
        if m is not None:
            self.gc(self._unpin(m, gs))

    @staticmethod
    def _unpin(m: Member, gs) -> list:
        """Take one pin of each of ``gs`` off ``m``'s counts; the positions it
        no longer pins.  A position it holds no pin of is passed over (pins
        are counted: one given back too many would free the slot of a view
        the job still holds)."""
        pinned, gone = m.pinned, []
        for g in gs:
            c = pinned.get(g)
            if c is None:
                continue
            if c > 1:
                pinned[g] = c - 1
            else:
                del pinned[g]
                gone.append(g)
        return gone

    def step(self, mid: int, pos: int, release=(), want=(), need: int | None = None, pin=None,
             unpin=()) -> list:
        """Member ``mid`` is at ``pos``, is done with its claims of
        ``release``, gives back a pin of each of ``unpin``, and asks for
        ``want`` (ascending).  Ready items are delivered at once; the others
        are queued for a worker.

        ``pin`` ``[lo, hi)``: what it has been given of those positions, and
        what it will be given, is *pinned*: never revoked (not by a detach
        either) until it gives the pin back or its connection closes, so it
        may hand out views of those slots (zero-copy batches).  Pins are
        counted per position: a member given a position twice (it runs an
        epoch again while it still holds a view of it) holds two pins, and
        gives back each on its own.  A delivery says whether it pinned
        (``("deliver", m, [G, ...], [pinned, ...])``); the claims it had in
        the range become pins, answered with ``("pinned", m, [lo, hi],
        [G, ...])`` (those positions), unless it is detached."""
        m = self.members[mid]
        old = m.pos
        m.pos = max(m.pos, pos)
        m.need = max(m.pos, need if need is not None else pos + 1)
        for g in release:
            m.claims.discard(g)
        # only what it released or moved past may be free now
        if m.pos - old <= len(self.items):
            passed = {h for h in range(old, m.pos) if h in self.items}
        else:
            passed = {h for h in self.items if old <= h < m.pos}
        maybe = set(release) | passed
        maybe.update(self._unpin(m, unpin))
        out = []
        if m.attached:
            if pin is not None and _may_pin(pin, m, self.nslots):
                lo, hi = pin
                m.pin = (lo, hi)
                made = sorted(g for g in m.claims if lo <= g < hi)
                for g in made:
                    m.claims.discard(g)
                    m.pinned[g] = m.pinned.get(g, 0) + 1
                out.append(("pinned", m, [lo, hi], made))
            now, pins = [], []
            for g in want:
                if not m.pos <= g < m.end:
                    continue                 # outside its pass: nobody will prepare that for it
                it = self.items.get(g)
                if it is not None and it.state != "prep":
                    pins.append(self._give(m, g))
                    now.append(g)
                else:
                    m.want.add(g)
                    if it is None and g not in self._queued:
                        heapq.heappush(self._queue, g)
                        self._queued.add(g)
            if now:
                out.append(("deliver", m, now, pins))
        m.short = sum(1 for w in m.want if m.pos <= w < m.need)
        self.gc(maybe)
        return out

    # ---------------------------------------------------------------- work
    def next_task(self) -> tuple[list, tuple[int, int] | None]:
        """``(actions, (G, slot) or None)``: the next position to prepare,
        with the slot it goes into (room made if needed).

        Urgent first: a position some member needs for the batch it
        assembles now (below its ``need``), lowest first; then the others
        (read-ahead windows), lowest first.  A position that cannot get a
        slot now (every slot claimed, nobody to detach) is passed over, not
        waited on: one stalled member's window never holds back another
        member's request (no head-of-line blocking)."""
        actions: list = []
        queue, queued = self._queue, self._queued
        while queue and (queue[0] not in queued or queue[0] in self.items):
            heapq.heappop(queue)         # stale entries: taken already, or a slot since
        if not queue:
            return actions, None         # (every queued position has an entry in the heap)
        # the common case, cheaply: the lowest queued position is needed now by someone (it is
        # then the lowest urgent one too); only otherwise look for urgent ones further up
        g = queue[0]
        if any(m.attached and m.pos <= g < m.need and g < m.end and g in m.want
               for m in self.members.values()):
            slot = self._slot_for(g, actions)
            if slot is not None:
                heapq.heappop(queue)
                return actions, (g, slot)
        # (a member whose batch ends at or below the lowest queued position has nothing urgent queued)
        urgent = sorted({h for m in self.members.values() if m.attached and m.want and g < min(m.need, m.end)
                         for h in self._urgent(m) if h in queued})
        for g in urgent:
            slot = self._slot_for(g, actions)
            if slot is not None:
                return actions, (g, slot)
        skipped = []
        try:
            while self._queue:
                g = heapq.heappop(self._queue)
                if g not in self._queued or g in self.items:
                    continue                 # taken already (urgent), or a stale entry
                if not any(g in m.want for m in self.members.values()):
                    self._queued.discard(g)  # nobody waits for it any more
                    continue
                slot = self._slot_for(g, actions)
                if slot is not None:
                    return actions, (g, slot)
                skipped.append(g)            # no room for it now: look further
                if not self.free and len(skipped) > 4 * len(self.members) + 4:
                    break                    # nobody can be detached for these either
        finally:
            for g in skipped:
                heapq.heappush(self._queue, g)
        return actions, None

    @staticmethod
    def _urgent(m: Member):
        """What ``m`` asked for and needs for the batch it assembles now."""
        lo, hi = m.pos, min(m.need, m.end)
        if hi - lo > len(m.want):
            return [g for g in m.want if lo <= g < hi]
        return [g for g in range(lo, hi) if g in m.want]

    def _slot_for(self, g: int, actions: list) -> int | None:
        """A slot for position ``g`` (room made if the policy allows), or None."""
        while not self.free:
            acts = self._make_room(g)
            actions += acts
            if not acts and not self.free:
                return None
        self._queued.discard(g)
        # position G in the slot after G - 1's when that one is free: a run of positions is a
        # run of slots, and a batch of them one contiguous view of staging (no copy in the
        # member); else the lowest free slot.  Past ``compact`` slots or twice what is staged,
        # a run turns back to the lowest free slot where a batch of every member begins (a
        # split batch is copied by every member), so staging in use stays compact: walking on
        # through all of it touched every page, a fault and zeroing each (docs/architecture.md)
        prev = self.items.get(g - 1)
        slot = prev.slot + 1 if prev is not None else -1
        if slot not in self.free:
            slot = self.free.lowest()
        else:
            far = max(self.compact, 2 * len(self.items))
            if slot >= 2 * far or (slot >= far and self._batches_begin_at(g)):
                slot = self.free.lowest()
        self.free.discard(slot)
        self.items[g] = Item(slot)
        return slot

    def _batches_begin_at(self, g: int) -> bool:
        """Whether ``g`` begins a batch of every attached member, judged from
        the batch each assembles now (its positions [pos, need) and their
        count, batches being consecutive runs of positions)."""
        for m in self.members.values():
            b = m.need - m.pos
            if m.attached and b > 0 and g >= m.pos and (g - m.pos) % b:
                return False
        return True

    def requeue(self, g: int) -> None:
        """The worker preparing ``g`` is gone before it finished: free its
        slot (the worker was SIGKILLed and reaped) and queue ``g`` again for
        whoever still wants it."""
        it = self.items.get(g)
        if it is None or it.state != "prep":
            return
        self.free.add(self.items.pop(g).slot)
        if g not in self._queued and any(g in m.want for m in self.members.values()):
            heapq.heappush(self._queue, g)
            self._queued.add(g)

    def excuse(self, gs) -> list:
        """The members that wait for any of ``gs`` now (in the batch they
        assemble) stop waiting for them and prepare them themselves (the
        worker that has them makes no progress, or none is ready): ``[(member,
        [G, ...]), ...]``.  An item a worker has stays its: its slot is
        written when the worker finishes, for whoever takes it then."""
        out = []
        gs = set(gs)
        for m in self.members.values():
            if not m.attached:
                continue
            mine = sorted(g for g in gs if g in m.want and m.pos <= g < m.need)
            if mine:
                m.want.difference_update(mine)
                m.short = sum(1 for w in m.want if m.pos <= w < m.need)
                out.append((m, mine))
        return out

    def done(self, g: int, ok: bool, why: str = "", info=None) -> list:
        """A worker finished position ``g``: deliver it to whoever waits."""
        return self.done_many([(g, ok, why, info)])

    def done_many(self, results) -> list:
        """Workers finished ``results`` (``(g, ok, why, info)`` each): one
        ``deliver`` action per member that waits for any of them, with all
        of those it waits for (a worker reports several samples at once),
        and whether each pinned."""
        out: dict[int, tuple] = {}
        members = self.members.values()
        for g, ok, why, info in results:
            it = self.items.get(g)
            if it is None:
                continue
            if ok:
                it.state, it.info = "ready", list(info or [])
                self.prepared += 1
            else:
                it.state, it.why = "failed", why
            for m in members:
                if g in m.want:
                    m.want.discard(g)
                    if m.pos <= g < m.need:
                        m.short -= 1
                    pinned = self._give(m, g)
                    a = out.get(m.mid)
                    if a is None:
                        out[m.mid] = ("deliver", m, [g], [pinned])
                    else:
                        a[2].append(g)
                        a[3].append(pinned)
            if not self._needed(g, it):      # nothing else changed: only this one may be free now
                self.free.add(self.items.pop(g).slot)
        return list(out.values())

    # ---------------------------------------------------------------- policy
    @staticmethod
    def _give(m: Member, g: int) -> bool:
        """``g`` is delivered to ``m``: claimed, or pinned (one more pin) if in
        its pin range; whether it pinned."""
        if m.pin[0] <= g < m.pin[1]:
            m.pinned[g] = m.pinned.get(g, 0) + 1
            return True
        m.claims.add(g)
        return False

    def _needed(self, g: int, it: Item) -> bool:
        if it.state == "prep":
            return True                      # a worker writes into its slot
        for m in self.members.values():   # (_holds inlined: this runs for every sample a member passes)
            if (m.attached and g >= m.pos) or g in m.claims or g in m.pinned or g in m.want:
                return True
        return False

    @staticmethod
    def _holds(m: Member, g: int) -> bool:
        """Whether ``g`` is kept for ``m``: it is attached and has not reached
        it (a member that completes a pass stays attached for the next one;
        one that stops running leaves, and its holds go with it)."""
        return m.attached and g >= m.pos

    def gc(self, only=None) -> None:
        """Free every item nobody may take any more (of ``only``, when given)."""
        items = self.items
        # held for the attached member furthest behind, or later: kept, no need to look further
        low = min((m.pos for m in self.members.values() if m.attached), default=None)
        if only is None:
            dead = [g for g, it in items.items() if (low is None or g < low) and not self._needed(g, it)]
        else:
            dead = [g for g in only if g in items and (low is None or g < low) and not self._needed(g, items[g])]
        for g in dead:
            self.free.add(self.items.pop(g).slot)

    def detach(self, m: Member) -> list:
        """``m`` leaves the stream until its next pass and prepares for itself.
        Its claims are revoked too: it checks each slot's header before and
        after copying, so a reused slot is never taken for its sample."""
        m.attached = False
        m.want.clear()
        m.short = 0
        m.claims.clear()
        self.detaches += 1
        self.gc()
        return [("detach", m)]

    def _make_room(self, g: int) -> list:
        asking = [m for m in self.members.values() if g in m.want]
        attached = sorted((m for m in self.members.values() if m.attached), key=lambda m: m.pos)
        if len(attached) > 1 and not any(m is attached[0] for m in asking):
            m0 = attached[0]     # furthest behind: what is kept for it is what fills staging
            if m0.claims or any(self._holds(m0, h) for h in self.items):
                return self.detach(m0)
        # the asker is furthest behind: drop what is held only for the future, furthest first
        for h in sorted(self.items, reverse=True):
            if h <= g:
                break
            it = self.items[h]
            if it.state == "prep" or any(h in m.claims or h in m.want or h in m.pinned
                                         for m in self.members.values()):
                continue
            self.free.add(self.items.pop(h).slot)
            return []
        # every slot is claimed.  A member that needs this sample now would wait for
        # others to release theirs; if it needs it now, revoke the largest other holder
        # (a slow or stalled member), or its own window if nobody else holds anything
        if any(g < m.need for m in asking):
            foot = {m.mid: len(m.claims) + sum(1 for h in self.items if self._holds(m, h))
                    for m in self.members.values()}
            others = [m for m in self.members.values() if m not in asking and foot[m.mid]]
            if others:
                return self.detach(max(others, key=lambda m: foot[m.mid]))
            holders = [m for m in asking if m.claims]
            if holders and all(any(w < m.need for w in m.want) for m in holders):
                return self.detach(max(holders, key=lambda m: len(m.claims)))
        return []

    # ---------------------------------------------------------------- report
    def lead(self) -> int:
        att = [m.pos for m in self.members.values() if m.attached]
        return max(att) if att else 0

    def status(self) -> dict:
        lead = self.lead()
        return {
            "id": self.gid, "key": self.key[:16], "slots": self.nslots,
            "staged": sum(1 for it in self.items.values() if it.state != "prep"),
            "preparing": sum(1 for it in self.items.values() if it.state == "prep"),
            "prepared": self.prepared, "detaches": self.detaches,
            "members": [{
                "pid": m.pid, "name": m.name, "attached": m.attached, "epoch": m.epoch,
                "position": m.pos - max(m.epoch, 0) * self.n, "lag": max(0, lead - m.pos) if m.attached else None,
                "shared": m.shared, "self": m.self_prepared, "num_workers": m.num_workers,
                "pinned": len(m.pinned), "pins": sum(m.pinned.values()),
            } for m in self.members.values()],
        }
