"""An unseeded loader under torch.distributed takes rank 0's seed without a
collective: a loader built on rank 0 only (evaluation) must not pair with
the other ranks' training loader (the constructor used to call
``broadcast_object_list``: rank 0's extra loader took the others' broadcast
and rank 0 then hung in its training loader's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from coordl.synth import make_image_folder
from coordl.testing import popen

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ports import free_port  # noqa: E402

JOB = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    import coordl

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ds = coordl.ImageFolder(sys.argv[1])
    out = {}
    if rank == 0 and sys.argv[2] == "eval-on-rank-0":
        torch.manual_seed(123)
        V = coordl.DataLoader(ds, batch_size=4, shuffle=False)     # no seed, rank 0 only
        out["eval_seed"] = V._seed
    if sys.argv[2] == "rank-1-only":
        if rank == 1:
            try:
                coordl.DataLoader(ds, batch_size=4, shuffle=True)
            except RuntimeError as e:
                out["error"] = str(e)
        else:
            import time
            time.sleep(8)       # rank 0 (which holds the store) lives on, building nothing
    else:
        torch.manual_seed(1000 + rank)      # each rank would draw another seed by itself
        L = coordl.DataLoader(ds, batch_size=4, shuffle=True)
        out["seed"] = L._seed
    print(json.dumps(out), flush=True)
    if sys.argv[2] != "rank-1-only":
        dist.barrier()
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("seedagree") / "photos"
    make_image_folder(root, num_images=16, num_classes=2, image_size=(32, 32), seed=0)
    return str(root)


def _run(tmp_path, folder, case, env_extra=None, timeout=90):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   **(env_extra or {}))
        procs.append(popen([sys.executable, str(script), folder, case], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            assert p.returncode == 0, e[-3000:]
            outs.append(json.loads(o.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def test_a_loader_built_on_rank_0_only_does_not_pair_with_the_training_loader(tmp_path, folder):
    r0, r1 = _run(tmp_path, folder, "eval-on-rank-0")
    assert "eval_seed" in r0
    assert r0["seed"] == r1["seed"]          # both training loaders shuffle with rank 0's training seed


def test_unseeded_ranks_agree_on_rank_0s_seed(tmp_path, folder):
    r0, r1 = _run(tmp_path, folder, "plain")
    assert r0["seed"] == r1["seed"]


def test_a_loader_rank_0_never_builds_fails_clearly(tmp_path, folder):
    r0, r1 = _run(tmp_path, folder, "rank-1-only", env_extra={"COORDL_PEER_RENDEZVOUS_TIMEOUT": "3"})
    assert "rank 0 did not build the same one" in r1["error"] and "seed=" in r1["error"]
