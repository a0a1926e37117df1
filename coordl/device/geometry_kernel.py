"""``decode="device"``'s geometry for a whole batch in one or two kernel
launches (Triton), where the stage otherwise launches a conversion and a
resize per image (:meth:`coordl.device.decode.DecodeStage._geometry`).

For each decoded (3, H, W) uint8 image and its record: the crop (``T1..W1``),
the antialiased bilinear or bicubic resize to (``RH``, ``RW``) (none: the
crop as it is) and the zero-padded crop (``T2..W2``) of the batch's output
size, written as float32 into its row of the batch, not yet rounded nor
mirrored: what ``_geometry`` writes there.  The resize follows torch's
antialiased filters (``F.interpolate(..., antialias=True)``): per output
pixel the span and the normalized weights of each axis (the triangle, or
Keys' cubic with a = -0.5 over twice the span), a sum along the row for each
source row of the span, then a sum of those down the column.  A plan that
draws its mode per sample (the record's ``MODE``) launches once per filter.

Three kernels make the same sums (:data:`KINDS`, in the order the stage
tries them):

* ``separable``: two passes.  The first sums along the rows once for every
  row of each crop and every output column, into a float32 block per image;
  the second sums those down each output pixel's span.  A source row feeds
  every output row whose span covers it, so the 2-D kernels below read
  and weigh it again for each (about two where the resize goes down,
  2/scale where it goes up); here each row sum is made once.  The blocks
  of a launch pair hold at most :attr:`BatchGeometry.MID_BUDGET` bytes (a
  batch of larger crops takes more pairs).
* ``tiled``: one pass, a tile of output rows and columns per program, each
  column's and row's weights computed once for its tile, the row sums
  made inside the loop down the span.
* ``per-pixel``: one pass, every pixel computing its own weights (the
  first kernel; the fallback where neither other compiles).

The separable and tiled kernels also round, clamp and mirror (and run the
tail's arithmetic) in their last pass, where :func:`fused_agrees` found it
exact.

The images are gathered into one flat buffer first (one ``torch.cat``:
each image's bytes with its strides); the scales, their inverses and the
supports are computed on the host in float32, as torch computes them.

Only where Triton imports (a CUDA build of torch brings it), for the
antialiased bilinear or bicubic plans, and only after :func:`agrees` found its rows
equal to ``_geometry``'s on the device, within :data:`TOLERANCE` after
rounding (:meth:`DecodeStage` checks once); ``TRITON_INTERPRET=1`` runs it
on the CPU (the tests).  Nothing here runs in a worker.
"""
from __future__ import annotations

import numpy as np
import torch

from .launch import launch, upload

__all__ = ["available", "BatchGeometry", "KINDS", "agrees", "faster", "upload", "TOLERANCE"]

#: ints per image in the kernels' table: row, offset, 3 strides, the crop, the resize, the second crop,
#: the widest span, the flip
NINT = 15

#: the kernels, in the order the stage tries them (the first whose rows agree is used)
KINDS = ("separable", "tiled", "per-pixel")

#: the antialiased filters the kernels resize with (torch's, as ``F.interpolate(..., antialias=True)``)
MODES = ("bilinear", "bicubic")

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
        from . import _geometry_triton as K
    except Exception:  # noqa: BLE001 - Triton not installed, or a build that cannot start here
        _KERNEL.append(None)
        return None

    _KERNEL.append({"per-pixel": K.crop_resize, "tiled": K.crop_resize_tiles,
                    "separable": (K.row_sums, K.column_sums)})
    return _KERNEL[0]


def _axes(n_in: np.ndarray, n_out: np.ndarray, cubic: bool = False) -> tuple:
    """(scale, 1/scale or 1, support) of one axis of each image, float32 as
    torch computes them (the bilinear filter's size is 2, the bicubic's 4:
    a support of half that, times the scale going down)."""
    scale = n_in.astype(np.float32) / n_out.astype(np.float32)
    down = scale >= 1
    one, half = np.float32(1), np.float32(2 if cubic else 1)
    return scale, np.where(down, one / scale, one), np.where(down, half * scale, half)


