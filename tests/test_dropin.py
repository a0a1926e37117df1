"""Drop-in gaps found with torch's own DataLoader tests and with the tools
around it: generic subscription, torch's iterator attributes, nested-tensor
batches, a script pointing torch's name at coordl's class, a loader built
again from its attributes (PyTorch Lightning's sampler injection)."""
import inspect
import os
import sys
from typing import List

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import TensorDataset

import coordl
from coordl import DataLoader
from toydata import Plain, TwoStageToy


def test_dataloader_is_generic_like_torch():
    alias = DataLoader[List[torch.Tensor]]
    assert alias.__origin__ is DataLoader
    assert TorchDataLoader[List[torch.Tensor]].__origin__ is TorchDataLoader

    def annotated() -> "coordl.DataLoader[List[torch.Tensor]]":  # evaluated below, as at import
        return DataLoader(TensorDataset(torch.arange(4)))

    ns = {"coordl": coordl, "List": List, "torch": torch}
    assert eval(annotated.__annotations__["return"], ns).__origin__ is DataLoader


# Placements: coordl's pipeline (two-stage dataset, epoch plan), torch's
# machinery with coordl's wrappers (TensorDataset fast path, seed on a generic
# dataset), and torch's machinery untouched (generic dataset, torch samplers).
PLACEMENTS = {
    "pipeline": lambda **kw: (TwoStageToy(24), dict(seed=1, **kw)),
    "tensor_fast_path": lambda **kw: (TensorDataset(torch.arange(24)), kw),
    "plan_generic": lambda **kw: (Plain(24), dict(seed=1, **kw)),
    "torch_samplers": lambda **kw: (Plain(24), kw),
}


def _pair(placement, **kw):
    ds, ckw = PLACEMENTS[placement](batch_size=4, **kw)
    torch_kw = {k: v for k, v in ckw.items() if k != "seed"}
    return DataLoader(ds, **ckw), TorchDataLoader(ds, **torch_kw)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterator_has_torchs_attributes(placement, num_workers):
    ours, theirs = _pair(placement, num_workers=num_workers)
    for L in (ours, theirs):
        it = iter(L)
        assert it._num_yielded == 0
        next(it), next(it), next(it)
        assert it._num_yielded == 3
        assert it._dataset is L.dataset  # the user's dataset, not a wrapper
        assert it._collate_fn is L.collate_fn
        assert it._index_sampler is L._index_sampler
        assert len(it._index_sampler) == 6
        assert (it._num_workers, it._persistent_workers, it._timeout, it._drop_last) == (num_workers, False, 0, False)
        assert it._pin_memory is False and it._auto_collation is True
        assert it._dataset_kind == L._dataset_kind and (it._world_size, it._rank) == (1, 0)
        if num_workers:  # attributes of torch's multiprocessing iterator only
            assert it._prefetch_factor == L.prefetch_factor and it._in_order is True
            workers = list(it._workers)
            assert len(workers) == num_workers and all(w.is_alive() and w.pid for w in workers)
            assert it._worker_pids_set is True and isinstance(it._base_seed, int)
            it._shutdown_workers()
            for w in workers:
                w.join(10)
                assert not w.is_alive() and w.exitcode == 0
            assert it._shutdown
        del it


@pytest.mark.parametrize("placement", ["pipeline", "tensor_fast_path"])
def test_shutdown_workers_then_next_ends_the_pass(placement):
    ours, _ = _pair(placement, num_workers=2)
    it = iter(ours)
    next(it)
    workers = list(it._workers)
    it._shutdown_workers()
    assert list(it) == []
    assert all(not w.is_alive() for w in workers)
    assert len(list(ours)) == 6  # the next pass starts its own workers


@pytest.mark.parametrize("persistent", [False, True])
def test_shutdown_persistent_workers_next_pass_works(persistent):
    L = DataLoader(TwoStageToy(24), batch_size=4, seed=1, num_workers=2, persistent_workers=persistent)
    it = iter(L)
    next(it)
    it._shutdown_workers()
    del it
    L2 = DataLoader(TensorDataset(torch.arange(24)), batch_size=4, num_workers=2,
                    persistent_workers=persistent)
    it = iter(L2)
    next(it)
    it._shutdown_workers()
    del it
    assert len(list(L)) == 6 and len(list(L2)) == 6


