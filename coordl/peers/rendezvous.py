"""Finding the other nodes: over torch.distributed, which the job already
runs, so there is nothing else to start.

When a loader is built with peers on, every rank takes part in two
``all_gather_object`` calls on the default process group (so building the
loader is collective, like building DDP):

1. each rank says which node it is on (:func:`coordl.cache.node_id`), which
   dataset it reads (fingerprint) and whether it caches; rank 0 adds a fresh
   32-byte job secret (the process group is the channel the job already
   trusts; the secret never goes on the peer wire, see ``protocol.py``);
2. the lowest rank of each node starts that node's cache server (a thread
   in its process) and says where it listens; the others say nothing.

Every rank then knows the same peer table and decides the same way, so no
rank waits on a collective the others skipped.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import warnings

__all__ = ["peer_host", "setup", "MODES"]

MODES = ("auto", "on", "off")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def peer_host() -> str:
    """The address this node's cache server binds: ``COORDL_PEER_ADDR``, else
    the local address of the interface that reaches torch.distributed's
    master (``MASTER_ADDR``), else the host name's address.  Never the
    wildcard address."""
    env = os.environ.get("COORDL_PEER_ADDR")
    if env:
        if env in ("0.0.0.0", "::", "*"):
            raise ValueError(f"COORDL_PEER_ADDR should be one interface's address, but got "
                             f"COORDL_PEER_ADDR={env!r} (every interface)")
        return env
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
                return s.getsockname()[0]
            except OSError:
                continue
            finally:
                s.close()
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = "127.0.0.1"
    return addr


def _want(mode) -> str:
    if mode is None:
        mode = os.environ.get("COORDL_PEERS") or "auto"
    if mode is True:
        mode = "on"
    if mode is False:
        mode = "off"
    if mode not in MODES:
        raise ValueError(f'peers should be "auto", "on" or "off", but got peers={mode!r}')
    return mode


def setup(mode, cache, fingerprint: str | None, plan_kwargs: dict, rank: int, world_size: int,
          cache_spec: dict | None = None, share: bool = False):
    """``(client, server)`` for this rank, or ``(None, None)`` when peers are
    off.  Collective over the default process group when it is initialized
    and spans more than one rank (unless ``mode`` is "off").  ``cache_spec``
    (``DataLoader._cache_spec``) names ``cache`` to the node daemon.  The server
    (the node's lowest rank only) runs in the node daemon when one runs or
    ``share`` starts one, else in this process (``hosted.start_server``)."""
    import torch.distributed as dist

    mode = _want(mode)
    if mode == "off":
        return None, None
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
    from ..cache import node_id

    me = {"node": node_id(), "fp": fingerprint, "cache": cache is not None}
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
    elif not all(r["cache"] for r in info):
        problem = "some ranks have no node cache (peers serve node caches: pass cache_size on every rank)"
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
            server = start_server(cache, cache_spec, secret, peer_host(), int(os.environ.get("COORDL_PEER_PORT") or 0),
                                  share)
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

    client = PeerClient(table, my_node, rank_nodes, secret, fingerprint, plan_kwargs,
                        timeout=float(os.environ.get("COORDL_PEER_TIMEOUT") or 5.0))
    return client, server
