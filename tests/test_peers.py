"""Partitioned caching across nodes (coordl.peers): several "nodes" on one
machine (COORDL_NODE_ID, gloo on loopback), each rank its own process
(tests/_peers_job.py) with a hard timeout; a real peer killed or stopped."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from coordl.peers import rendezvous
from coordl.peers.client import PeerClient
from coordl.plan import EpochPlan
from coordl.testing import popen

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_peers_job.py")
sys.path.insert(0, HERE)
from _cache_helpers import make_folder  # noqa: E402
from _ports import free_port  # noqa: E402

N = 64          # samples of 256 bytes, unique bytes each
SIZE = 256
# a node cache just over half the dataset: each of 2 nodes holds its first-epoch share
CACHE = N * SIZE // 2 + 1024


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_folder(str(tmp_path_factory.mktemp("peers") / "d"), n=N, size=SIZE)


class Cluster:
    """``world`` rank processes, ``per_node`` per node, started together."""

    def __init__(self, tmp, root, world=4, per_node=2, env=None, rank_opts=None, node_ids=True, **opts):
        self.port = free_port()
        self.outs = [str(tmp / f"rank{r}.jsonl") for r in range(world)]
        self.procs = []
        # a timeout with room for a rank descheduled on a loaded machine (a reply later than it reads
        # from storage); the tests of stalls and restarts set a short one
        env = {**os.environ, "COORDL_PEER_TIMEOUT": "5", **(env or {})}
        for r in range(world):
            args = [sys.executable, JOB, "--root", root, "--rank", str(r), "--world", str(world),
                    "--node", f"n{r // per_node}" if node_ids else "", "--port", str(self.port), "--cache-size", str(CACHE),
                    "--out", self.outs[r]]
            for k, v in {**opts, **(rank_opts or {}).get(r, {})}.items():
                args += [f"--{k.replace('_', '-')}", str(v)]
            self.procs.append(popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                               env=env, start_new_session=True))

    def lines(self, r):
        try:
            with open(self.outs[r]) as f:
                return [json.loads(x) for x in f if x.strip()]
        except (FileNotFoundError, json.JSONDecodeError):
            return []

    def wait_for(self, r, pred, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(pred(x) for x in self.lines(r)):
                return
            if self.procs[r].poll() is not None:
                raise AssertionError(f"rank {r} exited: {self.procs[r].stderr.read()[-3000:]}")
            time.sleep(0.02)
        raise AssertionError(f"rank {r} did not get there within {timeout} s")

    def finish(self, timeout=120, skip=()):
        deadline = time.monotonic() + timeout
        try:
            for r, p in enumerate(self.procs):
                if r in skip:
                    continue
                _out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
                assert p.returncode == 0, f"rank {r} failed:\n{err[-4000:]}"
        finally:
            self.kill()

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()

    def epochs(self, r):
        return {x["epoch"]: x for x in self.lines(r) if "epoch" in x}


def _stop_node_daemons(env, monkeypatch, nodes=("n0", "n1")):
    """Stop each node's daemon (``COORDL_NODE_ID``) of the run directory in
    ``env`` from this process (a ``coordl daemon stop`` each would import
    torch again) and wait for it and its workers."""
    from coordl.testing import kill_processes, stop_daemon

    left = []
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        for node in nodes:
            m.setenv("COORDL_NODE_ID", node)
            left += stop_daemon()
    kill_processes([psutil.Process(p) for p in left if psutil.pid_exists(p)])
    assert not left, f"daemon processes left behind (killed now): {left}"


def _expected(r, world, epoch):
    plan = EpochPlan(num_samples=N, seed=3, batch_size=4, shuffle=True, rank=r, world_size=world)
    return sorted(int(i) for i in plan.indices(epoch))


def test_two_nodes_two_ranks_each_read_nothing_from_storage_after_the_first_epoch(tmp_path, data):
    c = Cluster(tmp_path, data, epochs=3, workers=1, report=1)
    c.finish()
    for epoch in range(3):
        seen = []
        for r in range(4):
            got = c.epochs(r)[epoch]["got"]
            assert sorted(got) == _expected(r, 4, epoch)     # its own share, exactly once
            seen += got
        assert sorted(seen) == list(range(N))                # and the ranks together: everything once
    for epoch in (1, 2):
        st = [c.epochs(r)[epoch]["stats"] for r in range(4)]
        assert sum(s["samples_from_storage"] for s in st) == 0
        assert sum(s["samples_from_peers"] for s in st) > 0
        assert sum(s["bytes_from_peers"] for s in st) == SIZE * sum(s["samples_from_peers"] for s in st)
    # the node's lowest rank runs its server; `coordl cache ls` shows the traffic
    servers = [c.lines(r)[0]["server"] for r in range(4)]
    assert servers[0] and servers[2] and servers[1] is None and servers[3] is None
    assert servers[0][0] == "127.0.0.1" and servers[0] != servers[2]
    for r in (0, 2):
        rep = next(x for x in c.lines(r) if "caches" in x)
        mine = [x for x in rep["caches"] if x["name"].endswith(f"@n{r // 2}")]
        assert len(mine) == 1 and mine[0]["peer_in"] > 0 and mine[0]["peer_out"] > 0
        assert "peers: got" in rep["ls"]
    for r in range(4):     # the loaders are gone: so are their peer threads and connections
        end = next(x for x in c.lines(r) if "threads_left" in x)
        assert end["threads_left"] == [] and end["sockets_left"] == []


def test_a_peer_killed_mid_epoch_costs_storage_reads_not_samples(tmp_path, data):
    # no barrier: the survivors go on without the dead rank, as far as the loader is concerned
    c = Cluster(tmp_path, data, epochs=3, barrier=0, progress=1, sleep=0.05)
    try:
        c.wait_for(0, lambda x: x.get("progress") == [1, 1])
        os.killpg(c.procs[2].pid, signal.SIGKILL)    # node n1's server (and rank 2 itself)
        c.finish(skip={2})
    finally:
        c.kill()
    for r in (0, 1, 3):
        eps = c.epochs(r)
        assert sorted(eps) == [0, 1, 2]
        for epoch in range(3):
            assert sorted(eps[epoch]["got"]) == _expected(r, 4, epoch)
    # node n0 reads n1's share from storage once n1 is gone
    assert sum(c.epochs(r)[2]["stats"]["samples_from_storage"] for r in (0, 1)) > 0


def test_a_stalled_peer_costs_one_timeout_and_serves_again_next_epoch(tmp_path, data):
    # every rank finishes epoch 0 (n1 holds its share), then n1's lowest rank (its server) stops;
    # the others start epoch 1 only once it has (else its server might serve a batch first)
    c = Cluster(tmp_path, data, epochs=3, barriers=1, await_stop_after=0, await_stop_of=tmp_path / "rank2.jsonl",
                rank_opts={2: {"stop_self_after": 0, "await_stop_after": -1}}, env={"COORDL_PEER_TIMEOUT": "2"})
    try:
        c.wait_for(0, lambda x: x.get("epoch") == 1)
        assert psutil.Process(c.procs[2].pid).status() == psutil.STATUS_STOPPED
        os.killpg(c.procs[2].pid, signal.SIGCONT)
        c.finish()
    finally:
        c.kill()
    e1, e2 = c.epochs(0)[1], c.epochs(0)[2]
    for r in range(4):
        for epoch in range(3):
            assert sorted(c.epochs(r)[epoch]["got"]) == _expected(r, 4, epoch)
    assert e1["stats"]["samples_from_storage"] > 0       # the stalled peer's samples, from storage
    assert e2["stats"]["samples_from_peers"] > 0         # it is asked again at the next epoch


def test_with_share_the_node_daemons_workers_read_through_peers(tmp_path, data, monkeypatch):
    env = {"COORDL_RUN_DIR": str(tmp_path / "run")}
    os.makedirs(env["COORDL_RUN_DIR"], mode=0o700)
    c = Cluster(tmp_path, data, world=2, per_node=1, epochs=3, share=1, env=env)
    try:
        c.finish()
    finally:
        _stop_node_daemons(env, monkeypatch)      # each node has its own daemon (COORDL_NODE_ID)
    assert [c.lines(r)[0]["in_daemon"] for r in range(2)] == [True, True]   # each node's server: its daemon
    for epoch in range(3):
        assert sorted(c.epochs(0)[epoch]["got"] + c.epochs(1)[epoch]["got"]) == list(range(N))
    for epoch in (1, 2):
        st = [c.epochs(r)[epoch]["stats"] for r in range(2)]
        assert sum(s["samples_shared"] for s in st) == N            # the daemons prepared everything...
        assert sum(s["samples_from_storage"] for s in st) == 0      # ...reading nothing from storage
        assert sum(s["samples_from_peers"] for s in st) > 0


def test_one_node_keeps_peers_off_and_on_is_refused(tmp_path, data):
    c = Cluster(tmp_path, data, world=2, per_node=2, epochs=1, peers="auto")
    c.finish()
    assert [c.lines(r)[0]["server"] for r in range(2)] == [None, None]
    c = Cluster(tmp_path, data, world=2, per_node=2, epochs=1, peers="on")
    try:
        for p in c.procs:
            _out, err = p.communicate(timeout=120)
            assert p.returncode != 0 and 'peers="on" cannot work' in err and "COORDL_NODE_ID" in err
    finally:
        c.kill()


def _storage(c, ranks, epoch):
    return sum(c.epochs(r)[epoch]["stats"]["samples_from_storage"] for r in ranks)


def _peers_got(c, ranks, epoch):
    return sum(c.epochs(r)[epoch]["stats"]["samples_from_peers"] for r in ranks)


def _fails_with(c, text, timeout=90):
    try:
        for r, p in enumerate(c.procs):
            _out, err = p.communicate(timeout=timeout)
            assert p.returncode != 0 and text in err, f"rank {r}: rc={p.returncode}\n{err[-3000:]}"
    finally:
        c.kill()


def test_a_loader_built_on_rank_0_only_without_cache_is_not_collective(tmp_path, data):
    """An evaluation loader built on rank 0 only (peers
    "auto", no cache_size) must not call a collective: it paired with the
    other ranks' training loader (a wrong warning, then a hang)."""
    c = Cluster(tmp_path, data, world=2, per_node=1, epochs=2, peers="auto", rank_opts={0: {"extra": "nocache"}})
    c.finish(timeout=90)
    for epoch in range(2):
        assert sorted(c.epochs(0)[epoch]["got"] + c.epochs(1)[epoch]["got"]) == list(range(N))
    assert _storage(c, (0, 1), 1) == 0 and _peers_got(c, (0, 1), 1) > 0     # the training loader's peers work


