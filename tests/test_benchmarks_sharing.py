"""The benchmark scripts of sharing across jobs and nodes at tiny sizes, so
they cannot rot (no timing asserted): sharing.py, peers.py and gpu.py (whose
part (c) shares prep between jobs).  The others are in test_benchmarks.py."""
import csv
import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_helpers import _script  # noqa: E402


def test_sharing_quick(tmp_path):
    # a few configurations keep the suite short; the full list runs in the benchmark itself
    # (shared-mixed: several jobs sharing, of different batch sizes; shared-K2 would run the same code)
    out = _script("sharing.py", "--quick", "--configs", "solo,shared-mixed,shared-idle", "--step", "sleep",
                  "--out", str(tmp_path), timeout=600)
    with open(tmp_path / "sharing.csv") as f:
        rows = {r["config"]: r for r in csv.DictReader(f)}
    with open(tmp_path / "sharing_jobs.csv") as f:
        jobs = list(csv.DictReader(f))
    assert list(rows) == ["solo", "shared-mixed"], out
    for name, r in rows.items():
        k = int(r["K"])
        assert len(r["job_images_per_s"].split("/")) == k
        assert all(float(x) > 0 for x in r["job_images_per_s"].split("/"))
        # every job of every configuration ran both epochs over all 48 images
        mine = [j for j in jobs if j["config"] == name]
        assert sorted((int(j["job"]), int(j["epoch"])) for j in mine) == [(i, e) for i in range(k) for e in (0, 1)]
        assert all(int(j["images"]) == 48 for j in mine)
    # jobs started together did share samples
    assert sum(int(j["samples_shared"] or 0) for j in jobs if j["config"] == "shared-mixed") > 0
    assert "\ntargets:\n" in out
    # the slowest job vs solo, bit-identity by CRC, first batch after idling
    assert "  slowest of mixed batch sizes sharing / solo" in out
    assert re.search(r"every job's batches bit-identical to solo \(1 = yes\) +1\.00  met", out), out
    assert "  first batch after 2 s idle / warm start" in out, out
    m = re.search(r"groups (coordl-sharing-\d+-)\*", out)
    if m:   # the run's own groups are gone (another run's may exist beside it)
        for c in ("cpuacct", "blkio"):
            d = f"/sys/fs/cgroup/{c}"
            assert not (os.path.isdir(d) and [x for x in os.listdir(d) if x.startswith(m.group(1))])


def test_sharing_held_quick():
    """``sharing.py --held``: kept batches of every epoch while the epochs run twice over a staging
    that wraps; no row of a kept batch may change, every epoch is share=False's."""
    out = _script("sharing.py", "--held", "--quick", timeout=300)
    assert "held batches: 0 changed rows" in out and "epochs differing from share=False: 0" in out, out


def test_peers_quick(tmp_path):
    # two "nodes" as processes on loopback (--quick: no namespaces, cgroups or root), each caching 60%
    # of the dataset (together all of it, as the benchmark's three of 36%: a rank process per node and
    # configuration costs seconds of imports); the namespace + cgroup set-up runs in the benchmark itself
    # (docs/benchmarks.md)
    out = _script("peers.py", "--quick", "--nodes", "2", "--cache-fraction", "0.6", "--out", str(tmp_path),
                  timeout=300)
    with open(tmp_path / "peers.csv") as f:
        rows = list(csv.DictReader(f))
    with open(tmp_path / "peers_summary.csv") as f:
        summary = {r["config"]: r for r in csv.DictReader(f)}
    assert list(summary) == ["peers", "off", "local"], out
    for name in summary:
        mine = [r for r in rows if r["config"] == name]
        assert sorted((int(r["node"]), int(r["epoch"])) for r in mine) == [(n, e) for n in range(2) for e in range(3)]
        # every epoch delivered the 60 images once across the two nodes
        assert all(sum(int(r["images"]) for r in mine if int(r["epoch"]) == e) == 60 for e in range(3))
    later = [r for r in rows if int(r["epoch"]) >= 1]
    peer = [r for r in later if r["config"] == "peers"]
    # with peers, a later epoch's misses come from the other nodes, not storage
    assert all(int(r["peer_bytes"]) > 0 and int(r["storage_bytes"]) == 0 for r in peer), peer
    assert all(int(r["peer_bytes"]) == 0 for r in rows if r["config"] != "peers")
    assert sum(int(r["storage_bytes"]) for r in later if r["config"] == "off") > 0
    assert all(int(r["storage_bytes"]) == 0 and int(r["peer_bytes"]) == 0
               for r in rows if r["config"] == "local")
    assert "targets:" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "peers.png").exists()


