"""Where one layer's page of one vLLM block lies in memory, and what keeps the connector from taking part.

vLLM (0.32) describes its KV buffers as KVCacheTensor records: layer `layers[i]`'s page of block b starts at
`offset + i * layer_stride + b * block_stride` bytes into the tensor's allocation, and is the spec's
`page_size_bytes` long (K and V of the block's tokens, in the attention backend's order). That page is the
unit the connector moves: one store page per (block, layer), keyed by the block's chain key and the layer's
position (memory/store/fingerprint.py page_key). The bytes are copied or mapped as they are; the connector
never needs to know the order of heads, tokens and K/V inside a page, only that two instances of the same
model, dtype and block size write the same bytes for the same tokens (the fingerprint says which do).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..guard import layout_refusal, parallel_refusal


@dataclass(frozen=True)
class LayerPlacement:
    """One layer: the tensor's allocation it lives in (by the layer name vLLM registers it under), the byte
    offset of its block 0 there and the bytes from one block to the next."""

    name: str
    offset: int
    block_stride: int


@dataclass(frozen=True)
class BlockPlacement:
    """All layers of the one KV cache group, in vLLM's layer order (the order of the store pages of a block)."""

    layers: tuple[LayerPlacement, ...]
    page_bytes: int
    block_size: int
    num_blocks: int

    @classmethod
    def of(cls, kv_cache_config) -> BlockPlacement:
        group = kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        where: dict[str, LayerPlacement] = {}
        for t in kv_cache_config.kv_cache_tensors:
            for i, name in enumerate(t.layers):
                where[name] = LayerPlacement(name, t.offset + i * t.layer_stride, t.block_stride)
        layers = tuple(where[name] for name in group.layer_names if name in where)
        return cls(layers, int(spec.page_size_bytes), int(spec.block_size), int(kv_cache_config.num_blocks))


def decline_reason(kv_cache_config, tensor_parallel: int, pipeline_parallel: int) -> str | None:
    """Why the connector stays out of this engine (it then matches nothing and saves nothing), or None.

    One group of full attention only: a hybrid model's other groups (sliding window, Mamba state) are not
    prefix pages a store can hand over, and vLLM requires a connector without hybrid support to decline them.
    One worker only: with tensor or pipeline parallelism each worker holds a shard of every page, and the
    store's pages are whole pages."""
    refusal = layout_refusal(kv_cache_config)
    if refusal is None and kv_cache_config.kv_cache_tensors:
        placement = BlockPlacement.of(kv_cache_config)
        if len(placement.layers) != len(kv_cache_config.kv_cache_groups[0].layer_names):
            refusal = "a layer of the KV cache group has no KV tensor"
    return refusal or parallel_refusal(tensor_parallel, pipeline_parallel)
