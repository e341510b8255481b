"""The PyTorch engine (CUDA, MPS, CPU): the decoder shard, reading its tensors (loading.py), quantized and 16-bit
matrices (native/: its own CPU kernels and one-call decode step; torch's int4 kernel otherwise), OpenMP settings,
one-layer timing.

May import: engines, models, errors."""
