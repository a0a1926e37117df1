"""The README's first command: a small end-to-end run on generated photos.

Generates a photo-like JPEG ImageFolder, trains nothing, and reads it a few
epochs the way users do today, torch's DataLoader over torchvision's
ImageFolder and transforms (or, where torchvision does not import, the same
PIL pipeline written by hand), and then with the same call on
coordl.DataLoader (the same dataset object, when torchvision imports); then
shows what coordl did (which path, fused transforms, plan, stats), the node
cache over two epochs, and a mid-epoch save/restore that continues exactly
where it stopped.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

__all__ = ["run_demo", "DemoRootError"]


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _torchvision():
    """torchvision, when it imports as it is (never patched), else None."""
    try:
        import torchvision  # noqa: F401
        from torchvision import datasets, transforms
    except Exception:  # absent, or its compiled operators do not load beside this torch build
        return None
    return datasets, transforms


class _HandWrittenFolder(torch.utils.data.Dataset):
    """What torchvision's ImageFolder + RandomResizedCrop(224), RandomHorizontalFlip(),
    ToTensor(), Normalize() do, written with PIL by hand (torch's RNG, torchvision's
    crop algorithm): what users without torchvision would run."""

    def __init__(self, root: str, size: int = 224):
        from .datasets import IMG_EXTENSIONS, find_classes

        self.classes, self.class_to_idx = find_classes(root)
        self.samples = []
        for c in self.classes:
            for dirpath, _dirs, files in sorted(os.walk(os.path.join(root, c))):
                self.samples += [(os.path.join(dirpath, f), self.class_to_idx[c]) for f in sorted(files)
                                 if f.lower().endswith(IMG_EXTENSIONS)]
        self.size = size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        from . import transforms as T

        path, target = self.samples[i]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")
        top, left, h, w = T.RandomResizedCrop.get_params(img, (0.08, 1.0), (3 / 4, 4 / 3))
        img = img.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.Resampling.BILINEAR)
        if torch.rand(1) < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = T._to_chw(img).float().div_(255)
        x = (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
        return x, target


def _datasets(root: str):
    """``(what torch's DataLoader reads, what coordl.DataLoader reads, description)``:
    torchvision's ImageFolder + transforms for both when torchvision imports;
    otherwise the hand-written PIL pipeline for torch and coordl's namesakes."""
    tv = _torchvision()
    if tv is not None:
        datasets, V = tv
        tf = V.Compose([V.RandomResizedCrop(224), V.RandomHorizontalFlip(), V.ToTensor(), V.Normalize(MEAN, STD)])
        ds = datasets.ImageFolder(root, transform=tf)
        return ds, ds, ("torchvision.datasets.ImageFolder + torchvision.transforms (RandomResizedCrop(224), "
                        "RandomHorizontalFlip(), ToTensor(), Normalize()), the same object for both loaders")
    from . import ImageFolder
    from . import transforms as T

    mine = ImageFolder(root, transform=T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                                                  T.Normalize(MEAN, STD)]))
    return _HandWrittenFolder(root), mine, (
        "torchvision does not import here, so torch reads the same PIL pipeline written by hand "
        "(ImageFolder + RandomResizedCrop(224), RandomHorizontalFlip(), ToTensor(), Normalize()) "
        "and coordl its namesakes coordl.ImageFolder + coordl.transforms")


def _time_epochs(loader, epochs: int) -> tuple[float, int]:
    n = 0
    t0 = time.perf_counter()
    for _ in range(epochs):
        for images, _labels in loader:
            n += images.shape[0]
    return time.perf_counter() - t0, n


DEFAULT_IMAGES = 600
# written into a --root folder once the demo has generated its images there:
# what it holds, so a later run can reuse it knowingly (or refuse)
MARKER = ".coordl-demo.json"


class DemoRootError(ValueError):
    """``--root`` names a folder the demo will not use (nothing was written)."""


def _prepare_root(root: str, images: int | None) -> None:
    """Generate the demo's images in ``root`` (new or empty), or reuse the
    ones an earlier ``coordl demo --root`` generated there, saying so.

    Refused (:class:`DemoRootError`, nothing written): a folder with other contents (the
    demo never writes into, or reads as its dataset, a folder it did not
    make), and a demo folder whose image count differs from ``images``."""
    import json

    from .synth import make_image_folder

    if os.path.exists(root) and not os.path.isdir(root):
        raise DemoRootError(f"--root {root} exists and is not a directory: pass a new or empty directory")
    marker = os.path.join(root, MARKER)
    if os.path.isdir(root) and os.listdir(root):
        try:
            with open(marker) as f:
                made = json.load(f)
            held = int(made["images"])
        except (OSError, ValueError, KeyError, TypeError):
            raise DemoRootError(
                f"--root {root} is not empty and was not made by coordl demo: the demo generates its "
                "images into a new or empty directory and does not use or touch other folders. Pass a "
                "new directory (it is kept afterwards), or leave --root out (a temporary directory, "
                "removed afterwards)") from None
        if images is not None and images != held:
            raise DemoRootError(
                f"--root {root} holds the {held} images an earlier coordl demo generated, not "
                f"--images {images}: pass --images {held} (or leave --images out) to reuse them, or "
                f"another --root for {images} new images (or remove {root} first)")
        print(f"reusing the {held} photo-like JPEGs coordl demo generated earlier in {root} "
              f"(a new --root generates new ones)")
        return
    images = DEFAULT_IMAGES if images is None else images
    t0 = time.perf_counter()
    make_image_folder(root, num_images=images, num_classes=10, seed=0)
    with open(marker, "w") as f:
        json.dump({"images": images, "classes": 10, "seed": 0}, f)
    print(f"generated {images} photo-like JPEGs in {root} ({time.perf_counter() - t0:.1f}s)")


