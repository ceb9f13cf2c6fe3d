"""fuse_modules: a transformers model's RMSNorms and gated MLPs on vpaged's fused CPU ops, its code untouched.

    from vpaged.hf.fused import fuse_modules, unfuse
    fuse_modules(model)     # model.generate(...) and the serving engine run the fused forwards
    unfuse(model)           # every module back to its own class

Eager transformers runs an RMSNorm as ~6 kernels and a gated MLP's activation as silu then a product, each a
pass over the activations (on the CPU serving path, side by side with an eager copy, the fused forwards take
1-4 % off a step: benchmarks/NOTES.md). fuse_modules swaps, by class, the modules whose forward it can replace
with vpaged.ops.fused:

  * an RMSNorm of the Llama formula (weight * (x * rsqrt(mean(x**2) + eps)), a `weight` and a
    `variance_epsilon`: Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, Mixtral, ...) runs ops.fused.rms_norm;
  * a gated MLP with SiLU (gate_proj / up_proj / down_proj, or Phi-3's gate_up_proj / down_proj) runs its
    gate and up products as one product (where vpaged.hf.prepack packs weights: the two weights concatenated
    and packed once, as it packs single layers), then ops.fused.silu_mul, then down_proj.

A module qualifies by its structure and then by a probe: its own forward and the fused one run on the same
random rows at construction, and a module whose results differ (another formula behind a familiar name, e.g.
Gemma's (1 + weight)) is left alone. Only the class changes (to a subclass of the module's own, so isinstance
holds); parameters, state_dict, load_state_dict and tied weights are as before. Each call checks its input:
a dtype or device the fused ops do not take (float16, CUDA), or a call autograd records, runs the module's
own forward. The concatenated gate_up weight is keyed by both weights (storage, version, dtype, device, shape,
as prepack's), so model.to(...), load_state_dict or an in-place update repack it on the next call. A pickled or
deep-copied module is rebuilt fused from its state (the packed copy is made again).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgumentError
from ..ops.fused import FUSED_DTYPES, rms_norm, silu_mul
from .prepack import DEFAULT_BATCH_HINT, PrepackedLinear, pack_weight, packed_linear, past_panel_rows, weight_key

_PLAIN_LINEARS = (nn.Linear, PrepackedLinear)
_FUSED_CLASSES: dict[tuple[type, type], type] = {}


def _inference_call(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a call on x with this weight can run the fused ops: CPU, float32 / bfloat16 of the weight's
    dtype, and nothing for autograd to record."""
    if x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype not in FUSED_DTYPES or x.dtype != weight.dtype:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


class _Fused:
    """What every fused class shares: its plain class (`_vpaged_plain`), and pickling / deep copies as that
    class's state rebuilt fused."""

    _vpaged_plain: type

    def __reduce_ex__(self, protocol):
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_vpaged_")}
        return _rebuild_fused, (self._vpaged_plain, _mixin_of(type(self))), state


class _FusedRMSNorm(_Fused):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            not _inference_call(hidden_states, weight)
            or weight.dim() != 1
            or hidden_states.shape[-1] != weight.shape[0]
        ):
            return self._vpaged_plain.forward(self, hidden_states)
        return rms_norm(hidden_states, weight, self.variance_epsilon)


