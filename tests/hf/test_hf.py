"""VPagedCache against transformers' DynamicCache on tiny random-weight models (no download)."""

import gc
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from hf_helpers import PAD, VOCAB, generate, prompts  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from vpaged import KVGeometry, OutOfPagesError, PagePool, SequenceTooLongError  # noqa: E402
from vpaged.errors import InvalidArgumentError, ShapeError  # noqa: E402
from vpaged.hf import VPagedCache, cache_kwargs  # noqa: E402

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    pad_token_id=PAD,
    eos_token_id=None,
    bos_token_id=None,
)


def _configs():
    from transformers import GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen2Config

    return {
        "llama": LlamaConfig(num_key_value_heads=2, **COMMON),
        "qwen2": Qwen2Config(num_key_value_heads=2, **COMMON),
        # A window shorter than the sequences: DynamicCache drops old tokens, VPagedCache keeps them and
        # transformers' sliding mask hides them; outputs must agree.
        "mistral": MistralConfig(num_key_value_heads=2, sliding_window=12, **COMMON),
        "gpt_neox": GPTNeoXConfig(**COMMON),  # no GQA, no head_dim attribute
    }


ARCHS = list(_configs())
LAYOUTS = ["per_layer", "interleaved", "head_major"]


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    out = {}
    for name, cfg in _configs().items():
        torch.manual_seed(0)
        out[name] = AutoModelForCausalLM.from_config(cfg).eval()
    return out


def make_cache(model, layout, **kw):
    kw.setdefault("max_cache_len", 128)
    kw.setdefault("capacity_bytes", 4 << 20)
    kw.setdefault("page_size", 4096)  # small pages: page boundaries are crossed within a few tokens
    return VPagedCache(model.config, layout=layout, **kw)


# --------------------------------------------------------------------------------------------- generate()
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_generate_matches_dynamic_cache(models, arch, layout, rng):
    model = models[arch]
    cases = [
        ("greedy b1", *prompts(1, 9, rng), dict(do_sample=False)),
        ("greedy b4 left-padded", *prompts(4, 11, rng, pads=(0, 2, 5, 10)), dict(do_sample=False)),
        ("sampling b4 left-padded", *prompts(4, 7, rng, pads=(3, 0, 6, 1)), dict(do_sample=True, top_k=20)),
        ("beam 4", *prompts(2, 8, rng, pads=(0, 3)), dict(num_beams=4, do_sample=False)),
    ]
    for name, ids, mask, kw in cases:
        ref = generate(model, DynamicCache(config=model.config), ids, mask, seed=1234, **kw)
        cache = make_cache(model, layout)
        out = generate(model, cache, ids, mask, seed=1234, **kw)
        assert torch.equal(out, ref), f"{arch}/{layout}: {name} differs from DynamicCache"
        assert cache.get_seq_length() == out.shape[1] - 1  # the last token is generated, not yet cached
        cache.close()


def test_past_key_values_keyword(models, rng):
    model = models["llama"]
    ids, mask = prompts(1, 6, rng)
    ref = generate(model, DynamicCache(config=model.config), ids, mask)
    cache = make_cache(model, "per_layer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.x renamed it to `cache`
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=16, do_sample=False)
    assert torch.equal(out, ref)


def test_num_return_sequences_share_prompt_pages(models, rng):
    model = models["llama"]
    ids, mask = prompts(1, 100, rng)
    kw = dict(do_sample=True, num_return_sequences=4, max_new_tokens=4)
    ref = generate(model, DynamicCache(config=model.config), ids, mask, seed=7, **kw)
    pool = PagePool("cpu", capacity_bytes=4 << 20, page_size=4096)
    cache = make_cache(model, "per_layer", capacity_bytes=None, pool=pool)
    out = generate(model, cache, ids, mask, seed=7, **kw)
    assert torch.equal(out, ref)
    one_row = cache.kv.layout.pages_for(104) * cache.kv.layout.regions
    # The 4 identical prompt rows were stored once; only the pages the rows wrote after it are their own.
    assert pool.stats().high_water_pages < 2 * one_row