def test_an_earlier_iterator_used_after_a_new_pass_began_behaves_as_torchs():
    """``a = iter(L); next(a); b = iter(L); next(b)``, then ``a`` read to
    its end: torch's iter() of a loader with persistent workers resets and
    returns its one iterator, so ``a`` goes on with ``b``'s pass (15 more
    batches, ``b`` then done); without them the two passes are apart (15
    and 16).  coordl's ``a`` read the pool's batches meant for ``b``, which
    then waited for them forever."""
    from coordl.testing import run_in_child

    code = """
import sys
import torch
from torch.utils.data.dataloader import DataLoader as Torch
import coordl
sys.path.insert(0, {tests!r})
from toydata import TwoStageToy
for persistent in (False, True):
    for cls in (Torch, coordl.DataLoader):
        L = cls(TwoStageToy(64), batch_size=4, num_workers=1, persistent_workers=persistent)
        a = iter(L)
        first = next(a)[0][:, 0]
        b = iter(L)
        second = next(b)[0][:, 0]
        rest_a = [x[:, 0] for x, _ in a]
        rest_b = [x[:, 0] for x, _ in b]
        labels = sorted(torch.cat([second] + (rest_a if persistent else []) + rest_b).tolist())
        print("ROW", persistent, cls.__module__.split(".")[0], len(rest_a), len(rest_b), labels == list(range(64)))
"""
    r = run_in_child(code.format(tests=os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split()[1:] for line in r.stdout.splitlines() if line.startswith("ROW ")]
    assert rows == [["False", "torch", "15", "15", "True"], ["False", "coordl", "15", "15", "True"],
                    ["True", "torch", "15", "0", "True"], ["True", "coordl", "15", "0", "True"]], r.stdout


def _nested_collate(samples):
    return torch.nested.nested_tensor(list(samples))


class Ragged(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.full((i + 1, 3), float(i))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [3, None])
def test_nested_tensor_batches_delivered_like_torch(num_workers, batch_size):
    ds = Ragged()
    if batch_size is None:
        kw = dict(batch_size=None, collate_fn=lambda x: torch.nested.nested_tensor([x, x]))
    else:
        kw = dict(batch_size=batch_size, collate_fn=_nested_collate)
    want = list(TorchDataLoader(ds, num_workers=num_workers, **kw))
    L = DataLoader(ds, num_workers=num_workers, **kw)
    got = list(L)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.is_nested
        assert all(torch.equal(a, b) for a, b in zip(g.unbind(), w.unbind()))
    stats = L.stats()
    assert stats.batches == len(want)
    assert stats.samples == 6  # two batches of 3, or one sample per step


# A script may point torch's name at coordl's class (torch.utils.data.DataLoader = coordl.DataLoader), so
# that code it does not own (timm's create_loader, a trainer's) builds coordl's loaders: coordl's own calls of
# torch's DataLoader must still reach torch's class, on every path.
_SWAPPED = """
import sys, torch
sys.path.insert(0, %r)
import coordl
torch.utils.data.DataLoader = coordl.DataLoader
from torch.utils.data import RandomSampler, TensorDataset
from toydata import Plain, TwoStageToy
ds = TwoStageToy(24)
cases = [lambda: coordl.DataLoader(ds, batch_size=4, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(1))),
         lambda: coordl.DataLoader(ds, batch_size=4, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(1)),
                                   num_workers=2),
         lambda: coordl.DataLoader(ds, batch_size=4, shuffle=True, seed=1),
         lambda: coordl.DataLoader(Plain(24), batch_size=4, shuffle=True, num_workers=2),
         lambda: coordl.DataLoader(TensorDataset(torch.arange(24)), batch_size=4, shuffle=True)]
for make in cases:
    a = make()
    assert len(list(a)) == 6
    it = iter(a)
    next(it)
    state = a.state_dict()
    b = make()
    b.load_state_dict(state)
    assert len(list(b)) == 5
print("ok")
"""


def test_a_script_that_points_torchs_name_at_coordls_loader_still_loads():
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", _SWAPPED % here], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


# numpy's global generator holds a lock while it draws or is seeded, the GIL released: a worker forked
# while another thread of the process holds it (a loader iterated in another thread, whose samples' steps
# coordl seeds numpy's generator for) inherits it held, and seeding its own generator waited forever; the
# same for coordl's own module locks that workers take (the agreement checks', the kernels' tables').
_NUMPY_HELD = """
import sys, threading
sys.path.insert(0, %r)
import numpy as np, coordl
from coordl import tvcompat
from toydata import TwoStageToy
held, done = threading.Event(), threading.Event()

class Locking(TwoStageToy):
    def prep(self, raw, i):
        with tvcompat._agree_lock:      # as a worker's first agreement check takes it
            return super().prep(raw, i)

def hold():
    with np.random.mtrand._rand._bit_generator.lock, tvcompat._agree_lock:
        held.set()
        done.wait(60)

threading.Thread(target=hold, daemon=True).start()
held.wait()
n = len(list(coordl.DataLoader(Locking(16), batch_size=4, num_workers=2, seed=0)))
done.set()
print("ok", n)
"""


def test_workers_start_while_another_thread_holds_numpys_generator():
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        r = subprocess.run([sys.executable, "-c", _NUMPY_HELD % here], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the loader's workers never delivered: they waited for a lock another thread held at the fork")
    assert r.returncode == 0 and r.stdout.split() == ["ok", "4"], r.stderr[-3000:]


# ------------------------------------------------- a loader built again from its attributes
# Tools that put a sampler of their own into a loader they did not see built (PyTorch Lightning, for
# DistributedSampler under DDP, when the loader is passed to Trainer.fit) build it again from the
# __init__ parameters found among its attributes whose values are not the defaults, with the new
# sampler in place of the old one; coordl's own arguments must be among those names, or the copy
# silently loses them (its cache, its seed, its device...).
COORDL_ARGS = dict(seed=11, cache_size="8MiB", device="cpu", on_error="skip", rank=0, world_size=1,
                   read_ahead="4MiB", fetch_threads=3, cache_checksum=True, cache_keep_warm=2.0)


def _rebuilt(loader, sampler):
    """The loader built again as such a tool builds it (Lightning's rule, written here)."""
    import inspect

    attrs = {k: v for k, v in vars(loader).items() if not k.startswith("_")}
    params = inspect.signature(type(loader).__init__).parameters
    kw = {n: attrs[n] for n, p in params.items() if n in attrs and p.default is not attrs[n]}
    kw.pop("batch_sampler", None)          # torch's own, made of batch_size and drop_last
    kw.update(sampler=sampler, shuffle=False)
    return type(loader)(**kw)


@pytest.fixture
def folder(photo_folder):
    return photo_folder("rebuilt", num_images=12, num_classes=2, mean_kb=2, image_size=(24, 20), seed=2)


def _drop_caches():
    """cache_keep_warm keeps the caches after their loaders: cleared here, as `coordl cache clear` does."""
    from coordl import cache as C
    from coordl.testing import settle

    settle()
    for c in C.list_caches():
        C.clear_caches(c.name)


def _check_rebuilt(loader, again, sampler):
    assert type(again) is DataLoader and again.seed == 11 and again.cache_size == loader.cache_size == 8 * 2 ** 20
    assert again.on_error == "skip" and vars(again)["device"] == "cpu" and again._fetch_threads == 3
    assert again._read_ahead == 4 * 2 ** 20 and again._cache_opts == (True, 2.0)
    assert again.batch_size == 4 and again.sampler is sampler
    labels = [int(t) for _, y in again for t in y]
    assert labels == [loader.dataset.targets[i] for i in sampler]


def test_coordls_arguments_are_attributes_of_their_names_for_tools_that_build_the_loader_again(folder):
    ds = coordl.ImageFolder(folder, transform=coordl.transforms.PILToTensor())
    loader = DataLoader(ds, batch_size=4, shuffle=True, **COORDL_ARGS)
    got = vars(loader)
    for name, value in COORDL_ARGS.items():
        assert name in got and got[name] == value, (name, got.get(name))
    # the properties of those names still answer what the loader runs with
    assert loader.seed == 11 and loader.cache_size == 8 * 2 ** 20 and loader.device is None   # "cpu": none
    sampler = torch.utils.data.distributed.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=5)
    again = _rebuilt(loader, sampler)
    _check_rebuilt(loader, again, sampler)
    del again, loader
    _drop_caches()


def test_lightning_injecting_its_sampler_keeps_coordls_arguments(folder):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _torchvision import import_torchvision

    import_torchvision()          # lightning imports torchmetrics, which imports torchvision
    pytest.importorskip("lightning")
    from lightning.pytorch.utilities.data import _update_dataloader

    ds = coordl.ImageFolder(folder, transform=coordl.transforms.PILToTensor())
    loader = DataLoader(ds, batch_size=4, shuffle=True, **COORDL_ARGS)
    sampler = torch.utils.data.distributed.DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=5)
    again = _update_dataloader(loader, sampler)
    _check_rebuilt(loader, again, sampler)
    del again, loader
    _drop_caches()


