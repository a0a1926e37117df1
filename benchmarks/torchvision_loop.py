"""The ordinary torchvision training loop, with only the DataLoader import
changed: torch's DataLoader vs coordl's, side by side in one run, for the
transforms v1 and v2 pipelines.

    ImageFolder(root, transform=Compose([RandomResizedCrop(224),
        RandomHorizontalFlip(), ToTensor(), Normalize(mean, std)]))
    DataLoader(ds, batch_size=64, shuffle=True, num_workers=2)

(v2: the same with ``ToImage()`` first and ``ToDtype(float32, scale=True)``
instead of ``ToTensor()``, as torchvision's docs write it.)  The loop body is
one function that receives the DataLoader class, so the two sides run the
same code.  Rounds alternate the order of the loaders; the ratio is the
median over rounds of coordl's images/s over torch's, over all timed epochs
(worker start-up included, as a user sees it) and over the epochs after the
first.

Checked on every timed epoch: every sample once with torchvision's targets
(coordl: the labels delivered equal ``ds.targets`` in the epoch plan's order,
which is a permutation); pixel statistics: the average over images of each
image's per-channel mean and std of the normalized pixels, coordl's against
torch's, within 4 standard errors (the two sides draw different crops),
computed from per-image sums (``--stats``: torch's ``std`` per image cost
~0.9 ms an image in the main process, on the workers' cores, for both
loaders alike).  The exit status is 1 when a check fails.

torchvision's PyPI wheel does not import beside a CPU build of torch (its
compiled operators need the CUDA build); this script then loads it the way
the test suite does (tests/_torchvision.py), which touches neither
torchvision nor coordl.

More sides, each run in every round, in rotating order: ``--draft`` adds
coordl with ``jpeg_draft=True`` (the reduced-scale JPEG decode); ``--old
PATH`` adds coordl imported from another source tree (a checkout of an
earlier commit, its extension built there), run in a child process, so that
a change of coordl's defaults is measured against the code before it in one
run.  Besides the training pipelines, ``--pipelines`` takes ``v1-eval``
(Resize(256), CenterCrop, ToTensor, Normalize: torchvision's eval preset)
and ``timm-eval`` (timm's bicubic eval with crop_pct 0.95); ``--image-size
WxH`` generates images of one size (large ones: 2000x1500).

    python -m coordl.synth bench_data/photos --images 2000
    python benchmarks/torchvision_loop.py --root bench_data/photos --epochs 2 --rounds 3
    python benchmarks/torchvision_loop.py --quick          # tiny smoke run (tests use it)
    git archive COMMIT | tar -x -C /tmp/old && (cd /tmp/old && python setup.py build_ext --inplace)
    python benchmarks/torchvision_loop.py --pipelines v1,v1-eval --draft --old /tmp/old

Writes bench_out/torchvision_loop.csv and bench_out/torchvision_loop.json.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import common  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _torchvision():
    common.torchvision()
    from torchvision import datasets, transforms
    from torchvision.transforms import v2

    return datasets, transforms, v2


def pipeline(kind: str, size: int):
    _, V1, V2 = _torchvision()
    if kind == "v1":
        return V1.Compose([V1.RandomResizedCrop(size), V1.RandomHorizontalFlip(), V1.ToTensor(),
                           V1.Normalize(MEAN, STD)])
    if kind == "v1-eval":  # torchvision's eval preset (references/classification)
        return V1.Compose([V1.Resize(size * 256 // 224), V1.CenterCrop(size), V1.ToTensor(),
                           V1.Normalize(MEAN, STD)])
    if kind == "timm-eval":  # timm's eval transform, bicubic, crop_pct 0.95
        return V1.Compose([V1.Resize(int(size / 0.95), interpolation=V1.InterpolationMode.BICUBIC),
                           V1.CenterCrop(size), V1.ToTensor(), V1.Normalize(MEAN, STD)])
    if kind != "v2":
        raise SystemExit(f"--pipelines should name v1, v2, v1-eval or timm-eval, but got {kind!r}")
    return V2.Compose([V2.ToImage(), V2.RandomResizedCrop(size), V2.RandomHorizontalFlip(),
                       V2.ToDtype(torch.float32, scale=True), V2.Normalize(MEAN, STD)])


def image_stats(images: torch.Tensor, how: str = "sums") -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's per-channel mean and standard deviation (n - 1), in float64.

    ``"sums"``: from the per-channel sum and sum of squares (float32 sums,
    the variance formed in float64; equal to ``"std"`` to ~1e-6 on
    normalized images), ~0.04 ms per 224x224 image.  ``"std"``: torch's
    ``images.std((2, 3))``, ~0.9 ms per image on the benchmark machine: in
    the main process, on the cores the workers need, that check alone took
    a quarter of the CPU of an epoch on both sides and hid the loaders'
    difference (the check, not the loader, is what changed)."""
    if how == "std":
        return images.mean((2, 3)).double(), images.std((2, 3)).double()
    flat = images.flatten(2)
    n = flat.shape[2]
    mean = flat.mean(2).double()
    squares = torch.linalg.vector_norm(flat, dim=2).double() ** 2
    var = (squares - n * mean * mean) / max(n - 1, 1)
    return mean, var.clamp_min(0).sqrt()


