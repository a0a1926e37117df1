"""``decode="device"``: torchvision's ``ColorJitter`` on the device, with
PIL's arithmetic.

On the CPU path a ``ColorJitter`` between the geometry and the tensor
conversion gets the PIL image, and PIL computes it (coordl's
``coordl.decode.color`` reproduces those bytes on the decoded planes).  With
``decode="device"`` the workers draw each sample's operations as the CPU
path draws them (:meth:`.encoded.DecodePlan.draw_ops`: the user's object,
torch's generator seeded from the sample's), the record carries them, and
:class:`DeviceJitter` applies them to the batch's uint8 rows after the
geometry, before ``ToTensor``/``Normalize``, on the device, each
operation computing what PIL computes:

- brightness and contrast: PIL's blend with a black image, or a grey one at
  the image's mean luma (the sum of ``(19595 R + 38470 G + 7471 B + 0x8000)
  >> 16`` over the pixel count in double precision, rounded half up), in
  single precision: ``a + alpha * (v - a)``, clipped to 0..255 and
  truncated, each operation rounding as PIL's C does (nothing fused into
  a multiply-add);
- saturation: the blend of each value with its pixel's luma, the same way;
- hue: PIL's RGB -> HSV conversion, the hue turned, PIL's HSV -> RGB,
  through two tables of all 2**24 colours that PIL itself converted (made
  once per process and device on the first hue operation, about 2 s of
  CPU; 64 MiB each on the device).

The rows of a batch each have their own operations in their own order,
applied position by position.  On a GPU where Triton imports, one kernel
launch per position applies each row's operation there in place
(``_jitter_triton``: each pixel's three values read and written once,
where torch's operations pass over the rows about ten times per
operation; launched without fused multiply-adds); contrast's luma sums
are taken first, by a second kernel.  Elsewhere, or for a kind the kernel
got wrong, torch's operations run (one operation per rounding), the rows
whose operation there is of one kind taken together.  The first use of each kind on a device, by either path,
is checked against PIL on probe images
(:func:`coordl.decode.color.pil_jitter`): a kernel that differs there gives
way to torch's operations, and where those differ too (another PIL's
arithmetic) the CPU path's own code runs for those rows, a row at a time;
the log says so.
"""
from __future__ import annotations

import logging
import random
import threading

import numpy as np
import torch
from PIL import Image

from ..decode.color import BRIGHTNESS, CONTRAST, HUE, KERNEL_CODES, SATURATION, TIMM_AUGMIX, pil_jitter, probe_ops
from . import pil_ops
from .pil_ops import _blend
from .launch import launch, upload
from ..base import forks as _forks

__all__ = ["DeviceJitter", "host_jitter"]

log = logging.getLogger("coordl.device")

# the kinds the rows are grouped by: brightness and contrast are one blend with a constant image
_BLEND, _SATURATE, _HUE = 0, 1, 2
_KIND = {BRIGHTNESS: _BLEND, CONTRAST: _BLEND, SATURATION: _SATURATE, HUE: _HUE}
# an auto-augment policy's other operations (coordl.device.pil_ops): a kind each
_OWN = 100
_KIND.update({code: _OWN + code for code in pil_ops.CODES})
# timm's AugMix: its chains through these same operations, then its mix (DeviceJitter._timm_mix)
_TIMM_MIX = _KIND[TIMM_AUGMIX] = _OWN + TIMM_AUGMIX

_tables_lock = _forks.worker_safe(threading.Lock())
_tables: dict = {}      # device -> (to_hsv, from_hsv) there, once made (int32, 2**24 packed colours each)


def _luma(x: torch.Tensor) -> torch.Tensor:
    """PIL's RGB -> L of uint8 (k, 3, H, W) images: int32 (k, H, W)."""
    lum = x[:, 0].to(torch.int32).mul_(19595)
    lum.add_(x[:, 1].to(torch.int32).mul_(38470))
    lum.add_(x[:, 2].to(torch.int32).mul_(7471))
    return lum.add_(0x8000).bitwise_right_shift_(16)


def _mean(sums: torch.Tensor, n: int) -> torch.Tensor:
    """PIL's mean of ``n`` values from their int64 ``sums``: the sum over
    the count in double precision, rounded half up (an integer: float32)."""
    return (sums.to(torch.float64) / float(n) + 0.5).floor_().to(torch.float32)


