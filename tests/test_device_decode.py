"""decode="device" on a machine without an accelerator: the CPU stands in
for the device (``CPU_TEST_DEVICE``) and a CPU JPEG decoder for the GPU's
(``coordl.device.decode.HostDecoder``), so the same stage runs on the same
inputs with the same parameters: the records and bytes the workers ship,
the decode, crop, resize, flip and conversion, the fallbacks, the errors,
resume and the statistics.  tests/test_cuda.py runs the real decoders."""
import collections
import io
import os
import random
import sys
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import coordl
from coordl import _rng
from coordl import transforms as T
from coordl.decode import jpeg
from coordl.device import decode as DD
from coordl.device import delivery as D
from coordl.device import encoded as E

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _datasets_for_tests import FolderTwoStage  # noqa: E402

NORM = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
# docs/guide/gpu.md, "Same semantics as the CPU path, and the tolerance": the bound against the CPU path (uint8 levels per channel value)
DECODE_MEAN, DECODE_MAX = 6.0, 96
STD255 = torch.tensor(NORM.std).view(1, 3, 1, 1) * 255
Pair = collections.namedtuple("Pair", "image label")


def _rrc(size=24, **kw):
    return T.Compose([T.RandomResizedCrop(size, **kw), T.RandomHorizontalFlip(), T.ToTensor(), NORM])


def _eval(resize=40, crop=32):
    return T.Compose([T.Resize(resize), T.CenterCrop(crop), T.ToTensor(), NORM])


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("decode", num_images=20, num_classes=2, mean_kb=6, image_size=(96, 72), seed=4)


def _levels(a, b):
    """|a - b| in uint8 levels of the image before Normalize."""
    return (a - b).abs() * STD255


def _pairs(ds, workers=0, **kw):
    kw = {"batch_size": 4, "seed": 7, "shuffle": True, "num_workers": workers, **kw}
    cpu = coordl.DataLoader(ds, **kw)
    dev = coordl.DataLoader(ds, device="cpu", decode="device", **kw)
    return list(cpu), list(dev), dev


def _files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


# ---------------------------------------------------------------- geometry
@pytest.mark.parametrize("seed,epoch", [(0, 0), (7, 3), (2 ** 40 + 5, 11)])
def test_records_carry_the_cpu_paths_crop_and_flip_for_seed_epoch_index(photos, seed, epoch):
    """The crop box and the flip each record carries are torchvision's
    draws (RandomResizedCrop.get_params, then Bernoulli(p)) from the
    sample's own generator, (seed, epoch, index): the CPU path's."""
    tf = _rrc(24, scale=(0.2, 1.0))
    ds = coordl.ImageFolder(photos, tf)
    prep = E.DecodePrep(ds, E.plan_for(tf))
    flips = set()
    for i in range(len(ds)):
        raw = ds.raw(i)
        with _rng.sample_rng(seed, epoch, i):
            (rec, target) = prep.prep(raw, i)
        (paths, _), payloads = prep.take_device_marks(), prep.take_device_payloads()
        assert paths == ((0,),) and payloads == [raw]
        H, W = jpeg.jpeg_size(raw)
        g = _rng.derive(seed, epoch, i)
        top, left, h, w = T.RandomResizedCrop.get_params((W, H), (0.2, 1.0), (3 / 4, 4 / 3), g)
        flip = g.random() < 0.5
        flips.add(flip)
        assert rec.tolist()[E.KIND:E.FLIP + 1] == [E.ON_DEVICE, H, W, top, left, h, w, 24, 24, 0, 0, 24, 24, flip]
        assert rec[E.INDEX] == i and type(rec) is torch.Tensor and target == ds.targets[i]
    assert flips == {True, False}


@pytest.mark.parametrize("name,tf", [
    ("rrc+flip", _rrc(24)),
    ("flip+rrc", T.Compose([T.RandomHorizontalFlip(), T.RandomResizedCrop(20, scale=(0.3, 0.9)), T.ToTensor(), NORM])),
    ("resize+centercrop", _eval()),
    ("resize+flip+centercrop+flip", T.Compose([T.Resize(37), T.RandomHorizontalFlip(), T.CenterCrop(30),
                                               T.RandomHorizontalFlip(0.7), T.ToTensor(), NORM])),
    ("centercrop larger than the image (padding)", T.Compose([T.Resize(30), T.CenterCrop((33, 41)), T.ToTensor()])),
    ("resize (h, w)", T.Compose([T.Resize((21, 34), interpolation=T.InterpolationMode.BICUBIC), T.ToTensor(), NORM])),
    ("resize+randomcrop", T.Compose([T.Resize(45), T.RandomHorizontalFlip(), T.RandomCrop(31), T.ToTensor(), NORM])),
    ("centercrop only, uint8", T.Compose([T.CenterCrop(50), T.RandomHorizontalFlip(), T.PILToTensor()])),
    ("rrc nearest", T.Compose([T.RandomResizedCrop(28, interpolation=T.InterpolationMode.NEAREST), T.ToTensor()])),
    ("rrc + flips both ways", T.Compose([T.RandomVerticalFlip(0.6), T.RandomResizedCrop(27, scale=(0.2, 0.7)),
                                          T.RandomHorizontalFlip(), T.RandomVerticalFlip(0.5), T.ToTensor(), NORM])),
    ("resize + vertical flip + randomcrop", T.Compose([T.Resize(41), T.RandomVerticalFlip(0.7), T.RandomCrop((29, 33)),
                                                      T.ToTensor(), NORM])),
    ("rrc drawing bilinear or bicubic (timm's random)", T.Compose([
        T.RandomResizedCrop(26, interpolation=(T.InterpolationMode.BILINEAR, T.InterpolationMode.BICUBIC)),
        T.RandomHorizontalFlip(), T.ToTensor(), NORM])),
])
@pytest.mark.parametrize("workers", [0, 2])
def test_the_stage_gives_the_cpu_paths_images_up_to_resize_rounding(photos, cpu_device, exact, name, tf, workers):
    """Same decoded pixels on both sides (see ``exact``): every supported
    pipeline's crops, resizes, padding and flips, in every order, are the
    CPU path's to the resize's rounding (1 level; 3 for bicubic, whose
    uint8 kernel rounds and clamps between its two passes, where its
    negative lobes overshoot); labels are equal."""
    ds = coordl.ImageFolder(photos, tf)
    cpu, dev, L = _pairs(ds, workers)
    assert len(cpu) == len(dev) == 5
    for (a, y), (b, y2) in zip(cpu, dev):
        assert torch.equal(y, y2) and a.dtype == b.dtype and a.shape == b.shape
        d = (a.float() - b.float()).abs() if a.dtype == torch.uint8 else _levels(a, b)
        if name == "rrc nearest":
            assert float(d.max()) == 0, name       # nearest picks the same pixels: nothing to round
        assert float(d.max()) <= (3 if "(h, w)" in name or "bicubic" in name else 1) + 1e-3, (name, float(d.max()))
    st = L.stats()
    assert st.device_decode_images == len(ds) and st.device_decode_cpu_images == 0
    assert st.device_decode.startswith("CPU stand-in") and st.device_split.startswith("not split (decode='device'")
    # the decoder's calls and the geometry after them are timed, in the threads that ran them
    assert 0 < st.device_decode_seconds and 0 < st.device_geometry_seconds


