"""Sharing through the node daemon: a group
runs one code (its members' modules and library versions), in the job's
cache directory; variable-shape samples are not prepared for nothing; a
worker's setup failure is retried, never blamed on the dataset for good.

Every job here runs in a child process (or against the daemon's real
processes) with a hard timeout."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import coordl
from coordl.daemon import server as S
from coordl.testing import popen

HERE = os.path.dirname(os.path.abspath(__file__))
CODE_JOB = os.path.join(HERE, "_code_job.py")

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    from coordl.synth import make_image_folder

    root = tmp_path_factory.mktemp("sharecode") / "photos"
    make_image_folder(root, num_images=24, num_classes=3, image_size=(40, 32), mean_kb=3)
    return str(root)


@pytest.fixture
def daemon_settings():
    """For conftest's ``daemon_env``: an edited module is read from its source."""
    return {"PYTHONDONTWRITEBYTECODE": "1"}


MYAUG = """\
class MyAug:
    def __init__(self):
        self.k = 3

    def __call__(self, x):
        return {body}
"""
FLIP = "x.flip(-1)"
ROLL = "x.roll(self.k, -1)   # another project's MyAug: same name and attributes, other code"


def _project(path, body):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "myaug.py"), "w") as f:
        f.write(MYAUG.format(body=body))
    return str(path)


_REFS = [0]


