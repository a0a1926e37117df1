"""A collate_fn that draws (mixup, cutmix: torchvision's reference recipes
mix in the collate_fn) draws from torch's, Python's and numpy's generators
seeded from (seed, epoch, step) in coordl's pipeline: the same batches with
any number of workers, and exactly the same after a resume mid-epoch."""
import gc
import pickle
import random

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from coordl import DataLoader
from toydata import TwoStageToy

N, BS = 24, 4


def mixing_collate(batch):
    """A mixup-like collate drawing from all three global generators, as
    collate_fns written for torch's workers do."""
    x, y = default_collate(batch)
    lam = float(torch.distributions.Beta(torch.tensor([0.4]), torch.tensor([0.4])).sample())
    shift = random.randrange(1, len(y)) if len(y) > 1 else 0
    noise = float(np.random.uniform())
    return x, y, torch.tensor([lam, shift, noise], dtype=torch.float64)


def _make(num_workers, seed=5, **kw):
    return DataLoader(TwoStageToy(N), batch_size=BS, shuffle=True, seed=seed, num_workers=num_workers,
                      collate_fn=mixing_collate, **kw)


def _draws(batches):
    return [(b[0][:, 0].tolist(), b[2].tolist()) for b in batches]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_collate_draws_same_after_resume_mid_epoch(num_workers):
    full = _draws(_make(num_workers))
    a = _make(num_workers)
    it = iter(a)
    got = [next(it) for _ in range(2)]
    state = pickle.loads(pickle.dumps(a.state_dict()))
    del it, a
    gc.collect()
    b = _make(num_workers, seed=99)
    b.load_state_dict(state)
    got += list(b)
    assert _draws(got) == full


def test_collate_draws_do_not_depend_on_the_workers():
    one, two = _draws(_make(0)), _draws(_make(2))
    assert one == two
    # they differ from batch to batch and from epoch to epoch
    loader = _make(2)
    e0, e1 = _draws(loader), _draws(loader)
    assert len({tuple(d) for _, d in e0}) == len(e0)
    assert [d for _, d in e0] != [d for _, d in e1]


def test_collate_draws_leave_the_main_generators_as_they_were():
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    want = (torch.rand(2), random.random(), np.random.uniform())
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    list(_make(0))
    got = (torch.rand(2), random.random(), np.random.uniform())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
