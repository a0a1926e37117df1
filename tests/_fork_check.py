"""Hands batches of a loader to forked children and has each child check,
after the parent dropped its batch and went on through more batches (so the
memory behind a dropped batch can be reused), that its batch still holds
the values it had.  Run inside a child with a hard timeout
(``coordl.testing.run_in_child``): it forks."""
from __future__ import annotations

import gc
import multiprocessing as mp

import torch


def mapped_from(t: torch.Tensor, name: str) -> bool:
    """Whether ``t``'s memory lies in a mapping of this process whose path
    contains ``name`` (a memfd shows as ``/memfd:<name>... (deleted)``)."""
    p = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= p < hi:
                return name in line
    return False


def mappings(name: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if name in line)


def _look(batch, expect, conn) -> None:
    """In the child: wait for the parent's word, then compare."""
    if not conn.poll(120):
        return
    conn.recv()
    conn.send([bool(torch.equal(t, e)) for t, e in zip(batch, expect)])


def hand_to_children(loader, name: str, n: int = 5, epochs: int = 2) -> dict:
    """Batches 1..n of a pass, each given to a forked child and dropped here
    at once; then the rest of the pass and ``epochs`` more.  Returns how many
    handed batches were views of mappings named ``name`` when handed, and how
    many children found their batch changed."""
    ctx = mp.get_context("fork")
    kids, views = [], 0
    it = iter(loader)
    next(it)   # (a shared pass copies its first batch)
    for _ in range(n):
        batch = next(it)
        views += mapped_from(batch[0], name)
        expect = [t.clone() for t in batch]
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_look, args=(batch, expect, theirs), daemon=True)
        p.start()
        theirs.close()
        kids.append((p, mine))
        del batch, expect
        gc.collect()
    for _ in it:
        pass
    for _ in range(epochs):
        for _ in loader:
            pass
    changed = 0
    for p, mine in kids:
        mine.send("look")
        ok = mine.recv() if mine.poll(120) else None
        changed += ok is None or not all(ok)
        mine.close()
        p.join(30)
    return {"views": views, "changed": changed, "exitcodes": [p.exitcode for p, _ in kids]}
