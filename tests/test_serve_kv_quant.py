"""The serving engine with quantized K/V (kv_dtype): greedy tokens equal model.generate over a VPagedCache of the
same format (what both attend over is the same stored K/V, dequantized), preemption (swap and recompute)
changes no output, and the same budget holds proportionally more tokens."""

import random

import pytest
import torch

from vpaged import _C
from vpaged.hf.compat import serving_support

pytest.importorskip("transformers")

from serve_helpers import one_torch_thread  # noqa: E402, F401 - the autouse fixture

from vpaged.errors import DTypeError  # noqa: E402
from vpaged.hf import VPagedCache, cache_kwargs  # noqa: E402
from vpaged.serve import LLM, LLMEngine, SamplingParams, load_model  # noqa: E402

SERVING, WHY_NOT_SERVING = serving_support()
if not SERVING:
    pytest.skip(WHY_NOT_SERVING, allow_module_level=True)
if not hasattr(_C.DecodeParams(), "kv_dtype"):
    pytest.skip("extension built without quantized decode kernels", allow_module_level=True)

PAGE = 4096
GREEDY = dict(temperature=0.0, ignore_eos=True)
FORMATS = ["int8", "fp8", "fp8_e5m2"]


@pytest.fixture(scope="module")
def model():
    return load_model("random:llama-tiny")[0]


@pytest.fixture(scope="module")
def reference():
    return load_model("random:llama-tiny")[0]


@pytest.fixture
def prng(rng):
    return random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))


def random_prompt(prng, lo, hi, vocab=512):
    return [prng.randrange(3, vocab) for _ in range(prng.randint(lo, hi))]


@torch.no_grad()
def generate_quantized(reference, prompt, max_new, kv_dtype):
    """Greedy tokens of model.generate over a VPagedCache storing kv_dtype, and the top-2 logit gaps."""
    cache = VPagedCache(reference.config, max_cache_len=len(prompt) + max_new, kv_dtype=kv_dtype, layout="per_layer")
    out = reference.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, output_scores=True,
        return_dict_in_generate=True, eos_token_id=None, pad_token_id=0, **cache_kwargs(cache),
    )  # fmt: skip
    cache.close()
    tokens = out.sequences[0, len(prompt) :].tolist()
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return tokens, gaps


def agree(tokens, ref_tokens, gaps) -> int:
    """0 when equal; 1 when they part where the reference's top-2 gap is a near tie (then not compared on)."""
    assert len(tokens) == len(ref_tokens)
    for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
        if a != b:
            assert gaps[i] < 1e-4, f"token {i}: engine {a}, generate {b} (gap {gaps[i]:.2e})"
            return 1
    return 0


@pytest.mark.parametrize("kv", ["vpaged", "paged", "static"])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_greedy_equals_generate_over_the_same_format(model, reference, prng, kv, kv_dtype):
    extra = dict(max_model_len=160) if kv == "static" else {}
    eng = LLMEngine(model, kv=kv, kv_dtype=kv_dtype, kv_budget_bytes=4 << 20, page_size=PAGE,
                    max_num_batched_tokens=16, max_num_seqs=4, **extra)  # fmt: skip
    prompts = [random_prompt(prng, 1, 60) for _ in range(5)]
    max_new = [prng.randint(1, 10) for _ in prompts]
    ids = [eng.add_request(p, SamplingParams(max_tokens=n, **GREEDY)) for p, n in zip(prompts, max_new)]
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    tolerated = 0
    for i, p, n in zip(ids, prompts, max_new):
        ref, gaps = generate_quantized(reference, p, n, kv_dtype)
        tolerated += agree(final[i].token_ids, ref, gaps)
    assert tolerated <= 1
    assert eng.stats().live_kv_tokens == 0


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("swap_seqs", [8, 0])
def test_preemption_with_quantized_kv_changes_no_output(model, prng, kv_dtype, swap_seqs):
    # Every sequence grows past a page boundary after admission (fp8 pages hold 128 tokens here, int8 102).
    prompts = [random_prompt(prng, 60, 90) for _ in range(6)]
    params = SamplingParams(max_tokens=100, **GREEDY)
    roomy = LLM(model, kv_dtype=kv_dtype, kv_budget_bytes=8 << 20, page_size=PAGE).generate(prompts, params)
    store = LLM(model, kv_dtype=kv_dtype, kv_budget_bytes=8 << 20, page_size=PAGE).engine.store
    need = sum(store.pages_for_tokens(len(p) + 100) for p in prompts) * PAGE  # every sequence at its longest
    seq_bytes = store.pages_for_tokens(190) * PAGE
    tight = LLM(model, kv_dtype=kv_dtype, kv_budget_bytes=max(need // 2, seq_bytes), page_size=PAGE,
                swap_bytes=swap_seqs * seq_bytes, max_num_batched_tokens=64)  # fmt: skip
    outs = tight.generate(prompts, params)
    stats = tight.stats()
    assert stats.preemptions_swap + stats.preemptions_recompute > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert stats.live_kv_tokens == 0 and stats.swapped == 0


@pytest.mark.parametrize("kv", ["vpaged", "paged"])
def test_the_same_budget_holds_more_tokens(model, kv):
    """llama-tiny in fp32: 16-dim heads take 64 bytes a row, int8 20 (with its scale), fp8 16."""
    per_token = {}
    for kv_dtype in (None, "int8", "fp8"):
        eng = LLMEngine(model, kv=kv, kv_dtype=kv_dtype, kv_budget_bytes=4 << 20, page_size=PAGE)
        store = eng.store
        per_token[kv_dtype] = store.pages_for_tokens(4096) * store.page_bytes / 4096
        eng.close() if hasattr(eng, "close") else store.close()
    assert per_token["int8"] <= per_token[None] * 20 / 64 * 1.05
    assert per_token["fp8"] <= per_token[None] * 16 / 64 * 1.05


def test_unknown_kv_dtype_is_refused_before_anything_is_built(model):
    with pytest.raises(DTypeError):
        LLMEngine(model, kv_dtype="int4", kv_budget_bytes=4 << 20)
    with pytest.raises(DTypeError):
        LLMEngine(model, kv_dtype=torch.int16, kv_budget_bytes=4 << 20)
