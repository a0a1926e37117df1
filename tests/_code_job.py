"""A training job for the code-identity sharing tests: like ``_share_job``
but its transform ends with ``myaug.MyAug()`` imported from ``--project``
(put first on sys.path), so two projects (or two versions of one) have a
transform of the same name and attributes running different code."""
import argparse
import hashlib
import json
import os
import sys
import time
import warnings


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--project", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--share", type=int, default=1)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--go", default=None, help="say when myaug is imported, then wait for this file before the first batch")
    a = p.parse_args()
    sys.path.insert(0, a.project)
    import coordl
    from coordl import transforms as T
    import myaug

    ds = coordl.ImageFolder(a.root, transform=T.Compose([T.RandomResizedCrop(16), T.PILToTensor(), myaug.MyAug()]))
    loader = coordl.DataLoader(ds, batch_size=8, seed=a.seed, share=bool(a.share))
    warnings.simplefilter("always")
    if a.go:   # myaug is imported: the test may edit it now
        print(json.dumps({"imported": True}), flush=True)
        while not os.path.exists(a.go):
            time.sleep(0.05)
    for epoch in range(a.epochs):
        for k, (x, y) in enumerate(loader):
            h = hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()
            print(json.dumps({"epoch": epoch, "step": k, "digest": h}), flush=True)
            if a.sleep:
                time.sleep(a.sleep)
    st = loader.stats()
    print(json.dumps({"done": True, "shared": st.samples_shared, "self": st.samples_self_prepared}), flush=True)


if __name__ == "__main__":
    main()
