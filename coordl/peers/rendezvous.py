"""Finding the other nodes: over torch.distributed, which the job already
runs, so there is nothing else to start.

When is building a loader collective?  Only when every rank can tell, from
what it knows alone, that peers may be on (:func:`setup` decides, in this
order, with no communication):

1. ``peers`` (or ``COORDL_PEERS``) is not "off", and every ``COORDL_PEER_*``
   value parses (a bad one is an error on every rank, naming the variable);
2. a torch.distributed process group spans more than one rank, and the
   loader's rank/world_size are the group's;
3. the loader has a node cache (``cache_size`` > 0): peers serve node caches;
4. the launcher does not say the job runs on one node: under torchrun
   ``LOCAL_WORLD_SIZE == WORLD_SIZE`` (or ``GROUP_WORLD_SIZE == 1``), under
   SLURM ``SLURM_NNODES == 1``, unless ``COORDL_NODE_ID`` is set (simulated
   nodes on one machine).

Only then is the build collective, and it is checked before anything can
pair with the wrong call: every rank tags this loader with its per-process
sequence number (the how-many-th loader of this process that reaches this
point) and a fingerprint of what must agree (dataset, plan, world size), and
meets the others on the process group's key-value store, with a deadline
(``COORDL_PEER_RENDEZVOUS_TIMEOUT``, default 300 s).  A rank whose tag
differs from rank 0's (a rank that built one loader more, or another
dataset) makes every rank raise the same error; a rank that does not come
within the deadline makes those that came raise, and the sequence number is
marked abandoned so that a late rank raises too (never pairs with it).
Only after every rank has arrived with the same tag do the two
``all_gather_object`` calls run on the default group:

1. each rank says which node it is on (:func:`coordl.cache.node_id`), which
   dataset it reads (fingerprint) and whether it caches; rank 0 adds a fresh
   32-byte job secret (the process group is the channel the job already
   trusts; the secret never goes on the peer wire, see ``protocol.py``);
2. the lowest rank of each node starts that node's cache server (in its
   process or the node daemon) and says where it listens.

Nothing collective happens afterwards: what each node's cache holds is
asked of the peers themselves, over the peer protocol, at each epoch start
(``client.py``).
"""
from __future__ import annotations

import datetime
import hashlib
import ipaddress
import itertools
import json
import os
import socket
import time
import warnings

from .protocol import _unspecified, check_bind_host

__all__ = ["peer_host", "setup", "MODES", "env_settings", "check_bind_host"]

MODES = ("auto", "on", "off")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
DEFAULT_RENDEZVOUS_TIMEOUT = 300.0
_SEQ = itertools.count(1)      # loaders of this process that met the others (see the module doc)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def env_settings() -> dict:
    """The ``COORDL_PEER_*`` environment, parsed and checked (ValueError naming
    the variable).  Read the same way on every rank, before any collective."""
    out = {}
    port = os.environ.get("COORDL_PEER_PORT", "").strip()
    try:
        out["port"] = int(port) if port else 0
    except ValueError:
        out["port"] = -1
    if not 0 <= out["port"] <= 65535:
        raise ValueError(f"COORDL_PEER_PORT should be a TCP port number in 0..65535 (0: any free port), but "
                         f"got COORDL_PEER_PORT={port!r}")
    t = os.environ.get("COORDL_PEER_TIMEOUT", "").strip()
    try:
        out["timeout"] = float(t) if t else 5.0
    except ValueError:
        out["timeout"] = -1.0
    if not (out["timeout"] > 0 and out["timeout"] < float("inf")):
        raise ValueError(f"COORDL_PEER_TIMEOUT should be a positive number of seconds, but got "
                         f"COORDL_PEER_TIMEOUT={t!r}")
    r = os.environ.get("COORDL_PEER_RENDEZVOUS_TIMEOUT", "").strip()
    try:
        out["rendezvous_timeout"] = float(r) if r else DEFAULT_RENDEZVOUS_TIMEOUT
    except ValueError:
        out["rendezvous_timeout"] = -1.0
    if not (out["rendezvous_timeout"] > 0 and out["rendezvous_timeout"] < float("inf")):
        raise ValueError(f"COORDL_PEER_RENDEZVOUS_TIMEOUT should be a positive number of seconds, but got "
                         f"COORDL_PEER_RENDEZVOUS_TIMEOUT={r!r}")
    addr = os.environ.get("COORDL_PEER_ADDR")
    if addr:
        check_bind_host(addr, "COORDL_PEER_ADDR")
    out["addr"] = addr or None
    return out


