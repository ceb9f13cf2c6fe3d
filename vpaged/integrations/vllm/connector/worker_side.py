"""The worker half of the connector: fill blocks from the store before a step's forward, publish after it.

A load pins every layer page of the request's matched blocks (the leading ones still published: a page may
be evicted between the scheduler's match and this pin). When vLLM's buffer is on vpaged memory (the plugin,
VPAGED_VLLM=1), its blocks own whole pages and vLLM's scheduler runs in this process, the pages are mapped
into the block in place of its own (backing.share_file_pages): no byte is copied, the block reads the
store's page cache pages, each checked against its crc32 where it is mapped, and the pins are held until the
block is released or handed out for other tokens (patches.py gives it pages of its own first). Otherwise
each page is read, checked and copied into the block, then unpinned. Blocks it could not fill (a page gone,
a checksum that fails, a store error) are reported to vLLM (get_block_ids_with_load_errors), which computes
their tokens again under kv_load_failure_policy "recompute" and fails the request under "fail" (vLLM's
default: set "recompute" in --kv-transfer-config to have a lost page cost only time). Publishing reads each
layer's page of a filled block out of vLLM's buffer into the store, after the forward that wrote it
(wait_for_save): the blocks the store already holds are skipped with one probe, and a full store (every page
pinned) or a store error costs only the pages not published.
"""

from __future__ import annotations

import ctypes
import logging
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ....errors import StoreError, StoreFullError, VPagedError
from ....memory.store import PUBLISHED, PageStore, page_key
from .metadata import BlockTransfer, VPagedConnectorMetadata
from .placement import BlockPlacement

logger = logging.getLogger("vpaged.integrations.vllm.connector")


@dataclass
class WorkerSideStats:
    """Counts of this worker: tokens and pages filled from the store, bytes copied and mapped for them, blocks that
    could not be filled (load_failures), pages published, pages found present, pages a full store refused,
    store errors."""

    loaded_tokens: int = 0
    loaded_pages: int = 0
    copied_bytes: int = 0
    mapped_bytes: int = 0
    load_failures: int = 0
    published_pages: int = 0
    present_pages: int = 0
    full: int = 0
    faults: int = 0


