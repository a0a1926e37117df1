"""``decode="device"``, the prep side (workers, or the main process with
``num_workers=0``): what a sample carries when its image is decoded on the
device after the pipeline.

A transform the device stage can run (:func:`plan_for`) becomes a
:class:`DecodePlan`.  Each pass prepares a :class:`DecodePrep`, a view of
the dataset whose transform is an :class:`EncodedCompose`: where the CPU
path decodes, crops, resizes, flips and converts, ``from_bytes(raw)`` reads
the JPEG header, applies PIL's pixel limit, draws the sample's geometry
from its own generator with the CPU path's draws in the CPU path's order
(:meth:`DecodePlan.draw`), and returns an int64 *record* of ``RECORD``
fields in place of the image; the compressed bytes travel beside the batch
(the engine packs them into a shared-memory slot, ``BatchStats.device_blob``).
A sample the device decoder cannot take (not a JPEG, a header that does not
parse, CMYK/YCCK, no end-of-image marker; with ``COORDL_DEVICE_CHECK_DATA``,
entropy-coded data libjpeg-turbo finds short or corrupt) is prepared here on the CPU path
(the fused decode, same draws) up to the uint8 image ``ToTensor`` would
scale, and its record says so (``ON_CPU``); so is an image the dataset's
prep decoded itself (``transform(img)`` rather than ``from_bytes``), and
so is every sample of the workers' share (``COORDL_DEVICE_DECODER``'s
``workers``: :attr:`DecodePlan.cpu_share`, a function of the index).  A
bad file raises here exactly as on the CPU path.

Records are found in the sample as the device split finds its uint8 images
(:mod:`.split`: marked tensors, their paths), so any structure default
collation accepts works.  Nothing here holds device state.
"""
from __future__ import annotations

import copy
import random
import threading

import numpy as np
import torch

from ..decode import augmix
from ..decode.color import AFFINE, AUGMIX, BLUR, PERSPECTIVE, TIMM_AUGMIX
from .split import _Marked, _unmark

__all__ = ["RECORD", "ON_DEVICE", "ON_CPU", "DecodePlan", "plan_for", "DecodePrep", "EncodedCompose", "ops_of",
           "rects_of", "tail_fields", "noise_sizes"]

# the record: one int64 row per image; MODE: the index of the resize's interpolation among the plan's
# modes (DecodePlan.modes: a RandomResizedCrop that draws one); VFLIP: mirror top-bottom at the end (FLIP:
# left-right); after CHANNELS, the colour operations the device applies to
# the image after its geometry (a plan with ColorJitter): their number, then (code, value) pairs
# (coordl.decode.color's codes; the value a float64's bits); then the rectangles it erases after the
# conversion (a plan with RandomErasing): their number, then (top, left, height, width) each; then the
# parameters of the operations that need more than a number (an operation (AFFINE, k) or (BLUR, k) is the
# k-th's), seven fields each: an auto-augment policy's affine map, six doubles' bits then the fill and PIL's
# filter in one field (the filter << 32 | the fill's three values, or 1 << 24 for none); a GaussianBlur's
# kernel sizes, its sigmas' bits and whether it is torchvision v2's; an AugMix's draws take two slots
# (coordl.decode.augmix.pack), and so does a perspective map (eight doubles' bits, then the fill and filter);
# timm's AugMix takes as many as its chains need (_pack_timm_augmix)
MAX_OPS, MAX_RECTS, MAX_AFFINES = 8, 4, 12
_UNREAD = object()      # DecodePlan.device_size's header not read yet (None: a header that could not be read)
(KIND, SRC_H, SRC_W, T1, L1, H1, W1, RH, RW, T2, L2, H2, W2, FLIP, MODE, VFLIP, INDEX, CHANNELS, N_OPS) = range(19)
OPS = N_OPS + 1
N_RECTS = OPS + 2 * MAX_OPS
RECTS = N_RECTS + 1
AFFINES = RECTS + 4 * MAX_RECTS
RECORD = AFFINES + 7 * MAX_AFFINES
ON_DEVICE, ON_CPU = 0, 1

_local = threading.local()
_GOLDEN, _MASK64, _TWO64 = 0x9E3779B97F4A7C15, (1 << 64) - 1, float(1 << 64)


