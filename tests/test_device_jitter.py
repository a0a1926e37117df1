"""decode="device" with torchvision's ColorJitter between the geometry and
the conversion: the workers draw each sample's operations as the CPU path
draws them, the device applies them with PIL's arithmetic
(coordl.device.jitter).  On the CPU stand-in (``CPU_TEST_DEVICE``) the
same stage runs the same torch operations; tests/test_cuda.py runs them on
a GPU."""
import logging
import os
import random
import sys

import numpy as np
import pytest
import torch
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _jitter_cases as cases  # noqa: E402
from _batch_reads import check_batch_reads_and_resume  # noqa: E402
from _torchvision import import_torchvision  # noqa: E402

if import_torchvision() is None:
    pytest.skip("torchvision is not installed (pip install coordl[test])", allow_module_level=True)

from torchvision import datasets  # noqa: E402
from torchvision import transforms as V  # noqa: E402
from torchvision.transforms import v2 as V2  # noqa: E402

import coordl  # noqa: E402
from coordl import _rng  # noqa: E402
from coordl.decode import color as C  # noqa: E402
from coordl.decode import jpeg  # noqa: E402
from coordl.device import encoded as E  # noqa: E402
from coordl.device import jitter as J  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
STD255 = torch.tensor(STD).view(1, 3, 1, 1) * 255


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("jitter", num_images=20, num_classes=2, mean_kb=6, image_size=(96, 72), seed=4)


def _noise(rng, *shape, scale=1):
    return np.frombuffer(rng.randbytes(int(np.prod(shape))), np.uint8).reshape(shape) // scale


# ---------------------------------------------------------------- the operations
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_row_gets_pils_bytes_for_its_own_operations_in_its_own_order(seed):
    """A batch whose rows each have their own operations (none to four, any
    order, factors from 0 to 2.5, every hue shift kind), on noise, dark and
    grey images: every row is what PIL's ImageEnhance and HSV conversion
    give on that row's PIL image."""
    y, ops = cases.batch(seed, 12, 11, 17)
    want = cases.pils(y, ops)
    got = J.DeviceJitter(torch.device("cpu"))(y.clone(), ops)
    for r in range(12):
        assert np.array_equal(got[r].numpy(), want[r]), (r, ops[r])


def test_a_kind_that_differs_from_pil_runs_on_the_cpu_paths_code(monkeypatch, caplog):
    """Where the device's arithmetic differs from the installed PIL on the
    probes (here: a blend made one level off), those operations run through
    the CPU path's code for their rows: PIL's bytes still, and a warning."""
    real = J._blend
    monkeypatch.setattr(J, "_blend", lambda a, x, alpha: real(a, x, alpha).add_(1))
    rng = random.Random(4)
    y = torch.from_numpy(_noise(rng, 3, 3, 9, 10, scale=2).copy())
    ops = [[(C.BRIGHTNESS, 1.3)], [(C.SATURATION, 0.7), (C.HUE, 40)], []]
    before = y.clone()
    dj = J.DeviceJitter(torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="coordl.device"):
        got = dj(y, ops)
    for r in range(3):
        img = Image.fromarray(np.ascontiguousarray(before[r].numpy().transpose(1, 2, 0)))
        assert np.array_equal(got[r].numpy(), np.asarray(C.pil_jitter(img, ops[r])).transpose(2, 0, 1)), r
    assert dj._exact == {J._BLEND: False, J._SATURATE: False, J._HUE: True}
    assert "does not give this PIL's bytes" in caplog.text


