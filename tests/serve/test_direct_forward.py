"""The engine's direct forward (vpaged.serve.direct_forward) against the transformers forward it replaces.

Two engines on the same model, one walking the layers itself and one running transformers' forward, step the
same requests in lockstep (prefill chunks, decode rows, prompt-logprob rows in one packed step): their logits
agree to the order of sums on every step, for each model class the walk takes (Llama, Mistral, Qwen2 with its
biases, Qwen3 with its q/k norms), in float32 and bfloat16, and on the plain-weight fallback of fp32 panels past
PANEL_ROWS_MAX rows. Models outside the family, an engine without prepared modules, and a model whose forward
differs from the walk's keep the transformers forward, with the reason. Weights changed under a running engine
(in place, a new Parameter, load_state_dict) reach the walk's next step. Closing the engine releases the walk."""

import gc
import weakref

import pytest
import torch
from serve_helpers import assert_logits_agree, run_lockstep
from torch import nn

from vpaged.serve import LLMEngine, SamplingParams

FAMILY = ["random:llama-tiny", "random:mistral-tiny", "random:qwen2-tiny", "random:qwen3-tiny"]
VOCAB = 512


def engine(model, direct: bool, **options) -> LLMEngine:
    options.setdefault("max_num_batched_tokens", 48)  # prompts split into chunks, beside decode rows
    return LLMEngine(model, kv_budget_bytes=8 << 20, direct_forward=direct, **options)


def random_requests(prng, count: int, max_tokens: int = 6) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 1-90 random ids, greedy; the second asks for prompt logprobs (rows kept after the sampling rows)."""
    out = []
    for i in range(count):
        prompt = [prng.randrange(3, VOCAB) for _ in range(prng.randint(1, 90))]
        out.append(
            (
                prompt,
                SamplingParams(
                    max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=2 if i == 1 else None
                ),
            )
        )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILY)
def test_the_walk_gives_the_transformers_forwards_logits_on_packed_steps(name, dtype, prng):
    direct, plain = engine(name, True, dtype=dtype), engine(name, False, dtype=dtype)
    assert direct.runner.direct is not None and direct.direct_forward_off is None
    assert plain.runner.direct is None and plain.direct_forward_off == "direct_forward=False"
    seen = run_lockstep(direct, plain, random_requests(prng, 5))
    assert_logits_agree(*seen, dtype)


def test_fp32_panels_past_their_rows_run_the_plain_weights_alike(monkeypatch, prng):
    monkeypatch.setenv("VPAGED_LINEAR_PLAN", "panels")
    options = dict(max_num_batched_tokens=1200, max_model_len=2048)
    direct, plain = engine("random:llama-tiny", True, **options), engine("random:llama-tiny", False, **options)
    assert direct.runner.direct is not None

    greedy = SamplingParams(max_tokens=4, temperature=0)
    requests = [([prng.randrange(3, VOCAB) for _ in range(n)], greedy) for n in (1100, 50)]
    seen = run_lockstep(direct, plain, requests)
    assert seen[0][0].shape[0] == 2  # the 1,150-row step came first
    assert_logits_agree(*seen, torch.float32)


def test_models_and_engines_outside_the_walk_keep_the_transformers_forward():
    phi = engine("random:phi3-tiny", True)
    assert phi.runner.direct is None and "phi3" in phi.direct_forward_off
    unprepared = engine("random:llama-tiny", True, cpu_prepack=False)
    assert unprepared.runner.direct is None and "cpu_prepack" in unprepared.direct_forward_off


def test_a_model_made_under_inference_mode_keeps_the_transformers_forward():
    from vpaged.serve import load_model

    with torch.inference_mode():
        model = load_model("random:llama-tiny")[0]
    eng = engine(model, True)
    assert eng.runner.direct is None and "inference" in eng.direct_forward_off
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
    while eng.has_unfinished():
        eng.step()


def test_the_probe_refuses_a_model_whose_forward_differs_from_the_walk():
    from vpaged.serve import load_model

    model = load_model("random:llama-tiny")[0]
    layer = model.model.layers[0]  # not the last: the final norm would undo a scaling of the last layer's output

    class ScaledLayer(type(layer)):  # one more term than the walk knows of
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states, *args, **kwargs) * 1.5

    layer.__class__ = ScaledLayer
    eng = engine(model, True)
    assert eng.runner.direct is None and "probe" in eng.direct_forward_off
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0))  # the transformers forward serves it
    while eng.has_unfinished():
        eng.step()


@pytest.mark.parametrize("change", ["in_place", "new_parameter", "load_state_dict"])
def test_weights_changed_under_the_engine_reach_the_next_step(change, rng, prng):
    direct, plain = engine("random:qwen2-tiny", True), engine("random:qwen2-tiny", False)
    for eng in (direct, plain):  # a first request: the walk has read and packed the weights
        eng.add_request([3, 4, 5, 6], SamplingParams(max_tokens=2, temperature=0))
        while eng.has_unfinished():
            eng.step()
    seed = int(torch.randint(0, 1 << 30, (1,), generator=rng))
    for eng in (direct, plain):
        layers = eng.model.model.layers
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            if change == "in_place":
                layers[0].self_attn.k_proj.weight.mul_(1.5)
                layers[1].self_attn.v_proj.bias.add_(torch.randn(layers[1].self_attn.v_proj.bias.shape, generator=gen))
                layers[1].post_attention_layernorm.weight.mul_(0.5)
            elif change == "new_parameter":
                proj = layers[0].mlp.down_proj
                proj.weight = nn.Parameter(torch.randn(proj.weight.shape, generator=gen) * 0.1, requires_grad=False)
                attn = layers[1].self_attn
                attn.q_proj.weight = nn.Parameter(attn.q_proj.weight * 2, requires_grad=False)
            else:
                state = {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in eng.model.state_dict().items()}
                eng.model.load_state_dict(state)
    seen = run_lockstep(direct, plain, random_requests(prng, 3, max_tokens=3))
    assert_logits_agree(*seen, torch.float32)


def test_closing_the_engine_releases_the_walk():
    eng = engine("random:llama-tiny", True)
    walk = weakref.ref(eng.runner.direct)
    model = weakref.ref(eng.model)
    eng.close()
    del eng
    gc.collect()
    assert walk() is None and model() is None
    nn.Parameter(torch.zeros(1))  # a registration afterwards finds no walk to mark
    nn.Linear(2, 2)
