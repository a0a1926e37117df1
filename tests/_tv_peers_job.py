"""One rank of a two-"node" job reading torchvision's ImageFolder through
coordl with peers on (test_torchvision): prints one JSON line per epoch with
the targets it got and the epoch's stats."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    root, rank, world, port, cache = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    os.environ["COORDL_NODE_ID"] = f"n{rank}"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    import torch.distributed as dist
    from _torchvision import import_torchvision

    import_torchvision()
    from torchvision import datasets, transforms as V1

    import coordl

    dist.init_process_group("gloo", rank=rank, world_size=world)
    ds = datasets.ImageFolder(root, transform=V1.Compose([V1.RandomResizedCrop(8), V1.PILToTensor()]))
    L = coordl.DataLoader(ds, batch_size=4, shuffle=True, seed=3, cache_size=cache, peers="on")
    for epoch in range(2):
        got = [int(t) for _, y in L for t in y]
        st = L.stats().epochs[-1]
        print(json.dumps({"epoch": epoch, "got": got, "path": L.stats().path, "stats": st.__dict__}), flush=True)
        dist.barrier()
    del L
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
