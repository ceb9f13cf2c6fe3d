"""vpaged.serve.stores: where the engine keeps its sequences' K/V (see base.py for the contract).

make_store(config, geometry, max_seq_len) builds the store of config.kv; every store class implements the
whole KVStore protocol, so the engine, the scheduler and the runner never test which kind they hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...kvcache.geometry import KVGeometry
from .attention import StepAttention
from .base import KV_KINDS, Allocation, KVStore, StoreMemory
from .paged import PagedStore
from .static import StaticStore
from .virtual import VirtualStore

if TYPE_CHECKING:
    from ..config import EngineConfig

STORES: dict[str, type] = {"vpaged": VirtualStore, "paged": PagedStore, "static": StaticStore}
assert tuple(STORES) == KV_KINDS


def make_store(config: EngineConfig, geometry: KVGeometry, max_seq_len: int, weights: str = "") -> KVStore:
    """The store of kind config.kv for a model of `geometry`, sequences of at most max_seq_len tokens. weights:
    the model weights' identity (serve/weights_identity.py), what a prefix_store keys pages by."""
    if getattr(config.store, "prefix_store", None) is not None:
        return STORES[config.kv](config, geometry, max_seq_len, weights=weights)
    return STORES[config.kv](config, geometry, max_seq_len)


__all__ = [
    "KV_KINDS",
    "STORES",
    "KVStore",
    "StoreMemory",
    "Allocation",
    "StepAttention",
    "VirtualStore",
    "PagedStore",
    "StaticStore",
    "make_store",
]
