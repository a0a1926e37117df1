"""RandomErasing with a constant value after the conversion: on the CPU path
it runs as written after coordl's conversion (which a ColorJitter before it
no longer turns into as-written steps); with decode="device" the workers draw
each sample's rectangles as the CPU path draws them (after the jitter's
draws, from the same generators) and the device erases them after the
conversion.  On the CPU stand-in (``cpu_device``); tests/test_cuda.py runs
the same on a GPU."""
import logging
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _erase_cases as erase_cases  # noqa: E402
from _batch_reads import check_batch_reads_and_resume  # noqa: E402
from _resume_check import whole_and_resumed  # noqa: E402
from _torchvision import import_torchvision  # noqa: E402

if import_torchvision() is None:
    pytest.skip("torchvision is not installed (pip install coordl[test])", allow_module_level=True)

from torchvision import datasets  # noqa: E402
from torchvision import transforms as V  # noqa: E402
from torchvision.transforms import v2 as V2  # noqa: E402

import coordl  # noqa: E402
import coordl.tvcompat as tc  # noqa: E402
from coordl import _rng  # noqa: E402
from coordl.device import encoded as E  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
STD255 = torch.tensor(STD).view(1, 3, 1, 1) * 255
# a value no normalized pixel has: the erased pixels are exactly those equal to it in every channel
ODD = (7.0, -9.0, 11.0)


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("erasing", num_images=20, num_classes=2, mean_kb=6, image_size=(96, 72), seed=6)


def _timm():
    pytest.importorskip("timm", reason="timm is not installed (pip install timm)")
    from timm.data.random_erasing import RandomErasing

    return RandomErasing


def _recipe(version: str, erase, jitter: bool = False, size: int = 20):
    M = V if version == "v1" else V2
    conv = [V.ToTensor()] if version == "v1" else [V2.ToImage(), V2.ToDtype(torch.float32, scale=True)]
    steps = [M.RandomResizedCrop(size, scale=(0.3, 1.0)), M.RandomHorizontalFlip()]
    steps += [M.ColorJitter(0.4, 0.4, 0.4, 0.1)] if jitter else []
    steps += [*conv, M.Normalize(MEAN, STD)] + ([erase] if erase is not None else [])
    steps += [V2.ToPureTensor()] if version == "v2" else []
    return M.Compose(steps)


def _erased(x: torch.Tensor, value) -> torch.Tensor:
    """(B, H, W) bool: the pixels equal to ``value`` in every channel."""
    v = torch.tensor(value, dtype=torch.float32).view(1, -1, 1, 1)
    return (x == v).all(dim=1)


# ---------------------------------------------------------------- the CPU path
@pytest.mark.parametrize("which", ["v1", "v2", "timm"])
def test_a_jitter_before_an_erasing_keeps_coordls_conversion_and_torchvisions_result(photos, which):
    """ColorJitter, then the conversion and Normalize, then RandomErasing:
    the conversion is coordl's (it was as written while a random step came
    after it), and every sample is what the steps give when all of them
    after the fused geometry run as written under the sample's generators
    (v2's ToDtype within the float ulp docs/guide/torchvision.md states:
    torchvision multiplies by 1/255 where coordl divides by 255)."""
    erase = (_timm()(0.7, max_count=3, device="cpu") if which == "timm" else
             (V if which == "v1" else V2).RandomErasing(0.7, value=ODD))
    tf = _recipe("v1" if which == "timm" else which, erase, jitter=True)
    ds = datasets.ImageFolder(photos, transform=tf)
    L = coordl.DataLoader(ds, batch_size=5, seed=2)
    pipe = L.dataset.transform
    assert pipe.erase is not None and pipe.erase.user is erase and pipe.post_fused is not None
    assert "RandomErasing drawing where the steps before it left the generators" in L.stats().path_reason
    # the same user steps, all as written after the fused geometry, under the same generators
    written = tc.TorchvisionPipeline(pipe.fused, True, None, [*pipe.tail, *pipe.post, erase, *pipe.after])
    got = torch.cat([x for x, _ in L])
    raws = L.dataset
    erased = 0
    for i in range(len(ds)):
        with _rng.sample_rng(2, 0, i):
            want = written.from_bytes(raws.raw(i))
        if which == "v2":
            assert torch.equal(_erased(got[i:i + 1], ODD), _erased(want[None], ODD))
            assert float((got[i] - want).abs().max()) <= 2e-6, i
        else:
            assert torch.equal(got[i], want), i
        erased += bool((got[i] == 0).all(0).any()) if which == "timm" else bool(_erased(got[i:i + 1], ODD).any())
    assert 0 < erased < len(ds)


