"""vpaged.serve.stores: where the engine keeps its sequences' K/V (see base.py for the contract)."""

from .stores import KV_KINDS, PagedStore, StepAttention, VirtualStore

__all__ = ["KV_KINDS", "StepAttention", "VirtualStore", "PagedStore"]
