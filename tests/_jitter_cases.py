"""The batches and per-row ColorJitter operations the device jitter's tests
share (tests/test_device_jitter.py, its kernel's child, tests/test_cuda.py)."""
import random

import numpy as np
import torch
from PIL import Image

from coordl.decode import color as C


def random_ops(rng: random.Random, least: int = 0) -> list:
    """``least`` to four of ColorJitter's operations in a random order:
    factors from 0 to 2.5, any hue turn."""
    ops = [(C.BRIGHTNESS, rng.uniform(0.0, 2.5)), (C.CONTRAST, rng.uniform(0.0, 2.5)),
           (C.SATURATION, rng.uniform(0.0, 2.5)), (C.HUE, rng.randrange(256))]
    rng.shuffle(ops)
    return ops[:rng.randrange(least, 5)]


def batch(seed: int, n: int, h: int, w: int) -> tuple:
    """``(y, ops)``: a uint8 (n, 3, h, w) batch of noise (row 1 dark, row 2
    grey pixels, row 3 bright; n >= 4) and each row's operations (row 0:
    the extremes, every kind)."""
    rng = random.Random(seed)
    y = torch.from_numpy(np.frombuffer(rng.randbytes(n * 3 * h * w), np.uint8).reshape(n, 3, h, w).copy())
    y[1] //= 16                                        # dark: contrast's mean near 0
    y[2, 1] = y[2, 0]
    y[2, 2] = y[2, 0]                                  # grey pixels: no hue, no saturation
    y[3] = 255 - y[3] // 32                            # bright
    ops = [random_ops(rng) for _ in range(n)]
    ops[0] = [(C.HUE, 128), (C.CONTRAST, 0.0), (C.SATURATION, 2.5), (C.BRIGHTNESS, 1.0)]
    return y, ops


def pils(y: torch.Tensor, ops: list) -> list:
    """Each row of ``y`` (on the CPU) through its operations by PIL itself:
    uint8 (3, h, w) arrays."""
    out = []
    for r in range(len(ops)):
        img = Image.fromarray(np.ascontiguousarray(y[r].numpy().transpose(1, 2, 0)))
        out.append(np.asarray(C.pil_jitter(img, ops[r])).transpose(2, 0, 1))
    return out


def geometry_then(photos, steps, step, workers, on_cpu, share=0.0, monkeypatch=None, seed=5, epoch=0) -> tuple:
    """decode="device" (the CPU stand-in) with ``step`` (drawn in the worker,
    applied on the device) before the last of ``steps``, and the same
    loader without it, whose rows ``on_cpu(row, the sample's operations)``
    turns into what the device should give: ``(batches with it, batches
    expected, the loader with it, each sample's operations)``.  ``share``:
    the workers' share of the samples, prepared on the CPU path."""
    import coordl
    from coordl import _rng
    from coordl.decode import jpeg
    from coordl.device import encoded as E
    from torchvision import datasets
    from torchvision import transforms as V

    if share:
        from coordl.device import decoders as DDS

        monkeypatch.setattr(DDS, "cpu_share", lambda workers, spec=None: share)
    kw = dict(batch_size=4, seed=seed, shuffle=False, num_workers=workers, device="cpu", decode="device")
    with_it = coordl.DataLoader(datasets.ImageFolder(photos, transform=V.Compose(steps[:-1] + [step, steps[-1]])), **kw)
    without = coordl.DataLoader(datasets.ImageFolder(photos, transform=V.Compose(steps)), **kw)
    with_it.set_epoch(epoch)
    without.set_epoch(epoch)
    got, plain = list(with_it), list(without)
    plan, ds = E.plan_for(with_it.dataset.transform), with_it.dataset
    want, i, drawn = [], 0, []
    for x, y in plain:
        rows = []
        for r in range(x.shape[0]):
            g = _rng.derive(seed, epoch, i)
            plan.draw(*jpeg.jpeg_size(ds.raw(i)), g)
            ops = plan.draw_ops(g)
            drawn.append(ops)
            rows.append(on_cpu(x[r], ops))
            i += 1
        want.append((torch.stack(rows), y))
    return got, want, with_it, drawn