class _FusedGatedMLP(_Fused):
    """gate_proj / up_proj / down_proj with SiLU: down(silu(gate(x)) * up(x)), the gate and up products as one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj, self.up_proj
        if not _inference_call(x, gate.weight) or up.weight.dtype != x.dtype:
            return self._vpaged_plain.forward(self, x)
        packed = self.packed_gate_up()
        if packed is None:
            return self.down_proj(silu_mul(gate(x), up(x)))
        if past_panel_rows(x, packed[0]):
            # prepack's plan for so many rows: F.linear on the plain weights (not gate(x): a layer whose copy was
            # dropped here would pack it again)
            return self.down_proj(silu_mul(F.linear(x, gate.weight, gate.bias), F.linear(x, up.weight, up.bias)))
        return self.down_proj(silu_mul(packed_linear(x, *packed)))

    def packed_gate_up(self):
        """(packed [gate; up] weight, bias or None), made again whenever either weight or bias changed; None where
        it cannot be packed (then the two layers run as they are)."""
        gate, up = self.gate_proj, self.up_proj
        parts = (gate.weight, up.weight, gate.bias, up.bias)
        key = tuple(None if t is None else weight_key(t) for t in parts)
        if any(k is None for k, t in zip(key, parts) if t is not None):
            return None  # an untrackable (inference) tensor: never cache a copy of it
        if key != self.__dict__.get("_vpaged_gate_up_key"):
            packed = None
            if (gate.bias is None) == (up.bias is None):
                with torch.no_grad():
                    w = pack_weight(
                        torch.cat([gate.weight, up.weight]), self.__dict__.get("_vpaged_batch_hint", DEFAULT_BATCH_HINT)
                    )
                    if w is not None:
                        bias = None if gate.bias is None else torch.cat([gate.bias, up.bias])
                        packed = (w, bias)
            self._vpaged_gate_up = packed
            self._vpaged_gate_up_key = key
        return self._vpaged_gate_up


class _FusedGateUpMLP(_Fused):
    """Phi-3's gate_up_proj / down_proj with SiLU: down(silu(gate) * up) over the halves of one product."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not _inference_call(hidden_states, self.gate_up_proj.weight):
            return self._vpaged_plain.forward(self, hidden_states)
        return self.down_proj(silu_mul(self.gate_up_proj(hidden_states)))


_MIXINS = (_FusedRMSNorm, _FusedGatedMLP, _FusedGateUpMLP)


def _mixin_of(cls: type) -> type:
    return next(m for m in _MIXINS if issubclass(cls, m))


def _fused_class(plain: type, mixin: type) -> type:
    cls = _FUSED_CLASSES.get((plain, mixin))
    if cls is None:
        cls = type(f"Fused{plain.__name__}", (mixin, plain), {"_vpaged_plain": plain, "__module__": plain.__module__})
        _FUSED_CLASSES[(plain, mixin)] = cls
    return cls


def _rebuild_fused(plain: type, mixin: type) -> nn.Module:
    """An empty module of plain's fused class (the unpickler then sets its state)."""
    obj = plain.__new__(plain)
    obj.__class__ = _fused_class(plain, mixin)
    return obj


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _mixin_for(module: nn.Module) -> type | None:
    """The fused forward a module's structure fits, or None (the probe then has the last word)."""
    if isinstance(module, _Fused):
        return None
    params = dict(module.named_parameters(recurse=False))
    children = dict(module.named_children())
    if type(module).__name__.endswith("RMSNorm"):
        w = params.get("weight")
        eps = getattr(module, "variance_epsilon", None)
        if set(params) == {"weight"} and not children and w.dim() == 1 and isinstance(eps, float):
            return _FusedRMSNorm
        return None
    if params:
        return None
    linears = {k for k, c in children.items() if type(c) in _PLAIN_LINEARS}
    if set(children) == {"gate_proj", "up_proj", "down_proj", "act_fn"} and linears == set(children) - {"act_fn"}:
        g, u = module.gate_proj, module.up_proj
        if _is_silu(module.act_fn) and g.weight.shape == u.weight.shape:
            return _FusedGatedMLP
    if set(children) == {"gate_up_proj", "down_proj", "activation_fn"} and linears == {"gate_up_proj", "down_proj"}:
        if _is_silu(module.activation_fn) and module.gate_up_proj.out_features % 2 == 0:
            return _FusedGateUpMLP
    return None


def _probe_input(module: nn.Module, mixin: type) -> torch.Tensor:
    if mixin is _FusedRMSNorm:
        width = module.weight.shape[0]
        ref = module.weight
    elif mixin is _FusedGatedMLP:
        width, ref = module.gate_proj.in_features, module.gate_proj.weight
    else:
        width, ref = module.gate_up_proj.in_features, module.gate_up_proj.weight
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(3, width, generator=gen) * 2).to(ref.dtype)


