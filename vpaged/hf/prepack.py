"""prepack_linears: run a transformers model's dense linear layers on weights packed once (oneDNN, or vpaged's
panel product on AVX2 CPUs).

On CPU, F.linear hands each product to MKL with the weight in its plain [out, in] layout, and MKL re-blocks
the weight on every call. oneDNN can take the weight already blocked for the machine's kernels: torch ships
the two ops its inductor freezing pass emits for this (the ones vLLM's CPU backend relies on too),

    packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)         # once
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")      # every call

and prepack_linears puts them under every nn.Linear of a model (the LM head included) without touching the
model's code:

    from vpaged.hf.prepack import prepack_linears, unprepack
    prepack_linears(model)          # model.generate(...) and the serving engine run the packed products
    unprepack(model)                # every layer back to a plain nn.Linear

Each layer keeps its parameters (state_dict, load_state_dict, tied weights and optimizers see the model as
before); only its class changes, to PrepackedLinear, a subclass of nn.Linear whose forward keeps the packed
weight beside the parameter, keyed by what the weight is (its storage, version counter, dtype, device and
shape). Whatever changes the weight - model.to(dtype or device), load_state_dict, an in-place update, a new
Parameter - changes the key, and the next call packs again, or runs F.linear where packing cannot apply
(not on CPU, not fp32 / bf16, no oneDNN). On a CPU without the instructions oneDNN's bf16 path needs, a bf16
layer is packed in fp32 and its products run in fp32 (pack_weight says why). A call
that autograd records (grad enabled and a weight or input that requires grad) runs F.linear: the packed
weight is for inference, training sees the plain layer. The cost is memory: the packed copy sits beside the
plain weight, which state_dict() must keep returning.

torch's ops are private: they are named in one place, `packed_linear_ops()`, which says whether they exist
here, and tests/hf/test_prepack.py checks them against F.linear on the installed torch.

Where vpaged's kernels run their AVX2 path (CPUs with AVX2 and without AVX-512, or VPAGED_CPU_ISA=avx2), the packed
copy is vpaged's instead (vpaged.ops.linear: the weight in 16-output panels, its own dtype), in place of oneDNN's, so
memory stays as it was: on such a CPU (a 2-core Zen 3) the panel product takes SmolLM2-135M's 30 layers at 1-32
rows (decode steps) in 0.55-0.74x oneDNN's time and a bf16 weight stays bf16 (0.36-0.77x: oneDNN packs it in fp32
there), while prompt chunks of ~512 rows take 1.06-1.11x (benchmarks/bench_linear.py, and its --engine run, where
a burst of 32 prompts came out level). Calls of more than PANEL_ROWS_MAX rows on an fp32 weight run F.linear on the
plain weight (MKL; a bf16 weight stays on its panels: torch's bf16 matmul is 6-8x slower there).
linear_plan() says which copy this process makes; on AVX-512 and AMX CPUs oneDNN's wider kernels keep the products
(the panel product is not measured against them there). VPAGED_LINEAR_PLAN=panels or onednn overrides it for the
process.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from .. import _C
from ..errors import InvalidArgumentError
from ..ops.linear import PanelWeight, pack_panels, panel_linear

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
DEFAULT_BATCH_HINT = 64
# Calls of more rows than this on fp32 panels run F.linear on the plain weight instead (bench_linear.py: at 2,048
# rows the panel product re-reads its weight once per chunk of rows and falls 3-8 % behind MKL; below, MKL is the
# slower one, 1.1-1.3x the panels' time at 128-512 rows). bf16 panels take every call: where the plan is panels
# (AVX2 CPUs) torch's bf16 matmul has no bf16 instructions to run on and takes 6-8x the fp32 time.
PANEL_ROWS_MAX = 1024


# The packed copies pack_weight can make (linear_plan): vpaged's panels or oneDNN's copy.
LINEAR_PLANS = ("panels", "onednn")
LINEAR_PLAN_ENV = "VPAGED_LINEAR_PLAN"


def linear_plan() -> str:
    """Which packed copy pack_weight makes in this process (one of LINEAR_PLANS): VPAGED_LINEAR_PLAN where it is set
    to one of them; unset or "auto": "panels" where vpaged's kernels run their AVX2 path (cpu_auto_isa, capped by
    VPAGED_CPU_ISA), else "onednn". Any other value raises InvalidArgumentError."""
    chosen = os.environ.get(LINEAR_PLAN_ENV, "auto").strip().lower() or "auto"
    if chosen == "auto":
        return "panels" if _C.cpu_auto_isa() == "avx2" else "onednn"
    if chosen not in LINEAR_PLANS:
        raise InvalidArgumentError(f"{LINEAR_PLAN_ENV}={chosen!r}: expected auto, {', '.join(LINEAR_PLANS)}")
    return chosen


_OPS: tuple | None = None


def packed_linear_ops():
    """(reorder, linear) - torch's oneDNN weight packing and the matmul on a packed weight - or None where this
    torch has no oneDNN or lacks the ops. The only place vpaged names them."""
    global _OPS
    if _OPS is None:
        ops = None
        if torch.backends.mkldnn.is_available():
            mkldnn = torch.ops.mkldnn
            if hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise"):
                reorder, pointwise = mkldnn._reorder_linear_weight, mkldnn._linear_pointwise

                def linear(x, packed, bias):
                    if packed.dtype != x.dtype:  # a bf16 layer packed in fp32 (pack_weight): products in fp32
                        bias = None if bias is None else bias.to(packed.dtype)
                        return pointwise(x.to(packed.dtype), packed, bias, "none", [], "").to(x.dtype)
                    return pointwise(x, packed, bias, "none", [], "")

                ops = (reorder, linear)
        _OPS = (ops,)
    return _OPS[0]


def weight_key(weight: torch.Tensor):
    """What the packed copy was made from, or None where the weight cannot be tracked (an inference tensor
    has no version counter: an in-place change would go unseen, so such a weight is never packed)."""
    try:
        version = weight._version
    except RuntimeError:
        return None
    return (weight.data_ptr(), version, weight.dtype, weight.device, tuple(weight.shape))


class PrepackedLinear(nn.Linear):
    """An nn.Linear whose forward runs oneDNN's matmul on its weight packed once (see the module's text).

    Built by prepack_linears from an existing nn.Linear (its class is swapped; parameters stay); the packed
    copy is a plain attribute, not a parameter or buffer, so state_dict and .to() see the layer as before."""

    batch_hint: int
    packed_weight: torch.Tensor | None
    packed_key: tuple | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
            return F.linear(x, weight, self.bias)
        packed = self.current_packed()
        if packed is None or x.dtype != weight.dtype or x.device != weight.device:
            return F.linear(x, weight, self.bias)
        bias = self.bias
        if bias is not None and (bias.dtype != weight.dtype or bias.device != weight.device):
            return F.linear(x, weight, bias)
        return packed_linear(x, packed, bias, weight)

    def current_packed(self):
        """The packed copy of the weight as it is now (packed again if it changed since), or None where it cannot
        be packed or tracked (calls then run F.linear on the plain weight)."""
        key = weight_key(self.weight)
        if key is None:
            return None
        if key != self.packed_key:
            self.packed_weight = pack_weight(self.weight, self.batch_hint)
            self.packed_key = key
        return self.packed_weight

    def __getstate__(self):
        # copy.deepcopy and pickle take the parameters; the packed copy is made again by the next call.
        state = self.__dict__.copy()
        state["packed_weight"] = state["packed_key"] = None
        return state

    def extra_repr(self) -> str:
        return super().extra_repr() + f", prepacked (batch_hint={self.batch_hint})"


def past_panel_rows(x: torch.Tensor, packed) -> bool:
    """Whether prepack's plan runs this call on the plain weight (F.linear) rather than on `packed`: fp32 panels and
    more than PANEL_ROWS_MAX rows of x."""
    return type(packed) is PanelWeight and packed.dtype == torch.float32 and x.numel() > PANEL_ROWS_MAX * x.shape[-1]


def packed_linear(x: torch.Tensor, packed, bias: torch.Tensor | None = None, weight: torch.Tensor | None = None):
    """x @ W.T (+ bias) on W's packed copy (pack_weight's result: a PanelWeight or oneDNN's tensor), in x's dtype.
    With the plain weight given, a call past_panel_rows runs F.linear on it instead."""
    if type(packed) is PanelWeight:
        if weight is not None and past_panel_rows(x, packed):
            return F.linear(x, weight, bias)
        return panel_linear(x, packed, bias)
    return packed_linear_ops()[1](x, packed, bias)


def pack_weight(weight: torch.Tensor, batch_hint: int = DEFAULT_BATCH_HINT):
    """The weight's packed copy for packed_linear - vpaged's panels where linear_plan() says "panels", else
    oneDNN's packing for `batch_hint`-row products - or None where it cannot be packed (see prepack_linears): the
    caller then runs F.linear.

    oneDNN: a bf16 weight on a CPU whose oneDNN has no bf16 path (no avx512bw/vl/dq, no avx_ne_convert: AVX2-only
    CPUs) is packed as its fp32 copy, and its products run in fp32 (packed_linear_ops' linear converts the input
    and the result): the products of bf16 values are exact in fp32 and the sums are fp32, as in oneDNN's bf16
    path, while torch's own bf16 matmul on such a CPU ran 6.8x slower than fp32 (512 x 1024 x 2816, AMD Zen 3, one
    thread). The packed copy then takes twice the bf16 weight's bytes. Panels keep the weight's dtype."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or weight.dim() != 2 or 0 in weight.shape:
        return None
    if linear_plan() == "panels":
        return pack_panels(weight)
    return pack_onednn(weight, batch_hint)