def test_peers_first_pass_and_connection_targets_tiny(tmp_path):
    """benchmarks/peers.py first-pass and connections at a tiny size."""
    out = _script("peers.py", "first-pass", "--images", "60", "--nodes", "2", "--epochs", "3", "--workers", "0",
                  "--batch-size", "8", "--cache-fraction", "0.55", "--scenarios", "eval,resume", "--out", str(tmp_path), timeout=300)
    assert "eval " in out and "resume " in out and "MISSED" not in out, out
    import json

    res = json.loads((tmp_path / "peers_first_pass.json").read_text())["results"]
    assert res["eval"]["met"] and res["resume"]["met"]
    out = _script("peers.py", "connections", "--nodes", "5", "--ranks", "2", "--workers", "3", "--procs", "2",
                  "--idle", "20", "--out", str(tmp_path), timeout=120)
    c = json.loads((tmp_path / "peers_connections.json").read_text())
    assert c["served"] == c["requests"] == 4 * 2 * 3 * 4 and c["server_threads"] == 3, out


#: gpu.py's rows that run only where nvidia.nvimgcodec imports (the decode="device" rows run on the CPU
#: stand-in in --smoke, so that their plumbing is checked before a GPU run)
NEEDS_NVIMGCODEC = ("coordl-decode-split-hw", "coordl-decode-split", "coordl-decode-split-nv", "coordl-decode-hw",
                    "coordl-decode-cuda", "coordl-decode-split-cuda")


