"""The cluster: peer links (handshake, the typed peer protocol), membership and each member's announcements, node
identity, this node's measured speed, and the picture of it all that /v1/cluster shows (plan agreement per
instance lives in exo_like/instances/).

May import: partitioning, engines (to measure a layer), models, errors."""
