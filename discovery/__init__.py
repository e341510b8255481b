"""Finding peers: mDNS on the local network, plus static host:port peers where multicast cannot reach.

May import: nothing of exo_like (the node hands it what it announces and takes back the peers found)."""

from discovery.finder import PeerFinder
from discovery.mdns import SERVICE_TYPE, MdnsDiscovery
from discovery.static import PeerAddress, parse_peers

__all__ = ["SERVICE_TYPE", "MdnsDiscovery", "PeerFinder", "PeerAddress", "parse_peers"]