@pytest.mark.timeout(600)
def test_gpu_smoke(tmp_path):
    """benchmarks/gpu.py --smoke: every part at tiny sizes (the CPU stands in
    for the GPU where there is none), so the script is right before a GPU
    run; no timing asserted."""
    out, work = tmp_path / "gpu.json", tmp_path / "work"
    work.mkdir()
    text = _script("gpu.py", "--smoke", "--out", str(out), "--tmp", str(work), timeout=540)
    res = json.loads(out.read_text())
    assert set(res["parts"]) == {"a", "b", "c", "d"}, text
    m = res["machine"]
    assert m["cpu_count"] >= 1 and m["python"] and m["torch"] and m["coordl"] and m["date"], m
    dali = res["parts"]["d"]
    assert dali["ran"] or dali["skipped"], dali
    if not dali["ran"]:
        assert "(d) DALI: skipped: " in text
    a = res["parts"]["a"]
    # the rows run without --loaders (coordl-decode-deep, -split-nv and -hw only when named)
    names = ["torch", "coordl-import", "coordl-device", "dali", "coordl-decode-device", "coordl-decode-block",
             "coordl-decode-cuda", "coordl-decode-workers", "coordl-decode-measured", "coordl-decode-split-hw"]
    names_b = [n for n in names if n not in ("coordl-decode-cuda", "coordl-decode-measured")]   # part (a) only
    names_b.insert(names_b.index("coordl-decode-block") + 1, "coordl-decode-level")            # part (b) only
    assert list(a["rows"]) == names, a
    for name, by_workers in a["rows"].items():
        assert list(by_workers) == [str(w) for w in a["workers"]], by_workers
        for w, r in by_workers.items():
            if name == "dali" and not dali["ran"]:
                assert r == {"skipped": dali["skipped"]}
                continue
            if name in NEEDS_NVIMGCODEC and "skipped" in r:
                # where nvImageCodec imports (DALI's wheel brings it), a row measured from 4 workers on
                # skips the smoke run's 1 and 2 for that reason first
                assert "nvidia.nvimgcodec does not import" in r["skipped"] or (
                    int(w) < 4 and r["skipped"] == "measured at 4 to any number of workers"), r
                continue
            if name == "coordl-decode-workers":     # from 4 workers in (a); --smoke runs 1 and 2 (part (b) runs it)
                assert r["skipped"] == "measured at 4 to any number of workers", r
                continue
            if name == "coordl-decode-measured":    # no decoders step's figures without gpu_check.sh
                assert "--decoders-json" in r["skipped"], r
                continue
            assert "error" not in r and r["images_per_s"] > 0 and r["images"] > 0 and r["cpu_ms_per_image"] > 0, r
            # where a decode="device" pass spends its time: for those loaders only
            assert (r["decode_call_share"] is not None) == name.startswith("coordl-decode-"), r
            # where the CPU went: the workers' share is counted (a loader with workers has them)
            assert r["cores_busy"] > 0, r
            if not r["cut_at_epoch_end"]:
                assert r["worker_processes"] >= (name != "dali"), r
                assert r["workers_cpu_ms_per_image"] > 0 or name == "dali", r
    b = res["parts"]["b"]
    assert b["ceiling"]["images_per_s"] > 0, b
    assert list(b["rows"]) == names_b, b
    assert all(b["rows"][n]["workers"] <= 4 for n in ("coordl-decode-device", "coordl-decode-split-hw",
                                                       "coordl-decode-workers", "coordl-decode-level"))
    share = b["rows"]["coordl-decode-workers"]          # 2 workers at 39:1: 2/41 of the samples, by index
    assert 0 < share["on_cpu_share"] < 0.25, share
    assert b["rows"]["coordl-decode-device"]["on_cpu_share"] == 0.0, b["rows"]["coordl-decode-device"]
    for name, r in b["rows"].items():
        if (name == "dali" and not dali["ran"]) or (name in NEEDS_NVIMGCODEC and "skipped" in r):
            continue
        assert "error" not in r and r["images_per_s"] > 0
        assert r["of_ceiling"] == pytest.approx(r["images_per_s"] / b["ceiling"]["images_per_s"], abs=1e-3)
    # the ceiling and the rows --profile-b names ran again under the profiler (on a CPU: no device streams)
    for p in (b["ceiling"]["profile"], b["rows"]["coordl-device"]["profile"],
              b["rows"]["coordl-decode-block"]["profile"]):
        assert "error" not in p and p["images"] > 0 and "streams" in p, p
    assert "profile" not in b["rows"]["coordl-decode-device"]
    c = res["parts"]["c"]
    assert list(c["rows"]) == ["coordl share=True"], c   # --smoke runs the shared row alone
    for label, r in c["rows"].items():
        assert "error" not in r, r
        assert r["alone"] > 0 and len(r["per_job"]) == c["jobs"] and min(r["per_job"]) > 0, r
    # jobs started together on the same folder did share prep through the node daemon
    assert sum(c["rows"]["coordl share=True"]["shared_samples"]) > 0, c
    for title in ("(a) images/s on", "(a) where the CPU goes", "(b) ", "(c) "):
        assert title in text, text
    assert set(res["targets"]) == {n for n in names if n.startswith("coordl-decode-")}, res["targets"]
    assert os.listdir(work) == [], "the run's temporary folder was left behind"


def _gpu_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "_gpu_bench", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu.py"))
    gpu = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpu  # its dataclasses look their module up
    try:
        spec.loader.exec_module(gpu)
    finally:
        del sys.modules[spec.name]
    return gpu, spec