def test_a_loader_with_defaults_hands_nothing_more_to_a_rebuild():
    loader = DataLoader(TwoStageToy(8), batch_size=4)
    params = inspect.signature(DataLoader.__init__).parameters
    extras = set(COORDL_ARGS) | {"decode", "share", "peers", "progress", "jpeg_draft"}
    assert extras <= set(vars(loader))
    assert not {k for k in extras if vars(loader)[k] is not params[k].default}


# ------------------------------------------------- pickling and copying a loader
# torch's loader pickles (Lightning's ddp_spawn sends the loaders given to Trainer.fit to the processes it
# spawns; copy.deepcopy copies them): coordl's pickles as the arguments it was built with and its state.
def _batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_pickles_and_its_copy_delivers_the_same_batches(num_workers):
    import pickle

    loader = DataLoader(TwoStageToy(30), batch_size=4, shuffle=True, num_workers=num_workers)
    copy = pickle.loads(pickle.dumps(loader))
    assert type(copy) is DataLoader and copy is not loader and copy.seed == loader.seed
    for _ in range(2):
        assert _same(_batches(copy), _batches(loader))
    del copy, loader


def test_a_loader_pickled_mid_epoch_goes_on_where_it_was():
    import pickle

    loader = DataLoader(TwoStageToy(30), batch_size=4, shuffle=True)
    it = iter(loader)
    first = [next(it), next(it)]
    copy = pickle.loads(pickle.dumps(loader))
    rest = _batches(it)
    assert len(first) + len(rest) == 8
    assert _same(_batches(copy), rest)           # the copy's first pass: the batches not yet delivered
    assert _same(_batches(copy), _batches(loader))
    del it


