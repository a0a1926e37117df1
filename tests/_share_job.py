"""A training job for the sharing tests: iterates a loader and writes a
digest of every batch (and its stats) as JSON lines, one per batch, so a
test can kill it (or the daemon) at a chosen step and still compare."""
import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import coordl  # noqa: E402
from coordl import transforms as T  # noqa: E402


def digest(batch) -> str:
    h = hashlib.sha1()
    for t in batch:
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def dataset(root: str, size: int):
    return coordl.ImageFolder(root, transform=T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(),
                                                          T.PILToTensor()]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--share", type=int, default=1)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--sleep-until", default=None, help="stop sleeping once this file exists")
    p.add_argument("--cache-size", default=None)
    a = p.parse_args()
    loader = coordl.DataLoader(dataset(a.root, a.size), batch_size=a.batch_size, num_workers=a.workers,
                               seed=a.seed, share=bool(a.share), cache_size=a.cache_size)
    for epoch in range(a.epochs):
        it, k = iter(loader), 0
        while True:
            t0 = time.monotonic()
            batch = next(it, None)
            if batch is None:
                break
            wait = time.monotonic() - t0   # how long this batch kept the job waiting
            print(json.dumps({"epoch": epoch, "step": k, "digest": digest(batch), "wait": wait}), flush=True)
            k += 1
            if a.sleep and not (a.sleep_until and os.path.exists(a.sleep_until)):
                time.sleep(a.sleep)
        del it, batch
    st = loader.stats()
    print(json.dumps({"done": True, "shared": st.samples_shared, "self": st.samples_self_prepared,
                      "samples": st.samples}), flush=True)


if __name__ == "__main__":
    main()
