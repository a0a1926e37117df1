"""The benchmark scripts at tiny sizes, so they cannot rot (no timing asserted).

Those of sharing across jobs and nodes (sharing.py, peers.py, gpu.py) are in
test_benchmarks_sharing.py: a module runs on one worker under ``--dist
loadfile``, and the two halves take minutes each."""
import csv
import json
import os
import sys

import pytest

from coordl.testing import run_in_child

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_helpers import BENCH, _script  # noqa: E402


def test_overhead_quick():
    out = _script("overhead.py", "--quick")
    rows = [l.split() for l in out.splitlines() if l.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "2"]
    assert all(float(r[3]) > 0 for r in rows)


def test_recipes_quick(tmp_path):
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed (pip install coordl[test])")
    _script("recipes.py", "--quick", "--recipes",
            "train_v1,train_v2_ra,eval_v2,eval_weights,clip_eval,train_v2_tensor_ta,cifar_v1,timm_ds_eval,train_v2_mixup",
            "--out", str(tmp_path))
    res = json.loads((tmp_path / "recipes.json").read_text())
    assert set(res["summary"]) == {"train_v1", "train_v2_ra", "eval_v2", "eval_weights", "clip_eval", "train_v2_tensor_ta",
                                   "cifar_v1", "timm_ds_eval", "train_v2_mixup"}
    for name, s in res["summary"].items():
        # cifar_v1 shuffles (shuffle=True): each side with its own generator; mixup's draws are each side's
        # own too (its soft labels' column sums are each class's count: every sample once)
        assert s["every_sample_once"] and (s["same_labels_as_torch"] or name in ("cifar_v1", "train_v2_mixup")), \
            (name, s)
        assert s["coordl_over_torch"] > 0 and s["path"].startswith("coordl: "), (name, s)
    assert "read through PresetTrain.transforms" in res["summary"]["train_v1"]["path"]
    assert "fused PILToTensor, RandomResizedCrop" in res["summary"]["train_v2_tensor_ta"]["path"]
    assert "read through ImageClassification as" in res["summary"]["eval_weights"]["path"]
    assert "fused Resize, CenterCrop, _convert_image_to_rgb, ToTensor" in res["summary"]["clip_eval"]["path"]
    assert "fused RandomCrop, RandomHorizontalFlip, ToTensor, Normalize" in res["summary"]["cifar_v1"]["path"]
    assert res["summary"]["timm_ds_eval"]["path"].startswith("coordl: timm's ImageDataset read as raw file bytes")


def test_recipes_quick_under_accelerate(tmp_path):
    import importlib.util

    if importlib.util.find_spec("torchvision") is None or importlib.util.find_spec("accelerate") is None:
        pytest.skip("torchvision or accelerate is not installed (pip install coordl[test])")
    _script("recipes.py", "--quick", "--recipes", "train_v2,eval_v1", "--accelerate", "--out", str(tmp_path))
    res = json.loads((tmp_path / "recipes.json").read_text())
    assert res["settings"]["accelerate"] == "coordl"
    for name, s in res["summary"].items():
        assert s["every_sample_once"] and s["same_labels_as_torch"], (name, s)
        assert s["path"].startswith("coordl: "), (name, s)      # coordl's pipeline inside Accelerate's wrapper


