"""Live stall metrics (issue 10, req. 2): per-epoch wait in next() over the
wall time between batches, and stage busy times, on synthetic datasets with
known delays.  Bounds are wide: they tell a loader-bound epoch from a
step-bound one and a slow read from a slow decode, not how fast this
machine is."""
import io
import time
import warnings

import pytest

import coordl
from toydata import TwoStageToy


def _epoch(loader, step_sleep=0.0):
    for _ in loader:
        if step_sleep:
            time.sleep(step_sleep)
    return loader.stats().epochs[-1]


def test_a_loader_bound_epoch_stalls_and_a_step_bound_one_does_not():
    slow_data = coordl.DataLoader(TwoStageToy(48, prep_delay=0.01), batch_size=4, seed=0)
    st = _epoch(slow_data)                       # nothing to hide the 10 ms per sample behind
    assert st.stall_fraction > 0.8
    assert st.wait_seconds <= st.wall_seconds and st.prep_seconds >= 0.9 * 48 * 0.01
    slow_step = coordl.DataLoader(TwoStageToy(48, prep_delay=0.001), batch_size=4, seed=0, num_workers=1,
                                  prefetch_factor=4)
    _epoch(slow_step, step_sleep=0.05)            # warm-up epoch: the worker starts
    st2 = _epoch(slow_step, step_sleep=0.05)      # 4 ms of prep per 50 ms step: the loader keeps up
    assert st2.stall_fraction < 0.5 < st.stall_fraction
    assert st2.wall_seconds >= 12 * 0.05


def test_busy_times_tell_a_slow_read_from_a_slow_decode():
    reads = _epoch(coordl.DataLoader(TwoStageToy(24, delay=0.01), batch_size=4, seed=0, fetch_threads=1))
    preps = _epoch(coordl.DataLoader(TwoStageToy(24, prep_delay=0.01), batch_size=4, seed=0))
    assert reads.fetch_seconds > 5 * reads.prep_seconds
    assert preps.prep_seconds > 5 * preps.fetch_seconds


def test_each_epoch_has_its_own_record_and_the_totals_add_up():
    L = coordl.DataLoader(TwoStageToy(16, prep_delay=0.002), batch_size=4, seed=0)
    for _ in range(2):
        _epoch(L)
    st = L.stats()
    assert [e.epoch for e in st.epochs] == [0, 1]
    assert all(0 < e.stall_fraction <= 1 and e.wall_seconds > 0 for e in st.epochs)
    assert st.wait_seconds == pytest.approx(sum(e.wait_seconds for e in st.epochs))
    assert st.prep_seconds == pytest.approx(sum(e.prep_seconds for e in st.epochs))


def test_progress_bar_shows_samples_per_second_and_stall(monkeypatch):
    import tqdm.auto

    out = io.StringIO()
    real = tqdm.auto.tqdm
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda *a, **k: real(*a, **{**k, "file": out, "mininterval": 0}))
    L = coordl.DataLoader(TwoStageToy(16, prep_delay=0.002), batch_size=4, seed=0, progress=True)
    assert sum(1 for _ in L) == 4
    text = out.getvalue()
    assert "epoch 0" in text and "samples/s" in text and "stall" in text


def test_progress_must_be_a_bool():
    with pytest.raises(ValueError, match="progress should be a bool"):
        coordl.DataLoader(TwoStageToy(4), progress="yes")
