"""The HTTP API every node serves: four dialects (OpenAI chat and completions in routes.py, OpenAI Responses,
Anthropic Messages, Ollama) as thin adapters over one core (chat.py: the chat template with tools, the grammar of
structured output or a forced call, the generations of a request's choices, tool calls parsed back per model family
in tool_calls/), with one request lifecycle and streaming path (lifecycle.py); /metrics renders serving/metrics.

May import: the node it drives, serving, cluster, models, errors, and the dashboard package it mounts. Only cli
imports it."""
