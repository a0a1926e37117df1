"""Worker processes never hold, touch or free the main process's device state.

On a GPU a CUDA tensor (or page-locked memory a copy has used) destroyed in a
forked worker aborts it: its destructor calls into a CUDA context the worker
does not have.  Here the CPU stands in for the device (``CPU_TEST_DEVICE``):
every tensor the device path makes in the main process (delivered batches,
ring buffers, the tail's constants) carries a probe that records being
destroyed in a process other than the one that made it.  The training loops
below are the ordinary ones (a training and a validation loader interleaved,
three loaders, several epochs, early exits, garbage cycles of the training
step), with a ``worker_init_fn`` that runs the cyclic collector in each
worker, as any allocation there may: no probe may fire in a worker."""
import os
import sys
import textwrap

import pytest

from coordl.testing import run_in_child

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _one_child import run_cases  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("devstate", num_images=24, num_classes=2, mean_kb=2, image_size=(40, 32), seed=3)


_PRELUDE = '''
import collections, gc, os, sys, types
import torch
import coordl
from coordl import transforms as T
from coordl.device import delivery as D

D.CPU_TEST_DEVICE = True
MAIN = os.getpid()


class Probe:
    """Records in LOG when it dies in a process other than MAIN."""
    def __init__(self, what):
        self.what = what
    def __del__(self):
        if os.getpid() != MAIN:
            fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, f"{os.getpid()} {self.what}\\n".encode())
            os.close(fd)


def probe(t, what):
    if "_probe" not in t.__dict__:
        t._probe = Probe(what)
    return t

real_start, real_consts = D.DeviceDelivery._start_copy, D.DeviceTail.constants

def start(self, host, paths, *rest):
    st = real_start(self, host, paths, *rest)
    D.map_tensors(st.batch, lambda t: probe(t, "delivered batch"))
    for slot in self.slots:
        for b in slot.buffers:
            probe(b, "ring buffer")
    return st

def consts(self, device):
    div, pairs = real_consts(self, device)
    probe(div, "tail constant")
    for m, s in pairs:
        probe(m, "tail constant"), probe(s, "tail constant")
    return div, pairs

D.DeviceDelivery._start_copy, D.DeviceTail.constants = start, consts
Pair = collections.namedtuple("Pair", "image label")


class DictFolder(coordl.ImageFolder):
    def prep(self, raw, i):
        img, y = self._prep(raw, i)
        return {"image": img, "label": y}


class PairFolder(coordl.ImageFolder):
    def prep(self, raw, i):
        return Pair(*self._prep(raw, i))


def collect_in_worker(w):
    gc.collect()          # what any allocation in the worker may start


NORM = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
TRAIN = T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToTensor(), NORM])
VAL = T.Compose([T.Resize(20), T.CenterCrop(16), T.ToTensor(), NORM])


def loader(cls, tf, **kw):
    kw.setdefault("num_workers", 2)
    return coordl.DataLoader(cls(ROOT, transform=tf), batch_size=4, seed=1, device="cpu",
                             worker_init_fn=collect_in_worker, **kw)


def garbage_of_a_training_step(batch):
    """A reference cycle holding a delivered batch, as autograd graphs,
    exceptions with tracebacks and closures leave them, not yet collected."""
    junk = {"batch": batch}
    junk["self"] = junk


def report():
    gc.enable()
    fired = open(LOG).read() if os.path.exists(LOG) else ""
    print("FIRED:" + repr(fired))
'''


def _run(photos, tmp_path, body: str, setup: str = ""):
    log = str(tmp_path / "fired.log")
    code = f"ROOT, LOG = {photos!r}, {log!r}\n" + _PRELUDE + setup + textwrap.dedent(body) + "\nreport()\n"
    res = run_in_child(code, timeout=200)
    assert res.returncode == 0, res.stdout + res.stderr
    _none_fired(res.stdout, res.stderr)


def _none_fired(out: str, err: str = "") -> None:
    line = [x for x in out.splitlines() if x.startswith("FIRED:")]
    assert line, out + err
    fired = line[-1][len("FIRED:"):].strip("'").split("\\n")
    assert line[-1] == "FIRED:''", (f"device state destroyed in a worker process ({len(fired) - 1} objects), "
                                    f"first: {fired[:5]}\n{err[-3000:]}")


