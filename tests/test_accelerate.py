"""coordl's loader under Hugging Face Accelerate (``coordl.accelerate``).

``accelerator.prepare(loader)`` builds a torch DataLoader of its own from
the loader's dataset and arguments, so a coordl loader handed to it loads
through torch's machinery; ``coordl.accelerate.prepare`` keeps Accelerate's
wrapper and its batch sampler and puts a coordl loader inside.  Each case
runs Accelerate in processes of its own (its state is process-wide), one
or two of them as ``torchrun`` starts them, and compares what the prepared
loader delivers with Accelerate's own preparation of torch's loader over
torchvision's dataset: the same samples on each rank, the same pixels."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from coordl.synth import make_image_folder
from coordl.testing import popen

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _ports import free_port  # noqa: E402

pytest.importorskip("accelerate")

PRELUDE = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, %r)
    from _torchvision import import_torchvision
    import_torchvision()
    import torch
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder
    from accelerate import Accelerator
    import coordl
    import coordl.accelerate

    root, workers, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    acc = Accelerator(cpu=True)
    rank = acc.process_index

    def folder(tf):
        ds = ImageFolder(root, tf)
        ds.samples = [(p, i) for i, (p, _) in enumerate(ds.samples)]   # each label its index
        ds.targets = [i for _, i in ds.samples]
        return ds

    def loader(cls, tf, **kw):
        ds = folder(tf)
        kw.setdefault("sampler", torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(5)))
        return cls(ds, batch_size=5, num_workers=workers, **kw)

    def report(**kw):
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(kw, f)
""") % HERE

EVAL = "T.Compose([T.Resize(40), T.CenterCrop(32), T.ToTensor()])"
TRAIN = "T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToTensor()])"

# the same samples and pixels as Accelerate over torch's loader; coordl's pipeline inside Accelerate's wrapper
SAME_AS_TORCH = PRELUDE + textwrap.dedent(f"""
    tf = {EVAL}
    ref = acc.prepare(loader(torch.utils.data.DataLoader, tf))
    given = loader(coordl.DataLoader, tf)
    p = coordl.accelerate.prepare(acc, given)
    plain = acc.prepare(loader(coordl.DataLoader, tf))
    epochs = []
    for e in range(2):
        a = [(y.tolist(), x) for x, y in ref]
        b = [(y.tolist(), x) for x, y in p]
        epochs.append({{"torch": [y for y, _ in a], "coordl": [y for y, _ in b],
                        "same_pixels": len(a) == len(b) and all(torch.equal(u, v) for (_, u), (_, v) in zip(a, b))}})
    # Accelerate's gradient state sees coordl's loader: its last batch, and the epoch's padding dropped
    gathered, ends = [], []
    for x, y in p:
        ends.append(acc.gradient_state.end_of_dataloader)
        gathered += acc.gather_for_metrics(y).tolist()
    report(epochs=epochs, gathered=gathered, ends=ends, base=type(vars(p)["base_dataloader"]).__module__, is_coordl=isinstance(p, coordl.DataLoader),
           given_kept=vars(p)["base_dataloader"] is given, length=[len(p), len(ref)],
           path=p.stats().path, plain_base=type(vars(plain)["base_dataloader"]).__module__,
           several=[type(o).__name__ for o in coordl.accelerate.prepare(acc, torch.nn.Linear(2, 2), given)],
           several_base=type(vars(coordl.accelerate.prepare(acc, torch.nn.Linear(2, 2), given)[1])["base_dataloader"]).__module__)
""")

# a state taken mid-epoch from the prepared loader, loaded into a new one, then the rest of the epoch
RESUME = PRELUDE + textwrap.dedent(f"""
    tf = {TRAIN}
    def prepared():
        torch.manual_seed(0)    # Accelerate seeds the shares' sampler from torch's generator
        return coordl.accelerate.prepare(acc, loader(coordl.DataLoader, tf, sampler=None, shuffle=True, seed=9))
    p = prepared()
    whole, state = [], None
    for k, (x, y) in enumerate(p):
        whole.append((y.tolist(), x))
        if k == 1:
            state = p.state_dict()      # two batches delivered
    torch.save(state, os.path.join(out_dir, f"state{{rank}}.pt"))
    acc.wait_for_everyone()
    other = None
    if acc.num_processes > 1:       # each process's state is its own: another rank's refuses to load mid-epoch
        o = prepared()
        try:
            o.load_state_dict(torch.load(os.path.join(out_dir, f"state{{1 - rank}}.pt")))
        except coordl.StateError as e:
            other = str(e)
    q = prepared()
    q.load_state_dict(torch.load(os.path.join(out_dir, f"state{{rank}}.pt")))
    rest = [(y.tolist(), x) for x, y in q]
    skipped = coordl.accelerate.skip_first_batches(acc, prepared(), 2)
    loaded, twice = prepared(), None
    loaded.load_state_dict(torch.load(os.path.join(out_dir, f"state{{rank}}.pt")))
    try:
        coordl.accelerate.skip_first_batches(acc, loaded, 1)     # it resumes from its state: it would skip twice
    except ValueError as e:
        twice = str(e)
    after = [(y.tolist(), x) for x, y in skipped]
    # Accelerate's own skip_first_batches (what transformers' Trainer calls on resume) reads the batch sampler
    # of the prepared loader: the batches coordl delivers, so it skips the ones delivered
    from accelerate import skip_first_batches as accelerates_skip
    theirs = [y.tolist() for x, y in accelerates_skip(prepared(), 2)]
    # a state taken in the second epoch resumes there; set_epoch is coordl's epoch
    p2 = prepared()
    list(p2)
    second, state1 = [], None
    for k, (x, y) in enumerate(p2):
        second.append((y.tolist(), x))
        if k == 0:
            state1 = p2.state_dict()
    q2 = prepared()
    q2.load_state_dict(state1)
    rest1 = [(y.tolist(), x) for x, y in q2]
    p3 = prepared()
    p3.set_epoch(1)
    set1 = [(y.tolist(), x) for x, y in p3]
    report(whole=[y for y, _ in whole], rest=[y for y, _ in rest], theirs=theirs,
           rest1=len(rest1) == len(second) - 1 and all(a == b and torch.equal(u, v) for (a, u), (b, v) in zip(second[1:], rest1)),
           set1=len(set1) == len(second) and all(a == b and torch.equal(u, v) for (a, u), (b, v) in zip(second, set1)),
           same_pixels=len(rest) == len(whole) - 2 and all(torch.equal(u, v) for (_, u), (_, v) in zip(whole[2:], rest)),
           other=other, skipped_pixels=all(torch.equal(u, v) for (_, u), (_, v) in zip(whole[2:], after)), twice=twice,
           skipped=[y for y, _ in after], skipped_base=type(vars(skipped)["base_dataloader"]).__module__)
""")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate") / "photos"
    make_image_folder(str(root), num_images=23, num_classes=3, image_size=(48, 40), seed=4)
    return str(root)