def test_throughput_quick(tmp_path):
    out = _script("throughput.py", "--quick", "--loaders", "torch,coordl", "--out", str(tmp_path))
    with open(tmp_path / "throughput.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["loader"] for r in rows] == ["torch", "coordl"]
    assert all(float(r["images_per_s"]) > 0 and float(r["efficiency"]) > 0 for r in rows)
    assert "vs torch" in out


def test_worker_scaling_tiny(tmp_path):
    """worker_scaling.py: both modes run and report; ``fixed`` starts every
    fetch thread, on demand never more."""
    from coordl import synth

    root = tmp_path / "photos"
    assert synth.main([str(root), "--images", "160", "--classes", "2", "--size", "96x72"]) == 0
    out = _script("worker_scaling.py", "--root", str(root), "--workers", "1", "--rounds", "1", "--epochs", "1",
                  "--fetch-threads", "3", "--batch-size", "8", "--out", str(tmp_path / "ws.json"))
    runs = json.loads((tmp_path / "ws.json").read_text())["runs"]
    assert set(runs) == {"adaptive 1", "fixed 1"}, out
    (a,), (f,) = runs["adaptive 1"], runs["fixed 1"]
    assert f["fetch_threads"] == 3 and 1 <= a["fetch_threads"] <= 3, out
    assert a["images_per_s"] > 0 and f["total_ms"] > 0 and f["workers_ms"] > 0, out


def test_device_decode_fidelity_quick(tmp_path):
    out = _script("device_decode_fidelity.py", "--quick", "--out", str(tmp_path / "fid.md"))
    text = (tmp_path / "fid.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[2:]]
    assert len(rows) == 2 * 2 * 4 and "| stand-in fancy |" in out
    for size, pipe, name, mx, mean, over in rows:
        assert int(mx) >= 0 and float(mean) >= 0
        if name == "stand-in fancy":    # same decoded pixels: the resize's arithmetic alone
            assert int(mx) <= 1, (size, pipe)


def test_device_stage_quick(tmp_path):
    """device_stage.py: the stage's per-image figures on the CPU stand-in,
    from the batches a real pass gave it (no timing asserted)."""
    import json
    out = _script("device_stage.py", "--quick", "--json", str(tmp_path / "stage.json"))
    res = json.loads((tmp_path / "stage.json").read_text())
    assert res["facts"]["device"] == "cpu" and list(res["rows"]) == ["16"], out
    r = res["rows"]["16"]
    assert r["images"] > 0 and r["finish_us"] > 0 and r["decode_bookkeeping_us"] > 0 and r["decoder_us"] > 0, r
    assert r["finish_no_launch_us"] > 0 and "the batch kernel's launch a no-op" in out, r   # RandomResizedCrop: bilinear
    assert "finish" in out and "decode bookkeeping" in out
    assert set(r["erasing"]) == {"a copy per rectangle", "the mask"} and "RandomErasing(0.5)" in out, r
    assert all(e["host_us"] > 0 and e["rectangles"] > 0 for e in r["erasing"].values()), r
    if r["policy"] is not None:          # torchvision at hand: TrivialAugmentWide's operations, all PIL's here
        assert r["policy"]["host_us"] > 0 and all(r["policy"]["exact"].values()), r
        assert "TrivialAugmentWide() after the geometry" in out
        assert r["augmix"]["host_us"] > 0 and all(r["augmix"]["exact"].values()) and "AugMix() after" in out, r
        assert r["augmix"]["vs_cpu"] == {"max": 0, "share": 0.0}, r      # the CPU's own functions here
        t = r["policy_tensor"]
        assert t["host_us"] > 0 and t["vs_cpu"] == {"max": 0, "share": 0.0}, r
        assert "TrivialAugmentWide() given a tensor after the geometry" in out


def test_device_policy_fidelity_quick():
    """device_policy_fidelity.py: each policy both ways against the CPU
    path on the stand-in, and TrivialAugmentWide by operation; the
    geometric operations within the geometry's level."""
    out = _script("device_policy_fidelity.py", "--quick")
    if "nothing to measure" in out:
        return
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| `") and "by operation" not in line]
    policies = ("TrivialAugmentWide", "RandAugment", "AutoAugment", "AugMix")
    assert [r[0] for r in rows] == [f"`{p}` {v}" for p in policies for v in ("v1", "v2")] + [
        f"`{p}` {v}, given a tensor" for p in policies for v in ("v1", "v2")], out
    assert all(int(r[1]) == 8 and float(r[3]) >= 0 for r in rows), out
    for line in out.splitlines():
        if line.startswith(("| shear", "| quarter", "| Identity")):
            assert line.rstrip(" |").endswith("| 1") or line.rstrip(" |").endswith("| 0"), line


def test_decode_thread_quick():
    """decode_thread.py: the decode thread's CPU taking each batch in is
    measured over a real pass (no timing asserted)."""
    out = _script("decode_thread.py", "--quick")
    assert "decode thread, taking the next batch in:" in out and " batches, 2 workers" in out, out


def test_device_decoders_quick(tmp_path):
    """device_decoders.py on the CPU: the reference decoders run and agree
    with themselves, the GPU variants say why they were skipped."""
    import json
    out = _script("device_decoders.py", "--quick", "--json", str(tmp_path / "d.json"))
    res = json.loads((tmp_path / "d.json").read_text())
    rows = res["rows"]
    pil, sj = rows["PIL (CPU path's decode)"], rows["simplejpeg, plain upsampling (CPU stand-in)"]
    assert pil["pixels"]["libjpeg fancy (PIL)"]["max"] == 0 and sj["pixels"]["libjpeg plain"]["max"] == 0, out
    # the two upsamplings differ on these 4:2:0 files: the comparison can tell them apart
    assert pil["pixels"]["libjpeg plain"]["max"] > 0 and pil["pixels"]["undecoded"] == 0
    for r in (pil, sj):
        assert all(r[f"{t} threads"]["images_per_s"] > 0 and r[f"{t} threads"]["cpu_ms_per_image"] > 0
                   for t in (1, 2)), r
    tv = rows["torchvision.io.decode_jpeg batched (nvJPEG)"]
    assert "CUDA" in tv["skipped"], tv
    assert all("skipped" in r or "pixels" in r for r in rows.values()), rows


def test_device_decoders_count_only_decoded_images_and_compare_chw_images():
    """A variant that returns None for some images is credited only with
    those it decoded, and a decoder whose images are (3, H, W) (torchvision's)
    has its pixels compared, not skipped as another shape."""
    import importlib.util
    import io

    import numpy as np
    import torch
    from PIL import Image

    spec = importlib.util.spec_from_file_location("devdec", os.path.join(BENCH, "device_decoders.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    blobs = []
    for k in range(4):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(k).integers(0, 255, (24, 32, 3), dtype=np.uint8)).save(buf, "JPEG")
        blobs.append(buf.getvalue())
    refs = {"pil": [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in blobs]}

    class Chw(mod._PIL):
        chw = True

        def decode(self, blobs):
            return [torch.from_numpy(a.copy()).permute(2, 0, 1) for a in super().decode(blobs)]

    class Half(mod._PIL):
        def decode(self, blobs):
            return [a if k % 2 == 0 else None for k, a in enumerate(super().decode(blobs))]

    cpu = torch.device("cpu")
    px = mod.fidelity(Chw, cpu, blobs, refs)
    assert px["pil"] == {"max": 0, "mean": 0.0, "other_shape": 0, "compared": 4}, px
    half = mod.fidelity(Half, cpu, blobs, refs)
    assert half["undecoded"] == 2 and half["pil"]["compared"] == 2, half
    r = mod.throughput(Half, cpu, blobs, batch=4, seconds=0.05, threads=1)
    assert r["images"] > 0 and r["undecoded"] == r["images"], r     # two of every four
    none = mod.throughput(type("Nothing", (mod._PIL,), {"decode": lambda self, b: [None] * len(b)}),
                          cpu, blobs, batch=4, seconds=0.05, threads=1)
    assert "no image decoded" in none["error"], none


def test_device_workers_quick(tmp_path):
    """device_workers.py: the workers' CPU per image in decode="device" from
    files, the node cache and memory, with the batch path and the per-sample
    path; each setting read from where it says, by the path it names (no
    timing asserted)."""
    import json
    out = _script("device_workers.py", "--quick", "--json", str(tmp_path / "w.json"))
    rows = json.loads((tmp_path / "w.json").read_text())["rows"]
    assert list(rows) == ["files", "files, per sample", "node cache", "node cache, per sample", "in memory",
                          "workers' share", "the CPU path", "data checked", "ColorJitter",
                          "ColorJitter on the CPU path", "RandomErasing", "RandomErasing on the CPU path",
                          "ColorJitter to the device", "RandomErasing to the device", "RandomErasing noise",
                          "RandomErasing noise on the CPU path", "TrivialAugmentWide",
                          "TrivialAugmentWide on the CPU path", "TrivialAugmentWide to the device", "GaussianBlur",
                          "GaussianBlur on the CPU path", "AugMix", "AugMix on the CPU path",
                          "TrivialAugmentWide given a tensor", "TrivialAugmentWide given a tensor on the CPU path",
                          "TrivialAugmentWide given a tensor to the device"], out
    for name, r in rows.items():
        [run] = r["runs"]
        # the workers' CPU comes in clock ticks (10 ms): a smoke run's few images may show none
        assert run["images"] >= 32 and run["us_per_image"] >= 0, (name, run)
        on_batch_path = ("files", "node cache", "workers' share", "data checked", "ColorJitter", "RandomErasing",
                         "TrivialAugmentWide", "GaussianBlur", "AugMix", "TrivialAugmentWide given a tensor")
        assert run["batch_reads"] == (name in on_batch_path), (name, run)
        assert run["device_split"].startswith("split") == name.endswith("to the device"), (name, run)
        # the share's samples are prepared on the CPU path (the batch path hands them to the per-sample one)
        assert (run["on_cpu"] > 0) == (name == "workers' share"), (name, run)
        if name.startswith("node cache"):
            assert run["from_cache"] > 0 and run["from_storage"] == 0, (name, run)
        else:
            assert run["from_cache"] == 0, (name, run)


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
    # one read path: each configuration is a process of its own (seconds of imports), and the other
    # path runs the same code with COORDL_NATIVE_STORE=0 (both paths against a server: test_remote.py)
    out = _script("small_server.py", "--images", "24", "--workers", "0", "--epochs", "1", "--batch-size", "8",
                  "--size", "32", "--paths", "native")
    rows = [l.split() for l in out.splitlines() if l.startswith(("local ", "http "))]
    assert rows[0][:2] == ["local", "default"], out
    assert [r[1:3] for r in rows[1:]] == [["native", "default"], ["native", "fetch_threads=8"]], out
    assert all(r[-1] == "0/1" for r in rows), out        # every configuration ran, none failed
    assert all(float(r[-5]) > 0 for r in rows), out     # images/s


def test_gpu_check_stages_dali_parts_across_calls(tmp_path):
    """The device tool replaces a carried folder at each call: `gpu_check.sh
    --stage`, run once per call with one DALI part, keeps every part (and the
    sums) in DALI_STAGE, where the check then finds them all."""
    import subprocess

    stage = tmp_path / "stage"
    for k in range(3):
        carried = tmp_path / f"call{k}"        # what one call carries: the sums and one part
        carried.mkdir()
        (carried / "SHA256SUMS").write_text("sums\n")
        (carried / f"dali-wheels.tar.part-{k:02d}").write_bytes(bytes([k]) * 10)
        r = subprocess.run(["bash", os.path.join(BENCH, "gpu_check.sh"), "--stage"], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "DALI_DIR": str(carried), "DALI_STAGE": str(stage)})
        assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(stage)) == ["SHA256SUMS"] + [f"dali-wheels.tar.part-{k:02d}" for k in range(3)]
    assert (stage / "dali-wheels.tar.part-01").read_bytes() == b"\x01" * 10