def test_the_default_stand_in_is_within_the_documented_tolerance(photos, cpu_device):
    """The CPU path decodes a reduced-size DCT when the crop allows it and
    interpolates chroma; the device decodes full size with plain chroma
    upsampling: the difference stays within docs/guide/gpu.md's bound."""
    for tf in (_rrc(24), _eval()):
        cpu, dev, _ = _pairs(coordl.ImageFolder(photos, tf))
        d = torch.cat([_levels(a, b).flatten() for (a, _), (b, _) in zip(cpu, dev)])
        assert float(d.mean()) <= DECODE_MEAN and float(d.max()) <= DECODE_MAX, (float(d.mean()), float(d.max()))


# ---------------------------------------------------------------- structure
class Structured(FolderTwoStage):
    """A two-stage dataset of its own that hands the bytes to its transform."""

    def prep(self, raw, i):
        tf, k = self.transform, self.kind
        if k == "dict":
            return {"label": i % 3, "image": tf.from_bytes(raw), "name": f"s{i}"}
        if k == "namedtuple":
            return Pair(tf.from_bytes(raw), i)
        if k == "two_views":
            return tf.from_bytes(raw), tf.from_bytes(raw), i
        if k == "decodes_itself":           # a PIL image: prepared on the CPU up to uint8
            return tf(Image.open(io.BytesIO(raw)).convert("RGB")), i
        if k == "touches":
            return tf.from_bytes(raw).float(), i
        if k == "reads":                    # computes from the image, then places it as it is
            x = tf.from_bytes(raw)
            self.seen = float(x.sum())
            return x, i
        if k == "disagree":
            return (tf.from_bytes(raw), i) if i % 4 else (i, tf.from_bytes(raw))
        raise AssertionError(k)


@pytest.mark.parametrize("kind", ["dict", "namedtuple", "two_views"])
@pytest.mark.parametrize("workers", [0, 2])
def test_images_anywhere_in_the_sample(photos, cpu_device, exact, kind, workers):
    ds = Structured(photos, _rrc(16), kind)
    cpu, dev, L = _pairs(ds, workers)
    assert len(cpu) == len(dev) == 5
    for a, b in zip(cpu, dev):
        assert type(a) is type(b)
        if kind == "dict":
            assert list(a) == list(b) and a["name"] == b["name"] and torch.equal(a["label"], b["label"])
            a, b = [a["image"]], [b["image"]]
        elif kind == "namedtuple":
            assert torch.equal(a.label, b.label)
            a, b = [a.image], [b.image]
        else:
            assert torch.equal(a[2], b[2])
            a, b = a[:2], b[:2]
        for x, y in zip(a, b):
            assert x.shape == y.shape and float(_levels(x, y).max()) <= 1.0 + 1e-3
    per_sample = 2 if kind == "two_views" else 1
    assert L.stats().device_decode_images == per_sample * len(ds)


@pytest.mark.parametrize("workers", [0, 2])
def test_two_views_with_the_workers_share_are_each_the_cpu_paths(photos, cpu_device, exact, monkeypatch, workers):
    """Two images per sample, half the samples the workers': each view
    goes to its own place (the workers' rows of both views arrive in one
    tensor, interleaved), the workers' exactly the CPU path's."""
    from coordl.device import decoders as DDS
    from coordl.device.encoded import plan_for

    monkeypatch.setattr(DDS, "cpu_share", lambda workers, spec=None: 0.5)
    ds = Structured(photos, _rrc(16), "two_views")
    cpu, dev, L = _pairs(ds, workers, shuffle=False)
    plan = plan_for(ds.transform)
    plan.cpu_share = 0.5
    for a, b in zip(cpu, dev):
        assert torch.equal(a[2], b[2])
        for r, i in enumerate(a[2].tolist()):
            for v in (0, 1):
                if plan.on_cpu(i):
                    assert torch.equal(a[v][r], b[v][r]), (i, v)
                else:
                    assert float(_levels(a[v][r], b[v][r]).max()) <= 1.0 + 1e-3, (i, v)
    st = L.stats()
    assert 0 < st.device_decode_cpu_images < 2 * len(ds) and st.device_decode_images + st.device_decode_cpu_images == 2 * len(ds)


def test_a_dataset_that_decodes_itself_is_prepared_on_the_cpu_exactly(photos, cpu_device):
    ds = Structured(photos, _rrc(16), "decodes_itself")
    cpu, dev, L = _pairs(ds)
    for (a, y), (b, y2) in zip(cpu, dev):
        assert torch.equal(a, b) and torch.equal(y, y2)       # the CPU path's own pixels, bit for bit
    st = L.stats()
    assert st.device_decode_cpu_images == len(ds) and st.device_decode_images == 0


@pytest.mark.parametrize("kind,msg", [("touches", "did more with the image of sample"),
                                      ("reads", "did more with the image of sample"),
                                      ("disagree", "must sit at the same places")])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_prep_the_stage_cannot_follow_stops_the_pass_saying_why(photos, cpu_device, kind, msg, workers):
    ds = Structured(photos, _rrc(16), kind)
    L = coordl.DataLoader(ds, batch_size=4, seed=7, num_workers=workers, device="cpu", decode="device")
    with pytest.raises(RuntimeError, match=msg) as e:
        list(L)
    assert "decode='cpu'" in str(e.value)


