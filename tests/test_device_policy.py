"""decode="device" with torchvision's auto-augment policies (TrivialAugmentWide, RandAugment, AutoAugment) between the
geometry and the conversion (the reference classification recipe's
``--auto-augment``): the workers draw each sample's operation as the CPU
path draws it, the device computes it with PIL's arithmetic
(coordl.device.pil_ops through coordl.device.jitter).  On the CPU stand-in
(``CPU_TEST_DEVICE``) the same stage runs the same torch operations;
tests/test_cuda.py runs them on a GPU."""
import collections
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
from coordl import tvcompat  # noqa: E402
from coordl.decode import color as C  # noqa: E402
from coordl.device import encoded as E  # noqa: E402
from coordl.device import jitter as J  # noqa: E402
from coordl.device import pil_ops as P  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
STD255 = torch.tensor(STD).view(1, 3, 1, 1) * 255
VERSIONS = {"v1": V, "v2": V2}


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("policy", num_images=24, num_classes=2, mean_kb=6, image_size=(96, 72), seed=8)


def _pils(y: torch.Tensor, ops: list) -> list:
    out = []
    for r in range(len(ops)):
        img = Image.fromarray(np.ascontiguousarray(y[r].numpy().transpose(1, 2, 0)))
        out.append(np.asarray(C.pil_jitter(img, ops[r])).transpose(2, 0, 1))
    return out


def _rows(seed: int, n: int, h: int, w: int) -> torch.Tensor:
    """Noise rows of every kind the tables meet: full range, dark, few
    values, one value, grey pixels."""
    rng = random.Random(seed)
    y = torch.from_numpy(np.frombuffer(rng.randbytes(n * 3 * h * w), np.uint8).reshape(n, 3, h, w).copy())
    y[1] //= 16
    y[2] = y[2] // 64 + 90
    y[3] = 200
    y[4, 1] = y[4, 0]
    y[4, 2] = y[4, 0]
    return y


def _geometric_ops(h: int, w: int) -> list:
    """The affine maps and transpositions torchvision's policies ask PIL for
    on an ``h`` x ``w`` image, over their whole magnitude ranges, both
    versions, with and without a fill."""
    out = []
    for M in (V, V2):
        for fill, mode in ((None, "NEAREST"), ([9, 80, 200], "NEAREST"), (None, "BILINEAR"), ([3, 4, 5], "BICUBIC")):
            p = tvcompat.policy_of(M.TrivialAugmentWide(fill=fill, interpolation=getattr(M.InterpolationMode, mode)))
            for name, mags in (("ShearX", np.linspace(0, 0.99, 7)), ("ShearY", np.linspace(0, 0.99, 5)),
                               ("TranslateX", (0.0, 3.0, 32.0, 150 / 331 * w)), ("TranslateY", (1.0, 31.0, 4.9)),
                               ("Rotate", (4.5, 30.0, 45.0, 90.0, 135.0))):
                for m in mags:
                    for sign in (1.0, -1.0):
                        out += p._ops(name, float(m) * sign, h, w)
    return out


# ---------------------------------------------------------------- the operations
@pytest.mark.parametrize("h,w", [(11, 17), (16, 16), (2, 9)])
def test_each_operation_is_pils_on_every_row(h, w):
    """Every operation of the policies, each row with its own value, on rows
    of noise, dark, few-valued, flat and grey images, square or not and
    smaller than the sharpness kernel: PIL's own bytes."""
    rng = random.Random(h * w)
    cases = [(C.SHARPNESS, rng.uniform(0.0, 2.0)) for _ in range(4)] + [(C.SHARPNESS, 0.01), (C.SHARPNESS, 1.99)]
    cases += [(C.POSTERIZE, b) for b in range(1, 9)] + [(C.SOLARIZE, t) for t in (0.0, 8.2, 127.5, 128.0, 255.0)]
    cases += [(C.AUTOCONTRAST, 0), (C.EQUALIZE, 0), (C.INVERT, 0)] + [(C.SOLARIZE_ADD, a) for a in (0, 33, 110)]
    cases += _geometric_ops(h, w) + [(C.PERSPECTIVE, v) for v in C._PROBE_VALUES[C.PERSPECTIVE]]
    cases += [(C.PIL_BLUR, r) for r in (0.1, 0.45, 1.0, 1.3, 2.0, 7.5)]
    if h == w:
        cases += [(C.TRANSPOSE, m) for m in range(7)]
    by_code = collections.defaultdict(list)
    for op in cases:
        by_code[op[0]].append(op)
    for code, ops in by_code.items():
        n = max(len(ops), 5)
        y = _rows(code, n, h, w)
        per_row = [[ops[r % len(ops)]] for r in range(n)]
        got = torch.cat([P.apply(y[r:r + 1], code, [per_row[r][0][1]]) for r in range(n)])
        batch = P.apply(y, code, [o[0][1] for o in per_row])
        want = _pils(y, per_row)
        for r in range(n):
            assert np.array_equal(got[r].numpy(), want[r]), (code, per_row[r])
            assert np.array_equal(batch[r].numpy(), want[r]), (code, per_row[r])


def test_pils_three_ways_of_an_affine_map_are_each_followed():
    """A translation (PIL's scale path, double-precision tables), a shear
    (16.16 fixed point) and a map too large for fixed point (PIL's
    double-precision accumulation) each give PIL's bytes."""
    y = _rows(3, 5, 12, 10)
    maps = {"scale": (1.0, 0.0, -3.0, 0.0, 1.0, 2.0, None, 0), "fixed": (1.0, 0.37, 0.0, 0.0, 1.0, 0.0, (1, 2, 3), 0),
            "map": (1.0, 0.2, 40000.0, 0.1, 1.0, -40000.0, None, 0)}
    for how, value in maps.items():
        assert P.source_index(value[:6], 12, 10)[0] == how
        got = P.apply(y, C.AFFINE, [value] * 5)
        for r, want in enumerate(_pils(y, [[(C.AFFINE, value)]] * 5)):
            assert np.array_equal(got[r].numpy(), want), (how, r)


def test_each_kind_passes_its_check_against_pil_and_a_wrong_one_does_not(monkeypatch, caplog):
    """DeviceJitter checks each kind on probe images at its first use; an
    equalize made wrong (no clipping of PIL's table) fails its check, and
    its rows then run through the CPU path's code: PIL's bytes still."""
    dj = J.DeviceJitter(torch.device("cpu"))
    for code in P.CODES:
        assert dj.exact(J._KIND[code]), code
    real = P._equalize_tables
    monkeypatch.setattr(P, "_equalize_tables", lambda x: real(x).add_(1))
    dj = J.DeviceJitter(torch.device("cpu"))
    y = _rows(5, 5, 9, 8)
    ops = [[(C.EQUALIZE, 0)], [(C.POSTERIZE, 3), (C.EQUALIZE, 0)], [], [(C.EQUALIZE, 0)], [(C.INVERT, 0)]]
    want = _pils(y, ops)
    with caplog.at_level(logging.WARNING, logger="coordl.device"):
        got = dj(y.clone(), ops)
    assert dj._exact[J._KIND[C.EQUALIZE]] is False and "EQUALIZE" not in caplog.text
    assert any("does not give this PIL's bytes" in r.message for r in caplog.records)
    for r in range(5):
        assert np.array_equal(got[r].numpy(), want[r]), r


def test_records_carry_affine_maps_and_fills():
    """An operation's affine map (six doubles), fill and filter travel in
    the record and come back as they went, beside other operations."""
    ops = [(C.BRIGHTNESS, 1.25), (C.AFFINE, (1.0, -0.3, 0.1, 0.0, 1.0, 2.5e-17, (9, 80, 200), 3)),
           (C.AFFINE, (0.5, 0.0, -3.0, 0.0, 2.0, 7.0, None, 0)), (C.SOLARIZE, 127.5)]
    rec = [0] * E.INDEX + E.tail_fields(7, ops, [(1, 2, 3, 4)])
    assert len(rec) == E.RECORD
    assert E.ops_of(rec) == ops and E.rects_of(rec) == [(1, 2, 3, 4)]
    persp = [(C.CONTRAST, 0.5), (C.PERSPECTIVE, (1.2, 0.1, -2.0, 0.05, 1.3, -1.5, 0.006, -0.009, (1, 2, 3), 2))]
    assert E.ops_of([0] * E.INDEX + E.tail_fields(3, persp)) == persp
    full = ops[1:3] + persp[1:] * 5                       # twelve slots in seven operations
    assert E.ops_of([0] * E.INDEX + E.tail_fields(3, full)) == full
    with pytest.raises(ValueError, match="than the 12 parameter slots"):
        E.tail_fields(7, full + ops[1:2])
    for v in C._PROBE_VALUES[C.TIMM_AUGMIX]:       # timm's AugMix: its chains' operations, affine maps among them
        mix = [(C.SOLARIZE, 100.0), (C.TIMM_AUGMIX, v), (C.AFFINE, ops[1][1])]
        assert E.ops_of([0] * E.INDEX + E.tail_fields(1, mix)) == mix