def run_demo(root: str | None = None, images: int | None = None, epochs: int = 2,
             workers: int = 2, batch_size: int = 32) -> dict:
    """``images``: how many to generate (default 600); with ``root`` a folder
    an earlier demo generated, None reuses what it holds."""
    from torch.utils.data import DataLoader as TorchDataLoader

    from . import DataLoader, ImageFolder

    tmp = None
    if root is None:
        tmp = tempfile.mkdtemp(prefix="coordl-demo-")
        root = os.path.join(tmp, "photos")
    try:
        _prepare_root(root, images)
        torch_ds, ds, what = _datasets(root)
        total_bytes = sum(os.path.getsize(p) for p, _ in torch_ds.samples)
        print(f"dataset: {len(torch_ds)} images, {len(torch_ds.classes)} classes, {total_bytes / 2**20:.1f} MiB")
        print(f"pipeline: {what}")
        print(f"loaders: batch_size={batch_size}, num_workers={workers}, shuffle=True, {epochs} epochs each\n")

        # the timed runs: the same call on both classes, torch's RNG seeded the same before each
        kwargs = dict(batch_size=batch_size, shuffle=True, num_workers=workers)
        torch.manual_seed(0)
        torch_loader = TorchDataLoader(torch_ds, **kwargs)
        t_torch, n_torch = _time_epochs(torch_loader, epochs)
        del torch_loader
        torch.manual_seed(0)
        loader = DataLoader(ds, **kwargs)
        t_coordl, n_coordl = _time_epochs(loader, epochs)
        st, seed = loader.stats(), loader.seed
        del loader

        r_torch, r_coordl = n_torch / t_torch, n_coordl / t_coordl
        print(f"{'loader':<28}{'images':>8}{'seconds':>10}{'images/s':>11}")
        print(f"{'torch.utils.data.DataLoader':<28}{n_torch:>8}{t_torch:>10.2f}{r_torch:>11.1f}")
        print(f"{'coordl.DataLoader':<28}{n_coordl:>8}{t_coordl:>10.2f}{r_coordl:>11.1f}")
        same = ("the same dataset object and arguments: only the DataLoader import differs" if torch_ds is ds else
                "the same arguments; torch reads the hand-written PIL pipeline, coordl its namesakes")
        print(f"coordl / torch throughput: {r_coordl / r_torch:.2f}x ({same})\n")

        print("what coordl did:")
        print(f"  path: {st.path} ({st.path_reason})")
        print(f"  order: epoch plan, seed={seed} (drawn from torch's RNG; epoch e's order is a pure function "
              "of (seed, e))")
        print(f"  samples delivered: {st.samples} in {st.batches} batches over {len(st.epochs)} epochs")
        print(f"  time the loop waited for data: {st.wait_seconds:.2f}s; busy: fetch {st.fetch_seconds:.2f}s, "
              f"prep {st.prep_seconds:.2f}s (summed over workers)")

        # The node cache: one more argument, two epochs (the second reads what the first kept).
        cached = DataLoader(ds, cache_size=total_bytes // 2, **kwargs)
        for _ in range(2):
            for _batch in cached:
                pass
        print(f"  with cache_size={total_bytes // 2} (half the dataset; MinIO: what the first epoch reads "
              "stays, nothing is evicted):")
        for e in cached.stats().epochs:
            print(f"    epoch {e.epoch}: raw bytes {e.bytes_from_storage / 2**20:.1f} MiB from storage, "
                  f"{e.bytes_from_cache / 2**20:.1f} MiB from the node cache")
        del cached

        # Resume: stop mid-epoch, restore in a fresh loader, compare with an uninterrupted run.
        ref = DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers, seed=7)
        want = [labels for _, labels in ref]
        del ref
        cut = max(1, len(want) // 3)
        a = DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers, seed=7)
        it = iter(a)
        got = [next(it)[1] for _ in range(cut)]
        state = a.state_dict()
        del it, a
        b = DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers)
        b.load_state_dict(state)
        got += [labels for _, labels in b]
        del b
        same = len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want))
        print(f"  resume: stopped after batch {cut} of {len(want)}, restored into a new loader: "
              f"{'identical to an uninterrupted epoch' if same else 'MISMATCH'}")
        return {"torch_images_per_s": r_torch, "coordl_images_per_s": r_coordl, "resume_exact": same,
                "path": st.path, "path_reason": st.path_reason}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
