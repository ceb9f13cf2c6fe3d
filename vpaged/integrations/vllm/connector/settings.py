"""ConnectorSettings: what `kv_connector_extra_config` may say to the vpaged connector, checked once.

    --kv-transfer-config '{"kv_connector": "VPagedConnector",
                           "kv_connector_module_path": "vpaged.integrations.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "kv"}}'

store: the page store's name ("NAME" in /dev/shm, "dir:PATH" kept across reboots), created on first use with
store_bytes of capacity (default 4 GiB) in pages of one layer's block; weights: the model weights' identity
when the one read from the model's files is not wanted (a name with its revision); map: hits map the store's
pages into vLLM's KV buffer when it is on vpaged memory (VPAGED_VLLM=1), instead of copying them (default
true). A key this connector does not know is an error: a misspelt option would otherwise be ignored silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....errors import InvalidArgumentError

DEFAULT_STORE_BYTES = 4 << 30
KNOWN_KEYS = ("store", "store_bytes", "weights", "map")


@dataclass(frozen=True)
class ConnectorSettings:
    store: str
    store_bytes: int = DEFAULT_STORE_BYTES
    weights: str = ""
    map_pages: bool = True

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> ConnectorSettings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KNOWN_KEYS))
        if unknown:
            raise InvalidArgumentError(
                f"kv_connector_extra_config has keys the vpaged connector does not know: {unknown} "
                f"(it knows {list(KNOWN_KEYS)})"
            )
        store = extra.get("store")
        if not isinstance(store, str) or not store:
            raise InvalidArgumentError(
                'the vpaged connector needs kv_connector_extra_config {"store": NAME}: the page store to share '
                f"(a name, or dir:PATH), got {store!r}"
            )
        size = extra.get("store_bytes", DEFAULT_STORE_BYTES)
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgumentError(f"kv_connector_extra_config store_bytes is a positive int, got {size!r}")
        weights = extra.get("weights", "")
        if not isinstance(weights, str):
            raise InvalidArgumentError(f"kv_connector_extra_config weights is a str, got {weights!r}")
        map_pages = extra.get("map", True)
        if not isinstance(map_pages, bool):
            raise InvalidArgumentError(f"kv_connector_extra_config map is true or false, got {map_pages!r}")
        return cls(store, size, weights, map_pages)
