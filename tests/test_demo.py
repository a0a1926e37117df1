"""The README's main job, ``coordl demo``, end to end at a small size."""
import os
import re
import subprocess
import sys


def test_demo_runs_and_its_resume_check_passes(tmp_path):
    r = subprocess.run([sys.executable, "-m", "coordl", "demo", "--images", "48", "--epochs", "1",
                        "--workers", "1", "--batch-size", "8"],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    gen = re.search(r"generated 48 photo-like JPEGs in (\S+) ", out)
    assert gen, out
    assert not os.path.exists(gen.group(1))       # the temporary dataset is removed afterwards
    assert re.search(r"torch\.utils\.data\.DataLoader\s+48\s", out), out
    assert re.search(r"coordl\.DataLoader\s+48\s", out), out
    assert "coordl / torch throughput:" in out
    assert "raw bytes" in out and "from the node cache" in out
    assert "identical to an uninterrupted epoch" in out and "MISMATCH" not in out


def test_demo_exits_nonzero_when_its_resume_check_fails(monkeypatch, capsys):
    from coordl import cli, demo

    monkeypatch.setattr(demo, "run_demo", lambda **kw: {"resume_exact": False})
    assert cli.main(["demo", "--images", "8"]) == 1


def test_demo_refuses_a_root_it_did_not_make(tmp_path, capsys):
    """``coordl demo --root <existing folder> --images 100`` used to run on
    whatever the folder held, silently.  A folder the demo did
    not make is refused, untouched, with what to do instead."""
    from coordl import cli
    from coordl.synth import make_image_folder

    root = str(tmp_path / "mine")
    make_image_folder(root, num_images=6, num_classes=2, image_size=(64, 48), seed=1)
    before = sorted(os.walk(root))
    assert cli.main(["demo", "--root", root, "--images", "100", "--workers", "0", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--root {root} is not empty and was not made by coordl demo" in err, err
    assert "new directory" in err and "leave --root out" in err
    assert sorted(os.walk(root)) == before


def test_demo_reuses_a_root_it_made_and_says_so(tmp_path, capsys):
    from coordl.demo import MARKER, DemoRootError, _prepare_root

    root = str(tmp_path / "demo")
    _prepare_root(root, 8)
    assert "generated 8 photo-like JPEGs in " + root in capsys.readouterr().out
    assert os.path.isfile(os.path.join(root, MARKER))
    for images in (None, 8):
        _prepare_root(root, images)
        assert f"reusing the 8 photo-like JPEGs coordl demo generated earlier in {root}" in capsys.readouterr().out
    try:
        _prepare_root(root, 20)
    except DemoRootError as e:
        assert "holds the 8 images" in str(e) and "--images 8" in str(e) and "another --root" in str(e)
    else:
        raise AssertionError("a demo folder of 8 images was taken for --images 20")
    empty = tmp_path / "empty"
    empty.mkdir()
    _prepare_root(str(empty), 4)  # an empty directory is filled
    assert "generated 4 photo-like JPEGs" in capsys.readouterr().out


def _recording(monkeypatch):
    """Record the arguments of every loader the demo builds, per class."""
    import torch

    import coordl

    calls = {"torch": [], "coordl": []}

    class TorchRec(torch.utils.data.DataLoader):
        def __init__(self, *a, **kw):
            calls["torch"].append((a, kw))
            super().__init__(*a, **kw)

    class CoordlRec(coordl.DataLoader):
        def __init__(self, *a, **kw):
            calls["coordl"].append((a, kw))
            super().__init__(*a, **kw)

    monkeypatch.setattr(torch.utils.data, "DataLoader", TorchRec)
    monkeypatch.setattr(coordl, "DataLoader", CoordlRec)
    return calls


def test_the_timed_loaders_differ_only_in_the_import_when_the_demo_says_so(monkeypatch, capsys):
    import pytest

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _torchvision import import_torchvision

    from coordl import demo

    if import_torchvision() is None or demo._torchvision() is None:
        pytest.skip("torchvision is not installed (pip install coordl[test])")
    calls = _recording(monkeypatch)
    demo.run_demo(images=12, epochs=1, workers=0, batch_size=4)
    out = capsys.readouterr().out
    (ta, tk), (ca, ck) = calls["torch"][0], calls["coordl"][0]   # the timed runs
    assert "only the DataLoader import differs" in out, out
    assert ta[0] is ca[0] and ta[1:] == ca[1:] and tk == ck, (calls["torch"][0], calls["coordl"][0])
    assert "from the node cache" in out


def test_without_torchvision_the_demo_does_not_claim_only_the_import_differs(monkeypatch, capsys):
    from coordl import demo

    monkeypatch.setattr(demo, "_torchvision", lambda: None)
    calls = _recording(monkeypatch)
    demo.run_demo(images=12, epochs=1, workers=0, batch_size=4)
    out = capsys.readouterr().out
    assert "hand-written" in out and "only the DataLoader import differs" not in out, out
    (_, tk), (_, ck) = calls["torch"][0], calls["coordl"][0]
    assert tk == ck