class DecodePlan:
    """The geometry and conversion the device stage runs for one transform
    (made by :func:`plan_for`; picklable, no device state).

    ``steps``: coordl's geometric transforms in order; ``resize``: the
    ``RandomResizedCrop`` or ``Resize`` among them (None: no resize);
    ``size``: the output (h, w); ``modes``: the resize's interpolation, or
    the modes its ``RandomResizedCrop`` draws from (timm's
    ``interpolation="random"``; the record's ``MODE`` says which);
    ``mode``: the one mode (None where it draws); ``antialias``: the resize's;
    ``to_float``: ``ToTensor`` (else ``PILToTensor``: uint8 out);
    ``normalizes``: the ``Normalize`` steps after ``ToTensor``; ``jitters``:
    torchvision ``ColorJitter`` steps between the geometry and the
    conversion (``coordl.tvcompat.ColorJitterOnPlanes``; also
    ``RandomGrayscale`` and the auto-augment policies,
    ``coordl.tvcompat.PolicyOnDevice``), their draws made
    with the sample's (:meth:`draw_ops`), their arithmetic PIL's, on the
    device (:mod:`.jitter`); ``erasing``: a
    ``RandomErasing`` after the conversion (``coordl.tvcompat.ErasingOnTensor``),
    its rectangles drawn with the sample's after the jitter's draws
    (:meth:`draw_after`), erased on the device after the conversion."""

    def __init__(self, steps: list, resize, size: tuple, to_float: bool, normalizes: list, spec,
                 jitters: list = (), erasing=None, reciprocal: bool = False) -> None:
        from .. import transforms as T

        self.steps = list(steps)
        self.resize = resize
        self.size = tuple(size)
        self.modes = T.modes_of(resize) if resize is not None else (T.InterpolationMode.BILINEAR,)
        self.mode = self.modes[0] if len(self.modes) == 1 else None
        self.antialias = bool(resize.antialias) if resize is not None else True
        self.to_float = to_float
        # ToTensor's scaling by a multiply with 1/255 (torchvision v2's ToDtype), else a division
        self.reciprocal = reciprocal
        self.normalizes = list(normalizes)
        self.jitters = list(jitters)
        self.erasing = erasing
        self.spec = spec
        # the CPU path up to the uint8 image ToTensor scales (samples the device decoder cannot take)
        self.prefix = self.steps + [T.PILToTensor()]
        # the share of the samples the workers decode on the CPU path beside the device's decoder
        # (COORDL_DEVICE_DECODER's "workers", coordl.device.decoders.cpu_share); set by the loader
        self.cpu_share = 0.0
        # COORDL_DEVICE_CHECK_DATA (coordl.device.decoders.check_data): each JPEG's entropy-coded data read
        # through libjpeg-turbo first; set by the loader
        self.check_data = False

    def on_cpu(self, index: int) -> bool:
        """Sample ``index`` is one the workers decode on the CPU path
        (:attr:`cpu_share`): a function of the index and the share alone,
        so a sample's pixels never depend on the batch, the worker or the
        timing, and resume gives the same.  The indices are spread by a
        Weyl sequence (index times the golden ratio, modulo 1): any run of
        consecutive indices, and a shuffled batch on average, has the share."""
        return self.cpu_share > 0 and ((int(index) * _GOLDEN) & _MASK64) < self.cpu_share * _TWO64

    def device_size(self, raw, index: int, hdr=_UNREAD):
        """``(height, width)`` where the device decoder takes sample
        ``index``'s JPEG ``raw``, else None (the CPU path: the workers'
        share, not a JPEG, CMYK/YCCK, no end-of-image marker, and with
        :attr:`check_data` entropy-coded data that ends early or is corrupt,
        which a GPU decoder would decode in part).  Raises PIL's
        decompression-bomb error before any pixel exists, as the CPU path.
        ``hdr``: ``raw``'s ``coordl.decode.jpeg._header``, where the caller
        has read it."""
        jpeg = _lazy()[1]
        if self.cpu_share and self.on_cpu(index):
            return None
        if hdr is _UNREAD:
            hdr = jpeg._header(raw)
        if hdr is None or hdr[2] not in jpeg._FAST_COLORSPACES or not jpeg._ends_with_eoi(raw):
            return None
        height, width = int(hdr[0]), int(hdr[1])
        jpeg.check_pixels((height, width))
        if self.check_data and not jpeg.entropy_data_complete(raw, height, width):
            return None
        return height, width

    def draw(self, height: int, width: int, rng) -> list:
        """The record fields T1..VFLIP for a ``height`` x ``width`` image:
        the draws of ``coordl.transforms.decode_and_apply`` (and of the
        transforms called one by one), in its order, from ``rng``.

        The CPU path mirrors the image where a flip stands before the next
        crop (a flip does not commute with a crop); here the crops are
        mapped onto the unmirrored image instead and one flip, the parity of
        both, is applied at the end: the same pixels, one mirror.  A
        vertical flip alike, on the other axis (the CPU path applies it
        where it stands)."""
        from ..decode.ops import _draw_box
        from .. import transforms as T

        h, w = height, width                 # the image as the CPU path holds it now
        box1 = (0, 0, height, width)          # crop of the decoded image
        rh = rw = 0                           # then resize to (rh, rw)
        box2 = None                           # then crop (zero outside) of the resized image
        mirrored = False                      # the CPU path's image is the mirror of ours
        flip = False                          # a drawn flip not yet applied (decode_and_apply's)
        upside = False                        # the CPU path's image is upside down from ours
        mode = 0                              # the resize's mode among self.modes
        for t in self.steps:
            tt = type(t)
            if tt is T.RandomHorizontalFlip:
                if rng.random() < t.p:
                    flip = not flip
                continue
            if tt is T.RandomVerticalFlip:
                if rng.random() < t.p:
                    upside = not upside
                continue
            if flip:
                mirrored, flip = not mirrored, False
            if tt is T.RandomResizedCrop:
                top, left, bh, bw = _draw_box(h, w, t.scale, t.ratio, rng)
                mode = t.draw_mode(rng)
                box1 = (h - top - bh if upside else top, w - left - bw if mirrored else left, bh, bw)
                h, w = rh, rw = t.size
            elif tt is T.Resize:
                h, w = rh, rw = t.output_size(h, w)
            else:                             # CenterCrop, RandomCrop
                ch, cw = t.size
                if tt is T.CenterCrop:
                    top, left = t.offsets(h, w)
                else:
                    if h < ch or w < cw:
                        raise ValueError(f"Required crop size {(ch, cw)} is larger than input image size {(h, w)}")
                    top, left = rng.randint(0, h - ch), rng.randint(0, w - cw)
                box2 = (h - top - ch if upside else top, w - left - cw if mirrored else left, ch, cw)
                h, w = ch, cw
        if box2 is None:
            box2 = (0, 0, h, w)
        return [*box1, rh, rw, *box2, int(mirrored != flip), mode, int(upside)]

    @property
    def draws_after(self) -> bool:
        """Something draws after the geometry (a jitter or an erasing)."""
        return bool(self.jitters) or self.erasing is not None

    def draw_ops(self, rng) -> list:
        """The colour operations of the plan's ``ColorJitter`` steps for one
        sample (:meth:`draw_after`'s first)."""
        return self.draw_after(rng)[0]

    def draw_after(self, rng) -> tuple[list, list, "np.ndarray | None"]:
        """``(ops, rects, noise)`` of one sample, drawn as the CPU path draws
        them after the geometry: the colour operations of the plan's
        ``ColorJitter`` steps, ``[(code, value)]`` in order
        (``coordl.decode.color``'s), then the rectangles its
        ``RandomErasing`` erases, ``[(top, left, height, width)]``, and with
        an erasing of noise (:attr:`noise`) their values, float32, one
        rectangle after the other (:func:`noise_sizes`), else None; by the
        user's objects, from torch's and Python's generators seeded from
        ``rng`` (the sample's own, after :meth:`draw`; as
        ``coordl._rng.seeded_globals`` seeds them)."""
        if not self.draws_after:
            return [], [], None
        if not isinstance(rng, random.Random):     # outside a prep stage: the generators as they are
            return self._draw_after()
        _rng = _lazy()[0]
        seeds = _rng.global_seeds(rng)
        if self.numpy_draws:                        # numpy's seed next, as coordl._rng.seeded_globals draws it
            seeds = (*seeds, _rng.numpy_seed(rng))
        return self.after_for_seeds([seeds])[0]

    def _draw_after(self) -> tuple[list, list, "np.ndarray | None"]:
        ops = [op for j in self.jitters for op in j.draw(self.size)]
        rects, noise = self.erasing.draw_with(3, *self.size) if self.erasing is not None else ([], None)
        if len(rects) > MAX_RECTS:
            raise ValueError(f"{self.erasing.user!r} drew {len(rects)} rectangles, more than the {MAX_RECTS} "
                             "decode='device' erases")
        if noise:
            noise = np.concatenate([v.reshape(-1).numpy() for v in noise]).astype(np.float32, copy=False)
        return ops, rects, (noise if rects and self.noise else None)

    @property
    def noise(self) -> str | None:
        """The erasing's noise (``coordl.tvcompat.ErasingOnTensor.noise``):
        None (a constant value, or no erasing), ``"pixel"`` or ``"rand"``."""
        return self.erasing.noise if self.erasing is not None else None

    def after_for_seeds(self, seeds) -> list:
        """:meth:`draw_after` of samples given the seeds of torch's and
        Python's generators for their as-written steps (the pairs of
        ``coordl._rng.global_seeds``; with :attr:`numpy_draws`, numpy's
        third).  torch's generator's state is saved
        once for them all and restored after; Python's is seeded (and saved
        and restored) only where a step draws from it (:attr:`python_draws`:
        torchvision's ``ColorJitter`` and ``RandomErasing`` draw from
        torch's alone)."""
        cpu = torch.default_generator
        python, numpy = self.python_draws, self.numpy_draws
        state, py_state = cpu.get_state(), random.getstate() if python else None
        np_state = np.random.get_state() if numpy else None
        try:
            out = []
            for torch_seed, py_seed, *np_seed in seeds:
                cpu.manual_seed(int(torch_seed))
                if python:
                    random.seed(int(py_seed))
                if numpy:
                    np.random.seed(np_seed[0])
                out.append(self._draw_after())
            return out
        finally:
            cpu.set_state(state)
            if python:
                random.setstate(py_state)
            if numpy:
                np.random.set_state(np_state)

    @property
    def python_draws(self) -> bool:
        """A step after the geometry draws from Python's generator (timm's
        ``RandomErasing``, timm's policies, torchvision v1's
        ``RandomChoice`` and ``RandomOrder``)."""
        return (self.erasing is not None and self.erasing.kind == "timm") or self.numpy_draws or any(
            getattr(j, "draws_python", False) for j in self.jitters)

    @property
    def numpy_draws(self) -> bool:
        """A step after the geometry draws from numpy's global generator
        (timm's ``RandAugment``): its seed then comes from the sample's
        generator too (:meth:`draw_after`; ``seeds`` of
        :meth:`after_for_seeds` carry it third)."""
        return any(getattr(j, "draws_numpy", False) for j in self.jitters)

    @staticmethod
    def jitter_on_cpu(x: torch.Tensor, ops: list) -> torch.Tensor:
        """The uint8 RGB planes ``x`` through the colour operations ``ops``
        (:meth:`draw_after`'s) as the CPU path computes them: PIL's bytes."""
        if not ops:
            return x
        from .jitter import host_jitter

        return torch.from_numpy(host_jitter(x.numpy(), ops))

    def describe(self) -> str:
        names = " + ".join(type(t).__name__ for t in self.steps + [getattr(j, "user", j) for j in self.jitters])
        conv = "ToTensor" + "".join(" + Normalize" for _ in self.normalizes) if self.to_float else "PILToTensor"
        if self.erasing is not None:
            conv += " + RandomErasing" + (f" ({self.erasing.noise} noise)" if self.erasing.noise else "")
        return f"{names} -> {self.size[0]}x{self.size[1]} ({' or '.join(m.value for m in self.modes)}), {conv}"

    def __repr__(self) -> str:
        return f"DecodePlan({self.describe()})"