def test_a_loader_one_node_by_the_launcher_is_not_collective(tmp_path, data):
    """Torchrun's environment says one node
    (LOCAL_WORLD_SIZE == WORLD_SIZE): peers "auto" stay off without any
    collective, so a loader with a cache built on rank 0 only goes through."""
    c = Cluster(tmp_path, data, world=2, per_node=2, epochs=1, node_ids=False, barrier=0, peers="auto",
                env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "COORDL_NODE_ID": ""},
                rank_opts={0: {"extra": "cache"}})
    c.finish(timeout=90)
    assert [c.lines(r)[0]["server"] for r in range(2)] == [None, None]


def test_a_rank_building_one_loader_more_is_an_error_on_every_rank(tmp_path, data):
    """Rank 0 builds one cached loader more than rank 1
    (peers on): every rank raises a clear error naming the mismatch, instead
    of pairing rank 0's extra loader with rank 1's training loader."""
    c = Cluster(tmp_path, data, world=2, per_node=1, epochs=1, rank_opts={0: {"extra": "cache"}},
                env={"COORDL_PEER_RENDEZVOUS_TIMEOUT": "20"})
    _fails_with(c, "built different DataLoaders")


@pytest.mark.parametrize("first", ["eval", "resume"])
def test_ownership_follows_what_caches_hold_after_any_first_pass(tmp_path, data, first):
    """An evaluation pass (shuffle=False) first, or a
    mid-epoch resume with fresh caches, left ownership computed from a plan
    the caches never followed: a share of every later epoch came from
    storage for good.  Asked from what caches hold, the cluster reads
    nothing from storage from the first epoch after one full pass."""
    c = Cluster(tmp_path, data, world=2, per_node=1, epochs=4, first=first)
    c.finish()
    full = 0 if first == "eval" else 2      # (resumed mid-epoch 0: epoch 1 is the first full one)
    for epoch in range(1, 4):
        assert sorted(c.epochs(0)[epoch]["got"] + c.epochs(1)[epoch]["got"]) == list(range(N))
    for epoch in range(full, 4):
        assert _storage(c, (0, 1), epoch) == 0, f"epoch {epoch}: {_storage(c, (0, 1), epoch)} from storage"
        assert _peers_got(c, (0, 1), epoch) > 0