# ---------------------------------------------------------------- the draws
def _probe_image(seed: int, h: int, w: int) -> Image.Image:
    rng = random.Random(seed)
    return Image.fromarray(np.frombuffer(rng.randbytes(h * w * 3), np.uint8).reshape(h, w, 3))


def _same_draws(t, mine, img: Image.Image, seeds) -> list:
    """For each seed of torch's, Python's and numpy's generators: the user's
    ``t`` on ``img`` is PIL's result of ``mine``'s draws, and the generators
    are left as the user's call leaves them; where the user's call fails
    (timm's posterize at 0 bits, which this PIL refuses), so does the draw,
    with the same error.  Each seed's operations (none for those)."""
    out = []
    for seed in seeds:
        tvcompat._seed_all(seed)
        try:
            want = np.asarray(t(img))
        except ValueError as e:
            tvcompat._seed_all(seed)
            with pytest.raises(ValueError, match=str(e)):
                mine.draw((img.height, img.width))
            continue
        after = tvcompat._all_states()
        tvcompat._seed_all(seed)
        ops = mine.draw((img.height, img.width))
        now = tvcompat._all_states()
        assert torch.equal(now[0], after[0]) and now[1:] == after[1:], seed
        assert np.array_equal(np.asarray(C.pil_jitter(img, ops)), want), (seed, ops)
        out.append(ops)
    return out

POLICIES = {"ta_wide": lambda M: M.TrivialAugmentWide(), "ra": lambda M: M.RandAugment(),
            "imagenet": lambda M: M.AutoAugment(), "cifar10": lambda M: M.AutoAugment(M.AutoAugmentPolicy.CIFAR10),
            "ra_bilinear": lambda M: M.RandAugment(interpolation=M.InterpolationMode.BILINEAR),
            "ta_bicubic": lambda M: M.TrivialAugmentWide(interpolation=M.InterpolationMode.BICUBIC, fill=[50, 0, 9])}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_draws_are_the_users_policys_own(version, policy):
    """Over many samples the policy's operations are drawn, and PIL's
    result of the drawn operations on a real crop is the user's policy's,
    with torch's generator left as its call leaves it."""
    M = VERSIONS[version]
    t = POLICIES[policy](M)
    p = tvcompat.policy_of(t)
    assert p is not None and p.draws_agree() and p.v2 == (version == "v2")
    drawn = _same_draws(t, p, _probe_image(1, 30, 40), range(300))
    assert len({tuple(c for c, _ in ops) for ops in drawn}) >= 10   # colour operations, tables, affine maps, pairs


def test_a_policy_the_device_cannot_run_is_not_taken():
    """Another interpolation than PIL's nearest, bilinear and bicubic,
    another class: not drawn apart, so decode="device" refuses them."""
    assert tvcompat.policy_of(V.TrivialAugmentWide(interpolation=V.InterpolationMode.BOX)) is None
    assert tvcompat.policy_of(V2.RandAugment(interpolation=V2.InterpolationMode.LANCZOS)) is None
    assert tvcompat.policy_of(V2.RandAugment(interpolation=V2.InterpolationMode.BILINEAR)) is not None
    assert tvcompat.policy_of(V.AugMix()) is None and tvcompat.policy_of(V.ColorJitter(0.2)) is None


# ---------------------------------------------------------------- the loader
def _levels_against_the_cpu_path(ds, seed: int) -> tuple:
    """``ds`` through ``decode="cpu"`` and ``decode="device"`` (the stand-in),
    2 workers, shuffled: the same labels and shapes; ``(every value's
    difference in uint8 levels, the device's loader)``."""
    kw = dict(batch_size=4, seed=seed, shuffle=True, num_workers=2)
    cpu = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cpu", decode="device", **kw)
    dev = list(L)
    assert len(cpu) == len(dev) > 0
    for (a, y), (b, y2) in zip(cpu, dev):
        assert torch.equal(y, y2) and a.shape == b.shape and a.dtype == b.dtype
    return torch.cat([((a - b).abs() * STD255).flatten() for (a, _), (b, _) in zip(cpu, dev)]), L


def _split_is_the_cpu_paths(ds, name: str, workers: int = 2) -> None:
    """The device split (decode="cpu", the stand-in's device) of ``ds``
    draws the step ``name`` in the worker and runs it on the device: the
    CPU path's batches, bit for bit."""
    kw = dict(batch_size=4, seed=9, shuffle=True, num_workers=workers)
    cpu = list(coordl.DataLoader(ds, **kw))
    S = coordl.DataLoader(ds, device="cpu", **kw)
    split = list(S)
    assert S.stats().device_split.startswith("split") and name in S.stats().device_split, S.stats().device_split
    assert len(cpu) == len(split) > 0
    for (a, y), (b, y2) in zip(cpu, split):
        assert torch.equal(y, y2) and torch.equal(a, b)


def _geometry_then_policy(photos, steps, policy, workers, seed=5, epoch=0):
    """The device path with the policy, and the device path without it
    (uint8 out) followed by PIL's operations of each sample's draws on each
    row: the pairs of batches, the loader, each sample's operations."""
    return cases.geometry_then(photos, steps, policy, workers,
                               lambda row, ops: torch.from_numpy(_pils(row[None], [ops])[0].copy()), seed=seed,
                               epoch=epoch)


@pytest.mark.parametrize("version,policy,workers", [("v1", "ta_wide", 0), ("v2", "ta_wide", 2), ("v1", "ra", 2),
                                                    ("v2", "imagenet", 0), ("v1", "ra_bilinear", 2),
                                                    ("v2", "ta_bicubic", 0)])
def test_the_device_runs_the_policy_on_its_rows_as_the_cpu_path(photos, cpu_device, version, policy, workers):
    """Bit for bit: the device's policy of its own geometry's rows is PIL's
    operations of each sample's draws on those rows."""
    M = VERSIONS[version]
    steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
    t = POLICIES[policy](M)
    got, want, L, drawn = _geometry_then_policy(photos, steps, t, workers)
    assert len(got) == len(want) == 6
    for (a, y), (b, y2) in zip(got, want):
        assert a.dtype == torch.uint8 and torch.equal(y, y2) and torch.equal(a, b)
    assert len({tuple(c for c, _ in ops) for ops in drawn}) >= 5
    st = L.stats()
    assert st.device_decode_images == 24 and type(t).__name__ in st.device_decode


@pytest.mark.parametrize("version,policy", [("v1", "ta_wide"), ("v2", "ta_wide"), ("v2", "ra"), ("v1", "imagenet"),
                                            ("v1", "augmix"), ("v2", "augmix")])
def test_torchvisions_reference_recipe_with_a_policy_runs_on_the_device(photos, cpu_device, exact, version, policy):
    """torchvision's reference classification preset with ``--auto-augment``
    (``augmix`` too) and random erasing, only the import changed plus the
    option: the same labels; the rows the CPU path's up to what the policy's
    operations make of the geometry's 1-level rounding (a solarize or
    posterize boundary crossed, an equalize table moved, a factor over 1),
    on a few values."""
    M = VERSIONS[version]
    conv = [M.PILToTensor(), M.ConvertImageDtype(torch.float)] if version == "v1" else \
        [M.PILToTensor(), M.ToDtype(torch.float, scale=True)]
    step = AUGMIX["default"](M) if policy == "augmix" else POLICIES[policy](M)
    tf = M.Compose([M.RandomResizedCrop(24), M.RandomHorizontalFlip(0.5), step, *conv, M.Normalize(MEAN, STD),
                    M.RandomErasing(0.5)])
    ds = datasets.ImageFolder(photos, transform=tf)
    d, L = _levels_against_the_cpu_path(ds, 7)
    # measured (docs/guide/gpu.md): 1-3% of the values more than a level off, a mean well under a level
    assert float((d > 1 + 1e-3).float().mean()) < 0.06 and float(d.mean()) < 1.0, (float(d.mean()), float(
        (d > 1 + 1e-3).float().mean()))
    assert L.stats().device_decode_images == len(ds)


def test_batch_reads_and_resume_give_the_per_sample_paths_batches(photos, cpu_device):
    tf = V.Compose([V.RandomResizedCrop(16), V.RandomHorizontalFlip(), V.TrivialAugmentWide(fill=[3, 200, 90]),
                    V.ToTensor(), V.Normalize(MEAN, STD)])
    runs = check_batch_reads_and_resume(datasets.ImageFolder(photos, transform=tf), batch_size=3, seed=11,
                                        shuffle=True, device="cpu", decode="device")
    assert len(runs) == 8