def test_a_copy_of_a_loader_over_a_plain_dataset_is_torchs_copy():
    """Torch's machinery: the copy's order is what torch's copy gives (the
    generator goes with it, at its state)."""
    import copy as copymod

    ds = TensorDataset(torch.arange(20), torch.arange(20) % 3)
    torch_loader = TorchDataLoader(ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(4))
    mine = DataLoader(ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(4))
    assert _same(_batches(mine), _batches(torch_loader))
    theirs, ours = copymod.deepcopy(torch_loader), copymod.deepcopy(mine)
    assert type(ours) is DataLoader and ours.stats().path == "torch"
    for _ in range(2):
        assert _same(_batches(ours), _batches(theirs))


def test_a_torchvision_loader_pickles_with_its_users_dataset(photo_folder):
    import pickle

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _torchvision import import_torchvision

    tv = import_torchvision()
    if tv is None:
        pytest.skip("torchvision is not installed (pip install coordl[test])")
    from torchvision import datasets, transforms as T

    root = photo_folder("pickled", num_images=10, num_classes=2, mean_kb=2, image_size=(30, 24), seed=6)
    ds = datasets.ImageFolder(root, T.Compose([T.RandomResizedCrop(16), T.ToTensor()]))
    loader = DataLoader(ds, batch_size=4, shuffle=True, seed=2)
    copy = pickle.loads(pickle.dumps(loader))
    assert copy.stats().path == "coordl" and copy.stats().path_reason == loader.stats().path_reason
    assert _same(_batches(copy), _batches(loader))
    ds.transform = T.Compose([T.CenterCrop(12), T.ToTensor()])      # followed by the original...
    assert _batches(loader)[0][0].shape[-1] == 12
    assert _batches(copy)[0][0].shape[-1] == 16                       # ...not by the copy, which has its own
    del copy, loader


def test_what_does_not_pickle_fails_as_under_torch():
    import pickle

    ds = TensorDataset(torch.arange(8))
    with pytest.raises(Exception) as theirs:
        pickle.dumps(TorchDataLoader(ds, collate_fn=lambda b: b))
    with pytest.raises(type(theirs.value)):
        pickle.dumps(DataLoader(ds, collate_fn=lambda b: b))


def test_torchs_init_gets_every_argument_by_keyword(monkeypatch):
    """A tool that records the arguments of torch's __init__ (Lightning, when it
    could not wrap coordl's own) replaces the sampler among them: positional
    ones would then be given twice ("got multiple values for argument
    'sampler'")."""
    seen = []
    torch_init = TorchDataLoader.__init__

    def recording(self, *args, **kwargs):
        seen.append((args, set(kwargs)))
        torch_init(self, *args, **kwargs)

    monkeypatch.setattr(TorchDataLoader, "__init__", recording)
    DataLoader(TwoStageToy(8), batch_size=4, shuffle=True, seed=1)
    assert len(seen) == 1 and seen[0][0] == () and {"dataset", "sampler", "batch_size"} <= seen[0][1], seen


