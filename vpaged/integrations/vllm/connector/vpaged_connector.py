"""VPagedConnector: vLLM's KV connector (v1 API) on a vpaged page store, for prefix reuse across instances.

Every vLLM instance started with the connector and the same store name shares one set of prefix pages: a
prompt whose leading blocks another instance (or this one before a restart, with a `dir:` store) computed
starts with those tokens present. vLLM builds one connector per role: the scheduler's (scheduler_side.py:
matching, the per-step plan) and each worker's (worker_side.py: the loads and publishes); this class hands
each call to its half. kv_role "kv_both" loads and publishes, "kv_producer" only publishes, "kv_consumer"
only loads. The engine is checked once at construction: another vLLM than guard.SUPPORTED_VLLM_VERSIONS is
refused (VersionUnsupportedError), a hybrid model, tensor or pipeline parallelism are declined with one
warning (the connector then does nothing and vLLM runs as without it).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ....errors import VersionUnsupportedError
from ....memory.store import PageStore
from ..guard import SUPPORTED_VLLM_VERSIONS, version_supported, warn_once
from .identity import engine_fingerprint
from .metadata import VPagedConnectorMetadata
from .placement import BlockPlacement, decline_reason
from .scheduler_side import SchedulerSide
from .settings import ConnectorSettings
from .worker_side import WorkerSide

logger = logging.getLogger("vpaged.integrations.vllm.connector")


class VPagedConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        import vllm

        version = getattr(vllm, "__version__", "unknown")
        if not version_supported(version):
            raise VersionUnsupportedError(
                f"the vpaged connector runs on vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}, this is vLLM {version}"
            )
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        loads, saves = bool(transfer.is_kv_consumer), bool(transfer.is_kv_producer)
        parallel = vllm_config.parallel_config
        why = decline_reason(kv_cache_config, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.store: PageStore | None = None
        placement = fingerprint = None
        if why is not None:
            warn_once("connector:" + why, f"the vpaged connector does nothing for this engine: {why}")
        else:
            placement = BlockPlacement.of(kv_cache_config)
            fingerprint = engine_fingerprint(vllm_config, kv_cache_config, placement, self.settings.weights)
            self.store = PageStore.open(
                self.settings.store,
                create=True,
                capacity_pages=max(1, self.settings.store_bytes // placement.page_bytes),
                page_bytes=placement.page_bytes,
            )
        self.placement, self.fingerprint = placement, fingerprint
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(self.store, fingerprint, placement, loads, saves)
            self.worker_side = None
        else:
            self.scheduler_side = None
            self.worker_side = WorkerSide(self.store, placement, loads, saves, self.settings.map_pages)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a save lost to a preemption is a later miss, never a wrong token

    # ----------------------------------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, VPagedConnectorMetadata)
        self.worker_side.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv filled every layer before the forward began

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # published per block in wait_for_save, once every layer of the step is written

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, VPagedConnectorMetadata)
        self.worker_side.save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    # -------------------------------------------------------------------------------------- scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> VPagedConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, self.scheduler_side.request_finished(request)

    # ---------------------------------------------------------------------------------------------- both
    def shutdown(self) -> None:
        if self.worker_side is not None and self.worker_side.active:
            logger.info("vpaged connector: %s", self.worker_side.stats)
        if self.store is not None:
            self.store.close()
            self.store = None
