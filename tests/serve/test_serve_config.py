"""EngineConfig in parts (issue #35): each part checked once, one store config per kind (no option a kind
ignores), the flat form of earlier releases mapped onto the parts, kv_dtype resolved once into kv_format."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest
import torch
from serve_helpers import option_of

from vpaged.errors import DTypeError, InvalidArgumentError
from vpaged.kvcache.formats import KVFormat
from vpaged.serve.config import (
    STORE_CONFIGS,
    EngineConfig,
    ModelConfig,
    PagedStoreConfig,
    ParallelConfig,
    SchedulerConfig,
    StaticStoreConfig,
    VirtualStoreConfig,
)


def random_flat(rng: random.Random) -> dict:
    return dict(
        kv_budget_bytes=rng.randint(1, 1 << 30),
        max_num_seqs=rng.randint(1, 256),
        max_num_batched_tokens=rng.randint(1, 4096),
        watermark_fraction=rng.choice([0, 0.01, 0.3]),
        dtype=rng.choice([None, torch.float32, torch.bfloat16]),
        max_model_len=rng.choice([None, rng.randint(1, 1 << 16)]),
        cpu_prepack=rng.random() < 0.5,
        tensor_parallel_size=rng.randint(1, 4),
        seed=rng.randrange(1 << 31),
    )


def test_the_flat_form_builds_the_same_config_as_the_parts():
    rng = random.Random()
    flat = random_flat(rng)
    page, layout, swap = rng.choice([None, 1 << 16]), rng.choice(["per_layer", "head_major"]), rng.randint(0, 9)
    by_parts = EngineConfig(
        store=VirtualStoreConfig(flat["kv_budget_bytes"], page_size=page, layout=layout, swap_bytes=swap),
        scheduler=SchedulerConfig(flat["max_num_seqs"], flat["max_num_batched_tokens"], flat["watermark_fraction"]),
        model=ModelConfig(flat["dtype"], "cpu", flat["max_model_len"], flat["cpu_prepack"]),
        parallel=ParallelConfig(flat["tensor_parallel_size"]),
        seed=flat["seed"],
    )
    by_flat = EngineConfig(**flat, page_size=page, layout=layout, swap_bytes=swap)
    assert by_parts == by_flat and by_flat.unused_options == ()
    for name, value in flat.items():  # each flat name lands in its part
        assert option_of(by_flat, name) == value, name
    assert pickle.loads(pickle.dumps(by_flat)) == by_flat  # what a spawned tensor-parallel rank receives


@pytest.mark.parametrize("kind", list(STORE_CONFIGS))
def test_each_kind_holds_only_its_own_options(kind):
    config = EngineConfig(kv_budget_bytes=1 << 20, kv=kind)
    own = {f.name for f in dataclasses.fields(config.store)}
    assert type(config.store) is STORE_CONFIGS[kind] and config.kv == kind
    assert ("block_size" in own) == (kind == "paged")
    assert ("layout" in own) == ("page_size" in own) == (kind != "paged")
    assert ("swap_bytes" in own) == ("enable_prefix_caching" in own) == (kind == "vpaged")


def test_an_option_the_kind_does_not_use_is_listed_not_applied():
    config = EngineConfig(kv_budget_bytes=1 << 20, kv="paged", page_size=4096, layout="interleaved", block_size=8)
    assert config.unused_options == ("page_size", "layout")
    assert config.store == PagedStoreConfig(1 << 20, block_size=8)
    assert EngineConfig(kv_budget_bytes=1 << 20, kv="vpaged", page_size=4096).unused_options == ()


def test_replace_changes_a_part_and_can_change_the_kind():
    rng = random.Random()
    base = EngineConfig(**random_flat(rng), layout="interleaved", page_size=1 << 16)
    seqs = rng.randint(1, 64)
    assert dataclasses.replace(base, max_num_seqs=seqs).scheduler == dataclasses.replace(
        base.scheduler, max_num_seqs=seqs
    )
    static = dataclasses.replace(base, kv="static")
    assert static.store == StaticStoreConfig(base.store.kv_budget_bytes, layout="interleaved", page_size=1 << 16)
    assert (static.scheduler, static.model, static.parallel) == (base.scheduler, base.model, base.parallel)
    paged = dataclasses.replace(static, kv="paged", block_size=32)
    assert paged.store == PagedStoreConfig(base.store.kv_budget_bytes, block_size=32)


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(layout="diagonal"), InvalidArgumentError, "layout must be one of"),
        (dict(kv="paged", block_size=12), InvalidArgumentError, "block_size must be one of (8, 16, 32), got 12"),
        (dict(page_size=0), InvalidArgumentError, "page_size must be a positive int, got 0"),
        (dict(tensor_parallel_size=0), InvalidArgumentError, "tensor_parallel_size must be a positive int, got 0"),
        (dict(cpu_prepack=1), InvalidArgumentError, "cpu_prepack must be a bool, got 1"),
        (dict(seed=1.5), InvalidArgumentError, "seed must be an int, got 1.5"),
        (dict(kv_dtype="int4"), DTypeError, "unknown kv_dtype 'int4'"),
        (dict(kv_dtype=torch.int16), DTypeError, "int16"),
        (dict(kv_dtype=torch.float16, dtype=torch.float32), DTypeError, "neither the model dtype"),
        (dict(max_num_sequences=4), TypeError, "unexpected options ['max_num_sequences']"),
    ],
)
def test_bad_options_are_refused_when_the_config_is_built(options, error, message):
    with pytest.raises(error) as e:
        EngineConfig(kv_budget_bytes=1 << 20, **options)
    assert message in str(e.value)


def test_kv_dtype_is_resolved_once_against_the_models_dtype():
    unknown = EngineConfig(kv_budget_bytes=1 << 20, kv_dtype="fp8")
    assert unknown.kv_format is None  # the model's dtype is not known yet
    for dtype in (torch.float32, torch.bfloat16):
        resolved = unknown.for_model_dtype(dtype)
        assert resolved.kv_format == KVFormat(dtype, torch.float8_e4m3fn) and resolved.model.dtype == dtype
        assert resolved.for_model_dtype(dtype) is resolved
    # The model's own dtype is a valid kv_dtype before that dtype is known (it was refused against float32).
    same = EngineConfig(kv_budget_bytes=1 << 20, kv_dtype=torch.bfloat16)
    assert same.for_model_dtype(torch.bfloat16).kv_format == KVFormat(torch.bfloat16, torch.bfloat16)
    with pytest.raises(DTypeError):
        same.for_model_dtype(torch.float32)
    auto = EngineConfig(kv_budget_bytes=1 << 20, dtype=torch.float16, kv_dtype="auto")
    assert auto.kv_format == KVFormat(torch.float16, torch.float16) and not auto.kv_format.quantized
