"""The PyTorch engine (CUDA, MPS, CPU): the decoder shard, quantized matrices (native/: its own CPU kernels
and one-call decode step; torch's int4 kernel otherwise), OpenMP settings, one-layer timing.

May import: engines, models, errors."""
