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

Prefill/decode hand-off follows vLLM's kv_transfer_params protocol. A prefill request sent with
{"do_remote_decode": true} (a producer's) publishes, besides its full blocks, its last block that is not full
under a key of that exact prompt (fingerprint.py tail_key), and finishes with {"do_remote_prefill": true, ...}
for the proxy to pass on. A decode request carrying {"do_remote_prefill": true} (a consumer's) then matches its
whole prompt but the last token: the full blocks and that tail block, so it computes one token where a
plain hit computes up to a block. A page missing (evicted, never published) makes it a plain match: the rest is
computed, never waited for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ....memory.store import PageStore, StoreFingerprint, chain_keys, page_key, tail_key
from .metadata import BlockTransfer, VPagedConnectorMetadata
from .placement import BlockPlacement


@dataclass
class TrackedRequest:
    request: object
    keys: list[bytes] = field(default_factory=list)  # chain keys of its first len(keys) full blocks
    offered: int = 0  # blocks already sent to the worker to publish (or loaded from the store)
    tail_offered: bool = False  # a hand-off's last, partial block sent to publish


@dataclass
class SchedulerSideStats:
    queries: int = 0
    matched_tokens: int = 0
    loads: int = 0
    saves_planned: int = 0
    handoffs_out: int = 0  # prefill requests that finished with their whole prompt sent to publish
    handoffs_in: int = 0  # decode requests that found the whole prompt of their prefill
    handoff_computed_tokens: int = 0  # prompt tokens those requests computed themselves (1 each)


class SchedulerSide:
    def __init__(self, store: PageStore | None, fingerprint: StoreFingerprint | None, placement: BlockPlacement | None,
                 loads: bool, saves: bool):  # fmt: skip
        self.store, self.fingerprint, self.placement = store, fingerprint, placement
        self.active = store is not None
        self.loads_enabled, self.saves_enabled = loads and self.active, saves and self.active
        self.block_size = placement.block_size if placement else 0
        self.layers = len(placement.layers) if placement else 0
        self.tracked: dict[str, TrackedRequest] = {}
        # req id -> (first block, the keys of the blocks matched from there, whether the last is a hand-off's)
        self.matched: dict[str, tuple[int, list[bytes], bool]] = {}
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

    @staticmethod
    def handoff(request, flag: str) -> bool:
        """Whether the request's kv_transfer_params set `flag` (do_remote_decode / do_remote_prefill)."""
        params = getattr(request, "kv_transfer_params", None)
        return bool(isinstance(params, dict) and params.get(flag))

    def last_block_key(self, tracked: TrackedRequest) -> bytes:
        """The key of the block holding the prompt's last token: its chain key when full, else its tail key."""
        request, bs = tracked.request, self.block_size
        n = request.num_prompt_tokens
        full = self.block_keys(tracked, n // bs)
        if n % bs == 0:
            return full[-1]
        return tail_key(self.fingerprint, full[-1] if full else None, request.prompt_token_ids[(n // bs) * bs : n])

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
        handoff = self.handoff(request, "do_remote_prefill") and 1 < request.num_tokens == request.num_prompt_tokens
        if limit <= have and not handoff:  # (a hand-off may still have the last block to load)
            return 0, False
        tracked = self._tracked(request)
        keys = self.block_keys(tracked, max(limit, have))[have:]
        self.stats.queries += 1
        found = self.store.match(self.page_keys(keys)) // self.layers if keys else 0
        if found == len(keys) and handoff:
            # A decode instance's request: the prefill published the block of the prompt's last token too.
            last = self.last_block_key(tracked)
            if self.store.match(self.page_keys([last])) == self.layers:
                self.matched[request.request_id] = (have, [*keys, last], True)
                self.stats.handoffs_in += 1
                tokens = request.num_tokens - 1 - num_computed_tokens
                self.stats.matched_tokens += tokens
                return tokens, False
        self.matched[request.request_id] = (have, keys[:found], False)
        self.stats.matched_tokens += found * bs
        return found * bs, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if not self.active or not self.keyable(request):
            return
        tracked = self._tracked(request)
        first, keys, handoff = self.matched.pop(request.request_id, (0, [], False))
        if num_external_tokens <= 0 or not keys:
            return
        count = min(len(keys), -(-num_external_tokens // self.block_size))
        block_ids = blocks.get_block_ids()[0][first : first + count]
        last_written = handoff and count == len(keys)  # vLLM computes the last token into the last block
        if handoff:
            self.stats.handoff_computed_tokens += request.num_tokens - first * self.block_size - num_external_tokens
        self.pending_loads.append(BlockTransfer(request.request_id, list(block_ids), keys[:count], last_written))
        # The store has them: nothing to publish (a hand-off's last block counts once it is full).
        tracked.offered = max(tracked.offered, first + count - int(last_written))
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
        request, bs = tracked.request, self.block_size
        # The meta is built before the scheduler advances num_computed_tokens past this step's tokens.
        done = min(request.num_computed_tokens + scheduled, request.num_tokens)
        full = done // bs
        n = request.num_prompt_tokens
        tail = (
            not tracked.tail_offered and n % bs and done >= n and self.handoff(request, "do_remote_decode")
        )  # a prefill for a decode instance: the prompt's last block too, not full
        if full <= tracked.offered and not tail:
            return None
        block_ids = self.kv_cache_manager.get_blocks(req_id).get_block_ids()[0]
        full = min(full, len(block_ids))
        first = min(tracked.offered, full)
        ids, keys = list(block_ids[first:full]), self.block_keys(tracked, full)[first:full]
        tracked.offered = max(tracked.offered, full)
        if tail and n // bs < len(block_ids):
            ids.append(block_ids[n // bs])
            keys.append(self.last_block_key(tracked))
            tracked.tail_offered = True
        self.stats.saves_planned += len(ids)
        return BlockTransfer(req_id, ids, keys) if ids else None

    def request_finished(self, request) -> dict | None:
        """The kv_transfer_params the request finishes with: for a prefill sent for a decode instance, what
        that instance's request carries (the proxy passes it on); None otherwise."""
        tracked = self.tracked.pop(request.request_id, None)
        self.matched.pop(request.request_id, None)
        if not self.saves_enabled or not self.handoff(request, "do_remote_decode"):
            return None
        whole = request.num_prompt_tokens % self.block_size == 0
        published = bool(tracked and (tracked.tail_offered or whole))
        self.stats.handoffs_out += published
        return {"do_remote_prefill": True, "do_remote_decode": False, "vpaged_store": self.store.name,
                "vpaged_published": published}  # fmt: skip