def pack_onednn(weight: torch.Tensor, batch_hint: int = DEFAULT_BATCH_HINT) -> torch.Tensor | None:
    """oneDNN's packing of a CPU float32 / bfloat16 weight for `batch_hint`-row products (a bf16 weight as its fp32
    copy where oneDNN has no bf16 path: see pack_weight), or None where this torch cannot pack it."""
    ops = packed_linear_ops()
    if ops is None:
        return None
    with torch.no_grad():
        try:
            return ops[0](weight.detach(), batch_hint)
        except RuntimeError:
            if weight.dtype != torch.bfloat16:
                return None
        try:
            return ops[0](weight.detach().float(), batch_hint)
        except RuntimeError:
            return None


def prepack_supported(dtype: torch.dtype = torch.float32) -> tuple[bool, str | None]:
    """(True, None) when this torch and CPU pack weights of `dtype`, else (False, why)."""
    if linear_plan() == "panels" and dtype in PACKABLE_DTYPES:
        return True, None
    if packed_linear_ops() is None:
        return False, "this torch has no oneDNN linear ops (torch.ops.mkldnn._reorder_linear_weight)"
    if dtype not in PACKABLE_DTYPES:
        return False, f"oneDNN packs {[str(d) for d in PACKABLE_DTYPES]} weights, not {dtype}"
    if pack_weight(torch.zeros(8, 8, dtype=dtype)) is None:
        return False, f"oneDNN cannot pack {dtype} weights on this CPU"
    return True, None