_HOW = ("decode='device' runs [RandomResizedCrop | Resize] [CenterCrop | RandomCrop], with RandomHorizontalFlip "
        "and RandomVerticalFlip anywhere among them, then torchvision's ColorJitter (optional; alone or in a "
        "RandomApply), RandomGrayscale, TrivialAugmentWide, RandAugment and AutoAugment (nearest, bilinear "
        "or bicubic; timm's too), RandomPosterize, RandomSolarize, RandomAdjustSharpness, RandomAutocontrast, "
        "RandomEqualize, RandomInvert and GaussianBlur (alone or in a RandomApply), then ToTensor() "
        "[+ Normalize(...)s] [+ RandomErasing] or PILToTensor()")


def _refuse(why: str, fix: str = "") -> ValueError:
    fix = f"{fix}, or use decode='cpu'" if fix else "use decode='cpu' for this transform"
    return ValueError(f"decode='device' cannot run the dataset's transform: {why}. {_HOW}; {fix}")


def plan_for(transform) -> DecodePlan:
    """The :class:`DecodePlan` for ``transform`` (a coordl ``Compose``, as a
    torchvision pipeline is translated by coordl.tvcompat), or ValueError
    naming the step the device stage cannot run and what to do."""
    from .. import transforms as T
    from ..decode.ops import _TENSOR_MODES

    if transform is None:
        raise _refuse("the dataset has no transform (its samples would be PIL images)",
                      "give it a transform ending in ToTensor()")
    jitters, erasing = [], None
    if type(transform) is T.Compose:
        ts = list(transform.transforms)
    elif type(transform).__name__ == "TorchvisionPipeline":
        ts, jitters, erasing = _as_written(transform)
    elif type(transform).__name__ == "MultiViews":     # a user's transform of several views (coordl.tvcompat)
        raise _refuse(f"it makes {len(transform.calls)} views of each image ({transform.name}), and the device "
                      "stage makes one image of each sample",
                      "pass device= without decode='device' (the views are made on the CPU, each from one decode, "
                      "and the batches copied to the device)")
    else:
        raise _refuse(f"it is a {type(transform).__module__}.{type(transform).__qualname__}, not a "
                      "coordl.transforms.Compose (or a torchvision Compose of the supported steps)")
    geometric = (T.RandomResizedCrop, T.Resize, T.CenterCrop, T.RandomCrop, T.Pad, T.RandomHorizontalFlip,
                 T.RandomVerticalFlip)
    steps, resize, crop = [], None, None
    i = 0
    while i < len(ts) and type(ts[i]) in geometric:
        t, tt = ts[i], type(ts[i])
        if tt in (T.RandomResizedCrop, T.Resize):
            if resize is not None or crop is not None:
                raise _refuse(f"step {i} ({t!r}) comes after {(resize or crop)!r}: the device stage crops, resizes "
                              "once, then crops")
            if t._in_float:
                raise _refuse(f"step {i} ({t!r}) resizes a tensor in float32 and rounds once, as torchvision's v1 "
                              "functions do on a tensor, which the device stage does not",
                              "use decode='cpu', or v2's transforms (torch's uint8 kernel)")
            bad = [m.value for m in T.modes_of(t) if m.value not in _TENSOR_MODES]
            if bad:
                raise _refuse(f"step {i} ({t!r}) resamples with {bad[0]!r}, which torch's tensor "
                              f"kernels do not have (they have {', '.join(_TENSOR_MODES)})",
                              "use bilinear or bicubic")
            resize = t
        elif tt in (T.CenterCrop, T.RandomCrop, T.Pad):
            if tt is T.Pad or (tt is T.RandomCrop and (t.padding is not None or t.pad_if_needed)):
                raise _refuse(f"step {i} ({t!r}) pads the image, which the device stage does not",
                              "use decode='cpu' (with device=, uint8 images still go to the device)")
            if crop is not None:
                raise _refuse(f"step {i} ({t!r}) is a second crop after {crop!r}")
            crop = t
        steps.append(t)
        i += 1
    if i == len(ts) or type(ts[i]) not in (T.ToTensor, T.PILToTensor):
        what = "the transform ends there" if i == len(ts) else f"step {i} is {ts[i]!r}"
        raise _refuse(f"{what}: after the geometric steps the device stage needs ToTensor() or PILToTensor()")
    to_float = type(ts[i]) is T.ToTensor
    normalizes = ts[i + 1:]
    for k, t in enumerate(normalizes, i + 1):
        if type(t) is not T.Normalize or not to_float:
            raise _refuse(f"step {k} ({t!r}) follows {ts[i]!r}: only Normalize(...)s may follow ToTensor()")
    if to_float and torch.get_default_dtype() != torch.float32:
        raise _refuse(f"torch's default dtype is {torch.get_default_dtype()}, not float32 (ToTensor's result "
                      "on the device is float32)", "set torch.set_default_dtype(torch.float32)")
    for n in normalizes:
        std = torch.tensor(n.std, dtype=torch.float32)
        if (std == 0).any():
            raise _refuse(f"{n!r} has a std that is zero in float32")
    if crop is not None:
        size = crop.size
    elif type(resize) is T.RandomResizedCrop or (type(resize) is T.Resize and isinstance(resize.size, tuple)):
        size = resize.size
    else:
        raise _refuse(f"{'no geometric step' if resize is None else repr(resize)} gives every image the same size, "
                      "so the images of a batch could not be stacked",
                      "add CenterCrop(size) or RandomResizedCrop(size), or give Resize an (h, w) size")
    if erasing is not None:
        if not to_float:
            raise _refuse(f"{erasing.user!r} erases a uint8 image (after PILToTensor without a conversion to "
                          "float)", "convert to float first (ToTensor(), or ToDtype(torch.float32, scale=True))")
        if not erasing.noise and len(erasing.value) not in (1, 3):
            raise _refuse(f"{erasing.user!r} has {len(erasing.value)} values for a 3-channel image",
                          "give it one value, or one per channel")
        if erasing.most > MAX_RECTS:
            raise _refuse(f"{erasing.user!r} erases up to {erasing.most} rectangles, and the device stage at most "
                          f"{MAX_RECTS}", f"give it max_count={MAX_RECTS} or fewer")
    return DecodePlan(steps, resize, size, to_float, normalizes, transform.spec(), jitters, erasing,
                      bool(getattr(ts[i], "reciprocal", False)))


