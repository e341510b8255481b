"""The HTTP API every node serves: OpenAI routes, request parsing, response shapes; /metrics renders serving/metrics.

May import: the node it drives, serving, cluster, models, errors, and the dashboard package it mounts. Only cli
imports it."""