def _noise_erasings():
    return {"v1": lambda: V.RandomErasing(0.7, value="random"), "v2": lambda: V2.RandomErasing(0.7, value="random"),
            "timm-pixel": lambda: _timm()(0.8, mode="pixel", max_count=3, device="cpu"),
            "timm-rand": lambda: _timm()(0.8, mode="rand", max_count=2, device="cpu")}


@pytest.mark.parametrize("which", ["v1", "v2", "timm-pixel", "timm-rand"])
def test_noise_erasing_kept_apart_gives_the_as_written_batches(photos, monkeypatch, which):
    """An erasing of noise (torchvision's value="random", timm's "pixel" and
    "rand") is kept apart too: the batches are those of the whole pipeline
    run as written (the translation told not to keep it apart), bit for bit."""
    tf = _recipe("v2" if which == "v2" else "v1", _noise_erasings()[which](), jitter=True)
    kw = dict(batch_size=5, seed=4, shuffle=True)
    L = coordl.DataLoader(datasets.ImageFolder(photos, transform=tf), **kw)
    assert L.dataset.transform.erase is not None and L.dataset.transform.erase.noise
    apart = list(L)
    real = tc.erasing_of
    monkeypatch.setattr(tc, "erasing_of", lambda t: None if (e := real(t)) is not None and e.noise else e)
    W = coordl.DataLoader(datasets.ImageFolder(photos, transform=tf), **kw)
    assert W.dataset.transform.erase is None
    written = list(W)
    assert len(apart) == len(written) == 4
    assert all(torch.equal(a, b) and torch.equal(y, z) for (a, y), (b, z) in zip(apart, written))


# ---------------------------------------------------------------- the device
def _pair(photos, tf, workers=0, share=0.0, monkeypatch=None, **kw):
    if share:
        from coordl.device import decoders as DDS

        monkeypatch.setattr(DDS, "cpu_share", lambda workers, spec=None: share)
    ds = datasets.ImageFolder(photos, transform=tf)
    kw = dict(batch_size=4, seed=3, shuffle=True, num_workers=workers, **kw)
    cpu = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cpu", decode="device", **kw)
    return cpu, list(L), L


@pytest.mark.parametrize("version,workers", [("v1", 0), ("v2", 2)])
def test_the_device_erases_the_cpu_paths_rectangles(photos, cpu_device, exact, version, workers):
    """The same rectangles as the CPU path, erased with the same value (an
    odd one, so that the erased pixels are exactly those that have it); the
    other pixels within the geometry's rounding (1 level)."""
    M = V if version == "v1" else V2
    cpu, dev, L = _pair(photos, _recipe(version, M.RandomErasing(0.6, value=ODD)), workers)
    assert len(cpu) == len(dev) == 5
    n = 0
    for (a, y), (b, y2) in zip(cpu, dev):
        assert torch.equal(y, y2) and a.shape == b.shape
        m = _erased(a, ODD)
        assert torch.equal(m, _erased(b, ODD))
        n += int(m.flatten(1).any(1).sum())
        keep = ~m[:, None].expand_as(a)
        assert float(((a - b).abs() * STD255)[keep].max()) <= 1 + 1e-3
    assert 0 < n < 20
    st = L.stats()
    assert st.device_decode_images == 20 and "RandomErasing" in st.device_decode


