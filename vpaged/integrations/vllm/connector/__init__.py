"""vLLM's KV connector on a vpaged page store (docs/vllm-connector.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "VPagedConnector",
        "kv_connector_module_path": "vpaged.integrations.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"store": "kv"}}'

settings.py: the extra config; placement.py: where a block's layer pages lie and when the connector declines;
identity.py: the fingerprint of an engine's pages; metadata.py: the per-step plan; scheduler_side.py and
worker_side.py: the two halves; vpaged_connector.py: the class vLLM loads (importing it imports vLLM).
"""

from .settings import ConnectorSettings

__all__ = ["VPagedConnector", "VPagedConnectorMetadata", "BlockTransfer", "ConnectorSettings"]


def __getattr__(name: str):
    # vLLM's names are imported on first use, so the settings (and vpaged without vLLM) import alone.
    if name == "VPagedConnector":
        from .vpaged_connector import VPagedConnector

        return VPagedConnector
    if name in ("VPagedConnectorMetadata", "BlockTransfer"):
        from . import metadata

        return getattr(metadata, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