def test_records_carry_the_cpu_paths_draws(photos):
    """Each record carries the operations the user's ColorJitter draws on the
    CPU path, in its order, from torch's generator seeded from the sample's
    own generator after the geometry's draws."""
    tf = V.Compose([V.RandomResizedCrop(24), V.RandomHorizontalFlip(), V.ColorJitter(0.4, 0.4, 0.4, 0.1),
                    V.ToTensor()])
    ds = coordl.DataLoader(datasets.ImageFolder(photos, transform=tf), batch_size=2).dataset
    plan = E.plan_for(ds.transform)
    assert len(plan.jitters) == 1 and plan.describe().startswith("RandomResizedCrop + RandomHorizontalFlip + ColorJitter")
    prep = E.DecodePrep(ds, plan)
    orders = set()
    for i in range(len(ds)):
        raw = ds.raw(i)
        with _rng.sample_rng(3, 1, i):
            rec, _ = prep.prep(raw, i)
        prep.take_device_marks(), prep.take_device_payloads()
        g = _rng.derive(3, 1, i)
        plan.draw(*jpeg.jpeg_size(raw), g)
        g2 = _rng.derive(3, 1, i)
        plan.draw(*jpeg.jpeg_size(raw), g2)
        torch.manual_seed(0)     # the draws must not come from the process's generator
        state, py_state = torch.get_rng_state(), random.getstate()
        want = plan.draw_ops(g)
        assert torch.equal(torch.get_rng_state(), state) and random.getstate() == py_state
        with _rng.seeded_globals(g2):          # as the CPU path's as-written part draws them
            assert [op for j in plan.jitters for op in j.draw()] == want
        assert E.ops_of(rec.tolist()) == want and len(want) == 4
        orders.add(tuple(c for c, _ in want))
    assert len(orders) > 1


# ---------------------------------------------------------------- the loader
def _geometry_then_jitter(photos, steps, jitter, workers, share=0.0, monkeypatch=None, seed=5, epoch=0):
    """The device path with ColorJitter, and the device path without it
    (uint8 out) followed by the CPU's jitter of each row with the
    operations that sample draws: the pairs of batches."""
    got, want, L, _ = cases.geometry_then(photos, steps, jitter, workers,
                                          lambda row, ops: torch.from_numpy(C.jitter(row.numpy(), ops)),
                                          share, monkeypatch, seed, epoch)
    return got, want, L


@pytest.mark.parametrize("workers", [0, 2])
def test_the_device_jitters_the_device_geometrys_rows_as_the_cpu_path_jitters(photos, cpu_device, workers):
    """Bit for bit: the device's ColorJitter of its own geometry's rows is
    the CPU path's jitter of those rows, with each sample's draws."""
    steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
    got, want, L = _geometry_then_jitter(photos, steps, V.ColorJitter(0.5, 0.6, 0.7, 0.2), workers)
    assert len(got) == len(want) == 5
    for (a, y), (b, y2) in zip(got, want):
        assert a.dtype == torch.uint8 and torch.equal(y, y2) and torch.equal(a, b)
    st = L.stats()
    assert st.device_decode_images == 20 and "ColorJitter" in st.device_decode


@pytest.mark.parametrize("version,workers", [("v1", 0), ("v2", 2)])
def test_a_randomapply_around_colorjitter_runs_on_the_device_as_the_cpu_path(photos, cpu_device, version, workers):
    """``RandomApply([ColorJitter(...)], p)`` (timm's ``color_jitter_prob``,
    the self-supervised recipes): its draw of whether it applies, then the
    jitter's, made in the worker; bit for bit the CPU path's jitter of the
    device's rows, some rows left as they are."""
    M = V if version == "v1" else V2
    steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
    got, want, L = _geometry_then_jitter(photos, steps, M.RandomApply([M.ColorJitter(0.5, 0.6, 0.7, 0.2)], p=0.5),
                                         workers)
    for (a, y), (b, y2) in zip(got, want):
        assert a.dtype == torch.uint8 and torch.equal(y, y2) and torch.equal(a, b)
    plan = E.plan_for(L.dataset.transform)
    assert type(plan.jitters[0]).__name__ == "RandomApplyOnPlanes" and "RandomApply" in plan.describe()
    applied = [bool(plan.after_for_seeds([(k, k)])[0][0]) for k in range(40)]
    assert 0 < sum(applied) < 40