def test_uneven_ranks_per_node_cost_no_storage_reads_after_the_first_epoch(tmp_path, data):
    """Node n0 runs 2 ranks, n1 one; n0 reads 2/3 of the
    dataset in the first epoch and caches only half: what overflows is
    handed to n1, which has room, so from epoch 1 on nothing comes from
    storage (the plan-based ownership read the overflow every epoch)."""
    c = Cluster(tmp_path, data, world=3, per_node=2, epochs=3, peers="auto")
    c.finish()
    for epoch in range(3):
        assert set(sum((c.epochs(r)[epoch]["got"] for r in range(3)), [])) == set(range(N))   # (padded: 3 ranks)
    for epoch in (1, 2):
        assert _storage(c, range(3), epoch) == 0, f"epoch {epoch}: {_storage(c, range(3), epoch)} from storage"


def test_bad_peer_environment_is_refused_on_every_rank_naming_the_variable(tmp_path, data):
    """COORDL_PEER_PORT=70000 raised OverflowError on one
    rank and a gloo error on the others; now every rank refuses it, before
    any collective, naming the variable."""
    c = Cluster(tmp_path, data, world=2, per_node=1, epochs=1, env={"COORDL_PEER_PORT": "70000"})
    _fails_with(c, "COORDL_PEER_PORT should be")