def test_gpu_script_weighs_the_measured_row_by_its_figures(tmp_path):
    """coordl-decode-measured: each decoder weighs the images/s it was
    measured to deliver (the decoders step's JSON; nvImageCodec's CUDA
    decoder only where it decoded every file), each worker one
    coordl-device worker's at that worker count; a missing figure is said."""
    import torch

    from coordl.device import decoders as DDS

    gpu, _ = _gpu_module()
    fig = {"rows": {gpu.TV_ROWS[0]: {"pixels": {"undecoded": 0}, "1 threads": {"images_per_s": 15789.1}},
                    gpu.CUDA_ROW: {"pixels": {"undecoded": 0}, "1 threads": {"images_per_s": 9000.4}}}}
    path = tmp_path / "d.json"
    path.write_text(json.dumps(fig))
    ctx = gpu.Ctx(root=str(tmp_path), device=torch.device("cpu"), decoders=gpu._read_decoders(str(path)))
    assert gpu.measured_unavailable(ctx) is None
    ctx.rates[("coordl-device", 8)] = 3408.0
    spec, how = gpu.measured_spec(ctx, 8)
    assert spec == "torchvision:15789+nvimgcodec-cuda:9000+workers:426", spec
    assert "one worker 426 images/s" in how, how
    parsed = DDS.decoder_spec(spec)
    assert parsed == [("torchvision", 15789.0), ("nvimgcodec-cuda", 9000.0), ("workers", 426.0)]
    assert DDS.cpu_share(8, parsed) == pytest.approx(8 * 426 / (15789 + 9000 + 8 * 426))
    # a CUDA decoder that left files undecoded is not weighed in
    fig["rows"][gpu.CUDA_ROW]["pixels"]["undecoded"] = 64
    ctx.decoders = fig
    spec, how = gpu.measured_spec(ctx, 8)
    assert spec == "torchvision:15789+workers:426" and "not measured decoding every file" in how, (spec, how)
    with pytest.raises(RuntimeError, match="coordl-device was not measured at 15 workers"):
        gpu.measured_spec(ctx, 15)
    # torchvision's row with CUDA's own waits where the blocking one is missing (a step cut short)
    ctx.decoders = {"rows": {gpu.TV_ROWS[1]: {"pixels": {"undecoded": 0}, "1 threads": {"images_per_s": 14000.0}}}}
    assert gpu.measured_spec(ctx, 8)[0] == "torchvision:14000+workers:426"
    ctx.decoders = {"rows": {}}
    with pytest.raises(RuntimeError, match="the decoders step has no images/s"):
        gpu.measured_spec(ctx, 8)
    none = gpu.Ctx(root=str(tmp_path), device=torch.device("cpu"), decoders=gpu._read_decoders(str(tmp_path / "no")))
    assert "--decoders-json" in gpu.measured_unavailable(none)


def test_gpu_script_sums_device_time_by_stream_from_a_trace():
    """Part (b)'s profile: each stream's kernels, copies and fills per image,
    the busiest stream named, and the union of every stream's busy time
    (overlaps counted once); CPU events and events without a stream left out."""
    gpu, _ = _gpu_module()
    ev = [
        {"ph": "X", "cat": "kernel", "name": "conv", "ts": 0, "dur": 400, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "conv", "ts": 500, "dur": 300, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "bn", "ts": 900, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "crop_resize", "ts": 300, "dur": 300, "args": {"stream": 13}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 2000, "dur": 100, "args": {"stream": 13}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::conv2d", "ts": 0, "dur": 5000, "args": {}},
        {"ph": "X", "cat": "kernel", "name": "nostream", "ts": 0, "dur": 9000, "args": {}},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0, "args": {"stream": 7}},
    ]
    p = gpu.device_time_by_stream(ev, window_s=0.01, images=10)
    assert p["busiest"] == "7" and set(p["streams"]) == {"7", "13"}, p
    s7, s13 = p["streams"]["7"], p["streams"]["13"]
    assert s7["us_per_image"] == 80.0 and s7["ops"] == 3 and s7["top"][0] == ["conv", 70.0], s7
    assert s13["us_per_image"] == 40.0 and s13["share_of_window"] == 0.04, s13
    # busy: [0, 600) (conv and crop_resize overlap), [500, 800) joins it, [900, 1000), [2000, 2100) -> 1000 us
    assert p["any_stream_busy_share"] == 0.1, p
    assert gpu.device_time_by_stream([], 1.0, 5)["streams"] == {}