# ---------------------------------------------------------------- fallbacks
@pytest.fixture(scope="module")
def odd_files(tmp_path_factory):
    """A folder of JPEGs with, in class "odd": a CMYK JPEG, a grayscale
    JPEG, a PNG, a progressive JPEG and a JPEG with corrupt data (header and
    end marker intact: libjpeg-turbo refuses it, PIL decodes what it can)."""
    root = tmp_path_factory.mktemp("odd") / "data"
    rng = np.random.default_rng(1)
    (root / "a").mkdir(parents=True)
    (root / "odd").mkdir()

    def photo(h, w):
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (h + w)], -1)
        return Image.fromarray(np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8))

    for k in range(7):
        photo(60 + 3 * k, 80 - 2 * k).save(root / "a" / f"{k}.jpg", quality=90)
    photo(64, 70).convert("CMYK").save(root / "odd" / "cmyk.jpg", quality=90)
    photo(50, 66).convert("L").save(root / "odd" / "gray.jpg", quality=90)
    photo(58, 62).save(root / "odd" / "png.jpg", format="PNG")
    photo(61, 77).save(root / "odd" / "progressive.jpg", quality=85, progressive=True)
    buf = io.BytesIO()
    photo(64, 64).save(buf, "JPEG", quality=90)
    raw = buf.getvalue()
    sos = raw.find(b"\xff\xda")
    (root / "odd" / "corrupt.jpg").write_bytes(raw[:sos + 300] + b"\xff\xd9")
    return str(root)


def test_what_the_device_decoder_cannot_take_is_decoded_on_the_cpu(odd_files, cpu_device):
    """CMYK and PNG: prepared by the CPU path in the worker (its very
    pixels); grayscale and progressive JPEGs go to the device decoder; a
    stream it rejects is decoded on the CPU in the main process as the CPU
    path decodes it (PIL's decode of corrupt data); all counted."""
    ds = coordl.ImageFolder(odd_files, _rrc(24))
    names = [os.path.basename(p) for p, _ in ds.samples]
    cpu, dev, L = _pairs(ds, batch_size=len(ds), shuffle=False)
    (a, y), (b, y2) = cpu[0], dev[0]
    assert torch.equal(y, y2)
    for k, name in enumerate(names):
        d = _levels(a[k], b[k])
        if name in ("cmyk.jpg", "png.jpg"):
            assert float(d.max()) == 0, name                   # the CPU path, bit for bit
        else:
            assert float(d.mean()) <= DECODE_MEAN and float(d.max()) <= DECODE_MAX, (name, float(d.mean()))
    st = L.stats()
    assert st.device_decode_cpu_images == 3                     # cmyk, png, corrupt
    assert st.device_decode_images == len(ds) - 3


class _Partial(DD.HostDecoder):
    """As a GPU decoder given data that ends early: no error, and the
    pixels it could not decode are what the memory held (77 here)."""

    def decode(self, streams):
        from coordl.decode import jpeg

        out = []
        for s, img in zip(streams, super().decode(streams)):
            if isinstance(img, BaseException):
                h, w = jpeg._header(bytes(s.numpy()))[:2]
                img = torch.full((3, h, w), 77, dtype=torch.uint8)
            out.append(img)
        return out


@pytest.mark.parametrize("workers", [0, 2])
def test_checked_data_sends_a_corrupt_jpeg_to_the_cpu_path(odd_files, cpu_device, monkeypatch, workers):
    """COORDL_DEVICE_CHECK_DATA=1: the JPEG whose data ends early (header
    and end marker intact), which a GPU decoder decodes in part without an
    error, is prepared on the CPU path in the worker (its very pixels);
    every other sample is as without the check."""
    ds = coordl.ImageFolder(odd_files, _rrc(24))
    names = [os.path.basename(p) for p, _ in ds.samples]
    k = names.index("corrupt.jpg")
    others = [i for i in range(len(ds)) if i != k]
    monkeypatch.setattr(DD, "decoder_for", lambda dev, **kw: _Partial(dev, fancy_upsampling=True))
    kw = dict(batch_size=len(ds), shuffle=False, num_workers=workers, seed=7)
    cpu = list(coordl.DataLoader(ds, **kw))[0][0]
    x = list(coordl.DataLoader(ds, device="cpu", decode="device", **kw))[0][0]
    assert float(_levels(cpu[k], x[k]).max()) > 10        # unchecked: the decoder's undefined pixels
    monkeypatch.setenv("COORDL_DEVICE_CHECK_DATA", "1")
    L = coordl.DataLoader(ds, device="cpu", decode="device", **kw)
    y = list(L)[0][0]
    assert torch.equal(y[k], cpu[k])
    assert torch.equal(y[others], x[others])
    st = L.stats()
    assert st.device_decode_cpu_images == 3 and st.device_decode_images == len(ds) - 3    # cmyk, png, corrupt


