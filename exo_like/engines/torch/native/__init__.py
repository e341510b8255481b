"""Native CPU kernels of the torch engine: quantized matrix products from affine groups' stored codes (quant.cpp),
products with 16-bit float matrices widened to float32 (half.cpp), a Llama-family shard's decode step as one call
(decode.cpp), built once per torch version and CPU kind into a cache on disk (build.py), and the matrices they take
(matrix.py; decode.py registers a shard's layers). Without a C++ compiler the engine runs torch's own kernels
instead and says so once.

May import: engines.torch (not its model), models."""
