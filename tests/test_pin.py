"""pin_memory=True on coordl's own pipeline.

The "no accelerator" path runs with torch's availability check answering
False (the ``no_accelerator`` fixture), so it holds on a machine with CUDA
too; the pinning path is tested with torch's availability check and the pin
function replaced, so the tests prove each batch goes through pinning (in a
pin thread when there are workers) and that what the loop gets is the
pinned copy.
"""
import threading
import warnings

import pytest
import torch

import coordl.device.pin as pin_mod
from coordl import DataLoader, SampleError
from toydata import TwoStageToy

NO_ACCEL = "'pin_memory' argument is set as true but no accelerator is found"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pin_without_accelerator_warns_like_torch_and_delivers(num_workers, no_accelerator):
    ds = TwoStageToy(20)
    want = list(DataLoader(ds, batch_size=4, seed=3, num_workers=num_workers))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch_batches = list(torch.utils.data.DataLoader(ds, batch_size=4, pin_memory=True))
        got = list(DataLoader(ds, batch_size=4, seed=3, num_workers=num_workers, pin_memory=True))
    msgs = [str(x.message) for x in w if issubclass(x.category, UserWarning)]
    assert len(torch_batches) == 5 and sum(NO_ACCEL in m for m in msgs) == 2, msgs  # torch's and ours
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, want)) and len(got) == len(want)


@pytest.fixture
def fake_accelerator(monkeypatch):
    """Pretend an accelerator exists; record every pin call."""
    calls = []
    made = set()

    def fake_pin(batch):
        calls.append(threading.current_thread().name)
        out = [t.clone() if isinstance(t, torch.Tensor) else t for t in batch]
        made.update(t.data_ptr() for t in out if isinstance(t, torch.Tensor))
        return out

    monkeypatch.setattr(pin_mod, "accelerator_available", lambda: True)
    monkeypatch.setattr(pin_mod, "pin_batch", fake_pin)
    monkeypatch.setattr(pin_mod, "current_device_index", lambda: 0)
    monkeypatch.setattr(pin_mod, "set_device_index", lambda i: None)
    return calls, made


@pytest.mark.parametrize("num_workers,thread", [(0, "MainThread"), (2, "coordl-pin-memory")])
def test_pipeline_batches_go_through_pinning(fake_accelerator, num_workers, thread):
    calls, made = fake_accelerator
    ds = TwoStageToy(22)
    want = list(DataLoader(ds, batch_size=4, shuffle=True, seed=3, num_workers=num_workers))
    assert calls == []  # not asked: not pinned
    L = DataLoader(ds, batch_size=4, shuffle=True, seed=3, num_workers=num_workers, pin_memory=True)
    it = iter(L)
    assert it._pin_memory is True
    got = list(it)
    assert calls == [thread] * len(want)
    assert all(b[0].data_ptr() in made and b[1].data_ptr() in made for b in got)
    assert len(got) == len(want)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
    assert L.stats().batches == len(want)


def test_pin_thread_forwards_sample_errors_in_order(fake_accelerator):
    ds = TwoStageToy(24, bad=[13])
    L = DataLoader(ds, batch_size=4, seed=3, num_workers=2, pin_memory=True)
    it = iter(L)
    good = [next(it) for _ in range(3)]  # samples 0..11
    with pytest.raises(SampleError, match="sample 13"):
        next(it)
    assert [b[0][0, 0].item() for b in good] == [0, 4, 8]


def test_pin_failure_names_the_batch(monkeypatch, fake_accelerator):
    def broken(batch):
        raise TypeError("cannot pin this")

    monkeypatch.setattr(pin_mod, "pin_batch", broken)
    L = DataLoader(TwoStageToy(8), batch_size=4, seed=3, num_workers=2, pin_memory=True)
    with pytest.raises(RuntimeError, match=r"pinning batch 0 of epoch 0 failed \(TypeError: cannot pin this\)"):
        next(iter(L))


@pytest.mark.parametrize("persistent", [False, True])
def test_abandoned_pinned_passes_stop_and_next_pass_is_right(fake_accelerator, persistent):
    """Breaking out of pinned passes: the pin thread stops, the workers of a
    non-persistent pass exit (the leak fixture checks), and a persistent pool
    serves the next pass correctly (one thread drives it at a time)."""
    ds = TwoStageToy(40, delay=0.02)  # slow reads: the pin thread waits in the pool at the break
    want = list(DataLoader(ds, batch_size=4, seed=3, num_workers=2))
    L = DataLoader(ds, batch_size=4, seed=3, num_workers=2, pin_memory=True,
                   persistent_workers=persistent, timeout=20)
    for _ in range(3):
        for i, _b in enumerate(L):
            if i == 1:
                break
    L.set_epoch(0)
    got = list(L)
    assert len(got) == len(want) and all(torch.equal(a[0], b[0]) for a, b in zip(got, want))
    del L


