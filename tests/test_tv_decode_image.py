"""torchvision's folders whose ``loader`` is torchvision.io's
``decode_image`` (or ``read_image``, or a ``functools.partial`` of one giving
its mode) run on coordl's pipeline: the v2 transforms given the uint8 tensor
that loader returns, torch's samples for every kind of file (a grey or CMYK
JPEG, a PNG with alpha: the transform as written on the loader's own
tensor), torchvision's errors, the device stages.

Each test runs with torchvision's own function where it decodes here, and
with tests/_tv_io.py's stand-in (its contract, computed with PIL) where it
does not (torchvision beside torch's CPU build)."""
import functools
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _torchvision import import_torchvision  # noqa: E402
from _tv_io import real_decodes, standin_decode_image  # noqa: E402

import coordl  # noqa: E402

tv = import_torchvision()
pytestmark = [pytest.mark.skipif(tv is None, reason="torchvision is not installed"),
              # torchvision 0.29 deprecates its image decoders (for TorchCodec's), under torch's loader as under coordl's
              pytest.mark.filterwarnings("ignore:The image decoding and encoding:DeprecationWarning")]
REAL = tv is not None and real_decodes(tv)


@pytest.fixture(params=["torchvision", "stand-in"])
def decode_image(request):
    if request.param == "torchvision":
        if not REAL:
            pytest.skip("torchvision's decode_image does not decode here (its image extension did not load)")
        from torchvision.io import decode_image as fn
        return fn
    return standin_decode_image


def _photo(h, w, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (h + w)], -1) + rng.integers(-25, 25, (h, w, 3))
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    """RGB JPEGs of every chroma layout, one progressive."""
    root = tmp_path_factory.mktemp("tvio") / "jpegs"
    for k in range(12):
        d = root / f"c{k % 3}"
        d.mkdir(parents=True, exist_ok=True)
        _photo(60 + 5 * k, 90 - 3 * k, k).save(d / f"{k}.jpg", quality=88, subsampling=k % 3, progressive=k == 5)
    return str(root)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """RGB JPEGs with a grey and a CMYK JPEG, an RGB and an RGBA PNG."""
    root = tmp_path_factory.mktemp("tvio") / "mixed"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    for k in range(4):
        _photo(64 + 4 * k, 80 - 4 * k, k).save(root / "a" / f"{k}.jpg", quality=90, subsampling=k % 3)
    _photo(70, 60, 10).convert("L").save(root / "a" / "gray.jpg")
    _photo(60, 70, 11).convert("CMYK").save(root / "b" / "cmyk.jpg")
    _photo(66, 50, 12).save(root / "b" / "rgb.png")
    _photo(50, 66, 13).convert("RGBA").save(root / "b" / "rgba.png")
    _photo(72, 72, 14).save(root / "b" / "z.jpg", quality=75)
    return str(root)


def _v2():
    from torchvision.transforms import v2
    return v2


def _eval(normalize=True):
    v2 = _v2()
    return v2.Compose([v2.Resize(40), v2.CenterCrop(32), v2.ToDtype(torch.float32, scale=True)]
                      + ([v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])] if normalize else []))


def _train():
    v2 = _v2()
    return v2.Compose([v2.RandomResizedCrop(32, antialias=True), v2.RandomHorizontalFlip(),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)])


def _same(a, b) -> bool:
    return len(a) == len(b) and all(type(x[0]) is type(y[0]) and torch.equal(x[0], y[0])
                                    and torch.equal(torch.as_tensor(x[1]), torch.as_tensor(y[1])) for x, y in zip(a, b))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_evaluation_folder_gives_torchs_batches_on_coordls_pipeline(jpegs, decode_image, workers):
    ds = tv.datasets.ImageFolder(jpegs, _eval(), loader=decode_image)
    L = coordl.DataLoader(ds, batch_size=4, num_workers=workers)
    assert _same(list(L), list(torch.utils.data.DataLoader(ds, batch_size=4)))
    st = L.stats()
    assert st.path == "coordl", st.path_reason
    assert "loader torchvision.io.decode_image (JPEGs of 3 colour components decoded by coordl" in st.path_reason