def _reference(project, root, seed=7, epochs=1):
    """The job's digests with share=False, computed here (the project's
    ``myaug.py`` loaded under a name of its own)."""
    import hashlib
    import importlib.util

    from coordl import transforms as T

    _REFS[0] += 1
    spec = importlib.util.spec_from_file_location(f"_myaug_ref{_REFS[0]}", os.path.join(project, "myaug.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ds = coordl.ImageFolder(root, transform=T.Compose([T.RandomResizedCrop(16), T.PILToTensor(), mod.MyAug()]))
    ld = coordl.DataLoader(ds, batch_size=8, seed=seed)
    return [hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()
            for _ in range(epochs) for x, y in ld]


def _stop_and_check(p, first, project, root, most=4):
    """Kill a long job and check every whole epoch it printed (up to
    ``most``) against share=False."""
    p.kill()
    out, _ = p.communicate(timeout=30)
    got = [first] + [json.loads(x)["digest"] for x in out.splitlines() if x.startswith('{"epoch"')]
    per = 3                                         # batches per epoch (24 photos, batch 8)
    n = min(most, len(got) // per)
    assert n >= 1
    assert got[:n * per] == _reference(project, root, epochs=n)


def _job(project, root, *extra):
    return popen([sys.executable, CODE_JOB, "--project", project, "--root", root, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(p, timeout=150):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"job timed out: {err[-3000:]}")
    assert p.returncode == 0, err[-3000:]
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    return [x["digest"] for x in lines if "digest" in x], lines[-1], err


def _first_line(p):
    line = p.stdout.readline()
    assert line.startswith("{"), p.stderr.read()[-3000:] if not line else line
    return json.loads(line)["digest"]


def _stop(p):
    p.kill()
    p.communicate(timeout=30)


def test_two_projects_with_the_same_class_name_run_their_own_code(photos, daemon_env, tmp_path):
    a = _project(tmp_path / "proj_a", FLIP)
    b = _project(tmp_path / "proj_b", ROLL)
    ref_a, ref_b = _reference(a, photos), _reference(b, photos)
    assert ref_a != ref_b
    S.start()
    ja = _job(a, photos, "--epochs", "1000", "--sleep", "0.1")   # runs until b is done
    try:
        first = _first_line(ja)                     # a's group exists, its workers imported a's myaug
        assert first == ref_a[0]
        got_b, done_b, err_b = _finish(_job(b, photos))
        assert got_b == ref_b                       # today: the first project's batches
        assert done_b["shared"] > 0                 # prepared by the daemon, with b's code
        assert ja.poll() is None
    finally:
        _stop_and_check(ja, first, a, photos)       # and a kept its own code meanwhile


def test_module_edited_between_runs_while_another_job_keeps_the_workers(photos, daemon_env, tmp_path):
    proj = _project(tmp_path / "proj", FLIP)
    ref1 = _reference(proj, photos)
    ref2 = _reference(_project(tmp_path / "proj2", ROLL), photos)
    assert ref1 != ref2
    S.start()
    keeper = _job(proj, photos, "--epochs", "1000", "--sleep", "0.1")   # keeps the daemon's workers busy
    first = None
    try:
        first = _first_line(keeper)
        got1, done1, _ = _finish(_job(proj, photos))
        assert got1 == ref1 and done1["shared"] > 0
        _project(proj, ROLL)                          # the user edits myaug.py
        got2, done2, _ = _finish(_job(proj, photos))
        assert got2 == ref2                           # today: the old code's output
        assert done2["shared"] > 0
        assert keeper.poll() is None
    finally:
        if first is None:
            _stop(keeper)
    _project(proj, FLIP)
    _stop_and_check(keeper, first, proj, photos)     # the keeper ran the code it imported throughout


def test_module_edited_after_the_job_imported_it_is_not_run_for_it(photos, daemon_env, tmp_path):
    """The daemon's fresh workers import the file as it is now; the job runs
    what it imported before the edit: its identity check refuses, the job
    prepares for itself and says why."""
    proj = _project(tmp_path / "proj", FLIP)
    ref1 = _reference(proj, photos)
    go = tmp_path / "go"
    job = _job(proj, photos, "--go", str(go))
    try:
        assert json.loads(job.stdout.readline()) == {"imported": True}
        _project(proj, ROLL)
        go.touch()
        got, done, err = _finish(job)
    finally:
        if job.poll() is None:
            _stop(job)
    assert got == ref1                              # today: the edited file's output
    assert err.count("other code than this job") == 1, err
    assert done["shared"] == 0


def _photos_dataset(root):
    from coordl import transforms as T

    return coordl.ImageFolder(root, transform=T.Compose([T.RandomResizedCrop(16), T.PILToTensor()]))


def test_daemon_workers_use_the_jobs_cache_directory(photos, daemon_env, tmp_path, monkeypatch):
    """The daemon was started from a shell whose COORDL_SHM_DIR differs from
    the job's: its workers read through (and fill) the job's node cache,
    and make no second cache in the daemon's directory."""
    theirs = tmp_path / "daemon-shm"
    theirs.mkdir()
    mine = os.environ["COORDL_SHM_DIR"]
    monkeypatch.setenv("COORDL_SHM_DIR", str(theirs))
    S.start()
    monkeypatch.setenv("COORDL_SHM_DIR", mine)
    ref = [(x.clone(), y.clone()) for x, y in coordl.DataLoader(_photos_dataset(photos), batch_size=8, seed=7)]
    ld = coordl.DataLoader(_photos_dataset(photos), batch_size=8, seed=7, share=True, cache_size="8MiB")
    got = list(ld)
    assert all(torch.equal(x, rx) and torch.equal(y, ry) for (x, y), (rx, ry) in zip(got, ref))
    assert ld.stats().samples_shared > 0
    assert os.listdir(theirs) == []                 # today: the workers' own cache, beside the job's
    caches = S.status()["caches"]
    assert [(c["cached"], c["samples"]) for c in caches] == [(24, 24)], caches   # the job's, filled by the daemon
    del ld, got


def _identity(batch):
    return batch


def test_variable_shape_samples_warn_once_and_are_not_prepared_for_nothing(daemon_env, tmp_path):
    sys.path.insert(0, HERE)
    from _share_datasets import VarShape

    log = str(tmp_path / "daemon_preps.log")
    n = 60
    ref = list(coordl.DataLoader(VarShape(n, log), batch_size=4, seed=3, collate_fn=_identity))
    ld = coordl.DataLoader(VarShape(n, log), batch_size=4, seed=3, collate_fn=_identity, share=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = [list(ld) for _ in range(3)]
    flat = lambda bs: [(s[0].tolist(), s[1]) for b in bs for s in b]   # noqa: E731
    assert flat(got[0]) == flat(ref)
    msgs = [str(x.message) for x in w if "coordl" in str(x.message)]
    shape = [m for m in msgs if "shape" in m]
    assert len(shape) == 1, msgs                    # today: none
    assert "share" in shape[0] and ("same shape" in shape[0] or "fixed" in shape[0]), shape[0]
    with open(log) if os.path.exists(log) else open(os.devnull) as f:
        daemon_preps = len(f.read().splitlines())
    assert daemon_preps < n, daemon_preps           # today: every sample of every epoch (~3n)


def test_a_worker_setup_failure_is_retried_and_not_blamed_on_the_dataset(daemon_env, tmp_path):
    sys.path.insert(0, HERE)
    from _share_datasets import FlakySetup

    counter = tmp_path / "failures_left"
    counter.write_text("2")          # the first worker and its replacement fail to set up
    n = 40
    ref_ld = coordl.DataLoader(FlakySetup(n, str(counter)), batch_size=8, seed=5)
    ref = [[b[0].clone() for b in ref_ld] for _ in range(3)]
    ld = coordl.DataLoader(FlakySetup(n, str(counter)), batch_size=8, seed=5, share=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = [[b[0] for b in ld] for _ in range(3)]
    for e in range(3):
        assert len(got[e]) == len(ref[e]) and all(torch.equal(x, y) for x, y in zip(got[e], ref[e])), e
    msgs = [str(x.message) for x in w]
    assert not any("could not load this dataset" in m for m in msgs), msgs
    assert any("flaky worker setup" in m for m in msgs), msgs      # the real cause, said
    assert counter.read_text() == "0"
    st = ld.stats()
    assert st.epochs[1].samples_shared + st.epochs[2].samples_shared >= n   # retried: shared again
    assert len(S.status()["worker_pids"]) == 1


_CFG_JOB = r"""
import hashlib, json, sys, warnings
sys.path.insert(0, sys.argv[1])
import coordl
from coordl import transforms as T
import shiftcfg, shiftaug

if sys.argv[3] != "default":
    shiftcfg.amount = int(sys.argv[3])     # a value the job sets at run time, before building its loader
warnings.simplefilter("always")
ds = coordl.ImageFolder(sys.argv[2], transform=T.Compose([T.RandomResizedCrop(16), T.PILToTensor(),
                                                             shiftaug.Shift()]))
for share in sys.argv[4].split(","):   # share=False's batches first, where asked: one process for both
    loader = coordl.DataLoader(ds, batch_size=8, seed=7, share=share == "1")
    for epoch in range(2):
        for x, y in loader:
            print(json.dumps({"share": share, "digest": hashlib.sha1(x.numpy().tobytes()
                                                                     + y.numpy().tobytes()).hexdigest()}), flush=True)
    st = loader.stats()
    print(json.dumps({"share": share, "shared": st.samples_shared, "verified": st.samples_verified}), flush=True)
    del loader
"""

_SHIFTAUG = """\
import shiftcfg


class Shift:
    def __call__(self, x):
        return (x.int() + shiftcfg.{attr}).clamp(0, 255).to(x.dtype)
"""


def _cfg_project(path, amount=10, attr="amount"):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "shiftcfg.py"), "w") as f:
        f.write(f"amount = {amount}\n")
    with open(os.path.join(path, "shiftaug.py"), "w") as f:
        f.write(_SHIFTAUG.format(attr=attr))
    return str(path)


def _cfg_job(project, root, amount, share):
    r = subprocess.run([sys.executable, "-c", _CFG_JOB, project, root, str(amount), "1" if share else "0"],
                       capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    return [x["digest"] for x in lines if "digest" in x], lines[-1], r.stderr


def _cfg_job_against_its_own(project, root, amount):
    """The job's batches with share=False, then (in the same process: one
    interpreter's start) with share=True: (want, got, share=True's last
    line, stderr)."""
    r = subprocess.run([sys.executable, "-c", _CFG_JOB, project, root, str(amount), "0,1"],
                       capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    want = [x["digest"] for x in lines if "digest" in x and x["share"] == "0"]
    got = [x["digest"] for x in lines if "digest" in x and x["share"] == "1"]
    return want, got, lines[-1], r.stderr


def test_a_value_set_at_run_time_that_the_daemon_cannot_see_is_caught_and_never_delivered(photos, tmp_path,
                                                                                         daemon_env):
    """The job sets ``shiftcfg.amount = 140`` before building its loader; the
    daemon's workers import the module and see its default, 10.  The code
    identity cannot see a value: the job's check of the daemon's samples
    against its own finds the difference before its first batch, warns
    naming it, and every batch is the one share=False makes."""
    project = _cfg_project(tmp_path / "proj")
    want, got, last, err = _cfg_job_against_its_own(project, photos, 140)
    assert got == want
    assert "differs from this job's own" in err and "values differ, by up to 130" in err, err[-3000:]
    assert last["verified"] >= 1


def test_the_check_costs_a_few_samples_per_pass_and_passes_when_the_code_agrees(photos, tmp_path, daemon_env):
    project = _cfg_project(tmp_path / "proj2")
    want, got, last, err = _cfg_job_against_its_own(project, photos, "default")
    assert got == want
    assert "differs" not in err, err[-3000:]
    assert last["shared"] > 0 and 1 <= last["verified"] <= 2 * 2      # two per pass, two passes


def test_a_data_file_read_at_import_and_changed_since_is_caught(photos, tmp_path, daemon_env):
    """A module reads a JSON file at import: the daemon's idle workers keep
    what it said when they imported it (same source, same code identity);
    a later job that reads the changed file gets its own samples."""
    project = _cfg_project(tmp_path / "proj3")
    with open(os.path.join(project, "shiftcfg.py"), "w") as f:
        f.write("import json, os\n\namount = json.load(open(os.path.join(os.path.dirname(__file__), "
                "'amount.json')))\n")
    with open(os.path.join(project, "amount.json"), "w") as f:
        f.write("10\n")
    got, _, err = _cfg_job(project, photos, "default", share=True)        # the daemon's workers import it
    assert "differs" not in err
    with open(os.path.join(project, "amount.json"), "w") as f:
        f.write("140\n")
    want, got, last, err = _cfg_job_against_its_own(project, photos, "default")
    assert got == want
    assert "differs from this job's own" in err, err[-3000:]