def _take(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for an int32 ``index`` (a torch that indexes only by
    int64: converted)."""
    try:
        return table[index]
    except (IndexError, RuntimeError, TypeError):
        return table[index.to(torch.int64)]


def _hsv_tables(device: torch.device) -> tuple:
    """(to_hsv, from_hsv) on ``device``: PIL's conversions of every colour,
    int32 tensors indexed by ``(c0 << 16) | (c1 << 8) | c2`` that hold the
    converted colour packed the same way; made once per process and device
    (the host's copies let go once moved)."""
    with _tables_lock:
        got = _tables.get(device)
        if got is None:
            i = np.arange(1 << 24, dtype=np.uint32)
            every = np.stack([(i >> 16) & 255, (i >> 8) & 255, i & 255], axis=-1).astype(np.uint8)
            raw = every.reshape(4096, 4096, 3).tobytes()
            del i, every

            def packed(img: Image.Image) -> torch.Tensor:
                a = np.asarray(img).reshape(-1, 3).astype(np.int32)
                return torch.from_numpy(np.ascontiguousarray((a[:, 0] << 16) | (a[:, 1] << 8) | a[:, 2]))

            to_hsv = packed(Image.frombytes("RGB", (4096, 4096), raw).convert("HSV")).to(device)
            from_hsv = packed(Image.frombytes("HSV", (4096, 4096), raw).convert("RGB")).to(device)
            got = _tables[device] = (to_hsv, from_hsv)
    return got


#: the tests run the kernel on the CPU (Triton's interpreter): True
KERNEL_ON_CPU = False
_BLOCK = 1024
_KERNEL: list = []


def _kernel():
    """The Triton kernels (the module ``_jitter_triton``: ``jitter_ops``,
    ``luma_sums``), or None where Triton does not import."""
    if not _KERNEL:
        try:
            from . import _jitter_triton as K
        except Exception:  # noqa: BLE001 - Triton not installed, or a build that cannot start here
            K = None
        _KERNEL.append(K)
    return _KERNEL[0]


def host_jitter(planes: np.ndarray, ops) -> np.ndarray:
    """The uint8 (3, H, W) ``planes`` through ``ops`` as the CPU path
    computes them (PIL's bytes: coordl's colour kernel where it is PIL's
    here, else PIL itself), as a new C-contiguous array."""
    from ..decode import color

    if color.exact_kernel() and all(c in KERNEL_CODES for c, _ in ops):
        return color.jitter(planes, ops)
    img = pil_jitter(Image.fromarray(np.ascontiguousarray(planes.transpose(1, 2, 0))), ops)
    return np.ascontiguousarray(np.asarray(img).transpose(2, 0, 1))


class DeviceJitter:
    """Applies each row's colour operations to a uint8 (B, 3, H, W) batch on
    ``device`` (see the module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._exact: dict = {}       # kind -> whether the device computes PIL's bytes (checked at first use)
        # kind -> whether the kernel computes PIL's bytes (checked at its first use); {} without the kernel
        self._kernel_ok: dict | None = {} if _kernel() is not None and (device.type == "cuda" or KERNEL_ON_CPU) \
            else None

    def __call__(self, y: torch.Tensor, ops: list) -> torch.Tensor:
        """``y`` with row ``r`` through ``ops[r]`` (``[(code, value)]``,
        ``coordl.decode.color``'s codes), in place where it can be: the
        batch."""
        depth = max((len(o) for o in ops), default=0)
        for p in range(depth):
            at = [(r, *o[p]) for r, o in enumerate(ops) if len(o) > p]
            if y.is_contiguous() and all(self.kernel(kind) for kind in {_KIND[c] for _, c, _ in at}):
                self._launch(y, at)
                continue
            groups: dict = {}
            for r, code, value in at:
                groups.setdefault(_KIND[code], []).append((r, code, value))
            for kind, rows in sorted(groups.items()):
                if self.exact(kind):
                    self._apply(y, kind, rows)
                else:
                    self._on_host(y, rows)
        return y

    def kernel(self, kind: int) -> bool:
        """Whether the Triton kernel runs operations of ``kind`` here: where
        Triton imports, on a GPU (or the interpreter in the tests), and its
        bytes were PIL's on the probes of that kind (checked once, the first
        time; else torch's operations run them)."""
        if self._kernel_ok is None or kind >= _OWN:
            return False
        ok = self._kernel_ok.get(kind)
        if ok is None:
            try:
                ok = self._check(kind, self._launch, "the ColorJitter kernel is not used for them: torch's "
                                                     "operations run them")
            except Exception as e:  # noqa: BLE001 - a Triton that cannot compile or launch here
                log.info("decode='device': the ColorJitter kernel cannot run on %s (%s: %s): torch's operations "
                         "run it", self.device, type(e).__name__, e)
                ok = False
            self._kernel_ok[kind] = ok
        return ok

    def exact(self, kind: int) -> bool:
        """Whether this device's torch operations of ``kind`` give PIL's
        bytes (checked once, on probe images, the first time)."""
        ok = self._exact.get(kind)
        if ok is None:
            ok = self._exact[kind] = self._check(kind, lambda y, rows: self._apply(y, kind, rows),
                                                 "those operations of ColorJitter run on the CPU, a row at a "
                                                 "time (the same pixels, slower)")
        return ok

    def _means(self, y: torch.Tensor, rows: list) -> torch.Tensor:
        """Contrast's grey level for each of ``rows`` of ``y`` as it is: the
        mean of its luma (the histogram's sum over the pixel count in double
        precision, rounded half up), float32 on the device."""
        lum = _luma(y.index_select(0, upload(np.array(rows, dtype=np.int64), self.device)))
        return _mean(lum.sum(dim=(1, 2), dtype=torch.int64), lum.shape[1] * lum.shape[2])

    def _launch(self, y: torch.Tensor, rows: list) -> None:
        """One launch of the kernel: each of ``rows`` (``(row, code,
        value)``) through its operation, in place."""
        n, hw, dev = len(rows), y.shape[2] * y.shape[3], self.device
        codes = np.array([c for _, c, _ in rows], dtype=np.int32)
        hue = codes == HUE
        values = np.array([v for _, _, v in rows], dtype=np.float64)
        alphas = np.where(hue, 0.0, values).astype(np.float32)       # the factor in single precision
        shifts = np.where(hue, values, 0).astype(np.int64).astype(np.int32) & 255
        grid = (-(-hw // _BLOCK),)
        bases = torch.zeros(n, dtype=torch.float32, device=dev)
        contrast = [j for j, (_, c, _) in enumerate(rows) if c == CONTRAST]
        if contrast:       # contrast's grey levels first: each row's luma summed (a kernel), then its mean
            sums = torch.zeros(len(contrast), dtype=torch.int64, device=dev)
            launch(dev, _kernel().luma_sums, (len(contrast), *grid),
                                  (y, upload(np.array([rows[j][0] for j in contrast], dtype=np.int64), dev), sums, hw),
                                  {"BLOCK": _BLOCK})
            bases.index_copy_(0, upload(np.array(contrast, dtype=np.int64), dev), _mean(sums, hw))
        if hue.any():
            to_hsv, from_hsv = _hsv_tables(dev)
        else:      # not read (no row turns its hue), but typed as the tables: the kernel compiles once
            to_hsv = from_hsv = torch.zeros(1, dtype=torch.int32, device=dev)
        args = (y, upload(np.array([r for r, _, _ in rows], dtype=np.int64), dev), upload(codes, dev),
                upload(alphas, dev), bases, upload(shifts, dev), hw, to_hsv, from_hsv)
        launch(dev, _kernel().jitter_ops, (n, *grid), args, {"BLOCK": _BLOCK, "enable_fp_fusion": False})

    def _apply(self, y: torch.Tensor, kind: int, rows: list) -> None:
        idx = upload(np.array([r for r, _, _ in rows], dtype=np.int64), self.device)
        x = y.index_select(0, idx)
        if kind == _TIMM_MIX:
            out = self._timm_mix(x, [v for _, _, v in rows])
        elif kind >= _OWN:
            out = pil_ops.apply(x, kind - _OWN, [v for _, _, v in rows])
        elif kind == _HUE:
            out = self._hue(x, [int(v) & 255 for _, _, v in rows])
        else:
            # the factor rounded to single precision, as PIL's blend takes it
            alpha = upload(np.array([v for _, _, v in rows], dtype=np.float64).astype(np.float32),
                           self.device).view(-1, 1, 1, 1)
            if kind == _SATURATE:
                out = _blend(_luma(x).unsqueeze(1).to(torch.float32), x, alpha)
            else:
                a = torch.zeros(len(rows), dtype=torch.float32, device=self.device)
                contrast = [j for j, (_, code, _) in enumerate(rows) if code == CONTRAST]
                if contrast:
                    a.index_copy_(0, upload(np.array(contrast, dtype=np.int64), self.device),
                                  self._means(y, [rows[j][0] for j in contrast]))
                out = _blend(a.view(-1, 1, 1, 1), x, alpha)
        y.index_copy_(0, idx, out)

    def _timm_mix(self, x: torch.Tensor, values: list) -> torch.Tensor:
        """timm's AugMix of each row as its ``(m, weights, chains)`` say:
        each chain's operations on a copy of the rows (through this jitter,
        position by position, as any row's operations), the copies summed
        with their weights in single precision (a product, then a sum: as
        numpy computes ``mixed += w * image``), clipped to 0..255,
        truncated, then PIL's blend of the row with that at ``m``."""
        dev = x.device
        mixed = torch.zeros(x.shape, dtype=torch.float32, device=dev)
        for i in range(max(len(v[1]) for v in values)):
            aug = self(x.clone(), [list(v[2][i]) if i < len(v[2]) else [] for v in values])
            w = upload(np.array([v[1][i] if i < len(v[1]) else 0.0 for v in values], dtype=np.float32), dev)
            mixed.add_(w.view(-1, 1, 1, 1) * aug.to(torch.float32))
        blended = mixed.clamp_(0.0, 255.0).to(torch.uint8)
        m = upload(np.array([v[0] for v in values], dtype=np.float32), dev).view(-1, 1, 1, 1)
        return _blend(x.to(torch.float32), blended, m)

    def _hue(self, x: torch.Tensor, shifts: list) -> torch.Tensor:
        to_hsv, from_hsv = _hsv_tables(self.device)
        rgb = x[:, 0].to(torch.int32).bitwise_left_shift_(16)
        rgb.bitwise_or_(x[:, 1].to(torch.int32).bitwise_left_shift_(8)).bitwise_or_(x[:, 2].to(torch.int32))
        hsv = _take(to_hsv, rgb)
        shift = upload(np.array(shifts, dtype=np.int32), self.device).view(-1, 1, 1)
        turned = hsv.bitwise_right_shift(16).add_(shift).bitwise_and_(255).bitwise_left_shift_(16)
        rgb = _take(from_hsv, hsv.bitwise_and_(0xFFFF).bitwise_or_(turned))
        out = torch.empty_like(x)
        out[:, 0].copy_(rgb.bitwise_right_shift(16))
        out[:, 1].copy_(rgb.bitwise_right_shift(8).bitwise_and_(255))
        out[:, 2].copy_(rgb.bitwise_and_(255))
        return out

    def _on_host(self, y: torch.Tensor, rows: list) -> None:
        """The rows' operations as the CPU path computes them (PIL's bytes),
        a row at a time."""
        for r, code, value in rows:
            y[r].copy_(torch.from_numpy(host_jitter(y[r].cpu().numpy(), [(code, value)])))

    def _check(self, kind: int, run, then: str) -> bool:
        """Whether ``run(y, rows)`` gives PIL's bytes for operations of
        ``kind`` on probe images (noise, dark noise, grey pixels; factors
        from 0 to 2.75, hue turns across the circle), or for a kind with a
        stated tolerance (``pil_ops.TOLERANCE``: the blur) values within its
        levels, the share that differ counted over all the probes; where
        not, a warning ending with ``then``."""
        rng = random.Random(20261128)

        def noise(h, w, scale=1):
            return np.frombuffer(rng.randbytes(h * w * 3), np.uint8).reshape(h, w, 3) // scale

        images = [noise(24, 32), noise(9, 13, 4)]
        grey = noise(8, 8)
        grey[:, :, 1] = grey[:, :, 2] = grey[:, :, 0]        # grey pixels: no hue, no saturation
        images.append(grey)
        flat = noise(6, 6) // 255 + 77                          # one value: the tables' degenerate cases
        narrow = noise(40, 40) // 64 + 100                      # four values: large steps in equalize's table
        images += [flat, narrow]
        codes = [code for code, k in _KIND.items() if k == kind]
        cases = probe_ops(codes)
        most, share = pil_ops.TOLERANCE.get(codes[0], (0, 0.0))
        differ = values = 0
        for img in images:
            x = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))[None].to(self.device)
            for ops in cases:
                try:
                    want = np.asarray(pil_jitter(Image.fromarray(img), ops)).transpose(2, 0, 1)
                except (ValueError, RuntimeError):   # a blur's kernel larger than the probe: not a case
                    continue
                if want.shape != x.shape[1:]:        # a quarter turn of an image that is not square
                    continue
                got = x.clone()
                run(got, [(0, *ops[0])])
                d = np.abs(got[0].cpu().numpy().astype(np.int16) - want.astype(np.int16))
                differ, values = differ + int((d > 0).sum()), values + d.size
                if int(d.max()) > most or (not share and differ):
                    log.warning("decode='device': %s on %s does not give this PIL's bytes on a probe image: %s",
                                ops, self.device, then)
                    return False
        if values and differ / values > share:
            log.warning("decode='device': operations %s on %s differ from this PIL's on %d of %d probe values, "
                        "more than their tolerance: %s", codes, self.device, differ, values, then)
            return False
        return True
