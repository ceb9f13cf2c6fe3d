"""Devices and backends: which backends are usable here, and why CUDA is not when it is not."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _C
from ..errors import BackendUnavailableError, InvalidArgumentError

HOST_PAGE_SIZE = 64 * 1024  # ≥ 64 KiB keeps host mappings far from vm.max_map_count
CUDA_PAGE_SIZE = 2 * 1024 * 1024  # VMM granularity on A100/H100/H200 (the driver is asked where there is one)


@dataclass(frozen=True)
class BackendInfo:
    name: str
    usable: bool
    reason: str  # why not usable ("" when usable)
    granularity: int  # smallest page size in bytes (0 when unusable)
    devices: int


def backends() -> dict[str, BackendInfo]:
    """The backends of this build and machine. Touches the CUDA driver only through a dlopen probe."""
    cuda_reason = _C.cuda_unavailable_reason(0)
    return {
        "cpu": BackendInfo("cpu", True, "", _host_granularity(), 1),
        "cuda": BackendInfo(
            "cuda",
            cuda_reason == "",
            cuda_reason,
            _C.cuda_granularity(0) if cuda_reason == "" else 0,
            _C.cuda_device_count() if cuda_reason == "" else 0,
        ),
    }


def _host_granularity() -> int:
    import mmap

    return mmap.PAGESIZE


def normalize_device(device) -> torch.device:
    """torch.device for 'cpu', 'cuda', 'cuda:N' (an index is always filled in for CUDA)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(f"not a device: {device!r}") from e
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        return torch.device("cuda", 0 if dev.index is None else dev.index)
    raise InvalidArgumentError(f"vpaged supports devices 'cpu' and 'cuda[:N]', not {device!r}")


def default_page_size(device: torch.device) -> int:
    if device.type == "cpu":
        return HOST_PAGE_SIZE
    gran = _C.cuda_granularity(device.index)
    if gran == 0:
        reason = _C.cuda_unavailable_reason(device.index) or "CUDA is unavailable"
        raise BackendUnavailableError(f"cannot use {device}: {reason}")
    return gran


def make_backend(device: torch.device, page_size: int, capacity_pages: int, reserve_pages: int = 0):
    if device.type == "cpu":
        return _C.host_backend(page_size, capacity_pages)
    reason = _C.cuda_unavailable_reason(device.index)
    if reason:
        raise BackendUnavailableError(f"cannot use {device}: {reason}")
    return _C.cuda_backend(device.index, page_size, capacity_pages, reserve_pages)
