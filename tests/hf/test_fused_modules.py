"""vpaged.hf.fused: RMSNorms and gated MLPs swapped onto the fused ops, against the same model left as it is.

Every random-weight family the engine serves gives the plain model's logits (fp32 and bf16, prepacked or
not); what users do to a model (to(dtype), load_state_dict, in-place updates, deepcopy, pickle, training, a
second prepare) refits, falls back or leaves it as it was; a module with another formula behind a familiar
name is left alone; the engine fuses by default and cpu_prepack=False leaves every module as it was."""

import copy
import pickle

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from test_prepack import ids, logits  # noqa: E402

from vpaged.errors import InvalidArgumentError  # noqa: E402
from vpaged.hf.fused import fuse_modules, fused_modules, unfuse  # noqa: E402
from vpaged.hf.prepack import PrepackedLinear, prepack_linears  # noqa: E402
from vpaged.serve import RANDOM_CONFIGS, LLMEngine, load_model  # noqa: E402

FAMILIES = sorted(n for n in RANDOM_CONFIGS if n.endswith("-tiny"))
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}


def expected_count(model) -> int:
    """What fuse_modules should swap: every *RMSNorm module and every decoder layer's MLP."""
    norms = sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())
    return norms + model.config.num_hidden_layers


def pair(name, dtype=torch.float32):
    return load_model(f"random:{name}", dtype=dtype)[0], load_model(f"random:{name}", dtype=dtype)[0]


@pytest.mark.parametrize("prepacked", [False, True], ids=["plain-linears", "prepacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_fused_model_gives_the_plain_models_logits(name, dtype, prepacked):
    model, ref = pair(name, dtype)
    if prepacked:
        prepack_linears(model)
    n = fuse_modules(model)
    assert n == expected_count(model) == len(fused_modules(model))
    for x in (ids(), ids(1, 1, 1), ids(1, 70, 2)):
        torch.testing.assert_close(logits(model, x), logits(ref, x), **TOL[dtype])
    assert fuse_modules(model) == n  # idempotent


def test_fused_classes_keep_isinstance_and_state_dict():
    model, ref = pair("llama-tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_modules(model)
    layer = model.model.layers[0]
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    assert isinstance(layer.mlp, LlamaMLP) and type(layer.mlp) is not LlamaMLP
    assert isinstance(layer.input_layernorm, LlamaRMSNorm)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert unfuse(model) == expected_count(model)
    assert type(layer.mlp) is LlamaMLP and type(layer.input_layernorm) is LlamaRMSNorm
    assert not [k for k in layer.mlp.__dict__ if k.startswith("_vpaged_")]
    torch.testing.assert_close(logits(model, ids()), logits(ref, ids()), atol=0, rtol=0)


def test_to_another_dtype_refits_or_falls_back_never_wrong():
    model, ref = pair("qwen3-tiny")
    prepack_linears(model)
    fuse_modules(model)
    for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.float32):
        model.to(dtype), ref.to(dtype)
        tol = TOL.get(dtype, dict(atol=1e-2, rtol=1e-2) if dtype == torch.float16 else dict(atol=1e-9, rtol=1e-9))
        torch.testing.assert_close(logits(model, ids()), logits(ref, ids()), **tol)


def test_load_state_dict_and_in_place_updates_repack_the_gate_up_weight():
    model, ref = pair("mistral-tiny")
    prepack_linears(model)
    fuse_modules(model)
    x = ids()
    logits(model, x)
    g = torch.Generator().manual_seed(4)
    new = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in ref.state_dict().items()}
    ref.load_state_dict(new)
    model.load_state_dict(new)
    torch.testing.assert_close(logits(model, x), logits(ref, x), **TOL[torch.float32])
    with torch.no_grad():
        for m in (model, ref):
            m.model.layers[1].mlp.up_proj.weight.mul_(3.0)
            m.model.layers[0].mlp.gate_proj.weight[0].zero_()
    torch.testing.assert_close(logits(model, x), logits(ref, x), **TOL[torch.float32])


def test_gate_and_up_drop_their_own_packed_copies_also_after_a_second_prepare():
    model, ref = pair("llama-tiny")
    mlp = model.model.layers[0].mlp
    for _ in range(2):  # a second engine on the same model prepares it again
        prepack_linears(model)
        fuse_modules(model, batch_hint=32)
        if mlp.__dict__.get("_vpaged_gate_up") is None:
            pytest.skip("oneDNN cannot pack here: the MLP runs its two layers")
        assert type(mlp.gate_proj) is PrepackedLinear and mlp.gate_proj.packed_weight is None
        assert mlp.up_proj.packed_weight is None and mlp.down_proj.packed_weight is not None
    fuse_modules(model, batch_hint=16)  # a new hint: the gate_up weight is packed again on the next call
    torch.testing.assert_close(logits(model, ids()), logits(ref, ids()), **TOL[torch.float32])
    assert mlp._vpaged_batch_hint == 16 and mlp.__dict__.get("_vpaged_gate_up_key") is not None


def test_deepcopy_and_pickle_rebuild_fused_modules():
    model, ref = pair("phi3-tiny")
    prepack_linears(model)
    fuse_modules(model)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert len(fused_modules(other)) == expected_count(model)
        torch.testing.assert_close(logits(other, ids()), logits(ref, ids()), **TOL[torch.float32])


def test_training_runs_the_plain_forward_and_gets_its_gradients():
    model, ref = pair("llama-tiny")
    fuse_modules(model)
    x = ids()
    grads = []
    for m in (model, ref):
        m.zero_grad()
        m(x).logits.float().square().mean().backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
    for k in grads[1]:
        torch.testing.assert_close(grads[0][k], grads[1][k], atol=1e-6, rtol=1e-5)


class TwistedRMSNorm(nn.Module):
    """An RMSNorm by name with Gemma's (1 + weight) formula: the probe must refuse it."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GeluMLP(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(n, 2 * n), nn.Linear(n, 2 * n), nn.Linear(2 * n, n)
        self.act_fn = nn.GELU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_other_formulas_behind_familiar_names_are_left_alone():
    m = nn.Sequential(TwistedRMSNorm(32), GeluMLP(32))
    assert fuse_modules(m) == 0
    assert type(m[0]) is TwistedRMSNorm and type(m[1]) is GeluMLP
    with pytest.raises(InvalidArgumentError):
        fuse_modules("model")
    with pytest.raises(InvalidArgumentError):
        fuse_modules(m, batch_hint=0)


@pytest.mark.serving
def test_engine_fuses_by_default_and_cpu_prepack_false_leaves_every_module():
    on = LLMEngine(load_model("random:qwen3-tiny")[0], kv_budget_bytes=4 << 20)
    assert on.fused_modules == expected_count(on.model) > 0
    off = LLMEngine(load_model("random:qwen3-tiny")[0], kv_budget_bytes=4 << 20, cpu_prepack=False)
    assert off.fused_modules == 0 and fused_modules(off.model) == []
