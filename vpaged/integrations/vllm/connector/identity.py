"""The fingerprint of a vLLM engine's KV pages: what two engines must share for a page of one to serve the other.

Note (why files, not the loaded weights). The scheduler half of the connector computes keys (to tell vLLM how
many tokens the store holds) and may run in a process that never loads the model, so the weights' identity
is read from the model's files: the name and revision vLLM was given, and a digest of the model's
config.json and of every weight file's name, size, first and last 64 KiB. A fine-tune saved over a
checkpoint changes it; two copies of the same files anywhere give the same identity. It cannot tell apart
weight files that differ only between their first and last 64 KiB with the same size (the engine's own
`weights_identity` samples every tensor instead; `kv_connector_extra_config {"weights": ...}` names the
weights outright when neither is wanted). The KV geometry, the page size (block size, dtype), the KV cache
dtype, the platform (whose attention backend lays a page out) and the vLLM version go into the fingerprint as
well: any of them changes a page's bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ....memory.store import StoreFingerprint

SAMPLE_BYTES = 64 << 10
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def model_directory(model: str, revision: str | None) -> Path | None:
    """The local directory of `model`: the path itself, or its snapshot in the Hugging Face cache (never a
    download); None when there is neither."""
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not cached, hub package missing or offline: the name and revision must do
        return None


def files_digest(directory: Path) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"vpaged-vllm-wts")
    config = directory / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES):
        size = path.stat().st_size
        h.update(f"{path.relative_to(directory)}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(SAMPLE_BYTES))
            if size > SAMPLE_BYTES:
                f.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def weights_identity(model_config) -> str:
    model = str(model_config.model)
    revision = getattr(model_config, "revision", None)
    directory = model_directory(model, revision)
    digest = files_digest(directory) if directory is not None else "no-local-files"
    return f"{model}@{revision or 'default'}#{digest}"


def engine_fingerprint(vllm_config, kv_cache_config, placement, weights: str = "") -> StoreFingerprint:
    import vllm
    from vllm.platforms import current_platform

    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    cache_config = vllm_config.cache_config
    extra = {
        "engine": f"vllm-{getattr(vllm, '__version__', 'unknown')}",
        "platform": str(getattr(current_platform, "device_type", "unknown")),  # the backend's page layout
        "cache_dtype": str(getattr(cache_config, "cache_dtype", "auto")),
        "model_dtype": str(vllm_config.model_config.dtype),
        "spec": json.dumps(
            {k: str(getattr(spec, k, "")) for k in ("block_size", "num_kv_heads", "head_size", "dtype")},
            sort_keys=True,
        ),
    }
    return StoreFingerprint(
        weights=weights or weights_identity(vllm_config.model_config),
        num_layers=len(placement.layers),
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        layout=f"vllm-block{placement.block_size}",
        page_bytes=placement.page_bytes,
        kv_format=str(spec.dtype).replace("torch.", ""),
        extra=tuple(extra.items()),
    )
