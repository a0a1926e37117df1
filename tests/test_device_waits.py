"""``COORDL_CUDA_WAIT``: the device's host-wait scheduling, set through the
CUDA driver's primary-context flags (a recording driver stands in here;
tests/test_cuda.py sets the real one)."""
import warnings

import pytest
import torch

import coordl
from coordl.device import delivery as D
from coordl.device import waits as W


class _Driver:
    """Primary-context flags per device, as the driver keeps them."""

    def __init__(self, flags=0x08, obey=True, fail=False):
        self.state = {0: flags, 1: flags}
        self.obey, self.fail, self.calls = obey, fail, []

    def flags(self, ordinal):
        return self.state[ordinal]

    def set_flags(self, ordinal, flags):
        self.calls.append((ordinal, flags))
        if self.fail:
            raise RuntimeError("the CUDA driver's cuDevicePrimaryCtxSetFlags failed (CUresult 708)")
        if self.obey:
            self.state[ordinal] = flags


@pytest.mark.parametrize("value,want", [(None, None), ("", None), ("default", None), ("block", "block"),
                                        (" Spin ", "spin"), ("yield", "yield"), ("auto", "auto")])
def test_the_setting_is_read(monkeypatch, value, want):
    monkeypatch.delenv("COORDL_CUDA_WAIT", raising=False)
    if value is not None:
        monkeypatch.setenv("COORDL_CUDA_WAIT", value)
    assert W.wanted() == want


def test_a_wrong_setting_fails_when_a_device_loader_is_made(monkeypatch):
    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)
    monkeypatch.setenv("COORDL_CUDA_WAIT", "sleep")
    ds = torch.utils.data.TensorDataset(torch.arange(8.0))
    with pytest.raises(ValueError, match=r'COORDL_CUDA_WAIT should be "block", "spin", "yield", "auto" or '
                                         r'"default".*but got COORDL_CUDA_WAIT=\'sleep\''):
        coordl.DataLoader(ds, batch_size=2, device="cpu")
    coordl.DataLoader(ds, batch_size=2)      # no device: the setting is not read


def test_only_the_scheduling_bits_change_and_the_old_one_is_returned():
    d = _Driver(flags=0x08 | 0x01)           # another flag set, and spin
    assert W.scheduling(1, d) == "spin"
    assert W.set_scheduling(1, "block", d) == "spin"
    assert d.state[1] == 0x08 | 0x04 and d.state[0] == 0x09 and d.calls == [(1, 0x0C)]
    assert W.scheduling(1, d) == "block"
    assert W.set_scheduling(1, "auto", d) == "block" and d.state[1] == 0x08


def test_a_driver_that_keeps_its_flag_is_an_error():
    with pytest.raises(RuntimeError, match=r"kept scheduling flag 0x0 after it was asked for 'block'"):
        W.set_scheduling(0, "block", _Driver(flags=0, obey=False))


def test_apply_sets_it_on_cuda_only_and_warns_when_the_driver_refuses(monkeypatch):
    monkeypatch.setenv("COORDL_CUDA_WAIT", "block")
    d = _Driver(flags=0)
    assert W.apply(torch.device("cpu"), d) is None and d.calls == []
    note = W.apply(torch.device("cuda", 1), d)
    assert d.state[1] == 0x04 and "cuda:1's host waits are now 'block' (were 'auto')" in note
    with pytest.warns(UserWarning, match=r"COORDL_CUDA_WAIT=block: the device's wait could not be set .*CUresult 708"):
        assert W.apply(torch.device("cuda", 0), _Driver(fail=True)) is None
    monkeypatch.delenv("COORDL_CUDA_WAIT")
    d = _Driver(flags=0)
    assert W.apply(torch.device("cuda", 0), d) is None and d.calls == []


def test_a_loader_applies_it_once_at_its_first_pass(monkeypatch):
    monkeypatch.setattr(D, "CPU_TEST_DEVICE", True)
    seen = []
    monkeypatch.setattr(W, "apply", lambda device, driver=None: seen.append(device))
    L = coordl.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2, device="cpu")
    assert seen == []                         # nothing at construction
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            assert len(list(L)) == 4
    assert seen == [torch.device("cpu")]


