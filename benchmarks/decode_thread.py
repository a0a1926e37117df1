"""What ``decode="device"``'s decode thread spends outside the decoder's calls.

On a GPU the decode thread (``coordl-device-decode``) bounds delivery: it
should spend its time in the decoder's calls.  This measures, per batch and
per image over a pass on the CPU stand-in, the CPU time that thread spends
in ``next()`` on the pass below it (the workers' batches taken in: their
messages, their slots; or, where a fetch thread does that, a queue's
hand-over), and its whole CPU outside the decoder's calls (``next()`` and
the stage's own work: the records, the streams, the rows the workers
prepared).  ``--decoder`` sets ``COORDL_DEVICE_DECODER`` (e.g.
``torchvision:2+workers:1``: the workers prepare a third of the samples
with 2 workers).  Run it on two checkouts to compare.

    python -m coordl.synth bench_data/photos --images 2000
    python benchmarks/decode_thread.py --root bench_data/photos --workers 2
    python benchmarks/decode_thread.py --quick          # tiny smoke run (tests use it)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
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


class _Calls:
    """The calling thread's CPU inside the stage (``stage``) and inside the
    decoder's calls (``decode``), for the decode thread only."""

    def __init__(self) -> None:
        self.stage = self.decode = 0.0
        self.thread = None
        self.inside: set = set()      # a split's call holds its first decoder's: counted once

    def timed(self, fn, which: str):
        def wrapper(*a, **kw):
            if threading.get_ident() != self.thread or which in self.inside:
                return fn(*a, **kw)
            c = time.thread_time()
            self.inside.add(which)
            try:
                return fn(*a, **kw)
            finally:
                self.inside.discard(which)
                setattr(self, which, getattr(self, which) + time.thread_time() - c)
        return wrapper


def measure(root: str, workers: int, batch: int, images: int, size: int, decoder: str | None = None) -> dict:
    from coordl.device import decode as DD
    from coordl.device import decoders as DDS

    timers: list = []
    calls = _Calls()
    real = P.PinThread
    real_envelope = coordl.DataLoader._decode_envelope
    real_decoders = {c: c.decode for c in _decoder_classes(DDS)}

    def envelope(self, env, note):
        calls.thread = threading.get_ident()
        return calls.timed(real_envelope, "stage")(self, env, note)

    class Watched(real):
        def __init__(self, inner, depth, stage=None, name="coordl-pin-memory"):
            if name == "coordl-device-decode":
                inner = _Timed(inner)
                timers.append(inner)
            super().__init__(inner, depth, stage, name)

    P.PinThread = Watched
    coordl.DataLoader._decode_envelope = envelope
    for c, fn in real_decoders.items():
        c.decode = calls.timed(fn, "decode")
    saved = os.environ.get("COORDL_DEVICE_DECODER")
    if decoder:
        os.environ["COORDL_DEVICE_DECODER"] = decoder
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
        note = L.stats().device_decode
    finally:
        P.PinThread = real
        coordl.DataLoader._decode_envelope = real_envelope
        for c, fn in real_decoders.items():
            c.decode = fn
        if saved is None:
            os.environ.pop("COORDL_DEVICE_DECODER", None)
        else:
            os.environ["COORDL_DEVICE_DECODER"] = saved
    t = timers[0]
    outside = t.cpu + calls.stage - calls.decode
    return {"batches": t.batches, "images": n, "cpu_ms_per_batch": round(t.cpu / t.batches * 1e3, 3),
            "cpu_us_per_image": round(t.cpu / max(t.batches * batch, 1) * 1e6, 2),
            "wall_ms_per_batch": round(t.wall / t.batches * 1e3, 3),
            "outside_calls_ms_per_batch": round(outside / t.batches * 1e3, 3),
            "decoder_calls_ms_per_batch": round(calls.decode / t.batches * 1e3, 3), "decode": note}


def _decoder_classes(DDS) -> list:
    """The decoder classes whose ``decode`` is the decoder's call."""
    import inspect

    return [c for _, c in inspect.getmembers(DDS, inspect.isclass)
            if c.__module__ == DDS.__name__ and "decode" in c.__dict__]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=None, help="an ImageFolder of JPEGs (default: generated, ImageNet-like)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--images", type=int, default=1500, help="images taken from the pass")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--decoder", default=None, help="COORDL_DEVICE_DECODER for the pass (e.g. torchvision:2+workers:1)")
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
        r = measure(root, args.workers, args.batch_size, args.images, args.size, args.decoder)
    print(f"decode thread, taking the next batch in: {r['cpu_ms_per_batch']:.3f} ms of CPU per batch of "
          f"{args.batch_size} ({r['cpu_us_per_image']:.2f} us per image; {r['wall_ms_per_batch']:.2f} ms wall, "
          f"waits included), {r['batches']} batches, {args.workers} workers", flush=True)
    print(f"decode thread, outside the decoder's calls: {r['outside_calls_ms_per_batch']:.3f} ms of CPU per batch "
          f"(the calls: {r['decoder_calls_ms_per_batch']:.3f} ms); {r['decode']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
