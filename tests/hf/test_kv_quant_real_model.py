"""Quantized K/V on a real model (SmolLM2-135M-Instruct, benchmarks/real_model.py): perplexity of 1,024 tokens of
English prose with every layer's K/V stored in each format, against full-precision K/V. Random-weight models
cannot judge this (their logits are near flat, so any rounding flips tokens)."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import real_model  # noqa: E402

WHY = real_model.why_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")

# Bounds on the perplexity increase (relative), per format. int8 is held to the goal (+0.5 %); the fp8 goals
# (+1.0 % e4m3, +4 % e5m2) are not met on this text: measured +1.78 % and +4.28 % (benchmarks/NOTES.md), the
# same to 1e-6 as an independent quantize-dequantize of K/V through transformers' DynamicCache (below), so
# these bounds guard against regressions of the format, at ~1.4x the measured increase.
BOUNDS = {("int8", None): 0.005, ("fp8", None): 0.025, ("fp8_e5m2", None): 0.06}


@pytest.fixture(scope="module")
def loaded():
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, before))
    model, tok = real_model.load()
    yield model, real_model.prose_ids(tok, 1024), tok
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def perplexities(loaded):
    """Perplexity of the text with full-precision K/V (None) and with each format, computed once."""
    from bench_kv_quant import perplexity

    model, ids, _ = loaded
    out = {None: perplexity(model, ids)}
    for kv_dtype, scales in BOUNDS:
        out[kv_dtype] = perplexity(model, ids, kv_dtype, scales)
    return out


def test_perplexity_within_each_formats_bound(perplexities):
    base = perplexities[None]
    assert 1.0 < base < 100.0, base  # a real model on real text
    for (kv_dtype, _), bound in BOUNDS.items():
        ppl = perplexities[kv_dtype]
        assert ppl / base - 1 <= bound, (kv_dtype, ppl, base)
        assert ppl != base  # the format did change what the layers attend over


def test_perplexity_equals_an_independent_quantizer(loaded, perplexities):
    """The same perplexity as quantizing and dequantizing each layer's new K/V with torch alone (int8 by its
    definition, fp8 by torch's float8 conversion) inside transformers' DynamicCache."""
    import math

    from transformers import DynamicCache

    model, ids, _ = loaded

    def fake(x, kind):
        if kind == torch.int8:
            s = x.abs().amax(-1, keepdim=True) / 127
            return torch.where(s > 0, (x / torch.where(s > 0, s, 1)).round().clamp(-127, 127) * s, 0.0)
        return x.to(kind).float()

    class Quantizing(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            return super().update(fake(k, self.kind), fake(v, self.kind), layer_idx, *args, **kwargs)

    x = torch.tensor([ids])
    for name, kind in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        cache = Quantizing(config=model.config)
        cache.kind = kind
        with torch.no_grad():
            logits = model(x, past_key_values=cache, use_cache=True).logits[0, :-1].float()
        want = math.exp(float(torch.nn.functional.cross_entropy(logits, x[0, 1:])))
        assert perplexities[name] == pytest.approx(want, rel=1e-5)


def test_engine_with_int8_kv_answers_like_the_cache(loaded):
    """The engine (quantized decode kernel, quantized scatter) and model.generate over a VPagedCache of the
    same format give the same greedy tokens on a real model (ties are far apart here)."""
    from bench_kv_quant import greedy_answer

    from vpaged.serve import LLMEngine, SamplingParams

    model, _, tok = loaded
    prompt = real_model.CHAT_PROMPTS[0]
    want = greedy_answer(model, tok, prompt, "int8", max_new=12)  # stops at EOS; the engine ignores it
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    eng = LLMEngine(model, tok, kv_budget_bytes=64 << 20, kv_dtype="int8", cpu_prepack=False)
    eng.add_request(tok(text)["input_ids"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    final = None
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final = out
    assert len(want) >= 4 and final.token_ids[: len(want)] == want
