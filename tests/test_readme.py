"""Every command in the README runs as written.

The README is parsed when the tests are collected, so a changed or added
command is tested as it then reads.  Each shell block runs in a fresh
directory, through a ``coordl`` command made as pip makes console scripts
(``sys.path[0]`` is its bin directory, not the directory it runs in: what a
user who ran ``pip install`` has), with ``python``, ``torchrun`` and that
``coordl`` first on ``PATH``.  Python blocks must compile (they are
fragments: ``model``, ``step`` and the like are the reader's).

What is not run as written, and why (the only changes made):

* ``pip install ...`` is skipped (no network, and the package is installed),
  and with it ``python -m pytest -n 3``: that is this suite.
* ``/data/imagenet/train`` is replaced by ``data/train``: a small ImageFolder
  generated in the directory (``coordl.synth.make_image_folder``, 24
  images of 96x72), which every ``train.py`` reads too.
* Sizes are shrunk where the README's would take minutes here (2 cores):
  ``coordl demo`` gets ``--images 24 --epochs 1 --batch-size 8`` and ``coordl
  analyze``'s ``--workers 8`` becomes ``--workers 2``.
* ``torchrun --nnodes 3 --nproc-per-node 8 ... --rdzv-endpoint node0:29500``
  runs as one node of 2 processes at ``localhost`` on a free port (the
  three-node setup is tested in tests/test_peers.py).
* ``train.py`` and ``mymodel.py`` are the reader's own files; the README
  says what they do, and the stand-ins below do that (``train.py``: parse
  ``--lr`` and ``--batch-size``, build an ordinary ``coordl.DataLoader(ds,
  ..., seed=0)``, with ``cache_size`` as the README asks (16 MiB: the
  README's "40%" is of the machine's memory, more than a test should
  take), and run an epoch; under torchrun, initialise the process group
  first).
* ``coordl daemon status`` after jobs started in the background (``&``) is
  run once the daemon they start answers (a reader types it some seconds
  later); the background jobs must then exit 0.  The daemon is the test's
  own (``COORDL_RUN_DIR``) and is stopped at the end.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ports import free_port  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"

MYMODEL = '''
def train_step(batch):
    images, labels = batch
    return images.float().mean() + labels.float().mean()
'''

TRAIN = '''
import argparse, os
import torch
import coordl
from coordl import transforms as T

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--batch-size", type=int, default=8)
args, _ = p.parse_known_args()
distributed = "WORLD_SIZE" in os.environ
if distributed:
    torch.distributed.init_process_group("gloo")
ds = coordl.ImageFolder("data/train", transform=T.Compose([
    T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.PILToTensor()]))
loader = coordl.DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=1, seed=0,
                           cache_size="16MiB")
n = 0
for images, labels in loader:
    n += len(labels)
print("trained on", n, "samples, lr", args.lr, "stats", loader.stats().samples, flush=True)
del loader
if distributed:
    torch.distributed.destroy_process_group()
'''

SKIP = ("pip install", "python -m pytest")


def _substitute(cmd: str) -> str:
    cmd = cmd.replace("/data/imagenet/train", "data/train")
    if re.match(r"coordl demo\b", cmd) and "--images" not in cmd:
        cmd += " --images 24 --epochs 1 --batch-size 8"
    if re.match(r"coordl analyze\b", cmd):
        cmd = re.sub(r"--workers \d+", "--workers 2", cmd)
    if cmd.startswith("torchrun "):
        cmd = re.sub(r"--nnodes \d+", "--nnodes 1", cmd)
        cmd = re.sub(r"--nproc-per-node \d+", "--nproc-per-node 2", cmd)
        cmd = re.sub(r"--rdzv-endpoint \S+", f"--rdzv-endpoint localhost:{free_port()}", cmd)
    return cmd


def _blocks():
    """(kind, first line, text) of each fenced block: kind "python" or "shell"."""
    out = []
    lang, lines = None, None
    for line in README.read_text().splitlines():
        m = re.match(r"^\s*```\s*(\w*)\s*$", line)
        if m and lines is None:
            lang, lines = m.group(1).lower(), []
        elif m:
            kind = "python" if lang in ("python", "py", "pycon") else \
                "shell" if lang in ("", "sh", "bash", "shell", "console") else lang
            text = "\n".join(lines)
            first = next((s.strip() for s in lines if s.strip()), "")
            out.append((kind, first, text))
            lang, lines = None, None
        elif lines is not None:
            lines.append(line)
    return out


def _commands(text: str) -> list[tuple[str, bool]]:
    """(command, background) for each command of a shell block, skips and
    comments removed."""
    out = []
    for line in text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if not line:
            continue
        background = line.endswith("&") and not line.endswith("&&")
        if background:
            line = line[:-1].strip()
        for part in (p.strip() for p in line.split("&&")):
            if part and not part.startswith(SKIP):
                out.append((part, background))
    return out


BLOCKS = _blocks()
SHELL = [(first, text) for kind, first, text in BLOCKS if kind == "shell" and _commands(text)]
PYTHON = [(first, text) for kind, first, text in BLOCKS if kind == "python"]


def test_the_readme_has_the_commands_this_test_knows():
    """Guards the parser: the README's command blocks are found."""
    cmds = [c for _, t in SHELL for c, _ in _commands(t)]
    assert any(c.startswith("coordl demo") for c in cmds), cmds
    assert any(c.startswith("coordl analyze") for c in cmds), cmds
    assert PYTHON