def test_timms_erasing_after_a_jitter_and_the_workers_share(photos, cpu_device, exact, monkeypatch):
    """timm's RandomErasing (Python's generator; up to three rectangles)
    after a ColorJitter, half the samples prepared by the workers on the CPU
    path: the rectangles the CPU path erases (zeros, a value no normalized
    pixel has with ImageNet's mean), on the device's rows and the workers'."""
    tf = _recipe("v1", _timm()(0.8, max_count=3, device="cpu"), jitter=True)
    cpu, dev, L = _pair(photos, tf, 2, share=0.5, monkeypatch=monkeypatch)
    rects = 0
    for (a, y), (b, _) in zip(cpu, dev):
        m = (a == 0).all(1)
        assert torch.equal(m, (b == 0).all(1))
        rects += int(m.flatten(1).any(1).sum())
        keep = ~m[:, None].expand_as(a)
        assert float(((a - b).abs() * STD255)[keep].max()) <= 8 + 1e-3
    assert rects > 5
    st = L.stats()
    assert 0 < st.device_decode_cpu_images < 20 and st.device_decode_images + st.device_decode_cpu_images == 20


def _erased_by(photos, tf, kw, base):
    """Per batch, the CPU path's pixels the erasing set: where its batch
    differs from the same recipe's without the erasing (``base``; it draws
    last, so nothing else changes)."""
    cpu = list(coordl.DataLoader(datasets.ImageFolder(photos, transform=tf), **kw))
    without = list(coordl.DataLoader(datasets.ImageFolder(photos, transform=base), **kw))
    return cpu, [a != b for (a, _), (b, _) in zip(cpu, without)]


@pytest.mark.parametrize("which,workers", [("v1", 0), ("v2", 2), ("timm-pixel", 0), ("timm-rand", 2)])
def test_the_device_erases_the_cpu_paths_noise(photos, cpu_device, exact, which, workers):
    """An erasing of noise on the device: the erased pixels are the CPU
    path's, bit for bit (the noise the workers drew where the CPU path
    draws it), the others within the geometry's rounding (1 level)."""
    version = "v2" if which == "v2" else "v1"
    tf = _recipe(version, _noise_erasings()[which]())
    base = _recipe(version, None)
    kw = dict(batch_size=4, seed=3, shuffle=True, num_workers=workers)
    cpu, masks = _erased_by(photos, tf, kw, base)
    L = coordl.DataLoader(datasets.ImageFolder(photos, transform=tf), device="cpu", decode="device", **kw)
    dev = list(L)
    erased = 0
    for (a, y), (b, y2), m in zip(cpu, dev, masks):
        assert torch.equal(y, y2)
        assert torch.equal(a[m], b[m])
        assert float(((a - b).abs() * STD255)[~m].max()) <= 1 + 1e-3
        erased += int(m.flatten(1).any(1).sum())
    assert erased >= 5
    assert f"RandomErasing ({'rand' if which == 'timm-rand' else 'pixel'} noise)" in L.stats().device_decode


def test_noise_of_the_workers_share_and_after_a_jitter(photos, cpu_device, exact, monkeypatch):
    """timm's pixel noise after a ColorJitter, half the samples prepared by
    the workers on the CPU path: their noise travels with their rows too."""
    tf = _recipe("v1", _timm()(0.9, mode="pixel", max_count=3, device="cpu"), jitter=True)
    base = _recipe("v1", None, jitter=True)
    from coordl.device import decoders as DDS

    monkeypatch.setattr(DDS, "cpu_share", lambda workers, spec=None: 0.5)
    kw = dict(batch_size=4, seed=3, shuffle=True, num_workers=2)
    cpu, masks = _erased_by(photos, tf, kw, base)
    L = coordl.DataLoader(datasets.ImageFolder(photos, transform=tf), device="cpu", decode="device", **kw)
    for (a, _), (b, _), m in zip(cpu, list(L), masks):
        assert torch.equal(a[m], b[m])
        assert float(((a - b).abs() * STD255)[~m].max()) <= 8 + 1e-3
    st = L.stats()
    assert 0 < st.device_decode_cpu_images < 20


