"""The cluster: peer links (handshake, the typed peer protocol), membership and plan agreement, node identity, this
node's measured speed, and the picture of it all that /v1/cluster shows.

May import: partitioning, engines (to measure a layer), models, errors."""
