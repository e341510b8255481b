"""Whether this machine runs the torch engine's native CPU kernels (built at install where a C++ compiler is), so
tests that count a node's bytes or its kernels' forms expect that path's, and hold on machines without it."""

import torch

from exo_like.engines.torch.quant import native_kernels

NATIVE = native_kernels(torch.device("cpu")) is not None