def test_noise_erasing_resumes_exactly_and_is_not_split(photos, cpu_device):
    tf = _recipe("v1", V.RandomErasing(0.7, value="random"), jitter=True, size=16)
    ds = datasets.ImageFolder(photos, transform=tf)
    kw = dict(batch_size=3, shuffle=True, num_workers=2, device="cpu", decode="device")
    want, got = whole_and_resumed(lambda seed=11: coordl.DataLoader(ds, seed=seed, **kw), 3)
    assert len(got) == len(want) == 7
    assert all(torch.equal(a, b) and torch.equal(y, z) for (a, y), (b, z) in zip(got, want))
    # the device split (decode="cpu") does not carry noise: the samples are prepared whole in the workers
    S = coordl.DataLoader(ds, batch_size=3, seed=11, device="cpu")
    list(S)
    assert S.stats().device_split.startswith("not split") and "noise" in S.stats().device_split


def test_records_carry_the_cpu_paths_rectangles(photos):
    """Each record's rectangles are those the user's object erases on the
    CPU path, drawn after the jitter's operations; both generators are left
    as they were."""
    RE = _timm()
    for erase in (V.RandomErasing(0.9, value=ODD), RE(1.0, max_count=4, device="cpu")):
        tf = _recipe("v1", erase, jitter=True)
        pipe, _, _ = tc.translate(tf)
        plan = E.plan_for(pipe)
        before = torch.random.get_rng_state(), __import__("random").getstate()
        for i in range(12):
            g = _rng.derive(5, 1, i)
            plan.draw(60, 80, g)
            state = g.getstate()
            ops, rects, noise = plan.draw_after(g)
            assert noise is None
            # the CPU path's own draws: the jitter as written, then the erasing, under the same seeds
            g.setstate(state)
            with _rng.seeded_globals(g):
                for j in plan.jitters:
                    j.draw()
                x = torch.full((3, 20, 20), 0.5)
                y = erase(x.clone())
            assert E.rects_of([0] * E.INDEX + E.tail_fields(i, ops, rects)) == [tuple(r) for r in rects]
            assert len(rects) <= E.MAX_RECTS and E.ops_of([0] * E.INDEX + E.tail_fields(i, ops, rects)) == ops
            mine = x.clone()
            for t, l, h, w in rects:
                mine[:, t:t + h, l:l + w] = torch.tensor(erase_value(erase)).view(-1, 1, 1)
            assert torch.equal(mine, y), (i, rects)
        assert torch.equal(torch.random.get_rng_state(), before[0]) and __import__("random").getstate() == before[1]


def erase_value(erase):
    return (0.0,) if type(erase).__module__.startswith("timm") else ODD


def test_batch_reads_and_resume_give_the_per_sample_paths_batches(photos, cpu_device):
    """The workers' batch reads (the extension's draws, with Python's seed
    for timm's erasing) give the per-sample path's batches; a resumed pass
    the rest of the whole pass's."""
    tf = _recipe("v1", _timm()(0.7, max_count=2, device="cpu"), jitter=True, size=16)
    runs = check_batch_reads_and_resume(datasets.ImageFolder(photos, transform=tf), batch_size=3, seed=11,
                                        shuffle=True, device="cpu", decode="device")
    assert len(runs) == 7 and any((a == 0).all(1).any() for a, _ in runs)


