"""Lifetime of coordl's pipeline: what happens after an error, when a thread or
process dies, when a pass is abandoned, when batches die inside a gc run.

Anything that could hang on a regression runs in a child process with a hard
timeout (``run_in_child``), so a hang fails the test instead of the run.
"""
import json
import sys
import textwrap

import pytest

from coordl.testing import run_in_child

HERE = __file__.rsplit("/", 1)[0]
sys.path.insert(0, HERE)
from _one_child import run_cases  # noqa: E402


def _child(body: str, timeout: float = 90, prelude: str = ""):
    code = f"import sys; sys.path.insert(0, {HERE!r})\n" + prelude + textwrap.dedent(body)
    r = run_in_child(code, timeout=timeout)
    assert r.returncode == 0, f"child failed (rc {r.returncode})\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.fixture(scope="module")
def cases_in_one_child():
    """``get(test, cases, timeout, prelude)``: the output of this test's case,
    from one child that ran all of ``cases`` (tests/_one_child.py), run once
    per module: the cases of a parametrized test share the child's start."""
    runs = {}

    def get(test: str, case: str, cases: dict, timeout: float, prelude: str = "") -> str:
        if test not in runs:
            runs[test] = run_cases(cases, timeout, f"import sys; sys.path.insert(0, {HERE!r})\n" + prelude)
        return runs[test][case]

    return get


# ---------------------------------------------------- a sample's error mid-pass
_COLLECT = """
import torch
from coordl import DataLoader
from toydata import TwoStageToy, Unsized

def collect(L, epochs):
    out, errors = [], []
    for _ in range(epochs):
        it = iter(L)
        while True:
            try:
                x, y = next(it)
            except StopIteration:
                break
            except Exception as e:
                errors.append(type(e).__name__)
                out.append("error")
                continue
            out.append(x[:, 0].tolist())
    return out, len(errors)
"""


_ERROR_PLACEMENTS = ["inline", "workers", "persistent", "sampler", "torch-inline", "torch-workers"]


def _sample_error_case(placement: str) -> str:
    nw = 0 if placement in ("inline", "torch-inline") else 2
    pw = placement == "persistent"
    extra = (", sampler=Unsized(len(ds))" if placement.startswith("torch") else
             ", sampler=torch.utils.data.SequentialSampler(ds)" if placement == "sampler" else ", seed=0")
    return f"""
        ds = TwoStageToy(40, bad={{13, 30}})
        ref = collect(torch.utils.data.DataLoader(ds, batch_size=4, num_workers={nw},
                                                  persistent_workers={pw}), 2)
        L = DataLoader(ds, batch_size=4, num_workers={nw}, persistent_workers={pw}{extra})
        assert L._mode.runs_pipeline == {not placement.startswith("torch")}
        mine = collect(L, 2)
        print("REF", ref)
        print("MINE", mine)
        print("SAME", mine == ref, ref[1])
    """


@pytest.mark.parametrize("placement", _ERROR_PLACEMENTS)
def test_after_a_sample_error_the_pass_goes_on_like_torch(placement, cases_in_one_child):
    """One bad sample in the middle: torch raises for its batch, then yields
    the following batches.  coordl must deliver the same batches and raise the
    same number of times, on every placement (and the next epoch is whole)."""
    out = cases_in_one_child("sample error", placement, {p: _sample_error_case(p) for p in _ERROR_PLACEMENTS},
                             timeout=120, prelude=_COLLECT)
    assert "SAME True 4" in out, out


# ------------------------------- a batch freed by gc inside the pool's own send
def test_batch_freed_by_gc_inside_the_pools_own_send_does_not_deadlock():
    """A batch kept alive only by a reference cycle dies when the cyclic gc
    runs, and gc can run inside any allocation, including inside the pool's
    send on a worker's control pipe (under that pipe's lock).  The slot
    finalizer must not send there itself."""
    out = _child("""
        import gc
        from coordl import DataLoader
        from toydata import TwoStageToy

        class GcInSend:
            \"\"\"The real connection; a gc run happens inside each send.\"\"\"
            def __init__(self, conn):
                self.conn = conn
            def send(self, msg):
                gc.collect()
                self.conn.send(msg)
            def __getattr__(self, name):
                return getattr(self.conn, name)

        gc.disable()  # collections happen where the test says
        L = DataLoader(TwoStageToy(80), batch_size=4, seed=0, num_workers=1, persistent_workers=True)
        it = iter(L)
        pool = L._mode.pool
        pool.ctrl[0] = GcInSend(pool.ctrl[0])
        n = 0
        for x, y in it:
            cycle = [x, y]
            cycle.append(cycle)  # garbage only to the cyclic gc
            del x, y, cycle
            n += 1
        gc.collect()
        print("DONE", n, len(pool.maps) <= 6)
    """, timeout=40)
    assert "DONE 20 True" in out, out


