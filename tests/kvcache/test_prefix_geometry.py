"""Prefix caching on model geometries whose pages hold part tokens: 3 KV heads x 64 dims in fp32 (768-byte K
rows: SmolLM2-135M's geometry) holds 85.33 tokens per 64 KiB page and 2730.67 per 2 MiB page. A second
identical prompt must hit (nearly) every full page, with the same outputs as with caching off, and the engine
says what its cache does instead of turning it off without a word."""

import math

import pytest
import torch

import vpaged
from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache

ROW = 3 * 64 * 4  # bytes of one token's K of one layer (and of V)


def full_page_tokens(tokens: int, page: int) -> int:
    """Tokens wholly inside the full pages a prompt of `tokens` fills."""
    return (tokens * ROW // page) * page // ROW


@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "head_major"])
def test_two_mib_pages_on_the_accounting_backend(layout):
    """2 MiB pages (CUDA's granularity) never hold a whole number of these rows; on the accounting backend
    (pages counted, nothing mapped) a second identical 40,000-token prompt maps >= 90 % of its full pages
    shared and takes no page of its own for them."""
    pool = vpaged.PagePool("cpu", page_size=2 << 20, capacity_pages=2000, accounting_only=True)
    cache = VirtualKVCache(
        KVGeometry(4, 3, 64, torch.float32), VirtualCacheConfig(max_seqs=4, max_seq_len=65536, layout=layout), pool=pool
    )
    lay = cache.layout
    prompt = list(range(1, 40_001))
    a = cache.allocate(tokens=prompt)
    cache.extend(a, len(prompt))
    cached = cache.cache_prefix(a, prompt)
    full_pages = len(prompt) * lay.token_bytes // lay.page_size
    assert cached == full_pages * lay.page_size // lay.token_bytes
    used = pool.stats().used_pages
    b = cache.allocate(tokens=prompt)
    hit = cache.seq_len(b)
    assert hit == cached and math.ceil(hit * lay.token_bytes / lay.page_size) >= 0.9 * full_pages
    assert pool.stats().used_pages == used
    cache.extend(b, len(prompt) - hit)  # a straddling page copied (counted, each run), the rest fresh
    assert cache.stats().cow_copies == (lay.runs if hit * lay.token_bytes % lay.page_size else 0)
    assert cache.stats().prefix_hit_tokens == hit


pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from vpaged.serve import LLM, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def smol_like():
    """A random-weight model with SmolLM2-135M's attention geometry (9 heads on 3 KV heads of 64), small."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=576,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("prompt_tokens", [300, 1300])
def test_second_identical_prompt_hits_its_full_pages(smol_like, prompt_tokens):
    gen = torch.Generator().manual_seed(prompt_tokens)
    prompt = torch.randint(0, 512, (prompt_tokens,), generator=gen).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    for caching in (True, False):
        llm = LLM(smol_like, kv_budget_bytes=32 << 20, page_size=64 << 10, enable_prefix_caching=caching)
        first = llm.generate([prompt], params)[0]
        again = llm.generate([prompt], params)[0]
        outputs[caching] = (first.token_ids, again.token_ids, again.metrics.prefix_hit_tokens, llm.engine.stats())
    (f_on, a_on, hit_on, stats_on), (f_off, a_off, hit_off, stats_off) = outputs[True], outputs[False]
    assert f_on == a_on == f_off == a_off
    want = full_page_tokens(prompt_tokens, 64 << 10)
    assert hit_on >= 0.9 * want and hit_off == 0
    assert stats_on.prefix_caching == "on" and stats_on.prefix_tokens_per_page == pytest.approx(65536 / ROW)
    assert stats_off.prefix_caching.startswith("turned off") and stats_off.prefix_tokens_per_page == 0.0


@pytest.mark.parametrize("kv", ["paged", "static"])
def test_the_engine_says_why_prefix_caching_is_off(smol_like, kv, caplog):
    with caplog.at_level("WARNING", logger="vpaged.serve"):
        llm = LLM(smol_like, kv=kv, kv_budget_bytes=32 << 20, max_model_len=512)
    stats = llm.engine.stats()
    assert stats.prefix_caching != "on" and kv in stats.prefix_caching and stats.prefix_tokens_per_page == 0.0
    assert any("prefix caching is off" in r.getMessage() for r in caplog.records)


def test_metrics_say_whether_prefix_caching_is_on(smol_like):
    pytest.importorskip("fastapi")
    from collections import Counter

    from vpaged.serve.http.metrics import prometheus_text

    on = LLM(smol_like, kv_budget_bytes=32 << 20).engine.stats()
    off = LLM(smol_like, kv="paged", kv_budget_bytes=32 << 20, max_model_len=512).engine.stats()
    text_on, text_off = prometheus_text(on, Counter()), prometheus_text(off, Counter())
    assert 'vpaged_prefix_caching_info{state="on",reason=""} 1.0' in text_on
    assert f"vpaged_prefix_tokens_per_page {65536 / ROW!r}" in text_on
    assert 'vpaged_prefix_caching_info{state="off",reason="kv=\'paged\'' in text_off
    assert "vpaged_prefix_tokens_per_page 0.0" in text_off
