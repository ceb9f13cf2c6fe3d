"""DirectForward: the engine's packed step through a Llama-family decoder as direct calls, not transformers' forward.

transformers runs each decoder layer through several Python frames (the layer, its attention, the attention
interface, decorators that merge config defaults and record outputs) and ~25 small tensor ops around the six
products: views, transposes, the rotary embedding as eight element-wise ops (cat, neg, two products and a sum, for q
and for k), the residual adds. On a small model these cost as much as the products: SmolLM2-135M's 30 layers in
bf16 on a 2-core Zen 4 took a batch-1 decode step in 31 ms, of which the products were 18.6 ms
(benchmarks/NOTES.md). Walked here, a layer is

    x, residual = add_rms_norm(h, residual)          # the residual add and the next RMSNorm, one pass
    qkv = packed_linear(x, [Wq; Wk; Wv])             # one product for the three projections
    rotary_(qkv's q and k heads, cos, sin)           # in place, one pass, one call for both
    out = step.attend_rows(layer, q, k, v, scale)    # the store's K/V write and attention, as before
    h = o_proj(out); x, residual = add_rms_norm(h, residual); h = mlp(x)

with the model's own modules and weights: its embedding, its rotary module for cos / sin (so every rope type
transformers implements is the model's own), its fused RMSNorms and gated MLP (vpaged.hf.fused), its packed
linear layers (vpaged.hf.prepack), its LM head on the kept rows. Each op rounds where the eager code rounds
(vpaged.ops.fused), so the logits equal the transformers forward's up to the order of sums.

Who qualifies (DirectForward.build says why not): a CausalLM of model_type llama, mistral, qwen2 or qwen3 on the
CPU in float32 / bfloat16, prepared by the engine (cpu_prepack: every RMSNorm and the MLPs run fused, which their
own probes admitted), with the decoder structure those classes have (q/k/v/o projections, Qwen3's q/k norms, no
other children). Then a probe: a few random tokens through both forwards, over the same attention, must give the
same logits; a model that differs in anything not checked above (a scaling, an extra term) fails it and keeps
the transformers forward. The weights are read on every call, never copied, except the [q; k; v] weight, which
is packed again when any of the three changes (as the fused MLP packs its [gate; up]).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgumentError
from ..hf.fused import is_fused_gated_mlp, is_fused_rms_norm
from ..hf.prepack import (
    DEFAULT_BATCH_HINT,
    PrepackedLinear,
    pack_weight,
    packed_linear,
    past_panel_rows,
    weight_key,
)
from ..ops.fused import FUSED_DTYPES, add_rms_norm_rows, rms_norm, rotary_rows, silu_mul

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_LINEARS = (nn.Linear, PrepackedLinear)
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


class _Layer:
    """One decoder layer: its modules (read once: attribute lookups on nn.Modules are slow), and what the walk
    runs on, read from them again by refresh() whenever a weight changed."""

    __slots__ = (
        "attn", "mlp", "in_norm", "post_norm", "q_norm", "k_norm", "o_proj", "down_proj", "index", "scale",
        "qkv_key", "qkv", "o", "gate_up", "down",
    )  # fmt: skip

    def __init__(self, layer: nn.Module, index: int):
        attn = layer.self_attn
        self.attn = attn
        self.mlp = layer.mlp
        self.in_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.o_proj = attn.o_proj
        self.down_proj = layer.mlp.down_proj
        self.index = index
        self.scale = attn.scaling
        self.qkv_key = self.qkv = self.o = self.gate_up = self.down = None

    def tensors(self) -> list[torch.Tensor]:
        """Every weight and bias the walk reads (their identities and versions say when to refresh)."""
        modules = [self.in_norm, self.post_norm, self.attn.q_proj, self.attn.k_proj, self.attn.v_proj, self.o_proj]
        modules += [self.mlp.gate_proj, self.mlp.up_proj, self.down_proj]
        modules += [m for m in (self.q_norm, self.k_norm) if m is not None]
        out = []
        for m in modules:
            out.append(m.weight)
            if getattr(m, "bias", None) is not None:
                out.append(m.bias)
        return out

    def refresh(self, batch_hint: int) -> None:
        """Read the packed copies again: [q; k; v] packed here when a weight changed, o_proj's and down_proj's own
        (PrepackedLinear), the MLP's [gate; up] (its fused forward's)."""
        attn = self.attn
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        tensors = [p.weight for p in projections] + [p.bias for p in projections if p.bias is not None]
        key = tuple(weight_key(t) for t in tensors)
        if None in key:
            self.qkv, self.qkv_key = (None, None), None
        elif key != self.qkv_key:
            with torch.no_grad():
                packed = pack_weight(torch.cat([p.weight for p in projections]), batch_hint)
                bias = None if attn.q_proj.bias is None else torch.cat([p.bias for p in projections])
            self.qkv, self.qkv_key = (packed, bias), key
        self.o = _packed_of(self.o_proj)
        self.down = _packed_of(self.down_proj)
        self.gate_up = self.mlp.packed_gate_up()

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x @ [Wq; Wk; Wv].T (+ biases): [rows, (heads + 2 kv_heads) * head_dim], q's columns, then k's, then v's.
        One product on the packed [q; k; v] weight; where prepack's plan runs the plain weights (fp32 panels past
        PANEL_ROWS_MAX rows) or nothing could be packed, the three plain products side by side."""
        packed, bias = self.qkv
        if packed is None or past_panel_rows(x, packed):
            attn = self.attn
            return torch.cat([F.linear(x, p.weight, p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj)], dim=1)
        return packed_linear(x, packed, bias)

    def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The fused gated MLP's forward on the packed copies refresh() read (the module's own forward where it
        would run its plain weights)."""
        gate_up = self.gate_up
        if gate_up is None or past_panel_rows(x, gate_up[0]):
            return self.mlp(x)
        return _linear(silu_mul(packed_linear(x, *gate_up)), self.down, self.down_proj)

    def drop_split_copies(self) -> None:
        """The q/k/v layers' own packed copies (prepack_linears made them): the walk runs the packed [q; k; v]
        product instead; a direct call of a layer (the transformers forward) packs it again."""
        for p in (self.attn.q_proj, self.attn.k_proj, self.attn.v_proj):
            if type(p) is PrepackedLinear:
                p.packed_weight = p.packed_key = None


def _stale_marker(direct: DirectForward):
    """The registration hook of a walk: marks it stale, without keeping it (or its model) alive."""
    ref = weakref.ref(direct)

    def mark(module, name, param):
        target = ref()
        if target is not None:
            target._stale = True

    return mark


def _packed_of(linear: nn.Module):
    """A linear layer's current packed copy (PrepackedLinear), or None: then the walk calls the layer itself."""
    return linear.current_packed() if type(linear) is PrepackedLinear else None