def test_the_loader_class_exists_once_coordl_is_imported_after_torch():
    """So that a tool patching torch's DataLoader subclasses for a while
    (Lightning around its *_dataloader hooks) finds it, even when the script
    first names coordl.DataLoader inside such a hook; without torch imported
    first, ``import coordl`` still imports no torch."""
    import subprocess

    code = ("import sys\n"
            "import coordl\n"
            "assert 'torch' not in sys.modules and 'coordl.loader' not in sys.modules\n"
            "import torch\n"
            "import importlib; importlib.reload(coordl)\n"
            "assert 'coordl.loader' in sys.modules\n"
            "from torch.utils.data import DataLoader\n"
            "assert sys.modules['coordl.loader'].DataLoader in DataLoader.__subclasses__()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


_HOOK_JOB = """
import sys
sys.path.insert(0, {tests!r})
from _torchvision import import_torchvision
import_torchvision()
import torch
import lightning
import coordl                        # coordl.DataLoader first named inside the hook, below
from lightning.fabric.utilities.data import _replace_dunder_methods
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

ds = coordl.ImageFolder({root!r}, transform=coordl.transforms.PILToTensor())
with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
    loader = coordl.DataLoader(ds, batch_size=4, shuffle=True, seed=11, read_ahead="4MiB", fetch_threads=3)
sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=5)
again = _update_dataloader(loader, sampler)
assert type(again) is coordl.DataLoader and again.sampler is sampler, again
assert again.seed == 11 and again._read_ahead == 4 * 2 ** 20 and again._fetch_threads == 3
assert [int(t) for _, y in again for t in y] == [ds.targets[i] for i in sampler]
print("ok")
"""


def test_lightning_rebuilding_a_loader_made_in_its_hook_keeps_coordls_arguments(folder):
    """A LightningModule's train_dataloader() naming coordl.DataLoader for the
    first time in the process: Lightning records its arguments and builds it
    again with a DistributedSampler (this failed with "got multiple values for
    argument 'sampler'" when the class did not exist yet as Lightning began
    recording)."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from _torchvision import import_torchvision

    import_torchvision()
    pytest.importorskip("lightning")
    r = subprocess.run([sys.executable, "-c", _HOOK_JOB.format(tests=here, root=str(folder))],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


_CKPT_JOB = """
import glob, sys, tempfile
sys.path.insert(0, {tests!r})
from _torchvision import import_torchvision
import_torchvision()
import torch
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import coordl


class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3 * 8 * 8, 2)
        self.seen = []

    def training_step(self, batch, i):
        x, y = batch
        self.seen.append(y.tolist())
        return torch.nn.functional.cross_entropy(self.layer(x.float().flatten(1)), y)

    def train_dataloader(self):
        tf = coordl.transforms.Compose([coordl.transforms.RandomResizedCrop(8), coordl.transforms.PILToTensor()])
        return coordl.DataLoader(coordl.ImageFolder({root!r}, transform=tf), batch_size=2, shuffle=True,
                                 num_workers={workers})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.1)


kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
          max_epochs=2)
where = tempfile.mkdtemp()
torch.manual_seed(0)
whole = M()
L.Trainer(callbacks=[ModelCheckpoint(dirpath=where, every_n_train_steps=8, save_top_k=-1)], **kw).fit(whole)
ckpt = [p for p in glob.glob(where + "/*.ckpt") if "step=8" in p][0]      # mid-epoch 1 (6 batches an epoch)
torch.manual_seed(1)                                                       # another process's state
rest = M()
L.Trainer(enable_checkpointing=False, **kw).fit(rest, ckpt_path=ckpt)
assert len(whole.seen) == 12 and rest.seen == whole.seen[8:], (whole.seen, rest.seen)
print("ok")
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_lightning_resumes_mid_epoch_from_its_checkpoint_exactly(folder, workers):
    """A Lightning checkpoint saved mid-epoch holds the loader's state_dict
    (coordl's loader is stateful for Lightning): training resumed from it
    delivers exactly the batches the uninterrupted run delivered after it
    (torch's loader, reshuffled on resume, does not)."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from _torchvision import import_torchvision

    import_torchvision()
    pytest.importorskip("lightning")
    r = subprocess.run([sys.executable, "-c", _CKPT_JOB.format(tests=here, root=str(folder), workers=workers)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
