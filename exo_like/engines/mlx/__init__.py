"""The MLX engine (Metal, or CPU on Linux): the decoder shard and one-layer timing.

May import: engines, models, errors."""