@pytest.mark.parametrize("reader", ["extension", "simplejpeg"])
def test_the_data_check_finds_data_that_ends_early(odd_files, monkeypatch, reader):
    """entropy_data_complete: True for every whole JPEG of the folder
    (baseline, grayscale, progressive), False for data cut short with its
    end marker put back, through the crop extension or, without it,
    simplejpeg."""
    from coordl.decode import jpeg

    if reader == "simplejpeg":
        monkeypatch.setattr(jpeg, "_ext", None)
    elif jpeg._ext is None:
        pytest.skip("the crop extension is not built")
    for path in _files(odd_files):
        with open(path, "rb") as f:
            raw = f.read()
        hdr = jpeg._header(raw)
        if hdr is None or hdr[2] not in jpeg._FAST_COLORSPACES:
            continue                                    # the PNG and the CMYK JPEG never reach the check
        want = not path.endswith("corrupt.jpg")
        assert jpeg.entropy_data_complete(raw, hdr[0], hdr[1]) == want, path
        if want:                                        # the same file cut in its data, the marker put back
            assert not jpeg.entropy_data_complete(raw[:len(raw) // 2] + b"\xff\xd9", hdr[0], hdr[1]), path


def test_coordl_verify_lists_the_damaged_jpegs(odd_files, photos, tmp_path, capsys):
    """``coordl verify``: the folder's JPEG whose data ends early is listed
    (the check COORDL_DEVICE_CHECK_DATA runs), a copy cut short without
    its end marker too, each with why; the PNG, the CMYK and the whole
    JPEGs are not; exit status 1.  A folder of whole JPEGs: nothing, 0."""
    import shutil

    from coordl import cli
    from coordl.decode.verify import CUT_SHORT, DAMAGED

    root = tmp_path / "data"
    shutil.copytree(odd_files, root)
    whole = (root / "a" / "0.jpg").read_bytes()
    (root / "a" / "cut.jpg").write_bytes(whole[:len(whole) // 2])
    assert cli.main(["verify", str(root), "--threads", "2"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"{root / 'a' / 'cut.jpg'}: {CUT_SHORT}", f"{root / 'odd' / 'corrupt.jpg'}: {DAMAGED}"]
    assert "2 damaged JPEG files" in err
    assert cli.main(["verify", photos]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "0 damaged JPEG files" in err


def test_the_data_check_setting_is_checked_at_construction(photos, cpu_device, monkeypatch):
    monkeypatch.setenv("COORDL_DEVICE_CHECK_DATA", "maybe")
    with pytest.raises(ValueError, match=r"COORDL_DEVICE_CHECK_DATA should be 1 .* but got "
                                         r"COORDL_DEVICE_CHECK_DATA='maybe'"):
        coordl.DataLoader(coordl.ImageFolder(photos, _rrc(24)), batch_size=4, device="cpu", decode="device")


class _Refusing:
    """A device decoder that rejects some streams (by their first bytes)."""

    name = "refusing"

    def __init__(self, inner, bad):
        self.inner, self.bad, self.calls = inner, bad, []

    def decode(self, streams):
        self.calls.append(len(streams))
        return [RuntimeError("rejected") if bytes(s[:64].numpy()) in self.bad else self.inner.decode([s])[0]
                for s in streams]

    def finish(self):
        pass

    def release(self):
        return []


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_neither_decoder_can_read_is_the_cpu_paths_error(odd_files, cpu_device, monkeypatch, on_error,
                                                                   workers):
    """A stream the device decoder rejects and the CPU cannot decode either
    raises the sample's SampleError for its batch (the pass goes on, the
    step is used up) or is skipped, counted and warned about."""
    ds = coordl.ImageFolder(odd_files, _rrc(16))
    bad_index = next(i for i, (p, _) in enumerate(ds.samples) if p.endswith("progressive.jpg"))
    bad = {ds.raw(bad_index)[:64]}
    real = jpeg.decode_rgb

    def host(raw, scale=1):
        if bytes(raw[:64]) in bad:
            raise OSError("broken data stream when reading image file")
        return real(raw, scale)

    monkeypatch.setattr(jpeg, "decode_rgb", host)
    monkeypatch.setattr(DD, "decoder_for", lambda dev, **kw: _Refusing(DD.HostDecoder(dev), bad))
    L = coordl.DataLoader(ds, batch_size=4, seed=3, shuffle=False, num_workers=workers, device="cpu",
                          decode="device", on_error=on_error)
    plan = L.plan
    step_of_bad = [k for k in range(plan.num_batches) if bad_index in plan.indices(0)[k * 4:(k + 1) * 4]][0]
    it = iter(L)
    got = []
    if on_error == "raise":
        for k in range(plan.num_batches):
            if k == step_of_bad:
                with pytest.raises(coordl.SampleError) as e:
                    next(it)
                assert isinstance(e.value, OSError) and "progressive.jpg" in str(e.value)
                assert f"sample {bad_index}" in str(e.value)
            else:
                got.append(next(it))
        with pytest.raises(StopIteration):
            next(it)
        state = L.state_dict()          # the failed step counts as used up
        assert state["epoch"] == 1 and state["batches"] == 0
        assert sum(len(y) for _, y in got) == len(ds) - 4
    else:
        with pytest.warns(coordl.SkippedSampleWarning, match="progressive.jpg"):
            got = list(it)
        assert sum(len(y) for _, y in got) == len(ds) - 1
        assert all(x.shape[0] == y.shape[0] for x, y in got)
        st = L.stats()
        assert st.skipped == 1 and st.samples == len(ds) - 1
        labels = torch.cat([y for _, y in got]).tolist()
        want = [t for i, t in enumerate(ds.targets) if i != bad_index]
        assert labels == want


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_corrupt_file_gets_the_error_it_gets_on_the_cpu_path(tmp_path, cpu_device, on_error):
    """Not an image at all, and a JPEG cut short (no end marker): the worker
    hands both to the CPU path, whose error (PIL's) they get."""
    from coordl.synth import make_image_folder

    root = make_image_folder(str(tmp_path / "d"), num_images=8, num_classes=1, image_size=(40, 30), seed=1)
    files = _files(root)
    with open(files[2], "wb") as f:
        f.write(b"this is not an image" * 10)
    with open(files[5], "rb") as f:
        data = f.read()
    with open(files[5], "wb") as f:
        f.write(data[:len(data) // 2])
    kw = dict(batch_size=2, seed=1, shuffle=False, on_error=on_error)
    ds = coordl.ImageFolder(root, _rrc(16))
    for L in (coordl.DataLoader(ds, **kw), coordl.DataLoader(ds, device="cpu", decode="device", **kw)):
        it = iter(L)
        outcome = []
        for _ in range(4):
            try:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    x, y = next(it)
                outcome.append(len(y))
                assert all(w.category is coordl.SkippedSampleWarning for w in seen)
                assert len(seen) == 2 - len(y)
            except coordl.SampleError as e:
                outcome.append(type(e).__mro__[1].__name__)
        if on_error == "raise":
            assert outcome == [2, "UnidentifiedImageError", "OSError", 2], outcome
        else:
            assert outcome == [2, 1, 1, 2], outcome
            assert L.stats().skipped == 2


# ---------------------------------------------------------------- resume, stats
@pytest.mark.parametrize("workers", [0, 2])
def test_exact_mid_epoch_resume(photos, cpu_device, workers):
    ds = coordl.ImageFolder(photos, _rrc(16))
    kw = dict(batch_size=3, seed=11, shuffle=True, num_workers=workers, device="cpu", decode="device")
    whole = coordl.DataLoader(ds, **kw)
    whole.set_epoch(2)
    want = list(whole)
    L = coordl.DataLoader(ds, **kw)
    L.set_epoch(2)
    it = iter(L)
    first = [next(it) for _ in range(3)]
    state = L.state_dict()
    del it
    R = coordl.DataLoader(ds, **kw)
    R.load_state_dict(state)
    rest = list(R)
    got = first + rest
    assert len(got) == len(want) == 7
    for (a, y), (b, y2) in zip(got, want):
        assert torch.equal(a, b) and torch.equal(y, y2)
    assert R.stats().device_decode_images == len(ds) - 9


def test_the_node_cache_and_peers_path_are_unchanged(photos, cpu_device):
    """Bytes come from the node cache as before: epoch 1 reads them from it."""
    ds = coordl.ImageFolder(photos, _rrc(16))
    L = coordl.DataLoader(ds, batch_size=4, seed=2, device="cpu", decode="device", cache_size="8MiB")
    first, second = list(L), list(L)
    assert len(first) == len(second) == 5
    e0, e1 = L.stats().epochs
    assert e0.samples_from_storage == len(ds) and e1.samples_from_cache == len(ds)
    assert L.stats().device_decode_images == 2 * len(ds)


def test_stats_and_repr_say_which_path(photos, cpu_device):
    ds = coordl.ImageFolder(photos, _eval())
    L = coordl.DataLoader(ds, batch_size=4, device="cpu", decode="device")
    assert L.decode == "device"
    list(L)
    st = L.stats()
    assert st.device_decode == ("CPU stand-in (libjpeg-turbo, plain chroma upsampling) on cpu: Resize + CenterCrop "
                                "-> 32x32 (bilinear), ToTensor + Normalize")
    assert (st.device_decode_images, st.device_decode_cpu_images) == (len(ds), 0)
    plain = coordl.DataLoader(ds, batch_size=4, device="cpu")
    list(plain)
    assert plain.decode == "cpu" and plain.stats().device_decode == "" and plain.stats().device_decode_images == 0
    assert plain.stats().device_decode_seconds == 0 == plain.stats().device_geometry_seconds


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, True)])
def test_a_transform_assigned_later_takes_effect_at_the_next_pass(photos, cpu_device, workers, persistent):
    ds = coordl.ImageFolder(photos, _rrc(16))
    L = coordl.DataLoader(ds, batch_size=4, seed=1, num_workers=workers, persistent_workers=persistent,
                          device="cpu", decode="device")
    assert next(iter(L))[0].shape[-1] == 16
    ds.transform = _eval(30, 20)
    assert next(iter(L))[0].shape[-1] == (16 if persistent else 20)
    ds.transform = T.Compose([T.RandomResizedCrop(8), lambda x: x, T.ToTensor()])
    if not persistent:
        with pytest.raises(ValueError, match=r"step 1 is <function"):
            iter(L)


# ---------------------------------------------------------------- refusals
def test_arguments_are_checked_with_the_remedy(photos, cpu_device, monkeypatch):
    ds = coordl.ImageFolder(photos, _rrc())
    with pytest.raises(ValueError, match=r'decode should be "cpu" or "device", but got decode=\'gpu\''):
        coordl.DataLoader(ds, device="cpu", decode="gpu")
    monkeypatch.setattr(D, "CPU_TEST_DEVICE", False)
    with pytest.raises(ValueError, match=r"decode='device' should come with device= the CUDA device .*"
                                         r"device=\"cpu\" runs the CPU stand-in.* but got device=None"):
        coordl.DataLoader(ds, decode="device")


@pytest.mark.parametrize("workers", [0, 2])
def test_the_cpu_stand_in_is_public_as_device_cpu(photos, monkeypatch, workers):
    """decode="device" with device="cpu" runs the device path with the CPU
    decoder standing in for the GPU's, without the test seam: a user's own
    CI covers the stage, its fallbacks and its stats as this project's
    does.  device="cpu" alone stays a no-op, as before."""
    ds = coordl.ImageFolder(photos, _rrc())
    kw = dict(batch_size=4, seed=7, shuffle=True, num_workers=workers, device="cpu", decode="device")
    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)
    want = list(coordl.DataLoader(ds, **kw))
    monkeypatch.setattr(D, "CPU_TEST_DEVICE", False)
    L = coordl.DataLoader(ds, **kw)
    got = list(L)
    assert len(got) == len(want) == 5
    for (a, y), (b, y2) in zip(want, got):
        assert torch.equal(a, b) and torch.equal(y, y2)
    st = L.stats()
    assert st.device_decode.startswith("CPU stand-in") and st.device_decode_images == len(ds)
    assert coordl.DataLoader(ds, batch_size=4, device="cpu")._device is None


@pytest.mark.parametrize("tf,msg", [
    (T.Compose([T.RandomResizedCrop(8), lambda x: x, T.ToTensor()]), r"step 1 is <function .*ToTensor\(\) or PIL"),
    (T.Compose([T.RandomResizedCrop(8), T.ToTensor(), T.ToDtype(torch.float64)]), r"step 2 \(ToDtype"),
    (T.Compose([T.Resize(20), T.ToTensor()]), r"Resize\(size=20.* same size"),
    (T.Compose([T.CenterCrop(20), T.Resize(8), T.ToTensor()]), r"step 1 \(Resize.*comes after CenterCrop"),
    (T.Compose([T.RandomResizedCrop(8, interpolation=T.InterpolationMode.LANCZOS), T.ToTensor()]), r"lanczos"),
    (T.Compose([T.CenterCrop(8), T.CenterCrop(4), T.ToTensor()]), r"second crop"),
    (T.Compose([T.RandomResizedCrop(8), T.PILToTensor(), NORM]), r"only Normalize\(...\)s may follow ToTensor"),
    (T.Compose([T.RandomResizedCrop(8)]), r"the transform ends there"),
    (None, r"has no transform"),
    (lambda img: img, r"not a coordl.transforms.Compose"),
])
def test_a_transform_the_device_cannot_run_is_refused_naming_the_step(photos, cpu_device, tf, msg):
    ds = coordl.ImageFolder(photos, tf)
    with pytest.raises(ValueError, match=msg) as e:
        coordl.DataLoader(ds, batch_size=2, device="cpu", decode="device")
    assert "decode='device' cannot run the dataset's transform" in str(e.value)
    assert "decode='cpu'" in str(e.value) or "give it a transform" in str(e.value)


def test_combinations_the_stage_cannot_serve_are_refused(photos, cpu_device, monkeypatch):
    ds = coordl.ImageFolder(photos, _rrc())
    kw = dict(batch_size=2, device="cpu", decode="device")
    with pytest.raises(ValueError, match=r"cannot run with sharing \(share=True\).*share=False"):
        coordl.DataLoader(ds, share=True, **kw)
    monkeypatch.setenv("COORDL_SHARE", "1")
    with pytest.raises(ValueError, match=r"COORDL_SHARE=1 in the environment"):
        coordl.DataLoader(ds, **kw)
    monkeypatch.delenv("COORDL_SHARE")


    class Unsized(torch.utils.data.Sampler):      # no length: torch's machinery reads it
        def __iter__(self):
            return iter(range(len(ds)))

    with pytest.raises(ValueError, match=r"has a sampler or batch_sampler of its own"):
        coordl.DataLoader(ds, sampler=Unsized(), **kw)
    # a sampler with a length runs on coordl's pipeline, in its order: the stage serves it
    by_sampler = list(coordl.DataLoader(ds, sampler=list(range(len(ds))), seed=1, **kw))
    in_order = list(coordl.DataLoader(ds, shuffle=False, seed=1, **kw))
    assert len(by_sampler) == len(in_order) and all(torch.equal(a[0], b[0]) for a, b in zip(by_sampler, in_order))
    with pytest.raises(ValueError, match=r"has no raw/prep"):
        coordl.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 3)), **kw)
    with pytest.raises(ValueError, match=r"needs batches"):
        coordl.DataLoader(ds, device="cpu", decode="device", batch_size=None)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_sampler_is_served(photos, cpu_device, exact, workers):
    """A batch_sampler (torch then has batch_size=None, its batches collated
    by default_collate, of any size): the device stage serves its batches,
    each the CPU path's batch up to the resize's rounding."""
    ds = coordl.ImageFolder(photos, _rrc())
    batches = [[3, 1, 4], [15, 9, 2, 6, 5], [0], [7, 8]]
    cpu, dev, L = _pairs(ds, workers, batch_size=1, shuffle=False, batch_sampler=batches)
    assert [len(y) for _, y in dev] == [3, 5, 1, 2]
    for (a, y), (b, y2) in zip(cpu, dev):
        assert torch.equal(y, y2) and a.shape == b.shape
        assert float(_levels(a, b).max()) <= 1 + 1e-3
    assert L.stats().device_decode_images == 11


def test_the_cuda_decoder_is_named_when_missing(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_gpu_decoders(name, *a, **kw):
        if name.startswith(("torchvision", "nvidia")):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_gpu_decoders)
    with pytest.raises(ValueError, match=r"needs a JPEG decoder for the GPU.*nvidia-nvimgcodec-cu12.*decode='cpu'"):
        DD.decoder_for(torch.device("cuda"))
    monkeypatch.setenv("COORDL_DEVICE_DECODER", "pillow")
    with pytest.raises(ValueError, match=r'COORDL_DEVICE_DECODER should be one of "auto", "torchvision", '
                                         r'"nvimgcodec", "nvimgcodec-hw", "nvimgcodec-hybrid" or "nvimgcodec-cuda"'):
        DD.decoder_for(torch.device("cuda"))


def _nvimgcodec():
    try:
        from nvidia import nvimgcodec  # noqa: F401
    except Exception as e:  # noqa: BLE001 - absent, or present without its libraries
        pytest.skip(f"nvidia.nvimgcodec does not import here ({type(e).__name__})")


def test_nvimgcodecs_calls_decode_what_libjpeg_decodes(photos):
    """nvImageCodec's decoder through the calls the GPU makes (its CPU
    backend stands in where nvImageCodec is installed without a GPU):
    interleaved RGB in (3, H, W) with libjpeg's interpolated chroma, as the
    stand-in with ``fancy_upsampling``; a stream it cannot read is an error
    in its place, the others decode."""
    _nvimgcodec()
    dev = torch.device("cpu")
    nv, host = DD.NvImageCodecDecoder(dev), DD.HostDecoder(dev, fancy_upsampling=True)
    streams = [torch.from_numpy(np.fromfile(f, dtype=np.uint8)) for f in _files(photos)[:6]]
    streams.insert(2, torch.frombuffer(bytearray(b"not a jpeg" * 20), dtype=torch.uint8))
    got, want = nv.decode(streams), host.decode(streams)
    nv.finish()
    assert isinstance(got[2], Exception) and isinstance(want[2], Exception)
    for i, (a, b) in enumerate(zip(got, want)):
        if i == 2:
            continue
        assert a.dtype == torch.uint8 and a.shape == b.shape and a.shape[0] == 3, (i, a.shape, b.shape)
        assert int((a.int() - b.int()).abs().max()) <= 1, i


def test_the_stage_with_nvimgcodec_gives_the_cpu_paths_images(photos, cpu_device, monkeypatch):
    """The whole decode="device" stage with nvImageCodec as its decoder
    (its CPU backend here): the CPU path's images to the resize's rounding."""
    _nvimgcodec()
    monkeypatch.setattr(DD, "decoder_for", lambda dev, **kw: DD.NvImageCodecDecoder(dev))
    ds = coordl.ImageFolder(photos, T.Compose([T.RandomResizedCrop(20), T.RandomHorizontalFlip(), T.ToTensor(), NORM]))
    cpu, dev, L = _pairs(ds)
    assert len(cpu) == len(dev) == 5
    for (a, y), (b, y2) in zip(cpu, dev):
        assert torch.equal(y, y2) and a.shape == b.shape
        assert float(_levels(a, b).max()) <= 1 + 1e-3
    st = L.stats()
    assert st.device_decode.startswith("nvImageCodec") and st.device_decode_images == len(ds)


# ---------------------------------------------------------------- torchvision
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_torchvision_users_change_only_the_import_and_the_option(photos, cpu_device, exact, tv, version):
    from torchvision import datasets

    if version == "v1":
        from torchvision import transforms as V
        tf = V.Compose([V.RandomResizedCrop(20), V.RandomHorizontalFlip(), V.ToTensor(),
                        V.Normalize(NORM.mean, NORM.std)])
    else:
        from torchvision.transforms import v2 as V
        tf = V.Compose([V.RandomResizedCrop(20), V.RandomHorizontalFlip(), V.ToImage(),
                        V.ToDtype(torch.float32, scale=True), V.Normalize(NORM.mean, NORM.std)])
    ds = datasets.ImageFolder(photos, transform=tf)
    cpu, dev, L = _pairs(ds, 2)
    for (a, y), (b, y2) in zip(cpu, dev):
        assert torch.equal(y, y2) and float(_levels(a, b).max()) <= 1.0 + 1e-3
    assert L.stats().path == "coordl" and L.stats().device_decode_images == len(ds)
    tf2 = V.Compose([V.RandomResizedCrop(20), V.ElasticTransform(sigma=1.0),
                      V.ToTensor() if version == "v1" else V.ToImage()])
    with pytest.raises(ValueError, match=r"the steps ElasticTransform run as written"):
        coordl.DataLoader(datasets.ImageFolder(photos, transform=tf2), batch_size=2, device="cpu", decode="device")


# ---------------------------------------------------------------- the stage itself
def test_chunks_bound_the_decoded_bytes_of_one_call(photos, cpu_device, monkeypatch):
    """A batch is decoded in calls of at most BUDGET decoded bytes (never
    fewer than one image per call), in row order."""
    ds = coordl.ImageFolder(photos, _rrc(16))
    calls = []

    class Counting(DD.HostDecoder):
        def decode(self, streams):
            calls.append(len(streams))
            return super().decode(streams)

    monkeypatch.setattr(DD, "decoder_for", lambda dev, **kw: Counting(dev))

    def epoch():
        return list(coordl.DataLoader(ds, batch_size=8, seed=2, device="cpu", decode="device", drop_last=True))

    whole = epoch()
    assert calls == [8, 8]
    calls.clear()
    monkeypatch.setattr(DD, "BUDGET", 3 * 96 * 72 * 3)       # three of these images
    got = epoch()
    assert calls == [3, 3, 2, 3, 3, 2]
    monkeypatch.setattr(DD, "BUDGET", 1)
    calls.clear()
    got1 = epoch()
    assert calls == [1] * 16
    # the same images whether the geometry ran chunk by chunk or after the last chunk
    for (a, y), (b, y2), (c, y3) in zip(whole, got, got1):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(y, y2) and torch.equal(y, y3)


def test_a_drawn_interpolation_is_the_cpu_paths_per_sample(photos, cpu_device, exact):
    """A RandomResizedCrop that draws its mode (timm's "random"): each
    record's MODE is the CPU path's draw (the box, then the mode), both modes
    occur, and each image is the CPU path's to the resize's rounding, where
    the other mode would be far from it."""
    M = T.InterpolationMode
    tf = T.Compose([T.RandomResizedCrop(20, scale=(0.3, 1.0), interpolation=(M.BILINEAR, M.BICUBIC)), T.ToTensor(),
                    NORM])
    ds = coordl.ImageFolder(photos, tf)
    prep = E.DecodePrep(ds, E.plan_for(tf))
    modes = []
    for i in range(len(ds)):
        with _rng.sample_rng(3, 1, i):
            rec, _ = prep.prep(ds.raw(i), i)
        prep.take_device_marks(), prep.take_device_payloads()
        g = _rng.derive(3, 1, i)
        with Image.open(ds.samples[i][0]) as im:
            T.RandomResizedCrop.get_params(im, (0.3, 1.0), (3 / 4, 4 / 3), rng=g)
        assert rec.tolist()[E.MODE] == int(g.random() * 2), i
        modes.append(rec.tolist()[E.MODE])
    assert set(modes) == {0, 1}
    kw = dict(batch_size=5, seed=3, num_workers=0)
    L = coordl.DataLoader(ds, **kw)
    L.set_epoch(1)
    D_ = coordl.DataLoader(ds, device="cpu", decode="device", **kw)
    D_.set_epoch(1)
    single = coordl.DataLoader(coordl.ImageFolder(photos, T.Compose([T.RandomResizedCrop(
        20, scale=(0.3, 1.0)), T.ToTensor(), NORM])), **kw)
    single.set_epoch(1)
    far = 0.0
    for (a, _), (b, _), (c, _) in zip(L, D_, single):
        assert float(_levels(a, b).max()) <= 3 + 1e-3
        far = max(far, float(_levels(a, c).max()))
    assert far > 3        # the mode drawn matters: bilinear throughout would not pass above


def test_the_plan_draws_exactly_what_decode_and_apply_draws():
    """Random pipelines, random sizes: after the plan's draws, the sample's
    generator is where the CPU path leaves it (what target_transform or a
    later sample of the same prep would draw next is the same)."""
    r = random.Random(5)
    both = (T.InterpolationMode.BILINEAR, T.InterpolationMode.BICUBIC)
    steps = [lambda: T.RandomResizedCrop(r.randint(4, 40), interpolation=both if r.random() < 0.5 else "bilinear"),
             lambda: T.RandomHorizontalFlip(r.random()), lambda: T.RandomVerticalFlip(r.random())]
    for trial in range(200):
        head = [steps[0]()] if r.random() < 0.7 else [T.Resize(r.randint(5, 50))]
        tf = T.Compose([steps[r.randint(1, 2)](), *head, steps[r.randint(1, 2)](),
                        T.CenterCrop(r.randint(3, 30)), T.ToTensor()])
        plan = E.plan_for(tf)
        H, W = r.randint(8, 300), r.randint(8, 300)
        g1, g2 = random.Random(trial), random.Random(trial)
        plan.draw(H, W, g1)
        with _rng.sample_rng(0, 0, 0):
            _rng._local.rng = g2
            img = torch.zeros(3, H, W, dtype=torch.uint8)
            for t in tf.transforms[:-1]:
                img = t(img)
        assert g1.random() == g2.random(), (trial, tf)


def test_the_next_batch_is_decoded_while_this_ones_images_are_finished(photos, cpu_device, monkeypatch):
    """With workers, the decode of batch k+1 (the decoder waits for the GPU
    without the GIL) runs in a thread of its own while the pin thread
    finishes batch k (geometry, conversion, copy): the decoder is called for
    the next batch while the first batch's finish is held back.  The batches
    are those of the loader without workers, in order."""
    import threading

    ds = coordl.ImageFolder(photos, _rrc(16))
    kw = dict(batch_size=4, seed=5, shuffle=True, device="cpu", decode="device")
    want = list(coordl.DataLoader(ds, **kw))
    decoded, waiting = threading.Event(), threading.Event()
    from coordl.pipeline import workers as W

    where = {"decode": set(), "finish": set(), "take in": set(), "prepare": set()}
    overlapped = []
    real_finish = DD.DecodeStage.finish
    real_next = W.PipelineIter.__next__
    real_prepare = DD.DecodeStage.prepare

    def prepare(self, batch, stats):
        where["prepare"].add(threading.current_thread().name)
        return real_prepare(self, batch, stats)

    def take_in(self):
        where["take in"].add(threading.current_thread().name)
        return real_next(self)

    class Watching(DD.HostDecoder):
        def decode(self, streams):
            where["decode"].add(threading.current_thread().name)
            if waiting.is_set():         # the first batch's finish is waiting: this is a later batch
                decoded.set()
            return super().decode(streams)

    def finish(self, pending):
        where["finish"].add(threading.current_thread().name)
        if not waiting.is_set():
            waiting.set()
            overlapped.append(decoded.wait(30))
        return real_finish(self, pending)

    monkeypatch.setattr(DD, "decoder_for", lambda dev, **kw: Watching(dev))
    monkeypatch.setattr(DD.DecodeStage, "finish", finish)
    monkeypatch.setattr(W.PipelineIter, "__next__", take_in)
    monkeypatch.setattr(DD.DecodeStage, "prepare", prepare)
    got = list(coordl.DataLoader(ds, num_workers=2, **kw))
    assert overlapped == [True]
    # the workers' batches are taken in and made ready for the decoder by a thread of their own, so the
    # decode thread only decodes
    assert where == {"decode": {"coordl-device-decode"}, "finish": {"coordl-pin-memory"},
                     "take in": {"coordl-device-fetch"}, "prepare": {"coordl-device-fetch"}}
    assert len(got) == len(want)
    for (a, y), (b, y2) in zip(got, want):
        assert torch.equal(a, b) and torch.equal(y, y2)


def test_what_a_decoders_images_hold_is_kept_until_the_work_on_them_ran():
    """nvImageCodec's images own device memory outside torch's allocator:
    the stage keeps what the decoder hands over until the staged batch's
    event completes, and lets go of it then (no host wait)."""
    stage = DD.DecodeStage.__new__(DD.DecodeStage)
    stage._retired = collections.deque()
    streams = D.HostStreams(auto=False)
    first, second = streams.event(), streams.event()
    first.record()
    second.record()
    a, b = ["images of batch 1"], ["images of batch 2"]
    stage._retire(first, a)
    stage._retire(second, b)
    assert [h for _, h in stage._retired] == [a, b]
    first.complete()
    third = streams.event()
    third.record()
    c = ["images of batch 3"]
    stage._retire(third, c)
    assert [h for _, h in stage._retired] == [b, c]
    second.complete()
    third.complete()
    stage._retire(third, [])
    assert list(stage._retired) == []


@pytest.mark.parametrize("mode,antialias", [("bilinear", True), ("bicubic", True), ("bilinear", False),
                                            ("nearest", False)])
def test_the_stages_resize_is_f_interpolates(mode, antialias):
    """The stage resizes each image with the operator F.interpolate calls
    (without its per-call checks) where that gives F.interpolate's values:
    the same values on sizes the probe did not use, up and down, also when
    written straight into a row of the batch."""
    import torch.nn.functional as F

    resize = DD._resizer(mode, antialias)
    g = torch.Generator().manual_seed(3)
    kw = {"align_corners": False, "antialias": antialias} if mode != "nearest" else {}
    for shape, size in [((1, 3, 37, 52), (24, 24)), ((1, 3, 20, 15), (33, 41)), ((1, 3, 300, 200), (7, 224))]:
        x = torch.rand(shape, generator=g) * 255
        want = F.interpolate(x, size=size, mode=mode, **kw)
        assert torch.equal(resize(x, size), want), (mode, shape, size)
        # written into one row of a batch: that row only, the same values
        batch = torch.full((3, 3, *size), -7.0)
        resize(x, size, batch[1:2])
        assert torch.equal(batch[1:2], want) and bool((batch[0] == -7).all() and (batch[2] == -7).all())


def test_the_geometry_setting_is_checked_and_the_cpu_keeps_one_launch_per_image(photos, cpu_device, monkeypatch):
    """COORDL_DEVICE_GEOMETRY takes auto, per-image or a kernel's name, and
    says so; on the CPU device (outside the kernel's own tests) the stage
    launches per image."""
    plan = E.plan_for(_rrc())
    monkeypatch.setenv("COORDL_DEVICE_GEOMETRY", "fast")
    with pytest.raises(ValueError, match='COORDL_DEVICE_GEOMETRY should be "auto", "per-image" or one of the batch '
                                         r"kernels \('separable', 'tiled', 'per-pixel'\)"):
        DD.DecodeStage(torch.device("cpu"), plan, DD.HostDecoder(), "raise", str)
    for value in ("auto", "Tiled", "per-image"):
        monkeypatch.setenv("COORDL_DEVICE_GEOMETRY", value)
        assert DD.DecodeStage(torch.device("cpu"), plan, DD.HostDecoder(), "raise", str).batch_geometry is False


def test_the_geometry_path_never_depends_on_timing(photos, monkeypatch, caplog):
    """The first batch's check decides between the batch kernel and one
    launch per image by the pixels alone: a kernel slower there than the
    launches it replaces is still used (a warning says so, and how to turn
    it off), so two loaders, or a run and its resume, take the same path
    and give the same pixels."""
    import logging

    from coordl.device import geometry_kernel as GK

    pytest.importorskip("triton")
    plan = E.plan_for(_rrc())
    monkeypatch.setattr(GK, "agrees", lambda stage, imgs, recs, geo=None: (True, "max 0 level(s)"))
    monkeypatch.setattr(GK, "fused_agrees", lambda geo, dev, imgs, recs: (True, "the same rows"))
    monkeypatch.setattr(GK, "faster", lambda stage, imgs, recs, geo=None: (False, "2.00 ms against 1.00 ms"))
    monkeypatch.setattr(DD, "BATCH_GEOMETRY_ON_CPU", True)

    def on_a_gpu():      # made on the CPU, deciding as on a GPU (where the speed is measured)
        stage = DD.DecodeStage(torch.device("cpu"), plan, DD.HostDecoder(), "raise", str)
        stage.device = torch.device("cuda")
        return stage

    stage = on_a_gpu()
    assert stage.batch_geometry is None            # undecided until the first batch
    img = torch.zeros((3, 40, 30), dtype=torch.uint8)
    rec = [0] * (E.FLIP + 1)
    with caplog.at_level(logging.INFO, logger="coordl.device"):
        geo = stage._batched({(0, 0): img}, [[rec]])
    assert isinstance(geo, GK.BatchGeometry) and stage.batch_geometry is geo and geo.kind == "separable"
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warned and "COORDL_DEVICE_GEOMETRY=per-image" in warned[0].getMessage(), caplog.text
    monkeypatch.setattr(GK, "agrees", lambda stage, imgs, recs, geo=None: (False, "max 3 level(s)"))
    other = on_a_gpu()
    assert other._batched({(0, 0): img}, [[rec]]) is False


def test_the_geometry_setting_names_the_one_kernel_to_try(monkeypatch):
    """COORDL_DEVICE_GEOMETRY=<kernel> has the first batch's check try that
    kernel alone: it is used where its rows agree, and where they do not
    the stage launches per image (no other kernel is tried); auto tries
    them all in order, the first that agrees used."""
    from coordl.device import geometry_kernel as GK

    pytest.importorskip("triton")
    plan = E.plan_for(_rrc())
    tried = []

    def agrees(stage, imgs, recs, geo=None):
        tried.append(geo.kind)
        return geo.kind in ok_kinds, "checked"

    monkeypatch.setattr(GK, "agrees", agrees)
    monkeypatch.setattr(GK, "fused_agrees", lambda geo, dev, imgs, recs, tail=None: (False, "rounded after"))
    monkeypatch.setattr(DD, "BATCH_GEOMETRY_ON_CPU", True)
    img = torch.zeros((3, 40, 30), dtype=torch.uint8)
    rec = [0] * (E.FLIP + 1)
    for setting, ok_kinds, want_tried, want in [
        ("auto", {"tiled", "per-pixel"}, ["separable", "tiled"], "tiled"),
        ("auto", set(), ["separable", "tiled", "per-pixel"], None),
        ("tiled", {"tiled", "per-pixel"}, ["tiled"], "tiled"),
        ("per-pixel", {"per-pixel"}, ["per-pixel"], "per-pixel"),
        ("separable", {"tiled", "per-pixel"}, ["separable"], None),
    ]:
        monkeypatch.setenv("COORDL_DEVICE_GEOMETRY", setting)
        tried.clear()
        stage = DD.DecodeStage(torch.device("cpu"), plan, DD.HostDecoder(), "raise", str)
        geo = stage._batched({(0, 0): img}, [[rec]])
        assert tried == want_tried, (setting, tried)
        assert (geo.kind if geo else None) == want, (setting, geo)
