"""One rank of a multi-"node" job for the peer tests: torch.distributed over
gloo on loopback, its node named by COORDL_NODE_ID.  Writes one JSON line
per epoch: the dataset index of every sample it got (identified by its
bytes, which are unique per file) and the epoch's stats."""
import argparse
import json
import os
import signal
import sys
import threading
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
    p.add_argument("--barriers", type=int, default=-1, help="only after the first N epochs (-1: all)")
    p.add_argument("--stop-self-after", type=int, default=-1, help="SIGSTOP itself after this epoch")
    p.add_argument("--await-stop-after", type=int, default=-1,
                   help="after this epoch's barrier, wait until the rank writing --await-stop-of is stopped")
    p.add_argument("--await-stop-of", default="", help="that rank's --out file (its first line has its pid)")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per batch")
    p.add_argument("--progress", type=int, default=0, help="write a line per batch")
    p.add_argument("--report", type=int, default=0, help="write the node caches' info at the end")
    p.add_argument("--share", type=int, default=0, help="share=True (the node daemon prepares)")
    p.add_argument("--kill-daemon-after", type=int, default=-1, help="SIGKILL this node's daemon after this epoch")
    p.add_argument("--extra", default="none",
                   help="before the training loader, build and run one more (shuffle=False) loader on this "
                        "rank: 'nocache' (cache_size=0) or 'cache' (the training one's cache_size)")
    p.add_argument("--first", default="none",
                   help="'partial': break the first epoch off after 2 batches; 'resume': resume mid-epoch 0 "
                        "with fresh caches; 'eval': one shuffle=False "
                        "pass over the same dataset and cache (a loader built on every rank) before training")
    a = p.parse_args()
    if a.node:
        os.environ["COORDL_NODE_ID"] = a.node
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    import torch.distributed as dist

    from _cache_helpers import file_bytes, folder

    import coordl

    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    ds = folder(a.root)
    which = {b: i for i, b in enumerate(file_bytes(ds))}
    if a.extra != "none" or a.first == "eval":
        V = coordl.DataLoader(ds, batch_size=a.batch_size, shuffle=False, seed=3, num_workers=a.workers,
                              cache_size=0 if a.extra == "nocache" else a.cache_size, peers=a.peers)
        for _ in V:
            pass
    L = coordl.DataLoader(ds, batch_size=a.batch_size, shuffle=True, seed=3, num_workers=a.workers,
                          cache_size=a.cache_size, peers=a.peers, share=bool(a.share))
    # the evaluation loader goes only once the training loader holds the node cache: a cache goes
    # with its last holder, and the reaper thread releases a collected loader's hold at a moment of
    # its own, so deleting it first left the training loader a warm or an empty cache by chance
    V = None
    if a.first == "resume":    # fresh caches, resumed mid-epoch 0 (from a loader without cache)
        R = coordl.DataLoader(ds, batch_size=a.batch_size, shuffle=True, seed=3, num_workers=0, peers="off")
        it = iter(R)
        for _ in range(len(R) // 2):
            next(it)
        L.load_state_dict(R.state_dict())
        del it, R
    with open(a.out, "w") as out:
        server = L.peer_server
        out.write(json.dumps({"server": list(server.address) if server else None, "pid": os.getpid(),
                              "in_daemon": bool(server and server.in_daemon)}) + "\n")
        out.flush()
        for epoch in range(a.epochs):
            got = []
            for k, (x, _y) in enumerate(L):
                for row in x:
                    got.append(which.get(bytes(row.numpy()), -1))
                if a.progress:
                    out.write(json.dumps({"progress": [epoch, k]}) + "\n")
                    out.flush()
                if a.sleep:
                    time.sleep(a.sleep)
                if epoch == 0 and a.first == "partial" and k == 1:
                    break
            if epoch == a.kill_daemon_after:
                from coordl.daemon import server as daemon

                pid = daemon.status()["pid"]
                os.kill(pid, signal.SIGKILL)
                while daemon.status() is not None:
                    time.sleep(0.05)
            st = L.stats().epochs[-1]
            out.write(json.dumps({"epoch": epoch, "got": got, "stats": st.__dict__}) + "\n")
            out.flush()
            if a.barrier and (a.barriers < 0 or epoch < a.barriers):
                dist.barrier()
            if epoch == a.stop_self_after:
                os.kill(os.getpid(), signal.SIGSTOP)    # a stalled node: its server stops answering
            if epoch == a.await_stop_after:
                _await_stopped(a.await_stop_of)
        if a.report:
            import contextlib
            import io

            from coordl.cache import list_caches
            from coordl.cli import main as cli

            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                cli(["cache", "ls"])
            out.write(json.dumps({"caches": [c.__dict__ for c in list_caches()], "ls": text.getvalue()}) + "\n")
            out.flush()
        if a.barrier:
            dist.barrier()   # nobody's server goes before everyone is done with it
        ports = {p for _n, _h, p in L._peers.nodes} if L._peers is not None else set()
        del L
        import gc

        gc.collect()
        import psutil

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:   # the reaper thread closes the client and server
            left = [t.name for t in threading.enumerate() if t.name.startswith("coordl-peer")]
            socks = [str(c) for c in psutil.Process().net_connections(kind="tcp")
                     if c.laddr and c.laddr.port in ports or c.raddr and c.raddr.port in ports]
            if not left and not socks:
                break
            time.sleep(0.05)
        out.write(json.dumps({"threads_left": left, "sockets_left": socks}) + "\n")
    dist.destroy_process_group()


def _await_stopped(out_file: str, timeout: float = 60.0) -> None:
    """Wait until the rank that writes ``out_file`` is stopped: the barrier
    lets everyone go at once, and without this the next epoch could be served
    by that rank's server in the moment before it stops itself."""
    import psutil

    with open(out_file) as f:
        pid = json.loads(f.readline())["pid"]
    deadline = time.monotonic() + timeout
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        if time.monotonic() > deadline:
            raise SystemExit(f"rank with pid {pid} did not stop within {timeout} s")
        time.sleep(0.005)


if __name__ == "__main__":
    main()