class BatchGeometry:
    """One kernel launch (or a pair) per batch of what ``_geometry`` does
    image by image.

    ``kind``: one of :data:`KINDS` (the module's docstring says what each
    does).  ``fused`` (set by :func:`fused_agrees`): the separable or tiled
    kernel also rounds, clamps and mirrors, writing the uint8 batch itself
    (:meth:`run` with ``final=True``), which spares the stage four passes
    over the batch on the device."""

    BLOCK = 128
    TILE = 2048     # output values x span per program of the tiled kernels: registers, as BLOCK x KMAX
    #: bytes of the separable kernels' row sums per launch pair (float32, 3 x crop height x output width
    #: per image: about 1 MB for an ImageNet photo's crop at 224 wide)
    MID_BUDGET = 128 << 20

    def __init__(self, size: tuple, kind: str = "separable", modes: tuple = ("bilinear",)) -> None:
        if kind not in KINDS:
            raise ValueError(f"the batch-geometry kernel is one of {', '.join(KINDS)}, not {kind!r}")
        if any(m not in MODES for m in modes):
            raise ValueError(f"the batch-geometry kernel resizes with {' or '.join(MODES)}, not {modes!r}")
        self.oh, self.ow = size
        # the plan's modes (DecodePlan.modes' values), which a record's MODE indexes
        self.modes = tuple(modes)
        kernels = _kernel()
        self.kind = kind
        self.kernel = kernels[kind] if kernels else None
        self.fused = self.fused_tail = False
        self._norms = None      # (tail, device, its constants there): kept here, never on the tail, which
        #                         may travel to a worker process

    @property
    def final_rows(self) -> bool:
        """The kernel can write the final rows (``run(..., final=True)``)."""
        return self.kind != "per-pixel"

    def _norm(self, tail, dev: torch.device) -> torch.Tensor:
        if self._norms is None or self._norms[0] is not tail or self._norms[1] != dev:
            self._norms = (tail, dev, upload(_norm_values(tail).numpy(), dev))     # queued, not waited for
        return self._norms[2]

    def run(self, items: list, y: torch.Tensor, final: bool = False, tail=None) -> None:
        """``items``: ``[(row, image, record), ...]``; each (3, H, W) uint8
        image's geometry written into ``y[row]``: float32, not yet rounded
        nor mirrored (``y``: a contiguous (n, 3, oh, ow) float32 batch), or,
        with ``final`` (the separable and tiled kernels), rounded half to even,
        clamped to [0, 255] and mirrored where its record says, into a
        uint8 ``y``; with ``final`` and ``tail`` (a
        :class:`~.split.DeviceTail` :func:`tail_fits`), then through the
        tail's arithmetic, into a float32 ``y``.  Each record's ``MODE``
        says its resize's filter: one launch (or pair) per filter."""
        from .encoded import MODE

        if not items:
            return
        if final and not self.final_rows:
            raise ValueError(f"the {self.kind} kernel does not write the final rows")
        if len(self.modes) == 1:
            return self._run(items, y, final, tail, self.modes[0] == "bicubic")
        for m, mode in enumerate(self.modes):
            group = [item for item in items if item[2][MODE] == m]
            if group:
                self._run(group, y, final, tail, mode == "bicubic")

    def _run(self, items: list, y: torch.Tensor, final: bool, tail, cubic: bool) -> None:
        from .encoded import FLIP, H1, L1, L2, RH, RW, T1, T2, W1

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
        ints = np.asarray(ints, dtype=np.int64).reshape(-1, NINT)     # the kernels read NINT per image
        sy, iy, py = _axes(ints[:, 7], ints[:, 9], cubic)
        sx, ix, px = _axes(ints[:, 8], ints[:, 10], cubic)
        floats = np.stack([sy, sx, iy, ix, py, px], axis=1).astype(np.float32)
        kmax = int(np.ceil(np.maximum(py, px)).max()) * 2 + 1      # the widest span, torch's interp size
        ints[:, 13] = kmax
        dev = y.device
        src = torch.cat(flats) if len(flats) > 1 else flats[0]
        ints_t, floats_t = upload(ints, dev), upload(floats, dev)
        kp = 4                       # the spans' largest, as a power of two (one compiled kernel each)
        while kp < kmax:
            kp *= 2
        if self.kind == "per-pixel":
            block = max(16, min(self.BLOCK, 4096 // kp))
            grid = (len(items), -(-self.oh * self.ow // block))
            self._launch(dev, self.kernel, grid, (src, ints_t, floats_t, y, self.oh, self.ow),
                         dict(BLOCK=block, KMAX=kp, CUBIC=int(cubic)))
            return
        bj = 32
        bi = max(2, min(16, self.TILE // (bj * kp)))
        norm = self._norm(tail, dev) if final and tail is not None else floats_t
        kw = dict(BI=bi, BJ=bj, KMAX=kp, FINAL=(2 if tail is not None else 1) if final else 0,
                  NORM=int(final and tail is not None and norm.numel() == 6), CUBIC=int(cubic))
        if self.kind == "tiled":
            grid = (len(items), -(-self.oh // bi), -(-self.ow // bj))
            self._launch(dev, self.kernel, grid, (src, ints_t, floats_t, y, self.oh, self.ow, norm), kw)
            return
        rows_k, cols_k = self.kernel
        br = bi                 # the tiled kernel's tile height: the same reduction shapes as there
        size = 3 * ints[:, 7] * self.ow                  # each image's row sums: 3 x crop height x ow
        for g0, g1 in _groups(size, self.MID_BUDGET // 4):
            at = np.concatenate([[0], np.cumsum(size[g0:g1])])
            mid = torch.empty(int(at[-1]), dtype=torch.float32, device=dev)
            mids = upload(at[:-1].astype(np.int64), dev)
            it, ft, n = ints_t[g0:g1], floats_t[g0:g1], g1 - g0
            self._launch(dev, rows_k, (n, -(-int(ints[g0:g1, 7].max()) // br), -(-self.ow // bj)),
                         (src, it, ft, mids, mid, self.ow), dict(BR=br, BJ=bj, KMAX=kp, CUBIC=int(cubic)))
            self._launch(dev, cols_k, (n, -(-self.oh // bi), -(-self.ow // bj)),
                         (mid, mids, it, ft, y, self.oh, self.ow, norm), kw)

    _launch = staticmethod(launch)


def _groups(size: np.ndarray, budget: int) -> list:
    """Consecutive runs ``(start, end)`` of ``size`` whose sums stay within
    ``budget`` (a larger entry alone)."""
    out, start, total = [], 0, 0
    for k, s in enumerate(size.tolist()):
        if k > start and total + s > budget:
            out.append((start, k))
            start, total = k, 0
        total += s
    out.append((start, len(size)))
    return out

def tail_fits(tail) -> bool:
    """The kernel can run ``tail`` (a :class:`~.split.DeviceTail`) itself:
    ``ToTensor``'s scaling (its division: not v2's multiply by 1/255, which
    the tail then runs after the kernel) and at most one ``Normalize`` of 1
    or 3 values (for 3 channels)."""
    pairs = getattr(tail, "_pairs", None)
    return pairs is not None and not getattr(tail, "reciprocal", False) and len(pairs) <= 1 and all(m.numel() in (1, 3) and s.numel() in (1, 3)
                                                          for m, s in pairs)


def _norm_values(tail) -> torch.Tensor:
    """``tail``'s mean and std for the kernel, float32 [m0, m1, m2, s0, s1,
    s2] (one value spread to three channels), or a 1-value tensor for a
    tail without ``Normalize``; on the host."""
    if tail._pairs:
        m, s = tail._pairs[0]
        return torch.cat([m.reshape(-1).expand(3), s.reshape(-1).expand(3)]).to(torch.float32)
    return torch.zeros(1, dtype=torch.float32)


def finished(y: torch.Tensor, flips: list) -> torch.Tensor:
    """What the stage makes of a batch of float32 rows (``_geometry``'s, or
    the kernel's without ``final``): rounded half to even in place,
    clamped, uint8, each row mirrored where ``flips`` says (one mirror for
    the batch: a few launches, not one per row).  The stage's own step,
    and what :func:`fused_agrees` holds the kernel's final rows to."""
    y = y.round_().clamp_(0, 255).to(torch.uint8)
    if all(flips):
        return y.flip(-1)
    if any(flips):
        mask = upload(np.asarray(flips), y.device).view(-1, 1, 1, 1)
        return torch.where(mask, y.flip(-1), y)
    return y


def _modes(stage) -> tuple:
    """The values of ``stage``'s plan's modes."""
    return tuple(m.value for m in stage.plan.modes)


def agrees(stage, images: list, records: list, geo: "BatchGeometry | None" = None) -> tuple[bool, str]:
    """Whether the kernel's rows (``geo``'s; default: the separable kernel),
    rounded, are ``stage._geometry``'s within :data:`TOLERANCE`: (ok, what
    was found)."""
    oh, ow = stage.plan.size
    n = len(images)
    want = torch.empty((n, 3, oh, ow), dtype=torch.float32, device=stage.device)
    got = torch.full_like(want, -7.0)
    for j, (img, rec) in enumerate(zip(images, records)):
        stage._geometry(img, rec, into=want[j:j + 1])
    (geo or BatchGeometry((oh, ow), modes=_modes(stage))).run([(j, img, rec) for j, (img, rec) in enumerate(zip(images, records))], got)
    a = want.round().clamp_(0, 255)
    b = got.round().clamp_(0, 255)
    d = (a - b).abs()
    worst, share = float(d.max()), float((d > 0).float().mean())
    return worst <= TOLERANCE, f"max {worst:.0f} level(s), {share:.2%} of values differ"


def fused_agrees(geo: BatchGeometry, device: torch.device, images: list, records: list,
                 tail=None) -> tuple[bool, str]:
    """Whether the kernel's final uint8 rows (rounded, clamped,
    mirrored in the kernel) are exactly its float32 rows finished as the
    stage finishes them (:func:`finished`): the in-kernel rounding is half
    to even on this device, as ``torch.round``.  Sets ``geo.fused``; and,
    with ``tail`` (the stage's :class:`~.split.DeviceTail`, where it
    :func:`tail_fits`), whether the kernel's float rows through the tail's
    arithmetic are exactly ``tail`` of those uint8 rows: ``geo.fused_tail``."""
    from .encoded import FLIP

    geo.fused = geo.fused_tail = False
    if not geo.final_rows:
        return False, f"the {geo.kind} kernel does not write the final rows"
    n = len(images)
    items = [(j, img, rec) for j, (img, rec) in enumerate(zip(images, records))]
    rows = torch.full((n, 3, geo.oh, geo.ow), -7.0, dtype=torch.float32, device=device)
    geo.run(items, rows)
    got = torch.zeros((n, 3, geo.oh, geo.ow), dtype=torch.uint8, device=device)
    geo.run(items, got, final=True)
    want = finished(rows, [bool(rec[FLIP]) for rec in records])
    same = bool(torch.equal(got, want))
    geo.fused = same
    what = ("the kernel's own rounding and mirror give the same rows" if same else
            f"the kernel's own rounding differs in {int((got != want).sum())} values: rounded after it")
    if same and tail is not None and tail_fits(tail):
        floats = torch.full((n, 3, geo.oh, geo.ow), -7.0, dtype=torch.float32, device=device)
        geo.run(items, floats, final=True, tail=tail)
        geo.fused_tail = bool(torch.equal(floats, tail(got)))
        what += ("; and its ToTensor/Normalize arithmetic the tail's, bit for bit" if geo.fused_tail else
                 "; its ToTensor/Normalize arithmetic differs from the tail's: the tail runs after it")
    return same, what


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
    geo = geo or BatchGeometry((oh, ow), modes=_modes(stage))
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
