"""vpaged.hf.prepack: linear layers on packed weights (oneDNN's, or vpaged's panels) against the same model left
plain. Both plans run on every CPU (the one this CPU does not pick is forced); oneDNN's only where torch has it.

torch's private ops are checked against F.linear on the installed torch; every random-weight family the
engine serves (and a tied-embedding Gemma 3) gives the plain model's logits in fp32 and bf16; what users do
to a model (to(dtype), to(device), load_state_dict, in-place updates, deepcopy, training, a second prepare)
repacks, falls back or leaves the model as it was; the engine's greedy tokens with prepack on equal
model.generate's and the engine's with it off."""

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import vpaged.hf.prepack as prepack_module  # noqa: E402
from vpaged import _C  # noqa: E402
from vpaged.errors import InvalidArgumentError  # noqa: E402
from vpaged.hf.fused import fuse_modules  # noqa: E402
from vpaged.hf.prepack import (  # noqa: E402
    LINEAR_PLAN_ENV,
    PANEL_ROWS_MAX,
    PrepackedLinear,
    linear_plan,
    pack_weight,
    packed_linear,
    packed_linear_ops,
    prepack_linears,
    prepack_supported,
    prepacked_layers,
    unprepack,
)
from vpaged.ops.linear import PanelWeight  # noqa: E402
from vpaged.serve import RANDOM_CONFIGS, LLMEngine, SamplingParams, load_model  # noqa: E402

FAMILIES = sorted(n for n in RANDOM_CONFIGS if n.endswith("-tiny"))
FP32_OK, _ = prepack_supported(torch.float32)
needs_ops = pytest.mark.skipif(not FP32_OK, reason="this torch / CPU cannot pack fp32 weights")
HAS_ONEDNN = packed_linear_ops() is not None
needs_onednn = pytest.mark.skipif(not HAS_ONEDNN, reason="this torch has no oneDNN linear ops")
PLANS = ["panels", pytest.param("onednn", marks=needs_onednn)]


@pytest.fixture(params=PLANS)
def plan(request, monkeypatch):
    """Each packing plan, whichever this CPU picks (linear_plan is what pack_weight asks)."""
    monkeypatch.setattr(prepack_module, "linear_plan", lambda: request.param)
    return request.param


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gemma3_tied():
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg).eval()


def pair(name):
    """(model to prepare, plain reference) with equal weights."""
    if name == "gemma3-tied":
        return gemma3_tied(), gemma3_tied()
    return load_model(f"random:{name}")[0], load_model(f"random:{name}")[0]


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def ids(n=2, t=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n, t), generator=g)


