"""torch dtype <-> DLPack (code, bits) for the dtypes a KV cache holds."""

import torch

from ..errors import DTypeError

_DLPACK = {
    torch.float32: (2, 32),
    torch.float16: (2, 16),
    torch.bfloat16: (4, 16),
    torch.float64: (2, 64),
}


def dlpack_code(dtype: torch.dtype) -> tuple[int, int]:
    try:
        return _DLPACK[dtype]
    except KeyError:
        names = ", ".join(str(d).removeprefix("torch.") for d in _DLPACK)
        raise DTypeError(f"unsupported dtype {dtype}; vpaged caches hold {names}") from None


def itemsize(dtype: torch.dtype) -> int:
    return dlpack_code(dtype)[1] // 8
