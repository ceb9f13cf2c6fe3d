"""transformers integration: VPagedCache, a `transformers.Cache` whose K/V live in one VirtualKVCache.

    from vpaged.hf import VPagedCache, cache_kwargs
    cache = VPagedCache(model.config, max_cache_len=4096, capacity_bytes=2 << 30)
    out = model.generate(input_ids, **cache_kwargs(cache), max_new_tokens=256)

(`cache_kwargs(cache)` is `{"cache": cache}` on transformers >= 5.24 and `{"past_key_values": cache}` before;
see vpaged/hf/compat.py for what differs between the supported releases.)

Each batch row is one vpaged sequence; the rows sit in consecutive slots, so one layer's K of the whole batch
is a single strided [B, T, H, D] view that update() returns transposed to the [B, H, T, D] transformers
expects, without copying. Pages are mapped as tokens arrive: memory follows the tokens generated, not
max_cache_len. Beam search and batch selection remap pages instead of copying K/V: rows that take another
row's content share its full pages, and the partly filled last page is copied only when it is next written
(copy-on-write in VirtualKVCache).

Identical prompt rows, as generate() makes them for beam search and num_return_sequences by repeating each
prompt, are stored once: during a prefill into an empty cache, a row whose K/V equal the previous row's in
every layer shares that row's pages instead of holding its own copy.

Geometry comes from the model itself: the number of layers and their kinds from the config (what must be
known before the first forward), heads, head sizes (keys and values may differ: multi-head latent
attention), dtype and device from the first K/V each kind of layer hands over.

Layer kinds (the config's layer_types, read by transformers' own function): full-attention layers are held
in vpaged; sliding-window layers too, all tokens kept (transformers' mask hides the old ones), or with
`bounded_sliding=True` only the window (plus one page) per row, in a second VirtualKVCache (vpaged/hf/groups.py);
linear-attention / Mamba layers (Jamba, Bamba, Granite-4 style hybrids) and layers without attention are
transformers' own layer classes inside the same Cache, so generate() runs those models unchanged. Other
kinds raise InvalidArgumentError at construction, naming them.

The cache holds no tensor views between calls: a view pins its pages, and a pinned page cannot be unmapped
or remapped. Inference only: K/V are written without autograd.

transformers is imported here only; `import vpaged` does not need it (extra `vpaged[hf]`).
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import CacheLayerMixin

from ..errors import InvalidArgumentError, ShapeError
from ..kvcache import CacheStats, VirtualKVCache
from ..kvcache.geometry import KVGeometry
from ..memory.device import normalize_device
from ..memory.pool import PagePool, resolve_pool
from .cache_config import VPagedCacheConfig
from .compat import CacheBase, cache_keyword, cache_kwargs, layer_plan, register_attention, support_status  # noqa: F401
from .config import ATTENTION_TYPES, config_dtype, layer_kinds
from .groups import KVGroup, WindowGroup


class VPagedLayer(CacheLayerMixin):
    """One model layer's face of a VPagedCache. The layers of one kind share a VirtualKVCache; operations that
    change the batch or the length (crop, reorder, reset, ...) act on all layers at once and live on the
    cache, so the per-layer versions refuse rather than half-apply."""

    is_compileable = False  # views come from DLPack capsules, which torch.compile cannot trace
    is_croppable = True

    def __init__(self, cache: VPagedCache, layer_idx: int, group: KVGroup):
        # No super().__init__(): it would store keys/values tensors, which here are computed views.
        self._cache = weakref.ref(cache)  # weak: layers must not keep a dropped cache's memory alive
        self._group = weakref.ref(group)
        self.layer_idx = layer_idx
        self.is_sliding = group.bounded
        if group.bounded:
            self.sliding_window = group.window

    def _owner(self) -> VPagedCache:
        cache = self._cache()
        if cache is None:
            raise InvalidArgumentError("the VPagedCache of this layer has been dropped")
        return cache

    def _kv(self) -> KVGroup:
        self._owner()
        return self._group()

    @property
    def is_initialized(self) -> bool:
        return self._kv().kv is not None

    @property
    def keys(self) -> torch.Tensor | None:
        """This layer's K as a fresh [B, H, T, D] view (None before the first update). Do not keep it across
        steps: it pins pages that reorder and crop need to remap."""
        return self._kv().views(self.layer_idx)[0]

    @property
    def values(self) -> torch.Tensor | None:
        return self._kv().views(self.layer_idx)[1]

    @property
    def batch_size(self) -> int:
        return self._owner().batch_size

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        group = self._kv()
        if group.kv is None:
            group.open(self.layer_idx, key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self._kv().update(self.layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._kv().seq_length(self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._kv().mask_sizes(self.layer_idx, query_length)

    def get_max_length(self) -> int:
        group = self._kv()
        return group.window if group.bounded else self._owner().max_cache_len

    def _whole_cache_only(self, name: str):
        raise InvalidArgumentError(f"{name}() changes every layer of a VPagedCache at once: call it on the cache")

    def reset(self) -> None:
        self._whole_cache_only("reset")

    def crop(self, tokens_to_remove: int) -> None:
        self._whole_cache_only("crop")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._whole_cache_only("reorder_cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._whole_cache_only("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._whole_cache_only("batch_select_indices")

    def offload(self):
        raise InvalidArgumentError("VPagedCache does not offload layers")

    prefetch = offload

    def __repr__(self) -> str:
        return f"VPagedLayer({self.layer_idx}{', sliding window' if self.is_sliding else ''})"


class VPagedCache(CacheBase):
    """A transformers Cache backed by VirtualKVCaches (one sequence per batch row).

        VPagedCache(model.config, max_cache_len=4096, capacity_bytes=2 << 30)          # keywords fill the record
        VPagedCache(model.config, VPagedCacheConfig(max_cache_len=4096, layout="per_layer"), pool=pool)

    Args:
        config: the model config (PreTrainedConfig): gives the layers and their kinds (layer_types) and the
            dtype. May be None when a geometry is given (then every layer is a full-attention layer).
        cache_config: a VPagedCacheConfig (vpaged/hf/cache_config.py: max_cache_len, max_batch_size, device,
            capacity_bytes, page_size, shared_budget, layout, share_prefill, bounded_sliding, dtype, kv_dtype,
            kv_scales), or its fields as keyword options instead: the record is made from them and checks them.
        geometry: a KVGeometry, when the K/V are known up front (without a config it gives the layers); the
            model's K/V must then match it (ShapeError otherwise), and its dtype / kv_dtype are the cache's (not
            given again in the record). Without one, the heads and head sizes are read from the first K/V.
        pool: a PagePool to share with other caches (instead of capacity_bytes / shared_budget). Neither: the
            device's default pool.

    The VirtualKVCaches are created at the first update of a layer of their kind, when batch size, geometry,
    dtype and device are known, and released by reset() / close() or when the cache is dropped.
    """

    def __init__(
        self,
        config=None,
        cache_config: VPagedCacheConfig | None = None,
        *,
        geometry: KVGeometry | None = None,
        pool: PagePool | None = None,
        **options,
    ):
        if cache_config is None:
            cache_config = VPagedCacheConfig.from_options("VPagedCache", options)
        elif options:
            raise InvalidArgumentError(f"give either a VPagedCacheConfig or its fields {sorted(options)}, not both")
        elif not isinstance(cache_config, VPagedCacheConfig):
            raise InvalidArgumentError(f"cache_config must be a VPagedCacheConfig, got {type(cache_config).__name__}")
        cc = cache_config
        dtype, kv_dtype = cc.dtype, cc.kv_dtype
        num_kv_heads = head_dim = v_head_dim = None
        if geometry is not None:
            if not isinstance(geometry, KVGeometry):
                raise InvalidArgumentError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
            given = [name for name, value in (("dtype", dtype), ("kv_dtype", kv_dtype)) if value is not None]
            if given:
                raise InvalidArgumentError(f"give either geometry or {', '.join(given)}, not both (it has them)")
            num_kv_heads, head_dim, v_head_dim = geometry.num_kv_heads, geometry.head_dim, geometry.v_head_dim
            dtype, kv_dtype = geometry.dtype, (geometry.kv_dtype if geometry.quantized else None)
        if config is not None:
            plan = layer_kinds(config)
            if geometry is not None and geometry.num_layers != len(plan):
                raise InvalidArgumentError(f"the geometry has {geometry.num_layers} layers, the config {len(plan)}")
            dtype = dtype if dtype is not None else config_dtype(config)
        elif geometry is None:
            raise InvalidArgumentError("give a model config, or a KVGeometry (then every layer is full attention)")
        else:
            plan = [("full_attention", {})] * geometry.num_layers
        if pool is not None and (cc.capacity_bytes is not None or cc.shared_budget is not None):
            raise InvalidArgumentError("give either pool or capacity_bytes / shared_budget, not both")
        device = normalize_device(cc.device) if cc.device is not None else (pool.device if pool else None)
        if pool is not None and device != pool.device:
            raise InvalidArgumentError(f"pool is on {pool.device}, device is {device}")
        self.cache_config = cc
        self._plan = plan
        self.max_cache_len = cc.max_cache_len
        self.max_batch_size = cc.max_batch_size
        self.layout = cc.layout
        self.dtype = dtype
        self.device = device
        self.page_size = cc.page_size
        self.share_prefill = cc.share_prefill
        self.bounded_sliding = cc.bounded_sliding
        self._capacity_bytes = cc.capacity_bytes
        self._shared_budget = cc.shared_budget
        self._pool = pool
        common = dict(
            max_len=cc.max_cache_len,
            max_batch_size=cc.max_batch_size,
            layout=cc.layout,
            dtype=dtype,
            device=device,
            page_size=cc.page_size,
            pool_for=self._pool_for,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            kv_dtype=kv_dtype,
            kv_scales=cc.kv_scales,
        )
        self.kv_dtype = kv_dtype
        windowed = [
            i
            for i, (kind, kw) in enumerate(plan)
            if self.bounded_sliding and kind == "sliding_attention" and kw.get("sliding_window")
        ]
        full = [i for i, (t, _) in enumerate(plan) if t in ATTENTION_TYPES and i not in windowed]
        windows = {plan[i][1]["sliding_window"] for i in windowed}
        if len(windows) > 1:
            raise InvalidArgumentError(f"bounded_sliding: the sliding layers have different windows {sorted(windows)}")
        self._groups: list[KVGroup] = []
        if full:
            self._groups.append(KVGroup(full, share_prefill=self.share_prefill, **common))
        if windowed:
            self._groups.append(WindowGroup(windowed, window=int(windows.pop()), **common))
        self._group_of = {layer: g for g in self._groups for layer in g.layers}
        super().__init__(layers=[self._make_layer(i) for i in range(len(plan))])

    def _make_layer(self, i: int):
        group = self._group_of.get(i)
        if group is not None:
            return VPagedLayer(self, i, group)
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

        kind, kwargs = self._plan[i]
        return DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs)

    def _pool_for(self, device: torch.device) -> PagePool | None:
        """The pool a group opens on: the one given, a private one of capacity_bytes (created once: it is this
        cache's budget, shared by its groups and kept across reset()), or None for the device's default."""
        if self._pool is None and (self._capacity_bytes is not None or self._shared_budget is not None):
            _, self._pool = resolve_pool(
                device, None, self._capacity_bytes, self.page_size, shared_budget=self._shared_budget
            )
        if self._pool is not None and self._pool.device != device:
            raise InvalidArgumentError(f"the model gives K/V on {device}; the cache's pool is on {self._pool.device}")
        return self._pool

    # --------------------------------------------------------------------------------------- properties
    # Plain attributes to the user (see CacheBase); the groups read them when they open.
    @property
    def max_cache_len(self) -> int | None:
        return self._max_cache_len

    @max_cache_len.setter
    def max_cache_len(self, value: int | None) -> None:
        self._max_cache_len = value
        for g in getattr(self, "_groups", []):
            g.max_len = value

    @property
    def max_batch_size(self) -> int | None:
        return self._max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, value: int | None) -> None:
        self._max_batch_size = value
        for g in getattr(self, "_groups", []):
            g.max_batch_size = value

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv(self) -> VirtualKVCache | None:
        """The VirtualKVCache of the full-attention layers (None before their first update)."""
        return self._groups[0].kv if self._groups and not self._groups[0].bounded else None

    @property
    def window_kv(self) -> VirtualKVCache | None:
        """The VirtualKVCache of the bounded sliding-window layers (None without them / before their update)."""
        return next((g.kv for g in self._groups if g.bounded), None)

    def _opened(self) -> list[KVGroup]:
        return [g for g in self._groups if g.kv is not None]

    @property
    def num_kv_heads(self) -> int | None:
        return self._groups[0].num_kv_heads

    @property
    def head_dim(self) -> int | None:
        return self._groups[0].head_dim

    @property
    def v_head_dim(self) -> int | None:
        return self._groups[0].v_head_dim

    @property
    def batch_size(self) -> int:
        opened = self._opened()
        return opened[0].batch_size if opened else -1

    @property
    def pool(self) -> PagePool | None:
        """The page pool under this cache (None before the first update when none was given)."""
        opened = self._opened()
        return opened[0].kv.pool if opened else self._pool

    @property
    def sequences(self) -> list[int]:
        """The vpaged sequence id of each batch row (in the full-attention layers' VirtualKVCache)."""
        return list(self._groups[0].rows)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    def _views(self, layer: int):
        return self._group_of[layer].views(layer)

    # --------------------------------------------------------------------------------------- batch edits
    def _check_idle(self, what: str) -> None:
        for g in self._groups:
            g.check_idle(what)

    def _delegated(self):
        return [layer for i, layer in enumerate(self.layers) if i not in self._group_of]

    def _delegated_select(self, sources: list[int]) -> None:
        """Row i of the transformers-held layers takes row sources[i]'s state (any number of rows)."""
        index = torch.tensor(sources, dtype=torch.long)
        for layer in self._delegated():
            if hasattr(layer, "conv_states"):  # linear attention: its reorder is an index_select of its states
                layer.reorder_cache(index)
            elif hasattr(layer, "batch_select_indices"):
                layer.batch_select_indices(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i takes the content of row beam_idx[i] (beam search), by sharing pages: full pages are mapped
        into the new row, the last partial page is copied when next written."""
        opened = self._opened()
        if not opened:
            return
        self._check_idle("reorder_cache")
        sources = self._indices(beam_idx, "beam_idx")
        if len(sources) != self.batch_size:
            raise ShapeError(f"beam_idx has {len(sources)} entries for {self.batch_size} rows")
        for g in opened:
            g.reorder(sources)
        for layer in self._delegated():
            if hasattr(layer, "conv_states"):
                layer.reorder_cache(beam_idx)

    def batch_select_indices(self, indices) -> None:
        """Keep the rows `indices` (ints, or a bool mask), in that order."""
        if not self._opened():
            return
        self._check_idle("batch_select_indices")
        idx = torch.as_tensor(indices)
        if idx.dtype == torch.bool:
            if idx.numel() != self.batch_size:
                raise ShapeError(f"mask of {idx.numel()} entries for {self.batch_size} rows")
            idx = idx.nonzero().flatten()
        self._resize(self._indices(idx, "indices"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes `repeats` neighbouring rows sharing its pages."""
        if not self._opened():
            return
        self._check_idle("batch_repeat_interleave")
        if not isinstance(repeats, int) or repeats <= 0:
            raise InvalidArgumentError(f"repeats must be a positive int, got {repeats!r}")
        self._resize([i for i in range(self.batch_size) for _ in range(repeats)])

    def _indices(self, idx, name: str) -> list[int]:
        out = torch.as_tensor(idx).flatten().tolist()
        rows = self.batch_size
        for i in out:
            if not isinstance(i, int) or not 0 <= i < rows:
                raise InvalidArgumentError(f"{name} holds {i!r}, outside 0..{rows - 1}")
        return out

    def _resize(self, sources: list[int]) -> None:
        if not sources:
            raise InvalidArgumentError("a cache needs at least one row")
        for g in self._opened():
            g.resize(sources)
        self._delegated_select(sources)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens of every row (transformers 5 passes a negative count;
        crop(0) does nothing). Pages past the new end return to the pool."""
        if not isinstance(tokens_to_remove, int) or isinstance(tokens_to_remove, bool):
            raise InvalidArgumentError(f"crop takes an int, got {tokens_to_remove!r}")
        if tokens_to_remove > 0:
            raise InvalidArgumentError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        opened = self._opened()
        if not opened or tokens_to_remove == 0:
            return
        self._check_idle("crop")
        for g in opened:
            g.check_crop(tokens_to_remove)
        for layer in self._delegated():
            if hasattr(layer, "conv_states"):
                layer.crop(tokens_to_remove)
        for g in opened:
            g.crop(tokens_to_remove)

    # --------------------------------------------------------------------------------------- memory
    def reset(self) -> None:
        """Drop all rows and give every page back to the pool; the next forward starts a new batch."""
        for g in getattr(self, "_groups", []):
            g.close()
        if hasattr(self, "_plan"):
            self.layers = [self._make_layer(i) for i in range(len(self._plan))]

    close = reset

    def __del__(self):
        # Dropping the cache returns its pages through close() now (the address range waits for the queued
        # kernels that may still read them before unmapping), not whenever the last reference goes.
        for g in getattr(self, "_groups", []):
            g.close()

    def stats(self) -> CacheStats | None:
        """The full-attention layers' VirtualKVCache's stats (None before the first update)."""
        return self.kv.stats() if self.kv is not None else None

    def window_stats(self) -> CacheStats | None:
        """The bounded sliding-window layers' VirtualKVCache's stats (None without them / before the update)."""
        return self.window_kv.stats() if self.window_kv is not None else None

    def bytes_per_token(self) -> int:
        """K and V of one token of one row over all layers held in vpaged (bounded sliding layers included,
        though they hold at most their window), in the cache's dtype (known after the first update, or when
        dtype and the geometry were given)."""
        total = 0
        for g in self._groups:
            if g.kv is not None:  # opened: the geometry its cache was built on
                total += g.kv.geometry.bytes_per_token
                continue
            dtype = self.dtype
            if dtype is None or g.num_kv_heads is None or g.head_dim is None:
                raise InvalidArgumentError(
                    "geometry unknown before the first update; pass dtype, num_kv_heads and head_dim"
                )
            total += KVGeometry(
                len(g.layers), g.num_kv_heads, g.head_dim, dtype, g.v_head_dim, g.kv_dtype
            ).bytes_per_token
        return total

    def static_bytes(self, batch_size: int | None = None, max_cache_len: int | None = None) -> int:
        """What a StaticCache of batch_size rows x max_cache_len tokens would allocate for the same model."""
        batch = batch_size if batch_size is not None else max(self.batch_size, 1)
        return batch * (max_cache_len or self.max_cache_len) * self.bytes_per_token()

    def __repr__(self) -> str:
        opened = self._opened()
        state = f"{self.batch_size} rows x {opened[0].length} tokens" if opened else "empty"
        return f"VPagedCache(layers={self.num_layers}, layout={self.layout}, {state})"
