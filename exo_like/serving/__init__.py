"""Serving requests on the ring: the first stage's scheduler and its KV cache manager, each stage's step loop, the
origin's side of a request (with replay), sampling, stop strings, the KV block pool, and what the node counts for
/metrics.

May import: cluster (the peer protocol, the ring's resources), engines, tensor_parallel (a node's group worker),
models, partitioning, errors, meter."""
