"""One rank of a multi-"node" job for the peer tests: torch.distributed over
gloo on loopback, its node named by COORDL_NODE_ID.  Writes one JSON line
per epoch: the dataset index of every sample it got (identified by its
bytes, which are unique per file) and the epoch's stats."""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--cache-size", type=int, required=True)
    p.add_argument("--peers", default="on")
    p.add_argument("--out", required=True)
    p.add_argument("--barrier", type=int, default=1, help="synchronize ranks between epochs")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per batch")
    a = p.parse_args()
    os.environ["COORDL_NODE_ID"] = a.node
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    import torch.distributed as dist

    from _cache_helpers import file_bytes, folder

    import coordl

    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    ds = folder(a.root)
    which = {b: i for i, b in enumerate(file_bytes(ds))}
    L = coordl.DataLoader(ds, batch_size=a.batch_size, shuffle=True, seed=3, num_workers=a.workers,
                          cache_size=a.cache_size, peers=a.peers)
    with open(a.out, "w") as out:
        server = L.peer_server
        out.write(json.dumps({"server": list(server.address) if server else None, "pid": os.getpid()}) + "\n")
        out.flush()
        for epoch in range(a.epochs):
            got = []
            for x, _y in L:
                for row in x:
                    got.append(which.get(bytes(row.numpy()), -1))
                if a.sleep:
                    time.sleep(a.sleep)
            st = L.stats().epochs[-1]
            out.write(json.dumps({"epoch": epoch, "got": got, "stats": st.__dict__}) + "\n")
            out.flush()
            if a.barrier:
                dist.barrier()
    del L
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
