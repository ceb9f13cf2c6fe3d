"""torch dtype <-> DLPack (code, bits) for the dtypes a KV cache holds."""

import torch

from ..errors import DTypeError

_DLPACK = {
    torch.float32: (2, 32),
    torch.float16: (2, 16),
    torch.bfloat16: (4, 16),
    torch.float64: (2, 64),
}
# Bytes: what the memory layers see of a quantized cache (vpaged/kvcache/formats.py).
_STORAGE = {**_DLPACK, torch.uint8: (1, 8)}


def dlpack_code(dtype: torch.dtype) -> tuple[int, int]:
    try:
        return _DLPACK[dtype]
    except KeyError:
        names = ", ".join(str(d).removeprefix("torch.") for d in _DLPACK)
        raise DTypeError(f"unsupported dtype {dtype}; vpaged caches hold {names}") from None


def itemsize(dtype: torch.dtype) -> int:
    return dlpack_code(dtype)[1] // 8


def storage_dlpack_code(dtype: torch.dtype) -> tuple[int, int]:
    """dlpack_code(), and bytes (uint8) for the rows of a quantized cache."""
    return _STORAGE[dtype] if dtype in _STORAGE else dlpack_code(dtype)
