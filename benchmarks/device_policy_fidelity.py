"""How far ``decode="device"`` with torchvision's auto-augment policies is
from the CPU path, per channel value and per operation.

Same files, same seed: torchvision's ``ImageFolder`` with
``RandomResizedCrop``, ``RandomHorizontalFlip``, a policy
(``TrivialAugmentWide``, ``RandAugment``, ``AutoAugment``, ``AugMix``; v1 and v2;
timm's ``rand-m9-mstd0.5`` and ``original`` where timm imports),
``PILToTensor``, through ``coordl.DataLoader`` with ``decode="cpu"`` (the
policy as written on the PIL image of the fused crop) and with
``decode="device"`` on the CPU stand-in with libjpeg's interpolated chroma
upsampling (both sides decode the same pixels, so what is left is the
geometry's 1-level rounding and what the policy's operations make of it:
the device computes each operation with PIL's arithmetic, bit for bit on
its own rows, which the tests check).  Reported per policy: the share of
values more than 1 level off, the mean and the max absolute difference;
for ``TrivialAugmentWide`` (one operation a sample) per operation too.
With ``tensor``: the reference preset's ``backend="tensor"``
(``PILToTensor`` before an antialiased bilinear ``RandomResizedCrop``,
the flip, the policy interpolating bilinearly, as the preset passes its
interpolation): on the CPU path the policy runs as written on the crop's
tensor, with torchvision's tensor functions; on the device those very
functions run on the device's rows.
Last, ``GaussianBlur``: the GPU's way of blurring (one grouped convolution
in double precision with torchvision's own float32 weights), run here on
the CPU, against torchvision's own blur of the same rows.
On a GPU the decoder's own difference adds to this (section 9's table).

    python -m coordl.synth /tmp/synth600 --images 600
    python benchmarks/device_policy_fidelity.py --root /tmp/synth600 --seeds 2
    python benchmarks/device_policy_fidelity.py --root /tmp/synth600 --seeds 2 --policies AugMix   # some rows
    python benchmarks/device_policy_fidelity.py --root /tmp/synth600 --seeds 2 --policies tensor   # backend="tensor"
    python benchmarks/device_policy_fidelity.py --quick        # tiny smoke run (tests use it)
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import common  # noqa: E402
import coordl  # noqa: E402
from coordl import _rng  # noqa: E402
from coordl.decode import color as C  # noqa: E402
from coordl.device import decode as DD  # noqa: E402
from coordl.device import delivery as D  # noqa: E402
from coordl.device import encoded as E  # noqa: E402

POLICIES = {"TrivialAugmentWide": lambda M: M.TrivialAugmentWide(), "RandAugment": lambda M: M.RandAugment(),
            "AutoAugment": lambda M: M.AutoAugment(), "AugMix": lambda M: M.AugMix()}
# timm's (--aa): RandAugment at m9 with noise (without timm's "inc1" variant, whose posterize at 0 bits this
# PIL refuses on either path), and AutoAugment's original policy; a bilinear or bicubic filter drawn per
# geometric operation, timm's default; and "3a", DeiT III's three augmentations (solarize, desaturate, PIL's
# Gaussian blur at a drawn radius); and its AugMix (three chains of its operations, mixed and blended)
TIMM = {"rand-m9-mstd0.5": "rand_augment_transform", "original": "auto_augment_transform",
        "3a": "auto_augment_transform", "augmix-m3-w3": "augment_and_mix_transform"}
NAMES = {C.BRIGHTNESS: "Brightness", C.CONTRAST: "Contrast", C.SATURATION: "Color", C.SHARPNESS: "Sharpness",
         C.POSTERIZE: "Posterize", C.SOLARIZE: "Solarize", C.AUTOCONTRAST: "AutoContrast", C.EQUALIZE: "Equalize",
         C.INVERT: "Invert", C.AFFINE: "shear, translation or rotation", C.TRANSPOSE: "quarter turn"}


def measure(root: str, policy: str, version: str, size: int, seeds: int, workers: int,
            tensor: bool = False) -> tuple:
    """(every sample's |CPU path - device| values, {operation: values}) for
    one policy; ``tensor``: given the crop's tensor (the reference preset's
    ``backend="tensor"``)."""
    common.torchvision()
    from torchvision import datasets

    M = importlib.import_module("torchvision.transforms" if version in ("v1", "timm") else "torchvision.transforms.v2")
    if version == "timm":
        A = importlib.import_module("timm.data.auto_augment")
        t = getattr(A, TIMM[policy])(policy, {})
    else:
        t = POLICIES[policy](M)
    if tensor:
        t = getattr(M, type(t).__name__)(interpolation=M.InterpolationMode.BILINEAR)
        tf = M.Compose([M.PILToTensor(), M.RandomResizedCrop(size, antialias=True), M.RandomHorizontalFlip(), t,
                        M.ToDtype(torch.uint8) if version == "v2" else M.ConvertImageDtype(torch.uint8)])
    else:
        tf = M.Compose([M.RandomResizedCrop(size), M.RandomHorizontalFlip(), t, M.PILToTensor()])
    ds = datasets.ImageFolder(root, transform=tf)
    every, per_op = [], collections.defaultdict(list)
    for seed in range(seeds):
        kw = dict(batch_size=16, seed=seed, shuffle=False, num_workers=workers)
        cpu = torch.cat([a for a, _ in coordl.DataLoader(ds, **kw)])
        L = coordl.DataLoader(ds, device="cpu", decode="device", **kw)
        dev = torch.cat([a for a, _ in L])
        plan, mine = E.plan_for(L.dataset.transform), L.dataset
        for i in range(len(ds)):
            d = (cpu[i].int() - dev[i].int()).abs().flatten()
            every.append(d)
            raw = mine.raw(i)
            hw = plan.device_size(raw, i)
            if policy == "TrivialAugmentWide" and hw is not None and not tensor:
                g = _rng.derive(seed, 0, i)
                plan.draw(*hw, g)
                ops = plan.draw_ops(g)
                per_op[NAMES[ops[0][0]] if ops else "Identity"].append(d)
    return torch.cat(every), per_op


def blur_against_torchvision(trials: int, size: int) -> tuple:
    """``(values differing, values, largest difference)``: the GPU's way of
    blurring (``coordl.device.pil_ops._blur``, grouped, double precision,
    run here on the CPU) against torchvision's own ``GaussianBlur`` of the
    same rows (23x23 kernels, sigmas drawn in 0.1-2.0), on noise and on
    images of a few flat levels (sums near halves)."""
    from coordl.device import pil_ops as P

    common.torchvision()
    F = importlib.import_module("torchvision.transforms._functional_tensor")
    g = torch.Generator().manual_seed(0)
    differ = total = most = 0
    for trial in range(trials):
        x = torch.randint(0, 256, (1, 3, size, size), dtype=torch.uint8, generator=g)
        if trial % 2:
            x = x // 40 * 40
        sigma = float(torch.empty(1).uniform_(0.1, 2.0, generator=g))
        want = F.gaussian_blur(x[0], [23, 23], [sigma, sigma])
        got = P._blur(x, [(23, 23, sigma, sigma, 0)], grouped=True)[0]
        d = (want.int() - got.int()).abs()
        differ, total, most = differ + int((d > 0).sum()), total + d.numel(), max(most, int(d.max()))
    return differ, total, most


def _row(label: str, d: torch.Tensor, n: int) -> str:
    d = d.float()
    return (f"| {label} | {n} | {float((d > 1).float().mean()):.2%} | {float(d.mean()):.3f} | {int(d.max())} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=None, help="an ImageFolder of JPEGs (default: synthetic ImageNet-like ones)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--seeds", type=int, default=2, help="passes over the folder, each with its own seed")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a few small images: a smoke test")
    ap.add_argument("--policies", default=",".join(POLICIES) + ",timm,tensor,blur",
                    help="the rows to measure, comma-separated: torchvision's policies, timm, tensor (each "
                         "policy given a tensor), blur")
    args = ap.parse_args(argv)
    wanted = set(args.policies.split(","))
    if common.torchvision() is None:
        print("torchvision is not installed: nothing to measure")
        return 0
    D.CPU_TEST_DEVICE = True
    DD.decoder_for = lambda dev, **kw: DD.HostDecoder(dev, fancy_upsampling=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root
        if root is None:
            from coordl.synth import make_image_folder

            n, size = (8, (96, 72)) if args.quick else (96, None)
            root = make_image_folder(os.path.join(tmp, "photos"), num_images=n, num_classes=2, image_size=size,
                                     seed=5, mean_kb=6.0 if args.quick else 110.0)
        if args.quick:
            args.size, args.seeds = 32, 1
        print("| policy | samples | values > 1 level off | mean | max |\n|---|---:|---:|---:|---:|", flush=True)
        per_op_rows = []
        for policy in (p for p in POLICIES if p in wanted):
            for version in ("v1", "v2"):
                d, per_op = measure(root, policy, version, args.size, args.seeds, args.workers)
                n = d.numel() // (3 * args.size * args.size)
                print(_row(f"`{policy}` {version}", d, n), flush=True)
                if per_op and version == "v1":
                    per_op_rows = [_row(name, torch.cat(v), len(v)) for name, v in sorted(per_op.items())]
        for policy in (POLICIES if "tensor" in wanted else ()):
            for version in ("v1", "v2"):
                d, _ = measure(root, policy, version, args.size, args.seeds, args.workers, tensor=True)
                print(_row(f"`{policy}` {version}, given a tensor", d, d.numel() // (3 * args.size * args.size)),
                      flush=True)
        try:
            importlib.import_module("timm.data.auto_augment")
        except ImportError:
            pass
        else:
            for policy in (TIMM if "timm" in wanted else ()):
                d, _ = measure(root, policy, "timm", args.size, args.seeds, args.workers)
                print(_row(f"timm `{policy}`", d, d.numel() // (3 * args.size * args.size)), flush=True)
        if per_op_rows:
            print("\n| `TrivialAugmentWide` v1, by operation | samples | values > 1 level off | mean | max |\n"
                  "|---|---:|---:|---:|---:|")
            print("\n".join(per_op_rows))
        if "blur" in wanted:
            differ, total, most = blur_against_torchvision(4 if args.quick else 20, 48 if args.quick else 224)
            print(f"\nGaussianBlur, the GPU's way (double precision) against torchvision's own: {differ} of {total} "
                  f"values differ, by at most {most}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