def test_the_workers_share_runs_the_policy_in_the_worker(photos, cpu_device, monkeypatch):
    """Samples the workers prepare on the CPU path get the policy's
    operation there (PIL itself), the others on the device: the same
    batches as with every sample on the device, up to the decode's
    tolerance, and the same draws."""
    from coordl.device import decoders as DDS

    tf = V.Compose([V.Resize(40), V.CenterCrop(28), V.TrivialAugmentWide(), V.PILToTensor()])
    ds = datasets.ImageFolder(photos, transform=tf)
    kw = dict(batch_size=4, seed=2, num_workers=2, device="cpu", decode="device")
    plain = list(coordl.DataLoader(ds, **kw))
    monkeypatch.setattr(DDS, "cpu_share", lambda workers, spec=None: 0.5)
    L = coordl.DataLoader(ds, **kw)
    shared = list(L)
    st = L.stats()
    assert 0 < st.device_decode_cpu_images < 24
    for (a, y), (b, y2) in zip(plain, shared):
        assert torch.equal(y, y2)
        assert float((a.float() - b.float()).abs().gt(1).float().mean()) < 0.05


@pytest.mark.parametrize("policy", ["ta_wide", "timm", "blur"])
def test_the_device_split_draws_the_policy_in_the_worker(photos, cpu_device, policy):
    """With ``decode="cpu"`` the split stops at the cropped uint8 image and
    the device runs the policy and the conversion: the CPU path's batches,
    bit for bit (timm's: numpy's generator seeded in the worker as the CPU
    path seeds it)."""
    t = TIMM["rand-m7-mstd0.5"](_timm_aa()) if policy == "timm" else V.TrivialAugmentWide() if policy == "ta_wide" \
        else V.RandomApply([V.GaussianBlur(9, sigma=(0.1, 2.0))], p=0.5)
    tf = V.Compose([V.RandomResizedCrop(20), V.RandomHorizontalFlip(), t, V.ToTensor(), V.Normalize(MEAN, STD)])
    ds = datasets.ImageFolder(photos, transform=tf)
    kw = dict(batch_size=4, seed=9, shuffle=True, num_workers=2)
    cpu = list(coordl.DataLoader(ds, **kw))
    L = coordl.DataLoader(ds, device="cpu", **kw)
    split = list(L)
    st = L.stats()
    assert st.device_split.startswith("split") and type(t).__name__ in st.device_split
    assert "after the steps run as written" not in st.device_split
    for (a, y), (b, y2) in zip(cpu, split):
        assert torch.equal(y, y2) and torch.equal(a, b)


def test_other_policies_are_refused_naming_them(photos, cpu_device):
    tf = V.Compose([V.RandomResizedCrop(16), V.AugMix(fill=[1, 2, 3]), V.ToTensor()])
    tf2 = V.Compose([V.RandomResizedCrop(16), V.TrivialAugmentWide(interpolation=V.InterpolationMode.HAMMING),
                     V.ToTensor()])
    for t in (tf, tf2):
        with pytest.raises(ValueError, match=r"decode='device' cannot run.*(AugMix|TrivialAugmentWide) run as"):
            coordl.DataLoader(datasets.ImageFolder(photos, transform=t), batch_size=4, device="cpu",
                              decode="device")


@pytest.mark.parametrize("policies", [lambda: [V.RandomPerspective() for _ in range(7)],
                                      lambda: [V.AugMix() for _ in range(6)] + [V.RandomRotation(3)]])
def test_more_affine_maps_than_a_record_carries_are_refused(photos, cpu_device, policies):
    tf = V.Compose([V.RandomResizedCrop(16)] + policies() + [V.ToTensor()])
    with pytest.raises(ValueError, match=r"more than 12 shears, translations, rotations or blurs"):
        coordl.DataLoader(datasets.ImageFolder(photos, transform=tf), batch_size=4, device="cpu", decode="device")


def test_three_policies_a_sample_fit_in_the_record(photos, cpu_device):
    """``RandAugment(num_ops=3)`` and three ``TrivialAugmentWide``s (three
    affine maps a sample at most) run on the device: the record's twelve
    parameter slots carry them."""
    steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.PILToTensor()]
    for t in (V.RandAugment(num_ops=3), V.Compose([V.TrivialAugmentWide() for _ in range(3)])):
        got, want, L, drawn = _geometry_then_policy(photos, steps, t, 0)
        for (a, y), (b, y2) in zip(got, want):
            assert torch.equal(y, y2) and torch.equal(a, b)
        assert max(sum(c == C.AFFINE for c, _ in ops) for ops in drawn) >= 2


@pytest.mark.parametrize("policy", ["TrivialAugmentWide", "AugMix"])
def test_analyze_recommends_decoding_on_the_gpu_for_the_reference_recipe(photos, monkeypatch, policy):
    """``coordl analyze`` on torchvision's ImageFolder with the reference
    recipe's ``ta_wide`` or ``augmix``, prep the stall and a GPU there:
    decode="device" (it was not, while the policy was refused)."""
    from coordl.analyze import recommend
    from coordl.tvcompat import adapt

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tf = V.Compose([V.RandomResizedCrop(16), V.RandomHorizontalFlip(), getattr(V, policy)(), V.PILToTensor(),
                    V.ConvertImageDtype(torch.float), V.Normalize(MEAN, STD)])
    ds, _ = adapt(datasets.ImageFolder(photos, transform=tf))
    [rec] = recommend({"largest": "prep"}, ds)
    assert rec["applies"] and rec["option"] == "decode='device'"
    assert f"RandomResizedCrop + RandomHorizontalFlip + {policy} -> 16x16" in rec["why"], rec


# ---------------------------------------------------------------- timm's policies
def _timm_aa():
    pytest.importorskip("timm", reason="timm is not installed (pip install timm)")
    from timm.data import auto_augment as A

    return A


TIMM = {"rand-m9-mstd0.5-inc1": lambda A: A.rand_augment_transform("rand-m9-mstd0.5-inc1", {}),
        "rand-m7-mstd0.5": lambda A: A.rand_augment_transform("rand-m7-mstd0.5", {"img_mean": (124, 116, 104)}),
        "original": lambda A: A.auto_augment_transform("original", {}),
        "v0-bicubic": lambda A: A.auto_augment_transform("v0", {"interpolation": Image.BICUBIC}),
        "original-bicubic": lambda A: A.auto_augment_transform("original", {"interpolation": Image.BICUBIC}),
        "3a": lambda A: A.auto_augment_transform("3a", {}),
        "augmix-m3-w3": lambda A: A.augment_and_mix_transform("augmix-m3-w3", {}),
        "augmix-m5-w2-d2-mstd0.5": lambda A: A.augment_and_mix_transform("augmix-m5-w2-d2-mstd0.5", {}),
        "rand-m9-n2-mstd0.5-t3aw": lambda A: A.rand_augment_transform("rand-m9-n2-mstd0.5-t3aw", {})}


@pytest.mark.parametrize("config", list(TIMM))
def test_timms_draws_are_its_policys_own(config):
    """timm's RandAugment and AutoAugment (numpy's choice of operations,
    Python's draws in each operation, a bilinear or bicubic filter drawn
    per geometric operation): PIL's result of coordl's draws on a real crop
    is timm's own, with torch's, Python's and numpy's generators left as
    its call leaves them; where timm's call fails (its posterize at 0 bits,
    which this PIL refuses), so does coordl's draw, with PIL's error."""
    A = _timm_aa()
    t = TIMM[config](A)
    p = tvcompat.policy_of(t)
    assert p is not None and p.draws_agree() and p.draws_numpy
    kinds = set()
    for ops in _same_draws(t, p, _probe_image(2, 30, 40), range(200)):
        ops = [o for c, v in ops for o in ([o for chain in v[2] for o in chain] if c == C.TIMM_AUGMIX else
                                           [(c, v)])]      # timm's AugMix: its chains' operations
        kinds |= {c for c, _ in ops}
        kinds |= {v[7] for c, v in ops if c == C.AFFINE}
    assert len(kinds) >= (3 if config == "3a" else 8), kinds


def test_timms_operations_the_device_does_not_run_keep_the_policy_as_written(monkeypatch):
    """An operation outside those the device runs (here, timm's
    Desaturate taken out of them) keeps the policy as written; one whose
    blur asks PIL for two radii is refused at its draw."""
    A = _timm_aa()
    assert tvcompat.policy_of(A.rand_augment_transform("rand-m9-mstd0.5", {})) is not None
    assert tvcompat.policy_of(A.RandAugment([A.AugmentOp("GaussianBlur", magnitude=5)])) is not None
    monkeypatch.setattr(tvcompat, "_TIMM_OTHERS", tvcompat._TIMM_OTHERS - {"desaturate"})
    assert tvcompat.policy_of(A.RandAugment([A.AugmentOp("Desaturate", magnitude=5)])) is None
    from PIL import ImageFilter

    with pytest.raises(ValueError, match="blurs with radii"):
        tvcompat._pil_blur_op(("filter", ImageFilter.GaussianBlur((1.0, 2.0))), "GaussianBlur")