# --------------------------------------------------------------------------------------------- forward loop
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_forward_loop_logits_match(models, arch, layout, rng):
    model = models[arch]
    ids, mask = prompts(2, 10, rng, pads=(0, 4))
    dyn, vp = DynamicCache(config=model.config), make_cache(model, layout)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(dyn)).logits
        b = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(vp)).logits
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        used = [vp.pool.stats().used_pages]
        for _ in range(50):
            nxt = a[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            pos = pos[:, -1:] + 1
            a = model(input_ids=nxt, attention_mask=mask, position_ids=pos, **cache_kwargs(dyn)).logits
            b = model(input_ids=nxt, attention_mask=mask, position_ids=pos, **cache_kwargs(vp)).logits
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            used.append(vp.pool.stats().used_pages)
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(vp.layers[layer].keys, dyn.layers[layer].keys, rtol=0, atol=0)
        torch.testing.assert_close(vp.layers[layer].values, dyn.layers[layer].values, rtol=0, atol=0)
    # Memory follows the tokens: pages were added step by step (as the layout's granularity allows), exactly
    # what 60 tokens of two rows need, far below a max_cache_len reservation.
    lay = vp.kv.layout
    assert used == sorted(used) and used[-1] == 2 * lay.runs * lay.pages_for(60)
    assert used[-1] > used[0] or lay.pages_for(60) == lay.pages_for(10)
    assert used[-1] * vp.pool.page_size < vp.static_bytes()
    vp.reset()
    assert vp.pool.stats().used_pages == 0


def test_views_are_zero_copy(models, rng):
    model = models["llama"]
    cache = make_cache(model, "per_layer")
    ids, mask = prompts(2, 5, rng)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache))
        k = torch.randn(2, 2, 1, 16, generator=rng)
        keys, values = cache.update(k, k.clone(), 0)
        cache.update(k, k.clone(), 1)
    assert keys.shape == (2, 2, 6, 16)
    base = cache.kv.batch(0, cache.sequences).k_ptr
    assert keys.data_ptr() == base + cache.kv.slot(cache.sequences[0]) * cache.kv.layout.slot_bytes
    torch.testing.assert_close(keys[:, :, -1:], k, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------- batch edits
def _fill(model, caches, ids, mask):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return [model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(c)).logits for c in caches]


def _step(model, caches, tok, mask):
    pos = (mask.cumsum(-1) - 1)[:, -1:]
    with torch.no_grad():
        return [model(input_ids=tok, attention_mask=mask, position_ids=pos, **cache_kwargs(c)).logits for c in caches]


def _same_kv(vp, dyn):
    for layer in range(len(vp.layers)):
        assert torch.equal(vp.layers[layer].keys, dyn.layers[layer].keys)
        assert torch.equal(vp.layers[layer].values, dyn.layers[layer].values)


