"""How the process's host threads wait for the GPU (``COORDL_CUDA_WAIT``).

By default CUDA picks the wait from the number of contexts against the
number of CPUs, and on a GPU node that is a spin: a thread in
``cudaStreamSynchronize`` keeps its core busy until the GPU is done.  The
decode thread of ``decode="device"`` waits so inside torchvision's batched
JPEG call (the call synchronizes its stream before it returns), for about
as long as the GPU's decoder runs: on a GPU node that is most of a core
spent polling.

coordl's own host waits (a ring slot whose copy still runs, nvImageCodec's
images before they are released) use blocking events and never spin,
whatever this setting.  Waits inside libraries (torchvision's) and the
training loop's own (``loss.item()``) follow the device's scheduling flag,
which is the process's, not the loader's: ``COORDL_CUDA_WAIT=block`` sets it
to blocking synchronization (the thread sleeps until the GPU's interrupt;
a wake-up costs some microseconds per wait) when a loader with a CUDA
``device=`` starts its first pass; ``spin`` and ``yield`` set those; unset
(or ``default``) leaves CUDA's choice alone.  The flag is the primary
context's (``cuDevicePrimaryCtxSetFlags``), set through the driver library
with the scheduling bits only.
"""
from __future__ import annotations

import ctypes
import logging
import os

__all__ = ["MODES", "wanted", "scheduling", "set_scheduling", "apply"]

log = logging.getLogger("coordl.device")

_ENV = "COORDL_CUDA_WAIT"
#: CU_CTX_SCHED_* of the driver API; the scheduling bits of a context's flags
MODES = {"auto": 0x00, "spin": 0x01, "yield": 0x02, "block": 0x04}
_SCHED_MASK = 0x07


def wanted() -> str | None:
    """``COORDL_CUDA_WAIT`` (``block``, ``spin``, ``yield``, ``auto``), or
    None when it is unset or ``default``.  ValueError naming the values."""
    raw = os.environ.get(_ENV, "").strip().lower()
    if raw in ("", "default"):
        return None
    if raw not in MODES:
        raise ValueError(f'{_ENV} should be "block", "spin", "yield", "auto" or "default" (CUDA\'s own choice, '
                         f'unchanged), but got {_ENV}={raw!r}')
    return raw


class Driver:
    """The CUDA driver library's primary-context flags (``libcuda.so.1``)."""

    def __init__(self) -> None:
        self._lib = ctypes.CDLL("libcuda.so.1")
        self._check(self._lib.cuInit(0), "cuInit")
        self._set = getattr(self._lib, "cuDevicePrimaryCtxSetFlags_v2", None) or self._lib.cuDevicePrimaryCtxSetFlags

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"the CUDA driver's {what} failed (CUresult {rc})")

    def _device(self, ordinal: int) -> ctypes.c_int:
        dev = ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)), "cuDeviceGet")
        return dev

    def _state(self, dev: ctypes.c_int) -> tuple:
        """(the primary context's flags, whether it is active)."""
        flags, active = ctypes.c_uint(), ctypes.c_int()
        self._check(self._lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)),
                    "cuDevicePrimaryCtxGetState")
        return flags.value, bool(active.value)

    def flags(self, ordinal: int) -> int:
        return self._state(self._device(ordinal))[0]

    def set_flags(self, ordinal: int, flags: int) -> None:
        dev = self._device(ordinal)
        self._check(self._set(dev, ctypes.c_uint(flags)), "cuDevicePrimaryCtxSetFlags")
        self._set_current(dev, flags)

    def _set_current(self, dev: ctypes.c_int, flags: int) -> None:
        """The same scheduling bits on the calling thread's current context
        where it is ``dev``'s primary context (the one torch uses) and the
        driver has ``cuCtxSetFlags`` (CUDA 12.1+): the primary context's
        flags are what the driver gives the context, and this sets them on
        the live one as well, whatever the driver does with an active
        primary context's flags.  Another context current in this thread
        is the user's: left alone."""
        set_ctx = getattr(self._lib, "cuCtxSetFlags", None)
        if set_ctx is None:
            return
        cur = ctypes.c_void_p()
        if self._lib.cuCtxGetCurrent(ctypes.byref(cur)) != 0 or not cur.value or not self._state(dev)[1]:
            return
        primary = ctypes.c_void_p()     # active already: retaining it here does not create it
        self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev), "cuDevicePrimaryCtxRetain")
        try:
            if primary.value != cur.value:
                return
            have = ctypes.c_uint()
            self._check(self._lib.cuCtxGetFlags(ctypes.byref(have)), "cuCtxGetFlags")
            want = (have.value & ~_SCHED_MASK) | (flags & _SCHED_MASK)
            if want != have.value:
                rc = set_ctx(ctypes.c_uint(want))
                if rc != 0:     # the primary context's flags are set all the same: what the driver does with them
                    log.info("the CUDA driver's cuCtxSetFlags(%#x) on the live context failed (CUresult %d); "
                             "its primary context's flags are set", want, rc)
        finally:
            release = getattr(self._lib, "cuDevicePrimaryCtxRelease_v2", None) or self._lib.cuDevicePrimaryCtxRelease
            release(dev)


def scheduling(ordinal: int, driver=None) -> str:
    """The device's scheduling flag now, by name."""
    bits = (driver or Driver()).flags(ordinal) & _SCHED_MASK
    return next((name for name, b in MODES.items() if b == bits), hex(bits))


def set_scheduling(ordinal: int, mode: str, driver=None) -> str:
    """Set device ``ordinal``'s scheduling flag to ``mode`` (its other flags
    kept); returns the one it replaced.  RuntimeError when the driver
    refuses or the flag read back is another."""
    d = driver or Driver()
    before = d.flags(ordinal)
    d.set_flags(ordinal, (before & ~_SCHED_MASK) | MODES[mode])
    after = d.flags(ordinal) & _SCHED_MASK
    if after != MODES[mode]:
        raise RuntimeError(f"the CUDA driver kept scheduling flag {after:#x} after it was asked for {mode!r}")
    old = before & _SCHED_MASK
    return next((name for name, b in MODES.items() if b == old), hex(old))


def apply(device, driver=None) -> str | None:
    """At a CUDA loader's first pass: set ``COORDL_CUDA_WAIT``'s scheduling
    on ``device`` (a torch.device) where it is set; a note for the log, or
    None.  A driver that refuses is a warning, not an error: the loader
    delivers the same batches either way."""
    mode = wanted()
    if mode is None or getattr(device, "type", None) != "cuda":
        return None
    import torch

    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    try:
        before = set_scheduling(ordinal, mode, driver)
    except Exception as e:  # noqa: BLE001 - the driver's own refusal, reported
        import warnings

        warnings.warn(f"{_ENV}={mode}: the device's wait could not be set ({type(e).__name__}: {e}); CUDA's "
                      "own choice stays", stacklevel=3)
        return None
    note = f"{_ENV}={mode}: cuda:{ordinal}'s host waits are now {mode!r} (were {before!r})"
    log.info(note)
    return note