def test_gpu_script_skips_what_does_not_fit_its_budget_saying_so(monkeypatch):
    """--budget: a measurement that would end past the run's budget is not
    started; its row says why (the GPU check must end in time, not be cut)."""
    import argparse
    import time

    import torch

    gpu, _ = _gpu_module()
    assert not gpu.out_of_time(argparse.Namespace(deadline=None), 1e9)
    assert gpu.parse(["--budget", "100"]).deadline > time.monotonic() + 90
    assert gpu.parse([]).deadline is None
    args = gpu.parse(["--parts", "a", "--workers", "1,4", "--loaders", "torch,coordl-import", "--seconds", "2"])
    args.deadline = time.monotonic() + 11     # room for one window of 2 s and its start (8 s), not two
    ran = []

    def run_variant(ctx, v, w, *a, **kw):
        ran.append((v.name, w))
        time.sleep(1.5)
        return {"images_per_s": 1.0, "cpu_ms_per_image": 1.0, "window_s": 2.0}

    monkeypatch.setattr(gpu, "run_variant", run_variant)
    ctx = gpu.Ctx(root="/nonexistent", device=torch.device("cpu"), size=32)
    res = {"parts": {}}
    gpu.part_a(args, ctx, res, lambda: None)
    rows = res["parts"]["a"]["rows"]
    assert ran == [("torch", 1)], ran
    assert rows["coordl-import"]["1"] == rows["torch"]["4"] == {"skipped": gpu.OUT_OF_TIME}


def test_gpu_script_reads_the_targets_from_its_figures():
    """The run's summary of the decode="device" targets: the ratio to DALI
    at each worker count both ran, the worker counts at which a row gave
    8,000 images/s on at most 2 busy vCPUs, the ResNet-50 share with at
    most 4 workers, each met or not (None: not measured)."""
    gpu, _ = _gpu_module()
    res = {"parts": {
        "a": {"rows": {
            "dali": {"1": {"images_per_s": 1000.0}, "8": {"images_per_s": 10000.0},
                     "15": {"images_per_s": 12000.0}},
            "coordl-decode-split": {"1": {"images_per_s": 3000.0, "cores_busy": 1.0},
                                    "8": {"images_per_s": 12500.0, "cores_busy": 3.0},
                                    "15": {"images_per_s": 14000.0, "cores_busy": 4.0}},
            "coordl-decode-block": {"1": {"images_per_s": 8100.0, "cores_busy": 1.9},
                                    "8": {"images_per_s": 9000.0, "cores_busy": 2.1},
                                    "15": {"skipped": "not enough of the run's time left (--budget)"}},
            "coordl-device": {"1": {"images_per_s": 400.0, "cores_busy": 1.0}}}},
        "b": {"rows": {"coordl-decode-split": {"of_ceiling": 0.96, "workers": 4},
                       "coordl-decode-block": {"of_ceiling": 0.99, "workers": 15}}}}}
    t = gpu.targets(res)
    assert set(t) == {"coordl-decode-split", "coordl-decode-block"}
    split, block = t["coordl-decode-split"], t["coordl-decode-block"]
    assert split["vs_dali"] == {"1": 3.0, "8": 1.25, "15": round(14000 / 12000, 3)}
    assert split["met"] == {"vs_dali_at_8_and_15": False, "rate_on_few_cores": False, "of_ceiling": True}
    assert block["rate_on_few_cores"] == ["1"] and block["met"]["rate_on_few_cores"] is True
    assert block["met"]["vs_dali_at_8_and_15"] is None      # not measured at 15
    assert "of_ceiling" not in block and block["met"]["of_ceiling"] is None   # 15 workers: not the target's
    res["parts"]["a"]["rows"]["coordl-decode-hw"] = {"1": {"skipped": "needs CUDA"}}
    assert gpu.targets(res)["coordl-decode-hw"]["met"] == {"vs_dali_at_8_and_15": None, "rate_on_few_cores": None,
                                                          "of_ceiling": None}


def test_gpu_script_gives_set_device_an_index():
    """`torch.cuda.set_device` refuses torch.device("cuda") (no index), which
    gpu.py's main process and its part (c) jobs both passed it on a GPU."""
    import torch
    gpu, spec = _gpu_module()
    assert gpu.cuda_index(torch.device("cuda")) == 0
    assert gpu.cuda_index(torch.device("cuda", 1)) == 1
    with open(spec.origin) as f:
        src = f.read()
    assert "set_device(device)" not in src and "set_device(ctx.device)" not in src