def test_declared_torch_range_is_one_the_loader_works_with():
    """setup.cfg must not promise a torch without what the loader passes and
    calls: DataLoader(in_order=...) and torch.accelerator are new in 2.6."""
    import configparser
    import inspect
    import pathlib
    import re

    cfg = configparser.ConfigParser()
    cfg.read(pathlib.Path(__file__).resolve().parent.parent / "setup.cfg")
    reqs = cfg["options"]["install_requires"]
    m = re.search(r"^\s*torch\s*>=\s*(\d+)\.(\d+)", reqs, re.M)
    assert m, reqs
    assert (int(m.group(1)), int(m.group(2))) >= (2, 6), f"torch lower bound {m.group(0).strip()} is below 2.6"
    assert "in_order" in inspect.signature(torch.utils.data.DataLoader.__init__).parameters
    assert callable(torch.accelerator.is_available)


def test_shutdown_workers_of_a_pinned_pass(fake_accelerator):
    L = DataLoader(TwoStageToy(40), batch_size=4, seed=3, num_workers=2, pin_memory=True)
    it = iter(L)
    next(it)
    workers = list(it._workers)
    assert len(workers) == 2
    it._shutdown_workers()
    assert list(it) == []
    for w in workers:
        w.join(10)
        assert w.exitcode == 0
    assert len(list(L)) == 10


def test_a_sample_error_through_the_pin_thread_does_not_keep_the_pass_alive(fake_accelerator, monkeypatch):
    """After a SampleError from a pinned pass, dropping the iterator frees it
    (and stops its workers) at once, without waiting for the garbage
    collector: the re-raised error must not hold the pin thread's or the
    consumer's frame in a reference cycle."""
    import gc
    import weakref

    made = []
    real_init = pin_mod.PinThread.__init__

    def recording_init(self, *a, **kw):
        made.append(self)
        real_init(self, *a, **kw)

    monkeypatch.setattr(pin_mod.PinThread, "__init__", recording_init)
    L = DataLoader(TwoStageToy(24, bad=[13]), batch_size=4, seed=3, num_workers=2, pin_memory=True)
    gc.collect()
    gc.disable()
    try:
        it = iter(L)
        (pin,) = made
        made.clear()
        gone, thread = weakref.ref(pin), pin._thread
        del pin
        with pytest.raises(SampleError, match="sample 13"):
            for _ in it:
                pass
        del it
        thread.join(10)  # the pin thread finishes the pass (or stops) and lets go of it
        assert not thread.is_alive()
        assert gone() is None, "the pinned pass outlived its iterator: a reference cycle through the error"
    finally:
        gc.enable()


@pytest.mark.parametrize("name,hint", [("coordl-pin-memory", True), ("coordl-device-decode", False)])
def test_a_thread_that_ends_without_finishing_the_pass_is_named(monkeypatch, name, hint):
    """The consumer of a PinThread (the training loop, or the pin thread
    above a decode thread) gets an error naming the thread that died, with
    the pin_memory remedy only where it is the pin thread."""
    from coordl.device import pin as P

    monkeypatch.setattr(P, "_pin_loop", lambda *a, **k: None)      # the thread ends at once
    t = P.PinThread(iter([]), depth=1, name=name)
    with pytest.raises(RuntimeError, match=f"thread {name} exited without finishing the pass") as e:
        next(t)
    assert ("pin_memory=False" in str(e.value)) == hint


def test_worker_stats_beside_the_pin_thread_read_whole_messages(tmp_path):
    """The pin thread receives the workers' results while another thread
    asks them for their statistics (``pool.worker_stats``): both read the
    same pipes, one message at a time, never the middle of another's."""
    from coordl.synth import make_image_folder
    from coordl.testing import run_in_child

    root = make_image_folder(str(tmp_path / "photos"), num_images=40, num_classes=2, mean_kb=2,
                             image_size=(32, 24), seed=1)
    code = f"""
import coordl
from coordl import transforms as T
from coordl.device import delivery as D
D.CPU_TEST_DEVICE = True
ds = coordl.ImageFolder({root!r}, T.Compose([T.RandomResizedCrop(8), T.ToTensor()]))
L = coordl.DataLoader(ds, batch_size=1, num_workers=2, persistent_workers=True, device="cpu", prefetch_factor=4)
n = 0
for e in range(20):
    for b in L:
        assert len(L._mode.pool.worker_stats()) == 2
        n += 1
print("OK", n)
"""
    r = run_in_child(code, timeout=120)
    assert r.returncode == 0 and "OK 800" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("decode", ["device", "cpu"])
def test_a_script_that_leaves_a_pass_mid_epoch_exits_cleanly(tmp_path, decode):
    """A training script that breaks out of the loop and ends, the pass
    still running: the interpreter's exit must not abort.  A daemon thread
    still inside a torch call when the interpreter finalizes (the pin
    thread's resize, the decode thread's decoder) ends the process with
    "terminate called without an active exception" (exit 134) when it
    takes the GIL back; coordl stops its threads before that."""
    from coordl.synth import make_image_folder
    from coordl.testing import run_in_child

    root = make_image_folder(str(tmp_path / "photos"), num_images=192, num_classes=2, mean_kb=30,
                             image_size=(320, 240), seed=2)
    code = f"""
import coordl
from coordl import transforms as T
from coordl.device import delivery as D
D.CPU_TEST_DEVICE = True
tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize([0.5] * 3, [0.25] * 3)])
ds = coordl.ImageFolder({root!r}, tf)
L = coordl.DataLoader(ds, batch_size=16, num_workers=1, persistent_workers=True, device="cpu", decode={decode!r},
                      prefetch_factor=4)
for k, b in enumerate(L):
    if k == 3:
        break
print("OK")
"""
    for _ in range(3):
        r = run_in_child(code, timeout=120)
        assert r.returncode == 0 and "OK" in r.stdout and "terminate called" not in r.stderr, \
            (r.returncode, r.stderr[-3000:])


