"""Hidden states as bytes + dtype + shape: exact round-trips, bfloat16 included, and bad payloads refused."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from exo_like.engines.activations import Activations


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_roundtrip_through_msgpack_is_bit_exact(dtype: torch.dtype) -> None:
    tensor = torch.randn(5, 7).to(dtype)
    name = str(dtype).removeprefix("torch.")
    bits = tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32).numpy()
    acts = Activations(name, tuple(tensor.shape), bits.tobytes())
    back = Activations.from_wire(msgpack.unpackb(msgpack.packb(acts.to_wire())))
    assert back == acts
    restored = torch.from_numpy(back.bits().copy())
    restored = restored.view(dtype) if dtype != torch.float32 else restored
    assert torch.equal(restored, tensor)


def test_payload_size_must_match_shape() -> None:
    with pytest.raises(ValueError, match="bytes"):
        Activations("float32", (2, 3), b"\0" * 20)


def test_unknown_dtype_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        Activations("int8", (1,), b"\0")


def test_bits_view_is_read_only() -> None:
    acts = Activations("float32", (2,), np.array([1.0, 2.0], dtype=np.float32).tobytes())
    view = acts.bits()
    assert view.tolist() == [1.0, 2.0]
    with pytest.raises(ValueError):
        view[0] = 3.0
