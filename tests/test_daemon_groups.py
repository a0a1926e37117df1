"""The group policy (coordl.daemon.groups) as plain data: each sample
prepared once for every member at it, bounded staging, detach of the
member furthest behind, no deadlock, references released on leave."""
from coordl.daemon.groups import Group, Member


def run_worker(g: Group):
    """Prepare everything the group hands out now; the actions returned."""
    out = []
    while True:
        acts, task = g.next_task()
        out += acts
        if task is None:
            return out
        out += g.done(task[0], True, info=["storage", 1, 0.0, 0.0])


def tasks(g: Group) -> list:
    """Every position the group hands out now, in its order (none prepared)."""
    out = []
    while True:
        _, task = g.next_task()
        if task is None:
            return out
        out.append(task[0])


def two_members(nslots, n, names=("a", "b"), passes=((0, 0, None), (0, 0, None))):
    """A group with two members, each in a pass (epoch, start, end or n)."""
    g = Group(1, "k", nslots=nslots, samples_per_epoch=n)
    ms = [Member(k + 1, 10 + k, name) for k, name in enumerate(names)]
    for m, (epoch, start, end) in zip(ms, passes):
        g.add(m)
        g.begin_pass(m.mid, epoch, start, n if end is None else end)
    return (g, *ms)


def delivered(actions, m):
    return [x for a in actions if a[0] == "deliver" and a[1] is m for x in a[2]]


def test_members_at_the_same_positions_share_every_sample():
    g, a, b = two_members(16, 8)
    acts = g.step(1, 0, want=range(4)) + g.step(2, 0, want=range(4))
    acts += run_worker(g)
    assert sorted(delivered(acts, a)) == [0, 1, 2, 3] and sorted(delivered(acts, b)) == [0, 1, 2, 3]
    assert g.prepared == 4
    # b releases and moves on; a still holds its claims, so they stay staged
    g.step(2, 4, release=range(4))
    assert set(g.items) == {0, 1, 2, 3}
    g.step(1, 4, release=range(4))
    assert g.items == {} and len(g.free) == 16


def test_a_slower_member_takes_what_the_faster_one_caused():
    g, fast, slow = two_members(16, 8, ("fast", "slow"))
    g.step(1, 0, want=range(8))
    run_worker(g)
    g.step(1, 8, release=range(8))
    assert len(g.items) == 8          # kept: slow has not reached them
    acts = g.step(2, 0, want=range(8))
    assert sorted(delivered(acts, slow)) == list(range(8)) and g.prepared == 8


def test_full_staging_detaches_the_member_furthest_behind_not_the_leader():
    g, fast, slow = two_members(4, 100, ("fast", "slow"))
    g.step(2, 0, want=[0])
    run_worker(g)                      # slow holds sample 0 and stops consuming
    acts = []
    for pos in range(0, 12):
        acts += g.step(1, pos, release=[pos - 1] if pos else [], want=[pos], need=pos + 1)
        acts += run_worker(g)
        assert pos in delivered(acts, fast)     # the leader is never held back
    assert [a for a in acts if a[0] == "detach"] == [("detach", slow)]
    assert not slow.attached and not slow.claims and g.detaches == 1


def test_a_stalled_holder_is_revoked_rather_than_a_deadlock():
    g, a, b = two_members(4, 100, passes=((0, 40, None), (0, 0, None)))
    g.step(1, 40, want=[40, 41, 42, 43], need=44)  # a (ahead) claims every slot...
    run_worker(g)
    acts = g.step(2, 0, want=[0], need=1)          # ...and b, furthest behind, needs 0 now
    acts += run_worker(g)
    assert ("detach", a) in acts and 0 in delivered(acts, b)


