"""Finding peers: mDNS on the local network, plus static host:port peers where multicast cannot reach."""

from discovery.finder import PeerFinder
from discovery.mdns import SERVICE_TYPE, MdnsDiscovery
from discovery.static import PeerAddress, parse_peers

__all__ = ["SERVICE_TYPE", "MdnsDiscovery", "PeerFinder", "PeerAddress", "parse_peers"]