# ------------------------------------------------------------------------------------------ torch's ops
@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_torchs_private_ops_exist_and_match_f_linear(rows, bias):
    reorder, linear = packed_linear_ops()
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    packed = reorder(w, 64)
    for x in (torch.randn(rows, 80, generator=g), torch.randn(1, rows, 80, generator=g), torch.randn(80, rows).t()):
        torch.testing.assert_close(linear(x, packed, b), F.linear(x, w, b), atol=2e-5, rtol=1e-4)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_a_bf16_layer_packed_in_fp32_runs_its_products_in_fp32(bias):
    """The packing a CPU without oneDNN's bf16 path gets (forced here on any CPU): bf16 in, bf16 out, each output
    the exact sum of the bf16 products rounded once, within fp32 summation error."""
    reorder, linear = packed_linear_ops()
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    w = torch.randn(96, 80, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    packed = reorder(w.float(), 64)
    assert packed.dtype == torch.float32
    for x in (torch.randn(7, 80, generator=g), torch.randn(1, 300, 80, generator=g)):
        x = x.bfloat16()
        out = linear(x, packed, b)
        exact = x.double() @ w.double().T + (0 if b is None else b.double())
        assert out.dtype == torch.bfloat16 and out.shape == exact.shape
        torch.testing.assert_close(out.double(), exact, atol=1e-4, rtol=2**-8)  # one bf16 rounding
    # pack_weight picks it where oneDNN has no bf16 path, and never leaves a bf16 layer unpacked on a CPU it packs
    assert pack_weight(w).dtype in (torch.bfloat16, torch.float32)


def test_the_plan_follows_the_kernels_cpu_path(monkeypatch):
    monkeypatch.delenv(LINEAR_PLAN_ENV, raising=False)
    assert linear_plan() == ("panels" if _C.cpu_auto_isa() == "avx2" else "onednn")
    packed = pack_weight(torch.randn(24, 16))
    assert (type(packed) is PanelWeight) == (linear_plan() == "panels")
    monkeypatch.setenv(LINEAR_PLAN_ENV, "auto")
    assert linear_plan() == ("panels" if _C.cpu_auto_isa() == "avx2" else "onednn")


@pytest.mark.parametrize("chosen", ["panels", "onednn", " OneDNN "])
def test_the_environment_picks_the_plan_and_a_bad_value_is_refused(monkeypatch, chosen):
    monkeypatch.setenv(LINEAR_PLAN_ENV, chosen)
    assert linear_plan() == chosen.strip().lower()
    monkeypatch.setenv(LINEAR_PLAN_ENV, "mkl")
    with pytest.raises(InvalidArgumentError, match="VPAGED_LINEAR_PLAN='mkl'"):
        linear_plan()
    with pytest.raises(InvalidArgumentError):
        pack_weight(torch.randn(4, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_panels_keep_the_weights_dtype_and_run_every_row_count(dtype, plan):
    """Panels hold a bf16 weight as bf16 (half oneDNN's fp32 copy on AVX2 CPUs); calls of more than
    PANEL_ROWS_MAX rows run F.linear on the plain weight, the others the panels: both the exact sum rounded once."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    w = torch.randn(40, 24, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    packed = pack_weight(w)
    if plan == "panels":
        assert type(packed) is PanelWeight and packed.dtype == dtype
        assert packed.panels.numel() * packed.panels.element_size() == 48 * 24 * w.element_size()
    for rows in (1, 5, PANEL_ROWS_MAX, PANEL_ROWS_MAX + 1):
        x = torch.randn(rows, 24, generator=g).to(dtype)
        exact = x.double() @ w.double().T + b.double()
        got = packed_linear(x, packed, b, w)
        assert got.dtype == dtype and got.shape == (rows, 40)
        torch.testing.assert_close(got.double(), exact, **TOL[dtype])


def test_past_panel_rows_bf16_panels_stay_on_the_panels_fp32_ones_run_f_linear(monkeypatch):
    """Where the plan is panels, torch's bf16 matmul runs without bf16 instructions (6-8x its fp32 time): a long
    call on bf16 panels stays on them, one on fp32 panels runs F.linear (MKL) on the plain weight."""
    monkeypatch.setattr(prepack_module, "linear_plan", lambda: "panels")
    calls = []
    plain_linear = F.linear
    monkeypatch.setattr(prepack_module.F, "linear", lambda *a: calls.append(a[0].dtype) or plain_linear(*a))
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(24, 16, generator=g).to(dtype)
        x = torch.randn(PANEL_ROWS_MAX + 1, 16, generator=g).to(dtype)
        packed = pack_weight(w)
        assert prepack_module.past_panel_rows(x, packed) == (dtype == torch.float32)
        assert not prepack_module.past_panel_rows(x[:PANEL_ROWS_MAX], packed)
        got = packed_linear(x, packed, None, w)
        torch.testing.assert_close(got.double(), x.double() @ w.double().T, **TOL[dtype])
    assert calls == [torch.float32]


def test_weights_that_cannot_be_packed_are_refused_not_guessed():
    assert pack_weight(torch.zeros(4, 4, dtype=torch.float64)) is None
    assert pack_weight(torch.zeros(4, 4, dtype=torch.float16)) is None
    assert prepack_supported(torch.float64)[0] is False
    with pytest.raises(InvalidArgumentError):
        prepack_linears(torch.nn.Linear(2, 2), batch_hint=0)
    with pytest.raises(InvalidArgumentError):
        prepack_linears("model")


# ------------------------------------------------------------------------------------------ equal outputs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", [*FAMILIES, "gemma3-tied"])
def test_a_prepared_model_gives_the_plain_models_logits(name, dtype, plan):
    model, ref = pair(name)
    model.to(dtype), ref.to(dtype)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert prepack_linears(model) == linears > 0
    assert model.get_output_embeddings() is not None and type(model.get_output_embeddings()) is PrepackedLinear
    x = ids()
    torch.testing.assert_close(logits(model, x), logits(ref, x), **TOL[dtype])
    # a batch of one row (a decode step's shape) and a longer one
    torch.testing.assert_close(logits(model, x[:1, :1]), logits(ref, x[:1, :1]), **TOL[dtype])
    torch.testing.assert_close(logits(model, ids(1, 70, 1)), logits(ref, ids(1, 70, 1)), **TOL[dtype])


@needs_ops
def test_layers_hold_a_packed_weight_once_prepared():
    model, _ = pair("llama-tiny")
    prepack_linears(model)
    assert all(m.packed_weight is not None for m in model.modules() if type(m) is PrepackedLinear)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_fused_mlp_on_panels_over_many_rows_runs_the_plain_weights_without_packing_again(monkeypatch, dtype):
    """Past PANEL_ROWS_MAX rows the fused gate_up product on fp32 panels runs F.linear on gate_proj's and up_proj's
    own weights (on bf16 panels it stays on the panels): the two layers' dropped copies stay dropped (no third copy
    of the MLP's weights), and the result is the plain model's."""
    monkeypatch.setattr(prepack_module, "linear_plan", lambda: "panels")
    model, ref = pair("llama-tiny")
    model.to(dtype), ref.to(dtype)
    prepack_linears(model)
    assert fuse_modules(model) > 0
    mlp = model.model.layers[0].mlp
    assert type(mlp.__dict__["_vpaged_gate_up"][0]) is PanelWeight
    x = torch.randn(PANEL_ROWS_MAX + 3, mlp.gate_proj.in_features).to(dtype)
    with torch.no_grad():
        got, want = mlp(x), ref.model.layers[0].mlp(x)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert mlp.gate_proj.packed_weight is None and mlp.up_proj.packed_weight is None


def test_state_dict_keys_and_values_are_unchanged():
    model, ref = pair("qwen2-tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prepack_linears(model)
    after = model.state_dict()
    assert list(after) == list(before) == list(ref.state_dict())
    for k, v in after.items():
        assert v.layout == torch.strided and torch.equal(v, before[k]), k
    assert not any("packed" in k for k in after)


def test_tied_weights_stay_tied_and_follow_the_embedding():
    model, ref = pair("gemma3-tied")
    assert model.config.tie_word_embeddings
    prepack_linears(model)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight is embed.weight
    x = ids()
    with torch.no_grad():  # an in-place update of the shared weight reaches the LM head's products
        embed.weight.mul_(1.5)
        ref.get_input_embeddings().weight.mul_(1.5)
    torch.testing.assert_close(logits(model, x), logits(ref, x), **TOL[torch.float32])
    assert head.weight is embed.weight


# ------------------------------------------------------------------------------------------ what users do
def test_to_another_dtype_repacks_or_falls_back_never_wrong():
    model, ref = pair("llama-tiny")
    prepack_linears(model)
    x = ids()
    logits(model, x)  # packed at fp32
    model.to(torch.bfloat16), ref.to(torch.bfloat16)
    torch.testing.assert_close(logits(model, x), logits(ref, x), **TOL[torch.bfloat16])
    model.to(torch.float64), ref.to(torch.float64)  # oneDNN cannot pack fp64: F.linear, exactly
    assert torch.equal(logits(model, x), logits(ref, x))
    for m in model.modules():
        if type(m) is PrepackedLinear:
            assert m.packed_weight is None


def test_to_device_falls_back_off_cpu():
    model, ref = pair("llama-tiny")
    prepack_linears(model)
    model.to("meta")  # not a CPU tensor: the layer runs F.linear (no real device needed to check it)
    head = model.get_output_embeddings()
    with torch.no_grad():
        out = head(torch.empty(3, 64, device="meta"))
    assert out.device.type == "meta" and out.shape == (3, 512) and head.packed_weight is None


def test_load_state_dict_and_in_place_updates_repack():
    model, _ = pair("phi3-tiny")
    other, _ = pair("phi3-tiny")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn_like(p))
    prepack_linears(model)
    x = ids()
    logits(model, x)
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(logits(model, x), logits(other, x), **TOL[torch.float32])
    head = model.get_output_embeddings()  # a new Parameter (the tie broken, or a user's swap)
    head.weight = torch.nn.Parameter(other.get_output_embeddings().weight.clone() * 2)
    with torch.no_grad():
        other.get_output_embeddings().weight.mul_(2)
    torch.testing.assert_close(logits(model, x), logits(other, x), **TOL[torch.float32])


def test_prepare_twice_is_idempotent_and_unprepack_restores_plain_layers():
    model, ref = pair("mistral-tiny")
    n = prepack_linears(model)
    packed = [m.packed_weight for m in model.modules() if type(m) is PrepackedLinear]
    assert prepack_linears(model) == n == len(prepacked_layers(model))
    assert [m.packed_weight for m in model.modules() if type(m) is PrepackedLinear] == packed  # same objects
    assert unprepack(model) == n and prepacked_layers(model) == []
    assert all(
        type(m) is torch.nn.Linear and not hasattr(m, "packed_weight")
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    )
    x = ids()
    assert torch.equal(logits(model, x), logits(ref, x))


def test_deepcopy_and_pickle_take_the_parameters_only(tmp_path):
    model, ref = pair("llama-tiny")
    prepack_linears(model)
    logits(model, ids())
    twin = copy.deepcopy(model)
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    for m in (twin, loaded):
        torch.testing.assert_close(logits(m, ids()), logits(ref, ids()), **TOL[torch.float32])


def test_training_runs_the_plain_layer_and_gets_its_gradients():
    model, ref = pair("llama-tiny")
    prepack_linears(model)
    model.train(), ref.train()
    x = ids()
    model(x, labels=x).loss.backward()
    ref(x, labels=x).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------ the engine


def run_greedy(eng, prompts, max_new):
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    ids_ = [eng.add_request(p, params) for p in prompts]
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out.token_ids
    return [final[i] for i in ids_]


@pytest.mark.serving
def test_engine_prepares_by_default_and_cpu_prepack_false_leaves_every_linear():
    on = LLMEngine(load_model("random:llama-tiny")[0], kv_budget_bytes=4 << 20)
    assert on.prepacked_layers == (15 if FP32_OK else 0)
    off = LLMEngine(load_model("random:llama-tiny")[0], kv_budget_bytes=4 << 20, cpu_prepack=False)
    assert off.prepacked_layers == 0
    assert all(type(m) is torch.nn.Linear for m in off.model.modules() if isinstance(m, torch.nn.Linear))
    with pytest.raises(InvalidArgumentError):
        LLMEngine("random:llama-tiny", kv_budget_bytes=4 << 20, cpu_prepack=1)


@pytest.mark.serving
@pytest.mark.parametrize("name", FAMILIES)
def test_engine_greedy_tokens_equal_generate_and_the_plain_engine(name):
    from test_serve_engine import check_greedy_against_generate

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in (5, 33, 70, 1)]
    max_new = 8
    on = LLMEngine(load_model(f"random:{name}")[0], kv_budget_bytes=4 << 20, max_num_batched_tokens=32)
    off = LLMEngine(
        load_model(f"random:{name}")[0], kv_budget_bytes=4 << 20, max_num_batched_tokens=32, cpu_prepack=False
    )
    second = LLMEngine(on.model, kv_budget_bytes=4 << 20, max_num_batched_tokens=32)  # the same model again
    assert second.prepacked_layers == on.prepacked_layers
    tokens_on, tokens_off, tokens_second = (run_greedy(e, prompts, max_new) for e in (on, off, second))
    reference = load_model(f"random:{name}")[0]
    tolerated = sum(check_greedy_against_generate(reference, p, t, max_new) for p, t in zip(prompts, tokens_on))
    assert tolerated <= 1
    near_ties = sum(check_greedy_against_generate(reference, p, t, max_new) for p, t in zip(prompts, tokens_off))
    if tolerated == near_ties == 0:
        assert tokens_on == tokens_off == tokens_second