# ------------------------- iterators that outlive their thread, process or fork
def _iterator_in_a_thread_case(persistent: bool) -> str:
    return f"""
        import threading
        from coordl import DataLoader
        from coordl.plan import plan
        from toydata import TwoStageToy

        L = DataLoader(TwoStageToy(120, delay=0.002), batch_size=4, shuffle=True, seed=1,
                       num_workers=2, persistent_workers={persistent})
        box = []
        t = threading.Thread(target=lambda: box.append(iter(L)))
        t.start()
        t.join()
        got = [i for x, _ in box.pop() for i in x[:, 0].tolist()]
        print("EXACT", got == plan(120, 1, 0).tolist())
        got = [i for x, _ in L for i in x[:, 0].tolist()]
        print("NEXT", got == plan(120, 1, 1).tolist())
    """


@pytest.mark.parametrize("persistent", [False, True])
def test_iterator_created_in_a_thread_that_exits(persistent, cases_in_one_child):
    """iter(loader) in a setup thread that then exits, batches consumed in the
    main thread: the workers belong to the process, not to that thread."""
    out = cases_in_one_child("iterator in a thread", str(persistent),
                             {str(p): _iterator_in_a_thread_case(p) for p in (False, True)}, timeout=90)
    assert "EXACT True" in out and "NEXT True" in out, out


_KILLED_TRAINER = """
import os, signal, sys, threading, psutil
sys.path.insert(0, sys.argv[1])
from coordl import DataLoader
from toydata import TwoStageToy
L = DataLoader(TwoStageToy(4000, delay=0.01), batch_size=4, seed=0, num_workers=2)
box = []
t = threading.Thread(target=lambda: box.append(iter(L)))
t.start(); t.join()
next(box[0])
print("workers", *[c.pid for c in psutil.Process().children()], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_exit_when_the_main_process_is_killed():
    """Without PR_SET_PDEATHSIG the workers still notice a SIGKILLed main
    process (its pidfd) and exit; an intermediate process watches them (the
    hard-timeout runner would kill leftovers itself and hide a failure)."""
    out = _child(f"""
        import subprocess, sys, psutil
        p = subprocess.run([sys.executable, "-c", {_KILLED_TRAINER!r}, {HERE!r}],
                           capture_output=True, text=True, timeout=60)
        print("rc", p.returncode)
        pids = [int(x) for x in p.stdout.split("workers", 1)[1].split()]
        procs = []
        for pid in pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        gone, alive = psutil.wait_procs(procs, timeout=20)
        print("workers", len(pids), "alive", len(alive))
    """, timeout=90)
    assert "rc -9" in out and "workers 2 alive 0" in out, out


def test_forked_child_dropping_its_copy_of_the_iterator_leaves_the_workers_alone():
    """After os.fork() the child holds a copy of the iterator; when that copy
    dies there, its finalizer must not stop the parent's workers."""
    out = _child("""
        import gc, os
        from coordl import DataLoader
        from toydata import TwoStageToy

        L = DataLoader(TwoStageToy(80), batch_size=4, seed=0, num_workers=2)
        it = iter(L)
        next(it)
        pid = os.fork()
        if pid == 0:
            del it
            gc.collect()
            os._exit(0)
        os.waitpid(pid, 0)
        print("N", 1 + sum(1 for _ in it))
    """, timeout=40)
    assert "N 20" in out, out


# ------------------------------------------------------------- abandoned passes
def test_abandoned_passes_with_persistent_workers_do_not_leak_slots():
    """Break out of many passes after one batch: batches the main process had
    received but not delivered must give their slots back."""
    out = _child("""
        import gc, json
        from coordl import DataLoader
        from toydata import TwoStageToy

        L = DataLoader(TwoStageToy(400), batch_size=4, seed=0, num_workers=2,
                       persistent_workers=True, prefetch_factor=2)
        for p in range(30):
            for k, (x, y) in enumerate(L):
                if k == 2:
                    break
            del x, y
        for x, y in L:  # one complete pass, then nothing holds a batch
            pass
        del x, y
        gc.collect()
        st = L._mode.pool.worker_stats()
        print("STATS", json.dumps(st))
    """, timeout=60)
    st = json.loads(out.split("STATS ", 1)[1])
    slots = [s["slots"] for s in st]
    free = [s["free_slots"] for s in st]
    # a worker needs its prefetch window (2) plus the batches the consumer
    # still holds (1-2); leaking, it grew by about one slot per pass (~25 here)
    assert all(n <= 8 for n in slots), out
    assert slots == free, out  # nothing referenced: every slot came back