def training_loop(DataLoader, dataset, epochs: int, batch_size: int, workers: int, stats: str = "sums"):
    """What a user runs; only ``DataLoader`` differs.  Returns per-epoch
    (images, seconds, labels) (:func:`common.epoch`), each image's per-channel mean and std (the
    benchmark's check, :func:`image_stats`), and the loader."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers)
    means, stds = [], []

    def check(images):
        m, sd = image_stats(images, stats)
        means.append(m)
        stds.append(sd)

    out = [common.epoch(loader, check) for _epoch in range(epochs)]
    return out, torch.cat(means), torch.cat(stds), loader


def _compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(largest per-channel difference of the averages of two samples of
    per-image values, the same divided by its standard error)."""
    diff = (a.mean(0) - b.mean(0)).abs()
    se = (a.var(0) / len(a) + b.var(0) / len(b)).sqrt().clamp_min(1e-12)
    return float(diff.max()), float((diff / se).max())


_CHILD = """
import json, sys
sys.path.insert(0, {tree!r})
sys.path.insert(1, {here!r})
import torch
import coordl
import torchvision_loop as tl
assert coordl.__file__.startswith({tree!r}), coordl.__file__
datasets, _, _ = tl._torchvision()
ds = datasets.ImageFolder({root!r}, transform=tl.pipeline({kind!r}, {size!r}))
torch.manual_seed({rnd!r})
epochs, means, stds, loader = tl.training_loop(coordl.DataLoader, ds, {epochs!r}, {batch_size!r}, {workers!r},
                                               {stats!r})
want = torch.tensor(ds.targets)
once = all(sorted(loader.plan.indices(e).tolist()) == list(range(len(ds)))
           and torch.equal(lab, want[torch.as_tensor(loader.plan.indices(e))])
           for e, (_n, _s, lab) in enumerate(epochs))
st = loader.stats()
print("RESULT " + json.dumps({{"epochs": [[n, s] for n, s, _ in epochs], "once": once,
                              "means": means.tolist(), "stds": stds.tolist(),
                              "path": st.path + ": " + st.path_reason}}))
"""