def test_a_node_daemon_killed_serves_again_within_one_timeout_from_the_same_address(tmp_path, data, monkeypatch):
    """After n1's daemon (its peer server) is SIGKILLed, n1 serves again
    within about one timeout, in the very next epoch (it was read from
    storage for that whole epoch), and from its next pass on a new daemon
    serves everything from the same address (one run checks both: each
    run costs two ranks, two daemons and their workers).  An epoch lasts
    about twice the peer timeout (8 batches, 0.6 s each), so that the
    recovery has room on a loaded machine (at 0.4 s it missed epoch 1
    once in a full parallel run on 2 vCPUs)."""
    env = {"COORDL_RUN_DIR": str(tmp_path / "run"), "COORDL_PEER_TIMEOUT": "2"}
    os.makedirs(env["COORDL_RUN_DIR"], mode=0o700)
    c = Cluster(tmp_path, data, world=2, per_node=1, epochs=4, share=1, env=env, sleep=0.6,
                rank_opts={1: {"kill_daemon_after": 0}})
    try:
        c.finish()
    finally:
        _stop_node_daemons(env, monkeypatch)
    for epoch in range(4):
        assert sorted(c.epochs(0)[epoch]["got"] + c.epochs(1)[epoch]["got"]) == list(range(N))
    assert c.epochs(0)[1]["stats"]["samples_from_peers"] > 0, "n1 not served again within epoch 1"
    # n1 served again (a new daemon, the same port) from its next pass on
    assert c.epochs(0)[3]["stats"]["samples_from_peers"] > 0
    assert c.epochs(0)[3]["stats"]["samples_from_storage"] == 0