def _as_written(pipeline) -> tuple[list, list, object]:
    """``(steps, jitters, erasing)`` of a translated
    torchvision pipeline (``coordl.tvcompat.TorchvisionPipeline``) whose
    as-written part the device stage can run: torchvision ``ColorJitter``
    steps between the fused geometry (which hands them the image) and a
    tensor conversion (``ToTensor``/``ToImage`` + ``ToDtype``, then
    ``Normalize`` steps), and a ``RandomErasing`` with a constant value after
    the conversion (``pipeline.erase``; then ``ToPureTensor`` at most); else
    ValueError naming the steps it cannot."""
    erasing = pipeline.erase
    if erasing is not None:
        others = [type(t).__name__ for t in pipeline.after if type(t).__name__ != "ToPureTensor"]
        if others:
            raise _refuse(f"the steps {', '.join(others)} run as written after {erasing.user!r}",
                          "remove them from the transform")
        if not erasing.draws_agree():
            raise _refuse(f"{erasing.user!r}'s draws could not be made apart from its call here "
                          f"({type(erasing.user).__module__}: the log says why)", "remove it from the transform")
        if not pipeline.to_pil and not pipeline.tail and not pipeline.post:   # erasing the fused conversion's
            return list(pipeline.fused.transforms), [], erasing
    return (*_with_jitter(pipeline), erasing)


