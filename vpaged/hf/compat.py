"""What differs between the transformers 5.x releases vpaged supports, in one place.

Supported: transformers 5.17 (MIN_VERSION) and later 5.x; tested on 5.17 and on the newest release
(TESTED_NEWEST) by scripts/test_transformers_versions.sh. Differences that matter to vpaged:

| what | up to | from |
| --- | --- | --- |
| keyword that hands a cache to `generate()` and `forward()` | `past_key_values=` (5.23) | `cache=` (5.24; the old name still works, with a FutureWarning) |
| `forward(cache=...)` on a release that does not know it | no error: it lands unread in `**kwargs` and every forward starts a fresh DynamicCache (wrong tokens, silently) | |
| `Cache.max_cache_len`, `Cache.max_batch_size` | read-only, deprecated properties (5.17) | gone (by 5.20) |
| `Cache.update(...)` from a model's attention layer | `(k, v, layer_idx)` (5.23) | `(k, v, layer_idx, kwargs=...)` (5.24) |
| attention functions registered with `AttentionInterface` | see the notes above `register_attention` | |

Why 5.17 is the oldest supported: it is the release on the GPU image and the oldest one the test suite runs
on (CI). Older releases, probed with greedy and 3-beam search on a left-padded batch against DynamicCache:
5.14-5.16 give identical tokens unchanged; 5.10 (and the rest of 5.5-5.13) declares the layer's
`get_max_cache_shape()` abstract, where 5.14 brought `get_max_length()`, and with that one alias also gives
identical tokens; 5.0-5.4 call `get_mask_sizes(cache_position, layer_idx)` instead of
`(query_length, layer_idx)`. None of them run through the test suite, so none is claimed.

transformers is imported only by the functions and the module `vpaged.hf` that use it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache

MIN_VERSION = (5, 17)
NEXT_MAJOR = (6, 0)  # 6.x may change the Cache API again: not claimed until tested
TESTED_NEWEST = (5, 24)
# The serving engine (vpaged.serve) needs nothing beyond what VPagedCache needs: its packed forward passes
# input_ids, position_ids, a prepared 4D mask (returned untouched by every supported release's mask
# builders), use_cache=False and its own attention kwarg, and names no cache, so the cache keyword does not
# reach it. Its greedy tokens equal model.generate's on 5.17 and 5.24 (CI). Kept separate from MIN_VERSION
# so that a release the engine cannot serve can be refused on its own.
SERVE_MIN_VERSION = MIN_VERSION


def _parse(version: str) -> tuple[int, int]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if not piece.isdigit() else piece
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (2 - len(parts)))  # type: ignore[return-value]


def installed_version() -> str | None:
    """The installed transformers version, or None when it is not installed (without importing it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def support_status(version: str | None = None) -> tuple[str | None, bool, str]:
    """(version, supported, a sentence saying why) for the installed transformers, or for `version`."""
    version = installed_version() if version is None else version
    if version is None:
        return None, False, "not installed (pip install 'vpaged[hf]')"
    v = _parse(version)
    lo, hi = ".".join(map(str, MIN_VERSION)), ".".join(map(str, NEXT_MAJOR))
    if v < MIN_VERSION:
        return version, False, f"too old: VPagedCache needs transformers >= {lo}"
    if v >= NEXT_MAJOR:
        return version, False, f"newer than the supported range (>= {lo}, < {hi}); untested"
    if v > TESTED_NEWEST:
        return (
            version,
            True,
            f"supported (>= {lo}, < {hi}); newer than the newest tested, {TESTED_NEWEST[0]}.{TESTED_NEWEST[1]}",
        )
    return version, True, f"supported (>= {lo}, < {hi})"


def serving_support(version: str | None = None) -> tuple[bool, str]:
    """(usable, why not) of the installed transformers (or `version`) for the serving engine."""
    version = installed_version() if version is None else version
    if version is None:
        return False, "transformers is not installed (pip install 'vpaged[serve]')"
    if _parse(version) < SERVE_MIN_VERSION:
        need = ".".join(map(str, SERVE_MIN_VERSION))
        return False, f"the serving engine needs transformers >= {need} (found {version})"
    return True, ""


@cache
def cache_keyword() -> str:
    """The keyword that hands a cache to `generate()` and to a model's `forward()`: "cache" from transformers
    5.24, "past_key_values" before. Read from generate()'s input preparation rather than from the version
    number, so development builds between releases get the right one."""
    from transformers import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(cache) -> dict:
    """`{keyword: cache}` for the installed transformers: `model.generate(ids, **cache_kwargs(cache))`."""
    return {cache_keyword(): cache}


# ------------------------------------------------------------------------------------------ cache base classes
def _cache_base():
    from transformers.cache_utils import Cache

    class CacheBase(Cache):
        """transformers' Cache with what differs between releases evened out, for VPagedCache to build on.

        max_cache_len and max_batch_size: plain attributes of the subclass. In 5.17 the base class has
        read-only, deprecated properties of these names (a setter-less property: assigning raised
        AttributeError); they are gone by 5.20."""

        _max_cache_len: int | None = None
        _max_batch_size: int | None = None

        @property
        def max_cache_len(self) -> int | None:
            return self._max_cache_len

        @max_cache_len.setter
        def max_cache_len(self, value: int | None) -> None:
            self._max_cache_len = value

        @property
        def max_batch_size(self) -> int | None:
            return self._max_batch_size

        @max_batch_size.setter
        def max_batch_size(self, value: int | None) -> None:
            self._max_batch_size = value

    return CacheBase


def __getattr__(name: str):
    # Built on first use, so that `import vpaged.hf.compat` (vpaged info) does not import transformers.
    if name == "CacheBase":
        value = globals()["CacheBase"] = _cache_base()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------ attention functions
# An attention function registered under a name is called by every model whose config says
# `attn_implementation=<name>`, from the attention module's forward, right after Cache.update(), as
#
#     fn(module, query, key, value, attention_mask, dropout=0.0, scaling=..., **kwargs) -> (output, weights)
#
# query [B, heads, Tq, D]; key/value [B, kv_heads, Tk, D] (what Cache.update() returned: for a VPagedCache,
# views of its pages; kv_heads may be fewer than heads); attention_mask as the mask function registered under
# the same name made it (register_attention's `mask`); output [B, Tq, heads, D], weights or None. This is the
# same in every supported release. What differs:
#   - **kwargs: Llama and Mistral pass position_ids and use_cache (and sliding_window for sliding layers) in
#     both 5.17 and 5.24 (tests/hf/test_hf_compat.py records them); other models add their own (is_causal,
#     softcap, s_aux, position_bias). A function must take **kwargs and read what it needs with .get().
#   - transformers' own sdpa_attention_forward, for a function that delegates to it: named parameters
#     is_causal and position_bias in 5.17-5.24, plus `cache` (the continuous-batching PagedAttentionCache)
#     in 5.20-5.23 only. Pass it **kwargs unchanged rather than naming these.
#   - Cache.update(): 5.24 passes the same attention kwargs to the cache, as `kwargs=`; up to 5.23 a cache
#     sees only (key, value, layer_idx).
#   - the cache keyword of forward()/generate() (cache_keyword() above).
ATTENTION_SIGNATURE = "fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs)"


def register_attention(name: str, fn: Callable, *, mask: str | Callable | None = "sdpa") -> None:
    """Register `fn` as the attention implementation `name`, so that `from_pretrained(...,
    attn_implementation=name)` or `model.set_attn_implementation(name)` routes every attention layer to it.

    mask: which mask the model builds for it: the name of a registered mask function ("sdpa": a boolean
    [B, 1, Tq, Tk] mask, None where SDPA's is_causal can stand in; "eager": an additive float mask), a mask
    function, or None: no mask at all (then `fn` must apply causality and padding itself, from kwargs).
    Registration is global (transformers' class-level mappings), idempotent, and works the same way on
    every supported release."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if not isinstance(name, str) or not name or name in ("eager", "sdpa") or name.startswith("paged|"):
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"attention name {name!r}: pick a new name, not a built-in one")
    if not callable(fn):
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"fn must be callable, got {fn!r}")
    AttentionInterface.register(name, fn)
    if mask is None:
        # transformers builds no mask for names it has no mask function for; forget one left from before.
        AttentionMaskInterface._global_mapping.pop(name, None)
        return
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS[mask] if isinstance(mask, str) else mask
    AttentionMaskInterface.register(name, mask_fn)


def unregister_attention(name: str) -> None:
    """Undo register_attention (tests)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)


# ------------------------------------------------------------------------------------------ layer kinds
def layer_plan(config) -> list[tuple[str, dict]]:
    """(layer type, keyword arguments of transformers' cache layer class) of each layer of a decoder config,
    read by transformers' own get_layer_types_and_kwargs, as its DynamicCache does. That function returns one
    kwargs dict for all layers in 5.17 and one per layer in 5.24; layers that reuse another layer's K/V are
    left out (5.17) or typed "dummy" (5.24)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config)
    if isinstance(kwargs, dict):
        kwargs = [kwargs] * len(types)
    return [(t, dict(kw)) for t, kw in zip(types, kwargs)]