def prepack_linears(model: nn.Module, batch_hint: int = DEFAULT_BATCH_HINT) -> int:
    """Turn every dense nn.Linear of `model` into a PrepackedLinear; returns how many layers are prepared.

    Idempotent: a layer prepared before keeps its packed weight (a new batch_hint repacks it on the next
    call). Subclasses of nn.Linear other than PrepackedLinear (quantized or LoRA layers) are left alone: their
    forward is theirs. Packing happens here for the layers that can be packed, so the first forward does not
    pay for it; a layer whose weight cannot be packed (see the module's text) runs F.linear."""
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"prepack_linears needs an nn.Module, got {type(model).__name__}")
    if isinstance(batch_hint, bool) or not isinstance(batch_hint, int) or batch_hint < 1:
        raise InvalidArgumentError(f"batch_hint must be an int >= 1, got {batch_hint!r}")
    prepared = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PrepackedLinear
            module.packed_weight = None
            module.packed_key = None
        elif type(module) is not PrepackedLinear:
            continue
        if getattr(module, "batch_hint", None) != batch_hint:
            module.batch_hint = batch_hint
            module.packed_key = None
        key = weight_key(module.weight)
        if key is not None and key != module.packed_key:
            module.packed_weight = pack_weight(module.weight, batch_hint)
            module.packed_key = key
        prepared += 1
    return prepared


def unprepack(model: nn.Module) -> int:
    """Every PrepackedLinear of `model` back to a plain nn.Linear (packed copies dropped); returns how many."""
    undone = 0
    for module in model.modules():
        if type(module) is PrepackedLinear:
            for name in ("packed_weight", "packed_key", "batch_hint"):
                module.__dict__.pop(name, None)
            module.__class__ = nn.Linear
            undone += 1
    return undone


def prepacked_layers(model: nn.Module) -> list[str]:
    """Names of the model's layers that run prepacked."""
    return [name for name, m in model.named_modules() if type(m) is PrepackedLinear]