def _with_jitter(pipeline) -> tuple[list, list]:
    """``(steps, jitters)`` of a translated torchvision
    pipeline whose as-written part before its erasing is torchvision
    ``ColorJitter`` steps (:func:`_as_written`)."""
    from .. import transforms as T

    user = [getattr(t, "user", t) for t in pipeline.tail]
    jitters = pipeline.jitters()
    others = [type(u).__name__ for u, j in zip(user, jitters) if j is None]
    fused = pipeline.fused
    # the steps get the fused uint8 image as a PIL image, or as the tensor a PILToTensor before the crop made
    if others or not user or fused is None or type(fused.transforms[-1]) is not T.PILToTensor:
        names = ", ".join(others or [type(u).__name__ for u in user + list(pipeline.post)])   # the user's steps
        fix = "remove them from the transform"
        if pipeline.on_tensor() and set(others) & {"TrivialAugmentWide", "RandAugment", "AutoAugment", "AugMix"}:
            fix = ("given a tensor (PILToTensor before them), the device runs torchvision's auto-augment policies "
                   "and AugMix interpolating with nearest or bilinear (torchvision's own tensor functions refuse "
                   "the others) and without a fill: " + fix)
        if "RandomErasing" in names:
            fix = ("the device erases with torchvision's RandomErasing or timm's (its noise drawn on the CPU: "
                   "device='cpu'): " + fix)
        raise _refuse(f"the steps {names} run as written (coordl has no equivalent of them on the "
                      "device, or they follow one)", fix)
    bad = [j for j in jitters if not j.draws_agree()]
    if bad:
        raise _refuse(f"{bad[0].user!r}'s draws could not be made apart from its call with this torchvision "
                      f"({type(bad[0].user).__module__}: the log says why)", "remove it from the transform")
    if sum(getattr(j, "most", 4) for j in jitters) > MAX_OPS:
        raise _refuse(f"it has {len(jitters)} ColorJitter steps (or RandomGrayscale, auto-augment policies), and the "
                      f"device stage runs at most {MAX_OPS // 4} ColorJitters ({MAX_OPS} colour operations a sample; "
                      "a RandomGrayscale is one, an auto-augment policy as many as it draws)", "merge them into one")
    if sum(getattr(j, "affines", 0) for j in jitters) > MAX_AFFINES:
        raise _refuse(f"its auto-augment policies, blurs and AugMix may draw more than {MAX_AFFINES} shears, "
                      "translations, rotations or blurs a sample (an AugMix counts two, a perspective map two, "
                      "timm's AugMix as many as its chains' operations may need), the most the device stage "
                      "carries", "keep fewer such operations a sample")
    if pipeline.on_tensor():
        conversion = pipeline.post_on_tensor()
        if conversion is None:
            after = ", ".join(type(t).__name__ for t in pipeline.post)
            raise _refuse(f"after {type(user[-1]).__name__} the steps {after} run as written: on a uint8 tensor the "
                          "device stage needs ConvertImageDtype(torch.float) or ToDtype(torch.float32, scale=True) "
                          "[+ Normalize(...)s], or nothing")
        return list(fused.transforms[:-1]) + conversion, jitters
    if pipeline.post_fused is None:
        what = (f"after ColorJitter the steps {', '.join(type(t).__name__ for t in pipeline.post)} run as "
                "written" if pipeline.post else "the transform ends with ColorJitter (its result, a PIL image)")
        raise _refuse(f"{what}: after ColorJitter the device stage needs ToTensor() [+ Normalize(...)s] or "
                      "PILToTensor()")
    return list(fused.transforms[:-1]) + list(pipeline.post_fused.transforms), jitters


