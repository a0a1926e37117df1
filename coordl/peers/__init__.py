"""Partitioned caching across nodes: a sample missing from this node's cache
is asked of the node that holds it, before storage.

* ``rendezvous.py``: who the peers are, agreed over torch.distributed (and
  when building a loader is collective at all);
* ``protocol.py``: the authenticated binary frames on the wire;
* ``server.py``: a node's cache server, event-driven (in the node daemon or
  its lowest rank's process; ``hosted.py`` decides);
* ``client.py``: the fetch stage's peer tier, one connection per peer per
  process, ownership from each peer's membership bitmap, asked per epoch.

See docs/architecture.md, "Across nodes".
"""
from .client import PeerClient, PeerDown
from .server import PeerServer

__all__ = ["PeerClient", "PeerDown", "PeerServer"]
