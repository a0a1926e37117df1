"""``decode="device"``'s geometry for a whole batch in one kernel launch
(Triton), where the stage otherwise launches a conversion and a resize per
image (:meth:`coordl.device.decode.DecodeStage._geometry`).

For each decoded (3, H, W) uint8 image and its record: the crop (``T1..W1``),
the antialiased bilinear resize to (``RH``, ``RW``) (none: the crop as it
is) and the zero-padded crop (``T2..W2``) of the batch's output size, written
as float32 into its row of the batch, not yet rounded nor mirrored: what
``_geometry`` writes there.  The resize follows torch's antialiased
bilinear filter (``F.interpolate(..., antialias=True)``): per output pixel
the span and the normalized triangle weights of each axis, a sum along the
row for each source row of the span, then a sum of those down the column.

The images are gathered into one flat buffer first (one ``torch.cat``:
each image's bytes with its strides); the scales, their inverses and the
supports are computed on the host in float32, as torch computes them.

Only where Triton imports (a CUDA build of torch brings it), for the
bilinear, antialiased plans, and only after :func:`agrees` found its rows
equal to ``_geometry``'s on the device, within :data:`TOLERANCE` after
rounding (:meth:`DecodeStage` checks once); ``TRITON_INTERPRET=1`` runs it
on the CPU (the tests).  Nothing here runs in a worker.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["available", "BatchGeometry", "agrees", "faster", "upload", "TOLERANCE"]

#: ints per image in the kernels' table: row, offset, 3 strides, the crop, the resize, the second crop,
#: the widest span, the flip
NINT = 15

#: the most the kernel's rounded rows may differ from ``_geometry``'s, in uint8 levels
#: (float sums in another order or fused: a value at a rounding boundary may land one level over)
TOLERANCE = 1

_KERNEL: list = []


def available() -> bool:
    """Triton imports here."""
    return _kernel() is not None


def _kernel():
    if _KERNEL:
        return _KERNEL[0]
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - not installed, or a build that cannot start here
        _KERNEL.append(None)
        return None

    @triton.jit
    def crop_resize(src, ints, floats, out, oh, ow, BLOCK: tl.constexpr, KMAX: tl.constexpr):
        b = tl.program_id(0)
        blk = tl.program_id(1)
        ip = ints + b * 15                   # NINT
        row = tl.load(ip + 0)
        base = tl.load(ip + 1)
        sc = tl.load(ip + 2)
        sy = tl.load(ip + 3)
        sx = tl.load(ip + 4)
        t1 = tl.load(ip + 5)
        l1 = tl.load(ip + 6)
        h = tl.load(ip + 7)
        w = tl.load(ip + 8)
        rh = tl.load(ip + 9)
        rw = tl.load(ip + 10)
        t2 = tl.load(ip + 11)
        l2 = tl.load(ip + 12)
        kmax = tl.load(ip + 13)
        fp = floats + b * 6
        scale_y = tl.load(fp + 0)
        scale_x = tl.load(fp + 1)
        inv_y = tl.load(fp + 2)
        inv_x = tl.load(fp + 3)
        sup_y = tl.load(fp + 4)
        sup_x = tl.load(fp + 5)

        offs = blk * BLOCK + tl.arange(0, BLOCK)
        live = offs < oh * ow
        i = offs // ow
        j = offs % ow
        ii = i + t2                          # in the resized image
        jj = j + l2
        inside = live & (ii >= 0) & (ii < rh) & (jj >= 0) & (jj < rw)
        # the spans: center = scale * (i + 0.5); [int(center - support + 0.5), int(center + support + 0.5))
        cy = scale_y * (ii.to(tl.float32) + 0.5)
        cx = scale_x * (jj.to(tl.float32) + 0.5)
        ymin = tl.maximum((cy - sup_y + 0.5).to(tl.int32), 0)
        ysize = tl.minimum((cy + sup_y + 0.5).to(tl.int32), h) - ymin
        xmin = tl.maximum((cx - sup_x + 0.5).to(tl.int32), 0)
        xsize = tl.minimum((cx + sup_x + 0.5).to(tl.int32), w) - xmin
        ym = ymin.to(tl.float32) - cy
        xm = xmin.to(tl.float32) - cx
        # the weights of each axis over its span, [BLOCK, KMAX]: triangle((k + min - center + 0.5) * invscale),
        # divided by their sum
        k = tl.arange(0, KMAX)
        vx = tl.abs((k[None, :] + xm[:, None] + 0.5) * inv_x)
        wx = tl.where((k[None, :] < xsize[:, None]) & (vx < 1.0), 1.0 - vx, 0.0)
        tot_x = tl.sum(wx, axis=1)
        wx = tl.math.div_rn(wx, tl.where(tot_x != 0.0, tot_x, 1.0)[:, None])
        vy = tl.abs((k[None, :] + ym[:, None] + 0.5) * inv_y)
        tot_y = tl.sum(tl.where((k[None, :] < ysize[:, None]) & (vy < 1.0), 1.0 - vy, 0.0), axis=1)
        tot_y = tl.where(tot_y != 0.0, tot_y, 1.0)
        cols = (l1 + xmin[:, None] + k[None, :]) * sx
        okx = inside[:, None] & (k[None, :] < xsize[:, None])
        acc0 = tl.zeros((BLOCK,), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK,), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK,), dtype=tl.float32)
        for ky in range(0, kmax):
            v1 = tl.abs((ky + ym + 0.5) * inv_y)
            on = ky < ysize
            wy = tl.math.div_rn(tl.where(on & (v1 < 1.0), 1.0 - v1, 0.0), tot_y)
            p = src + base + (t1 + ymin + ky)[:, None] * sy + cols
            ok = okx & on[:, None]
            acc0 += wy * tl.sum(wx * tl.load(p, mask=ok, other=0).to(tl.float32), axis=1)
            acc1 += wy * tl.sum(wx * tl.load(p + sc, mask=ok, other=0).to(tl.float32), axis=1)
            acc2 += wy * tl.sum(wx * tl.load(p + 2 * sc, mask=ok, other=0).to(tl.float32), axis=1)
        o = out + row * (3 * oh * ow) + offs
        tl.store(o, tl.where(inside, acc0, 0.0), mask=live)
        tl.store(o + oh * ow, tl.where(inside, acc1, 0.0), mask=live)
        tl.store(o + 2 * oh * ow, tl.where(inside, acc2, 0.0), mask=live)

    @triton.jit
    def crop_resize_tiles(src, ints, floats, out, oh, ow, BI: tl.constexpr, BJ: tl.constexpr,
                          KMAX: tl.constexpr, FINAL: tl.constexpr):
        # the same sums as crop_resize, a tile of BI output rows by BJ columns per program: each column's
        # horizontal weights and each row's vertical ones computed once for the tile, not per pixel
        b = tl.program_id(0)
        ip = ints + b * 15                   # NINT
        row = tl.load(ip + 0)
        base = tl.load(ip + 1)
        sc = tl.load(ip + 2)
        sy = tl.load(ip + 3)
        sx = tl.load(ip + 4)
        t1 = tl.load(ip + 5)
        l1 = tl.load(ip + 6)
        h = tl.load(ip + 7)
        w = tl.load(ip + 8)
        rh = tl.load(ip + 9)
        rw = tl.load(ip + 10)
        t2 = tl.load(ip + 11)
        l2 = tl.load(ip + 12)
        kmax = tl.load(ip + 13)
        flip = tl.load(ip + 14)
        fp = floats + b * 6
        scale_y = tl.load(fp + 0)
        scale_x = tl.load(fp + 1)
        inv_y = tl.load(fp + 2)
        inv_x = tl.load(fp + 3)
        sup_y = tl.load(fp + 4)
        sup_x = tl.load(fp + 5)

        i = tl.program_id(1) * BI + tl.arange(0, BI)
        j = tl.program_id(2) * BJ + tl.arange(0, BJ)
        ii = i + t2
        jj = j + l2
        in_i = (i < oh) & (ii >= 0) & (ii < rh)
        in_j = (j < ow) & (jj >= 0) & (jj < rw)
        cy = scale_y * (ii.to(tl.float32) + 0.5)
        cx = scale_x * (jj.to(tl.float32) + 0.5)
        ymin = tl.maximum((cy - sup_y + 0.5).to(tl.int32), 0)
        ysize = tl.minimum((cy + sup_y + 0.5).to(tl.int32), h) - ymin
        xmin = tl.maximum((cx - sup_x + 0.5).to(tl.int32), 0)
        xsize = tl.minimum((cx + sup_x + 0.5).to(tl.int32), w) - xmin
        ym = ymin.to(tl.float32) - cy
        xm = xmin.to(tl.float32) - cx
        k = tl.arange(0, KMAX)
        vx = tl.abs((k[None, :] + xm[:, None] + 0.5) * inv_x)                       # [BJ, KMAX]
        wx = tl.where((k[None, :] < xsize[:, None]) & (vx < 1.0), 1.0 - vx, 0.0)
        tot_x = tl.sum(wx, axis=1)
        wx = tl.math.div_rn(wx, tl.where(tot_x != 0.0, tot_x, 1.0)[:, None])
        vy = tl.abs((k[None, :] + ym[:, None] + 0.5) * inv_y)                       # [BI, KMAX]
        tot_y = tl.sum(tl.where((k[None, :] < ysize[:, None]) & (vy < 1.0), 1.0 - vy, 0.0), axis=1)
        tot_y = tl.where(tot_y != 0.0, tot_y, 1.0)
        cols = (l1 + xmin[:, None] + k[None, :]) * sx                               # [BJ, KMAX]
        okx = in_j[:, None] & (k[None, :] < xsize[:, None])
        acc0 = tl.zeros((BI, BJ), dtype=tl.float32)
        acc1 = tl.zeros((BI, BJ), dtype=tl.float32)
        acc2 = tl.zeros((BI, BJ), dtype=tl.float32)
        for ky in range(0, kmax):
            v1 = tl.abs((ky + ym + 0.5) * inv_y)
            on = in_i & (ky < ysize)
            wy = tl.math.div_rn(tl.where(on & (v1 < 1.0), 1.0 - v1, 0.0), tot_y)     # [BI]
            p = src + base + ((t1 + ymin + ky) * sy)[:, None, None] + cols[None, :, :]
            ok = on[:, None, None] & okx[None, :, :]
            acc0 += wy[:, None] * tl.sum(wx[None, :, :] * tl.load(p, mask=ok, other=0).to(tl.float32), axis=2)
            acc1 += wy[:, None] * tl.sum(wx[None, :, :] * tl.load(p + sc, mask=ok, other=0).to(tl.float32), axis=2)
            acc2 += wy[:, None] * tl.sum(wx[None, :, :] * tl.load(p + 2 * sc, mask=ok, other=0).to(tl.float32),
                                         axis=2)
        inside = in_i[:, None] & in_j[None, :]
        live = (i < oh)[:, None] & (j < ow)[None, :]
        plane = oh * ow
        if FINAL:
            # rounded half to even (adding and taking away 1.5 * 2**23 leaves the nearest integer, ties to
            # even, for the values a resize of uint8 gives), clamped, mirrored where the record flips, uint8
            jo = tl.where(flip != 0, ow - 1 - j, j)
            o = out + row * (3 * plane) + i[:, None] * ow + jo[None, :]
            r0 = tl.minimum(tl.maximum((tl.where(inside, acc0, 0.0) + 12582912.0) - 12582912.0, 0.0), 255.0)
            r1 = tl.minimum(tl.maximum((tl.where(inside, acc1, 0.0) + 12582912.0) - 12582912.0, 0.0), 255.0)
            r2 = tl.minimum(tl.maximum((tl.where(inside, acc2, 0.0) + 12582912.0) - 12582912.0, 0.0), 255.0)
            tl.store(o, r0.to(tl.uint8), mask=live)
            tl.store(o + plane, r1.to(tl.uint8), mask=live)
            tl.store(o + 2 * plane, r2.to(tl.uint8), mask=live)
        else:
            o = out + row * (3 * plane) + i[:, None] * ow + j[None, :]
            tl.store(o, tl.where(inside, acc0, 0.0), mask=live)
            tl.store(o + plane, tl.where(inside, acc1, 0.0), mask=live)
            tl.store(o + 2 * plane, tl.where(inside, acc2, 0.0), mask=live)

    _KERNEL.append({"rows": crop_resize, "tiles": crop_resize_tiles})
    return _KERNEL[0]


def _axes(n_in: np.ndarray, n_out: np.ndarray) -> tuple:
    """(scale, 1/scale or 1, support) of one axis of each image, float32 as
    torch computes them (the bilinear filter's size is 2)."""
    scale = n_in.astype(np.float32) / n_out.astype(np.float32)
    down = scale >= 1
    one = np.float32(1)
    return scale, np.where(down, one / scale, one), np.where(down, scale, one)


class BatchGeometry:
    """One launch per batch of what ``_geometry`` does image by image.

    ``tiled`` (the default) runs the kernel that takes a tile of output
    rows and columns per program, each column's and row's weights computed
    once for its tile; otherwise the one that takes a run of pixels, every
    pixel computing its own (the first kernel: a fallback where the tiled
    one cannot compile).  ``fused`` (set by :func:`fused_agrees`): the tiled
    kernel also rounds, clamps and mirrors, writing the uint8 batch itself
    (:meth:`run` with ``final=True``), which spares the stage four passes
    over the batch on the device."""

    BLOCK = 128
    TILE = 2048     # output values x span per program of the tiled kernel: registers, as BLOCK x KMAX

    def __init__(self, size: tuple, tiled: bool = True) -> None:
        self.oh, self.ow = size
        kernels = _kernel()
        self.tiled = tiled
        self.kernel = kernels["tiles" if tiled else "rows"] if kernels else None
        self.fused = False

    def run(self, items: list, y: torch.Tensor, final: bool = False) -> None:
        """``items``: ``[(row, image, record), ...]``; each (3, H, W) uint8
        image's geometry written into ``y[row]``: float32, not yet rounded
        nor mirrored (``y``: a contiguous (n, 3, oh, ow) float32 batch), or,
        with ``final`` (the tiled kernel only), rounded half to even,
        clamped to [0, 255] and mirrored where its record says, into a
        uint8 ``y``."""
        from .encoded import FLIP, H1, L1, L2, RH, RW, T1, T2, W1

        if not items:
            return
        if final and not self.tiled:
            raise ValueError("only the tiled kernel writes the final uint8 rows")
        flats, ints, at = [], [], 0
        for row, img, rec in items:
            if img.is_contiguous():
                flat, strides = img.view(-1), img.stride()
            else:                   # (H, W, 3) memory seen as (3, H, W): nvImageCodec's
                hwc = img.permute(1, 2, 0)
                if not hwc.is_contiguous():
                    hwc = hwc.contiguous()
                flat, strides = hwc.view(-1), (1, hwc.stride(0), hwc.stride(1))
            h, w = rec[H1], rec[W1]
            rh, rw = (rec[RH], rec[RW]) if rec[RH] else (h, w)
            ints.append((row, at, *strides, rec[T1], rec[L1], h, w, rh, rw, rec[T2], rec[L2], 0, int(bool(rec[FLIP]))))
            flats.append(flat)
            at += flat.numel()
        ints = np.asarray(ints, dtype=np.int64)
        sy, iy, py = _axes(ints[:, 7], ints[:, 9])
        sx, ix, px = _axes(ints[:, 8], ints[:, 10])
        floats = np.stack([sy, sx, iy, ix, py, px], axis=1).astype(np.float32)
        kmax = int(np.ceil(np.maximum(py, px)).max()) * 2 + 1      # the widest span, torch's interp size
        ints[:, 13] = kmax
        dev = y.device
        src = torch.cat(flats) if len(flats) > 1 else flats[0]
        ints_t, floats_t = upload(ints, dev), upload(floats, dev)
        kp = 4                       # the spans' largest, as a power of two (one compiled kernel each)
        while kp < kmax:
            kp *= 2
        if self.tiled:
            bj = 32
            bi = max(2, min(16, self.TILE // (bj * kp)))
            grid = (len(items), -(-self.oh // bi), -(-self.ow // bj))
            kw = dict(BI=bi, BJ=bj, KMAX=kp, FINAL=bool(final))
        else:
            block = max(16, min(self.BLOCK, 4096 // kp))
            grid = (len(items), -(-self.oh * self.ow // block))
            kw = dict(BLOCK=block, KMAX=kp)
        if dev.type == "cuda":      # Triton launches on the current device, on its current stream
            with torch.cuda.device(dev):
                self.kernel[grid](src, ints_t, floats_t, y, self.oh, self.ow, **kw)
        else:
            self.kernel[grid](src, ints_t, floats_t, y, self.oh, self.ow, **kw)


def finished(y: torch.Tensor, flips: list) -> torch.Tensor:
    """What the stage makes of float32 rows (``_geometry``'s, or the kernel's
    without ``final``): rounded half to even, clamped, uint8, each row
    mirrored where ``flips`` says."""
    y = y.round().clamp_(0, 255).to(torch.uint8)
    for j, f in enumerate(flips):
        if f:
            y[j] = y[j].flip(-1)
    return y


def upload(arr: np.ndarray, dev: torch.device) -> torch.Tensor:
    """A small host array on ``dev``, in order on its current stream,
    without waiting for that stream: a copy from pageable memory with
    ``non_blocking=False`` synchronizes the stream (the pin thread would
    wait there for the previous batch's work on the GPU, spinning); from
    page-locked memory of torch's caching host allocator it is queued, and
    the allocator keeps the buffer until the copy has run."""
    t = torch.from_numpy(arr)
    if dev.type != "cuda":
        return t
    return t.pin_memory().to(dev, non_blocking=True)


def agrees(stage, images: list, records: list, geo: "BatchGeometry | None" = None) -> tuple[bool, str]:
    """Whether the kernel's rows (``geo``'s; default: the tiled kernel),
    rounded, are ``stage._geometry``'s within :data:`TOLERANCE`: (ok, what
    was found)."""
    oh, ow = stage.plan.size
    n = len(images)
    want = torch.empty((n, 3, oh, ow), dtype=torch.float32, device=stage.device)
    got = torch.full_like(want, -7.0)
    for j, (img, rec) in enumerate(zip(images, records)):
        stage._geometry(img, rec, into=want[j:j + 1])
    (geo or BatchGeometry((oh, ow))).run([(j, img, rec) for j, (img, rec) in enumerate(zip(images, records))], got)
    a = want.round().clamp_(0, 255)
    b = got.round().clamp_(0, 255)
    d = (a - b).abs()
    worst, share = float(d.max()), float((d > 0).float().mean())
    return worst <= TOLERANCE, f"max {worst:.0f} level(s), {share:.2%} of values differ"


def fused_agrees(geo: BatchGeometry, device: torch.device, images: list, records: list) -> tuple[bool, str]:
    """Whether the tiled kernel's final uint8 rows (rounded, clamped,
    mirrored in the kernel) are exactly its float32 rows finished as the
    stage finishes them (:func:`finished`): the in-kernel rounding is half
    to even on this device, as ``torch.round``.  Sets ``geo.fused``."""
    from .encoded import FLIP

    geo.fused = False
    if not geo.tiled:
        return False, "not the tiled kernel"
    n = len(images)
    items = [(j, img, rec) for j, (img, rec) in enumerate(zip(images, records))]
    rows = torch.full((n, 3, geo.oh, geo.ow), -7.0, dtype=torch.float32, device=device)
    geo.run(items, rows)
    got = torch.zeros((n, 3, geo.oh, geo.ow), dtype=torch.uint8, device=device)
    geo.run(items, got, final=True)
    want = finished(rows, [bool(rec[FLIP]) for rec in records])
    same = bool(torch.equal(got, want))
    geo.fused = same
    return same, ("the kernel's own rounding and mirror give the same rows" if same else
                  f"the kernel's own rounding differs in {int((got != want).sum())} values: rounded after it")


def faster(stage, images: list, records: list, geo: "BatchGeometry | None" = None) -> tuple[bool, str]:
    """On a GPU: whether the kernel's launch takes less wall time than the
    per-image path for the same images, repeated to a batch's 64 rows (each
    synchronized, the kernel compiled first): (faster, the two times).  What the pin thread saves is
    its CPU; a kernel slower on the GPU than the launches it replaces would
    move the bound there."""
    import time

    oh, ow = stage.plan.size
    # as many rows as a batch has (the images again): a launch's fixed cost weighs as it will
    n = max(len(images), 64)
    y = torch.empty((n, 3, oh, ow), dtype=torch.float32, device=stage.device)
    items = [(j, images[j % len(images)], records[j % len(images)]) for j in range(n)]
    geo = geo or BatchGeometry((oh, ow))
    sync = torch.cuda.synchronize if stage.device.type == "cuda" else (lambda *a: None)

    def per_image():
        for j, img, rec in items:
            stage._geometry(img, rec, into=y[j:j + 1])

    times = {}
    for name, fn in (("kernel", lambda: geo.run(items, y)), ("per image", per_image)):
        fn()
        sync(stage.device)
        t = time.perf_counter()
        for _ in range(3):
            fn()
        sync(stage.device)
        times[name] = (time.perf_counter() - t) / 3
    return times["kernel"] <= times["per image"], \
        f"{times['kernel'] * 1e3:.2f} ms against {times['per image'] * 1e3:.2f} ms for {n} images"