def test_the_fused_decode_and_crop_are_the_default_loaders_given_a_tensor(jpegs, decode_image):
    """With the same draws, a training pipeline on the loader's tensor is
    what coordl gives torchvision's default loader with PILToTensor first
    (a pipeline checked against torchvision's pixels in test_tv_pixels)."""
    v2 = _v2()
    ours = list(coordl.DataLoader(tv.datasets.ImageFolder(jpegs, _train(), loader=decode_image), batch_size=3,
                                  shuffle=True, seed=11))
    ref = coordl.DataLoader(tv.datasets.ImageFolder(jpegs, v2.Compose([v2.PILToTensor(), *_train().transforms])),
                            batch_size=3, shuffle=True, seed=11)
    assert _same(ours, list(ref)) and len(ours) == 4


@pytest.mark.parametrize("mode", [None, "RGB", "GRAY", "exif"])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_kind_of_file_gives_torchs_sample(mixed, decode_image, mode, workers):
    modes = sys.modules["torchvision.io.image"].ImageReadMode
    loader = {None: decode_image, "RGB": functools.partial(decode_image, mode=modes.RGB),
              "GRAY": functools.partial(decode_image, mode=modes.GRAY),
              "exif": functools.partial(decode_image, apply_exif_orientation=True)}[mode]
    ds = tv.datasets.ImageFolder(mixed, _eval(normalize=False), loader=loader)
    want = list(torch.utils.data.DataLoader(ds, batch_size=None))
    L = coordl.DataLoader(ds, batch_size=None, num_workers=workers)
    got = list(L)
    assert _same(got, want)
    channels = [x.shape[0] for x, _ in got]
    assert channels == {"RGB": [3] * 9, "GRAY": [1] * 9}.get(mode, [3, 3, 3, 3, 1, 4, 3, 4, 3]), channels
    st = L.stats()
    assert st.path == "coordl"
    # another mode, or the EXIF orientation applied: every file decoded by torchvision's function
    assert ("every file decoded by it" in st.path_reason) == (mode in ("GRAY", "exif")), st.path_reason


def test_random_steps_on_other_files_draw_by_the_sample(mixed, decode_image):
    """The files coordl hands to the transform as written (a grey or CMYK
    JPEG, an RGBA PNG) draw from the sample's seeded generators: the same
    with any number of workers, and each pass anew."""
    v2 = _v2()
    tf = v2.Compose([v2.RandomResizedCrop(24), v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True)])
    ds = tv.datasets.ImageFolder(mixed, tf, loader=decode_image)
    passes = {}
    for w in (0, 2):
        L = coordl.DataLoader(ds, batch_size=None, num_workers=w, seed=4)
        passes[w] = [list(L), list(L)]
    assert _same(passes[0][0], passes[2][0]) and _same(passes[0][1], passes[2][1])
    assert not _same(passes[0][0], passes[0][1])
    want = list(torch.utils.data.DataLoader(ds, batch_size=None))
    assert [x.shape for x, _ in passes[0][0]] == [x.shape for x, _ in want]


def test_the_transform_assigned_between_passes_runs_on_every_kind_of_file(mixed, decode_image):
    v2 = _v2()
    ds = tv.datasets.ImageFolder(mixed, _eval(normalize=False), loader=decode_image)
    L = coordl.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=False)
    list(L)
    ds.transform = v2.Compose([v2.Resize(30), v2.CenterCrop((20, 24)), v2.ToDtype(torch.float32, scale=True)])
    got = list(L)
    assert _same(got, list(torch.utils.data.DataLoader(ds, batch_size=None)))
    assert {tuple(x.shape[1:]) for x, _ in got} == {(20, 24)}