# ---------------------------------------------------------------- refusals
def _refused(photos, tf, msg):
    ds = datasets.ImageFolder(photos, transform=tf)
    with pytest.raises(ValueError, match=msg):
        coordl.DataLoader(ds, batch_size=2, device="cpu", decode="device")
    if "values for a 3-channel" in msg:     # torchvision's own error on the CPU path, for each erased sample
        with pytest.raises(coordl.SampleError, match="either a single value or 3"):
            list(coordl.DataLoader(ds, batch_size=5))
    else:
        assert len(list(coordl.DataLoader(ds, batch_size=5))) == 4       # the CPU path runs it


@pytest.mark.parametrize("make,msg", [
    (lambda: _recipe("v1", _timm()(0.5, max_count=5, device="cpu")), r"up to 5 rectangles.*at most 4"),
    (lambda: _recipe("v1", V.RandomErasing(0.5, value=(1.0, 2.0))), r"2 values for a 3-channel image"),
    (lambda: V2.Compose([V2.RandomResizedCrop(16), V2.PILToTensor(), V2.RandomErasing(0.5)]),
     r"erases a uint8 image"),
    (lambda: V2.Compose([V2.RandomResizedCrop(16), V2.ToImage(), V2.ToDtype(torch.float32, scale=True),
                         V2.RandomErasing(0.5), V2.GaussianBlur(3)]), r"GaussianBlur"),
])
def test_what_the_device_cannot_erase_is_refused_naming_it(photos, cpu_device, make, msg):
    _refused(photos, make(), msg)


def test_noise_drawn_on_another_devices_generator_runs_as_written():
    """timm's noise drawn on its ``device`` (its default: "cuda"): not the
    CPU generator the workers draw from, so the erasing runs as written."""
    assert tc.erasing_of(_timm()(0.5, mode="pixel", device="meta")) is None
    assert tc.erasing_of(_timm()(0.5, mode="pixel", device="cpu")).noise == "pixel"
    assert tc.erasing_of(_timm()(0.5, mode="const", device="meta")).noise is None   # no noise: no device use


@pytest.mark.parametrize("which", ["v1", "timm"])
def test_an_erasing_whose_draws_cannot_be_made_apart_is_refused(photos, cpu_device, monkeypatch, caplog, which):
    """Where coordl's draws differ from the user's object's (here: one
    rectangle a row lower), the workers could not draw what the CPU path
    draws: refused, not guessed, and the CPU path runs it as written."""
    monkeypatch.setattr(tc, "_agree", {})
    real = tc.ErasingOnTensor.draw_with

    def lower(self, c, h, w):
        rects, noise = real(self, c, h, w)
        return [(t + 1, l, eh, ew) for t, l, eh, ew in rects], noise

    monkeypatch.setattr(tc.ErasingOnTensor, "draw_with", lower)
    erase = V.RandomErasing(0.5) if which == "v1" else _timm()(0.5, device="cpu")
    with caplog.at_level(logging.WARNING, logger="coordl.tvcompat"):
        _refused(photos, _recipe("v1", erase), r"RandomErasing\(.*'s draws could not be made apart")
    assert "differ from its own here" in caplog.text


def test_analyze_recommends_decoding_on_the_gpu_for_an_erasing_recipe(photos, monkeypatch):
    from coordl.analyze import recommend
    from coordl.tvcompat import adapt

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ds, _ = adapt(datasets.ImageFolder(photos, transform=_recipe("v1", V.RandomErasing(0.25), jitter=True)))
    [rec] = recommend({"largest": "prep"}, ds)
    assert rec["applies"] and rec["option"] == "decode='device'"
    assert "ToTensor + Normalize + RandomErasing" in rec["why"], rec


class _Preset:
    """A training preset shaped as torchvision's classification reference
    scripts make theirs (an object that hands the image to a Compose it
    holds): crop, flip, conversion, Normalize, RandomErasing."""

    def __init__(self, size, random_erase, backend="pil"):
        M = V2 if backend == "tensor" else V
        steps = [M.RandomResizedCrop(size, antialias=True), M.RandomHorizontalFlip(0.5)]
        if backend == "tensor":
            steps += [V2.PILToTensor(), V2.ToDtype(torch.float, scale=True)]
        else:
            steps += [V.PILToTensor(), V.ConvertImageDtype(torch.float)]
        steps += [M.Normalize(MEAN, STD)]
        if random_erase > 0:
            steps.append(M.RandomErasing(p=random_erase))
        if backend == "tensor":
            steps.append(V2.ToPureTensor())
        self.transforms = M.Compose(steps)

    def __call__(self, img):
        return self.transforms(img)


