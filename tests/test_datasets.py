"""Tests for coordl.datasets (folder datasets, two-stage adapter) and coordl.synth."""
from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest
from PIL import Image

from coordl import datasets as D
from coordl import synth
from coordl.protocol import describe, is_two_stage


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

def image_bytes(seed: int, size=(12, 9), fmt="JPEG") -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


def write(path, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def reference_samples(root: str, extensions) -> list[tuple[str, int]]:
    """The scanning rules, spelled out with os.walk."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    out = []
    for idx, cls in enumerate(classes):
        for dirpath, _, fnames in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(dirpath, fname)
                if path.lower().endswith(extensions):
                    out.append((path, idx))
    return out


def as_array(img) -> np.ndarray:
    return np.asarray(img)


@pytest.fixture
def tree(tmp_path) -> str:
    """root/{a,b,c}/... with nested folders, mixed-case extensions and
    files that are not images."""
    root = tmp_path / "root"
    files = {
        "a/z.jpeg": "JPEG", "a/a.PNG": "PNG", "a/x/1.png": "PNG", "a/x-y/2.png": "PNG",
        "a/x/z/3.png": "PNG",
        "b/b1.jpg": "JPEG", "b/B2.JPG": "JPEG", "b/sub/x.png": "PNG",
        "c/c.bmp": "BMP",
    }
    for k, (rel, fmt) in enumerate(sorted(files.items())):
        write(root / rel, image_bytes(k, fmt=fmt))
    write(root / "b" / "notes.txt", b"not an image")
    write(root / "readme.txt", b"a file, not a class")
    return str(root)


# --------------------------------------------------------------------------
# scanning
# --------------------------------------------------------------------------

def test_classes_and_sample_order(tree):
    ds = D.ImageFolder(tree)
    assert ds.classes == ["a", "b", "c"]
    assert ds.class_to_idx == {"a": 0, "b": 1, "c": 2}
    expected = reference_samples(tree, D.IMG_EXTENSIONS)
    assert list(ds.samples) == expected
    assert ds.samples == expected and ds.imgs == expected
    assert ds.targets == [t for _, t in expected]
    assert len(ds) == len(expected) == 9
    rel_a = [os.path.relpath(p, os.path.join(tree, "a")) for p, t in ds.samples if t == 0]
    # sorted(os.walk(...)) order: "x-y" sorts before "x/z" ('-' < '/')
    assert rel_a == ["a.PNG", "z.jpeg", "x/1.png", "x-y/2.png", "x/z/3.png"]
    assert all(isinstance(p, str) and isinstance(t, int) for p, t in ds.samples)
    assert ds.samples[-1] == (os.path.join(tree, "c", "c.bmp"), 2)
    assert ds.samples[1:3] == expected[1:3]
    assert ds.extensions == D.IMG_EXTENSIONS
    assert ds.root == tree
    assert D.make_dataset(tree, extensions=D.IMG_EXTENSIONS) == expected
    assert ds.find_classes(tree) == (["a", "b", "c"], {"a": 0, "b": 1, "c": 2})


def test_is_valid_file_and_extensions(tree):
    ds = D.ImageFolder(tree, is_valid_file=lambda p: p.endswith(".png"), allow_empty=True)
    assert ds.extensions is None
    assert [os.path.basename(p) for p, _ in ds.samples] == ["1.png", "2.png", "3.png", "x.png"]
    ds = D.DatasetFolder(tree, extensions=".txt", allow_empty=True)
    assert [os.path.basename(p) for p, _ in ds.samples] == ["notes.txt"]
    ds = D.ImageFolder(tree, extensions=(".BMP",), allow_empty=True)  # case-insensitive
    assert ds.samples == [(os.path.join(tree, "c", "c.bmp"), 2)]
    with pytest.raises(FileNotFoundError, match="no file passed is_valid_file"):
        D.ImageFolder(tree, is_valid_file=lambda p: p.endswith(".png"))
    # not allow_empty: classes a and b have no .bmp
    with pytest.raises(FileNotFoundError, match="a, b"):
        D.ImageFolder(tree, extensions=(".bmp",), allow_empty=False)


def test_symlinked_dirs_followed_and_loops_stopped(tree, tmp_path):
    write(tmp_path / "ext" / "e.jpg", image_bytes(99))
    os.symlink(tmp_path / "ext", os.path.join(tree, "b", "linked"))
    os.symlink(os.path.join(tree, "a"), os.path.join(tree, "a", "x", "loop"))
    ds = D.ImageFolder(tree)
    paths = [p for p, _ in ds.samples]
    assert os.path.join(tree, "b", "linked", "e.jpg") in paths
    assert not any("loop" in p for p in paths)
    assert len(ds) == 10


# --------------------------------------------------------------------------
# the two stages
# --------------------------------------------------------------------------

def test_getitem_equals_prep_of_raw(tree):
    ds = D.ImageFolder(tree)
    assert is_two_stage(ds) and ds.is_two_stage
    for i, (path, target) in enumerate(ds.samples):
        raw = ds.raw(i)
        with open(path, "rb") as f:
            assert raw == f.read()
        a_img, a_t = ds[i]
        b_img, b_t = ds.prep(raw, i)
        assert a_t == b_t == target
        assert a_img.mode == "RGB"
        with Image.open(path) as ref:
            expected = as_array(ref.convert("RGB"))
        assert np.array_equal(as_array(a_img), expected)
        assert np.array_equal(as_array(b_img), expected)
        assert ds.describe(i) == path == describe(ds, i)
    assert ds[-1][1] == ds.targets[-1]
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(IndexError):
        ds.raw(-len(ds) - 1)


def test_transforms_applied(tree):
    ds = D.ImageFolder(tree, transform=lambda im: ("T", im.size), target_transform=lambda t: t * 10 + 1)
    for i, (_, target) in enumerate(ds.samples):
        assert ds[i] == (("T", (12, 9)), target * 10 + 1)
        assert ds.prep(ds.raw(i), i) == ds[i]


def test_truncated_jpeg_raises_in_prep(tmp_path):
    data = image_bytes(1, size=(64, 48))
    write(tmp_path / "r" / "k" / "bad.jpg", data[: len(data) // 2])
    ds = D.ImageFolder(str(tmp_path / "r"))
    raw = ds.raw(0)
    assert len(raw) == len(data) // 2
    with pytest.raises(OSError):
        ds.prep(raw, 0)
    with pytest.raises(OSError):
        ds[0]


def test_missing_file_raw_names_path(tree):
    ds = D.ImageFolder(tree)
    path = ds.samples[3][0]
    os.remove(path)
    with pytest.raises(FileNotFoundError) as exc:
        ds.raw(3)
    assert path in str(exc.value)


def test_read_bytes_sizes(tmp_path):
    for n in (0, 1, 4096, 3 * 1024 * 1024 + 7):
        data = os.urandom(n)
        p = write(tmp_path / f"f{n}", data)
        assert D.read_bytes(p) == data


def test_repr(tree):
    ds = D.ImageFolder(tree, transform=lambda x: x)
    text = repr(ds)
    lines = text.splitlines()
    assert lines[0] == "Dataset ImageFolder"
    assert lines[1] == "    Number of datapoints: 9"
    assert lines[2] == f"    Root location: {tree}"
    assert lines[3].startswith("    Transform: ")
    assert "Target transform" not in text


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------

def test_no_class_folder(tmp_path):
    write(tmp_path / "only_files" / "a.jpg", image_bytes(0))
    root = str(tmp_path / "only_files")
    with pytest.raises(FileNotFoundError, match="Couldn't find any class folder in"):
        D.ImageFolder(root)


def test_empty_class(tree):
    os.makedirs(os.path.join(tree, "empty"))
    write(os.path.join(tree, "empty", "x.txt"), b"text")
    with pytest.raises(FileNotFoundError) as exc:
        D.ImageFolder(tree)
    msg = str(exc.value)
    assert "empty" in msg and tree in msg and ".jpg" in msg and ".webp" in msg
    ds = D.ImageFolder(tree, allow_empty=True)
    assert ds.classes == ["a", "b", "c", "empty"]
    assert ds.class_to_idx["empty"] == 3
    assert 3 not in ds.targets and len(ds) == 9


def test_extensions_and_is_valid_file_exclusive(tree):
    with pytest.raises(ValueError):
        D.ImageFolder(tree, extensions=(".jpg",), is_valid_file=lambda p: True)
    with pytest.raises(ValueError):
        D.DatasetFolder(tree, extensions=(".jpg",), is_valid_file=lambda p: True)
    with pytest.raises(ValueError):
        D.DatasetFolder(tree)  # neither


# --------------------------------------------------------------------------
# loaders and decoders
# --------------------------------------------------------------------------

def test_custom_loader_without_decode_is_not_two_stage(tree):
    def my_loader(path):
        return "L:" + path

    ds = D.ImageFolder(tree, loader=my_loader)
    assert not is_two_stage(ds) and not ds.is_two_stage
    assert not hasattr(ds, "raw") and not hasattr(ds, "prep")
    with pytest.raises(AttributeError, match="decode"):
        ds.raw(0)
    path, target = ds.samples[0]
    assert ds[0] == ("L:" + path, target)
    assert ds.loader is my_loader
    assert describe(ds, 0) == path


def test_custom_loader_with_decode(tree):
    ds = D.ImageFolder(tree, loader=lambda p: "unused", decode=lambda b: ("D", len(b)))
    assert is_two_stage(ds)
    path, target = ds.samples[2]
    expected = (("D", os.path.getsize(path)), target)
    assert ds[2] == expected == ds.prep(ds.raw(2), 2)
    with pytest.raises(TypeError, match="decode should be a callable"):
        D.ImageFolder(tree, decode=b"not callable")


def test_datasetfolder_default_sample_is_bytes(tree):
    ds = D.DatasetFolder(tree, extensions=(".jpg", ".jpeg"), allow_empty=True)
    assert is_two_stage(ds)
    path, target = ds.samples[0]
    with open(path, "rb") as f:
        assert ds[0] == (f.read(), target)
    assert ds.loader(path) == ds[0][0]


def test_default_loader_named_loader_decodes_with_pil(tree):
    ds = D.ImageFolder(tree, loader=D.default_loader)
    assert is_two_stage(ds)
    path, _ = ds.samples[0]
    assert np.array_equal(as_array(ds[0][0]), as_array(D.pil_loader(path)))


def test_subclass_overriding_getitem_is_not_two_stage(tree):
    class WithPath(D.ImageFolder):
        def __getitem__(self, i):
            img, t = super().__getitem__(i)
            return img, t, self.samples[i][0]

    ds = WithPath(tree)
    assert not is_two_stage(ds)
    assert len(ds[0]) == 3


def test_make_dataset_override_is_used(tree):
    class FirstOnly(D.ImageFolder):
        @staticmethod
        def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
            full = D.make_dataset(directory, class_to_idx, extensions, is_valid_file, allow_empty)
            return full[:2]

    ds = FirstOnly(tree)
    assert ds.samples == reference_samples(tree, D.IMG_EXTENSIONS)[:2]
    assert ds.sizes.tolist() == [os.path.getsize(p) for p, _ in ds.samples]


def test_samples_and_targets_assignable(tree):
    ds = D.ImageFolder(tree)
    fp = ds.fingerprint()
    full = list(ds.samples)
    ds.samples = ds.samples[::2]
    assert ds.samples == full[::2] and len(ds) == 5
    assert ds.sizes.tolist() == [os.path.getsize(p) for p, _ in full[::2]]
    assert ds.fingerprint() != fp
    assert ds[4][1] == full[8][1]
    ds.targets = [0] * 5
    assert ds.targets == [0] * 5 and ds[4][1] == 0
    with pytest.raises(ValueError):
        ds.targets = [0, 1]


# --------------------------------------------------------------------------
# numpy storage, pickling, fingerprint
# --------------------------------------------------------------------------

def test_numpy_storage_and_small_pickle(tmp_path):
    root = tmp_path / "many"
    n = 3000
    for k in range(n):
        write(root / f"c{k % 3}" / f"img_{k:05d}.jpg", b"x" * (k % 7 + 1))
    ds = D.ImageFolder(str(root))
    assert len(ds) == n
    for name, value in vars(ds).items():
        assert not isinstance(value, (list, tuple, set, dict)) or len(value) < 100, name
    arrays = [v for v in vars(ds).values() if isinstance(v, np.ndarray)]
    assert sum(a.nbytes for a in arrays) >= n * (len("c0/img_00000.jpg") + 8 * 3)
    assert ds.sizes.dtype == np.int64
    assert ds.sizes.tolist() == [k % 7 + 1 for k in sorted(range(n), key=lambda k: (k % 3, k))]
    assert not ds.sizes.flags.writeable

    buffers = []
    inband = pickle.dumps(ds, protocol=5, buffer_callback=buffers.append)
    outband = sum(memoryview(b).nbytes for b in buffers)
    assert len(inband) < 2000  # everything per-sample is in the numpy buffers
    assert outband >= n * 8 * 3
    clone = pickle.loads(inband, buffers=buffers)
    assert clone.samples == ds.samples and clone.targets == ds.targets
    assert clone.fingerprint() == ds.fingerprint()
    assert pickle.loads(pickle.dumps(ds)).samples == ds.samples


def test_fingerprint(tree):
    fp = D.ImageFolder(tree).fingerprint()
    assert isinstance(fp, str) and int(fp, 16) >= 0 and len(fp) == 32
    assert D.ImageFolder(tree).fingerprint() == fp  # stable over rescans
    assert D.ImageFolder(tree, transform=lambda x: x).fingerprint() == fp

    path = os.path.join(tree, "b", "b1.jpg")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    fp_touched = D.ImageFolder(tree).fingerprint()
    assert fp_touched != fp
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert D.ImageFolder(tree).fingerprint() == fp

    with open(path, "ab") as f:
        f.write(b"\0")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime, new size
    assert D.ImageFolder(tree).fingerprint() not in (fp, fp_touched)

    os.truncate(path, st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert D.ImageFolder(tree).fingerprint() == fp
    os.rename(path, os.path.join(tree, "b", "b0.jpg"))
    os.utime(os.path.join(tree, "b", "b0.jpg"), ns=(st.st_atime_ns, st.st_mtime_ns))
    assert D.ImageFolder(tree).fingerprint() != fp


# --------------------------------------------------------------------------
# adapter for torchvision-style instances
# --------------------------------------------------------------------------

def default_loader(path):  # named like torchvision's
    with open(path, "rb") as f:
        return Image.open(f).convert("RGB")


class FakeTorchvisionFolder:
    """Duck-typed stand-in for torchvision's ImageFolder."""

    def __init__(self, root, loader=default_loader, transform=None, target_transform=None):
        self.root = root
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = reference_samples(root, D.IMG_EXTENSIONS)
        self.imgs = self.samples
        self.targets = [t for _, t in self.samples]
        self.loader = loader
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, target = self.samples[i]
        sample = self.loader(path)
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target


def test_two_stage_adapter_default_loader(tree):
    fake = FakeTorchvisionFolder(tree, transform=lambda im: im.resize((4, 3)), target_transform=lambda t: -t)
    ts = D.two_stage(fake)
    assert isinstance(ts, D.TwoStageFolder)
    assert is_two_stage(ts)
    assert len(ts) == len(fake)
    assert ts.samples == fake.samples and ts.targets == fake.targets
    assert ts.classes == fake.classes and ts.class_to_idx == fake.class_to_idx
    for i in range(len(fake)):
        (a, at), (b, bt), (c, ct) = fake[i], ts[i], ts.prep(ts.raw(i), i)
        assert at == bt == ct
        assert np.array_equal(as_array(a), as_array(b))
        assert np.array_equal(as_array(a), as_array(c))
        assert ts.describe(i) == fake.samples[i][0]
    for value in vars(ts).values():  # keeps neither the original nor its lists
        assert value is not fake
        assert not isinstance(value, (list, tuple, dict)) or len(value) <= 3
    assert ts.fingerprint() == D.ImageFolder(tree).fingerprint()
    assert repr(ts).startswith("Dataset TwoStageFolder(FakeTorchvisionFolder)")
    plain = D.two_stage(FakeTorchvisionFolder(tree))
    assert pickle.loads(pickle.dumps(plain)).samples == fake.samples


def test_two_stage_adapter_custom_loader(tree):
    def my_loader(path):
        with open(path, "rb") as f:
            return ("len", len(f.read()))

    fake = FakeTorchvisionFolder(tree, loader=my_loader)
    with pytest.raises(TypeError) as exc:
        D.two_stage(fake)
    msg = str(exc.value)
    assert msg.startswith("decode should be a callable taking the file's bytes and returning the sample")
    assert "my_loader" in msg and "reads paths" in msg and msg.endswith("but got decode=None")

    ts = D.two_stage(fake, decode=lambda b: ("len", len(b)))
    for i in range(len(fake)):
        assert ts[i] == fake[i] == ts.prep(ts.raw(i), i)
    with pytest.raises(TypeError, match="decode should be a callable"):
        D.two_stage(fake, decode=42)
    with pytest.raises(TypeError, match="torchvision-style"):
        D.two_stage(object())


def test_two_stage_adapter_paths_outside_root(tree, tmp_path):
    fake = FakeTorchvisionFolder(tree)
    fake.root = str(tmp_path / "elsewhere")
    ts = D.two_stage(fake)
    assert ts.samples == fake.samples
    assert ts.raw(0) == D.read_bytes(fake.samples[0][0])


# --------------------------------------------------------------------------
# synth
# --------------------------------------------------------------------------

def read_tree(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _, fnames in os.walk(root):
        for f in fnames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = D.read_bytes(p)
    return out


def test_synth_layout_and_decodable(tmp_path):
    root = synth.make_image_folder(tmp_path / "s", num_images=14, num_classes=3,
                                   image_size=(40, 30), quality=90)
    assert root == str(tmp_path / "s")
    assert sorted(os.listdir(root)) == ["class_00", "class_01", "class_02"]
    assert sorted(os.listdir(os.path.join(root, "class_01"))) == [
        "img_000001.jpg", "img_000004.jpg", "img_000007.jpg", "img_000010.jpg", "img_000013.jpg"]
    ds = D.ImageFolder(root)
    assert len(ds) == 14 and ds.classes == ["class_00", "class_01", "class_02"]
    for i in range(len(ds)):
        img, _ = ds[i]
        assert img.size == (40, 30)
        with Image.open(io.BytesIO(ds.raw(i))) as im:
            assert im.format == "JPEG"


def test_synth_deterministic(tmp_path):
    kw = dict(num_images=6, num_classes=2, image_size=(48, 36))
    a = read_tree(synth.make_image_folder(tmp_path / "a", seed=3, **kw))
    b = read_tree(synth.make_image_folder(tmp_path / "b", seed=3, workers=3, **kw))
    c = read_tree(synth.make_image_folder(tmp_path / "c", seed=4, **kw))
    assert len(a) == 6 and a == b
    assert a.keys() == c.keys() and all(a[k] != c[k] for k in a)


def test_synth_default_sizes_and_photo_like(tmp_path):
    n = 30
    root = synth.make_image_folder(tmp_path / "d", num_images=n, num_classes=5)
    ds = D.ImageFolder(root)
    assert len(ds) == n
    mean_kb = float(ds.sizes.mean()) / 1024
    assert 0.75 * 110 <= mean_kb <= 1.3 * 110
    assert ds.sizes.std() > 0
    dims = set()
    for i in range(n):
        img, _ = ds[i]
        w, h = img.size
        dims.add((w, h))
        assert 300 <= max(w, h) <= 800
        assert 3 / 4 - 0.01 <= w / h <= 4 / 3 + 0.01
        a = np.asarray(img.convert("L"), dtype=np.float64)
        assert a.std() > 10  # not flat colour
        # not white noise: neighbouring 4x4 block means are strongly correlated
        blocks = a[: h // 4 * 4, : w // 4 * 4].reshape(h // 4, 4, w // 4, 4).mean(axis=(1, 3))
        corr = np.corrcoef(blocks[:, :-1].ravel(), blocks[:, 1:].ravel())[0, 1]
        assert corr > 0.5
    assert len(dims) > 1 and (500, 375) in dims


def test_synth_cli(tmp_path, capsys):
    root = str(tmp_path / "cli")
    assert synth.main([root, "--images", "4", "--classes", "2", "--size", "16x12", "--workers", "1"]) == 0
    assert sorted(read_tree(root)) == [
        os.path.join("class_00", "img_000000.jpg"), os.path.join("class_00", "img_000002.jpg"),
        os.path.join("class_01", "img_000001.jpg"), os.path.join("class_01", "img_000003.jpg")]
    assert "4 JPEGs" in capsys.readouterr().out


# ------------------------------------------------- a user's loader, read by its code
def pil_loader(path):                       # named as torchvision's, but gray
    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("L")


def _rgb_copy(path):                        # torchvision's pil_loader, copied under another name
    # open path as file to avoid ResourceWarning
    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("RGB")


def test_a_loader_named_pil_loader_that_converts_to_gray_is_run_as_written(photo_folder):
    """A loader is known by what its code does, not by its name: a gray
    ``pil_loader`` of the user's gave RGB samples (coordl decoded as
    torchvision's)."""
    root = photo_folder("gray_loader", num_images=4, num_classes=2, mean_kb=2, image_size=(20, 14), seed=1)
    ds = D.ImageFolder(root, loader=pil_loader)
    assert not is_two_stage(ds)
    img, _ = ds[0]
    assert img.mode == "L" and np.array_equal(np.asarray(img), np.asarray(pil_loader(ds.samples[0][0])))
    with pytest.raises(TypeError, match="decode should be a callable"):
        D.two_stage(ds)


def test_a_copy_of_torchvisions_pil_loader_is_known_by_its_code(photo_folder):
    root = photo_folder("rgb_loader", num_images=4, num_classes=2, mean_kb=2, image_size=(20, 14), seed=2)
    ds = D.ImageFolder(root, loader=_rgb_copy)
    assert is_two_stage(ds)
    img, _ = ds.prep(ds.raw(1), 1)
    assert img.mode == "RGB" and np.array_equal(np.asarray(img), np.asarray(_rgb_copy(ds.samples[1][0])))