@pytest.mark.parametrize("version,workers", [("v1", 2), ("v2", 0)])
def test_randomgrayscale_runs_on_the_device_as_the_cpu_path(photos, cpu_device, version, workers):
    """``RandomGrayscale`` (timm's ``grayscale_prob``, the self-supervised
    recipes): its draw made in the worker, the grey image PIL's
    ``convert("L")`` as the colour operation (SATURATION, 0.0); bit for bit
    the CPU path's of the device's rows, some rows grey, some not."""
    M = V if version == "v1" else V2
    steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
    got, want, L = _geometry_then_jitter(photos, steps, M.RandomGrayscale(p=0.5), workers)
    grey = 0
    for (a, y), (b, y2) in zip(got, want):
        assert torch.equal(y, y2) and torch.equal(a, b)
        grey += int(((a[:, 0] == a[:, 1]) & (a[:, 1] == a[:, 2])).flatten(1).all(1).sum())
    assert 0 < grey < 20
    assert "RandomGrayscale" in E.plan_for(L.dataset.transform).describe()


def test_the_workers_share_is_jittered_in_the_worker_as_the_cpu_path(photos, cpu_device, monkeypatch):
    """Half the samples prepared by the workers on the CPU path, their jitter
    with them; the other half on the device: both are the jitter of their
    geometry's rows with the sample's draws."""
    steps = [V.Resize(40), V.RandomHorizontalFlip(), V.CenterCrop(28), V.PILToTensor()]
    got, want, L = _geometry_then_jitter(photos, steps, V2.ColorJitter(0.4, 0.4, 0.4, 0.1), 2, share=0.5,
                                         monkeypatch=monkeypatch, epoch=2)
    for (a, y), (b, y2) in zip(got, want):
        assert torch.equal(y, y2) and torch.equal(a, b)
    st = L.stats()
    assert 0 < st.device_decode_cpu_images < 20 and st.device_decode_images + st.device_decode_cpu_images == 20


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_cpu_paths_pixels_to_what_the_jitter_makes_of_the_resizes_rounding(photos, cpu_device, exact, version):
    """Against the CPU path itself (torchvision's recipe, only the import
    changed plus the option): the same labels, and pixels that differ by
    what ColorJitter makes of the 1 level the geometry's rounding may differ
    by (docs/guide/gpu.md: at most 8 levels, a mean under 0.5)."""
    M = V if version == "v1" else V2
    tail = [V.ToTensor()] if version == "v1" else [V2.ToImage(), V2.ToDtype(torch.float32, scale=True)]
    tf = M.Compose([M.RandomResizedCrop(20), M.RandomHorizontalFlip(), M.ColorJitter(0.4, 0.4, 0.4, 0.1),
                    *tail, M.Normalize(MEAN, STD)])
    ds = datasets.ImageFolder(photos, transform=tf)
    kw = dict(batch_size=4, seed=7, shuffle=True, num_workers=2)
    cpu = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cpu", decode="device", **kw)
    dev = list(L)
    assert len(cpu) == len(dev) == 5
    d = torch.cat([((a - b).abs() * STD255).flatten() for (a, _), (b, _) in zip(cpu, dev)])
    for (a, y), (b, y2) in zip(cpu, dev):
        assert torch.equal(y, y2) and a.shape == b.shape and a.dtype == b.dtype
    assert float(d.max()) <= 8 + 1e-3 and float(d.mean()) < 0.5, (float(d.max()), float(d.mean()))
    assert L.stats().device_decode_images == len(ds)


def test_timms_default_train_transform_runs_on_the_device(photos, cpu_device, exact):
    timm = pytest.importorskip("timm", reason="timm is not installed (pip install timm)")
    from timm.data import create_transform

    tf = create_transform(20, is_training=True)        # RandomResizedCrop, flip, ColorJitter(0.4), Normalize
    assert "ColorJitter" in repr(tf), timm.__version__
    ds = datasets.ImageFolder(photos, transform=tf)
    kw = dict(batch_size=4, seed=1, shuffle=True)
    cpu = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cpu", decode="device", **kw)
    dev = list(L)
    for (a, y), (b, y2) in zip(cpu, dev):
        assert torch.equal(y, y2) and a.shape == b.shape == (len(y), 3, 20, 20)
        assert float(((a - b).abs() * STD255).max()) <= 8 + 1e-3
    assert L.stats().device_decode_images == len(ds)


