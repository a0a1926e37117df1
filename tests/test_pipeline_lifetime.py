"""Lifetime of coordl's pipeline: what happens after an error, when a thread or
process dies, when a pass is abandoned, when batches die inside a gc run.

Anything that could hang on a regression runs in a child process with a hard
timeout (``run_in_child``), so a hang fails the test instead of the run.
"""
import textwrap

import pytest

from coordl.testing import run_in_child

HERE = __file__.rsplit("/", 1)[0]


def _child(body: str, timeout: float = 90, prelude: str = ""):
    code = f"import sys; sys.path.insert(0, {HERE!r})\n" + prelude + textwrap.dedent(body)
    r = run_in_child(code, timeout=timeout)
    assert r.returncode == 0, f"child failed (rc {r.returncode})\n{r.stdout}\n{r.stderr}"
    return r.stdout


# ---------------------------------------------------------------- item 10
_COLLECT = """
import torch
from torch.utils.data import SequentialSampler
from coordl import DataLoader
from toydata import TwoStageToy

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


@pytest.mark.parametrize("placement", ["inline", "workers", "persistent", "torch-inline", "torch-workers"])
def test_after_a_sample_error_the_pass_goes_on_like_torch(placement):
    """One bad sample in the middle: torch raises for its batch, then yields
    the following batches.  coordl must deliver the same batches and raise the
    same number of times, on every placement (and the next epoch is whole)."""
    nw = 0 if placement in ("inline", "torch-inline") else 2
    pw = placement == "persistent"
    extra = ", sampler=SequentialSampler(ds)" if placement.startswith("torch") else ", seed=0"
    out = _child(f"""
        ds = TwoStageToy(40, bad={{13, 30}})
        ref = collect(torch.utils.data.DataLoader(ds, batch_size=4, num_workers={nw},
                                                  persistent_workers={pw}), 2)
        L = DataLoader(ds, batch_size=4, num_workers={nw}, persistent_workers={pw}{extra})
        if {placement!r} != "torch-inline" and {placement!r} != "torch-workers":
            assert L._use_pipeline
        mine = collect(L, 2)
        print("REF", ref)
        print("MINE", mine)
        print("SAME", mine == ref, ref[1])
    """, timeout=40, prelude=_COLLECT)
    assert "SAME True 4" in out, out


# ---------------------------------------------------------------- item 9
# ---------------------------------------------------------------- item 11
# ---------------------------------------------------------------- item 12
# ---------------------------------------------------------------- item 13