def test_a_member_that_leaves_releases_everything():
    g = Group(1, "k", nslots=8, samples_per_epoch=8)
    a = Member(1, 10, "a")
    g.add(a)
    g.begin_pass(1, 0, 0, 8)
    g.step(1, 0, want=range(6))
    acts, task = g.next_task()           # one in a worker's hands
    g.remove(1)
    assert set(g.items) == {task[0]}     # only the slot a worker still writes
    g.done(task[0], True)
    assert g.items == {} and len(g.free) == 8


def test_failed_samples_are_delivered_as_failures():
    g = Group(1, "k", nslots=8, samples_per_epoch=8)
    a = Member(1, 10, "a")
    g.add(a)
    g.begin_pass(1, 0, 0, 8)
    g.step(1, 0, want=[0])
    _, (pos, _) = g.next_task()
    acts = g.done(pos, False, why="reading: OSError")
    assert delivered(acts, a) == [0] and g.items[0].state == "failed"


def test_a_member_that_finished_its_epoch_keeps_the_next_one_held():
    g, fast, slow = two_members(32, 8, ("fast", "slow"))
    g.step(2, 0, want=range(8))
    run_worker(g)
    g.end_pass(2, complete=True)            # slow finished epoch 0 (it consumed what it had)
    g.step(1, 0, want=range(8)), run_worker(g)
    g.end_pass(1, complete=True)
    g.begin_pass(1, 1, 8, 16)               # fast runs epoch 1 ahead of slow
    g.step(1, 8, want=range(8, 16)), run_worker(g)
    g.step(1, 16, release=range(8, 16))
    assert sorted(g.items) == list(range(8, 16))   # kept: slow is expected at epoch 1
    g.begin_pass(2, 1, 8, 16)
    acts = g.step(2, 8, want=range(8, 16))
    assert sorted(delivered(acts, slow)) == list(range(8, 16)) and g.prepared == 16
    g.end_pass(2)                           # stopped early (or detached): nothing kept for it
    g.end_pass(1)
    assert g.items == {}


def test_a_member_epochs_behind_takes_every_sample_within_the_bound():
    n = 8
    g, fast, slow = two_members(64, n, ("fast", "slow"))
    g.step(2, 0, want=[0]), run_worker(g)     # slow takes one sample, then falls behind
    for epoch in range(3):                   # fast runs three whole epochs ahead of it
        if epoch:
            g.begin_pass(1, epoch, epoch * n, (epoch + 1) * n)
        g.step(1, epoch * n, want=range(epoch * n, (epoch + 1) * n)), run_worker(g)
        g.step(1, (epoch + 1) * n, release=range(epoch * n, (epoch + 1) * n))
        g.end_pass(1, complete=True)
    assert sorted(g.items) == list(range(3 * n))  # all kept: staging holds them, slow is attached
    got = []
    for epoch in range(3):                   # slow catches up: nothing is prepared a second time
        if epoch:
            g.end_pass(2, complete=True)
            g.begin_pass(2, epoch, epoch * n, (epoch + 1) * n)
        acts = g.step(2, epoch * n, release=[0] if epoch == 0 else [],
                      want=range(epoch * n, (epoch + 1) * n)) + run_worker(g)
        got += delivered(acts, slow)
        g.step(2, (epoch + 1) * n, release=range(epoch * n, (epoch + 1) * n))
    assert got.count(0) == 1 and sorted(set(got)) == list(range(3 * n))
    assert g.prepared == 3 * n and slow.attached and g.detaches == 0


