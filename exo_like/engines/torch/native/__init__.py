"""Native CPU kernels of the torch engine: quantized matrix products from affine groups' stored codes (quant.cpp),
built once per torch version and CPU kind into a cache on disk (build.py), and the packed matrix they take
(matrix.py). Without a C++ compiler the engine runs torch's own kernels instead and says so once.

May import: engines.torch (not its model), models."""