def test_batch_reads_and_resume_give_the_per_sample_paths_batches(photos, cpu_device):
    """The workers' batch reads draw the operations as the per-sample path
    does; a resumed pass gives the rest of the whole pass's batches."""
    tf = V.Compose([V.RandomResizedCrop(16), V.RandomHorizontalFlip(), V.ColorJitter(0.3, 0.3, 0.3, 0.05),
                    V.ToTensor(), V.Normalize(MEAN, STD)])
    runs = check_batch_reads_and_resume(datasets.ImageFolder(photos, transform=tf), batch_size=3, seed=11,
                                        shuffle=True, device="cpu", decode="device")
    assert len(runs) == 7


@pytest.mark.parametrize("steps,msg", [
    ([V.RandomResizedCrop(16), V.ColorJitter(0.2), V.ElasticTransform(sigma=1.0), V.ToTensor()],
     r"steps ElasticTransform run as"),
    ([V.RandomResizedCrop(16), V.ColorJitter(0.2)], r"ends with ColorJitter"),
    ([V.RandomResizedCrop(16), V.ColorJitter(0.2), V.ColorJitter(0.1), V.ColorJitter(0.1), V.ToTensor()],
     r"3 ColorJitter steps.*at most 2"),
    ([V.RandomResizedCrop(16, interpolation=V.InterpolationMode.BOX), V.ColorJitter(0.2), V.ToTensor()],
     r"steps RandomResizedCrop run as written"),
])
def test_what_the_device_cannot_run_around_colorjitter_is_refused_naming_it(photos, cpu_device, steps, msg):
    ds = datasets.ImageFolder(photos, transform=V.Compose(steps))
    with pytest.raises(ValueError, match=msg):
        coordl.DataLoader(ds, batch_size=2, device="cpu", decode="device")


def test_a_colorjitter_whose_draws_cannot_be_made_apart_is_refused(photos, cpu_device, monkeypatch, caplog):
    """Where coordl cannot make the user's ColorJitter's draws apart from its
    call (another torchvision's API: here, a draw that makes nothing), the
    workers could not draw what the CPU path draws: refused, not guessed."""
    import coordl.tvcompat as tc

    monkeypatch.setattr(tc, "_agree", {})
    monkeypatch.setattr(tc.ColorJitterOnPlanes, "draw", lambda self: [])
    ds = datasets.ImageFolder(photos, transform=V.Compose([V.RandomResizedCrop(16), V.ColorJitter(0.3),
                                                           V.ToTensor()]))
    with caplog.at_level(logging.WARNING, logger="coordl.tvcompat"):
        with pytest.raises(ValueError, match=r"ColorJitter\(brightness=.*'s draws could not be made apart"):
            coordl.DataLoader(ds, batch_size=2, device="cpu", decode="device")
    assert "differs from torchvision.transforms" in caplog.text
    assert len(list(coordl.DataLoader(ds, batch_size=5))) == 4       # the CPU path runs it as written


def test_analyze_recommends_decoding_on_the_gpu_for_a_colorjitter_recipe(photos, monkeypatch):
    """``coordl analyze`` on torchvision's ImageFolder with timm's default
    training recipe, prep the stall and a GPU there: decode="device"."""
    from coordl.analyze import recommend
    from coordl.tvcompat import adapt

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tf = V.Compose([V.RandomResizedCrop(16), V.RandomHorizontalFlip(), V.ColorJitter(0.4, 0.4, 0.4), V.ToTensor(),
                    V.Normalize(MEAN, STD)])
    ds, _ = adapt(datasets.ImageFolder(photos, transform=tf))
    [rec] = recommend({"largest": "prep"}, ds)
    assert rec["applies"] and rec["option"] == "decode='device'"
    assert "RandomResizedCrop + RandomHorizontalFlip + ColorJitter -> 16x16" in rec["why"], rec


