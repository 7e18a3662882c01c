"""Tensor codec: ``{dtype, shape, data}`` with raw little-endian bytes, no per-element loop.

bfloat16 has no numpy dtype, so it travels as its int16 bit pattern and is viewed back.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np
import torch

from shared.errors import ProtocolError


class TensorDict(TypedDict):
    """A tensor on the wire."""

    dtype: str
    """Torch dtype name without the ``torch.`` prefix (``float32``, ``bfloat16``, ``int64``...)."""
    shape: list[int]
    """Dimensions, row-major."""
    data: bytes
    """The elements, little-endian, C order."""


# name -> (torch dtype, numpy dtype of the raw bytes)
_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float64": (torch.float64, np.dtype("<f8")),
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<i2")),
    "int64": (torch.int64, np.dtype("<i8")),
    "int32": (torch.int32, np.dtype("<i4")),
    "int16": (torch.int16, np.dtype("<i2")),
    "int8": (torch.int8, np.dtype("i1")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "bool": (torch.bool, np.dtype("?")),
}
_NAMES = {torch_dtype: name for name, (torch_dtype, _) in _DTYPES.items()}
MAX_DIMS = 8


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} cannot be sent") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name][0]
    except KeyError:
        raise ProtocolError(f"unknown tensor dtype {name!r}") from None


def encode_tensor(tensor: torch.Tensor) -> TensorDict:
    """Wire form of ``tensor`` (moved to CPU, made contiguous)."""
    name = dtype_name(tensor.dtype)
    t = tensor.detach().cpu().contiguous()
    if name == "bfloat16":
        t = t.view(torch.int16)
    return {"dtype": name, "shape": list(tensor.shape), "data": t.numpy().tobytes()}


def decode_tensor(obj: object) -> torch.Tensor:
    """Tensor from its wire form; raises ``ProtocolError`` on anything inconsistent."""
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise ProtocolError("a tensor must be a map with keys dtype, shape and data")
    name, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if not isinstance(name, str) or name not in _DTYPES:
        raise ProtocolError(f"unknown tensor dtype {name!r}")
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and d >= 0 for d in shape)
    ):
        raise ProtocolError(f"bad tensor shape {shape!r}")
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError("tensor data must be bytes")
    torch_t, np_t = _DTYPES[name]
    if math.prod(shape) * np_t.itemsize != len(data):
        raise ProtocolError(
            f"tensor of shape {list(shape)} and dtype {name} needs "
            f"{math.prod(shape) * np_t.itemsize} bytes, got {len(data)}"
        )
    # A bytearray gives a writable buffer: torch warns on (and must not write to) read-only ones.
    array = np.frombuffer(bytearray(data), dtype=np_t).reshape(shape)
    tensor = torch.from_numpy(array)
    return tensor.view(torch_t) if name == "bfloat16" else tensor