def _run(tmp_path, folder, code: str, processes: int, workers: int, timeout: float = 180) -> list[dict]:
    """The script in ``processes`` processes with the environment torchrun
    gives each (one process: none, as a plain ``python script.py``); what
    each rank reported."""
    script = tmp_path / "job.py"
    script.write_text(code)
    port = free_port()
    procs = []
    for rank in range(processes):
        env = dict(os.environ)
        if processes > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(processes),
                       LOCAL_WORLD_SIZE=str(processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(popen([sys.executable, str(script), folder, str(workers), str(tmp_path)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    out = []
    for rank in range(processes):
        with open(tmp_path / f"rank{rank}.json") as f:
            out.append(json.load(f))
    return out


@pytest.mark.parametrize("processes,workers", [(1, 0), (2, 0), (2, 2)])
def test_a_prepared_loader_delivers_accelerates_shares_through_coordl(tmp_path, folder, processes, workers):
    ranks = _run(tmp_path, folder, SAME_AS_TORCH, processes, workers)
    for r in ranks:
        assert r["base"] == "coordl.loader" and r["is_coordl"] and r["path"] == "coordl"
        assert r["plain_base"] == "torch.utils.data.dataloader"       # what accelerator.prepare alone gives
        assert r["given_kept"] == (processes == 1)     # one process: the loader given; else one over the shares
        assert r["length"][0] == r["length"][1]
        # among other objects, in their order (the model wrapped for DDP with two processes)
        assert r["several"] == [["Linear", "DistributedDataParallel"][processes > 1], "DataLoaderShard"]
        assert r["several_base"] == "coordl.loader"
        for e in r["epochs"]:
            assert e["coordl"] == e["torch"] and e["same_pixels"]
    for e in range(2):
        labels = [i for r in ranks for y in r["epochs"][e]["coordl"] for i in y]
        assert set(labels) == set(range(23))       # every sample, each rank its own share
        # even batches: the last short batches filled from the start of the epoch, as Accelerate fills them
        assert len(labels) == (23 if processes == 1 else 30)
    assert ranks[0]["epochs"][0]["coordl"] != ranks[0]["epochs"][1]["coordl"]
    for r in ranks:
        assert sorted(r["gathered"]) == list(range(23))     # every sample once, the padding dropped
        assert r["ends"] == [False] * (len(r["ends"]) - 1) + [True]


@pytest.mark.parametrize("processes,workers", [(1, 2), (2, 0)])
def test_a_state_saved_mid_epoch_through_the_prepared_loader_resumes_exactly(tmp_path, folder, processes, workers):
    for r in _run(tmp_path, folder, RESUME, processes, workers):
        assert len(r["whole"]) > 2 and r["rest"] == r["whole"][2:] and r["same_pixels"]
        # skipping two batches of the same epoch: the same batches, not prepared before
        assert r["skipped"] == r["whole"][2:] and r["skipped_pixels"] and r["skipped_base"] == "coordl.loader"
        assert "skip them twice" in r["twice"]
        assert r["theirs"] == r["whole"][2:] and r["rest1"]
        # one process: the epoch plan gives the order, and set_epoch(1) its second epoch; with two, the order is
        # that of Accelerate's sampler, whose generator has moved on
        assert r["set1"] == (processes == 1)
        assert (r["other"] is None) == (processes == 1)
        assert processes == 1 or "Resume with the same world size and rank" in r["other"]


def test_skip_first_batches_takes_only_a_loader_coordl_prepared():
    import coordl.accelerate

    class Prepared:
        base_dataloader = None

    with pytest.raises(TypeError, match="coordl.accelerate.prepare"):
        coordl.accelerate.skip_first_batches(object(), Prepared(), 3)
