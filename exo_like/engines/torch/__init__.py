"""The PyTorch engine (CUDA, MPS, CPU): the decoder shard, int4 quantized matrices, OpenMP settings, one-layer timing.

May import: engines, models, errors."""