def peer_host() -> str:
    """The address this node's cache server binds: ``COORDL_PEER_ADDR``, else
    the local address of the interface that reaches torch.distributed's
    master (``MASTER_ADDR``), else the host name's address.  Never the
    wildcard address."""
    env = os.environ.get("COORDL_PEER_ADDR")
    if env:
        return check_bind_host(env, "COORDL_PEER_ADDR")
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            infos = socket.getaddrinfo(master, None, proto=socket.IPPROTO_UDP)
        except OSError:
            infos = []
        for family, _, _, _, sockaddr in infos:
            if _is_loopback(sockaddr[0]):
                return sockaddr[0]
            s = socket.socket(family, socket.SOCK_DGRAM)
            try:   # no packet is sent: connect() on UDP only picks the route and source address
                s.connect((sockaddr[0], int(os.environ.get("MASTER_PORT") or 29500)))
                host = s.getsockname()[0]
                if not _unspecified(host):
                    return host
            except OSError:
                continue
            finally:
                s.close()
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = "127.0.0.1"
    return "127.0.0.1" if _unspecified(addr) else addr


def _want(mode) -> str:
    """"auto", "on" or "off" from ``peers=`` (None: ``COORDL_PEERS``, which
    also takes the 0/1/true/false/yes/no of ``COORDL_SHARE``)."""
    if mode is None:
        env = os.environ.get("COORDL_PEERS", "").strip()
        v = env.lower()
        if v in ("", "auto"):
            return "auto"
        if v in _TRUE:
            return "on"
        if v in _FALSE:
            return "off"
        raise ValueError(f'COORDL_PEERS should be "auto", "on" or "off" (or 1/0, true/false, yes/no), but got '
                         f"COORDL_PEERS={env!r}")
    if mode is True:
        mode = "on"
    if mode is False:
        mode = "off"
    if mode not in MODES:
        raise ValueError(f'peers should be "auto", "on" or "off", but got peers={mode!r}')
    return mode


def launcher_nodes(world_size: int) -> int | None:
    """The number of nodes the launcher says the job spans, when it says so
    (torchrun, SLURM) and ``COORDL_NODE_ID`` does not override node identity;
    else None.  Every rank of a job reads the same answer from its own
    environment."""
    env = os.environ
    if env.get("COORDL_NODE_ID"):
        return None

    def num(k):
        try:
            return int(env[k])
        except (KeyError, ValueError):
            return None

    ws = num("WORLD_SIZE")
    if ws is not None and ws != world_size:
        return None       # the environment describes another group than the one in use
    gws = num("GROUP_WORLD_SIZE")     # torchrun: one agent per node
    if gws is not None and ws is not None:
        return gws
    lws = num("LOCAL_WORLD_SIZE")
    if lws is not None and ws is not None and lws == ws:
        return 1
    nn = num("SLURM_NNODES") or num("SLURM_JOB_NUM_NODES")
    if nn is not None and num("SLURM_NTASKS") in (None, world_size):
        return nn
    return None


class RendezvousError(RuntimeError):
    """The ranks did not build the same loader (see the module doc)."""


def _tag(fingerprint, plan_kwargs: dict, world_size: int) -> dict:
    return {"dataset": fingerprint, "plan": {k: plan_kwargs[k] for k in sorted(plan_kwargs)},
            "world_size": world_size}


def _describe(t: dict) -> str:
    p = t["plan"]
    return (f"dataset {str(t['dataset'])[:16]}..., {p.get('num_samples')} samples, seed={p.get('seed')}, "
            f"batch_size={p.get('batch_size')}, shuffle={p.get('shuffle')}, drop_last={p.get('drop_last')}")


def _meet(seq: int, tag: dict, rank: int, world_size: int, timeout: float) -> None:
    """Every rank at loader number ``seq`` with the same ``tag``, or
    :class:`RendezvousError` on every rank that got here (see the module doc)."""
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    pre = f"coordl/peers/{seq}/"
    mine = json.dumps(tag, sort_keys=True, default=str)
    how = ("building a DataLoader with peers on is collective: build it on every rank, in the same order "
           "(or pass peers=\"off\" to a loader some ranks do not build, e.g. evaluation on rank 0)")
    deadline = time.monotonic() + timeout

    def wait(key) -> bool:
        left = deadline - time.monotonic()
        if left <= 0:
            return store.check([key])
        try:
            store.wait([key], datetime.timedelta(seconds=left))
            return True
        except RuntimeError:      # DistStoreError: the deadline passed
            return store.check([key])

    if rank == 0:
        store.set(pre + "tag", mine)
    if not wait(pre + "tag"):
        _abandon(store, pre, world_size, seq, timeout, how, "rank 0 did not build it")
    theirs = store.get(pre + "tag").decode()
    if theirs != mine:
        store.add(pre + "bad", 1)
        store.set(pre + f"why{rank}", _describe(tag))
    if store.add(pre + "arrived", 1) == world_size:
        if store.compare_set(pre + "state", "", "done").decode() != "done":
            raise RendezvousError(f"coordl: this rank built DataLoader #{seq} with peers on after the others "
                                  f"gave up waiting for it; {how}")
    if not wait(pre + "state"):
        _abandon(store, pre, world_size, seq, timeout, how, None)
    state = store.get(pre + "state").decode()
    if state != "done":
        raise RendezvousError(f"coordl: the other ranks gave up waiting for DataLoader #{seq} of this rank "
                              f"(built with peers on); {how}")
    if store.add(pre + "bad", 0):
        t0 = json.loads(theirs)
        raise RendezvousError(
            f"coordl: the ranks built different DataLoaders as their #{seq} with peers on (rank 0: "
            f"{_describe(t0)}; this rank {rank}: {_describe(tag)}{'' if theirs != mine else ', like rank 0'}); "
            f"a rank built one loader more or another dataset; {how}")


