"""Per-sample random generators.

Random augmentations in coordl draw from a generator that is a pure function of
(seed, epoch, sample index).  The prep stage enters :func:`sample_rng` around
``prep(raw, i)``; ``coordl.transforms`` asks :func:`current` for the generator.
A resumed run therefore reproduces exactly the same crops and flips, whichever
worker prepares the sample and in whatever order.

Outside a coordl prep stage (a transform called by hand, or by torch's
DataLoader), :func:`current` returns a shim over torch's global RNG, which is
what torchvision does, so ``torch.manual_seed`` still controls the result.
"""
from __future__ import annotations

import contextlib
import random
import threading

import torch

__all__ = ["sample_rng", "current", "derive", "rewind", "TorchRandom", "seeded_globals", "global_seeds",
           "batch_rng", "seeded_collate", "seeded_user_steps"]

_MASK64 = (1 << 64) - 1
_local = threading.local()


_AGAIN_SHIFT = 194      # above the batch and user bits below: a repeat's key is no other generator's


def _key(seed: int, epoch: int, index: int, again: int = 0) -> int:
    key = ((seed & _MASK64) << 128) | ((epoch & _MASK64) << 64) | (index & _MASK64)
    return key | ((again & _MASK64) << _AGAIN_SHIFT) if again else key


def derive(seed: int, epoch: int, index: int, again: int = 0) -> random.Random:
    """The generator for sample ``index`` of epoch ``epoch`` under ``seed``.

    ``random.Random`` seeded from one big integer built from the three values:
    distinct triples give distinct seeds, the result is identical on every
    platform and Python version that keeps the Mersenne Twister seeding rule,
    and drawing from it costs ~50 ns (a torch.Generator draw costs ~2 us).
    ``again``: how many times the index came before in the pass's order (a
    sampler that repeats indices: repeated augmentation, sampling with
    replacement), so that each time draws anew, as under torch; 0, the
    first time, keeps the triple's generator.
    """
    return random.Random(_key(seed, epoch, index, again))


class TorchRandom:
    """The subset of ``random.Random`` that transforms use, drawn from torch's
    global generator (what torchvision does when no per-sample generator is set)."""

    def random(self) -> float:
        return float(torch.rand(1).item())

    def uniform(self, a: float, b: float) -> float:
        return float(torch.empty(1).uniform_(a, b).item())

    def randint(self, a: int, b: int) -> int:
        """Inclusive on both ends, like ``random.Random.randint``."""
        return int(torch.randint(a, b + 1, size=(1,)).item())


_TORCH_RANDOM = TorchRandom()


def current():
    """The generator random transforms should draw from right now."""
    g = getattr(_local, "rng", None)
    return g if g is not None else _TORCH_RANDOM


class sample_rng:
    """``with sample_rng(seed, epoch, index[, again]) as g``: make ``g =
    derive(seed, epoch, index, again)`` the current generator in this
    thread, the previous one back on exit.  A class rather than a
    ``@contextmanager`` generator: it is entered once per sample, and this
    costs a third as much."""

    __slots__ = ("g", "prev", "key")

    def __init__(self, seed: int, epoch: int, index: int, again: int = 0) -> None:
        self.key = (seed, epoch, index, again)
        self.g = derive(seed, epoch, index, again)

    def __enter__(self) -> random.Random:
        self.prev = (getattr(_local, "rng", None), getattr(_local, "key", None))
        _local.rng, _local.key = self.g, self.key
        return self.g

    def __exit__(self, *exc) -> None:
        _local.rng, _local.key = self.prev


def rewind() -> None:
    """Inside a prep stage: make the sample's generator what it was when its
    prep began (a sample prepared again draws the same values; see
    coordl.device.SplitPrep).  Outside one: nothing to rewind."""
    key = getattr(_local, "key", None)
    if key is not None:
        _local.rng = derive(*key)


def global_seeds(g: random.Random) -> tuple[int, int]:
    """(torch's seed, Python's seed) for a sample's as-written steps: two
    draws of its generator ``g``, in that order (:func:`seeded_globals`)."""
    return g.getrandbits(63), g.getrandbits(63)


def numpy_seed(g) -> list:
    """The seed of numpy's global generator for a scope seeded from ``g``:
    four 32-bit draws, after :func:`global_seeds`'s two."""
    return [g.getrandbits(32) for _ in range(4)]