def _side_in_child(tree: str, root: str, kind: str, rnd: int, args):
    """``training_loop`` with coordl imported from ``tree``, in a child
    process: (epochs as (images, seconds, None), means, stds, every sample
    once, path)."""
    import subprocess

    code = _CHILD.format(tree=os.path.abspath(tree), here=HERE, root=root, kind=kind, size=args.size, rnd=rnd,
                         epochs=args.epochs, batch_size=args.batch_size, workers=args.workers, stats=args.stats)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=3600)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    if res.returncode != 0 or line is None:
        raise SystemExit(f"the side from {tree} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    out = json.loads(line[len("RESULT "):])
    return ([(n, sec, None) for n, sec in out["epochs"]], torch.tensor(out["means"], dtype=torch.float64),
            torch.tensor(out["stds"], dtype=torch.float64), out["once"], out["path"])


def run(args) -> dict:
    import functools

    import coordl

    datasets, _, _ = _torchvision()
    size = {"image_size": (96, 128), "mean_kb": 6} if args.quick else {}
    if args.image_size is not None:
        w, h = args.image_size
        size = {"image_size": (w, h), "mean_kb": 110 * w * h / (500 * 375)}
    root = common.image_folder(args, "tvloop-", **size)
    loaders = {"torch": torch.utils.data.DataLoader, "coordl": coordl.DataLoader}
    if args.draft:
        loaders["coordl-draft"] = functools.partial(coordl.DataLoader, jpeg_draft=True)
    if args.old:
        loaders["coordl-old"] = None  # run in a child process, see _side_in_child
    sides = list(loaders)
    rows, checks = [], []
    for rnd in range(args.rounds):
        for kind in args.pipelines:
            # each side first in turn; every other cycle reversed, so the neighbours change too
            # (reversing every odd round undid the rotation of two sides: torch always ran first)
            order = sides[rnd % len(sides):] + sides[:rnd % len(sides)]
            if (rnd // len(sides)) % 2 == 1:
                order.reverse()
            stats = {}
            for name in order:
                if name == "coordl-old":
                    epochs, means, stds, once, path = _side_in_child(args.old, root, kind, rnd, args)
                else:
                    ds = datasets.ImageFolder(root, transform=pipeline(kind, args.size))
                    torch.manual_seed(rnd)
                    epochs, means, stds, loader = training_loop(loaders[name], ds, args.epochs, args.batch_size,
                                                              args.workers, args.stats)
                    if name == "torch":
                        once = all(common.every_sample_once(ds, lab) for _n, _s, lab in epochs)
                        path = "torch"
                    else:
                        st = loader.stats()
                        want = torch.tensor(ds.targets)
                        once = all(sorted(loader.plan.indices(e).tolist()) == list(range(len(ds)))
                                   and torch.equal(lab, want[torch.as_tensor(loader.plan.indices(e))])
                                   for e, (_n, _s, lab) in enumerate(epochs))
                        path = f"{st.path}: {st.path_reason}"
                    del loader
                n = sum(e[0] for e in epochs)
                sec = sum(e[1] for e in epochs)
                later = epochs[1:] or epochs  # without the first epoch (worker start-up) when there are more
                steady = sum(e[0] for e in later) / sum(e[1] for e in later)
                rows.append({"round": rnd, "pipeline": kind, "loader": name, "images": n,
                             "seconds": round(sec, 3), "images_per_s": round(n / sec, 1),
                             "images_per_s_after_first_epoch": round(steady, 1),
                             "every_sample_once": once, "mean": [round(v, 4) for v in means.mean(0).tolist()],
                             "std": [round(v, 4) for v in stds.mean(0).tolist()]})
                stats[name] = (means, stds)
                print(f"round {rnd} {kind} {name:<6} {n:>6} images {sec:>8.2f}s {n / sec:>8.1f} images/s "
                      f"once={once} mean={rows[-1]['mean']} std={rows[-1]['std']}"
                      + (f"\n    {path}" if name.startswith("coordl") else ""), flush=True)
            # the sides draw different crops: compare in units of the sampling noise
            for name in sides[1:]:
                dm, zm = _compare(stats[name][0], stats["torch"][0])
                dsd, zs = _compare(stats[name][1], stats["torch"][1])
                checks.append({"round": rnd, "pipeline": kind, "loader": name, "max_mean_diff": round(dm, 4),
                               "mean_z": round(zm, 2), "max_std_diff": round(dsd, 4), "std_z": round(zs, 2),
                               "match": zm < 4 and zs < 4})
                print(f"    pixel statistics, {name} vs torch: mean differs by {dm:.4f} ({zm:.1f} standard errors), "
                      f"std by {dsd:.4f} ({zs:.1f} s.e.)", flush=True)
    summary = {}
    for kind in args.pipelines:
        summary[kind] = {}
        for name in sides[1:]:
            ratios = common.round_ratios(rows, "pipeline", kind, name, "torch")
            steady = common.round_ratios(rows, "pipeline", kind, name, "torch", "images_per_s_after_first_epoch")
            key = "" if name == "coordl" else f"{name}_"
            summary[kind].update({
                f"{key}coordl_over_torch" if key else "coordl_over_torch": round(statistics.median(ratios), 3),
                f"{key}ratios": [round(r, 3) for r in ratios],
                f"{key}coordl_over_torch_after_first_epoch" if key else "coordl_over_torch_after_first_epoch":
                    round(statistics.median(steady), 3)})
            print(f"{kind}: {name} / torch throughput {statistics.median(ratios):.2f}x "
                  f"(rounds {[round(r, 3) for r in ratios]}; after the first epoch {statistics.median(steady):.2f}x)")
        for name in sides[2:]:  # the default against each other coordl side, round by round
            rel = common.round_ratios(rows, "pipeline", kind, "coordl", name)
            summary[kind][f"coordl_over_{name.replace('-', '_')}"] = round(statistics.median(rel), 3)
            print(f"{kind}: coordl (default) / {name} throughput {statistics.median(rel):.3f}x "
                  f"(rounds {[round(r, 3) for r in rel]})")
        summary[kind]["every_sample_once"] = all(x["every_sample_once"] for x in rows if x["pipeline"] == kind)
        summary[kind]["pixel_statistics_match"] = all(c["match"] for c in checks if c["pipeline"] == kind)
        print(f"{kind}: every sample once: {summary[kind]['every_sample_once']}, "
              f"pixel statistics match: {summary[kind]['pixel_statistics_match']}")
    return {"rows": rows, "checks": checks, "summary": summary,
            "settings": {"root": root, "batch_size": args.batch_size, "workers": args.workers, "stats": args.stats,
                         "epochs": args.epochs, "rounds": args.rounds, "size": args.size, "sides": sides,
                         "old": args.old, "image_size": args.image_size,
                         "cpus": os.cpu_count(), "torch": torch.__version__}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="ImageFolder root (default: generate one)")
    ap.add_argument("--images", type=int, default=2000, help="images to generate when --root is not given")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--pipelines", default="v1,v2")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--stats", choices=["sums", "std"], default="sums",
                    help="how the loop computes each image's pixel statistics for the check: from sums "
                         "(default, ~0.04 ms/image) or with torch's std (~0.9 ms/image in the main process, "
                         "as before 2026-11-24 evening)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    ap.add_argument("--draft", action="store_true", help="add a side: coordl with jpeg_draft=True")
    ap.add_argument("--old", default=None, metavar="PATH",
                    help="add a side: coordl imported from this source tree, in a child process")
    ap.add_argument("--image-size", default=None, metavar="WxH",
                    help="generate images of this one size (default: ImageNet-like sizes)")
    args = ap.parse_args(argv)
    args.pipelines = args.pipelines.split(",")
    if args.image_size is not None:
        try:
            args.image_size = tuple(int(v) for v in args.image_size.lower().split("x"))
            assert len(args.image_size) == 2 and min(args.image_size) > 0
        except (ValueError, AssertionError):
            ap.error(f"--image-size should be WxH, two positive ints, but got --image-size={args.image_size}")
    if args.quick:
        vars(args).update(common.QUICK)
    res = common.run_and_save(run, args, "torchvision_loop")
    with open(os.path.join(args.out, "torchvision_loop.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["round", "pipeline", "loader", "images", "seconds", "images_per_s",
                                          "images_per_s_after_first_epoch", "every_sample_once"])
        w.writeheader()
        for r in res["rows"]:
            w.writerow({k: r[k] for k in w.fieldnames})
    ok = all(s["every_sample_once"] and s["pixel_statistics_match"] for s in res["summary"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