@pytest.fixture(scope="module")
def cases_in_one_child(photos, tmp_path_factory):
    """``get(test, case, bodies, setup)``: the output of one case of a
    parametrized test, from one child that ran every body in ``bodies``
    (tests/_one_child.py: one child's start instead of one per case), each
    with a probe log of its own and its report; run once per module."""
    runs = {}

    def get(test: str, case: str, bodies: dict, setup: str = "") -> str:
        if test not in runs:
            logs = tmp_path_factory.mktemp("fired")
            cases = {c: f"LOG = {str(logs / f'{n}.log')!r}\n" + textwrap.dedent(b) + "\nreport()\n"
                     for n, (c, b) in enumerate(bodies.items())}
            runs[test] = run_cases(cases, timeout=200 + 60 * len(cases),
                                   prelude=f"ROOT, LOG = {photos!r}, None\n" + _PRELUDE + setup)
        return runs[test][case]

    return get


def _interleaved_case(kind: str, persistent: bool) -> str:
    cls = {"tuple": "coordl.ImageFolder", "dict": "DictFolder", "namedtuple": "PairFolder"}[kind]
    return f"""
        gc.disable()          # the main process has not collected its garbage yet when workers start
        train = loader({cls}, TRAIN, shuffle=True, persistent_workers={persistent})
        val = loader({cls}, VAL, persistent_workers={persistent})
        held = None
        for epoch in range(3):
            for k, batch in enumerate(train):
                garbage_of_a_training_step(batch)
                held = held or batch
                if epoch == 1 and k == 2:
                    break     # an early exit: the pass is abandoned
            for batch in val:
                garbage_of_a_training_step(batch)
        third = loader({cls}, VAL, num_workers=1)
        for batch in third:
            garbage_of_a_training_step(batch)
        del train, val, third
        for batch in loader({cls}, TRAIN):
            pass
    """


_KINDS = ["tuple", "dict", "namedtuple"]


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("kind", _KINDS)
def test_training_and_validation_loaders_interleaved_never_free_device_state_in_a_worker(
        cases_in_one_child, kind, persistent):
    _none_fired(cases_in_one_child("interleaved", f"{kind}-{persistent}",
                                   {f"{k}-{p}": _interleaved_case(k, p) for k in _KINDS for p in (False, True)}))


_RECEIVED = '''
import coordl.pipeline.workers as W
from torch.utils.data._utils import worker as TW


def reachable_probes(roots):
    """What of the device path's tensors is reachable from ``roots``
    (module namespaces and classes left out: they are the program, not data)."""
    skip = {id(m.__dict__) for m in list(sys.modules.values()) if m is not None}
    seen, stack, hits = set(), list(roots), []
    while stack and len(seen) < 500000:
        o = stack.pop()
        if id(o) in seen or id(o) in skip or isinstance(o, (types.ModuleType, type)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor) and "_probe" in o.__dict__:
            hits.append(o._probe.what)
        if isinstance(o, types.FunctionType):
            stack.extend([o.__closure__ or (), o.__defaults__ or (), o.__kwdefaults__ or {}])
            continue
        stack.extend(gc.get_referents(o))
    return hits


def checked(real, name):
    def main(*args, **kw):
        hits = reachable_probes((args, kw))
        if hits:
            fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, f"{os.getpid()} {name} received {sorted(set(hits))}\\\\n".encode())
            os.close(fd)
        return real(*args, **kw)
    return main


W._worker_main = checked(W._worker_main, "coordl worker")
TW._worker_loop = checked(TW._worker_loop, "torch worker")


class Plain(torch.utils.data.Dataset):
    """A dataset without raw/prep: torch's machinery delivers it."""
    def __init__(self, root, transform):
        self.ds = coordl.ImageFolder(root, transform=transform)
    def __len__(self):
        return len(self.ds)
    def __getitem__(self, i):
        return self.ds[i]
'''


def _received_case(cls: str) -> str:
    return f"""
        for persistent in (False, True):
            train = loader({cls}, TRAIN, shuffle=True, persistent_workers=persistent)
            val = loader({cls}, VAL, persistent_workers=persistent)
            keep = []
            for epoch in range(3):
                keep += [b for b in train][:1]
                keep += [b for b in val][:1]
            train.load_state_dict(train.state_dict())
            keep += [next(iter(train))]
    """


@pytest.mark.parametrize("cls", ["coordl.ImageFolder", "Plain"])
def test_nothing_a_worker_receives_reaches_device_state(cases_in_one_child, cls):
    """Each worker's arguments are walked in the worker: no tensor the device
    path made in the main process is reachable from them, at any epoch, with
    persistent workers or without."""
    _none_fired(cases_in_one_child("received", cls, {c: _received_case(c) for c in ("coordl.ImageFolder", "Plain")},
                                   setup=_RECEIVED))