def test_pinned_items_survive_a_detach_until_released():
    """What a member asked to pin is never revoked (it may view those slots):
    not by a detach, not at the end of its pass; only its release (or its
    connection's close) frees them.  Pins are bounded per member."""
    g = Group(1, "k", nslots=16, samples_per_epoch=64)
    a = Member(1, 10, "a")
    g.add(a)
    g.begin_pass(1, 0, 0, 64)
    acts = g.step(1, 0, want=[0, 1, 2, 3], need=4, pin=[0, 4])
    assert ("pinned", a, [0, 4], []) in acts
    for _ in range(4):
        _, task = g.next_task()
        acts = g.done(task[0], True, info=["storage", 1, 0.0, 0.0])
        assert acts == [("deliver", a, [task[0]], [True])]     # each delivery says it pinned
    assert a.pinned == {0: 1, 1: 1, 2: 1, 3: 1} and not a.claims
    slots = sorted(g.items[x].slot for x in range(4))
    assert slots == list(range(slots[0], slots[0] + 4))     # consecutive positions, consecutive slots
    g.detach(a)
    g.end_pass(1)
    assert set(g.items) == {0, 1, 2, 3} and len(g.free) == 12   # still staged for its views
    g.release(1, [0, 1])
    assert set(g.items) == {0, 1, 2, 3}     # a release gives back claims, not pins
    g.release(1, unpin=[0, 1])
    assert set(g.items) == {2, 3}
    g.remove(1)                       # its connection closed
    assert not g.items and len(g.free) == 16
    b = Member(2, 11, "b")
    g.add(b)
    g.begin_pass(2, 0, 0, 64)
    assert not any(x[0] == "pinned" for x in g.step(2, 0, want=[0], need=1, pin=[0, 5]))   # > a quarter


def test_tasks_come_urgent_first_then_windows_lowest_first_whatever_the_members_ask():
    """The order ``next_task`` hands out work, checked on random requests from
    members at different places: first what some member needs for the batch
    it assembles (below its ``need``), lowest first, then the read-ahead
    windows, lowest first (the cheap path for the common case must keep it)."""
    import random

    rng = random.Random(7)
    for trial in range(200):
        n = 400
        g = Group(1, "k", nslots=4096, samples_per_epoch=n)
        members = []
        for k in range(rng.randint(1, 4)):
            m = Member(k + 1, 10 + k, f"m{k}")
            g.add(m)
            start = rng.randrange(0, 200)
            g.begin_pass(m.mid, 0, start, n)
            members.append(m)
        for m in members:
            pos = m.pos + rng.randrange(0, 20)
            batch = rng.randint(1, 16)
            window = rng.randint(0, 40)
            want = list(range(pos, min(n, pos + batch + window)))
            g.step(m.mid, pos, want=want, need=min(n, pos + batch))
        urgent = sorted({h for m in members for h in m.want if m.pos <= h < min(m.need, m.end)})
        rest = sorted({h for m in members for h in m.want} - set(urgent))
        got = tasks(g)
        assert got == urgent + rest, trial
        # what each member still waits for in its batch, kept as a count, matches its wants
        rng.shuffle(got)
        for h in got:
            g.done(h, True, info=["storage", 1, 0.0, 0.0])
            for m in members:
                assert m.short == sum(1 for w in m.want if m.pos <= w < min(m.need, m.end)), trial


def test_staging_in_use_stays_compact_and_batches_stay_runs_of_slots():
    """A run of positions takes a run of slots (a batch is then one view of
    staging, no copy), and turns back to the lowest free slot where a batch
    of every member begins once it has walked ``compact`` slots: the pages of
    staging in use stay few (walking on through all of staging touched every
    page of it) and no batch is split by the turn."""
    n, bs, window = 3000, 16, 32
    g = Group(1, "k", nslots=4096, samples_per_epoch=n, compact=64)
    members = [Member(k + 1, 10 + k, f"m{k}") for k in range(2)]
    for m in members:
        g.add(m)
        g.begin_pass(m.mid, 0, 0, n)
    highest, split = 0, 0
    for start in range(0, n, bs):
        slots = {}
        for m in members:
            want = list(range(start, min(n, start + bs + window)))
            acts = g.step(m.mid, start, release=list(range(max(0, start - bs), start)), want=want,
                          need=start + bs)
            while True:
                more, task = g.next_task()
                acts += more
                if task is None:
                    break
                highest = max(highest, task[1])
                acts += g.done(task[0], True, info=["storage", 1, 0.0, 0.0])
            assert not any(a[0] == "detach" for a in acts)
        batch = [g.items[h].slot for h in range(start, min(n, start + bs))]
        split += batch != list(range(batch[0], batch[0] + len(batch)))
    assert highest < 4 * 64, highest          # not a walk through all 4096 slots
    assert split == 0