def test_a_file_cut_short_gets_torchvisions_error_and_on_error_skips_it(tmp_path, decode_image):
    for k in range(3):
        (tmp_path / "c").mkdir(exist_ok=True)
        _photo(50, 60, k).save(tmp_path / "c" / f"{k}.jpg")
    whole = (tmp_path / "c" / "1.jpg").read_bytes()
    (tmp_path / "c" / "1.jpg").write_bytes(whole[:len(whole) // 2])
    ds = tv.datasets.ImageFolder(str(tmp_path), _eval(), loader=decode_image)
    with pytest.raises(Exception) as theirs:
        list(torch.utils.data.DataLoader(ds, batch_size=None))
    with pytest.raises(Exception) as ours:
        list(coordl.DataLoader(ds, batch_size=None))
    assert isinstance(ours.value, type(theirs.value)) and str(theirs.value) in str(ours.value)
    with pytest.warns(coordl.errors.SkippedSampleWarning):
        kept = list(coordl.DataLoader(ds, batch_size=None, on_error="skip"))
    assert len(kept) == 2


def test_a_decode_image_that_fails_gives_its_error_as_under_torch():
    """torchvision beside torch's CPU build (its image extension not loaded):
    the loader's own error, at the first sample, as torch's loader gives."""
    if REAL or tv is None:
        pytest.skip("torchvision's decode_image decodes here")
    from torchvision.io import decode_image

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        os.mkdir(os.path.join(d, "c"))
        _photo(40, 40, 0).save(os.path.join(d, "c", "0.jpg"))
        ds = tv.datasets.ImageFolder(d, _eval(), loader=decode_image)
        with pytest.raises(RuntimeError) as theirs:
            next(iter(torch.utils.data.DataLoader(ds, batch_size=None)))
        L = coordl.DataLoader(ds, batch_size=None)
        with pytest.raises(RuntimeError) as ours:
            next(iter(L))
        assert str(theirs.value) in str(ours.value)
        assert L.stats().path == "coordl" and "every file decoded by it" in L.stats().path_reason


def test_loaders_coordl_does_not_read_stay_on_torchs_machinery(jpegs, decode_image):
    mode = sys.modules["torchvision.io.image"].ImageReadMode.RGB
    for loader in (functools.partial(decode_image, mode=mode, device="cpu"),
                   lambda p: decode_image(p, mode=mode)):
        ds = tv.datasets.ImageFolder(jpegs, _eval(), loader=loader)
        L = coordl.DataLoader(ds, batch_size=4)
        assert L.stats().path == "torch" and "decode_image" in L.stats().path_reason


def test_a_subclass_adding_the_path_gives_torchs_samples(mixed, decode_image):
    class WithPaths(tv.datasets.ImageFolder):
        def __getitem__(self, index):
            return super().__getitem__(index) + (self.samples[index][0],)

    ds = WithPaths(mixed, _eval(normalize=False), loader=decode_image)
    L = coordl.DataLoader(ds, batch_size=None, num_workers=2)
    got, want = list(L), list(torch.utils.data.DataLoader(ds, batch_size=None))
    assert L.stats().path == "coordl"
    assert [p for *_, p in got] == [p for *_, p in want]
    assert _same([g[:2] for g in got], [w[:2] for w in want])


def test_the_device_split_gives_torchs_batches(jpegs, decode_image, cpu_device):
    ds = tv.datasets.ImageFolder(jpegs, _eval(), loader=decode_image)
    L = coordl.DataLoader(ds, batch_size=4, num_workers=2, device="cpu")
    assert _same(list(L), list(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert L.stats().path == "coordl" and L.stats().device_split.startswith("split"), L.stats().device_split


def test_decode_on_the_device_reads_every_file_as_the_default_loaders_tensor(mixed, decode_image, cpu_device):
    """``decode="device"`` (the CPU stand-in): JPEGs to the device decoder,
    the rest (CMYK, PNG) decoded by the loader and prepared on the CPU; the
    batches are those of the default loader with PILToTensor first."""
    v2 = _v2()
    rgb = functools.partial(decode_image, mode=sys.modules["torchvision.io.image"].ImageReadMode.RGB)
    kw = dict(batch_size=2, num_workers=2, device="cpu", decode="device", seed=2, shuffle=True)
    L = coordl.DataLoader(tv.datasets.ImageFolder(mixed, _train(), loader=rgb), **kw)
    ref = coordl.DataLoader(tv.datasets.ImageFolder(mixed, v2.Compose([v2.PILToTensor(), *_train().transforms])),
                            **kw)
    got, want = list(L), list(ref)
    st = L.stats()
    assert st.device_decode_images + st.device_decode_cpu_images == 9 and st.device_decode_cpu_images >= 3
    # CMYK: torchvision's conversion and PIL's may differ by a level; every other file is the same
    cmyk = [k for k, (p, _) in enumerate(L.dataset.samples) if p.endswith("cmyk.jpg")]
    assert len(got) == len(want) == 5
    for (a, ya), (b, yb) in zip(got, want):
        assert torch.equal(ya, yb)
        assert a.shape == b.shape
    assert cmyk and max((a - b).abs().max().item() for (a, _), (b, _) in zip(got, want)) <= 2 / 255 / 0.25 + 1e-6


def test_the_check_of_the_decode_is_made_once_and_can_say_no(monkeypatch, jpegs, decode_image):
    from coordl.decode import tvio

    assert tvio.agrees(decode_image) is True
    calls = []

    def other(data, mode=None, apply_exif_orientation=False):
        calls.append(1)
        return (decode_image(data) if mode is None else decode_image(data, mode=mode)) // 2 * 2    # other pixels

    other.__module__, other.__name__ = "torchvision.io.image", "decode_image"
    ds = tv.datasets.ImageFolder(jpegs, _eval(), loader=other)
    L = coordl.DataLoader(ds, batch_size=4)
    assert "every file decoded by it" in L.stats().path_reason
    before = len(calls)
    assert _same(list(L), list(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert len(calls) - before == 2 * len(ds)        # each file decoded by it, on coordl's side as on torch's
    assert tvio.agrees(other) is False


def test_pickled_the_dataset_keeps_its_loader(jpegs):
    if not REAL:
        pytest.skip("torchvision's decode_image does not decode here")
    import pickle

    from torchvision.io import ImageReadMode, decode_image, read_image

    for loader in (decode_image, read_image, functools.partial(decode_image, mode=ImageReadMode.RGB)):
        ds = tv.datasets.ImageFolder(jpegs, _eval(), loader=loader)
        L = coordl.DataLoader(ds, batch_size=4)
        copy = pickle.loads(pickle.dumps(L.dataset))
        assert _same([copy[i] for i in range(4)], [ds[i] for i in range(4)])


def test_a_dataset_of_listed_files_with_the_loader_gives_torchs_samples(mixed, decode_image):
    ds = tv.datasets.Food101.__new__(tv.datasets.Food101)
    tv.datasets.vision.VisionDataset.__init__(ds, mixed, transform=_eval(normalize=False))
    samples = tv.datasets.ImageFolder(mixed).samples
    ds._image_files, ds._labels = [p for p, _ in samples], [t for _, t in samples]
    ds.loader = decode_image
    L = coordl.DataLoader(ds, batch_size=None, num_workers=2)
    assert _same(list(L), list(torch.utils.data.DataLoader(ds, batch_size=None)))
    assert L.stats().path == "coordl" and "loader torchvision.io.decode_image" in L.stats().path_reason


def test_a_jpeg_coordls_decode_refuses_is_decoded_by_the_loader(monkeypatch, jpegs, decode_image):
    """Where coordl's decode raises on a file it took for its own (a stream
    libjpeg-turbo reads with a warning in one build and refuses in another),
    torchvision's function decodes it, and gives its result or its error."""
    from coordl.decode import jpeg

    ds = tv.datasets.ImageFolder(jpegs, _eval(), loader=decode_image)
    L = coordl.DataLoader(ds, batch_size=4)
    want = list(torch.utils.data.DataLoader(ds, batch_size=4))

    def refuse(*a, **k):
        raise OSError("broken data stream when reading image file")

    monkeypatch.setattr(jpeg, "decode_rgb_crop", refuse)
    monkeypatch.setattr(jpeg, "decode_rgb", refuse)
    assert _same(list(L), want)


@pytest.mark.parametrize("workers", [0, 2])
def test_coordls_own_folder_with_the_loader_is_two_stage_with_its_samples(mixed, decode_image, workers):
    ds = coordl.ImageFolder(mixed, _eval(normalize=False), loader=decode_image)
    theirs = tv.datasets.ImageFolder(mixed, _eval(normalize=False), loader=decode_image)
    assert ds.is_two_stage and coordl.datasets.two_stage(theirs).is_two_stage
    L = coordl.DataLoader(ds, batch_size=None, num_workers=workers)
    assert _same(list(L), list(torch.utils.data.DataLoader(theirs, batch_size=None)))
    assert L.stats().path == "coordl"


def test_resume_mid_epoch_and_the_node_cache_work_on_it(mixed, decode_image):
    from _resume_check import whole_and_resumed

    v2 = _v2()
    tf = v2.Compose([v2.RandomResizedCrop(24), v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True)])
    ds = tv.datasets.ImageFolder(mixed, tf, loader=decode_image)
    whole, resumed = whole_and_resumed(lambda seed=4: coordl.DataLoader(ds, batch_size=None, shuffle=True, seed=seed,
                                                                        num_workers=2), 4)
    assert _same(whole, resumed) and len(whole) == 9
    L = coordl.DataLoader(ds, batch_size=None, shuffle=True, seed=4, cache_size="8MiB")
    first, second = list(L), list(L)
    st = L.stats()
    assert st.epochs[1].samples_from_cache == 9 and st.epochs[1].samples_from_storage == 0
    assert [x.shape for x, _ in first] == [x.shape for x, _ in whole] and len(second) == 9


def test_a_transform_of_coordls_assigned_to_loader_dataset_runs_on_the_loaders_tensor(mixed, decode_image):
    from coordl import transforms as T

    ds = tv.datasets.ImageFolder(mixed, _eval(normalize=False), loader=decode_image)
    L = coordl.DataLoader(ds, batch_size=None, num_workers=2)
    list(L)
    mine = T.Compose([T.CenterCrop(20), T.ToDtype(torch.float32, scale=True)])
    L.dataset.transform = mine
    got = list(L)
    want = [(mine(decode_image(p)), t) for p, t in ds.samples]
    assert _same(got, want)
    assert [x.shape[0] for x, _ in got] == [3, 3, 3, 3, 1, 4, 3, 4, 3]
    assert "coordl's, run as assigned on the tensor of the loader" in L.stats().path_reason


@pytest.mark.parametrize("workers", [0, 2])
def test_decode_on_the_device_reads_a_batch_at_a_time_as_the_per_sample_path(mixed, decode_image, cpu_device,
                                                                             workers):
    """The workers' batch reads (coordl.pipeline.device_batches) take the
    JPEGs coordl decodes and hand the other files to the per-sample path:
    the same batches and statistics as the per-sample path alone."""
    from coordl.pipeline import device_batches as BR

    rgb = functools.partial(decode_image, mode=sys.modules["torchvision.io.image"].ImageReadMode.RGB)
    ds = tv.datasets.ImageFolder(mixed, _train(), loader=rgb)
    out = {}
    for enabled in (True, False):
        old, BR.ENABLED = BR.ENABLED, enabled
        try:
            L = coordl.DataLoader(ds, batch_size=3, seed=1, shuffle=True, device="cpu", decode="device",
                                  num_workers=workers, persistent_workers=bool(workers))
            batches = [list(L) for _ in range(2)]
            used = {s["batch_reads"] for s in L._mode.pool.worker_stats()} if workers else None
            st = L.stats()
            out[enabled] = (batches, st.device_decode_images, st.device_decode_cpu_images, used)
            del L
        finally:
            BR.ENABLED = old
    (got, dev, cpu, used), (want, dev2, cpu2, _) = out[True], out[False]
    assert all(_same(a, b) for a, b in zip(got, want)) and (dev, cpu) == (dev2, cpu2)
    assert cpu == 2 * 3 and dev == 2 * 6      # CMYK and the PNGs through torchvision's function, each pass
    if workers:
        assert used == {True}


def test_decode_on_the_device_refuses_a_file_of_other_channels_saying_what_to_do(mixed, decode_image, cpu_device):
    ds = tv.datasets.ImageFolder(mixed, _train(), loader=decode_image)
    with pytest.raises(ValueError, match=r"mode=ImageReadMode.RGB\), or use decode='cpu'"):
        list(coordl.DataLoader(ds, batch_size=3, device="cpu", decode="device"))