@pytest.mark.parametrize("text", [t for _, t in PYTHON], ids=[f[:40] for f, _ in PYTHON])
def test_readme_python_blocks_compile(text):
    compile(text, "README.md", "exec")


def _console_script(bindir: Path) -> None:
    """``coordl`` as pip writes it: runs coordl.cli:main with sys.path[0] =
    the bin directory (not the current directory)."""
    path = bindir / "coordl"
    path.write_text(f"#!{sys.executable}\nimport sys\nfrom coordl.cli import main\n"
                    "if __name__ == '__main__':\n    sys.exit(main())\n")
    path.chmod(0o755)


def _env(tmp_path: Path) -> dict:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _console_script(bindir)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(bindir), os.path.dirname(sys.executable), env.get("PATH", "")])
    env["COORDL_RUN_DIR"] = str(run)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _run(cmd: str, cwd: Path, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


@contextlib.contextmanager
def _run_dir_of(env: dict):
    """This process in ``env``'s run directory (its node daemon), for the
    waits and the clean-up around the README's commands: asked from here, a
    `coordl daemon status` per poll would start an interpreter that imports
    torch (seconds of CPU each)."""
    old = os.environ.get("COORDL_RUN_DIR")
    os.environ["COORDL_RUN_DIR"] = env["COORDL_RUN_DIR"]
    try:
        yield
    finally:
        if old is None:
            del os.environ["COORDL_RUN_DIR"]
        else:
            os.environ["COORDL_RUN_DIR"] = old


def _daemon_up(env: dict) -> bool:
    """What `coordl daemon status --json` exits 0 for: the daemon answers."""
    from coordl.daemon import server

    with _run_dir_of(env):
        try:
            return server.status() is not None
        except (OSError, RuntimeError):
            return False


@pytest.mark.parametrize("text", [t for _, t in SHELL], ids=[f[:50] for f, _ in SHELL])
def test_readme_shell_block_runs_as_written(text, tmp_path):
    from coordl.synth import make_image_folder

    work = tmp_path / "work"
    make_image_folder(str(work / "data" / "train"), num_images=24, num_classes=3, image_size=(96, 72), seed=0)
    (work / "mymodel.py").write_text(MYMODEL)
    (work / "train.py").write_text(TRAIN)
    env = _env(tmp_path)
    jobs: list[tuple[str, subprocess.Popen]] = []
    try:
        for cmd, background in _commands(text):
            cmd = _substitute(cmd)
            if background:
                jobs.append((cmd, subprocess.Popen(["bash", "-c", cmd], cwd=work, env=env, text=True,
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
                continue
            if cmd.startswith("coordl daemon status") and jobs:
                deadline = time.monotonic() + 120
                while not _daemon_up(env) and time.monotonic() < deadline:
                    if all(p.poll() is not None for _, p in jobs):
                        break
                    time.sleep(0.5)
            r = _run(cmd, work, env)
            assert r.returncode == 0, f"README command failed: {cmd}\n{r.stdout}\n{r.stderr}"
            if cmd.startswith("coordl analyze"):
                for arg, path in re.findall(r"--(json|plot) (\S+)", cmd):
                    if arg == "json" or "matplotlib" not in r.stdout:
                        assert (work / path).is_file(), (cmd, r.stdout)
        for cmd, p in jobs:
            out, _ = p.communicate(timeout=240)
            assert p.returncode == 0, f"README command failed: {cmd}\n{out}"
            assert "trained on" in out, out
    finally:
        for _, p in jobs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        if any((tmp_path / "run").iterdir()):  # a daemon was started: stop it (its caches go with it)
            import psutil

            from coordl.testing import kill_processes, stop_daemon

            with _run_dir_of(env):
                left = stop_daemon()
            kill_processes([psutil.Process(p) for p in left if psutil.pid_exists(p)])
            assert not left, f"daemon processes left after the stop (killed now): {left}"


def test_console_script_names_a_module_it_cannot_find(tmp_path):
    """The README's ``--step mymodel:train_step`` from the directory that
    holds mymodel.py is run above; a module that is in neither the current
    directory nor on sys.path gets a clear error naming both, not a
    traceback."""
    work = tmp_path / "work"
    (work / "d" / "c").mkdir(parents=True)
    env = _env(tmp_path)
    r = _run("coordl analyze d --step nosuchmodel:train_step --plot ''", work, env)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "no module named 'nosuchmodel'" in r.stderr and str(work) in r.stderr, r.stderr


def test_readme_says_what_optional_features_need():
    text = README.read_text()
    plot = text[text.index("--plot"):]
    assert "matplotlib" in plot[:plot.index("##")], "the README should say --plot needs matplotlib"
    progress = text[text.index("progress=True"):]
    assert "tqdm" in progress[:400], "the README should say progress=True needs tqdm"
