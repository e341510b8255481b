"""The torch engine's quantized matrices on CUDA: held in their stored bits on the GPU (matrix.py) and multiplied by
Triton kernels that dequantize as they read (kernels.py)."""