def _linear(x: torch.Tensor, packed, layer: nn.Module) -> torch.Tensor:
    if packed is None:
        return layer(x)
    return packed_linear(x, packed, layer.bias, layer.weight)


class DirectForward:
    """forward(input_ids [T], position_ids [T], keep [K], step) -> logits [K, vocab] of a packed step."""

    def __init__(self, model: nn.Module, batch_hint: int = DEFAULT_BATCH_HINT):
        body = model.model
        config = model.config.get_text_config(decoder=True)
        self.model = model
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.final_norm = body.norm
        self.lm_head = model.lm_head
        self.layers = [_Layer(layer, i) for i, layer in enumerate(body.layers[: config.num_hidden_layers])]
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(self.layers[0].attn.head_dim)
        self.batch_hint = batch_hint
        self._tensors: list[torch.Tensor] = []
        self._versions: list | None = None
        # A parameter assigned anywhere (a new nn.Parameter on a layer) makes the walk read its modules again.
        self._stale = True
        self._hook = torch.nn.modules.module.register_module_parameter_registration_hook(_stale_marker(self))

    def close(self) -> None:
        """Remove the parameter-registration hook (the engine calls it when it closes; a collected walk's hook
        does nothing)."""
        self._hook.remove()

    def _current(self) -> None:
        """Refresh every layer whose weights changed since the last step (identity, storage or in-place version)."""
        if self._stale:
            tensors = [t for layer in self.layers for t in layer.tensors()]
            dtype = self.embed.weight.dtype
            if any(
                t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu" or t.is_inference() for t in tensors
            ):
                raise InvalidArgumentError(
                    f"the model's weights are no longer dense CPU {dtype} tensors with version counters: the engine's "
                    "model was changed under it (build a new engine for a model in another dtype, on another device "
                    "or made under inference_mode)"
                )
            self._tensors, self._stale, self._versions = tensors, False, None
        versions = [(t.data_ptr(), t._version) for t in self._tensors]
        if versions != self._versions:
            for layer in self.layers:
                layer.refresh(self.batch_hint)
            self._versions = versions

    @classmethod
    def build(cls, model: nn.Module, batch_hint: int = DEFAULT_BATCH_HINT) -> tuple[DirectForward | None, str | None]:
        """(a DirectForward, None) for a model that qualifies (see the module's text), else (None, why not)."""
        why = _why_not(model)
        if why is not None:
            return None, why
        direct = cls(model, batch_hint)
        why = direct._probe()
        if why is not None:
            direct.close()
            return None, why
        for layer in direct.layers:
            layer.drop_split_copies()
        return direct, None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor, step) -> torch.Tensor:
        with torch.inference_mode():
            self._current()
            h = F.embedding(input_ids, self.embed.weight)  # [T, hidden]
            cos, sin = self.rotary(h, position_ids.unsqueeze(0))
            cos, sin = cos[0], sin[0]
            t = h.shape[0]
            heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
            q_end, k_end = heads * dim, (heads + kv_heads) * dim
            residual = None
            for layer in self.layers:
                norm = layer.in_norm
                if residual is None:  # the first layer: the embedding (a fresh tensor) is the residual
                    residual = h
                    x = rms_norm(h, norm.weight, norm.variance_epsilon)
                else:
                    x = add_rms_norm_rows(h, residual, norm.weight, norm.variance_epsilon)
                qkv = layer.project_qkv(x)
                q = qkv[:, :q_end].view(t, heads, dim)
                k = qkv[:, q_end:k_end].view(t, kv_heads, dim)
                v = qkv[:, k_end:].view(t, kv_heads, dim)
                if layer.q_norm is not None:  # Qwen3: an RMSNorm over each head before the rotation
                    q = rms_norm(q, layer.q_norm.weight, layer.q_norm.variance_epsilon)
                    k = rms_norm(k, layer.k_norm.weight, layer.k_norm.variance_epsilon)
                    rotary_rows(q, cos, sin)
                    rotary_rows(k, cos, sin)
                else:  # q's and k's heads are neighbours in each qkv row: one call rotates both
                    rotary_rows(qkv[:, :k_end].view(t, heads + kv_heads, dim), cos, sin)
                out = step.attend_rows(layer.index, q, k, v, layer.scale)
                h = _linear(out.view(t, heads * dim), layer.o, layer.o_proj)
                norm = layer.post_norm
                x = add_rms_norm_rows(h, residual, norm.weight, norm.variance_epsilon)
                h = layer.mlp_forward(x)
            h, residual = h[keep], residual[keep]  # the rows whose logits are asked for, in keep's order
            norm = self.final_norm
            x = add_rms_norm_rows(h, residual, norm.weight, norm.variance_epsilon)
            return self.lm_head(x)

    def _probe(self) -> str | None:
        """Whether this walk gives the transformers forward's logits on a few random tokens (both over the same
        plain causal attention); None when it does, else why not."""
        model = self.model
        vocab = self.embed.weight.shape[0]
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (6,), generator=gen)
        positions = torch.arange(3, 9)
        keep = torch.arange(6)
        step = _ProbeStep()
        try:
            with torch.inference_mode():
                ours = self.forward(ids, positions, keep, step).double()
                ref = (
                    model(
                        input_ids=ids.unsqueeze(0),
                        position_ids=positions.unsqueeze(0),
                        attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool),
                        use_cache=False,
                        vpaged_step=step,
                    )
                    .logits[0]
                    .double()
                )
        except Exception as e:  # noqa: BLE001 - any failure of the walk means: keep the transformers forward
            return f"the direct forward failed its probe: {type(e).__name__}: {e}"
        if ours.shape != ref.shape or not bool(torch.isfinite(ours).all()):
            return "the direct forward's probe logits are not the transformers forward's"
        scale = max(ref.abs().max().item(), 1e-30)
        tol = 1e-3 if self.embed.weight.dtype == torch.float32 else 5e-2
        err = (ours - ref).abs().max().item() / scale
        if err > tol:
            return f"the direct forward's probe logits differ from the transformers forward's by {err:.2e} of their max"
        return None