def test_abandoned_inline_passes_do_not_leak_fetch_threads():
    """num_workers=0: each abandoned pass must stop its fetch threads (and drop
    its read-ahead), not keep them forever."""
    import gc
    import threading
    import time

    from coordl import DataLoader
    from toydata import TwoStageToy

    def fetch_threads():
        return [t for t in threading.enumerate() if t.name.startswith("coordl-fetch")]

    class Big(TwoStageToy):  # the epoch does not fit the read-ahead budget
        def raw(self, i):
            return super().raw(i) + bytes(1 << 16)

    base = len(fetch_threads())
    L = DataLoader(Big(400), batch_size=4, seed=0, num_workers=0, fetch_threads=3, read_ahead="1MiB")
    for p in range(15):
        for k, (x, y) in enumerate(L):
            if k == 1:
                break
    del x, y
    gc.collect()
    deadline = time.monotonic() + 10  # threads finish their current read, then exit
    while len(fetch_threads()) > base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(fetch_threads()) == base, [t.name for t in fetch_threads()]


# -------------------------- dead threads and workers, reported with their cause
_PLACEMENTS = {
    "inline": "num_workers=0, seed=0",
    "workers": "num_workers=2, seed=0",
    "persistent": "num_workers=2, seed=0, persistent_workers=True",
    "sampler": "num_workers=2, sampler=torch.utils.data.SequentialSampler(ds)",
    "torch-machinery": "num_workers=2, sampler=Unsized(len(ds))",
}


def _raw_non_bytes_case(placement: str) -> str:
    return f"""
        import torch
        from coordl import DataLoader
        from toydata import TwoStageToy, Unsized

        class IntRaw(TwoStageToy):
            def raw(self, i):
                return 7 if i == 5 else super().raw(i)

        ds = IntRaw(24)
        L = DataLoader(ds, batch_size=4, {_PLACEMENTS[placement]})
        it, got, errors = iter(L), [], []
        while True:
            try:
                x, y = next(it)
            except StopIteration:
                break
            except Exception as e:
                errors.append(str(e))
                continue
            got += x[:, 0].tolist()
        print("GOT", got == [i for i in range(24) if not 4 <= i < 8], len(errors))
        print("MSG", errors[0])
    """


@pytest.mark.parametrize("placement", list(_PLACEMENTS))
def test_raw_returning_a_non_bytes_is_that_samples_error(placement, cases_in_one_child):
    """raw() returning an int used to kill the fetch thread (len() of it) and
    hang the pass; it is that sample's error, naming it, and the pass goes on."""
    out = cases_in_one_child("raw non-bytes", placement, {p: _raw_non_bytes_case(p) for p in _PLACEMENTS},
                             timeout=120)
    assert "GOT True 1" in out, out
    msg = out.split("MSG", 1)[1]
    assert "sample 5" in msg and "/toy/sample_5.bin" in msg and "reading" in msg and "int" in msg, msg


def _dead_fetch_thread_case(placement: str) -> str:
    return f"""
        import numpy as np
        import torch
        from coordl import DataLoader
        from toydata import TwoStageToy

        class ShortSizes(TwoStageToy):
            sizes = np.full(10, 32, dtype=np.int64)  # 10 sizes for 40 samples

        L = DataLoader(ShortSizes(40), batch_size=4, {_PLACEMENTS[placement]})
        for p in range(2):
            try:
                n = sum(1 for _ in L)
            except RuntimeError as e:
                print("RAISED", str(e).replace("\\n", " | "))
            else:
                print("NO ERROR", n)
    """


