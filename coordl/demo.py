"""The README's first command: a small end-to-end run on generated photos.

Generates a photo-like JPEG ImageFolder, trains nothing, and reads it a few
epochs through torch's DataLoader and through coordl with the same transforms,
workers and batch size; then shows what coordl did (plan, stats) and a
mid-epoch save/restore that continues exactly where it stopped.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

__all__ = ["run_demo", "DemoRootError"]


def _pipeline():
    from . import transforms as T

    return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])


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
        tf = _pipeline()
        ds = ImageFolder(root, transform=tf)
        total_bytes = int(ds.sizes.sum())
        print(f"dataset: {len(ds)} images, {len(ds.classes)} classes, {total_bytes / 2**20:.1f} MiB")
        print(f"pipeline: {tf!r}")
        print(f"loaders: batch_size={batch_size}, num_workers={workers}, {epochs} epochs each\n")

        torch.manual_seed(0)
        torch_loader = TorchDataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers)
        t_torch, n_torch = _time_epochs(torch_loader, epochs)
        del torch_loader

        loader = DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers, seed=0,
                            cache_size=total_bytes // 2)  # a node cache for half the dataset
        t_coordl, n_coordl = _time_epochs(loader, epochs)
        st = loader.stats()
        del loader

        r_torch, r_coordl = n_torch / t_torch, n_coordl / t_coordl
        print(f"{'loader':<28}{'images':>8}{'seconds':>10}{'images/s':>11}")
        print(f"{'torch.utils.data.DataLoader':<28}{n_torch:>8}{t_torch:>10.2f}{r_torch:>11.1f}")
        print(f"{'coordl.DataLoader':<28}{n_coordl:>8}{t_coordl:>10.2f}{r_coordl:>11.1f}")
        print(f"coordl / torch throughput: {r_coordl / r_torch:.2f}x")
        print("(both read the same coordl.ImageFolder, decode included, so this is the loader alone;\n"
              " benchmarks/throughput.py compares with torch's usual PIL pipeline and with DALI)\n")

        print("what coordl did:")
        print("  order: epoch plan, seed=0 (epoch e's order is a pure function of (seed, e))")
        print(f"  samples delivered: {st.samples} in {st.batches} batches over {len(st.epochs)} epochs")
        for e in st.epochs:
            print(f"  epoch {e.epoch}: raw bytes {e.bytes_from_storage / 2**20:.1f} MiB from storage, "
                  f"{e.bytes_from_cache / 2**20:.1f} MiB from the node cache (MinIO, half the dataset)")
        print(f"  time the loop waited for data: {st.wait_seconds:.2f}s; busy: fetch {st.fetch_seconds:.2f}s, "
              f"prep {st.prep_seconds:.2f}s (summed over workers)")

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
        return {"torch_images_per_s": r_torch, "coordl_images_per_s": r_coordl, "resume_exact": same}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