@pytest.mark.parametrize("config,workers", [("rand-m7-mstd0.5", 2), ("original", 0), ("3a", 2),
                                            ("augmix-m3-w3", 0)])
def test_the_device_runs_timms_policy_on_its_rows_as_the_cpu_path(photos, cpu_device, config, workers):
    """Bit for bit: timm's policy on the device's own geometry's rows is
    PIL's operations of each sample's draws (numpy's and Python's
    generators seeded from the sample's) on those rows."""
    A = _timm_aa()
    steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
    got, want, L, drawn = _geometry_then_policy(photos, steps, TIMM[config](A), workers)
    for (a, y), (b, y2) in zip(got, want):
        assert a.dtype == torch.uint8 and torch.equal(y, y2) and torch.equal(a, b)
    if config.startswith("augmix"):      # one mix a sample: its chains' operations differ
        drawn = [[o for chain in ops[0][1][2] for o in chain] for ops in drawn]
    assert len({tuple(c for c, _ in ops) for ops in drawn}) >= (3 if config == "3a" else 5)
    assert L.stats().device_decode_images == 24


@pytest.mark.parametrize("aa", ["rand-m9-mstd0.5", "original", "3a", "augmix-m3-w3"])
def test_timms_training_transform_with_auto_augment_runs_on_the_device(photos, cpu_device, exact, aa):
    """``create_transform(..., is_training=True, auto_augment=...)``, only
    the import changed plus the option: the same labels, the rows the CPU
    path's up to what the operations make of the geometry's level."""
    _timm_aa()
    from timm.data import create_transform

    ds = datasets.ImageFolder(photos, transform=create_transform(24, is_training=True, auto_augment=aa))
    d, L = _levels_against_the_cpu_path(ds, 3)
    assert float((d > 1 + 1e-3).float().mean()) < 0.06 and float(d.mean()) < 1.0, (float(d.mean()), float(
        (d > 1 + 1e-3).float().mean()))
    assert L.stats().device_decode_images == len(ds) and "Augment" in L.stats().device_decode


def test_timms_augmix_the_device_cannot_run_is_not_taken_and_a_wrong_mix_gives_way(monkeypatch):
    """timm's blended AugMix (other arithmetic) and one whose chains need
    more fields than a record's slots: not taken.  A device mix made wrong
    fails its first-use check, and its rows run through the CPU path's code
    (PIL's and numpy's arithmetic: the right mix still)."""
    A = _timm_aa()
    assert tvcompat.policy_of(A.augment_and_mix_transform("augmix-m3-w3-b1", {})) is None
    assert tvcompat.policy_of(A.augment_and_mix_transform("augmix-m3-w4", {})) is None
    assert tvcompat.policy_of(A.augment_and_mix_transform("augmix-m3-w4-d2", {})).affines <= E.MAX_AFFINES
    real = J.DeviceJitter._timm_mix
    monkeypatch.setattr(J.DeviceJitter, "_timm_mix", lambda self, x, values: real(self, x, values).clamp_(max=250))
    dj = J.DeviceJitter(torch.device("cpu"))
    y = _rows(7, 5, 12, 16)
    ops = [[(C.TIMM_AUGMIX, C._PROBE_VALUES[C.TIMM_AUGMIX][r % 4])] for r in range(5)]
    got = dj(y.clone(), ops)
    assert dj._exact[J._KIND[C.TIMM_AUGMIX]] is False
    for r, want in enumerate(_pils(y, ops)):
        assert np.array_equal(got[r].numpy(), want), r
    monkeypatch.setattr(J.DeviceJitter, "_timm_mix", real)
    assert J.DeviceJitter(torch.device("cpu")).exact(J._KIND[C.TIMM_AUGMIX])


def test_timms_policy_batch_reads_and_resume(photos, cpu_device):
    A = _timm_aa()
    tf = V.Compose([V.RandomResizedCrop(16), V.RandomHorizontalFlip(), TIMM["rand-m7-mstd0.5"](A), V.ToTensor()])
    runs = check_batch_reads_and_resume(datasets.ImageFolder(photos, transform=tf), batch_size=3, seed=11,
                                        shuffle=True, device="cpu", decode="device")
    assert len(runs) == 8


def test_filtered_affine_maps_in_chunks_are_each_rows_own(monkeypatch):
    """More rows than a bilinear or bicubic map takes at a time, mixed with
    nearest ones: each row is PIL's for its own map."""
    monkeypatch.setattr(P, "_FILTER_ROWS", 2)
    y = _rows(9, 7, 10, 12)
    ops = [(C.AFFINE, (1.0, 0.1 * r, 0.5, -0.05 * r, 1.0, 0.25, (r, 2 * r, 3 * r), (0, 2, 3)[r % 3]))
           for r in range(7)]
    got = P.apply(y, C.AFFINE, [v for _, v in ops])
    for r, want in enumerate(_pils(y, [[op] for op in ops])):
        assert np.array_equal(got[r].numpy(), want), r


# ---------------------------------------------------------------- one-operation random steps
RANDOM_OPS = {"RandomPosterize": {"bits": 2}, "RandomSolarize": {"threshold": 128.5},
              "RandomAdjustSharpness": {"sharpness_factor": 1.8}, "RandomAutocontrast": {}, "RandomEqualize": {},
              "RandomInvert": {}}


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_one_operation_random_steps_are_drawn_apart_and_agree(version):
    """torchvision's RandomPosterize, RandomSolarize, RandomAdjustSharpness,
    RandomAutocontrast, RandomEqualize, RandomInvert: each drawn apart from
    its call (its one ``torch.rand(1) < p``), PIL's result of the draw the
    user's own, on some samples and not others."""
    M = VERSIONS[version]
    img = _probe_image(4, 20, 24)
    for name, kw in RANDOM_OPS.items():
        t = getattr(M, name)(p=0.5, **kw)
        mine = tvcompat.random_op_of(t)
        assert mine is not None and mine.draws_agree(), name
        applied = sum(bool(ops) for ops in _same_draws(t, mine, img, range(24)))
        assert 0 < applied < 24, name


@pytest.mark.parametrize("version,workers", [("v1", 2), ("v2", 0)])
def test_one_operation_random_steps_run_on_the_device_as_the_cpu_path(photos, cpu_device, version, workers):
    """All six in one pipeline (the self-supervised recipes' solarization
    among them): the device's rows bit for bit PIL's operations of each
    sample's draws on those rows; then the device split, bit for bit the
    CPU path."""
    M = VERSIONS[version]
    ops = M.Compose([getattr(M, name)(p=0.5, **kw) for name, kw in RANDOM_OPS.items()])
    steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
    got, want, L, drawn = _geometry_then_policy(photos, steps, ops, workers)
    for (a, y), (b, y2) in zip(got, want):
        assert torch.equal(y, y2) and torch.equal(a, b)
    assert len({len(o) for o in drawn}) >= 3 and "RandomSolarize" in L.stats().device_decode
    tf = V.Compose([V.RandomResizedCrop(20), ops, V.ToTensor(), V.Normalize(MEAN, STD)])
    _split_is_the_cpu_paths(datasets.ImageFolder(photos, transform=tf), "RandomInvert", workers)


# ---------------------------------------------------------------- GaussianBlur
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_blur_on_the_gpus_way_is_within_a_level_on_a_few_values(version):
    """A GPU blurs a batch's rows in one grouped convolution in double
    precision with the CPU path's own float32 kernels; against torchvision's
    single-precision convolution on the CPU a value on a rounding boundary
    can come out a level apart: at most 1 level, on a few values in a
    million (docs/guide/gpu.md); on the CPU the device's rows are
    torchvision's own (its kernel, row by row)."""
    torch.manual_seed(0)
    y = torch.randint(0, 256, (6, 3, 64, 80), dtype=torch.uint8)
    y[3:] = y[3:] // 40 * 40                                   # flat regions: sums near halves
    v2 = int(version == "v2")
    values = [(23, 23, 0.1 + 0.35 * r, 0.1 + 0.35 * r, v2) for r in range(5)] + [(5, 9, 0.8, 1.7, v2)]
    want = np.stack(_pils(y, [[(C.BLUR, v)] for v in values]))
    assert np.array_equal(P._blur(y, values).numpy(), want)
    d = np.abs(P._blur(y, values, grouped=True).numpy().astype(int) - want)
    assert d.max() <= 1 and (d > 0).mean() < 1e-3, (d.max(), (d > 0).mean())


