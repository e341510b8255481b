"""The HTTP API every node serves: four dialects (OpenAI chat and completions in openai_api.py, its bodies parsed in
openai_requests.py; OpenAI Responses in responses_api.py; Anthropic Messages in anthropic_api.py; Ollama in
ollama_api.py and ollama_models.py) as thin adapters over one core: the dialect-neutral request each body becomes
(requests.py, with the fields the dialects share and tool use in tool_requests.py), and chat.py (the chat template
with tools, the grammar of structured output or a forced call), which starts the generations of a request's choices
(choices.py; one choice's in generation.py), reasoning and tool calls parsed back per model family (reasoning/,
tool_calls/). One request lifecycle and streaming path (lifecycle.py); routes.py assembles the app (the node's own
routes, --api-key, errors in each dialect's shape); instances_api.py loads and unloads models; /metrics renders
serving/metrics.

May import: the node it drives, serving, cluster, models, errors, and the dashboard package it mounts. Only cli
imports it."""