@pytest.mark.parametrize("placement", ["inline", "workers", "persistent"])
def test_dead_fetch_thread_fails_the_pass_naming_the_sample(placement, cases_in_one_child):
    """An exception escaping a fetch thread's loop (here: the dataset's sizes
    array is too short, so admitting sample 10 raises) is reported to the
    consumer with the sample, its path and the stage; nothing hangs, and the
    next pass starts cleanly."""
    out = cases_in_one_child("dead fetch thread", placement,
                             {p: _dead_fetch_thread_case(p) for p in ("inline", "workers", "persistent")},
                             timeout=90)
    lines = [ln for ln in out.splitlines() if ln.startswith(("RAISED", "NO ERROR"))]
    assert len(lines) == 2 and all(ln.startswith("RAISED") for ln in lines), out
    for ln in lines:
        assert "fetch thread" in ln and "died while admitting sample 1" in ln and "/toy/sample_1" in ln, ln
        assert "IndexError" in ln, ln


def test_dead_worker_control_thread_is_reported():
    """A control message the worker cannot unpickle kills its control reader:
    the worker reports that (instead of never hearing from main again)."""
    out = _child("""
        from coordl import DataLoader
        from toydata import TwoStageToy

        def refuse():
            raise RuntimeError("cannot rebuild this in the worker")

        class Unloadable:
            def __reduce__(self):
                return (refuse, ())

        L = DataLoader(TwoStageToy(400, delay=0.01), batch_size=4, seed=0, num_workers=2,
                       persistent_workers=True)
        it = iter(L)
        next(it)
        L._mode.pool._send(0, ("consumed", Unloadable()))  # through the real pipe and reader
        try:
            for _ in it:
                pass
        except RuntimeError as e:
            print("RAISED", "control thread of DataLoader worker process 0 died" in str(e),
                  "cannot rebuild" in str(e))
        else:
            print("NO ERROR")
    """, timeout=40)
    assert "RAISED True True" in out, out


def test_dead_worker_prep_thread_names_the_batch():
    """The worker's prep thread dying (a collate_fn result that cannot be sent
    to the main process) is reported with the stage and the batch."""
    out = _child("""
        from coordl import DataLoader
        from toydata import TwoStageToy

        def collate(samples):
            return lambda: samples  # cannot be pickled

        L = DataLoader(TwoStageToy(40), batch_size=4, seed=0, num_workers=2, collate_fn=collate)
        try:
            list(L)
        except RuntimeError as e:
            print("RAISED", "failed while collating batch" in str(e), "pickle" in str(e).lower())
        else:
            print("NO ERROR")
    """, timeout=40)
    assert "RAISED True True" in out, out


def test_worker_that_died_before_the_pass_began_is_reported_with_its_error():
    """worker_init_fn fails, the workers report it and exit before the main
    process sends them the pass: the send must surface the workers' error,
    not a bare BrokenPipeError (main is held back to make the order certain)."""
    out = _child("""
        import time
        from coordl import DataLoader
        from coordl.pipeline import workers as _pipeline
        from toydata import TwoStageToy

        def bad(w):
            raise ValueError("no GPU for you")

        begin = _pipeline.WorkerPool.begin_pass
        def late_begin(self, *a):
            for p in self.procs:
                p.join(20)  # the workers have failed and exited
            return begin(self, *a)
        _pipeline.WorkerPool.begin_pass = late_begin

        L = DataLoader(TwoStageToy(8), batch_size=2, seed=0, num_workers=2, worker_init_fn=bad)
        try:
            list(L)
        except RuntimeError as e:
            print("RAISED", "no GPU for you" in str(e))
        except BaseException as e:
            print("OTHER", type(e).__name__, e)
    """, timeout=40)
    assert "RAISED True" in out, out


