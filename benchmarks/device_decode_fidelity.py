"""How far ``decode="device"`` is from the CPU path, per channel value.

Same files, same seed: each image goes through ``coordl.DataLoader`` with
``decode="cpu"`` (the fused CPU path: full-size decode with libjpeg's
interpolated chroma upsampling, PIL's resampling arithmetic) and with
``decode="device"``; the pipelines end in
``PILToTensor`` so the difference is in uint8 levels, exactly what it is
before ``ToTensor``/``Normalize`` (which run the CPU path's arithmetic on
both sides).  Reported: max and mean absolute difference over every
channel value, and the share of values that differ by more than 8.

Decoders compared:

* ``stand-in``: the CPU standing in for the GPU (CI's ``HostDecoder``):
  libjpeg-turbo, full size, plain chroma upsampling, as nvJPEG does by
  default (torchvision's GPU decode);
* ``stand-in fancy``: the same with libjpeg's interpolated chroma
  upsampling (what nvImageCodec is asked for, ``fancy_upsampling=1``):
  both sides decode the same pixels, so this is the resize's arithmetic
  alone (the device's float antialiased resize against PIL's), the floor
  of the comparison;
* ``cuda torchvision``/``cuda nvimgcodec``/``cuda nvimgcodec-hw``/``cuda
  nvimgcodec-hybrid`` (``--device cuda``): the real decoders (the last two:
  nvImageCodec with the GPU's hardware decoder first, and its hybrid
  decoder);
* ``CPU path vs PIL`` and ``stand-in vs PIL``: each against what
  torchvision's ``ImageFolder`` gives (PIL decodes the whole image, PIL
  resizes), same draws: which of the two is nearer the reference.

    python benchmarks/device_decode_fidelity.py                 # CPU stand-in, three image sizes
    python benchmarks/device_decode_fidelity.py --device cuda   # also the GPU decoders
    python benchmarks/device_decode_fidelity.py --quick         # tiny smoke run (tests use it)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import coordl  # noqa: E402
from coordl import transforms as T  # noqa: E402
from coordl.datasets import pil_decode  # noqa: E402
from coordl.device import decode as DD  # noqa: E402
from coordl.device import delivery as D  # noqa: E402

SIZES = {"small": (96, 72), "imagenet": None, "large": (2048, 1536)}   # None: synth's ImageNet-like mix
PIPELINES = {
    "rrc224+flip": lambda: T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()]),
    "resize256+center224": lambda: T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()]),
}


def _pil(raw):
    return pil_decode(raw)


def _diffs(ds, device: str | None, decoder, batch_size: int, ref_ds=None) -> torch.Tensor:
    """|device path - CPU path| over every channel value of ``ds``, as int
    (``device=None``: the CPU path itself); ``ref_ds``: compare with this
    dataset's CPU path instead (the PIL reference)."""
    kw = dict(batch_size=batch_size, seed=3, shuffle=False)
    ref = coordl.DataLoader(ref_ds if ref_ds is not None else ds, **kw)
    if device is None:
        dev = coordl.DataLoader(ds, **kw)
    else:
        dev = coordl.DataLoader(ds, device=device, decode="device", **kw)
        dev._decoder = decoder
    out = []
    for (a, _), (b, _) in zip(ref, dev):
        out.append((a.int() - b.cpu().int()).abs().flatten())
    return torch.cat(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=48, help="images per size (large: a quarter)")
    ap.add_argument("--device", default=None, help="also measure the decoders of this CUDA device")
    ap.add_argument("--out", default=None, help="write the table (Markdown) here too")
    ap.add_argument("--quick", action="store_true", help="a few small images: a smoke test")
    args = ap.parse_args(argv)
    sizes = {"small": (96, 72), "large": (480, 360)} if args.quick else SIZES
    if args.quick:
        args.images = 4
    from coordl.synth import make_image_folder

    D.CPU_TEST_DEVICE = True
    variants = [("stand-in", "cpu", lambda: DD.HostDecoder()),
                ("stand-in fancy", "cpu", lambda: DD.HostDecoder(fancy_upsampling=True))]
    if args.device:
        dev = torch.device(args.device)
        variants.append((f"{dev} torchvision", str(dev), lambda: DD.TorchvisionDecoder(dev)))
        try:
            DD.NvImageCodecDecoder(dev)
            variants.append((f"{dev} nvimgcodec", str(dev), lambda: DD.NvImageCodecDecoder(dev)))
            for v in ("nvimgcodec-hw", "nvimgcodec-hybrid"):
                variants.append((f"{dev} {v}", str(dev), lambda v=v: DD.NvImageCodecDecoder(dev, variant=v)))
        except Exception as e:  # noqa: BLE001 - not installed
            print(f"(nvImageCodec not measured: {type(e).__name__}: {e})")
    rows = ["| images | pipeline | decoder | max | mean | > 8 levels |", "| --- | --- | --- | ---: | ---: | ---: |"]
    with tempfile.TemporaryDirectory() as tmp:
        for size_name, size in sizes.items():
            n = max(4, args.images // 4) if size_name == "large" else args.images
            root = make_image_folder(os.path.join(tmp, size_name), num_images=n, num_classes=2, image_size=size,
                                     seed=5, mean_kb=110.0 if size is None else 110.0 * size[0] * size[1] / 187500)
            for pipe_name, make in PIPELINES.items():
                ds = coordl.ImageFolder(root, make())
                # torchvision's own result: PIL decodes the whole image, PIL resizes (same draws)
                pil = coordl.ImageFolder(root, make(), decode=_pil)
                runs = [(name, _diffs(ds, device, decoder(), batch_size=8)) for name, device, decoder in variants]
                runs += [("CPU path vs PIL", _diffs(ds, None, None, 8, ref_ds=pil)),
                         ("stand-in vs PIL", _diffs(ds, "cpu", DD.HostDecoder(), 8, ref_ds=pil))]
                for name, d in runs:
                    row = (f"| {size_name} | {pipe_name} | {name} | {int(d.max())} | {float(d.float().mean()):.3f} "
                           f"| {float((d > 8).float().mean()):.2%} |")
                    rows.append(row)
                    print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
