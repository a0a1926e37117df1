"""Partitioned caching across nodes: a sample missing from this node's cache
is asked of the node that holds it, before storage.

* ``rendezvous.py``: who the peers are, agreed over torch.distributed;
* ``protocol.py``: the authenticated binary frames on the wire;
* ``server.py``: a node's cache server (in its lowest rank's process);
* ``client.py``: the fetch stage's peer tier, one connection per peer per
  process, ownership computed from the plan.

See docs/architecture.md, "Across nodes".
"""
from .client import PeerClient, PeerDown
from .server import PeerServer

__all__ = ["PeerClient", "PeerDown", "PeerServer"]
