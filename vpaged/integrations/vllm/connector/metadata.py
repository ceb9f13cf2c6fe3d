"""What the scheduler half tells the worker half each step: which blocks to fill from the store, which to publish.

Plain data (block ids and keys), pickled by vLLM when the worker runs in another process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class BlockTransfer:
    """Blocks of one request and the chain key of each (memory/store/fingerprint.py): a load fills vLLM's
    `block_ids[i]` with the store's pages of `block_keys[i]`; a save publishes them."""

    req_id: str
    block_ids: list[int]
    block_keys: list[bytes]
    last_written: bool = False  # a load whose last block vLLM writes into next (a hand-off's): copied, not mapped

    def __post_init__(self):
        if len(self.block_ids) != len(self.block_keys):
            raise ValueError(f"{len(self.block_ids)} blocks with {len(self.block_keys)} keys")


@dataclass
class VPagedConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
