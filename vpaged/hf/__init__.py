"""vpaged.hf: the transformers integration.

VPagedCache (cache.py) is a `transformers.Cache` whose K/V live in a VirtualKVCache; groups.py holds its
layer groups, attention.py the attention function `attn_implementation="vpaged"` runs, compat.py what
differs between the supported transformers releases, prepack.py the linear layers on oneDNN-packed weights,
fused.py the RMSNorms and gated MLPs on vpaged's fused CPU ops.
Names are loaded on first use, so that `vpaged.hf.compat` (read by `vpaged info`) never imports transformers.
Importing the package makes attn_implementation="vpaged" known to transformers (now, or as soon as transformers'
modeling code loads: autoregister.py), so `import vpaged.hf` is the one line that enables it.
"""

from __future__ import annotations

from ..lazy import lazy_names
from .autoregister import register_when_transformers_loads

_NAMES = {
    "VPagedCache": "cache",
    "VPagedLayer": "cache",
    "VPagedCacheConfig": "cache_config",
    "KVGroup": "groups",
    "WindowGroup": "groups",
    "cache_keyword": "compat",
    "cache_kwargs": "compat",
    "layer_plan": "compat",
    "register_attention": "compat",
    "unregister_attention": "compat",
    "support_status": "compat",
    "serving_support": "compat",
    "PrepackedLinear": "prepack",
    "prepack_linears": "prepack",
    "unprepack": "prepack",
    "fuse_modules": "fused",
    "fused_modules": "fused",
    "unfuse": "fused",
}

__all__ = sorted(_NAMES)


__getattr__, __dir__ = lazy_names(__name__, _NAMES, globals())
register_when_transformers_loads()