def test_prefill_duplicates_split_when_a_layer_differs(models, rng):
    """Rows 0-2 have the same tokens and positions, so layer 0 gives them the same K/V; row 1 masks its first
    token, so from layer 1 on it differs and must get its own pages; row 2 stays a sharer of row 0."""
    model = models["llama"]
    ids = torch.randint(1, VOCAB, (1, 9), generator=rng).repeat(3, 1)
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    pos = torch.arange(9).repeat(3, 1)
    dyn, vp = DynamicCache(config=model.config), make_cache(model, "per_layer")
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(dyn)).logits
        b = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(vp)).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    _same_kv(vp, dyn)
    kv, seqs = vp.kv, vp.sequences
    region0 = [kv.layout.page_indices(kv.slot(s), 0, 1)[0] for s in seqs]
    pages = kv._range.pages_at(region0)
    assert pages[2] == pages[0] != pages[1]
    tok = torch.randint(1, VOCAB, (3, 1), generator=rng)
    mask = torch.cat([mask, torch.ones_like(tok)], 1)
    a, b = _step(model, (dyn, vp), tok, mask)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    _same_kv(vp, dyn)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reorder_select_repeat_crop(models, layout, rng):
    model = models["qwen2"]
    dyn, vp = DynamicCache(config=model.config), make_cache(model, layout, max_batch_size=8)
    ids, mask = prompts(4, 37, rng, pads=(0, 1, 2, 3))  # 37 tokens: last pages partly filled
    _fill(model, (dyn, vp), ids, mask)
    tok = torch.randint(1, VOCAB, (4, 1), generator=rng)

    beam_idx = torch.tensor([2, 2, 0, 3])
    for c in (dyn, vp):
        c.reorder_cache(beam_idx)
    _same_kv(vp, dyn)
    mask = torch.cat([mask[beam_idx], torch.ones_like(tok)], 1)
    a, b = _step(model, (dyn, vp), tok, mask)  # writes into rows 0 and 1, which share row 2's pages
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    _same_kv(vp, dyn)

    keep = torch.tensor([3, 0])
    for c in (dyn, vp):
        c.batch_select_indices(keep)
    _same_kv(vp, dyn)
    mask = mask[keep]
    for c in (dyn, vp):
        c.batch_repeat_interleave(3)
    _same_kv(vp, dyn)
    mask = mask.repeat_interleave(3, 0)
    tok = torch.randint(1, VOCAB, (6, 1), generator=rng)
    mask = torch.cat([mask, torch.ones_like(tok)], 1)
    a, b = _step(model, (dyn, vp), tok, mask)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    _same_kv(vp, dyn)

    for c in (dyn, vp):
        c.crop(-3)
    assert vp.get_seq_length() == dyn.get_seq_length() == 36
    _same_kv(vp, dyn)
    mask = mask[:, :-3]
    tok = torch.randint(1, VOCAB, (6, 1), generator=rng)
    mask = torch.cat([mask, torch.ones_like(tok)], 1)
    a, b = _step(model, (dyn, vp), tok, mask)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    _same_kv(vp, dyn)
    with pytest.raises(InvalidArgumentError):
        vp.crop(3)  # transformers 5 semantics: a positive count is refused
    vp.crop(0)
    assert vp.get_seq_length() == 37


def test_beam_reorder_shares_pages(models, rng):
    model = models["llama"]
    pool = PagePool("cpu", capacity_bytes=8 << 20, page_size=4096)
    cache = make_cache(model, "per_layer", capacity_bytes=None, pool=pool, max_cache_len=256, max_batch_size=8)
    ids, mask = prompts(1, 200, rng)
    _fill(model, (cache,), ids, mask)
    one = pool.stats().used_pages
    cache.batch_repeat_interleave(8)
    cache.reorder_cache(torch.tensor([7, 7, 1, 0, 3, 3, 3, 2]))
    assert pool.stats().used_pages == one  # rows share pages; nothing copied yet
    tok = torch.randint(1, VOCAB, (8, 1), generator=rng)
    _step(model, (cache,), tok, torch.ones(8, 201, dtype=torch.long))
    # Each row copied (at most) its partly filled last page per region, not its 200-token prefix.
    assert pool.stats().used_pages <= one + 8 * cache.kv.layout.regions
    cache.close()
    assert pool.stats().used_pages == 0


# --------------------------------------------------------------------------------------------- memory, errors
def test_memory_released_when_dropped(models, rng):
    model = models["mistral"]
    pool = PagePool("cpu", capacity_bytes=4 << 20, page_size=4096)
    cache = make_cache(model, "interleaved", capacity_bytes=None, pool=pool)
    generate(model, cache, *prompts(2, 20, rng))
    assert pool.stats().used_pages > 0
    del cache
    gc.collect()
    assert pool.stats().used_pages == 0


