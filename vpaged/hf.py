"""transformers integration: VPagedCache, a `transformers.Cache` whose K/V live in one VirtualKVCache.

    from vpaged.hf import VPagedCache, cache_kwargs
    cache = VPagedCache(model.config, max_cache_len=4096, capacity_bytes=2 << 30)
    out = model.generate(input_ids, **cache_kwargs(cache), max_new_tokens=256)

(`cache_kwargs(cache)` is `{"cache": cache}` on transformers >= 5.24 and `{"past_key_values": cache}` before;
see vpaged/_hf_compat.py for what differs between the supported releases.)

Each batch row is one vpaged sequence; the rows sit in consecutive slots, so one layer's K of the whole batch
is a single strided [B, T, H, D] view that update() returns transposed to the [B, H, T, D] transformers
expects, without copying. Pages are mapped as tokens arrive: memory follows the tokens generated, not
max_cache_len. Beam search and batch selection remap pages instead of copying K/V: rows that take another
row's content share its full pages, and the partly filled last page is copied only when it is next written
(copy-on-write in VirtualKVCache).

Identical prompt rows, as generate() makes them for beam search and num_return_sequences by repeating each
prompt, are stored once: during a prefill into an empty cache, a row whose K/V equal the previous row's in
every layer shares that row's pages instead of holding its own copy.

The cache holds no tensor views between calls: a view pins its pages, and a pinned page cannot be unmapped
or remapped. Inference only: K/V are written without autograd.

transformers is imported here only; `import vpaged` does not need it (extra `vpaged[hf]`).
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import CacheLayerMixin

from ._checks import check_positive_int
from ._hf_compat import CacheBase, cache_keyword, cache_kwargs, register_attention, support_status  # noqa: F401
from .cache import CacheStats, VirtualKVCache
from .device import normalize_device
from .errors import DTypeError, InvalidArgumentError, ShapeError, SlotsExhaustedError
from .geometry import KVGeometry
from .pool import PagePool

# Layer kinds whose K/V we can hold in full. A sliding-window layer is served correctly by a full cache
# (transformers' sliding mask hides the tokens outside the window); it just keeps more tokens than needed.
_SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def _geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a model config; raises when the model's layers are not all
    attention layers of one shape."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        layers = int(text.num_hidden_layers)
        heads = int(text.num_attention_heads)
    except AttributeError as e:
        raise InvalidArgumentError(
            f"config {type(config).__name__} lacks {e.name}: pass num_layers, num_kv_heads and head_dim explicitly"
        ) from e
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    layer_types = getattr(text, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t not in _SUPPORTED_LAYER_TYPES})
    if odd:
        raise InvalidArgumentError(f"VPagedCache holds attention K/V only; this model has layer types {odd}")
    if any(mode == "reuse" for mode in (getattr(text, "kv_sharing_modes", None) or [])):
        raise InvalidArgumentError("VPagedCache does not support models whose layers share another layer's K/V")
    return layers, int(kv_heads), int(head_dim)


def _config_dtype(config) -> torch.dtype | None:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    dtype = getattr(text, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


class VPagedLayer(CacheLayerMixin):
    """One model layer's face of a VPagedCache. All layers share the cache's VirtualKVCache; operations that
    change the batch or the length (crop, reorder, reset, ...) act on all layers at once and live on the
    cache, so the per-layer versions refuse rather than half-apply."""

    is_compileable = False  # views come from DLPack capsules, which torch.compile cannot trace
    is_croppable = True
    is_sliding = False

    def __init__(self, cache: VPagedCache, layer_idx: int):
        # No super().__init__(): it would store keys/values tensors, which here are computed views.
        self._cache = weakref.ref(cache)  # weak: layers must not keep a dropped cache's memory alive
        self.layer_idx = layer_idx

    def _owner(self) -> VPagedCache:
        cache = self._cache()
        if cache is None:
            raise InvalidArgumentError("the VPagedCache of this layer has been dropped")
        return cache

    @property
    def is_initialized(self) -> bool:
        return self._owner().kv is not None

    @property
    def keys(self) -> torch.Tensor | None:
        """This layer's K as a fresh [B, H, T, D] view (None before the first update). Do not keep it across
        steps: it pins pages that reorder and crop need to remap."""
        return self._owner()._views(self.layer_idx)[0]

    @property
    def values(self) -> torch.Tensor | None:
        return self._owner()._views(self.layer_idx)[1]

    @property
    def batch_size(self) -> int:
        return self._owner().batch_size

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._owner()._open(key_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self._owner()._update(self.layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._owner()._written_len(self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self._owner().max_cache_len

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
        return f"VPagedLayer({self.layer_idx})"


class VPagedCache(CacheBase):
    """A transformers Cache backed by a VirtualKVCache (one sequence per batch row).

    Args:
        config: the model config (PreTrainedConfig): gives num_hidden_layers, num_key_value_heads
            (default num_attention_heads), head_dim (default hidden_size // num_attention_heads) and dtype.
            May be None when num_layers, num_kv_heads and head_dim are given.
        max_cache_len: tokens a row may hold (prompt + generated); going past it raises SequenceTooLongError.
        max_batch_size: rows the cache may hold at once (default: the batch of the first forward). Give it
            when batch_repeat_interleave() is to grow the batch.
        capacity_bytes: memory budget of a private page pool; running out raises OutOfPagesError.
        pool: a PagePool to share with other caches (instead of capacity_bytes). Neither: the device's
            default pool.
        layout: "head_major" (default: each head's K/V dense, the [B, H, T, D] transformers' attention reads
            fastest; a page per head at each page boundary), "per_layer" (dense [T, H, D] per layer: finer
            pages, attention on a strided view) or "interleaved" (all layers of a token side by side:
            finest pages, one map per page for all layers). See benchmarks/NOTES.md for measurements.
        dtype, device: of K/V; default: the config's dtype, and the dtype/device of the first K/V seen.
        page_size: bytes per page of a private or default pool.
        share_prefill: store identical prompt rows once (see the module docstring).

    The VirtualKVCache is created at the first update, when batch size, dtype and device are known, and
    released by reset() / close() or when the cache is dropped.
    """

    def __init__(
        self,
        config=None,
        *,
        max_cache_len: int,
        max_batch_size: int | None = None,
        capacity_bytes: int | None = None,
        pool: PagePool | None = None,
        layout: str = "head_major",
        dtype: torch.dtype | None = None,
        device=None,
        page_size: int | None = None,
        num_layers: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        share_prefill: bool = True,
    ):
        if config is not None:
            geo = _geometry(config)
            num_layers = num_layers if num_layers is not None else geo[0]
            num_kv_heads = num_kv_heads if num_kv_heads is not None else geo[1]
            head_dim = head_dim if head_dim is not None else geo[2]
            dtype = dtype if dtype is not None else _config_dtype(config)
        elif None in (num_layers, num_kv_heads, head_dim):
            raise InvalidArgumentError("give a model config, or num_layers, num_kv_heads and head_dim")
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("max_cache_len", max_cache_len),
        ):
            check_positive_int(name, value)
        if max_batch_size is not None:
            check_positive_int("max_batch_size", max_batch_size)
        if pool is not None and capacity_bytes is not None:
            raise InvalidArgumentError("give either pool or capacity_bytes, not both")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise DTypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        super().__init__(layers=[VPagedLayer(self, i) for i in range(num_layers)])
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.max_cache_len = max_cache_len
        self.max_batch_size = max_batch_size
        self.layout = layout
        self.dtype = dtype
        self.device = normalize_device(device) if device is not None else (pool.device if pool else None)
        if pool is not None and self.device != pool.device:
            raise InvalidArgumentError(f"pool is on {pool.device}, device is {self.device}")
        self.page_size = page_size
        self.share_prefill = share_prefill
        self._capacity_bytes = capacity_bytes
        self._pool = pool
        self.kv: VirtualKVCache | None = None
        self._rows: list[int] = []  # vpaged sequence of each batch row, in consecutive slots
        self._length = 0  # tokens every row holds once the current step's layers are all written
        self._written = [0] * num_layers  # tokens written per layer
        self._layers_left = 0  # layers still to write in the current step
        # During a prefill into an empty cache: row -> earlier row with the same K/V (rows not yet stored).
        self._dup_of: dict[int, int] = {}

    # --------------------------------------------------------------------------------------- properties
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def batch_size(self) -> int:
        return len(self._rows) if self.kv is not None else -1

    @property
    def pool(self) -> PagePool | None:
        """The page pool under this cache (None before the first update when none was given)."""
        return self.kv.pool if self.kv is not None else self._pool

    @property
    def sequences(self) -> list[int]:
        """The vpaged sequence id of each batch row."""
        return list(self._rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._written_len(layer_idx) if 0 <= layer_idx < self.num_layers else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    # --------------------------------------------------------------------------------------- forward path
    def _open(self, key_states: torch.Tensor) -> None:
        """Create the VirtualKVCache for the batch of the first update (or early_initialization)."""
        if self.kv is not None:
            return
        if key_states.dim() != 4:
            raise ShapeError(f"key states must be [batch, kv_heads, tokens, head_dim], got {list(key_states.shape)}")
        batch, heads, _, dim = key_states.shape
        if (heads, dim) != (self.num_kv_heads, self.head_dim):
            raise ShapeError(
                f"the model gives K/V of {heads} heads x {dim}; the cache was built for "
                f"{self.num_kv_heads} x {self.head_dim} (check num_key_value_heads / head_dim)"
            )
        if self.dtype is not None and key_states.dtype != self.dtype:
            raise DTypeError(f"the model gives K/V in {key_states.dtype}; the cache was built for {self.dtype}")
        device = normalize_device(key_states.device)
        if self.device is not None and device != self.device:
            raise InvalidArgumentError(f"the model gives K/V on {device}; the cache was built for {self.device}")
        max_seqs = self.max_batch_size or batch
        if batch > max_seqs:
            raise SlotsExhaustedError(f"batch of {batch} rows, more than max_batch_size={max_seqs}")
        if self._pool is None and self._capacity_bytes is not None:
            # The pool outlives reset(): it is this cache's budget, not one generation's.
            self._pool = PagePool(device, capacity_bytes=self._capacity_bytes, page_size=self.page_size)
        kv = VirtualKVCache(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            dtype=key_states.dtype,
            max_seqs=max_seqs,
            max_seq_len=self.max_cache_len,
            device=device,
            pool=self._pool,
            layout=self.layout,
            page_size=None if self._pool is not None else self.page_size,
        )
        self._rows = kv.allocate_many(batch)
        self.kv = kv
        self._length = 0
        self._written = [0] * self.num_layers
        self._layers_left = 0
        self._dup_of = {}

    def _update(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        if self.kv is None:
            self._open(key_states)
        kv = self.kv
        if key_states.shape != value_states.shape:
            raise ShapeError(
                f"key states {list(key_states.shape)} and value states {list(value_states.shape)} "
                "differ in shape (models with different K and V head sizes are not supported)"
            )
        batch, heads, n, dim = key_states.shape
        if batch != len(self._rows) or (heads, dim) != (self.num_kv_heads, self.head_dim):
            raise ShapeError(
                f"K/V of shape {list(key_states.shape)} for a cache of {len(self._rows)} rows x "
                f"{self.num_kv_heads} heads x {self.head_dim} (reset() it to start a new batch)"
            )
        if key_states.dtype != kv.dtype:
            raise DTypeError(f"K/V in {key_states.dtype}, the cache holds {kv.dtype}")
        past = self._written[layer]
        if self._layers_left == 0:
            # First layer of a new forward: grow every row once for all layers.
            self._begin_step(key_states, value_states, n)
        elif past + n != self._length:
            raise InvalidArgumentError(
                f"layer {layer} got {n} new tokens after {past}, but this forward grew the cache to {self._length} "
                "tokens: a layer was updated twice, or an earlier forward stopped before its last layer "
                "(reset() the cache then)"
            )
        out = None
        with torch.no_grad():
            if self._dup_of:  # only in a prefill, where past == 0
                self._write_rows(layer, key_states, value_states)
            else:
                k_all, v_all = kv.kv_batch(layer, self._rows)
                # One copy into the batched view instead of one write() per row: same bytes, B times fewer
                # calls, and the same views are what this layer reads. It keeps write()'s contract: it
                # writes exactly the tokens this forward's extend_many() added, whose pages extend_many()
                # made private to each row (copy-on-write), never a page another row shares.
                k_all[:, past:].copy_(key_states.transpose(1, 2))
                v_all[:, past:].copy_(value_states.transpose(1, 2))
                out = k_all.transpose(1, 2), v_all.transpose(1, 2)
        self._written[layer] = past + n
        self._layers_left -= 1
        if self._layers_left == 0 and self._dup_of:
            self._share_duplicates()
        if past == 0:
            # Nothing was cached before: the layer's whole K/V is what it was just given (and the duplicate
            # rows of a prefill have no pages to view yet).
            return key_states, value_states
        return out

    def _begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor, n: int) -> None:
        rows = self._rows
        dup_of = {}
        if self._length == 0 and self.share_prefill and len(rows) > 1 and n > 0:
            # generate() repeats each prompt for beams / return sequences, so duplicates are neighbours:
            # comparing each row with the previous one finds them at the cost of B-1 comparisons.
            for i in range(1, len(rows)):
                src = dup_of.get(i - 1, i - 1)
                if torch.equal(key_states[i], key_states[src]) and torch.equal(value_states[i], value_states[src]):
                    dup_of[i] = src
        self.kv.extend_many([s for i, s in enumerate(rows) if i not in dup_of], n)
        self._dup_of = dup_of
        self._length += n
        self._layers_left = self.num_layers

    def _write_rows(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Prefill with duplicate rows: write the rows that hold their own pages; a duplicate whose K/V
        differ in this layer after all (same tokens, different mask) gets its own pages now."""
        kv = self.kv
        for i, src in list(self._dup_of.items()):
            if not (torch.equal(key_states[i], key_states[src]) and torch.equal(value_states[i], value_states[src])):
                self._materialize(i)
        for i, seq in enumerate(self._rows):
            if i not in self._dup_of:
                kv.write(layer, seq, key_states[i].transpose(0, 1), value_states[i].transpose(0, 1))

    def _materialize(self, row: int) -> None:
        """Give a presumed duplicate row its own pages, holding its source's K/V of the layers written so far
        in this step (equal by the checks so far); the caller writes the current layer."""
        src = self._dup_of[row]
        seq, src_seq = self._rows[row], self._rows[src]
        self.kv.extend(seq, self._length)  # may raise (OutOfPagesError): the row stays a duplicate then
        del self._dup_of[row]
        for earlier in range(self.num_layers):
            if self._written[earlier] == self._length:  # written in this step already
                self.kv.write(earlier, seq, *self.kv.kv(earlier, src_seq))
        # Rows that pointed at this one keep pointing at it: it now holds the same data they matched.

    def _share_duplicates(self) -> None:
        sources = [self._dup_of.get(i, i) for i in range(len(self._rows))]
        self._dup_of = {}
        self.kv.reorder(self._rows, sources)

    def _written_len(self, layer: int) -> int:
        return self._written[layer] if self.kv is not None else 0

    def _views(self, layer: int):
        if self.kv is None:
            return None, None
        k, v = self.kv.kv_batch(layer, self._rows, self._written[layer])
        return k.transpose(1, 2), v.transpose(1, 2)

    # --------------------------------------------------------------------------------------- batch edits
    def _check_idle(self, what: str) -> None:
        if self._layers_left:
            raise InvalidArgumentError(f"{what}() in the middle of a forward ({self._layers_left} layers to go)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i takes the content of row beam_idx[i] (beam search), by sharing pages: full pages are mapped
        into the new row, the last partial page is copied when next written."""
        if self.kv is None:
            return
        self._check_idle("reorder_cache")
        sources = self._indices(beam_idx, "beam_idx")
        if len(sources) != len(self._rows):
            raise ShapeError(f"beam_idx has {len(sources)} entries for {len(self._rows)} rows")
        if sources != list(range(len(sources))):
            self.kv.reorder(self._rows, sources)

    def batch_select_indices(self, indices) -> None:
        """Keep the rows `indices` (ints, or a bool mask), in that order."""
        if self.kv is None:
            return
        self._check_idle("batch_select_indices")
        idx = torch.as_tensor(indices)
        if idx.dtype == torch.bool:
            if idx.numel() != len(self._rows):
                raise ShapeError(f"mask of {idx.numel()} entries for {len(self._rows)} rows")
            idx = idx.nonzero().flatten()
        self._resize(self._indices(idx, "indices"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes `repeats` neighbouring rows sharing its pages."""
        if self.kv is None:
            return
        self._check_idle("batch_repeat_interleave")
        if not isinstance(repeats, int) or repeats <= 0:
            raise InvalidArgumentError(f"repeats must be a positive int, got {repeats!r}")
        self._resize([i for i in range(len(self._rows)) for _ in range(repeats)])

    def _indices(self, idx, name: str) -> list[int]:
        out = torch.as_tensor(idx).flatten().tolist()
        rows = len(self._rows)
        for i in out:
            if not isinstance(i, int) or not 0 <= i < rows:
                raise InvalidArgumentError(f"{name} holds {i!r}, outside 0..{rows - 1}")
        return out

    def _resize(self, sources: list[int]) -> None:
        """New row i takes the content of current row sources[i]; the batch becomes len(sources) rows."""
        kv, rows = self.kv, self._rows
        old, new = len(rows), len(sources)
        if new == 0:
            raise InvalidArgumentError("a cache needs at least one row")
        if new <= old:
            kv.reorder(rows, sources + list(range(new, old)))
            for seq in rows[new:]:
                kv.free(seq)
            self._rows = rows[:new]
            return
        try:
            extra = kv.allocate_many(new - old)
        except SlotsExhaustedError as e:
            raise SlotsExhaustedError(
                f"{new} rows do not fit a cache of max_batch_size={kv.max_seqs}; "
                "build the cache with a larger max_batch_size"
            ) from e
        if kv.slot(extra[0]) != kv.slot(rows[-1]) + 1:
            # The new rows do not continue ours: move the whole batch to a fresh run of slots.
            for seq in extra:
                kv.free(seq)
            try:
                fresh = kv.allocate_many(new)
            except SlotsExhaustedError as e:
                raise SlotsExhaustedError(
                    f"no run of {new} free slots next to the current {old} rows; build the "
                    "cache with a larger max_batch_size"
                ) from e
            self._reorder_or_free(rows + fresh, list(range(old)) + sources, fresh)
            for seq in rows:
                kv.free(seq)
            self._rows = fresh
            return
        self._reorder_or_free(rows + extra, sources, extra)
        self._rows = rows + extra

    def _reorder_or_free(self, seqs: list[int], sources: list[int], added: list[int]) -> None:
        """reorder(); if it raises (it then changed nothing), the rows just allocated go back."""
        try:
            self.kv.reorder(seqs, sources)
        except BaseException:
            for seq in added:
                self.kv.free(seq)
            raise

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens of every row (transformers 5 passes a negative count;
        crop(0) does nothing). Pages past the new end return to the pool."""
        if not isinstance(tokens_to_remove, int) or isinstance(tokens_to_remove, bool):
            raise InvalidArgumentError(f"crop takes an int, got {tokens_to_remove!r}")
        if tokens_to_remove > 0:
            raise InvalidArgumentError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        if self.kv is None or tokens_to_remove == 0:
            return
        self._check_idle("crop")
        new_len = self._length + tokens_to_remove
        if new_len < 0:
            raise InvalidArgumentError(f"cannot remove {-tokens_to_remove} tokens from {self._length}")
        for seq in self._rows:
            self.kv.truncate(seq, new_len)
        self._length = new_len
        self._written = [min(w, new_len) for w in self._written]

    # --------------------------------------------------------------------------------------- memory
    def reset(self) -> None:
        """Drop all rows and give every page back to the pool; the next forward starts a new batch."""
        if self.kv is not None:
            kv, self.kv = self.kv, None
            kv.close()
        self._rows = []
        self._length = 0
        self._written = [0] * self.num_layers
        self._layers_left = 0
        self._dup_of = {}

    close = reset

    def __del__(self):
        # Dropping the cache returns its pages through close() now (the address range waits for the queued
        # kernels that may still read them before unmapping), not whenever the last reference goes.
        if getattr(self, "kv", None) is not None:
            self.reset()

    def stats(self) -> CacheStats | None:
        """The VirtualKVCache's stats (None before the first update)."""
        return self.kv.stats() if self.kv is not None else None

    def bytes_per_token(self) -> int:
        """K and V of one token of one row over all layers, in the cache's dtype (known after the first
        update, or when dtype was given)."""
        dtype = self.kv.dtype if self.kv is not None else self.dtype
        if dtype is None:
            raise InvalidArgumentError("dtype unknown before the first update; pass dtype")
        return KVGeometry(self.num_layers, self.num_kv_heads, self.head_dim, dtype).bytes_per_token

    def static_bytes(self, batch_size: int | None = None, max_cache_len: int | None = None) -> int:
        """What a StaticCache of batch_size rows x max_cache_len tokens would allocate for the same model."""
        batch = batch_size if batch_size is not None else max(self.batch_size, 1)
        return batch * (max_cache_len or self.max_cache_len) * self.bytes_per_token()

    def __repr__(self) -> str:
        state = f"{len(self._rows)} rows x {self._length} tokens" if self.kv is not None else "empty"
        return f"VPagedCache(layers={self.num_layers}, layout={self.layout}, {state})"