# ---------------------------------------------------------------- the prep side
class EncodedCompose:
    """The transform of :class:`DecodePrep`'s dataset copy.  Inside
    ``DecodePrep.prep``: ``from_bytes(raw)`` returns the image's record (and
    captures the bytes), ``__call__(img)`` (a dataset that decoded the image
    itself) prepares it on the CPU up to uint8 and returns its record.
    Outside it: the user's whole transform."""

    def __init__(self, full, plan: DecodePlan) -> None:
        self.full = full
        self.plan = plan
        self.transforms = getattr(full, "transforms", None)     # a Compose's, as the user's transform has them

    def __call__(self, img):
        cap = getattr(_local, "capture", None)
        if cap is None:
            return self.full(img)
        from ..transforms import ToTensor

        for t in self.plan.steps:
            img = t(img)
        return self._on_cpu(ToTensor.unscaled(img), cap)

    def from_bytes(self, raw):
        cap = getattr(_local, "capture", None)
        if cap is None:
            return self.full.from_bytes(raw)
        _rng, _, decode_and_apply = _lazy()
        plan = self.plan
        size = plan.device_size(raw, cap[1])
        if size is not None:
            g = _rng.current()
            geometry = plan.draw(*size, g)
            ops, rects, noise = plan.draw_after(g)
            return _capture([ON_DEVICE, *size, *geometry], raw if noise is None else (raw, noise), cap, ops, rects)
        # not for the device decoder: the CPU path, its draws and its errors (PIL's)
        return self._on_cpu(decode_and_apply(plan.prefix, raw), cap)

    def from_planes(self, planes):
        """An image the dataset decoded itself, as uint8 ``(C, H, W)``
        planes (a folder whose loader is torchvision.io's, for a file
        coordl does not decode as it does): the CPU path from there, as
        :meth:`from_bytes` takes it for a file the device does not decode."""
        cap = getattr(_local, "capture", None)
        if cap is None:
            return self.full.from_planes(planes)
        from ..transforms import apply_to_planes

        if planes.dtype != torch.uint8 or planes.ndim != 3 or planes.shape[0] != 3:
            raise _not_rgb("the dataset decoded", planes, "(3, H, W)")
        return self._on_cpu(apply_to_planes(self.plan.prefix, planes), cap)

    def _on_cpu(self, x, cap):
        """The uint8 image the CPU path made up to the jitter, jittered here
        with the sample's operations (as the CPU path draws and computes
        them); its erasing's rectangles, drawn right after, go to the device
        in the record."""
        oh, ow = self.plan.size
        if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or tuple(x.shape) != (3, oh, ow):
            raise _not_rgb("the CPU path made", x, f"(3, {oh}, {ow})")
        ops, rects, noise = self.plan.draw_after(_lazy()[0].current())
        x = self.plan.jitter_on_cpu(x.contiguous(), ops).contiguous()
        return _capture([ON_CPU, oh, ow] + [0] * (VFLIP - SRC_W), x if noise is None else (x, noise), cap, (), rects)

    def spec(self):
        return self.full.spec()

    def __repr__(self) -> str:
        return f"encoded({self.full!r})"


def _not_rgb(who: str, x, want: str) -> ValueError:
    """The refusal of an image that is not the uint8 RGB image the device stage goes on from."""
    got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
    return ValueError(f"decode='device': {who} a {got} image where a uint8 {want} RGB image was expected (a "
                      "grayscale or RGBA image the dataset decoded itself?): convert it to RGB; a folder whose "
                      "loader is torchvision.io's decode_image can be given "
                      "loader=functools.partial(decode_image, mode=ImageReadMode.RGB), or use decode='cpu'")


_LAZY: tuple = ()


def _lazy() -> tuple:
    """(coordl._rng, coordl.decode.jpeg, decode_and_apply): imported at the
    first sample rather than with this module (which coordl.device imports
    early), then kept: a ``from`` import costs microseconds per sample."""
    global _LAZY
    if not _LAZY:
        from .. import _rng
        from ..decode import jpeg
        from ..transforms import decode_and_apply

        _LAZY = (_rng, jpeg, decode_and_apply)
    return _LAZY


def _capture(fields: list, payload, cap, ops=(), rects=()) -> torch.Tensor:
    """The record (``fields`` KIND..FLIP, then :func:`tail_fields`) as a
    marked tensor, captured with what travels beside it (through numpy: a
    third of what ``torch.tensor`` of a list costs)."""
    records, index = cap
    if ops or rects:
        arr = np.array(fields + tail_fields(index, ops, rects), dtype=np.int64)
    else:               # the common record: the blank tail copied, not made of Python ints
        arr = np.empty(RECORD, dtype=np.int64)
        arr[:INDEX] = fields
        arr[INDEX:] = BLANK_TAIL
        arr[INDEX] = index
    m = torch.from_numpy(arr).as_subclass(_Marked)
    records.append((m, payload))
    return m


_NO_OPS = [0] * (2 * MAX_OPS)
_NO_RECTS = [0] * (1 + 4 * MAX_RECTS)
_NO_AFFINES = [0] * (7 * MAX_AFFINES)


def _blank_tail() -> np.ndarray:
    tail = np.zeros(RECORD - INDEX, dtype=np.int64)
    tail[CHANNELS - INDEX] = 3
    tail.flags.writeable = False
    return tail


# tail_fields of a sample without operations or rectangles, its index 0 (set the index after copying it)
BLANK_TAIL = _blank_tail()


