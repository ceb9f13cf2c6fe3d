"""VPagedCache on model families whose K/V are not plain multi-head attention of the config's shape:
multi-query attention named its own way (Falcon), keys and values of different head sizes (DeepSeek-V3's
multi-head latent attention), attention + Mamba hybrids (Jamba), and sliding-window layers held bounded
(Gemma 3). Each against transformers' default cache, greedy and 3-beam, on a left-padded batch of 2, with
tiny random-weight models built here (no download)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from hf_helpers import PAD, VOCAB, generate, prompts  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig  # noqa: E402

from vpaged import KVGeometry, VirtualCacheConfig  # noqa: E402
from vpaged.errors import InvalidArgumentError, ShapeError  # noqa: E402
from vpaged.hf import VPagedCache  # noqa: E402

TOKENS = dict(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=None, bos_token_id=None)
LAYOUTS = ["per_layer", "interleaved", "head_major"]


def _config(arch: str):
    if arch == "falcon_mqa":
        from transformers import FalconConfig

        arch_kw = dict(multi_query=True, new_decoder_architecture=False)  # one K/V head, named its own way
        return FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **arch_kw, **TOKENS)
    if arch == "deepseek_v3":
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=8,  # the cache holds the latent (kv_lora_rank 16) and the rope key (8): sizes differ
            max_position_embeddings=256,
            **TOKENS,
        )
    if arch == "jamba":
        from transformers import JambaConfig

        return JambaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_period=2,
            attn_layer_offset=1,  # layers 1 and 3 attend, 0 and 2 are Mamba
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            use_mamba_kernels=False,  # the torch path: no CUDA kernels needed
            mamba_d_state=8,
            mamba_expand=2,
            max_position_embeddings=256,
            **TOKENS,
        )
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,  # large rows: a page holds few tokens, so the window moves across pages
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            max_position_embeddings=256,
            **TOKENS,
        )
    raise AssertionError(arch)


ARCHS = ["falcon_mqa", "deepseek_v3", "jamba", "gemma3"]


@pytest.fixture(scope="module")
def models():
    out = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        out[arch] = AutoModelForCausalLM.from_config(_config(arch)).eval()
    return out


def make_cache(model, layout, **kw):
    kw.setdefault("max_cache_len", 96)
    kw.setdefault("capacity_bytes", 8 << 20)
    kw.setdefault("page_size", 4096)  # small pages: page boundaries are crossed within a few tokens
    return VPagedCache(model.config, layout=layout, **kw)


CASES = [
    ("greedy, left-padded batch of 2", dict(do_sample=False)),
    ("3-beam, left-padded batch of 2", dict(num_beams=3, do_sample=False)),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_generate_matches_default_cache(models, arch, layout, rng):
    model = models[arch]
    for name, kw in CASES:
        ids, mask = prompts(2, 9, rng, pads=(0, 3))
        ref = generate(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=20, **kw)
        extra = dict(bounded_sliding=True) if arch == "gemma3" else {}
        cache = make_cache(model, layout, **extra)
        out = generate(model, cache, ids, mask, max_new_tokens=20, **kw)
        assert torch.equal(out, ref), f"{arch}/{layout}: {name} differs from transformers' cache"
        cache.close()


def test_geometry_comes_from_the_tensors(models, rng):
    """The heads and head sizes are the model's, whatever its config calls them."""
    falcon = models["falcon_mqa"]
    cache = make_cache(falcon, "per_layer")
    assert cache.num_kv_heads is None  # unknown until the model hands over K/V
    generate(falcon, cache, *prompts(1, 5, rng), max_new_tokens=2)
    assert (cache.num_kv_heads, cache.head_dim, cache.v_head_dim) == (1, 16, 16)  # multi_query: one K/V head
    ds = models["deepseek_v3"]
    cache = make_cache(ds, "interleaved")
    generate(ds, cache, *prompts(1, 5, rng), max_new_tokens=2)
    # Multi-head latent attention caches its compressed latent (kv_lora_rank wide) as "K" and the shared rope
    # key (qk_rope_head_dim) as "V", one head each: two different head sizes.
    assert (cache.num_kv_heads, cache.head_dim, cache.v_head_dim) == (1, 16, 8)
    kv = cache.kv
    k, v = kv.kv(1, cache.sequences[0])
    assert list(k.shape) == [6, 1, 16] and list(v.shape) == [6, 1, 8]
    # Memory counts both: 16 + 8 elements per token and layer, 2 layers, fp32.
    assert cache.bytes_per_token() == kv.bytes_per_token == 2 * 1 * (16 + 8) * 4
    assert kv.stats().live_bytes == 6 * kv.bytes_per_token


def test_explicit_geometry_is_checked_against_the_model(models, rng):
    ds = models["deepseek_v3"]
    layers = ds.config.num_hidden_layers
    wrong = KVGeometry(layers, 1, 16, torch.float32, v_head_dim=16)  # the model's "V" (the rope key) has 8
    cache = make_cache(ds, "per_layer", geometry=wrong)
    with pytest.raises(ShapeError, match="v_head_dim=16"):
        generate(ds, cache, *prompts(1, 4, rng), max_new_tokens=1)
    assert cache.kv is None  # nothing was created
    cache = make_cache(ds, "per_layer", geometry=KVGeometry(layers, 1, 16, torch.float32, v_head_dim=8))
    generate(ds, cache, *prompts(1, 4, rng), max_new_tokens=2)