@pytest.mark.parametrize("backend", ["pil", "tensor"])
def test_a_reference_preset_with_random_erase_runs_on_the_device(photos, cpu_device, exact, backend):
    """Only the import changed plus the option: the preset's erasing runs on
    the device, erasing what the CPU path erases (zeros: exactly the pixels
    that are 0 in every channel, which no normalized pixel is with ImageNet's
    mean), the rest within the geometry's rounding."""
    cpu, dev, L = _pair(photos, _Preset(20, 0.5, backend), 2)
    n = 0
    for (a, y), (b, y2) in zip(cpu, dev):
        m = (a == 0).all(1)
        assert torch.equal(y, y2) and torch.equal(m, (b == 0).all(1))
        n += int(m.flatten(1).any(1).sum())
        keep = ~m[:, None].expand_as(a)
        assert float(((a - b).abs() * STD255)[keep].max()) <= 1 + 1e-3
    assert 0 < n < 20 and "RandomErasing" in L.stats().device_decode


def test_timms_train_transform_with_re_prob_runs_on_the_device(photos, cpu_device, exact):
    pytest.importorskip("timm", reason="timm is not installed (pip install timm)")
    from timm.data import create_transform

    tf = create_transform(20, is_training=True, re_prob=0.5, re_count=2)
    cpu, dev, L = _pair(photos, tf, 0)
    for (a, y), (b, y2) in zip(cpu, dev):
        m = (a == 0).all(1)
        assert torch.equal(y, y2) and torch.equal(m, (b == 0).all(1))
        keep = ~m[:, None].expand_as(a)
        assert float(((a - b).abs() * STD255)[keep].max()) <= 8 + 1e-3
    assert "ColorJitter" in L.stats().device_decode and "RandomErasing" in L.stats().device_decode


@pytest.mark.parametrize("value", [(0.0,), ODD])
def test_the_stages_mask_erases_what_one_copy_per_rectangle_erases(monkeypatch, value):
    """Many rectangles in a batch (up to 4 a row, overlapping, at the
    edges): the mask and masked fills used for them on a GPU set exactly
    the pixels, to exactly the value, that torchvision's erase of each
    rectangle in turn sets; so does a copy per rectangle."""
    from coordl.device import erase as ER

    y, rows, want = erase_cases.case(value)
    v = ER.value_on(value, torch.device("cpu"))
    monkeypatch.setattr(ER, "MASK_DEVICES", ("cuda", "cpu"))     # the GPU's way, on the CPU
    for few in (0, 1000):       # the mask, then a copy per rectangle
        monkeypatch.setattr(ER, "FEW_RECTS", few)
        assert torch.equal(ER.erase_rows(y.clone(), rows, v), want), few


def test_the_stage_reads_each_kept_rows_record(photos):
    """The stage erases row j with the rectangles of the record of the j-th
    kept sample (a skipped sample leaves a gap in the records)."""
    import types

    from coordl.device import decode as DD
    from coordl.device.split import DeviceTail

    y, rows, want = erase_cases.case(ODD)
    records = [[0] * E.INDEX + E.tail_fields(i, (), r) for i, r in enumerate(rows)]
    st = types.SimpleNamespace(plan=types.SimpleNamespace(erasing=types.SimpleNamespace(value=ODD), noise=None),
                               tail=DeviceTail([], ODD))
    keep = [0, 2, 3, 5]
    assert torch.equal(DD.DecodeStage._erased(st, y[keep].clone(), records, keep), want[keep])