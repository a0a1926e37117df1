"""The benchmark scripts at tiny sizes, so they cannot rot (no timing asserted)."""
import csv
import json
import os
import re

import pytest

from coordl.testing import run_in_child

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _script(name, *args, timeout=240):
    code = (f"import sys; sys.argv = [{name!r}] + {list(args)!r}; sys.path.insert(0, {BENCH!r}); "
            f"import runpy; runpy.run_path({os.path.join(BENCH, name)!r}, run_name='__main__')")
    r = run_in_child(code, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_overhead_quick():
    out = _script("overhead.py", "--quick")
    rows = [l.split() for l in out.splitlines() if l.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "2"]
    assert all(float(r[3]) > 0 for r in rows)


def test_recipes_quick(tmp_path):
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed (pip install coordl[test])")
    _script("recipes.py", "--quick", "--recipes", "train_v1,train_v2_ra,eval_v2", "--out", str(tmp_path))
    res = json.loads((tmp_path / "recipes.json").read_text())
    assert set(res["summary"]) == {"train_v1", "train_v2_ra", "eval_v2"}
    for name, s in res["summary"].items():
        assert s["every_sample_once"] and s["same_labels_as_torch"], (name, s)
        assert s["coordl_over_torch"] > 0 and s["path"].startswith("coordl: "), (name, s)
    assert "read through PresetTrain.transforms" in res["summary"]["train_v1"]["path"]


def test_throughput_quick(tmp_path):
    out = _script("throughput.py", "--quick", "--loaders", "torch,coordl", "--out", str(tmp_path))
    with open(tmp_path / "throughput.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["loader"] for r in rows] == ["torch", "coordl"]
    assert all(float(r["images_per_s"]) > 0 and float(r["efficiency"]) > 0 for r in rows)
    assert "vs torch" in out


def test_device_decode_fidelity_quick(tmp_path):
    out = _script("device_decode_fidelity.py", "--quick", "--out", str(tmp_path / "fid.md"))
    text = (tmp_path / "fid.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[2:]]
    assert len(rows) == 2 * 2 * 4 and "| stand-in fancy |" in out
    for size, pipe, name, mx, mean, over in rows:
        assert int(mx) >= 0 and float(mean) >= 0
        if name == "stand-in fancy":    # same decoded pixels: the resize's arithmetic alone
            assert int(mx) <= 1, (size, pipe)


def test_latency_inner_against_local_http_server(tmp_path):
    pytest.importorskip("aiohttp")
    from coordl.synth import make_image_folder

    root = tmp_path / "www" / "photos"
    make_image_folder(str(root), num_images=24, num_classes=2, image_size=(64, 48), seed=0)
    code = f"""
import functools, http.server, threading, subprocess, sys
class Q(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a): pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Q, directory={str(tmp_path / 'www')!r}))
threading.Thread(target=srv.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{{srv.server_address[1]}}/photos/"
r = subprocess.run([sys.executable, {os.path.join(BENCH, 'latency.py')!r}, "--inner", "--url", url,
                    "--root", {str(root)!r}, "--epochs", "1", "--batch-size", "8", "--loaders", "torch,coordl",
                    "--out", {str(tmp_path)!r}], capture_output=True, text=True, timeout=200)
print(r.stdout); print(r.stderr, file=sys.stderr)
srv.shutdown()
sys.exit(r.returncode)
"""
    r = run_in_child(code, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp_path / "latency.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["loader"] for r in rows] == ["torch", "coordl"]
    assert all(float(r["http_images_per_s"]) > 0 for r in rows)


def _cgroup_v1_writable():
    probe = "/sys/fs/cgroup/memory/coordl-probe-%d" % os.getpid()
    try:
        os.mkdir(probe)
        os.rmdir(probe)
        return os.access("/proc/sys/vm/drop_caches", os.W_OK) and os.path.isdir("/sys/fs/cgroup/blkio")
    except OSError:
        return False


@pytest.mark.skipif(not _cgroup_v1_writable(), reason="needs root and cgroup v1 (memory, blkio)")
def test_cache_benchmark_tiny(tmp_path):
    from coordl.synth import make_image_folder

    root = tmp_path / "photos"
    make_image_folder(str(root), num_images=40, num_classes=2, image_size=(96, 72), seed=0)
    out = _script("cache.py", "--root", str(root), "--cap", "700MiB", "--read-mbps", "200", "--epochs", "2",
                  "--batch-size", "8", "--loaders", "torch,coordl", "--cache-size", "100000", timeout=300)
    assert "coordl  epochs 2+" in out and "torch   epochs 2+" in out
    assert "1 cache segment(s)" in out
    assert not [d for d in os.listdir("/sys/fs/cgroup/memory") if d.startswith("coordl-bench-")]


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
    # three "nodes" as processes on loopback (--quick: no namespaces, cgroups or root);
    # the namespace + cgroup set-up runs in the benchmark itself (docs/benchmarks.md)
    out = _script("peers.py", "--quick", "--out", str(tmp_path), timeout=300)
    with open(tmp_path / "peers.csv") as f:
        rows = list(csv.DictReader(f))
    with open(tmp_path / "peers_summary.csv") as f:
        summary = {r["config"]: r for r in csv.DictReader(f)}
    assert list(summary) == ["peers", "off", "local"], out
    for name in summary:
        mine = [r for r in rows if r["config"] == name]
        assert sorted((int(r["node"]), int(r["epoch"])) for r in mine) == [(n, e) for n in range(3) for e in range(3)]
        # every epoch delivered the 60 images once across the three nodes
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


@pytest.mark.skipif(not _cgroup_v1_writable(), reason="needs root and cgroup v1 (memory, blkio)")
def test_validation_benchmark_tiny(tmp_path):
    """benchmarks/analyze_validate.py at tiny size, so it cannot rot (no timing asserted): both kinds of step,
    page cache dropped (a node cache under a memory cap) and warm, the analyzer's predictions (value and
    interval) against the benchmark's own training loops, every cgroup it made removed."""
    from coordl.synth import make_image_folder

    root = make_image_folder(tmp_path / "photos", num_images=32, num_classes=2, image_size=(64, 48), seed=0)
    bench = os.path.join(BENCH, "analyze_validate.py")
    out_json = tmp_path / "v.json"
    code = (f"import sys; sys.argv = ['analyze_validate.py', '--root', {root!r}, '--read-mbps', '200', "
            f"'--fractions', '0.5', '--workers', '1', '--runs', '1', '--epochs', '2', '--batch-size', '8', "
            f"'--overhead', '700MiB', '--analyze-repeats', '1', '--analyze-workers', '1', '--scaling-workers', '1', "
            f"'--out', {str(out_json)!r}]; import runpy; runpy.run_path({bench!r}, run_name='__main__')")
    r = run_in_child(code, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "within 15%:" in r.stdout and "inside the reported interval" in r.stdout, r.stdout
    res = json.loads(out_json.read_text())
    rows = res["results"]
    assert [(x["step"], x["page_cache"], x["cached_fraction"], x["workers"]) for x in rows] == [
        ("sleep", "dropped", 0.5, 1), ("sleep", "warm", 1.0, 1), ("cpu", "dropped", 0.5, 1), ("cpu", "warm", 1.0, 1)]
    for x in rows:
        assert x["measured"] > 0 and x["lo"] <= x["predicted"] <= x["hi"], x
        assert x["error"] == pytest.approx(x["predicted"] / x["measured"] - 1)
        assert x["in_interval"] == (x["lo"] <= x["measured"] <= x["hi"])
    assert set(res["analyzers"]) == {"sleep", "cpu"}
    assert res["analyzers"]["sleep"]["report"]["settings"]["step_kind"] == "accelerator"
    for c in ("memory", "blkio"):
        assert not [d for d in os.listdir(f"/sys/fs/cgroup/{c}") if d.startswith("coordl-anval-")]


def test_torchvision_loop_quick(tmp_path):
    import sys as _sys
    _sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    out = _script("torchvision_loop.py", "--quick", "--out", str(tmp_path))
    rep = json.loads((tmp_path / "torchvision_loop.json").read_text())
    assert set(rep["summary"]) == {"v1", "v2"}
    for s in rep["summary"].values():
        assert s["every_sample_once"] and s["pixel_statistics_match"] and s["coordl_over_torch"] > 0
    assert [(r["pipeline"], r["loader"]) for r in rep["rows"]] == [("v1", "torch"), ("v1", "coordl"),
                                                                  ("v2", "torch"), ("v2", "coordl")]
    assert "fused RandomResizedCrop, RandomHorizontalFlip, ToTensor, Normalize" in out


def test_torchvision_loop_quick_more_sides(tmp_path):
    """``--draft`` and ``--old`` (here: this very tree, in a child process) add sides."""
    import sys as _sys
    _sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    tree = os.path.dirname(BENCH)
    out = _script("torchvision_loop.py", "--quick", "--pipelines", "v1-eval", "--draft", "--old", tree,
                  "--out", str(tmp_path), timeout=600)
    rep = json.loads((tmp_path / "torchvision_loop.json").read_text())
    assert sorted(r["loader"] for r in rep["rows"]) == ["coordl", "coordl-draft", "coordl-old", "torch"]
    s = rep["summary"]["v1-eval"]
    assert s["every_sample_once"] and s["coordl_over_coordl_old"] > 0 and s["coordl_over_coordl_draft"] > 0
    assert "reduced-scale JPEG decode before Resize" in out


def test_pixels_quick(tmp_path):
    import sys as _sys
    _sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    _script("pixels.py", "--quick", "--old", os.path.dirname(BENCH), "--out", str(tmp_path), timeout=600)
    rep = json.loads((tmp_path / "pixels.json").read_text())
    tol = rep["tolerance"]
    assert tol["PIL image: Resize bicubic"]["max_levels"] == 0
    assert all(v.get("max_levels", 0) <= 1 for v in tol.values())
    assert all(v["at_reduced_scale"] >= 1 for v in rep["draft"].values())
    for per_pipeline in rep["prep_ms"].values():
        assert all(v["default"] > 0 and v["jpeg_draft"] > 0 and v["old"] > 0 for v in per_pipeline.values())


def test_torchvision_loop_check_from_sums_is_torchs_std():
    """The loop's pixel check computes each image's std from sums (cheap in
    the main process): the same statistic as torch's ``std((2, 3))``."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("tvloop", os.path.join(BENCH, "torchvision_loop.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(6, 3, 40, 50, generator=g) - 0.45) / 0.22
    (m1, s1), (m2, s2) = mod.image_stats(x, "sums"), mod.image_stats(x, "std")
    assert m1.shape == s1.shape == (6, 3) and m1.dtype == s1.dtype == torch.float64
    assert torch.allclose(m1, m2, atol=1e-6) and torch.allclose(s1, s2, atol=1e-5)
    assert not torch.allclose(s1, x.flatten(2).std(2).double() * 1.01, atol=1e-5)  # could fail


def test_small_server_tiny():
    """benchmarks/small_server.py: local files vs ``python -m http.server``."""
    pytest.importorskip("aiohttp")
    out = _script("small_server.py", "--images", "24", "--workers", "0", "--epochs", "1", "--batch-size", "8",
                  "--size", "32", "--paths", "native,fsspec")
    rows = [l.split() for l in out.splitlines() if l.startswith(("local ", "http "))]
    assert rows[0][:2] == ["local", "default"], out
    assert [r[1:3] for r in rows[1:]] == [["native", "default"], ["native", "fetch_threads=8"],
                                          ["fsspec", "default"], ["fsspec", "fetch_threads=8"]], out
    assert all(r[-1] == "0/1" for r in rows), out        # every configuration ran, none failed
    assert all(float(r[-5]) > 0 for r in rows), out     # images/s
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
    names = ["torch", "coordl-import", "coordl-device", "coordl-decode-device", "dali"]
    cuda = "cuda" in res["machine"]["device"]
    assert list(a["rows"]) == names, a
    for name, by_workers in a["rows"].items():
        assert list(by_workers) == [str(w) for w in a["workers"]], by_workers
        for r in by_workers.values():
            if name == "dali" and not dali["ran"]:
                assert r == {"skipped": dali["skipped"]}
                continue
            if name == "coordl-decode-device" and not cuda:
                assert "CUDA" in r["skipped"], r
                continue
            assert "error" not in r and r["images_per_s"] > 0 and r["images"] > 0 and r["cpu_ms_per_image"] > 0, r
    b = res["parts"]["b"]
    assert b["ceiling"]["images_per_s"] > 0, b
    assert list(b["rows"]) == names, b
    assert b["rows"]["coordl-decode-device"]["workers"] <= 4
    for name, r in b["rows"].items():
        if (name == "dali" and not dali["ran"]) or (name == "coordl-decode-device" and not cuda):
            continue
        assert "error" not in r and r["images_per_s"] > 0
        assert r["of_ceiling"] == pytest.approx(r["images_per_s"] / b["ceiling"]["images_per_s"], abs=1e-3)
    c = res["parts"]["c"]
    assert list(c["rows"]) == ["coordl share=True"], c   # --smoke runs the shared row alone
    for label, r in c["rows"].items():
        assert "error" not in r, r
        assert r["alone"] > 0 and len(r["per_job"]) == c["jobs"] and min(r["per_job"]) > 0, r
    # jobs started together on the same folder did share prep through the node daemon
    assert sum(c["rows"]["coordl share=True"]["shared_samples"]) > 0, c
    for title in ("(a) images/s on", "(b) ", "(c) "):
        assert title in text, text
    assert os.listdir(work) == [], "the run's temporary folder was left behind"
