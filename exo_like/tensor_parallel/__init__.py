"""Tensor-parallel groups: several nodes run every layer of one stage together, each a slice of it
(models/tensor_split.py), adding their partial sums with the framework's own collectives (torch.distributed,
mx.distributed). Each rank runs in a worker process of its node's (worker.py), formed with the others' at spawn;
the node drives it through an Engine (process.py); the leader hands each step to its followers over an
authenticated control channel (control.py), in typed frames (messages.py).

May import: engines, models, cluster (the peer protocol's wire forms), errors."""