class _Lib:
    """libcuda's entry points that :class:`waits.Driver` calls, over one
    device: its primary context (flags, active, retain count), and the
    context current in the calling thread (its own flags)."""

    PRIMARY, OTHER = 0x1000, 0x2000

    def __init__(self, current=PRIMARY, active=True, ctx_set_flags=True):
        self.primary_flags, self.active, self.retained = 0x08, active, 0
        self.current, self.ctx_flags = current, {self.PRIMARY: 0x08 | 0x10, self.OTHER: 0x01}
        if not ctx_set_flags:
            self.cuCtxSetFlags = None

    @staticmethod
    def _out(ref, value):
        ref._obj.value = value
        return 0

    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, ref, ordinal):
        return self._out(ref, ordinal.value)

    def cuDevicePrimaryCtxGetState(self, dev, flags, active):
        self._out(active, int(self.active))
        return self._out(flags, self.primary_flags)

    def cuDevicePrimaryCtxSetFlags_v2(self, dev, flags):
        self.primary_flags = flags.value
        return 0

    def cuCtxGetCurrent(self, ref):
        return self._out(ref, self.current)

    def cuDevicePrimaryCtxRetain(self, ref, dev):
        self.retained += 1
        self.active = True
        return self._out(ref, self.PRIMARY)

    def cuDevicePrimaryCtxRelease_v2(self, dev):
        self.retained -= 1
        return 0

    def cuCtxGetFlags(self, ref):
        return self._out(ref, self.ctx_flags[self.current])

    def cuCtxSetFlags(self, flags):
        self.ctx_flags[self.current] = flags.value
        return 0


def _driver(lib):
    d = W.Driver.__new__(W.Driver)
    d._lib, d._set = lib, lib.cuDevicePrimaryCtxSetFlags_v2
    return d


def test_the_live_primary_context_gets_the_scheduling_too():
    """The primary context's flags, and the live context current in this
    thread when it is that primary one (its other flags kept), with the
    retain the check takes given back."""
    lib = _Lib()
    assert W.set_scheduling(0, "block", _driver(lib)) == "auto"
    assert lib.primary_flags == 0x08 | 0x04
    assert lib.ctx_flags[lib.PRIMARY] == 0x10 | 0x08 | 0x04 and lib.retained == 0
    assert W.set_scheduling(0, "auto", _driver(lib)) == "block"
    assert lib.ctx_flags[lib.PRIMARY] == 0x18 and lib.retained == 0


@pytest.mark.parametrize("case", ["no context current", "the user's own context current",
                                  "the primary context inactive", "a driver before cuCtxSetFlags"])
def test_no_other_context_is_touched_and_none_is_created(case):
    lib = {"no context current": lambda: _Lib(current=0),
           "the user's own context current": lambda: _Lib(current=_Lib.OTHER),
           "the primary context inactive": lambda: _Lib(current=_Lib.OTHER, active=False),
           "a driver before cuCtxSetFlags": lambda: _Lib(ctx_set_flags=False)}[case]()
    before = dict(lib.ctx_flags)
    assert W.set_scheduling(0, "block", _driver(lib)) == "auto"
    assert lib.primary_flags == 0x0C                    # what the primary context will be (or is) given
    assert lib.ctx_flags == before and lib.retained == 0
    if case == "the primary context inactive":
        assert not lib.active                           # the check did not create it


def test_a_live_context_that_refuses_still_has_its_primary_flags_set(caplog):
    lib = _Lib()
    lib.cuCtxSetFlags = lambda flags: 1        # CUDA_ERROR_INVALID_VALUE
    with caplog.at_level("INFO", logger="coordl.device"):
        assert W.set_scheduling(0, "block", _driver(lib)) == "auto"
    assert lib.primary_flags == 0x0C and lib.retained == 0
    assert "cuCtxSetFlags(0x1c) on the live context failed (CUresult 1)" in caplog.text
