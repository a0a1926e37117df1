import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from coordl import EpochPlan, plan


@pytest.mark.parametrize("n", [1, 10, 13, 64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_matches_distributed_sampler(n, world_size, drop_last, shuffle):
    for rank in range(world_size):
        s = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle,
                               seed=11, drop_last=drop_last)
        for epoch in (0, 3):
            s.set_epoch(epoch)
            assert plan(n, 11, epoch, rank, world_size, shuffle, drop_last).tolist() == list(s)


def test_pure_function_and_fresh_permutation_each_epoch():
    a = plan(1000, 5, 2)
    assert np.array_equal(a, plan(1000, 5, 2))
    assert sorted(a.tolist()) == list(range(1000))
    # each epoch is drawn from the original order, not from the previous epoch's
    assert not np.array_equal(plan(1000, 5, 1), plan(1000, 5, 2))
    g = torch.Generator().manual_seed(5 + 2)
    assert a.tolist() == torch.randperm(1000, generator=g).tolist()


def test_no_shuffle_is_natural_order():
    assert plan(7, 3, 9, shuffle=False).tolist() == list(range(7))


def test_ranks_partition_the_epoch():
    n, ws = 103, 4
    parts = [plan(n, 1, 0, r, ws, drop_last=True) for r in range(ws)]
    assert len({len(p) for p in parts}) == 1
    flat = np.concatenate(parts)
    assert len(set(flat.tolist())) == len(flat)  # no sample twice when dropping
    padded = [plan(n, 1, 0, r, ws) for r in range(ws)]
    assert set(np.concatenate(padded).tolist()) == set(range(n))


@pytest.mark.parametrize("bs,drop_last", [(4, False), (4, True), (None, False)])
def test_epoch_plan_batches(bs, drop_last):
    p = EpochPlan(num_samples=22, seed=3, batch_size=bs, drop_last=drop_last)
    batches = list(p.batches(1))
    assert len(batches) == p.num_batches
    flat = [i for b in batches for i in (b if isinstance(b, list) else [b])]
    assert flat == plan(22, 3, 1).tolist()[: len(flat)]
    assert list(p.batches(1, start=2)) == batches[2:]


@pytest.mark.parametrize("kwargs,msg", [
    (dict(seed=-1), "seed should be an int in [0, 2**64), but got seed=-1"),
    (dict(seed="a"), "seed should be an int"),
    (dict(epoch=-2), "epoch should be a non-negative int, but got epoch=-2"),
    (dict(rank=2, world_size=2), "rank should be an int in [0, world_size=2), but got rank=2"),
    (dict(world_size=0), "world_size should be a positive int, but got world_size=0"),
])
def test_plan_argument_errors(kwargs, msg):
    args = dict(num_samples=10, seed=0, epoch=0)
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        plan(**args)
    assert msg in str(e.value)
