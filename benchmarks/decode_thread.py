"""What ``decode="device"``'s decode thread spends taking the next batch in.

On a GPU the decode thread (``coordl-device-decode``) bounds delivery: it
should spend its time in the decoder's calls.  This measures the CPU time
that thread spends in ``next()`` on the pass below it (the workers' batches
taken in: their messages, their slots; or, where a fetch thread does that,
a queue's hand-over), per batch and per image, over a pass on the CPU
stand-in.  Run it on two checkouts to compare.

    python -m coordl.synth bench_data/photos --images 2000
    python benchmarks/decode_thread.py --root bench_data/photos --workers 2
    python benchmarks/decode_thread.py --quick          # tiny smoke run (tests use it)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import coordl  # noqa: E402
from coordl import transforms as T  # noqa: E402
from coordl.device import pin as P  # noqa: E402


class _Timed:
    """``inner`` with the calling thread's CPU and wall time in ``next()`` counted."""

    def __init__(self, inner) -> None:
        self.inner, self.cpu, self.wall, self.batches = inner, 0.0, 0.0, 0

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self.inner)

    def __next__(self):
        c, w = time.thread_time(), time.perf_counter()
        try:
            return next(self.inner)
        finally:
            self.cpu += time.thread_time() - c
            self.wall += time.perf_counter() - w
            self.batches += 1

    def __getattr__(self, name):
        return getattr(self.inner, name)


def measure(root: str, workers: int, batch: int, images: int, size: int) -> dict:
    timers: list = []
    real = P.PinThread

    class Watched(real):
        def __init__(self, inner, depth, stage=None, name="coordl-pin-memory"):
            if name == "coordl-device-decode":
                inner = _Timed(inner)
                timers.append(inner)
            super().__init__(inner, depth, stage, name)

    P.PinThread = Watched
    try:
        tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        L = coordl.DataLoader(coordl.ImageFolder(root, tf), batch_size=batch, shuffle=True, seed=1,
                              num_workers=workers, device="cpu", decode="device")
        n = 0
        for _, y in L:
            n += len(y)
            if n >= images:
                break
    finally:
        P.PinThread = real
    t = timers[0]
    return {"batches": t.batches, "images": n, "cpu_ms_per_batch": round(t.cpu / t.batches * 1e3, 3),
            "cpu_us_per_image": round(t.cpu / max(t.batches * batch, 1) * 1e6, 2),
            "wall_ms_per_batch": round(t.wall / t.batches * 1e3, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=None, help="an ImageFolder of JPEGs (default: generated, ImageNet-like)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--images", type=int, default=1500, help="images taken from the pass")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the script")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root
        if root is None or args.quick:
            from coordl.synth import make_image_folder

            root = os.path.join(tmp, "photos")
            kw = {"image_size": (64, 48), "mean_kb": 3} if args.quick else {}
            make_image_folder(root, num_images=48 if args.quick else 2000, num_classes=2, seed=3, **kw)
            if args.quick:
                args.batch_size, args.images, args.size = 8, 40, 16
        r = measure(root, args.workers, args.batch_size, args.images, args.size)
    print(f"decode thread, taking the next batch in: {r['cpu_ms_per_batch']:.3f} ms of CPU per batch of "
          f"{args.batch_size} ({r['cpu_us_per_image']:.2f} us per image; {r['wall_ms_per_batch']:.2f} ms wall, "
          f"waits included), {r['batches']} batches, {args.workers} workers", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
