"""`vpaged simulate`: KV memory of cache kinds at production scale, with the real caches on the
accounting backend (no memory mapped), driven by seeded or user traces."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError
from .kinds import BlockTables, CacheKind, StaticSlots, VirtualMemory
from .run import KindResult, simulate
from .shapes import SHAPES, ModelShape, model_shape
from .traces import BUILTIN, SimRequest, TraceError, builtin_trace, load_csv

__all__ = [
    "SHAPES",
    "BUILTIN",
    "ModelShape",
    "model_shape",
    "SimRequest",
    "TraceError",
    "builtin_trace",
    "load_csv",
    "simulate",
    "KindResult",
    "CacheKind",
    "kind_names",
    "make_kind",
    "SimConfig",
]

MiB = 1 << 20
KiB = 1 << 10


@dataclass(frozen=True)
class SimConfig:
    shape: ModelShape
    budget_bytes: int
    max_seq_len: int = 4096
    max_seqs: int = 4096  # sequence slots of the block and virtual caches (address space only)


def kind_names(sharing: bool) -> list[str]:
    """Every cache kind the simulator knows; '+share' variants only matter when requests share prefixes or
    sample n > 1."""
    names = ["static", "block 8", "block 16", "block 32"]
    for layout in ("per_layer", "interleaved", "head_major"):
        names += [f"vpaged {layout} 64 KiB", f"vpaged {layout} 2 MiB"]
    if sharing:
        names += ["block 16 +share", "vpaged interleaved 2 MiB +share", "vpaged per_layer 64 KiB +share"]
    return names


def make_kind(name: str, cfg: SimConfig) -> CacheKind:
    """The cache kind a name describes ('static', 'block 16', 'vpaged interleaved 2 MiB', '... +share')."""
    return _parse_kind(name, cfg, "cache kind")


def _parse_kind(name: str, cfg: SimConfig, noun: str) -> CacheKind:
    words = name.split()
    share = bool(words) and words[-1] == "+share"
    if share:
        words = words[:-1]
    if words == ["static"] and not share:
        return StaticSlots(cfg.shape, cfg.budget_bytes, cfg.max_seq_len)
    if len(words) == 2 and words[0] == "block" and words[1].isdigit():
        return BlockTables(cfg.shape, cfg.budget_bytes, cfg.max_seq_len, int(words[1]), share, cfg.max_seqs)
    if len(words) == 4 and words[0] == "vpaged" and words[2].isdigit() and words[3] in ("KiB", "MiB"):
        page = int(words[2]) * (KiB if words[3] == "KiB" else MiB)
        return VirtualMemory(cfg.shape, cfg.budget_bytes, cfg.max_seq_len, words[1], page, share, cfg.max_seqs)
    raise InvalidArgumentError(
        f"unknown {noun} {name!r}: cache kinds look like 'static', 'block 16', 'vpaged interleaved 2 MiB', "
        "with ' +share' for prefix sharing and forked samples"
    )


# The names of earlier releases, when the simulator called its cache kinds "policies" (scripts still use them).
Policy = CacheKind
PolicyResult = KindResult
policy_names = kind_names


def make_policy(name: str, cfg: SimConfig) -> CacheKind:
    """make_kind() under its earlier name (its errors say "unknown policy", as they did)."""
    return _parse_kind(name, cfg, "policy")
