"""Models on demand: the instances the cluster is asked to serve (a replicated set every node merges alike), where
each runs (partitioning/instances.py decides), and which idle ones go to make room.

May import: cluster, partitioning, models, errors."""
