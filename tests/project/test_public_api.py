"""The public API: the names users import from vpaged, vpaged.ops, vpaged.hf and vpaged.serve, and the
console script. A name dropped or moved out of these faces fails here (the layout of the package behind
them may change; these may not, short of a release note)."""

import importlib
import importlib.metadata

import pytest

PUBLIC = {
    "vpaged": [
        "VirtualKVCache",
        "PagedKVCache",
        "PagePool",
        "PoolStats",
        "CacheStats",
        "PagedCacheStats",
        "BatchedKV",
        "Layout",
        "KVGeometry",
        "default_pool",
        "set_default_pool",
        "backends",
        "BackendInfo",
        "build_info",
        "torch_allocator",
        "TorchAllocator",
        "AllocatorStats",
        "empty",
        "ops",
        "__version__",
        "VPagedError",
        "OutOfPagesError",
        "MappingLimitError",
        "AddressSpaceError",
        "MappingLimitWarning",
        "BackendError",
        "BackendUnavailableError",
        "InvalidArgumentError",
        "UnknownSequenceError",
        "SequenceTooLongError",
        "SlotsExhaustedError",
        "LayerIndexError",
        "CacheClosedError",
        "ViewsAliveError",
        "DTypeError",
        "ShapeError",
        "SwapSpaceFullError",
        "SequenceSwappedError",
        "ReadOnlyTokensError",
        "PromptTooLongError",
        "UnknownRequestError",
    ],
    "vpaged.errors": ["VPagedError", "OutOfPagesError", "InvalidArgumentError", "ShapeError", "DTypeError"],
    "vpaged.ops": [
        "DecodePlan",
        "decode_attention",
        "decode_attention_contiguous",
        "decode_attention_paged",
        "decode_attention_reference",
        "batched_kv_from_tensors",
        "write_kv",
        "WritePlan",
        "plan_cuda_splits",
        "PanelWeight",
        "pack_panels",
        "panel_linear",
    ],
    "vpaged.hf": [
        "VPagedCache",
        "VPagedCacheConfig",
        "VPagedLayer",
        "KVGroup",
        "WindowGroup",
        "cache_kwargs",
        "cache_keyword",
        "register_attention",
        "support_status",
        "layer_plan",
    ],  # fmt: skip
    "vpaged.serve": [
        "LLM",
        "LLMEngine",
        "SamplingParams",
        "RequestOutput",
        "CompletionOutput",
        "RequestMetrics",
        "EngineStats",
        "load_model",
        "RANDOM_CONFIGS",
        "EngineConfig",
        "SchedulerConfig",
        "StoreConfig",
        "VirtualStoreConfig",
        "StaticStoreConfig",
        "PagedStoreConfig",
        "ModelConfig",
        "ParallelConfig",
    ],
}
NEEDS = {"vpaged.hf": "transformers", "vpaged.serve": "transformers"}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_import(module):
    if module in NEEDS:
        pytest.importorskip(NEEDS[module])
    mod = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(mod, name)]
    assert missing == []
    for name in PUBLIC[module]:
        exec(f"from {module} import {name}", {})  # the way users write it


def test_error_classes_are_vpaged_errors_and_builtins():
    import vpaged

    for name in PUBLIC["vpaged"]:
        value = getattr(vpaged, name)
        if isinstance(value, type) and issubclass(value, Exception) and not issubclass(value, Warning):
            assert issubclass(value, vpaged.VPagedError), name
            if value is vpaged.VPagedError:
                continue
            assert any(b.__module__ == "builtins" and b is not Exception for b in value.__mro__), name


def test_console_script_names_the_cli():
    try:
        scripts = importlib.metadata.entry_points(group="console_scripts")
    except Exception:  # pragma: no cover - no metadata (e.g. run from a source tree only)
        pytest.skip("no installed distribution metadata")
    found = [ep for ep in scripts if ep.name == "vpaged"]
    if not found:
        pytest.skip("vpaged is not installed (run from a source tree)")
    assert found[0].value == "vpaged.cli:main"
    assert callable(found[0].load())