def test_a_report_of_several_samples_is_one_delivery_per_member_with_what_each_waits_for():
    g, a, b = two_members(16, 8)
    g.step(1, 0, want=range(4), need=4)
    g.step(2, 0, want=[0, 2], need=1)
    handed = tasks(g)
    assert sorted(handed) == [0, 1, 2, 3]
    acts = g.done_many([(x, x != 3, "" if x != 3 else "broke", ["storage", 1, 0.0, 0.0]) for x in handed])
    assert [(x[0], x[1]) for x in acts] == [("deliver", a), ("deliver", b)]      # one each
    assert sorted(delivered(acts, a)) == [0, 1, 2, 3] and sorted(delivered(acts, b)) == [0, 2]
    assert a.short == 0 and b.short == 0 and not a.want and not b.want
    assert g.prepared == 3 and g.items[3].state == "failed"


def test_pins_are_counted_so_a_position_given_twice_stays_until_both_are_given_back():
    """A member given a position it still pins (it runs the epoch again, or
    rolls back, while it holds a view of it) holds two pins of it: giving
    one back (the second view died, or its copy was made) keeps the slot
    for the first view; a pin it was not given is not taken off."""
    g = Group(1, "k", nslots=16, samples_per_epoch=8)
    a = Member(1, 10, "a")
    g.add(a)
    for rnd in range(2):              # epoch 0, then epoch 0 again (set_epoch(0))
        g.begin_pass(1, 0, 0, 8)
        acts = g.step(1, 0, want=range(4), need=4, pin=[0, 4]) + run_worker(g)
        assert sorted(delivered(acts, a)) == [0, 1, 2, 3]
        g.end_pass(1)
    assert a.pinned == {0: 2, 1: 2, 2: 2, 3: 2}
    slots = {x: g.items[x].slot for x in range(4)}
    g.release(1, unpin=[0, 1, 2, 3, 0])     # the second view's pins (and one of 0 twice: the first view's)
    assert a.pinned == {1: 1, 2: 1, 3: 1} and set(g.items) == {1, 2, 3}
    assert {x: g.items[x].slot for x in (1, 2, 3)} == {x: slots[x] for x in (1, 2, 3)}
    g.release(1, unpin=[0, 5])              # pins it does not hold: nothing happens
    assert a.pinned == {1: 1, 2: 1, 3: 1}
    g.release(1, unpin=[1, 2, 3])
    assert not a.pinned and not g.items


def test_claims_in_a_pin_range_become_pins_and_the_answer_names_them():
    g = Group(1, "k", nslots=64, samples_per_epoch=64)
    a = Member(1, 10, "a")
    g.add(a)
    g.begin_pass(1, 0, 0, 64)
    acts = g.step(1, 0, want=range(8), need=2, pin=[0, 2]) + run_worker(g)
    flags = {x: p for act in acts if act[0] == "deliver" for x, p in zip(act[2], act[3])}
    assert flags == {x: x < 2 for x in range(8)}            # the read-ahead beyond the range is claimed
    assert a.claims == set(range(2, 8))
    acts = g.step(1, 2, release=[], want=[], need=4, pin=[2, 6], unpin=[0, 1])
    assert ("pinned", a, [2, 6], [2, 3, 4, 5]) in acts
    assert a.pinned == {2: 1, 3: 1, 4: 1, 5: 1} and a.claims == {6, 7}
    # pinned already: counted once against the bound (a quarter of 64 = 16 slots)
    assert any(x[0] == "pinned" for x in g.step(1, 2, need=4, pin=[2, 14]))
    assert not any(x[0] == "pinned" for x in g.step(1, 2, need=4, pin=[2, 20]))
