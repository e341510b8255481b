"""Models on demand: the instances the cluster is asked to serve (a replicated set every node merges alike,
wishes.py), where each runs (partitioning/instances.py decides, manager.py), each one's plan agreement
(instance.py) and this node's part in it (runtime.py: an engine, a stage, a generator), keep_alive, making room,
the router of ring messages (router.py), the models' lifecycle the API drives (model_lifecycle.py), the node's
reports added up over its parts (reports.py) and its watchdogs (watchdogs.py).

May import: cluster, serving, engines, tensor_parallel, partitioning, models, errors."""
