"""The scheduler half of the connector: how many prompt tokens the store holds, and which blocks move each step.

Matching: the full blocks of a request's tokens, past the ones vLLM's own prefix cache already has, whose
every layer page is published in the store now (a probe: no pin, so nothing is held for a request that may
never be scheduled). At most (tokens - 1) // block_size blocks: vLLM must compute at least one token of a
prompt to sample from it. The keys are the store's own chain over token ids (fingerprint.py), not vLLM's
block hashes: vLLM seeds those at random in every process unless PYTHONHASHSEED is set, so two instances,
or one instance and its restart, would never agree on them.

Loading is synchronous (the worker copies or maps the pages before the step's forward), so a hit costs no
extra scheduler step. Publishing is too: every step, the blocks a request fills (prompt or generated tokens)
are published by the worker after the forward that wrote them (wait_for_save), so request_finished holds no
block back. A request with a LoRA adapter, multimodal inputs or a cache salt is left to vLLM's own cache:
its pages depend on more than the token ids the keys chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ....memory.store import PageStore, StoreFingerprint, chain_keys, page_key
from .metadata import BlockTransfer, VPagedConnectorMetadata
from .placement import BlockPlacement


@dataclass
class TrackedRequest:
    request: object
    keys: list[bytes] = field(default_factory=list)  # chain keys of its first len(keys) full blocks
    offered: int = 0  # blocks already sent to the worker to publish (or loaded from the store)


@dataclass
class SchedulerSideStats:
    queries: int = 0
    matched_tokens: int = 0
    loads: int = 0
    saves_planned: int = 0


class SchedulerSide:
    def __init__(self, store: PageStore | None, fingerprint: StoreFingerprint | None, placement: BlockPlacement | None,
                 loads: bool, saves: bool):  # fmt: skip
        self.store, self.fingerprint, self.placement = store, fingerprint, placement
        self.active = store is not None
        self.loads_enabled, self.saves_enabled = loads and self.active, saves and self.active
        self.block_size = placement.block_size if placement else 0
        self.layers = len(placement.layers) if placement else 0
        self.tracked: dict[str, TrackedRequest] = {}
        self.matched: dict[str, tuple[int, int]] = {}  # req id -> (first block, blocks) of the last match
        self.pending_loads: list[BlockTransfer] = []
        self.kv_cache_manager = None
        self.stats = SchedulerSideStats()

    # ------------------------------------------------------------------------------------------------ keys
    @staticmethod
    def keyable(request) -> bool:
        return not (
            getattr(request, "lora_request", None) or getattr(request, "mm_features", None)
            or getattr(request, "cache_salt", None)
        )  # fmt: skip

    def block_keys(self, tracked: TrackedRequest, blocks: int) -> list[bytes]:
        if len(tracked.keys) < blocks:
            tokens = tracked.request.all_token_ids
            bs = self.block_size
            tracked.keys = chain_keys(self.fingerprint, (tokens[i * bs : (i + 1) * bs] for i in range(blocks)))
        return tracked.keys[:blocks]

    def page_keys(self, block_keys: list[bytes]) -> list[bytes]:
        return [page_key(k, layer) for k in block_keys for layer in range(self.layers)]

    def _tracked(self, request) -> TrackedRequest:
        t = self.tracked.get(request.request_id)
        if t is None or t.request is not request:
            t = self.tracked[request.request_id] = TrackedRequest(request)
        return t

    # ---------------------------------------------------------------------------------------- vLLM's calls
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.loads_enabled or not self.keyable(request):
            return 0, False
        bs = self.block_size
        have, limit = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        if limit <= have:
            return 0, False
        keys = self.block_keys(self._tracked(request), limit)
        self.stats.queries += 1
        found = self.store.match(self.page_keys(keys[have:limit])) // self.layers
        self.matched[request.request_id] = (have, found)
        self.stats.matched_tokens += found * bs
        return found * bs, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if not self.active or not self.keyable(request):
            return
        tracked = self._tracked(request)
        first, found = self.matched.pop(request.request_id, (0, 0))
        if num_external_tokens <= 0 or found == 0:
            return
        count = min(found, -(-num_external_tokens // self.block_size))
        block_ids = blocks.get_block_ids()[0][first : first + count]
        keys = self.block_keys(tracked, first + count)[first:]
        self.pending_loads.append(BlockTransfer(request.request_id, list(block_ids), keys))
        tracked.offered = max(tracked.offered, first + count)  # the store has them: nothing to publish
        self.stats.loads += 1

    def build_connector_meta(self, scheduler_output) -> VPagedConnectorMetadata:
        meta = VPagedConnectorMetadata(loads=self.pending_loads)
        self.pending_loads = []
        if self.saves_enabled and self.kv_cache_manager is not None:
            for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
                save = self._blocks_filled(req_id, scheduled)
                if save is not None:
                    meta.saves.append(save)
        return meta

    def _blocks_filled(self, req_id: str, scheduled: int) -> BlockTransfer | None:
        """The full blocks of `req_id` whose last token this step computes and that were never offered."""
        tracked = self.tracked.get(req_id)
        if tracked is None:
            return None
        request = tracked.request
        # The meta is built before the scheduler advances num_computed_tokens past this step's tokens.
        done = min(request.num_computed_tokens + scheduled, request.num_tokens)
        full = done // self.block_size
        if full <= tracked.offered:
            return None
        block_ids = self.kv_cache_manager.get_blocks(req_id).get_block_ids()[0]
        full = min(full, len(block_ids))
        first = tracked.offered
        keys = self.block_keys(tracked, full)[first:full]
        tracked.offered = full
        self.stats.saves_planned += full - first
        return BlockTransfer(req_id, list(block_ids[first:full]), keys)

    def request_finished(self, request) -> None:
        self.tracked.pop(request.request_id, None)
        self.matched.pop(request.request_id, None)