def tail_fields(index: int, ops=(), rects=()) -> list:
    """The record's fields from ``INDEX`` on: the sample's index, 3
    channels, the colour operations ``ops`` (``[(code, value)]``, at most
    ``MAX_OPS``, at most ``MAX_AFFINES`` of them affine) the device applies
    after the geometry, and the rectangles ``rects`` (``[(top, left,
    height, width)]``, at most ``MAX_RECTS``) it erases after the
    conversion."""
    affines = _NO_AFFINES
    if not ops:
        fields = [index, 3, 0] + _NO_OPS
    else:
        if len(ops) > MAX_OPS:
            raise ValueError(f"{len(ops)} operations after the geometry, more than the {MAX_OPS} a record carries")
        values = []
        for c, v in ops:
            if c in (AFFINE, BLUR, AUGMIX, PERSPECTIVE, TIMM_AUGMIX):
                if affines is _NO_AFFINES:
                    affines = []
                if c == AFFINE:
                    slot = _map_fields(v, 6)
                elif c == PERSPECTIVE:
                    slot = _map_fields(v, 8) + [0] * 5
                elif c == TIMM_AUGMIX:
                    slot = _pack_timm_augmix(v)
                elif c == BLUR:
                    slot = [int(v[0]), int(v[1]), *np.array(v[2:4], dtype=np.float64).view(np.int64).tolist(),
                            int(bool(v[4])), 0, 0]
                else:
                    slot = augmix.pack(v)
                if len(affines) + len(slot) > 7 * MAX_AFFINES:
                    raise ValueError(f"more affine, blur or AugMix operations in one sample than the {MAX_AFFINES} "
                                     "parameter slots of a record carry")
                values.append(float(len(affines) // 7))
                affines = affines + slot
            else:
                values.append(v)
        pairs = np.zeros((MAX_OPS, 2), dtype=np.int64)
        pairs[:len(ops), 0] = [c for c, _ in ops]
        pairs[:len(ops), 1] = np.array(values, dtype=np.float64).view(np.int64)
        fields = [index, 3, len(ops)] + pairs.ravel().tolist()
        affines = affines + [0] * (7 * MAX_AFFINES - len(affines))
    if not rects:
        return fields + _NO_RECTS + affines
    return fields + [len(rects)] + [int(v) for r in rects for v in r] + [0] * (4 * (MAX_RECTS - len(rects))) \
        + affines


_NO_FILL = 1 << 24


def _map_fields(v, n: int) -> list:
    """An affine (``n`` 6) or perspective (8) map's fields: its ``n``
    doubles' bits, then its fill and PIL filter in one (:func:`_packed`)."""
    return np.array(v[:n], dtype=np.float64).view(np.int64).tolist() + [_packed(v[n], v[n + 1])]


def _map_value(fields, n: int) -> tuple:
    """The map of :func:`_map_fields`'s fields: ``(a0.., fill, filter)``."""
    a = np.array(fields[:n], dtype=np.int64).view(np.float64).tolist()
    f = int(fields[n])
    fill = None if f & _NO_FILL else ((f >> 16) & 255, (f >> 8) & 255, f & 255)
    return (*a, fill, f >> 32)


def _packed(fill, resample: int) -> int:
    """An affine map's fill (None, or three values 0..255) and PIL filter as
    one field."""
    if fill is None:
        return (int(resample) << 32) | _NO_FILL
    r, g, b = (int(v) for v in fill)
    return (int(resample) << 32) | (r << 16) | (g << 8) | b


def ops_of(rec) -> list:
    """The colour operations a record (its fields, a list) carries:
    ``[(code, value)]``."""
    n = rec[N_OPS]
    if not n:
        return []
    pairs = np.array(rec[OPS:OPS + 2 * n], dtype=np.int64).reshape(n, 2)
    ops = list(zip(pairs[:, 0].tolist(), pairs[:, 1].copy().view(np.float64).tolist()))
    for j, (c, v) in enumerate(ops):
        if c in (AFFINE, PERSPECTIVE):
            at = AFFINES + 7 * int(v)
            ops[j] = (c, _map_value(rec[at:at + 9], 6 if c == AFFINE else 8))
        elif c == BLUR:
            at = AFFINES + 7 * int(v)
            sx, sy = np.array(rec[at + 2:at + 4], dtype=np.int64).view(np.float64).tolist()
            ops[j] = (c, (int(rec[at]), int(rec[at + 1]), sx, sy, int(rec[at + 4])))
        elif c == AUGMIX:
            at = AFFINES + 7 * int(v)
            ops[j] = (c, augmix.unpack(rec[at:at + augmix.FIELDS]))
        elif c == TIMM_AUGMIX:
            ops[j] = (c, _unpack_timm_augmix(rec, AFFINES + 7 * int(v)))
    return ops


def timm_augmix_fields(value) -> int:
    """The fields :func:`_pack_timm_augmix` takes for ``value``."""
    m, weights, chains = value
    return 1 + (len(weights) + 2) // 2 + sum(1 + (7 if c == AFFINE else 1) for chain in chains for c, _ in chain)


def _pack_timm_augmix(value) -> list:
    """timm's AugMix's draws (``(m, weights, chains)``: PIL's operations,
    ``coordl.decode.color``'s) as fields, padded to whole slots: the chains'
    count and each one's length, m and the weights two float32 to a field,
    then each operation's code and its value (an affine map's seven fields,
    else a float64's bits)."""
    m, weights, chains = value
    if len(chains) != len(weights) or len(chains) > 15 or any(len(c) > 15 for c in chains):
        raise ValueError("timm's AugMix with more than 15 chains or operations in a chain")
    head = len(chains)
    for i, c in enumerate(chains):
        head |= len(c) << (4 + 4 * i)
    fields = [head] + augmix.f32_fields([m, *weights])
    for chain in chains:
        for c, v in chain:
            if c == AFFINE:
                fields += [int(c)] + _map_fields(v, 6)
            elif c in (BLUR, AUGMIX, PERSPECTIVE, TIMM_AUGMIX):
                raise ValueError(f"operation {c} inside timm's AugMix")
            else:
                fields += [int(c), int(np.array([v], dtype=np.float64).view(np.int64)[0])]
    return fields + [0] * (-len(fields) % 7)


def _unpack_timm_augmix(rec, at: int) -> tuple:
    head = int(rec[at]) & ((1 << 64) - 1)
    width = head & 15
    lengths = [(head >> (4 + 4 * i)) & 15 for i in range(width)]
    n = (width + 2) // 2
    floats = augmix.f32_values(rec[at + 1:at + 1 + n], width + 1)
    k, chains = at + 1 + n, []
    for length in lengths:
        chain = []
        for _ in range(length):
            c = int(rec[k])
            if c == AFFINE:
                chain.append((c, _map_value(rec[k + 1:k + 8], 6)))
                k += 8
            else:
                chain.append((c, float(np.array([rec[k + 1]], dtype=np.int64).view(np.float64)[0])))
                k += 2
        chains.append(tuple(chain))
    return floats[0], tuple(floats[1:1 + width]), tuple(chains)


def noise_sizes(rects, noise: str | None, channels: int = 3) -> list:
    """The float32 values each of ``rects`` carries for an erasing of
    ``noise`` (``"pixel"``: one per channel and pixel; ``"rand"``: one per
    channel; None: none), in the order they travel after the payload."""
    if noise == "pixel":
        return [channels * h * w for _, _, h, w in rects]
    return [channels if noise == "rand" else 0 for _ in rects]


def rects_of(rec) -> list:
    """The rectangles a record (its fields, a list) erases:
    ``[(top, left, height, width)]``."""
    return [tuple(rec[RECTS + 4 * q:RECTS + 4 * q + 4]) for q in range(rec[N_RECTS])]


def _find(sample, records: list):
    """``[(path, payload)]`` of the records in ``sample`` (in the order
    default collation walks it), or None when one was touched or is not a
    leaf there."""
    from collections import abc

    if any(m.__dict__.get("_coordl_touched") for m, _ in records):
        return None
    if len(records) == 1 and type(sample) is tuple and len(sample) == 2 and sample[0] is records[0][0] \
            and type(sample[1]) is int:
        return [((0,), records[0][1])]      # (image, label), as ImageFolder's: no walk needed
    by_id = {id(m): p for m, p in records}
    out: list = []

    def go(x, path):
        if isinstance(x, torch.Tensor):
            if id(x) in by_id:
                out.append((path, by_id.pop(id(x))))
            return
        if isinstance(x, (str, bytes)):
            return
        if isinstance(x, abc.Mapping):
            for k, v in x.items():
                go(v, path + (k,))
        elif isinstance(x, abc.Sequence):
            for i, v in enumerate(x):
                go(v, path + (i,))

    go(sample, ())
    return out if not by_id else None


class DecodePrep:
    """What the pipeline prepares with ``decode="device"``: the dataset's
    own ``prep`` over a shallow copy whose transform is an
    :class:`EncodedCompose`; :meth:`take_device_marks` and
    :meth:`take_device_payloads` say where the records sit in the last
    sample and what travels with them.  The user's dataset is never modified."""

    def __init__(self, dataset, plan: DecodePlan) -> None:
        self._dataset = dataset
        mine = copy.copy(dataset)
        mine.transform = EncodedCompose(dataset.transform, plan)
        self._split_ds = mine
        self.plan = plan
        self._last: tuple = ((), [], None)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            target = self.__dict__["_split_ds"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(target, name)

    def __len__(self) -> int:
        return len(self._split_ds)

    def describe(self, index: int) -> str:
        fn = getattr(self._dataset, "describe", None)
        return str(fn(index)) if callable(fn) else f"{type(self._dataset).__name__}[{index}]"

    def prep(self, raw, index: int):
        records: list = []
        self._last = ((), [], None)
        _local.capture = (records, index)
        try:
            sample = self._split_ds.prep(raw, index)
        finally:
            _local.capture = None
        found = _find(sample, records)
        for m, _ in records:
            _unmark(m)
        if found is None:
            self._last = ((), [], index)
        else:
            self._last = (tuple(p for p, _ in found), [x for _, x in found], None)
        return sample

    def take_device_marks(self) -> tuple:
        """(paths of the records in the last sample, False)."""
        return self._last[0], False

    def take_device_payloads(self) -> list:
        """What travels with each record of the last sample, in the order of
        its paths: the JPEG's bytes, or the uint8 image the CPU path made.
        RuntimeError when the dataset's prep did more with a record than
        place it in the sample (not a sample's fault: the pass stops)."""
        paths, payloads, bad = self._last
        self._last = ((), [], None)
        if bad is not None:
            raise RuntimeError(
                f"decode='device': the dataset's prep did more with the image of sample {bad} "
                f"({self.describe(bad)}) than place it in the sample (it computed from it, or put it inside "
                "another object), but the image exists only after the batch is decoded on the device; "
                "have prep return transform.from_bytes(raw) as it is, or use decode='cpu'")
        return payloads