class _Globals:
    """torch's CPU generator, Python's ``random`` and (``numpy``) numpy's
    global generator seeded from ``g`` (:func:`global_seeds`, then
    :func:`numpy_seed`) on entry, each put back as it was on exit.  Only
    the CPU generator: ``torch.manual_seed`` would also seed every
    accelerator's, ~1 ms a call, and prep never draws on a device.  numpy's
    costs the most (about 60 us to save and restore its state), so it is
    seeded only for code that may draw from it (timm's ``RandAugment``
    picks its operations with ``np.random.choice``; torchvision's
    transforms never do: ``coordl.transforms.draws_numpy``)."""

    __slots__ = ("states",)

    def __init__(self, g, numpy: bool = True) -> None:
        torch_seed, py_seed = global_seeds(g)
        cpu = torch.default_generator
        np_state = None
        if numpy:
            import numpy as np

            np_seed = numpy_seed(g)
            np_state = np.random.get_state()
            np.random.seed(np_seed)
        self.states = (random.getstate(), cpu.get_state(), np_state)
        cpu.manual_seed(torch_seed)
        random.seed(py_seed)

    def restore(self) -> None:
        py_state, cpu_state, np_state = self.states
        random.setstate(py_state)
        torch.default_generator.set_state(cpu_state)
        if np_state is not None:
            import numpy as np

            np.random.set_state(np_state)


@contextlib.contextmanager
def seeded_globals(g, numpy: bool = True):
    """While inside: torch's CPU generator, Python's ``random`` and numpy's
    global generator seeded from ``g``, the sample's own generator (a
    ``random.Random``: inside a prep stage), and restored afterwards
    (:class:`_Globals`): what the user's own transforms (run as written,
    drawing from any of those generators) draw from, so that their draws
    too depend on (seed, epoch, index) alone (numpy's only with ``numpy``:
    the caller knows whether its steps may draw from it).  Anything else as
    ``g`` (outside a stage): the generators as they are, as torchvision."""
    if not isinstance(g, random.Random):
        yield
        return
    scope = _Globals(g, numpy)
    try:
        yield
    finally:
        scope.restore()


_BATCH_KEY = 1 << 192   # above every (seed, epoch, index) key of derive: no sample's generator is a batch's


def batch_rng(seed: int, epoch: int, step: int) -> random.Random:
    """The generator of step ``step``'s ``collate_fn`` in epoch ``epoch``
    under ``seed`` (:func:`derive`'s construction, with a bit set that no
    sample's key has)."""
    key = _BATCH_KEY | ((seed & _MASK64) << 128) | ((epoch & _MASK64) << 64) | (step & _MASK64)
    return random.Random(key)


@contextlib.contextmanager
def seeded_collate(seed: int, epoch: int, step: int):
    """While inside: torch's CPU generator, Python's ``random`` and numpy's
    global generator seeded from :func:`batch_rng` of the batch, and
    restored afterwards.  A ``collate_fn`` that draws (mixup, cutmix)
    therefore draws the same for a batch whichever worker collates it, in
    any run and after a resume, and leaves the caller's generators as they
    were.  The three states cost about 0.1 ms to save and restore (numpy's
    most of it); collates that cannot draw (torch's default ones) are not
    wrapped (:func:`collate_draws`)."""
    scope = _Globals(batch_rng(seed, epoch, step))
    try:
        yield
    finally:
        scope.restore()


def collate_draws(fn) -> bool:
    """Whether ``fn`` (a loader's ``collate_fn``) may draw: anything but
    torch's default collate and convert."""
    from torch.utils.data._utils.collate import default_collate, default_convert

    return fn is not None and fn is not default_collate and fn is not default_convert \
        and fn is not torch.utils.data.default_collate and fn is not torch.utils.data.default_convert


_USER_KEY = 2 << 192    # another bit above every key of derive: the globals of a sample's foreign steps


class seeded_user_steps:
    """``with seeded_user_steps():`` around steps of a transform that are
    not coordl's (a torchvision transform or a callable of the user's in a
    ``coordl.transforms.Compose``), which draw from torch's, Python's and
    numpy's global generators rather than the sample's own.  Inside a prep
    stage (:class:`sample_rng`) and not already inside this scope: those
    generators seeded from the sample's (seed, epoch, index), through a
    generator of their own (the sample's own generator draws nothing for
    it, so coordl's steps draw what they drew without those steps), and
    restored on exit (:class:`_Globals`).  Elsewhere (a transform called by
    hand, by torch's DataLoader, or nested): nothing, so the generators are
    used as they are, as torchvision's transforms use them.  About 20 us
    per sample for pipelines with such a step, 80 us where one may draw
    from numpy (``numpy``: not torchvision's own transforms, which never
    do)."""

    __slots__ = ("states", "numpy")

    def __init__(self, numpy: bool = True) -> None:
        self.numpy = numpy

    def __enter__(self):
        key = getattr(_local, "key", None)
        if key is None or getattr(_local, "user_seeded", False):
            self.states = None
            return self
        g = random.Random(_USER_KEY | _key(*key))
        self.states = _Globals(g, self.numpy)
        _local.user_seeded = True
        return self

    def __exit__(self, *exc) -> None:
        if self.states is not None:
            _local.user_seeded = False
            self.states.restore()