def test_gpu_script_reads_where_a_device_decode_pass_spends_its_time(tmp_path, monkeypatch):
    """gpu.py's decode="device" figures: the decoder's and the geometry's
    seconds from the loader's stats (the CPU stand-in here), none for a
    loader that does not decode on the device."""
    import coordl
    from coordl import transforms as T
    from coordl.device import delivery as D
    from coordl.synth import make_image_folder
    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)
    gpu, _ = _gpu_module()
    root = str(tmp_path / "photos")
    make_image_folder(root, num_images=12, num_classes=2, mean_kb=4, image_size=(64, 48), seed=1)
    ds = coordl.ImageFolder(root, T.Compose([T.RandomResizedCrop(16), T.ToTensor()]))
    dec = coordl.DataLoader(ds, batch_size=4, device="cpu", decode="device")
    list(dec)
    d, g = gpu._decode_seconds(dec.stats)
    assert d > 0 and g > 0
    plain = coordl.DataLoader(ds, batch_size=4, device="cpu")
    list(plain)
    assert gpu._decode_seconds(plain.stats) == (None, None) == gpu._decode_seconds(None)


def test_gpu_script_keeps_part_b_its_time_and_drops_whole_rows_last_first():
    """With --budget, part (a) ends where part (b) still has its time, and
    what (a) leaves out is whole rows from the end of the list (the least
    telling), never the largest worker counts of the rows before them,
    which the targets read (vs DALI at 8 and 15)."""
    import time
    import types

    gpu, _ = _gpu_module()
    rows = [v for v in gpu.VARIANTS if v.default and v.in_a]
    args = types.SimpleNamespace(parts=["a", "b"], train_seconds=4, seconds=1.5, workers=[1, 4, 8, 15],
                                 loaders=None)
    now = time.monotonic()
    args.deadline = now + 10_000
    end, skip = gpu.plan_a(args, rows, now)
    assert skip == set() and end == pytest.approx(args.deadline - gpu._cost_b(args))
    full = sum(gpu._cost_a(1.5, w) for v in rows for w in args.workers
               if gpu._in_range(v, w))
    args.deadline = now + gpu._cost_b(args) + full * 0.7
    end, skip = gpu.plan_a(args, rows, now)
    names = [v.name for v in rows]
    dropped = {n for n, _ in skip}
    assert skip and "dali" not in dropped and "coordl-decode-device" not in dropped
    first = min(names.index(n) for n in dropped)
    assert all(names.index(n) >= first for n in dropped)
    for v in rows[first + 1:]:       # every row after the first one cut is dropped whole
        assert all((v.name, w) in skip for w in args.workers if gpu._in_range(v, w))
    args.deadline = None
    assert gpu.plan_a(args, rows, now) == (None, set())


def test_gpu_script_runs_a_row_at_another_copy_stream_priority_and_puts_it_back(tmp_path):
    """coordl-decode-level: the loader's copy stream is made at the row's
    priority (the class attribute its first pass reads), and coordl's own
    is back once the row's source is closed."""
    import torch

    from coordl.device import delivery

    gpu, _ = _gpu_module()
    from coordl.synth import make_image_folder

    root = make_image_folder(str(tmp_path / "p"), num_images=8, num_classes=2, mean_kb=3, image_size=(40, 30), seed=1)
    ctx = gpu.Ctx(root=root, device=torch.device("cpu"), size=16)
    before = delivery.CudaStreams.PRIORITY
    row = next(v for v in gpu.VARIANTS if v.name == "coordl-decode-level")
    assert not row.in_a and row.in_b
    src = row.make(ctx, 0, 4)
    try:
        assert delivery.CudaStreams.PRIORITY == 0 != before
        assert sum(len(y) for _, y in src.epoch()) == 8
    finally:
        src.close()
    assert delivery.CudaStreams.PRIORITY == before
    # the device whose host waits a row set stays known through another row's wrapper (its figures say
    # which waits it ran with), and closing the outer wrapper undoes both, inner first
    undone = []
    inner = gpu._Restoring(gpu.Source(None), lambda: undone.append("waits"), 3)
    outer = gpu._Restoring(inner, lambda: undone.append("priority"))
    assert outer.ordinal == 3 and gpu._Restoring(gpu.Source(None), lambda: None).ordinal is None
    outer.close()
    assert undone == ["waits", "priority"]
