"""The repository holds coordl's own sources only."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tracked() -> list[str]:
    r = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("not a git checkout")
    return r.stdout.splitlines()


def test_no_third_party_packages_are_committed():
    """A 2.9 MB py-spy wheel sat at the repository root; packages come from pip."""
    packed = [p for p in _tracked() if p.endswith((".whl", ".tar.gz", ".zip", ".egg", ".so"))]
    assert packed == []


def test_no_module_calls_itself_work_in_progress():
    stale = [str(p.relative_to(ROOT)) for p in (ROOT / "coordl").rglob("*.py")
             if "work in progress" in p.read_text().lower()]
    assert stale == []


# A reader of the code or the docs has no tracker: a reference to a tracker
# entry ("issue" or "defect" and a number, with or without "#") says nothing
# to them.  Tests and docs name the behaviour instead.  Plain words ("an
# issue with X") stay allowed.
TRACKER_REF = re.compile(r"\b(?:issue|defect)s?[ _-]*#?\s?\d", re.IGNORECASE)
SCANNED = ("coordl/", "tests/", "benchmarks/", "docs/", "README.md", "CHANGELOG.md")


def tracker_refs(paths: list[str], root: Path = ROOT) -> list[str]:
    """``path:line: text`` of every tracker reference in the text files
    among ``paths`` (binary files are skipped)."""
    hits = []
    for rel in paths:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if TRACKER_REF.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    return hits


def tracker_file_names(paths: list[str]) -> list[str]:
    return [p for p in paths if "issue" in Path(p).name.lower()]


def test_the_tracker_check_finds_references_and_leaves_plain_words(tmp_path):
    """The check itself: planted references are found, ordinary uses of
    the word are not (the planted texts are built so this file has none)."""
    word = "iss" + "ue"
    bad = [f"see {word} 8", f"({word} #18)", f"{word.title()} 21, item 10", f"{word}s 18-22",
           f"{word}_19", f"de{'fect'} 7: a hung worker"]
    good = [f"an {word} with the cache", f"{word}s of memory", f"the {word} is 3 workers",
            f"{word}d 8 requests", f"t{word} 8"]
    for i, line in enumerate(bad + good):
        (tmp_path / f"f{i}.py").write_text(f"x = 1\n# {line}\n")
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe" + f"{word} 1".encode("utf-16-le"))
    names = [f"f{i}.py" for i in range(len(bad) + len(good))] + ["blob.bin"]
    hits = tracker_refs(names, tmp_path)
    assert sorted(h.split(":")[0] for h in hits) == sorted(f"f{i}.py" for i in range(len(bad))), hits
    assert all(":2: " in h for h in hits)
    assert tracker_file_names([f"benchmarks/_peers_{word}19.py", f"docs/{word.upper()}S.md", "tests/test_x.py"]) == [
        f"benchmarks/_peers_{word}19.py", f"docs/{word.upper()}S.md"]


def test_no_tracker_numbers_in_code_tests_or_docs():
    paths = [p for p in _tracked() if p.startswith(SCANNED)]
    assert paths, "no tracked files found under " + ", ".join(SCANNED)
    hits = tracker_refs(paths)
    assert hits == [], (f"{len(hits)} reference(s) to tracker entries; say what the code or test does "
                        "instead:\n" + "\n".join(hits))


def test_no_file_is_named_after_a_tracker_entry():
    assert tracker_file_names(_tracked()) == []
