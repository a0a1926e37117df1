"""A check two decode="device" test modules share: the workers' batch reads
give the per-sample path's batches, and a pass resumed mid-way gives the
rest of the whole pass's."""
import torch

import coordl
from coordl.pipeline import device_batches as BR


def check_batch_reads_and_resume(ds, **kw) -> list:
    """Runs ``ds`` through ``coordl.DataLoader(ds, **kw)`` (one worker,
    persistent, epoch 1) with the batch path on and off, then resumed from
    its state after two batches: all three the same batches.  Returns the
    batch path's batches."""
    kw = dict(num_workers=1, persistent_workers=True, **kw)
    runs = {}
    for flag in (True, False):
        old, BR.ENABLED = BR.ENABLED, flag
        try:
            L = coordl.DataLoader(ds, **kw)
            L.set_epoch(1)
            runs[flag] = list(L)
            assert {s["batch_reads"] for s in L._mode.pool.worker_stats()} == {flag}
            del L
        finally:
            BR.ENABLED = old
    for (a, y), (b, y2) in zip(runs[True], runs[False]):
        assert torch.equal(a, b) and torch.equal(y, y2)
    L = coordl.DataLoader(ds, **kw)
    L.set_epoch(1)
    it = iter(L)
    first = [next(it) for _ in range(2)]
    state = L.state_dict()
    del it, L
    R = coordl.DataLoader(ds, **kw)
    R.load_state_dict(state)
    got = first + list(R)
    assert len(got) == len(runs[True]) > 2
    for (a, y), (b, y2) in zip(got, runs[True]):
        assert torch.equal(a, b) and torch.equal(y, y2)
    return runs[True]