def _abandon(store, pre, world_size, seq, timeout, how, why) -> None:
    state = store.compare_set(pre + "state", "", "abandoned").decode()
    if state == "done":
        return
    came = store.add(pre + "arrived", 0)
    raise RendezvousError(f"coordl: only {came} of {world_size} ranks built DataLoader #{seq} with peers on "
                          f"within {timeout:g} s ({why or 'the others did not come'}; "
                          f"COORDL_PEER_RENDEZVOUS_TIMEOUT sets the wait); {how}")


def setup(mode, cache, fingerprint: str | None, plan_kwargs: dict, rank: int, world_size: int,
          cache_spec: dict | None = None, share: bool = False):
    """``(client, server)`` for this rank, or ``(None, None)`` when peers are
    off.  Collective only in the cases the module doc lists.  ``cache_spec``
    (``DataLoader._cache_spec``) names ``cache`` to the node daemon.  The server
    (the node's lowest rank only) runs in the node daemon when one runs or
    ``share`` starts one, else in this process (``hosted.start_server``)."""
    import torch.distributed as dist

    mode = _want(mode)
    if mode == "off":
        return None, None
    env = env_settings()
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        if mode == "on":
            warnings.warn("peers=\"on\" has no effect: there is no torch.distributed process group spanning "
                          "several ranks (run under torchrun, or init_process_group first)", stacklevel=3)
        return None, None
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        if mode == "on":
            raise ValueError(f"peers=\"on\" needs the loader's rank/world_size to be the process group's, but "
                             f"got rank={rank}, world_size={world_size} in a group of "
                             f"{dist.get_world_size()} (this is rank {dist.get_rank()})")
        return None, None
    if cache is None:
        if mode == "on":
            raise ValueError('peers="on" cannot work: this loader has no node cache (peers serve node caches: '
                             "pass cache_size on every rank)")
        return None, None
    if launcher_nodes(world_size) == 1:
        if mode == "on":
            raise ValueError('peers="on" cannot work: the launcher runs every rank on one node (set '
                             "COORDL_NODE_ID per simulated node to run several on one machine; see docs/guide/multinode.md, "
                             '"Several nodes on one machine")')
        return None, None
    # ---- collective from here on, and checked first (see the module doc)
    _meet(next(_SEQ), _tag(fingerprint, plan_kwargs, world_size), rank, world_size, env["rendezvous_timeout"])
    from ..cache import node_id

    me = {"node": node_id(), "fp": fingerprint, "cache": True}
    if rank == 0:
        me["secret"] = os.urandom(32)
    info: list = [None] * world_size
    dist.all_gather_object(info, me)
    nodes = list(dict.fromkeys(r["node"] for r in info))
    if len(nodes) < 2 and mode == "auto":
        return None, None
    problem = None
    if len(nodes) < 2:
        problem = "every rank is on one node (set COORDL_NODE_ID per node to run several on one machine)"
    elif len({r["fp"] for r in info}) != 1:
        problem = ("the nodes see different datasets (fingerprints differ: paths, sizes or modification "
                   "times); peers only serve the same files")
    if problem is not None:
        if mode == "on":
            raise ValueError(f'peers="on" cannot work: {problem}')
        if rank == 0:
            warnings.warn(f"coordl: peers off: {problem}", stacklevel=3)
        return None, None
    secret = info[0]["secret"]
    rank_nodes = [nodes.index(r["node"]) for r in info]
    my_node = rank_nodes[rank]
    first_rank = {}
    for r, n in enumerate(rank_nodes):
        first_rank.setdefault(n, r)
    server = None
    where = None
    if first_rank[my_node] == rank:
        from .hosted import start_server

        try:
            server = start_server(cache, cache_spec, secret, peer_host(), env["port"], share)
            where = list(server.address)
        except (OSError, ValueError) as e:
            warnings.warn(f"coordl: node {nodes[my_node]} cannot serve its cache to peers ({e}); "
                          "the other nodes read its samples from storage", stacklevel=3)
    addrs: list = [None] * world_size
    dist.all_gather_object(addrs, where)
    table = []
    for n, node in enumerate(nodes):
        a = addrs[first_rank[n]]
        table.append((node, a[0], int(a[1])) if a else (node, "", 0))
    from .client import PeerClient

    client = PeerClient(table, my_node, rank_nodes, secret, fingerprint, plan_kwargs, timeout=env["timeout"])
    return client, server
