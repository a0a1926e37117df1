"""Pins of the daemon's staging (``share=True``): a batch handed out as a
view of staging keeps its slots pinned until its tensors die, however
often the job views the same positions again (pins are counted, not a
set); a pass that ends early gives back what it pinned for its read-ahead;
a job that finds its samples staged already still reads the answers that
let it view them."""
import gc
import itertools
import time

import pytest
import torch

import coordl
from coordl import transforms as T
from coordl.base import reaper as _reaper
from coordl.daemon import server as S


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    from coordl.synth import make_image_folder

    root = tmp_path_factory.mktemp("pins") / "photos"
    make_image_folder(root, num_images=48, num_classes=4, image_size=(64, 48), mean_kb=4)
    return str(root)


@pytest.fixture
def daemon_settings():
    """For conftest's ``daemon_env``: 128 slots of staging (six epochs of 48
    samples go round it twice)."""
    return {"COORDL_STAGING": "408KiB"}


def dataset(root):
    return coordl.ImageFolder(root, transform=T.Compose(
        [T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.PILToTensor()]))


def loader(root, bs=8, share=True):
    return coordl.DataLoader(dataset(root), batch_size=bs, seed=7, share=share)


def reference(root, epochs, bs=8):
    ld = loader(root, bs, share=False)
    return [list(ld) for _ in range(epochs)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def zero_copy(ld) -> int:
    return ld.stats().batches_zero_copy


def hold_batch_one(ld):
    """Batch 1 of the loader's next pass, which is then left; batch 0 of a
    loader's first pass holds the sample it prepared itself to learn the
    layout, so batch 1 is the first that can be a view of staging."""
    it = iter(ld)
    next(it)
    before = zero_copy(ld)
    held = next(it)
    assert zero_copy(ld) == before + 1, "the held batch should be a view of staging"
    return held


def member_pins() -> list[int]:
    """Slots the daemon holds pinned for each member, as its status tells."""
    st = S.status()
    return [m["pinned"] for g in st["groups"] for m in g["members"]]


def settle_pins(want: list[int], timeout: float = 10.0) -> list[int]:
    """The members' pins once the daemon has read what the jobs sent (it
    reads each connection in its own time), or as they are at the timeout."""
    gc.collect()
    _reaper.flush()
    deadline = time.monotonic() + timeout
    while True:
        got = member_pins()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


# --------------------------------------------------------------------------- held batches
def test_a_held_batch_keeps_its_rows_while_the_job_runs_its_epochs_again_from_epoch_0(photos, daemon_env):
    """``example = next(iter(loader))``-style holding, then the usual
    ``for epoch in range(...): loader.set_epoch(epoch)`` loop from epoch 0:
    the job views (or copies) the held batch's positions a second time, and
    releasing that second use must not unpin the slots the held batch
    still maps, while later epochs go round staging and reuse free slots."""
    ref = reference(photos, epochs=6)
    ld = loader(photos)
    held = hold_batch_one(ld)
    for rnd in range(2):
        for epoch in range(6):
            ld.set_epoch(epoch)
            for k, b in enumerate(ld):
                assert same([b], [ref[epoch][k]]), (rnd, epoch, k)
            assert same([held], [ref[0][1]]), f"the held batch changed in epoch {epoch} of round {rnd}"
    assert ld.stats().samples_shared > 500
    del held, b
    assert settle_pins([0]) == [0]     # and its pins go with it


def test_held_batches_of_two_jobs_keep_their_rows(photos, daemon_env):
    ref = reference(photos, epochs=6)
    a, b = loader(photos), loader(photos)
    held = [hold_batch_one(a), hold_batch_one(b)]
    for epoch in range(6):
        for ld in (a, b):
            ld.set_epoch(epoch)
        for k, (x, y) in enumerate(itertools.zip_longest(a, b)):
            assert same([x, y], [ref[epoch][k]] * 2), (epoch, k)
        assert all(same([h], [ref[0][1]]) for h in held), f"a held batch changed in epoch {epoch}"


def test_a_held_batch_keeps_its_rows_across_a_load_state_dict_rollback(photos, daemon_env):
    """A state saved before the held batch, restored after the epoch: the
    rerun views the held batch's positions again."""
    ref = reference(photos, epochs=6)
    ld = loader(photos)
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    before = zero_copy(ld)
    held = next(it)
    assert zero_copy(ld) == before + 1
    rest = [x for x in it]
    assert same(rest, ref[0][2:])
    del it, rest
    for _ in range(2):
        ld.load_state_dict(state)            # back to batch 1 of epoch 0
        assert same(list(ld), ref[0][1:])
        for epoch in range(1, 6):
            assert same(list(ld), ref[epoch]), epoch
            assert same([held], [ref[0][1]]), f"the held batch changed in epoch {epoch}"


# --------------------------------------------------------------------------- early exits
def test_a_pass_left_early_gives_back_its_read_ahead_pins(photos, daemon_env, monkeypatch):
    """Passes left early (a batch for a model summary, ``break``,
    limit-batches loops, an iterator kept while a new pass starts) give
    back what the daemon pinned for their read-ahead when they end: the job
    then holds pinned only the slots of the batch it keeps, and its later
    full epochs are views of staging again (it could pin nothing more once
    the left passes' pins filled its quarter of staging)."""
    monkeypatch.setenv("COORDL_STAGING", "1MiB")    # 320 slots: a job may pin 80 and view 40
    ref = reference(photos, epochs=13)
    ld = loader(photos)
    example = next(iter(ld))                      # epoch 0
    before = zero_copy(ld)
    for kept in ld:                               # epoch 1
        break
    assert zero_copy(ld) == before + 1, "the kept batch should be a view of staging"
    for epoch in range(2, 8):                     # limit-batches loops of 1 to 3 batches
        for k, x in enumerate(ld):
            if k == epoch % 3:
                break
    left = iter(ld)                               # epoch 8: left, still referenced, when...
    next(left)
    next(left)
    for x in ld:                                  # ...epoch 9 runs
        pass
    del x
    assert same([example, kept], [ref[0][0], ref[1][0]])
    assert settle_pins([8]) == [8], "only the kept batch's 8 slots should stay pinned"
    for epoch in (10, 11, 12):
        for k, x in enumerate(ld):
            assert same([x], [ref[epoch][k]])
            time.sleep(0.01)                          # the training step: the daemon's pin answers arrive
        del x
    views = [e.batches_zero_copy for e in ld.stats().epochs[-3:]]
    # (with the left passes' pins kept, almost none could be; a batch whose pins come late under load is
    # still copied now and then, so the bound is over the three epochs, at half of them: 4 of 6 in one
    # epoch were seen in a loaded full run without the training step)
    assert sum(views) >= 9, f"batches of 6 viewed in the later full epochs: {views}"
    assert same([kept], [ref[1][0]])
    del kept
    assert settle_pins([0]) == [0]
    del left


# --------------------------------------------------------------------------- a job behind another
def test_a_job_whose_samples_are_staged_already_gets_its_batches_as_views(photos, daemon_env, monkeypatch):
    """A job behind another finds every sample it asks for staged: the
    daemon answers its pin requests at once, and the job must read those
    answers (what is already on its socket) before it decides to copy."""
    monkeypatch.setenv("COORDL_STAGING", "4MiB")
    ref = reference(photos, epochs=2, bs=4)
    fast, slow = loader(photos, bs=4), loader(photos, bs=4)
    for epoch in range(2):
        assert same(list(fast), ref[epoch])
        for k, x in enumerate(slow):
            assert same([x], [ref[epoch][k]])
            time.sleep(0.01)                          # the training step
        del x
    views = [e.batches_zero_copy for e in slow.stats().epochs]
    # 12 batches an epoch (batch 0 of the first pass holds the sample it prepared itself). A job
    # that reads one message at a time gets about 2 of 12 as views; one that reads what is on
    # its socket gets 11-12 on an idle machine. The job never waits for a pin's answer, so under
    # a heavily loaded machine a late answer costs a view now and then (9 of 12 seen): the bound
    # tells the two apart without depending on the machine's load
    assert sum(views) >= 16, f"batches of 2 x 12 the slower job got as views: {views}"


# --------------------------------------------------------------------------- the job's count of its pins
def test_the_jobs_count_of_its_pins_gives_each_back_once_and_never_one_a_view_uses():
    """Without a daemon (the other end of a socket pair plays it): two
    passes are given the same position, pinned, in the same slot; the first
    views it, the second is done with it without viewing. One pin goes back
    when the second is done with it, the other only when the view dies; the
    second cannot view it while the first view lives; what comes for a pass
    that is over goes back as it is read."""
    import mmap
    import socket

    from coordl.daemon import ipc
    from coordl.daemon.shared_iter import _Link

    info = ["storage", 1, 0.0, 0.0]
    a, b = socket.socketpair()
    daemon = ipc.Conn(b, 0)
    link = _Link(ipc.Conn(a, 0), mmap.mmap(-1, 4096), 64, 1, 16, [0], -1)
    given_back = []

    def read():
        b.setblocking(False)      # (send gave it a timeout)
        for msg, _ in daemon.read_ready():
            given_back.extend(msg.get("unpin", []))

    try:
        first = link.begin()
        daemon.send({"op": "ready", "pass": first.pid, "items": [[3, 5, True, info, True]]})
        assert link.pump() == 1 and 3 in first.got and link.pins == {(3, 5): 1}
        assert link.take_view([(3, 5)])                    # the first pass views it
        first.pinned.discard((3, 5))
        first.got.clear()
        first.end(complete=True)
        second = link.begin()
        daemon.send({"op": "ready", "pass": second.pid, "items": [[3, 5, True, info, True]]})
        daemon.send({"op": "ready", "pass": first.pid, "items": [[4, 6, True, info, True]]})   # late, for the first
        assert link.pump() == 2 and link.pins == {(3, 5): 2}
        assert not link.take_view([(4, 6)])                # given back as read: no pin left to view it with
        second.got.pop(3)
        second.done([(3, 5)])                              # copied: its own pin goes back...
        assert link.pins == {(3, 5): 1} and link.held == {(3, 5): 1}
        second.done([(3, 5)])                              # ...once
        assert link.pins == {(3, 5): 1}
        assert not link.take_view([(3, 5)])                # the one pin left is the first view's
        link.view_gone([(3, 5)])
        assert link.pins == {} and link.held == {} and link.views == 0
        second.end()
        read()
        assert sorted(given_back) == [3, 3, 4]
    finally:
        link.close()
        daemon.close()


# --------------------------------------------------------------------------- pins given back while idle
def _idle_link():
    """A link over a socket pair (the far end stands in for the daemon, not
    reading until told), with one pin of position 5 a live view uses."""
    import mmap
    import socket

    from coordl.daemon import ipc
    from coordl.daemon.shared_iter import _Link

    _reaper.start()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    link = _Link(ipc.Conn(a, 0), mmap.mmap(-1, 4096), 64, 1, 1, [0], -1)
    link.told([(5, 0)])
    assert link.take_view([(5, 0)])
    b.setblocking(False)
    return link, ipc.Conn(b, 0)


def _released(daemon, timeout: float = 10.0) -> list:
    """What the stand-in daemon reads until a message gives position 5 back
    (or the timeout): the unpins it saw."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        for msg, _ in daemon.read_ready():
            seen += msg.get("unpin", [])
        if 5 in seen:
            break
        time.sleep(0.02)
    return seen


def _dies_and_goes_back(link, daemon) -> None:
    """The view of position 5 dies while no pass runs: the daemon reads its
    pin given back (without a further message from the job)."""
    try:
        link.view_gone([(5, 0)])
        _reaper.flush()
        assert 5 in _released(daemon)
    finally:
        link._close_now()
        daemon.close()


def test_a_view_that_dies_while_the_socket_is_full_still_gives_its_pin_back():
    """No pass runs and the daemon reads late (the socket is full when the
    view dies): the release that does not fit goes out once the daemon
    reads, without waiting for the job's next message (a job between
    passes may send none for a long time, and the slot stays pinned)."""
    link, daemon = _idle_link()
    while True:                               # the daemon has not read: the socket fills
        link.conn.queue({"op": "noise", "pad": "x" * 65536})
        if not link.conn.write_ready():
            break
    _dies_and_goes_back(link, daemon)


def test_a_view_that_dies_while_a_write_holds_the_connection_still_gives_its_pin_back():
    """No pass runs; a write in another thread holds the connection for
    longer than the give-back waits for it (the daemon was slow to take the
    pass's last message): the pin still goes back afterwards, without
    waiting for a next message."""
    import threading

    link, daemon = _idle_link()
    link._wlock.acquire()
    threading.Timer(1.5, link._wlock.release).start()
    _dies_and_goes_back(link, daemon)


def test_a_clean_up_whose_reaper_has_ended_runs_at_once(monkeypatch):
    """``reaper.later`` enqueues only while this process's reaper runs: with
    its thread ended (here a stand-in that is not alive) the clean-up runs
    in the caller, never waits in a queue nothing reads."""
    import os
    import threading

    from coordl.base import reaper

    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    monkeypatch.setattr(reaper, "_thread", [dead, os.getpid()])
    ran = []
    reaper.later(lambda: ran.append(threading.current_thread().name))
    assert ran == [threading.current_thread().name]
    assert not reaper.running()