# ---------------------------------------------------------------- no processes
def test_a_rank_with_many_descriptors_keeps_its_daemon_hosted_server():
    """In a rank holding 1,100 open files, the check
    that the node daemon still serves (select() on its connection) failed
    with ValueError, read as "the daemon died", and the server was torn down
    and rebuilt every pass; the worker's and the daemon's loops had the
    same select()."""
    from coordl.testing import run_in_child

    code = r"""
import os, resource, socket
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
a, b = socket.socketpair()
assert a.fileno() > 1024
from coordl.peers.hosted import DaemonHosted
from coordl.pipeline.worker_process import _readable
h = DaemonHosted.__new__(DaemonHosted)
h.local = None
class Conn: pass
h.conn = Conn()
h.conn.sock = a
print("alive", h.alive(), _readable([a.fileno()], 0) == [])
b.close()
print("dead", not h.alive(), _readable([a.fileno()], 0) == [a.fileno()])
"""
    r = run_in_child(code, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["alive", "True", "True", "dead", "True", "True"], r.stdout + r.stderr


def test_peers_environment_takes_the_share_convention(monkeypatch):
    """COORDL_PEERS accepts 0/1/true/false/yes/no like
    COORDL_SHARE; a bad value's error names the variable, not a peers=
    argument nobody passed."""
    for v, want in (("0", "off"), ("false", "off"), ("no", "off"), ("1", "on"), ("true", "on"), ("YES", "on"),
                    ("", "auto"), ("auto", "auto"), ("off", "off")):
        monkeypatch.setenv("COORDL_PEERS", v)
        assert rendezvous._want(None) == want, v
    monkeypatch.setenv("COORDL_PEERS", "maybe")
    with pytest.raises(ValueError, match="COORDL_PEERS should be") as e:
        rendezvous._want(None)
    assert "peers=" not in str(e.value).split("but got")[1]
    for var, bad in (("COORDL_PEER_PORT", "70000"), ("COORDL_PEER_PORT", "x"), ("COORDL_PEER_TIMEOUT", "0"),
                     ("COORDL_PEER_TIMEOUT", "nan")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=f"{var} should be"):
            rendezvous.env_settings()
        monkeypatch.delenv(var)


def test_peers_env_values_build_a_loader_in_one_process(monkeypatch, data):
    import coordl
    from _cache_helpers import folder

    for v in ("0", "1", "false", "no"):
        monkeypatch.setenv("COORDL_PEERS", v)
        if v == "1":      # on, where it cannot be: said, not an error about an argument
            with pytest.warns(UserWarning, match="no effect"):
                L = coordl.DataLoader(folder(data), batch_size=4, seed=1, cache_size=1 << 16)
        else:
            L = coordl.DataLoader(folder(data), batch_size=4, seed=1, cache_size=1 << 16)
        assert L.peer_server is None
        del L


@pytest.mark.parametrize("addr", ["0", "::0", "0:0:0:0:0:0:0:0", "0.0.0.0", "::", "0.0", "[::]"])
def test_every_spelling_of_the_wildcard_is_refused(monkeypatch, addr):
    """The guard compared strings, so "0", "::0" or
    "0:0:0:0:0:0:0:0" bound every interface."""
    from coordl.peers.server import PeerServer

    monkeypatch.setenv("COORDL_PEER_ADDR", addr)
    with pytest.raises(ValueError, match="one interface"):
        rendezvous.peer_host()
    with pytest.raises(ValueError, match="one interface"):
        rendezvous.env_settings()
    with pytest.raises(ValueError, match="one interface"):
        PeerServer(object(), b"s" * 32, addr)



def test_ownership_comes_from_membership_not_from_plans(monkeypatch):
    """Who holds what is the peers' membership,
    asked once per process per epoch; owners() draws no permutation (it drew
    one per rank: 5.5 s at world 256 for 1.28M samples, in every worker)."""
    import importlib

    plan_mod = importlib.import_module("coordl.plan")

    def no_plan(*a, **k):
        raise AssertionError("owners() computed an epoch plan")

    monkeypatch.setattr(plan_mod.EpochPlan, "indices", no_plan)
    n = 1000
    plan = dict(num_samples=n, seed=1, batch_size=4, shuffle=True, drop_last=False)
    c = PeerClient([("a", "h", 1), ("b", "h", 2), ("c", "h", 3)], 0, [0, 0, 1, 2] * 64, b"s" * 32, "fp", plan)
    c._stale.clear()                 # membership as a peer would have answered it
    b = np.zeros(n, bool)
    b[::3] = True
    cc = np.zeros(n, bool)
    cc[1::3] = True
    cc[::3] = True                   # both hold every third sample
    c._maps = {1: np.packbits(b), 2: np.packbits(cc)}
    own = c.owners()
    assert set(own[2::3].tolist()) == {-1}             # nobody holds these: storage, no round trip
    assert set(own[1::3].tolist()) == {2}
    assert set(own[::3].tolist()) <= {1, 2}
    h = c.holders(list(range(0, n, 3)))
    assert set(h.tolist()) == {1, 2}, "several holders: the load is not spread"
    import pickle

    c2 = pickle.loads(pickle.dumps(c))                # pickled into a worker: configuration only
    assert c2.secret == c.secret and c2._maps == {} and c2._stale == {1, 2}


def test_peer_address_follows_the_process_groups_interface(monkeypatch):
    monkeypatch.delenv("COORDL_PEER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert rendezvous.peer_host() == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert rendezvous.peer_host() in ("127.0.0.1", "::1")
    monkeypatch.setenv("COORDL_PEER_ADDR", "10.1.2.3")
    assert rendezvous.peer_host() == "10.1.2.3"
    monkeypatch.setenv("COORDL_PEER_ADDR", "0.0.0.0")
    with pytest.raises(ValueError, match="one interface"):
        rendezvous.peer_host()


def test_the_server_refuses_the_wildcard_address(tmp_path):
    from coordl.peers.server import PeerServer

    with pytest.raises(ValueError, match="never every interface"):
        PeerServer(object(), b"s" * 32, "0.0.0.0")


def test_bad_peers_values_are_refused(data):
    import coordl
    from _cache_helpers import folder

    with pytest.raises(ValueError, match='peers should be "auto", "on" or "off"'):
        coordl.DataLoader(folder(data), batch_size=4, peers="yes")


def test_daemon_status_shows_the_peer_server_it_runs():
    from coordl.cli import format_status

    st = {"pid": 1, "uptime": 3, "worker_pids": [], "staging_limit": 0, "groups": [], "caches": [],
          "peer_servers": [{"address": ["10.0.0.2", 4242], "cache": "cache-x@n1", "job_pid": 77,
                            "connections": 2, "samples_served": 10, "bytes_served": 2 ** 21, "absent": 3}]}
    text = format_status(st)
    assert "serving cache-x@n1 to other nodes on 10.0.0.2:4242 for pid 77" in text
    assert "10 samples (2.0 MiB) served, 3 absent" in text