def test_too_long_raises_typed_error(models, rng):
    model = models["llama"]
    cache = make_cache(model, "per_layer", max_cache_len=20)
    with pytest.raises(SequenceTooLongError):
        generate(model, cache, *prompts(1, 10, rng), max_new_tokens=30)
    # The step that failed changed nothing: the cache still holds the 20 tokens that fit.
    assert cache.get_seq_length() == 20
    cache.reset()
    out = generate(model, cache, *prompts(1, 10, rng), max_new_tokens=5)
    assert out.shape[1] == 15


def test_out_of_budget_raises_typed_error(models, rng):
    model = models["llama"]
    # 2 layers x K/V x 2 heads x 16 x fp32 = 256 B per token per region; 4 KiB pages, 8 pages in all.
    cache = make_cache(model, "per_layer", capacity_bytes=8 * 4096)
    with pytest.raises(OutOfPagesError):
        generate(model, cache, *prompts(2, 10, rng), max_new_tokens=40)
    assert cache.pool.stats().used_pages <= 8


def test_shape_and_argument_errors(models, rng):
    model = models["llama"]
    with pytest.raises(InvalidArgumentError):
        VPagedCache(model.config, max_cache_len=0)
    with pytest.raises(InvalidArgumentError):
        VPagedCache(None, max_cache_len=8)
    c = model.config
    heads, dim = c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    wrong = KVGeometry(c.num_hidden_layers, heads, 2 * dim, torch.float32)  # the model's heads are dim wide
    cache = VPagedCache(model.config, max_cache_len=8, geometry=wrong, capacity_bytes=1 << 20)
    with pytest.raises(ShapeError):
        generate(model, cache, *prompts(1, 4, rng))
    with pytest.raises(InvalidArgumentError, match="not both"):
        VPagedCache(model.config, max_cache_len=8, geometry=wrong, dtype=torch.float32)
    with pytest.raises(InvalidArgumentError, match="layers"):
        VPagedCache(
            model.config, max_cache_len=8, geometry=KVGeometry(c.num_hidden_layers + 1, heads, dim, torch.float32)
        )
    cache = make_cache(model, "per_layer")
    with pytest.raises(InvalidArgumentError):
        cache.layers[0].crop(-1)  # per-layer edits would desynchronise the shared rows


# --------------------------------------------------------------------------------------------- quantized K/V
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_cache_shares_prefill_in_every_generate_pattern(models, kv_dtype, rng):
    """A quantized cache with share_prefill=True (duplicate prompt rows stored once: beams, return
    sequences) generates what the same cache without sharing generates (issue #41: beams raised
    InvalidArgumentError on the rows still at length 0)."""
    model = models["llama"]
    cases = [
        ("beam 4", *prompts(2, 8, rng, pads=(0, 3)), dict(num_beams=4, do_sample=False)),
        ("return 3", *prompts(2, 9, rng, pads=(2, 0)), dict(do_sample=True, num_return_sequences=3)),
        ("beam 3 return 2", *prompts(1, 7, rng), dict(num_beams=3, num_return_sequences=2, do_sample=False)),
        ("greedy b4 left-padded", *prompts(4, 11, rng, pads=(0, 2, 5, 10)), dict(do_sample=False)),
        ("same prompt twice", *(t.repeat(2, 1) for t in prompts(1, 6, rng)), dict(do_sample=False)),
    ]
    for name, ids, mask, kw in cases:
        outs = []
        for share in (False, True):
            cache = make_cache(model, "head_major", kv_dtype=kv_dtype, share_prefill=share)
            outs.append(generate(model, cache, ids, mask, seed=99, **kw))
            assert cache.get_seq_length() == outs[-1].shape[1] - 1, name
            cache.close()
        assert torch.equal(outs[0], outs[1]), f"{kv_dtype}: {name} differs with share_prefill=True"