def test_spawned_and_forkserver_workers_get_no_device_state(photos, tmp_path):
    # one worker: each is a fresh interpreter (seconds of imports) that gets what the other would
    _run(photos, tmp_path, """
        for ctx in ("spawn", "forkserver"):
            L = coordl.DataLoader(coordl.ImageFolder(ROOT, transform=TRAIN), batch_size=4, seed=1, device="cpu",
                                  num_workers=1, multiprocessing_context=ctx, worker_init_fn=gc.collect)
            for epoch in range(2):
                for batch in L:
                    garbage_of_a_training_step(batch)
    """)


_DECODE = '''
from coordl.device import decode as DD

real_finish = DD.DecodeStage.finish


def finish(self, pending):
    images = real_finish(self, pending)
    for t in images.values():
        probe(t, "image decoded on the device")
    return images


DD.DecodeStage.finish = finish
'''


def _decode_case(kind: str) -> str:
    cls = {"tuple": "coordl.ImageFolder", "dict": "DictFolder"}[kind]
    return f"""
        gc.disable()
        for persistent in (False, True):
            train = loader({cls}, TRAIN, shuffle=True, persistent_workers=persistent, decode="device")
            val = loader({cls}, VAL, persistent_workers=persistent, decode="device")
            for epoch in range(2):
                for k, batch in enumerate(train):
                    garbage_of_a_training_step(batch)
                    if epoch == 0 and k == 2:
                        break
                for batch in val:
                    garbage_of_a_training_step(batch)
            assert train.stats().device_decode_images > 0
    """


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_decode_on_the_device_never_reaches_a_worker(cases_in_one_child, kind):
    """decode="device": the images the main process decodes, the stage's
    decoder and the tail's constants stay there, through interleaved
    loaders, early exits, persistent workers and the workers' arguments."""
    _none_fired(cases_in_one_child("decode", kind, {k: _decode_case(k) for k in ("tuple", "dict")},
                                   setup=_DECODE + _RECEIVED))


_JITTER = '''
from coordl.device import jitter as J

real_tables = J._hsv_tables


def tables(device):
    got = real_tables(device)
    for t in got:
        probe(t, "hue table")
    return got


J._hsv_tables = tables
sys.path.insert(0, HERE)
from _torchvision import import_torchvision
HAVE_TV = import_torchvision() is not None
'''


_ERASE = '''
from coordl.device import erase as ER

real_value_on = ER.value_on


def value_on(value, device):
    return probe(real_value_on(value, device), "erasing value")


ER.value_on = value_on
'''


def test_colorjitter_and_randomerasing_on_the_device_never_reach_a_worker(photos, tmp_path):
    """A ColorJitter and a RandomErasing around the conversion, with the
    device split (the jitter and the erasing on the device: the tail's
    value and hue tables kept from pass to pass) and with decode="device":
    workers forked for later passes never free them, the delivered
    batches, nor the images erased on the device."""
    from _torchvision import import_torchvision

    if import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    body = """
        if HAVE_TV:
            from torchvision import datasets, transforms as V
            gc.disable()
            tf = V.Compose([V.RandomResizedCrop(16), V.RandomHorizontalFlip(), V.ColorJitter(0.4, 0.4, 0.4, 0.1),
                            V.ToTensor(), V.Normalize([0.5, 0.4, 0.3], [0.2, 0.25, 0.3]), V.RandomErasing(0.9)])
            for how in ({}, {"decode": "device"}):
                train = coordl.DataLoader(datasets.ImageFolder(ROOT, transform=tf), batch_size=4, seed=1, device="cpu",
                                          num_workers=2, worker_init_fn=collect_in_worker, **how)
                for epoch in range(3):        # workers forked anew each pass, after the value exists
                    for batch in train:
                        garbage_of_a_training_step(batch)
                assert "RandomErasing" in (train.stats().device_split + train.stats().device_decode)
                assert "ColorJitter" in (train.stats().device_split + train.stats().device_decode)
                assert train.stats().device_decode_images > 0 or train.stats().device_split.startswith("split")
            assert J._tables
        else:
            print("NO-TORCHVISION")
    """
    here = f"HERE = {os.path.dirname(os.path.abspath(__file__))!r}\n"
    _run(photos, tmp_path, body, setup=_DECODE + here + _JITTER + _ERASE)