class _ProbeStep:
    """A StepAttention's two entries for one sequence of new tokens at positions 3.. with no cached prefix: plain
    causal attention over the step's own K/V (what both forwards of the probe attend through)."""

    def attend_rows(self, layer, q, k, v, scale):
        group = q.shape[1] // k.shape[1]
        qh = q.transpose(0, 1).unsqueeze(0)
        kh = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        vh = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        return o[0].transpose(0, 1).contiguous()

    def attend(self, layer, query, key, value, scale):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        return self.attend_rows(layer, q, k, v, scale).unsqueeze(0)


def _why_not(model: nn.Module) -> str | None:
    """Why the structure of `model` does not fit the walk (None: it fits)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {MODEL_TYPES}"
    body = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if (
        body is None
        or any(not hasattr(body, p) for p in parts)
        or not isinstance(getattr(model, "lm_head", None), _LINEARS)
    ):
        return "the model has not the decoder's usual parts (model.embed_tokens / layers / norm / rotary_emb, lm_head)"
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype not in FUSED_DTYPES:
        return f"the direct forward runs float32 / bfloat16 models on the CPU, not {p.dtype} on {p.device}"
    if any(t.is_inference() for t in model.parameters()):
        return (
            "the model's weights are inference tensors (made under torch.inference_mode): no version counter "
            "shows their changes"
        )
    if not isinstance(body.embed_tokens, nn.Embedding) or not is_fused_rms_norm(body.norm):
        return "the embedding or the final norm is not a plain nn.Embedding / a fused RMSNorm"
    for i, layer in enumerate(body.layers):
        if set(dict(layer.named_children())) != _LAYER_PARTS:
            return f"layer {i} has other parts than {sorted(_LAYER_PARTS)}"
        if not is_fused_rms_norm(layer.input_layernorm) or not is_fused_rms_norm(layer.post_attention_layernorm):
            return f"layer {i}'s norms do not run fused (cpu_prepack off, or their probe refused them)"
        if not is_fused_gated_mlp(layer.mlp):
            return f"layer {i}'s MLP does not run fused (cpu_prepack off, or its probe refused it)"
        attn = layer.self_attn
        children = dict(attn.named_children())
        extra = set(children) - _ATTENTION_PARTS
        if not _ATTENTION_PARTS <= set(children) or extra - {"q_norm", "k_norm"} or len(extra) == 1:
            return f"layer {i}'s attention has other parts than q/k/v/o projections (and q/k norms)"
        if any(not isinstance(children[n], _LINEARS) for n in _ATTENTION_PARTS):
            return f"layer {i}'s projections are not plain linear layers"
        if extra and not all(is_fused_rms_norm(children[n]) for n in extra):
            return f"layer {i}'s q/k norms do not run fused"
        if getattr(attn, "layer_idx", i) != i or not isinstance(getattr(attn, "scaling", None), float):
            return f"layer {i}'s attention has no layer_idx {i} or no float scaling"
        if (attn.q_proj.bias is None) != (attn.k_proj.bias is None) or (attn.q_proj.bias is None) != (
            attn.v_proj.bias is None
        ):
            return f"layer {i}'s q/k/v projections have bias on some and not others"
    return None