def _same(fused: torch.Tensor, plain: torch.Tensor) -> bool:
    if fused.shape != plain.shape or fused.dtype != plain.dtype:
        return False
    a, b = fused.double(), plain.double()
    scale = max(b.abs().max().item(), 1e-30)
    tol = 1e-4 if plain.dtype == torch.float32 else 3e-2
    return bool(torch.isfinite(a).all()) and (a - b).abs().max().item() <= tol * scale


def fuse_modules(model: nn.Module, batch_hint: int = DEFAULT_BATCH_HINT) -> int:
    """Swap every module of `model` that fits a fused forward (see the module's text) and passes the probe;
    returns how many modules run fused (those fused before included). Modules whose parameters are not float32 /
    bfloat16 on the CPU are left alone. batch_hint: the rows oneDNN packs the gate_up weight for (as
    prepack_linears'); gate_proj / up_proj drop their own packed copies, which the fused forward does not use."""
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"fuse_modules needs an nn.Module, got {type(model).__name__}")
    if isinstance(batch_hint, bool) or not isinstance(batch_hint, int) or batch_hint < 1:
        raise InvalidArgumentError(f"batch_hint must be an int >= 1, got {batch_hint!r}")
    fused = 0
    for module in list(model.modules()):
        if isinstance(module, _Fused):  # fused before: a new batch_hint repacks on the next call
            if module.__dict__.get("_vpaged_batch_hint") != batch_hint:
                module._vpaged_batch_hint = batch_hint
                module.__dict__.pop("_vpaged_gate_up_key", None)
            _drop_split_copies(module)
            fused += 1
            continue
        mixin = _mixin_for(module)
        if mixin is None:
            continue
        p = next(module.parameters())
        if p.device.type != "cpu" or p.dtype not in FUSED_DTYPES:
            continue
        plain = type(module)
        x = _probe_input(module, mixin)
        with torch.no_grad():
            expected = plain.forward(module, x)
            module.__class__ = _fused_class(plain, mixin)
            module._vpaged_batch_hint = batch_hint
            try:
                ok = _same(module.forward(x), expected)
            except Exception:  # noqa: BLE001 - any failure of the fused forward means: leave the module alone
                ok = False
        if not ok:
            _restore(module)
            continue
        _drop_split_copies(module)
        fused += 1
    return fused


def _drop_split_copies(module: nn.Module) -> None:
    """A fused gated MLP runs its packed [gate; up] product: gate_proj's and up_proj's own packed copies (a
    prepack_linears, perhaps a second one, made them) are dropped; a direct call of either packs it again."""
    if isinstance(module, _FusedGatedMLP) and module.__dict__.get("_vpaged_gate_up") is not None:
        for layer in (module.gate_proj, module.up_proj):
            if type(layer) is PrepackedLinear:
                layer.packed_weight = layer.packed_key = None


def _restore(module: nn.Module) -> None:
    module.__class__ = module._vpaged_plain
    for name in [k for k in module.__dict__ if k.startswith("_vpaged_")]:
        del module.__dict__[name]


def unfuse(model: nn.Module) -> int:
    """Every fused module of `model` back to its own class (packed copies dropped); returns how many."""
    undone = 0
    for module in model.modules():
        if isinstance(module, _Fused):
            _restore(module)
            undone += 1
    return undone


def is_fused_rms_norm(module) -> bool:
    """Whether module runs the fused RMSNorm (fuse_modules swapped it after its probe)."""
    return isinstance(module, _FusedRMSNorm)


def is_fused_gated_mlp(module) -> bool:
    """Whether module runs the fused gate / up / down MLP with SiLU (its packed_gate_up() is the [gate; up] copy)."""
    return isinstance(module, _FusedGatedMLP)


def fused_modules(model: nn.Module) -> list[str]:
    """Names of the model's modules that run fused."""
    return [name for name, m in model.named_modules() if isinstance(m, _Fused)]
