"""Live stall metrics: per-epoch wait in next() over the
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


def _bar_lines(text: str) -> list[str]:
    """What stays on screen: each line as its last redraw left it."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n") if line.strip()]


def test_progress_bar_stays_after_each_epoch_and_its_rates_agree(monkeypatch):
    """The bar of each epoch stays on screen when the epoch ends, and its
    samples/s is its batches/s times the batch size: both
    over the same time, whatever the pace of the steps."""
    import re

    import tqdm.auto

    out = io.StringIO()
    real = tqdm.auto.tqdm
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda *a, **k: real(*a, **{**k, "file": out}))
    L = coordl.DataLoader(TwoStageToy(24, prep_delay=0.002), batch_size=4, seed=0, progress=True)
    for _ in range(2):
        for k, _batch in enumerate(L):
            time.sleep(0.005 if k % 3 else 0.08)  # uneven steps: a smoothed rate would drift from the average
    lines = _bar_lines(out.getvalue())
    assert [line.split(":")[0] for line in lines] == ["epoch 0", "epoch 1"], lines
    for line in lines:
        assert "100%" in line and "6/6" in line, line
        m = re.search(r"([\d.]+)(batch/s|s/batch), (\d+) samples/s", line)
        assert m, line
        batches_per_s = float(m.group(1)) if m.group(2) == "batch/s" else 1 / float(m.group(1))
        assert int(m.group(3)) == pytest.approx(4 * batches_per_s, rel=0.05, abs=1), line


def test_an_epoch_run_again_is_the_latest_record():
    """``set_epoch(0)`` after epochs 0 and 1: the re-run is ``epochs[-1]``,
    a record of its own; a pass that resumes it mid-way (load_state_dict)
    adds to that record."""
    L = coordl.DataLoader(TwoStageToy(16), batch_size=4, seed=0)
    for _ in range(2):
        _epoch(L)
    L.set_epoch(0)
    last = _epoch(L)
    st = L.stats()
    assert [e.epoch for e in st.epochs] == [0, 1, 0]
    assert last == st.epochs[-1] and (last.epoch, last.samples, last.batches) == (0, 16, 4)
    assert st.samples == sum(e.samples for e in st.epochs) == 48
    L.set_epoch(0)
    it = iter(L)
    next(it), next(it)
    state = L.state_dict()
    del it
    assert [(e.epoch, e.batches) for e in L.stats().epochs] == [(0, 4), (1, 4), (0, 4), (0, 2)]
    L.load_state_dict(state)
    assert sum(1 for _ in L) == 2
    assert [(e.epoch, e.batches) for e in L.stats().epochs] == [(0, 4), (1, 4), (0, 4), (0, 4)]
    assert L.stats().epochs[-1].samples == 16
    assert [e.epoch for e in L.stats().epochs] == [0, 1, 0, 0]