def test_a_later_layer_of_another_shape_names_the_layer(models):
    # A model config gives only the layers (the heads come from the first K/V of each kind of layer).
    config = LlamaConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=8, torch_dtype="float32")  # fmt: skip
    cache = VPagedCache(config, max_cache_len=16, capacity_bytes=1 << 20, page_size=4096)
    k = torch.randn(1, 2, 3, 8)
    cache.update(k, k.clone(), 0)
    with pytest.raises(ShapeError, match="layer 1.*layer 0"):
        cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 1)
    cache.update(k, k.clone(), 1)  # unchanged by the refused update: the step goes on


def test_hybrid_keeps_attention_in_vpaged_and_mamba_in_transformers(models, rng):
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    model = models["jamba"]
    cache = make_cache(model, "per_layer")
    assert [type(layer).__name__ for layer in cache.layers][1::2] == ["VPagedLayer", "VPagedLayer"]
    assert all(isinstance(cache.layers[i], LinearAttentionCacheLayerMixin) for i in (0, 2))
    ids, mask = prompts(2, 7, rng, pads=(0, 2))
    out = generate(model, cache, ids, mask, max_new_tokens=5)
    assert cache.kv.num_layers == 2  # only the attention layers' K/V live in vpaged
    assert cache.get_seq_length() == out.shape[1] - 1
    assert cache.kv.stats().live_tokens == 2 * (out.shape[1] - 1)
    cache.reset()  # fresh transformers layers too: a new batch of another size works
    ids, mask = prompts(3, 5, rng)
    ref = generate(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=4)
    assert torch.equal(generate(model, cache, ids, mask, max_new_tokens=4), ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bounded_sliding_layers_hold_at_most_the_window(models, layout, rng):
    model = models["gemma3"]
    window = model.config.sliding_window
    ids, mask = prompts(2, 10, rng, pads=(0, 4))
    ref = generate(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=40)
    cache = make_cache(model, layout, bounded_sliding=True)
    out = generate(model, cache, ids, mask, max_new_tokens=40)
    assert torch.equal(out, ref)
    win, full = cache.window_stats(), cache.stats()
    lay = cache.window_kv.layout
    assert cache.window_kv.num_layers == 3 and cache.kv.num_layers == 1
    # Per row and page run: the window's tokens plus one page.
    bound = 2 * lay.runs * (lay.pages_for(window - 1) + 1)
    assert 0 < win.mapped_pages <= bound, (win.mapped_pages, bound)
    assert win.pages_unmapped_total > 0  # pages behind the window went back to the pool
    assert full.live_tokens == 2 * (out.shape[1] - 1)  # the full-attention layer keeps every token
    assert cache.get_seq_length() == out.shape[1] - 1
    # Unbounded, the same model holds every token of the sliding layers too, and gives the same tokens.
    unbounded = make_cache(model, layout)
    assert torch.equal(generate(model, unbounded, ids, mask, max_new_tokens=40), ref)
    assert unbounded.window_kv is None and unbounded.kv.num_layers == 4


def test_bounded_sliding_long_prefill_and_crop(models, rng):
    model = models["gemma3"]
    ids, mask = prompts(2, 30, rng, pads=(0, 5))  # a prompt longer than the window and its slack
    ref = generate(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=6)
    cache = make_cache(model, "per_layer", bounded_sliding=True)
    assert torch.equal(generate(model, cache, ids, mask, max_new_tokens=6), ref)
    with pytest.raises(InvalidArgumentError, match="sliding"):
        cache.crop(-2)  # tokens behind the window are gone: refused, nothing changed
    assert cache.get_seq_length() == ref.shape[1] - 1


def test_unsupported_layer_kinds_raise_at_construction():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, **TOKENS)
    cfg.layer_types = ["full_attention", "indexed_attention"]
    with pytest.raises(InvalidArgumentError, match="indexed_attention"):
        VPagedCache(cfg, max_cache_len=8)


def test_bounded_sliding_compaction_out_of_pages_keeps_the_window(models, rng):
    """A compaction that cannot get its pages raises OutOfPagesError and leaves the window as it was: the
    same step, retried once pages are free again, gives what a cache that never ran short gives."""
    from vpaged import PagePool, VirtualKVCache
    from vpaged.errors import OutOfPagesError

    cfg = models["gemma3"].config  # window 6; layers: sliding, sliding, full, sliding; 8 tokens a 4 KiB page
    heads, dim = cfg.num_key_value_heads, cfg.head_dim
    gen = rng  # the suite's seeded torch.Generator

    def kv(n):
        return [
            (torch.randn(2, heads, n, dim, generator=gen), torch.randn(2, heads, n, dim, generator=gen))
            for _ in range(4)
        ]

    def step(cache, states):
        return [cache.update(k, v, layer) for layer, (k, v) in enumerate(states)]

    pool = PagePool(capacity_pages=256, page_size=4096)
    cache = make_cache(models["gemma3"], "per_layer", bounded_sliding=True, capacity_bytes=None, pool=pool)
    ref = make_cache(models["gemma3"], "per_layer", bounded_sliding=True)
    prefill, grow, decode = kv(6), kv(8), kv(1)  # 6 held + 8 new > 13 a row holds: compact to 5 + 8 tokens
    for a, b in zip(step(cache, prefill), step(ref, prefill)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    hog = VirtualKVCache(
        KVGeometry(1, 1, 1024, torch.float32), VirtualCacheConfig(max_seqs=1, max_seq_len=4096), pool=pool
    )
    seq = hog.allocate()
    hog.extend(seq, pool.free_pages() // 2)  # 2 pages a token: every free page taken
    before = cache.window_stats().mapped_pages
    with pytest.raises(OutOfPagesError):
        cache.update(*grow[0], 0)
    assert cache.window_stats().mapped_pages <= before
    hog.close()
    for states in (grow, decode):
        for a, b in zip(step(cache, states), step(ref, states)):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert cache.get_seq_length() == ref.get_seq_length() == 15
