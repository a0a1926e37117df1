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

__all__ = ["run_demo"]


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


def run_demo(root: str | None = None, images: int = 600, epochs: int = 2,
             workers: int = 2, batch_size: int = 32) -> dict:
    from torch.utils.data import DataLoader as TorchDataLoader

    from . import DataLoader, ImageFolder
    from .synth import make_image_folder

    tmp = None
    if root is None:
        tmp = tempfile.mkdtemp(prefix="coordl-demo-")
        root = os.path.join(tmp, "photos")
    try:
        if not os.path.isdir(root) or not os.listdir(root):
            t0 = time.perf_counter()
            make_image_folder(root, num_images=images, num_classes=10, seed=0)
            print(f"generated {images} photo-like JPEGs in {root} ({time.perf_counter() - t0:.1f}s)")
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