def test_without_coordls_colour_kernel_the_device_still_runs_it(photos, cpu_device, monkeypatch):
    """Where coordl's C colour kernel is not built (or not PIL's here), the
    CPU path runs ColorJitter through PIL; decode="device" still takes it:
    its draws are the user's object's, its arithmetic the device's own, and
    the samples the workers prepare go through PIL, as on the CPU path."""
    import coordl.tvcompat as tc

    monkeypatch.setattr(tc, "_agree", {})
    monkeypatch.setattr(C, "_checked", [False])
    assert not C.exact_kernel()
    steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
    got, want, L = _geometry_then_jitter(photos, steps, V.ColorJitter(0.5, 0.6, 0.7, 0.2), 0, share=0.5,
                                         monkeypatch=monkeypatch)
    assert type(L.dataset.transform.tail[0]).__name__ == "ColorJitter"      # as written on the CPU path
    for (a, y), (b, y2) in zip(got, want):
        assert torch.equal(y, y2) and torch.equal(a, b)
    st = L.stats()
    assert 0 < st.device_decode_cpu_images < 20 and st.device_decode_images + st.device_decode_cpu_images == 20


# ---------------------------------------------------------------- the kernel (Triton's interpreter)
_KERNEL_CHILD = """
import logging, random, sys
import numpy as np, torch
from coordl.decode import color as C
from coordl.device import jitter as J

J.KERNEL_ON_CPU = True
logging.basicConfig(level=logging.INFO, format="LOG %(message)s", stream=sys.stdout)
sys.path.insert(0, {here!r})
import _jitter_cases as cases
n = 10
y, ops = cases.batch(7, n, 13, 21)
{setup}
dj = J.DeviceJitter(torch.device("cpu"))
got = dj(y.clone(), ops)
same = sum(np.array_equal(g.numpy(), w) for g, w in zip(got, cases.pils(y, ops)))
print("SAME", same, n)
print("KERNEL", sorted(dj._kernel_ok.items()), "TORCH", sorted(dj._exact.items()))
"""


def _kernel_child(setup: str = "") -> str:
    import importlib.util
    import os

    from coordl.testing import run_in_child

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    code = _KERNEL_CHILD.replace("{setup}", setup).replace("{here!r}", repr(HERE))
    r = run_in_child(code, timeout=240, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def _states(out: str) -> tuple:
    line = [x for x in out.splitlines() if x.startswith("KERNEL ")][0]
    kernel, torch_ops = line[len("KERNEL "):].split(" TORCH ")
    return dict(eval(kernel)), dict(eval(torch_ops))


def test_the_kernel_gives_each_row_pils_bytes():
    """The Triton kernel (one launch per position of the rows' operations,
    in place), through Triton's interpreter: every row is PIL's, every kind
    passed its first-use check, and torch's operations never ran."""
    out = _kernel_child()
    assert "SAME 10 10" in out, out
    assert "KERNEL [(0, True), (1, True), (2, True)] TORCH []" in out, out


def test_a_kernel_that_differs_or_cannot_run_gives_way_to_torchs_operations():
    """A kernel whose bytes differ from PIL's on the probes (here one level
    off), or that cannot launch: torch's operations run those kinds, with
    PIL's bytes still."""
    off = """
real = J.DeviceJitter._launch
def launch(self, y, rows):
    real(self, y, rows)
    if any(c == C.SATURATION for _, c, _ in rows):
        y.add_(1)
J.DeviceJitter._launch = launch
"""
    out = _kernel_child(off)
    assert "SAME 10 10" in out, out
    kernel, torch_ops = _states(out)
    # saturation's kernel check failed: a position with a saturation runs in torch's operations
    assert kernel[0] is True and kernel[1] is False and torch_ops[1] is True, out
    broken = """
class Broken:
    def __getitem__(self, grid):
        raise RuntimeError("no compiler here")
import types
J._KERNEL[:] = [types.SimpleNamespace(jitter_ops=Broken(), luma_sums=Broken())]
"""
    out = _kernel_child(broken)
    assert "SAME 10 10" in out, out
    kernel, torch_ops = _states(out)
    assert kernel and not any(kernel.values()) and torch_ops == {0: True, 1: True, 2: True}, out
    assert "LOG decode='device': the ColorJitter kernel cannot run on cpu (RuntimeError: no compiler here)" in out
