"""VPagedCacheConfig: the one record VPagedCache is built from (keyword options fill it), its checks, and the
cache built from a record behaving exactly as the one built from keywords."""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
from hf_helpers import generate, prompts, tiny_llama  # noqa: E402

from vpaged import PagePool  # noqa: E402
from vpaged.errors import DTypeError, InvalidArgumentError  # noqa: E402
from vpaged.hf import VPagedCache, VPagedCacheConfig  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("max_cache_len", 0, InvalidArgumentError),
        ("max_cache_len", 2.5, InvalidArgumentError),
        ("max_batch_size", -1, InvalidArgumentError),
        ("capacity_bytes", 0, InvalidArgumentError),
        ("page_size", "4k", InvalidArgumentError),
        ("shared_budget", 3, InvalidArgumentError),
        ("layout", "rows", InvalidArgumentError),
        ("share_prefill", 1, InvalidArgumentError),
        ("bounded_sliding", "yes", InvalidArgumentError),
        ("dtype", "float32", DTypeError),
        ("kv_dtype", torch.int32, DTypeError),
    ],
)
def test_each_field_is_checked_with_an_error_naming_it(field, value, error):
    fields = {"max_cache_len": 64, field: value}
    with pytest.raises(error, match=field.split("_")[0] if error is InvalidArgumentError else None):
        VPagedCacheConfig(**fields)
    with pytest.raises(error):
        VPagedCache(None, geometry=None, **fields)  # the same check, through the keywords


def test_keywords_fill_the_record(model):
    cache = VPagedCache(model.config, max_cache_len=96, capacity_bytes=1 << 20, layout="per_layer", page_size=4096)
    assert cache.cache_config == VPagedCacheConfig(
        max_cache_len=96, capacity_bytes=1 << 20, layout="per_layer", page_size=4096
    )
    assert (cache.max_cache_len, cache.layout, cache.page_size) == (96, "per_layer", 4096)


def test_unknown_keyword_names_the_fields(model):
    with pytest.raises(TypeError, match="max_cache_len.*kv_scales"):
        VPagedCache(model.config, max_cache_len=8, max_len=8)
    with pytest.raises(InvalidArgumentError, match="max_cache_len"):
        VPagedCache(model.config)


def test_record_and_keywords_together_are_refused(model):
    record = VPagedCacheConfig(max_cache_len=32)
    with pytest.raises(InvalidArgumentError, match="not both"):
        VPagedCache(model.config, record, layout="per_layer")
    with pytest.raises(InvalidArgumentError, match="VPagedCacheConfig"):
        VPagedCache(model.config, {"max_cache_len": 32})


def test_pool_with_a_private_pool_size_is_refused_and_builds_nothing(model):
    pool = PagePool(capacity_bytes=1 << 20, page_size=4096)
    before = pool.stats()
    with pytest.raises(InvalidArgumentError, match="not both"):
        VPagedCache(model.config, VPagedCacheConfig(max_cache_len=32, capacity_bytes=1 << 20), pool=pool)
    assert pool.stats() == before


@pytest.mark.parametrize("layout", ["per_layer", "head_major"])
def test_a_record_built_cache_generates_what_a_keyword_built_one_does(model, layout, rng):
    ids, mask = prompts(3, 9, rng)
    record = VPagedCacheConfig(max_cache_len=64, capacity_bytes=2 << 20, page_size=4096, layout=layout)
    by_record = VPagedCache(model.config, record)
    by_keywords = VPagedCache(model.config, **dataclasses.asdict(record))
    out_record = generate(model, by_record, ids, mask)
    out_keywords = generate(model, by_keywords, ids, mask)
    assert torch.equal(out_record, out_keywords)
    assert by_record.pool.stats().high_water_pages == by_keywords.pool.stats().high_water_pages > 0
    # a record is a value: replace() gives a new one, the cache keeps the one it was built from
    assert dataclasses.replace(record, layout="interleaved") != by_record.cache_config
