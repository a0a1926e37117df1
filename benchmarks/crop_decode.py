"""Prep time per sample with and without the crop-window JPEG decode.

The fused RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor path, one
process, one thread, on an ImageFolder of JPEGs: each round runs every image
once with the window decode (coordl.decode._jpegcrop) and once with the whole-image
decode (the path it replaces), in alternating order; the figure is the median
over rounds.  Then the pixel difference between the two paths, per sample,
with the same (seed, epoch, index) draws.

    python -m coordl.synth /tmp/crop_data --images 300
    python benchmarks/crop_decode.py /tmp/crop_data --rounds 7
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from coordl import _rng  # noqa: E402
from coordl.decode import jpeg as _decode  # noqa: E402
from coordl import transforms as T  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", help="a folder of JPEGs (searched recursively)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args(argv)
    crop = _decode._crop
    if crop is None:
        print("coordl.decode._jpegcrop is not available (not built, or COORDL_CROP_DECODE=0)")
        return 1
    threads = torch.get_num_threads()
    files = sorted(glob.glob(os.path.join(args.root, "**", "*.jp*g"), recursive=True))
    if not files:
        print(f"no JPEGs under {args.root}")
        return 1
    raws = []
    for f in files:
        with open(f, "rb") as fh:
            raws.append(fh.read())
    pipe = T.Compose([T.RandomResizedCrop(args.size), T.RandomHorizontalFlip(), T.ToTensor()])

    def run(mod) -> float:
        _decode._crop = mod
        t = time.perf_counter()
        for i, raw in enumerate(raws):
            with _rng.sample_rng(0, 0, i):
                pipe.from_bytes(raw)
        return (time.perf_counter() - t) / len(raws) * 1e6

    try:
        torch.set_num_threads(1)
        run(None), run(crop)  # warm up
        times = {"whole": [], "window": []}
        for r in range(args.rounds):
            order = [("whole", None), ("window", crop)]
            for name, mod in (order if r % 2 == 0 else order[::-1]):
                times[name].append(run(mod))
        w, c = statistics.median(times["whole"]), statistics.median(times["window"])
        print(f"{len(raws)} images, RandomResizedCrop({args.size})+flip+ToTensor, 1 thread, "
              f"median of {args.rounds} interleaved rounds:")
        print(f"  prep per sample: whole decode {w:.0f} us, window decode {c:.0f} us "
              f"({w / c:.2f}x, {100 * (1 - c / w):.0f}% less)")
        print("  rounds (us):", {k: [round(x) for x in v] for k, v in times.items()})

        same, worst, total = 0, 0.0, 0.0
        u8 = T.Compose([T.RandomResizedCrop(args.size), T.RandomHorizontalFlip(), T.PILToTensor()])
        for i, raw in enumerate(raws):
            outs = []
            for mod in (crop, None):
                _decode._crop = mod
                with _rng.sample_rng(0, 0, i):
                    outs.append((u8.from_bytes(raw), _rng.current().getstate()))
            (a, sa), (b, sb) = outs
            if sa != sb:
                print(f"  sample {i}: the two paths drew different numbers")
                return 1
            d = (a.int() - b.int()).abs()
            same += bool(torch.equal(a, b))
            worst = max(worst, float(d.max()))
            total += float(d.float().mean())
        print(f"  pixels (uint8 output): identical in {same}/{len(raws)} samples, "
              f"max |diff| {worst:.0f}, mean |diff| {total / len(raws):.4f}")
    finally:
        _decode._crop = crop
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