class WorkerSide:
    def __init__(
        self, store: PageStore | None, placement: BlockPlacement | None, loads: bool, saves: bool, map_pages=True
    ):
        self.store, self.placement = store, placement
        self.map_pages = map_pages
        self.backing = None  # vLLM's buffer when it is a vpaged range whose blocks can map store pages
        self.active = store is not None
        self.loads_enabled, self.saves_enabled = loads and self.active, saves and self.active
        self.layers = len(placement.layers) if placement else 0
        self.page_bytes = placement.page_bytes if placement else 0
        self.block_size = placement.block_size if placement else 0
        self._buffers: list[tuple[torch.Tensor, int, int]] = []  # per layer: (raw bytes, offset, block stride)
        self._load_errors: set[int] = set()
        self.stats = WorkerSideStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.active:
            return
        raws: dict[int, torch.Tensor] = {}
        buffers = []
        for layer in self.placement.layers:
            storage = kv_caches[layer.name].untyped_storage()
            raw = raws.get(storage.data_ptr())
            if raw is None:
                raw = raws[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            last = layer.offset + (self.placement.num_blocks - 1) * layer.block_stride + self.page_bytes
            if last > raw.numel():
                raise ValueError(f"layer {layer.name}: its last block ends at byte {last}, past its {raw.numel()}")
            buffers.append((raw, layer.offset, layer.block_stride))
        self._buffers = buffers
        self.backing = self._mappable_backing(raws)

    def _mappable_backing(self, raws: dict[int, torch.Tensor]):
        """The plugin's backing of vLLM's KV buffer (VPAGED_VLLM=1) when hits can map store pages into it."""
        if not self.map_pages:
            return None
        from ..patches import STATE

        backing = STATE.backing
        if backing is None or list(raws) != [backing.address] or not backing.can_share_file_pages(self.page_bytes):
            return None
        return backing

    def page(self, layer: int, block: int) -> torch.Tensor:
        """Layer `layer`'s page of vLLM block `block`: a uint8 view into vLLM's buffer."""
        raw, offset, stride = self._buffers[layer]
        start = offset + block * stride
        return raw[start : start + self.page_bytes]

    def page_keys(self, block_key: bytes) -> list[bytes]:
        return [page_key(block_key, layer) for layer in range(self.layers)]

    # ----------------------------------------------------------------------------------------------- load
    def load(self, meta: VPagedConnectorMetadata) -> None:
        if not self.loads_enabled:
            return
        for transfer in meta.loads:
            filled = self._fill(transfer)
            if filled < len(transfer.block_ids):
                self.stats.load_failures += len(transfer.block_ids) - filled
                self._load_errors.update(transfer.block_ids[filled:])
            self.stats.loaded_tokens += filled * self.block_size

    def _fill(self, transfer: BlockTransfer) -> int:
        """Fill the transfer's blocks from the first on; returns how many were filled whole."""
        keys = [k for b in transfer.block_keys for k in self.page_keys(b)]
        try:
            handles = self.store.pin(keys)
        except StoreError as e:
            self._fault("pin", e)
            return 0
        maps = self._maps_now()
        whole = len(handles) // self.layers
        for h in handles[whole * self.layers :]:
            h.release()
        filled = 0
        for i, block in enumerate(transfer.block_ids[:whole]):
            mine = handles[i * self.layers : (i + 1) * self.layers]
            # A block vLLM writes into next (a hand-off's last) is copied: its mapping would be copied anyway.
            last_written = transfer.last_written and i == len(transfer.block_ids) - 1
            if not (self._map_block(block, mine) if maps and not last_written else self._copy_block(block, mine)):
                for h in handles[(i + 1) * self.layers : whole * self.layers]:
                    h.release()
                break
            filled += 1
        return filled

    def _maps_now(self) -> bool:
        """Whether hits map: on the plugin's backing, and only where vLLM's block pool is in this process. The
        plugin learns that a block was freed or handed out again from the block pool's hooks; where the
        scheduler runs in another process (vLLM's multiprocess executor, which `vllm serve` on the CPU always
        uses), it never would, and a block's store pages would stay pinned and be written through (privately)
        by the next tokens vLLM puts there. Copying is always right."""
        if self.backing is None:
            return False
        from ..patches import STATE

        return STATE.pool_for(self.backing) is not None

    def _copy_block(self, block: int, handles) -> bool:
        """Copy the block's pages out of the store (each checked against its crc32), then unpin them."""
        try:
            for layer, handle in enumerate(handles):
                self._write_page(self.page(layer, block), handle.read(verify=True))
        except StoreError as e:  # a checksum that fails, a damaged file: the rest is computed
            self._fault("read", e)
            return False
        finally:
            for h in handles:
                h.release()
        self.stats.loaded_pages += self.layers
        self.stats.copied_bytes += self.layers * self.page_bytes
        return True

    def _map_block(self, block: int, handles) -> bool:
        """Map the block's store pages in place of its own (no copy), checked against their crc32 where they
        are mapped; the pins are held until the backing unmaps them (the block freed, or handed out again)."""
        backing = self.backing
        layers = self.placement.layers
        spans = [(layers[i].offset + block * layers[i].block_stride, h.offset) for i, h in enumerate(handles)]

        def unpin() -> None:
            for h in handles:
                h.release()

        faults = backing.pool.file_page_faults
        try:
            backing.share_file_pages(block, spans, self.page_bytes, self.store.data_fd, unpin)
        except (StoreError, VPagedError) as e:  # the data file cut short, out of mappings: computed instead
            unpin()
            self._fault("map", e)
            return False
        base = backing.address
        bad = any(
            zlib.crc32((ctypes.c_char * self.page_bytes).from_address(base + at)) != h.crc
            for (at, _), h in zip(spans, handles)
        )
        if bad or backing.pool.file_page_faults != faults:
            backing.replace_file_pages([block])  # its own pages again; unpins
            self._fault("map", StoreError("a mapped page fails its checksum"))
            return False
        self.stats.loaded_pages += self.layers
        self.stats.mapped_bytes += self.layers * self.page_bytes
        return True

    @staticmethod
    def _write_page(dst: torch.Tensor, data: bytes) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        if dst.device.type == "cpu":
            dst.numpy()[:] = src
        else:
            dst.copy_(torch.from_numpy(src.copy()), non_blocking=False)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ----------------------------------------------------------------------------------------------- save
    def save(self, meta: VPagedConnectorMetadata) -> None:
        if not self.saves_enabled:
            return
        for transfer in meta.saves:
            for block, block_key in zip(transfer.block_ids, transfer.block_keys):
                if not self._publish_block(block, block_key):
                    break

    def _publish_block(self, block: int, block_key: bytes) -> bool:
        """Publish every layer page of one block; False when the store cannot take more now."""
        keys = self.page_keys(block_key)
        try:
            if self.store.match(keys) == len(keys):
                self.stats.present_pages += len(keys)
                return True
            for layer, key in enumerate(keys):
                page = self.page(layer, block)
                data = page.numpy() if page.device.type == "cpu" else page.cpu().numpy()
                if self.store.publish(key, data) == PUBLISHED:
                    self.stats.published_pages += 1
                else:
                    self.stats.present_pages += 1
        except StoreFullError:
            self.stats.full += 1
            return False
        except StoreError as e:
            self._fault("publish", e)
            return False
        return True

    def _fault(self, what: str, error: Exception) -> None:
        self.stats.faults += 1
        if self.stats.faults <= 3:
            logger.warning("vpaged connector: store %s failed (%s); those tokens are computed", what, error)