# ---------------------------------------------------------------- forked children
@pytest.mark.parametrize("placement", ["inline", "workers", "persistent", "workers_collate_fn"])
def test_a_batch_handed_to_a_forked_child_keeps_its_bytes_there(placement):
    """``mp.Process(target=f, args=(batch,))`` with fork: the child maps the
    parent's memory, so a zero-copy batch there views the same slot.  Once
    the parent drops its batch and goes on, the slot must not be reused
    under the child (torch's batches keep their bytes in a child too); and
    once the children are gone nothing of those slots stays mapped, in the
    main process or in the workers (but the free slots a loader without
    persistent workers keeps for its next pass's workers)."""
    nw = 0 if placement == "inline" else 2
    pw = placement == "persistent"
    # a collate_fn's batch, its new tensors packed into a slot (collate.pack)
    fn = "mixing_collate" if placement == "workers_collate_fn" else "None"
    out = _child(f"""
        import gc, json
        from coordl import DataLoader
        from toydata import TwoStageToy, mixing_collate
        from _fork_check import hand_to_children, mappings

        L = DataLoader(TwoStageToy(400), batch_size=4, seed=0, num_workers={nw}, persistent_workers={pw},
                       collate_fn={fn})
        r = hand_to_children(L, "coordl-slot")
        gc.collect()
        pool = L._mode.pool
        if pool is not None:
            st = pool.worker_stats()
            r["slots"] = [s["slots"] for s in st]
            r["free"] = [s["free_slots"] for s in st]
            r["worker_maps"] = [mappings("coordl-slot", p) for p in pool.pids]
            r["known"] = len(pool.maps)
        stash = getattr(L._mode, "_stash", None)
        r["stash"] = len(stash._kept) if stash is not None else 0
        r["main_maps"] = mappings("coordl-slot")
        print("RESULT", json.dumps(r))
    """, timeout=120)
    r = json.loads(out.split("RESULT ", 1)[1])
    assert r["exitcodes"] == [0] * 5, r
    assert r["views"] == (0 if nw == 0 else 5), r   # the batches handed over were zero-copy views
    assert r["changed"] == 0, r
    if pw:
        # every slot came back (the children are gone); each is mapped once in
        # its worker and once here, and none that the workers dropped stays
        assert r["slots"] == r["free"] and all(n <= 10 for n in r["slots"]), r
        assert r["worker_maps"] == r["slots"] and r["main_maps"] == r["known"] == sum(r["slots"]), r
    else:
        # what stays mapped here is the loader's stash for its next pass (slots no batch views, none a
        # child was handed: those went with the children), never more than one pass's slots
        assert r["main_maps"] == r["stash"] and r["stash"] <= (0 if nw == 0 else 2 * 10), r


def test_passes_without_persistent_workers_reuse_the_last_pools_free_slots():
    """Without persistent workers each pass forks new workers; the slots the
    last pass's workers wrote (their pages allocated already) are kept by
    the loader and taken by the next pass's workers instead of new ones, but
    never one a batch still views: a batch kept from the first pass keeps
    its bytes over the later passes, and every pass equals num_workers=0's."""
    out = _child("""
        import gc, json, re
        import torch
        from coordl import DataLoader
        from toydata import TwoStageToy
        from _fork_check import mapped_from

        def slots():
            with open("/proc/self/maps") as f:
                return set(re.findall(r"coordl-slot-\\d+-\\d+", f.read()))

        L = DataLoader(TwoStageToy(96), batch_size=8, seed=0, shuffle=True, num_workers=2)
        r = {"same": [], "kept_changed": [], "new_slots": []}
        kept, seen = None, set()
        for epoch in range(4):
            L.set_epoch(epoch)
            got, now = [], set()
            for b in L:
                got.append(b[0].clone())
                now |= slots()   # the slots the batches of this pass come in
                if kept is None:
                    kept, copy = b, [t.clone() for t in b]
                    r["kept_view"] = mapped_from(b[0], "coordl-slot")
                del b
            solo = DataLoader(TwoStageToy(96), batch_size=8, seed=0, shuffle=True, num_workers=0)
            solo.set_epoch(epoch)
            r["same"].append(len(got) == 12 and all(torch.equal(a, s[0]) for a, s in zip(got, solo)))
            r["kept_changed"].append(not all(torch.equal(t, c) for t, c in zip(kept, copy)))
            r["new_slots"].append(len(now - seen))
            seen |= now
        import os
        os.environ["COORDL_KEEP_SLOTS"] = "0"   # turned off: a pass's slots go with its workers
        L2 = DataLoader(TwoStageToy(96), batch_size=8, seed=0, num_workers=2)
        for b in L2:
            pass
        del b
        r["off"] = [L2._mode._stash is None, L._mode._stash is not None]
        print("RESULT", json.dumps(r))
    """, timeout=120)
    r = json.loads(out.split("RESULT ", 1)[1])
    assert r["kept_view"] and r["same"] == [True] * 4, r
    assert r["kept_changed"] == [False] * 4, r
    # the first pass made its slots; the later ones took them from the loader (none is viewed: the
    # kept batch's slot stays out), so they made none, or a few where a worker ran batches further
    # ahead than in the passes before (how far ahead is timing: 1 or 2 in some runs on a loaded 2-vCPU
    # machine); without the reuse each pass makes as many as the first
    assert r["new_slots"][0] > 2 and all(n <= r["new_slots"][0] // 2 for n in r["new_slots"][1:]), r
    assert r["off"] == [True, True], r