@pytest.mark.parametrize("decode", ["device", "cpu"])
def test_a_pass_left_early_wakes_its_threads_waiting_on_a_full_queue(tmp_path, decode):
    """A loop that breaks while the pin (and decode) threads wait to put a
    batch into their full queues: the next pass, and the interpreter's exit,
    wake them there rather than waiting for their next poll.  The poll is
    made longer than the child's timeout: a thread left to it hangs the
    child."""
    from coordl.synth import make_image_folder
    from coordl.testing import run_in_child

    root = make_image_folder(str(tmp_path / "photos"), num_images=96, num_classes=2, mean_kb=4,
                             image_size=(64, 48), seed=4)
    code = f"""
import time
import coordl
from coordl import transforms as T
from coordl.device import delivery as D, pin
D.CPU_TEST_DEVICE = True
pin._POLL = 600.0
ds = coordl.ImageFolder({root!r}, T.Compose([T.RandomResizedCrop(32), T.ToTensor()]))
L = coordl.DataLoader(ds, batch_size=4, num_workers=1, device="cpu", decode={decode!r}, persistent_workers=True)
seen = []
for epoch in range(3):
    for k, (x, y) in enumerate(L):
        if k == 2:
            break
        seen.append(y.tolist())
    time.sleep(0.5)                # every queue full, each thread waiting to put
it = iter(L)
next(it)
time.sleep(0.5)
print("OK", len(seen))
"""
    r = run_in_child(code, timeout=60)
    assert r.returncode == 0 and "OK 6" in r.stdout, (r.returncode, r.stderr[-3000:])


def test_an_iterator_whose_pass_a_newer_one_ended_says_so(tmp_path):
    """With device= (a pin thread per pass) a loader runs one pass at a
    time: an earlier iterator read after ``iter(loader)`` began another pass
    says why it ended, at once (the poll is made longer than the child's
    timeout), and the newer pass delivers every batch."""
    from coordl.synth import make_image_folder
    from coordl.testing import run_in_child

    root = make_image_folder(str(tmp_path / "photos"), num_images=40, num_classes=2, mean_kb=4,
                             image_size=(64, 48), seed=5)
    code = f"""
import coordl
from coordl import transforms as T
from coordl.device import delivery as D, pin
D.CPU_TEST_DEVICE = True
pin._POLL = 600.0
ds = coordl.ImageFolder({root!r}, T.Compose([T.RandomResizedCrop(32), T.ToTensor()]))
for decode in ("cpu", "device"):
    L = coordl.DataLoader(ds, batch_size=4, num_workers=1, device="cpu", decode=decode, seed=0)
    a = iter(L)
    next(a)
    b = iter(L)
    next(b)
    try:
        next(a)
    except RuntimeError as e:
        print("OLD", decode, "newer pass of the same loader began" in str(e))
    print("NEW", decode, 1 + sum(1 for _ in b))
"""
    r = run_in_child(code, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x for x in r.stdout.splitlines() if x.startswith(("OLD", "NEW"))] == \
        ["OLD cpu True", "NEW cpu 10", "OLD device True", "NEW device 10"], r.stdout


def test_a_loader_in_a_thread_that_outlives_the_main_one_is_not_stopped(tmp_path):
    """The stop at the interpreter's exit runs after Python has joined the
    non-daemon threads: a training thread still iterating when the main
    thread returns keeps its loader to the end of the pass."""
    from coordl.synth import make_image_folder
    from coordl.testing import run_in_child

    root = make_image_folder(str(tmp_path / "photos"), num_images=64, num_classes=2, mean_kb=4,
                             image_size=(64, 48), seed=3)
    code = f"""
import threading, time
import coordl
from coordl import transforms as T
from coordl.device import delivery as D
D.CPU_TEST_DEVICE = True
ds = coordl.ImageFolder({root!r}, T.Compose([T.RandomResizedCrop(32), T.ToTensor()]))
L = coordl.DataLoader(ds, batch_size=8, num_workers=1, device="cpu", decode="device")
seen = []

def train():
    for b in L:
        seen.append(len(b[1]))
        time.sleep(0.2)
    print("BATCHES", len(seen), flush=True)

t = threading.Thread(target=train)
t.start()
time.sleep(0.3)      # the pass is running; the main thread returns now
"""
    r = run_in_child(code, timeout=120)
    assert r.returncode == 0 and "BATCHES 8" in r.stdout, (r.returncode, r.stdout[-500:], r.stderr[-3000:])
