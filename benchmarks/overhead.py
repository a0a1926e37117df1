"""Per-batch overhead of coordl.DataLoader vs torch's DataLoader on a trivial
in-memory dataset (TensorDataset), at 0 and 2 workers.

Both loaders run interleaved in one process, several rounds each, so drift on
this noisy machine hits both alike; the figure is the ratio of median
per-batch times (torch / coordl: >= 1.0 means coordl is not slower).

    python benchmarks/overhead.py            # full run (~1 min)
    python benchmarks/overhead.py --quick    # seconds; used by the tests
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import TensorDataset

import coordl


def _epoch_seconds(loader) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for _ in loader:
        n += 1
    return time.perf_counter() - t0, n


def measure(num_samples: int, batch_size: int, workers: int, rounds: int, shuffle: bool) -> dict:
    ds = TensorDataset(torch.randn(num_samples, 3, 8, 8), torch.randint(0, 10, (num_samples,)))
    kw = dict(batch_size=batch_size, shuffle=shuffle, num_workers=workers,
              persistent_workers=workers > 0)
    loaders = {"torch": TorchDataLoader(ds, **kw), "coordl": coordl.DataLoader(ds, **kw)}
    for L in loaders.values():  # warm up: start workers, fill caches
        _epoch_seconds(L)
    per_batch = {k: [] for k in loaders}
    for _ in range(rounds):
        for name, L in loaders.items():
            secs, n = _epoch_seconds(L)
            per_batch[name].append(secs / n)
    med = {k: statistics.median(v) for k, v in per_batch.items()}
    del loaders
    return {
        "workers": workers,
        "batch_size": batch_size,
        "samples": num_samples,
        "torch_us_per_batch": med["torch"] * 1e6,
        "coordl_us_per_batch": med["coordl"] * 1e6,
        "ratio_torch_over_coordl": med["torch"] / med["coordl"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.rounds = 512, 2
    rows = [measure(args.samples, args.batch_size, w, args.rounds, shuffle=True) for w in (0, 2)]
    print(f"TensorDataset({args.samples} x [3,8,8] float + int label), batch_size={args.batch_size}, "
          f"shuffle=True, {args.rounds} rounds interleaved, median per-batch time")
    print(f"{'workers':>8}{'torch us/batch':>16}{'coordl us/batch':>17}{'torch/coordl':>14}")
    for r in rows:
        print(f"{r['workers']:>8}{r['torch_us_per_batch']:>16.1f}{r['coordl_us_per_batch']:>17.1f}"
              f"{r['ratio_torch_over_coordl']:>14.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