@pytest.mark.parametrize("version,workers", [("v1", 0), ("v2", 2)])
def test_a_random_gaussian_blur_runs_on_the_device_as_the_cpu_path(photos, cpu_device, version, workers):
    """``RandomApply([GaussianBlur(...)], p)`` (timm's
    ``gaussian_blur_prob``), and a ``GaussianBlur`` alone: drawn in the
    worker, blurred on the device; on the CPU stand-in bit for bit
    torchvision's blur of each sample's draws on the device's rows."""
    M = VERSIONS[version]
    steps = [V.RandomResizedCrop(32, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
    for step in (M.RandomApply([M.GaussianBlur(23, sigma=(0.1, 2.0))], p=0.5), M.GaussianBlur((3, 7), (0.5, 1.5))):
        got, want, L, drawn = _geometry_then_policy(photos, steps, step, workers)
        for (a, y), (b, y2) in zip(got, want):
            assert torch.equal(y, y2) and torch.equal(a, b)
        assert type(step).__name__ in L.stats().device_decode
        if type(step).__name__ == "RandomApply":      # blurred on some samples, not on others
            assert 0 < sum(bool(ops) for ops in drawn) < len(drawn)


def test_timms_gaussian_blur_prob_runs_on_the_device(photos, cpu_device, exact):
    """``create_transform(..., gaussian_blur_prob=...)``, only the import
    changed plus the option: the same labels, the rows within what the
    blur makes of the geometry's level."""
    pytest.importorskip("timm", reason="timm is not installed (pip install timm)")
    from timm.data import create_transform

    ds = datasets.ImageFolder(photos, transform=create_transform(24, is_training=True, gaussian_blur_prob=0.5))
    d, L = _levels_against_the_cpu_path(ds, 3)
    assert float(d.max()) <= 8 + 1e-3 and float(d.mean()) < 0.5, (float(d.max()), float(d.mean()))
    assert "RandomApply" in L.stats().device_decode and L.stats().device_decode_images == len(ds)


def test_the_blurs_first_use_check_takes_its_tolerance_over_all_the_probes(monkeypatch):
    """The GPU's way of blurring (run here on the CPU) passes the kind's
    check: within a level on a few values counted over all the probes, not
    failed by one value of a tiny probe; a blur off by two levels fails it
    and its rows run through the CPU path's code."""
    real = P._blur
    monkeypatch.setattr(P, "_blur", lambda x, values, grouped=None: real(x, values, grouped=True))
    assert J.DeviceJitter(torch.device("cpu")).exact(J._KIND[C.BLUR])
    monkeypatch.setattr(P, "_blur", lambda x, values, grouped=None: real(x, values).clamp_(max=253).add_(2))
    dj = J.DeviceJitter(torch.device("cpu"))
    y = _rows(3, 5, 12, 16)
    ops = [[(C.BLUR, (5, 5, 1.1, 1.1, 0))]] * 5
    got = dj(y.clone(), ops)
    assert dj._exact[J._KIND[C.BLUR]] is False
    for r, want in enumerate(_pils(y, ops)):
        assert np.array_equal(got[r].numpy(), want), r


# ---------------------------------------------------------------- AugMix
from coordl.decode import augmix as AM  # noqa: E402

AUGMIX = {"default": lambda M: M.AugMix(),
          "wide": lambda M: M.AugMix(severity=7, mixture_width=4, chain_depth=2, alpha=0.5),
          "nearest": lambda M: M.AugMix(all_ops=False, interpolation=M.InterpolationMode.NEAREST, chain_depth=3)}


def test_augmix_draws_travel_in_a_records_fields():
    """A value's fields give it back; one that does not fit (five chains of
    three), or a number that is not a float32, is refused."""
    for v in C._PROBE_VALUES[C.AUGMIX]:
        fields = AM.pack(v)
        assert len(fields) == AM.FIELDS and AM.unpack(fields) == v
        rec = E.tail_fields(0, [(C.BRIGHTNESS, 1.5), (C.AUGMIX, v)])
        assert E.ops_of([0] * E.INDEX + rec) == [(C.BRIGHTNESS, 1.5), (C.AUGMIX, v)]
    five = (0, 1, 0.5, (0.1,) * 5, (((0, 0.25),) * 3,) * 5)
    with pytest.raises(ValueError, match="more than a record carries"):
        AM.pack(five)
    with pytest.raises(ValueError, match="not a float32"):
        AM.pack((0, 1, 0.1, (0.5,), (((0, 0.25),),)))
    with pytest.raises(ValueError, match="parameter slots"):
        E.tail_fields(0, [(C.AFFINE, (1.0, 0.0, 0.0, 0.0, 1.0, 0.0, None, 0))]
                      + [(C.AUGMIX, C._PROBE_VALUES[C.AUGMIX][0])] * 6)


@pytest.mark.parametrize("config", list(AUGMIX))
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_augmix_draws_are_the_users_own(version, config):
    """Over many samples: the mix of the drawn operations and weights on a
    real image is the user's AugMix's own result, torch's generator left as
    its call leaves it; every operation drawn."""
    M = VERSIONS[version]
    t = AUGMIX[config](M)
    a = tvcompat.augmix_of(t)
    assert a is not None and a.draws_agree() and a.v2 == (version == "v2")
    drawn = _same_draws(t, a, _probe_image(2, 26, 31), range(40))
    names = {AM.NAMES[op] for ops in drawn for _, v in ops for c in v[4] for op, _ in c}
    assert len(names) == (9 if config == "nearest" else 13), names


def test_augmix_the_device_cannot_run_is_not_taken():
    """A fill, more chains than a record carries, another class: not drawn
    apart, so decode="device" refuses them."""
    assert tvcompat.augmix_of(V.AugMix(fill=[1, 2, 3])) is None
    assert tvcompat.augmix_of(V2.AugMix(fill=7)) is None
    assert tvcompat.augmix_of(V.AugMix(mixture_width=5)) is None
    assert tvcompat.augmix_of(V.AugMix(mixture_width=4, chain_depth=-1)) is None
    assert tvcompat.augmix_of(V.TrivialAugmentWide()) is None
    assert tvcompat.augmix_of(V2.AugMix(mixture_width=4, chain_depth=2)) is not None


def test_augmix_batched_is_each_rows_own():
    """The rows of a batch, each with its own draws (those drawing one
    operation at a step taken together), are each row's mix alone; and on
    images whose grey sum passes 2**24 (the contrast's mean taken a row at a
    time) too."""
    values = list(C._PROBE_VALUES[C.AUGMIX])
    for h, w, n in ((13, 17, 12), (260, 259, 3)):
        y = _rows(h, max(n, 5), h, w)[:n] if n >= 5 else _rows(h, 5, h, w)[:n]
        vals = [values[r % len(values)] for r in range(n)]
        if n == 3:    # the same version, mode and width: one group, contrast at the same step
            vals = [values[0]] * 3
        got = AM.apply(y, vals)
        for r in range(n):
            assert torch.equal(got[r], AM.on_planes(y[r], vals[r])), (h, r)


def _augmix_planes(row: torch.Tensor, ops: list) -> torch.Tensor:
    """A row through torchvision's own call with each sample's draws
    replayed: PIL's image of the row through the user's AugMix."""
    return torch.from_numpy(_pils(row[None], [ops])[0].copy())


@pytest.mark.parametrize("version,workers", [("v1", 0), ("v2", 2)])
def test_the_device_runs_augmix_on_its_rows_as_the_cpu_path(photos, cpu_device, version, workers):
    """Bit for bit: the device's AugMix of its own geometry's rows is the
    mix of each sample's draws on those rows."""
    steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
    t = AUGMIX["default" if version == "v1" else "wide"](VERSIONS[version])
    got, want, L, drawn = cases.geometry_then(photos, steps, t, workers, _augmix_planes, seed=4)
    assert len(got) == len(want) == 6
    for (a, y), (b, y2) in zip(got, want):
        assert a.dtype == torch.uint8 and torch.equal(y, y2) and torch.equal(a, b)
    assert len({ops[0][1][2] for ops in drawn}) == 24        # each sample its own weights
    st = L.stats()
    assert st.device_decode_images == 24 and "AugMix" in st.device_decode


def test_augmix_batch_reads_resume_and_the_split(photos, cpu_device):
    """Batch reads and resume give the per-sample path's batches; the device
    split (decode="cpu") runs the mix on the device: the CPU path's batches
    bit for bit."""
    tf = V.Compose([V.RandomResizedCrop(16), V.RandomHorizontalFlip(), V.AugMix(), V.ToTensor(),
                    V.Normalize(MEAN, STD)])
    ds = datasets.ImageFolder(photos, transform=tf)
    assert len(check_batch_reads_and_resume(ds, batch_size=3, seed=11, shuffle=True, device="cpu",
                                            decode="device")) == 8
    _split_is_the_cpu_paths(ds, "AugMix")


def test_augmix_with_more_slotted_steps_than_a_record_carries_is_refused(photos, cpu_device):
    tf = V.Compose([V.RandomResizedCrop(16)] + [V.AugMix() for _ in range(7)] + [V.ToTensor()])
    with pytest.raises(ValueError, match=r"an AugMix counts two"):
        coordl.DataLoader(datasets.ImageFolder(photos, transform=tf), batch_size=4, device="cpu", decode="device")


def test_a_wrong_mix_fails_the_checks(monkeypatch, photos, cpu_device):
    """The mix is checked against torchvision's own AugMix: one made wrong
    (the weights doubled) fails the draws' check, and decode="device"
    refuses the step.  The device's mix is checked against the CPU's at its
    first use: where the device's differs, its rows run through the CPU
    path's code (the right mix still)."""
    real = AM._column
    monkeypatch.setattr(tvcompat, "_agree", {})
    monkeypatch.setattr(AM, "_column", lambda values, upload: real([2 * v for v in values], upload))
    assert tvcompat.augmix_of(V.AugMix()).draws_agree() is False
    tf = V.Compose([V.RandomResizedCrop(16), V.AugMix(), V.ToTensor()])
    with pytest.raises(ValueError, match=r"AugMix.*draws could not be made apart"):
        coordl.DataLoader(datasets.ImageFolder(photos, transform=tf), batch_size=4, device="cpu", decode="device")
    monkeypatch.setattr(AM, "_column", real)

    assert J.DeviceJitter(torch.device("cpu")).exact(J._KIND[C.AUGMIX])
    apply = AM.apply
    monkeypatch.setattr(AM, "apply", lambda x, values, upload=None: apply(x, values, upload) if upload is None
                        else apply(x, values, upload).clamp_(max=200))     # the device's way only
    dj = J.DeviceJitter(torch.device("cpu"))
    y = _rows(6, 5, 12, 16)
    ops = [[(C.AUGMIX, C._PROBE_VALUES[C.AUGMIX][r])] for r in range(5)]
    want = _pils(y, ops)
    got = dj(y.clone(), ops)
    assert dj._exact[J._KIND[C.AUGMIX]] is False
    for r in range(5):
        assert np.array_equal(got[r].numpy(), want[r]), r


# ---------------------------------------------------------------- RandomRotation, RandomAffine after the crop
GEOMETRIC = {"rotation": lambda M: M.RandomRotation(25),
             "rotation_bilinear": lambda M: M.RandomRotation((-40, 10), interpolation=M.InterpolationMode.BILINEAR,
                                                             fill=[200, 10, 90]),
             "affine": lambda M: M.RandomAffine(15, translate=(0.1, 0.1), scale=(0.9, 1.1), shear=8),
             "affine_bicubic": lambda M: M.RandomAffine(0, shear=(-10, 10, -5, 5), fill=30,
                                                        interpolation=M.InterpolationMode.BICUBIC),
             "perspective": lambda M: M.RandomPerspective(0.6, p=0.7),
             "perspective_nearest": lambda M: M.RandomPerspective(interpolation=M.InterpolationMode.NEAREST,
                                                                  fill=[5, 250, 9], p=1.0)}


@pytest.mark.parametrize("step", list(GEOMETRIC))
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_rotations_and_affine_maps_are_drawn_as_the_users_own(version, step):
    """The user's own object draws, on a pixel-less image; PIL's affine map
    of what it asked for is its result on a real image, torch's generator
    left as its call leaves it; each sample its own map."""
    t = GEOMETRIC[step](VERSIONS[version])
    g = tvcompat.geometric_of(t)
    assert g is not None and g.draws_agree() and g.v2 == (version == "v2")
    drawn = _same_draws(t, g, _probe_image(3, 28, 35), range(30))
    code = C.PERSPECTIVE if "perspective" in step else C.AFFINE
    maps = [ops for ops in drawn if ops]
    assert all(ops[0][0] == code for ops in maps) and len({ops[0][1] for ops in maps}) == len(maps)
    assert len(maps) == 30 if "perspective" not in step else 10 < len(maps) < 30 or step.endswith("nearest")


def test_rotations_and_affine_maps_the_device_cannot_run_are_not_taken(photos, cpu_device):
    """An expanding rotation (another size), a fill by type, an elastic
    transform: run as written, so decode="device" refuses them, naming
    them."""
    from torchvision import tv_tensors

    assert tvcompat.geometric_of(V.RandomRotation(10, expand=True)) is None
    assert tvcompat.geometric_of(V2.RandomAffine(10, fill={tv_tensors.Image: 3, "others": 0})) is None
    assert tvcompat.geometric_of(V2.RandomPerspective(fill={tv_tensors.Image: 3, "others": 0})) is None
    assert tvcompat.geometric_of(V2.ElasticTransform()) is None
    tf = V.Compose([V.RandomResizedCrop(16), V.RandomRotation(10, expand=True), V.ToTensor()])
    with pytest.raises(ValueError, match=r"steps RandomRotation run as written"):
        coordl.DataLoader(datasets.ImageFolder(photos, transform=tf), batch_size=4, device="cpu", decode="device")


@pytest.mark.parametrize("version,step,workers", [("v1", "rotation", 0), ("v2", "rotation_bilinear", 2),
                                                  ("v1", "affine", 2), ("v2", "affine_bicubic", 0),
                                                  ("v1", "perspective", 2), ("v2", "perspective_nearest", 0)])
def test_the_device_rotates_its_rows_as_pil(photos, cpu_device, version, step, workers):
    """Bit for bit: the device's map of its own geometry's rows is PIL's
    transform of each sample's recorded call."""
    steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
    t = GEOMETRIC[step](VERSIONS[version])
    got, want, L, drawn = _geometry_then_policy(photos, steps, t, workers)
    for (a, y), (b, y2) in zip(got, want):
        assert torch.equal(y, y2) and torch.equal(a, b)
    maps = [ops for ops in drawn if ops]
    assert len({ops[0][1] for ops in maps}) == len(maps) > 12 and type(t).__name__ in L.stats().device_decode


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_tutorial_recipe_with_a_rotation_runs_on_the_device_and_the_split(photos, cpu_device, exact, version):
    """``RandomResizedCrop``, flip, ``RandomRotation(15)``, ``ToTensor``,
    ``Normalize``: with decode="device" the CPU path's rows up to the
    geometry's level (a map moves pixels, it does not change them); with
    the device split the CPU path's batches bit for bit."""
    M = VERSIONS[version]
    conv = [M.ToTensor()] if version == "v1" else [M.ToImage(), M.ToDtype(torch.float32, scale=True)]
    tf = M.Compose([M.RandomResizedCrop(24), M.RandomHorizontalFlip(), M.RandomRotation(15), *conv,
                    M.Normalize(MEAN, STD)] + ([M.ToPureTensor()] if version == "v2" else []))
    ds = datasets.ImageFolder(photos, transform=tf)
    d, L = _levels_against_the_cpu_path(ds, 2)
    assert float(d.max()) <= 1 + 1e-3 and "RandomRotation" in L.stats().device_decode, float(d.max())
    _split_is_the_cpu_paths(ds, "RandomRotation")


# ---------------------------------------------------------------- RandomApply around any step drawn apart
@pytest.mark.parametrize("version,workers", [("v1", 0), ("v2", 2)])
def test_a_random_apply_around_steps_drawn_apart_runs_on_the_device(photos, cpu_device, version, workers):
    """``RandomApply([RandomRotation(...)])`` and ``RandomApply([ColorJitter,
    RandomGrayscale, RandomSolarize])``: the wrapper's draw, then each inner
    step's, in the worker; on the device bit for bit PIL's operations of
    each sample's draws, none where it did not apply; the split the CPU
    path's batches."""
    M = VERSIONS[version]
    rot = M.RandomApply([M.RandomRotation(20, interpolation=M.InterpolationMode.BILINEAR)], p=0.5)
    many = M.RandomApply([M.ColorJitter(0.4, 0.4, 0.4, 0.1), M.RandomGrayscale(0.5), M.RandomSolarize(128, p=0.5)],
                         p=0.7)
    for step in (rot, many):
        r = tvcompat.random_apply_of(step)
        assert r is not None and r.draws_agree() and len(r.inners) == len(step.transforms)
        assert r.most == sum(getattr(i, "most", 4) for i in r.inners)
        steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
        got, want, L, drawn = _geometry_then_policy(photos, steps, step, workers)
        for (a, y), (b, y2) in zip(got, want):
            assert torch.equal(y, y2) and torch.equal(a, b)
        assert 0 < sum(bool(ops) for ops in drawn) < len(drawn) and "RandomApply" in L.stats().device_decode
    tf = M.Compose([M.RandomResizedCrop(20), M.RandomHorizontalFlip(), rot, M.ToTensor() if version == "v1" else
                    M.ToImage(), *([M.ToDtype(torch.float32, scale=True)] if version == "v2" else []),
                    M.Normalize(MEAN, STD)] + ([M.ToPureTensor()] if version == "v2" else []))
    _split_is_the_cpu_paths(datasets.ImageFolder(photos, transform=tf), "RandomApply", workers)


def test_a_random_apply_around_a_step_the_device_cannot_run_is_refused(photos, cpu_device):
    assert tvcompat.random_apply_of(V.RandomApply([V.ElasticTransform()], p=0.5)) is None
    assert tvcompat.random_apply_of(V.RandomApply([V.ColorJitter(0.2), V.ElasticTransform()], p=0.5)) is None
    tf = V.Compose([V.RandomResizedCrop(16), V.RandomApply([V.ElasticTransform(sigma=1.0)], p=0.5), V.ToTensor()])
    with pytest.raises(ValueError, match=r"steps RandomApply run as written"):
        coordl.DataLoader(datasets.ImageFolder(photos, transform=tf), batch_size=4, device="cpu", decode="device")


# ---------------------------------------------------------------- RandomChoice, RandomOrder
CHOICES = {"choice": lambda M: M.RandomChoice([M.RandomRotation(15), M.ColorJitter(0.4, 0.4, 0.4, 0.1),
                                               M.RandomSolarize(100, p=1.0)], p=[0.5, 0.3, 0.2]),
           "order": lambda M: M.RandomOrder([M.RandomGrayscale(0.5), M.RandomAffine(0, shear=10), M.RandomInvert(0.5)])}


@pytest.mark.parametrize("kind", list(CHOICES))
@pytest.mark.parametrize("version,workers", [("v1", 2), ("v2", 0)])
def test_random_choice_and_order_are_drawn_apart_and_run_on_the_device(photos, cpu_device, version, workers, kind):
    """The container's own draw (v1: Python's generator; v2: torch's), then
    the chosen step's, or each step's in the drawn order: PIL's result of
    the draws is the user's own on a real image, the generators left as its
    call leaves them; on the device bit for bit those operations on the
    device's rows."""
    M = VERSIONS[version]
    t = CHOICES[kind](M)
    c = tvcompat.choice_of(t)
    assert c is not None and c.draws_agree() and c.draws_python == (version == "v1")
    firsts = {tuple(code for code, _ in ops) for ops in _same_draws(t, c, _probe_image(4, 26, 30), range(40))}
    assert len(firsts) >= 3, firsts
    steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
    got, want, L, drawn = _geometry_then_policy(photos, steps, t, workers)
    for (a, y), (b, y2) in zip(got, want):
        assert torch.equal(y, y2) and torch.equal(a, b)
    assert type(t).__name__ in L.stats().device_decode
    if version == "v1":       # Python's generator seeded in the worker as the CPU path seeds it: its batches
        tf = V.Compose([V.RandomResizedCrop(20), t, V.ToTensor(), V.Normalize(MEAN, STD)])
        _split_is_the_cpu_paths(datasets.ImageFolder(photos, transform=tf), type(t).__name__, workers)


@pytest.mark.parametrize("version,workers", [("v1", 0), ("v2", 2)])
def test_a_three_channel_grayscale_runs_on_the_device(photos, cpu_device, version, workers):
    """``Grayscale(num_output_channels=3)`` before the conversion: PIL's grey
    image on three planes, computed on the device (a colour operation at
    0); the CPU path's batches with the device split, bit for bit; a
    one-channel ``Grayscale`` still refused."""
    M = VERSIONS[version]
    g = tvcompat.gray_of(M.Grayscale(3))
    assert g is not None and g.draws_agree() and tvcompat.gray_of(M.Grayscale(1)) is None
    steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
    got, want, L, drawn = _geometry_then_policy(photos, steps, M.Grayscale(3), workers)
    for (a, y), (b, y2) in zip(got, want):
        assert torch.equal(y, y2) and torch.equal(a, b) and torch.equal(a[:, 0], a[:, 2])
    assert all(ops == [(C.SATURATION, 0.0)] for ops in drawn) and "Grayscale" in L.stats().device_decode
    tf = V.Compose([V.RandomResizedCrop(20), M.Grayscale(3), V.ToTensor(), V.Normalize(MEAN, STD)])
    _split_is_the_cpu_paths(datasets.ImageFolder(photos, transform=tf), "Grayscale", workers)
    tf1 = V.Compose([V.RandomResizedCrop(20), M.Grayscale(1), V.ToTensor()])
    with pytest.raises(ValueError, match=r"steps Grayscale, ToTensor run as written"):
        coordl.DataLoader(datasets.ImageFolder(photos, transform=tf1), batch_size=4, device="cpu", decode="device")


@pytest.mark.parametrize("name,workers", [("RandomPhotometricDistort", 2), ("RandomChannelPermutation", 0)])
def test_v2s_photometric_distort_and_channel_permutation_run_on_the_device(photos, cpu_device, name, workers):
    """torchvision v2's ``RandomPhotometricDistort`` (SSD's) and
    ``RandomChannelPermutation``: the user's own draws, PIL's result of
    their operations the user's own on a real image; on the device bit for
    bit those operations on the device's rows; the split the CPU path's
    batches."""
    t = getattr(V2, name)()
    ph = tvcompat.photometric_of(t)
    assert ph is not None and ph.draws_agree()
    assert tvcompat.photometric_of(V2.ColorJitter(0.1)) is None
    drawn = _same_draws(t, ph, _probe_image(5, 22, 27), range(40))
    assert any(ops and ops[-1][0] == C.PERMUTE for ops in drawn)
    assert len({tuple(map(tuple, d)) for d in drawn}) >= (6 if name == "RandomChannelPermutation" else 20)
    steps = [V.RandomResizedCrop(20, scale=(0.3, 1.0)), V.RandomHorizontalFlip(), V.PILToTensor()]
    got, want, L, drawn = _geometry_then_policy(photos, steps, t, workers)
    for (a, y), (b, y2) in zip(got, want):
        assert torch.equal(y, y2) and torch.equal(a, b)
    assert name in L.stats().device_decode
    tf = V2.Compose([V2.RandomResizedCrop(20), t, V2.ToImage(), V2.ToDtype(torch.float32, scale=True),
                     V2.Normalize(MEAN, STD), V2.ToPureTensor()])
    _split_is_the_cpu_paths(datasets.ImageFolder(photos, transform=tf), name, workers)


# ---------------------------------------------------------------- given a tensor (backend="tensor")
ON_TENSOR = {"ta_wide": lambda M: M.TrivialAugmentWide(), "ra": lambda M: M.RandAugment(num_ops=3),
             "imagenet": lambda M: M.AutoAugment(),
             "svhn_bilinear": lambda M: M.AutoAugment(M.AutoAugmentPolicy.SVHN,
                                                      interpolation=M.InterpolationMode.BILINEAR),
             "augmix": lambda M: M.AugMix(interpolation=M.InterpolationMode.BILINEAR)}


def _on_tensor(x: torch.Tensor, ops: list) -> torch.Tensor:
    """uint8 planes through a step's drawn operations (AUGMIX values)."""
    for code, value in ops:
        assert code == C.AUGMIX
        x = AM.on_planes(x, value)
    return x


@pytest.mark.parametrize("policy", list(ON_TENSOR))
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_policy_given_a_tensor_draws_as_the_users_own(version, policy):
    """Given the uint8 tensor (the reference preset's ``backend="tensor"``),
    the user's policy's result is torchvision's tensor functions of the
    drawn operations, torch's generator left as its call leaves it; every
    operation of the policy drawn over the samples (Invert too, Identity as
    no operation)."""
    M = VERSIONS[version]
    t = ON_TENSOR[policy](M)
    p = tvcompat.tensor_step_of(t)
    assert p is not None and p.draws_agree() and p.v2 == (version == "v2")
    assert tvcompat.tensor_step_of(p) is p and p.affines == 2 and p.most == 1
    x = torch.from_numpy(np.array(_probe_image(3, 27, 33))).permute(2, 0, 1).contiguous()
    names, empty = set(), 0
    for seed in range(120):
        tvcompat._seed_all(seed)
        want = t(x.clone())
        after = tvcompat._all_states()
        tvcompat._seed_all(seed)
        ops = p.draw((27, 33))
        now = tvcompat._all_states()
        assert torch.equal(now[0], after[0]) and now[1:] == after[1:], seed
        assert torch.equal(_on_tensor(x, ops), want.as_subclass(torch.Tensor)), (seed, ops)
        empty += not ops
        names |= {AM.NAMES[op] for _, v in ops for c in v[4] for op, _ in c}
    assert len(names) >= (8 if "imagenet" in policy or "svhn" in policy else 11), names
    if policy == "imagenet":
        assert "Invert" in names
    if policy == "ta_wide":
        assert empty > 0           # Identity drawn: no operation


def test_a_policy_given_a_tensor_the_device_cannot_run_is_not_taken():
    """Bicubic (torchvision's own tensor functions refuse it), a fill, more
    operations a call than a record's value carries, a ColorJitter: not
    taken, so decode="device" refuses them."""
    assert tvcompat.tensor_step_of(V.TrivialAugmentWide(interpolation=V.InterpolationMode.BICUBIC)) is None
    assert tvcompat.tensor_step_of(V2.RandAugment(fill=[1, 2, 3])) is None
    assert tvcompat.tensor_step_of(V.AutoAugment(fill=4)) is None
    assert tvcompat.tensor_step_of(V.AugMix(fill=[1, 2, 3])) is None and tvcompat.tensor_step_of(V2.AugMix(fill=7)) is None
    assert tvcompat.tensor_step_of(V2.AugMix()) is not None
    assert tvcompat.tensor_step_of(V.RandAugment(num_ops=13)) is None
    assert tvcompat.tensor_step_of(V.RandAugment(num_ops=12)) is not None
    assert tvcompat.tensor_step_of(V2.RandAugment(num_ops=0)).draw((8, 8)) == []
    assert tvcompat.tensor_step_of(V.ColorJitter(0.3)) is None
    assert tvcompat.tensor_step_of(V.RandomRotation(5)) is None


def _tensor_preset(M, step, erase: float = 0.0, interp=None):
    """torchvision's reference classification preset with
    ``backend="tensor"``: PILToTensor first, then the crop (antialiased),
    flip, ``step``, the conversion to float, Normalize, RandomErasing, and
    v2's ToPureTensor."""
    interp = interp or M.InterpolationMode.BILINEAR
    conv = M.ToDtype(torch.float, scale=True) if M is V2 else M.ConvertImageDtype(torch.float)
    steps = [M.PILToTensor(), M.RandomResizedCrop(24, interpolation=interp, antialias=True),
             M.RandomHorizontalFlip(0.5)] + ([step] if step is not None else []) + [conv, M.Normalize(MEAN, STD)]
    steps += [M.RandomErasing(erase)] if erase else []
    return M.Compose(steps + ([M.ToPureTensor()] if M is V2 else []))


@pytest.mark.parametrize("version,policy,workers", [("v1", "ta_wide", 0), ("v2", "ta_wide", 2), ("v1", "ra", 2),
                                                    ("v2", "imagenet", 0), ("v1", "svhn_bilinear", 2),
                                                    ("v2", "augmix", 0), ("v1", "augmix", 2)])
def test_the_device_runs_a_policy_given_a_tensor_on_its_rows_as_torchvision(photos, cpu_device, version, policy,
                                                                           workers):
    """Bit for bit: the device's policy of its own geometry's rows (the
    crop of the tensor) is torchvision's tensor functions of each sample's
    draws on those rows."""
    M = VERSIONS[version]
    steps = [M.PILToTensor(), M.RandomResizedCrop(20, scale=(0.3, 1.0), antialias=True), M.RandomHorizontalFlip(),
             M.ToDtype(torch.uint8) if version == "v2" else M.ConvertImageDtype(torch.uint8)]
    t = ON_TENSOR[policy](M)
    got, want, L, drawn = cases.geometry_then(photos, steps, t, workers, _on_tensor, seed=6)
    assert len(got) == len(want) == 6
    for (a, y), (b, y2) in zip(got, want):
        assert a.dtype == torch.uint8 and torch.equal(y, y2) and torch.equal(a, b)
    assert len({str(ops) for ops in drawn}) >= 12
    st = L.stats()
    assert st.device_decode_images == 24 and type(t).__name__ in st.device_decode


@pytest.mark.parametrize("version,policy", [("v1", "ta_wide"), ("v2", "ra"), ("v1", "imagenet"), ("v2", "augmix")])
def test_the_reference_preset_with_backend_tensor_runs_on_the_device(photos, cpu_device, exact, version, policy):
    """The reference preset with ``--backend tensor`` and ``--auto-augment``
    and random erasing, only the import changed plus the option: the same
    labels, the rows the CPU path's up to what the operations make of the
    decode's rounding, on a few values."""
    M = VERSIONS[version]
    ds = datasets.ImageFolder(photos, transform=_tensor_preset(M, ON_TENSOR[policy](M), erase=0.5))
    d, L = _levels_against_the_cpu_path(ds, 7)
    assert float((d > 1 + 1e-3).float().mean()) < 0.06 and float(d.mean()) < 1.0, (float(d.mean()), float(
        (d > 1 + 1e-3).float().mean()))
    st = L.stats()
    assert st.device_decode_images == len(ds) and "RandomErasing" in st.device_decode


def test_a_policy_given_a_tensor_batch_reads_and_resume(photos, cpu_device):
    ds = datasets.ImageFolder(photos, transform=_tensor_preset(V2, V2.TrivialAugmentWide()))
    assert len(check_batch_reads_and_resume(ds, batch_size=3, seed=11, shuffle=True, device="cpu",
                                            decode="device")) == 8


def test_a_policy_given_a_tensor_that_torchvision_refuses_is_refused_naming_the_fix(photos, cpu_device):
    """Bicubic on a tensor fails in torchvision itself; a fill on the device
    is not run: decode="device" refuses when the loader is built, saying
    which policies it runs given a tensor."""
    for t in (V.TrivialAugmentWide(interpolation=V.InterpolationMode.BICUBIC), V.RandAugment(fill=[1, 2, 3])):
        tf = _tensor_preset(V, t)
        with pytest.raises(ValueError, match=r"run as written.*given a tensor \(PILToTensor before them\).*nearest "
                                             r"or bilinear"):
            coordl.DataLoader(datasets.ImageFolder(photos, transform=tf), batch_size=4, device="cpu",
                              decode="device")


def test_analyze_recommends_decoding_on_the_gpu_for_the_preset_with_backend_tensor(photos, monkeypatch):
    from coordl.analyze import recommend
    from coordl.tvcompat import adapt

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ds, _ = adapt(datasets.ImageFolder(photos, transform=_tensor_preset(V, V.TrivialAugmentWide())))
    [rec] = recommend({"largest": "prep"}, ds)
    assert rec["applies"] and rec["option"] == "decode='device'"
    assert "RandomResizedCrop + RandomHorizontalFlip + TrivialAugmentWide -> 24x24" in rec["why"], rec


def test_a_policy_given_torchvisions_image_runs_on_the_device(photos, cpu_device, exact):
    """v2's ``ToImage()`` before the crop (a ``tv_tensors.Image``, without a
    ``ToPureTensor`` at the end): the policy's draws and operations are a
    plain tensor's, and the batches the CPU path's up to the decode's
    rounding."""
    tf = V2.Compose([V2.ToImage(), V2.RandomResizedCrop(24, antialias=True), V2.RandomHorizontalFlip(),
                     V2.TrivialAugmentWide(interpolation=V2.InterpolationMode.BILINEAR),
                     V2.ToDtype(torch.float32, scale=True), V2.Normalize(MEAN, STD)])
    d, L = _levels_against_the_cpu_path(datasets.ImageFolder(photos, transform=tf), 3)
    assert float((d > 1 + 1e-3).float().mean()) < 0.06 and float(d.mean()) < 1.0
    assert "TrivialAugmentWide" in L.stats().device_decode


@pytest.mark.parametrize("version,policy,erase", [("v1", "ta_wide", 0.0), ("v2", "augmix", 0.0), ("v2", "ra", 0.5)])
def test_the_device_split_of_a_policy_given_a_tensor_is_the_cpu_paths(photos, cpu_device, version, policy, erase):
    """With ``decode="cpu"`` and a device, the preset with ``--backend
    tensor`` splits: the worker crops the tensor and draws the policy, the
    device runs it and converts (and erases): the CPU path's batches, bit
    for bit."""
    M = VERSIONS[version]
    t = ON_TENSOR[policy](M)
    _split_is_the_cpu_paths(datasets.ImageFolder(photos, transform=_tensor_preset(M, t, erase=erase)),
                            type(t).__name__)


def test_the_device_split_of_steps_run_as_written_on_a_tensor_is_the_cpu_paths(photos, cpu_device):
    """Steps the device does not run, given the tensor (a ColorJitter on a
    tensor, torchvision's float arithmetic), run as written in the worker,
    and the uint8 image they give travels: the device converts it, bit for
    bit the CPU path's; a v2 pipeline delivering ``tv_tensors.Image`` stays
    unsplit."""
    ds = datasets.ImageFolder(photos, transform=_tensor_preset(V, V.ColorJitter(0.4, 0.4, 0.4, 0.1)))
    kw = dict(batch_size=4, seed=9, shuffle=True, num_workers=2)
    cpu = list(coordl.DataLoader(ds, **kw))
    S = coordl.DataLoader(ds, device="cpu", **kw)
    split = list(S)
    assert S.stats().device_split.startswith("split: uint8 images travel after the steps run as written")
    for (a, y), (b, y2) in zip(cpu, split):
        assert torch.equal(y, y2) and torch.equal(a, b)
    tf = V2.Compose([V2.ToImage(), V2.RandomResizedCrop(24), V2.TrivialAugmentWide(),
                     V2.ToDtype(torch.float32, scale=True), V2.Normalize(MEAN, STD)])
    S = coordl.DataLoader(datasets.ImageFolder(photos, transform=tf), device="cpu", **kw)
    assert len(list(S)) == 6 and S.stats().device_split.startswith("not split")
