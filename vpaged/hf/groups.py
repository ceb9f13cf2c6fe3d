"""The K/V groups behind a VPagedCache: a set of a model's attention layers held in one VirtualKVCache, one
sequence per batch row, the rows in consecutive slots (so one layer of the whole batch is one strided view).

KVGroup holds every token (full-attention layers, and sliding-window layers unless bounded). WindowGroup
holds only what a sliding-window layer can still attend to: at most `window - 1 + slack` tokens per row,
slack being one page of tokens, so a row never maps more than the window plus one page; it returns to the
model exactly what transformers' own sliding cache returns (the last window - 1 tokens, then the new ones),
so the masks and the tokens generated are the same.

The geometry of a group (kv heads, K and V head sizes, dtype, device) is read from the first K/V the model
hands over, not guessed from config field names; a later K/V of another shape is a ShapeError naming the
layer and both shapes. Explicit values, when given, are checked against the first K/V.

transformers is not imported here: the groups see tensors only (vpaged/hf/cache.py is the transformers face).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import DTypeError, InvalidArgumentError, ShapeError, SlotsExhaustedError
from ..kvcache import VirtualCacheConfig, VirtualKVCache
from ..kvcache.geometry import KVGeometry
from ..memory.device import normalize_device
from ..memory.pool import default_pool


class KVGroup:
    """K/V of the attention layers `layers` (model layer indices) of every batch row, all tokens kept.

    pool_for(device) gives the page pool (or None for the device's default one) when the group opens."""

    bounded = False

    def __init__(
        self,
        layers: list[int],
        *,
        max_len: int,
        max_batch_size: int | None,
        layout: str,
        dtype: torch.dtype | None,
        device,
        page_size: int | None,
        pool_for: Callable,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        share_prefill: bool = False,
        kv_dtype=None,
        kv_scales=None,
    ):
        self.layers = list(layers)
        # A quantized format (kvcache/formats.py): what the layers attend over is what is stored, dequantized.
        self.kv_dtype, self.kv_scales = kv_dtype, kv_scales
        self.local = {layer: i for i, layer in enumerate(self.layers)}
        self.max_len = max_len
        self.max_batch_size = max_batch_size
        self.layout, self.dtype, self.device, self.page_size = layout, dtype, device, page_size
        self._pool_for = pool_for
        self.num_kv_heads, self.head_dim, self.v_head_dim = num_kv_heads, head_dim, v_head_dim
        self.share_prefill = share_prefill
        self.kv: VirtualKVCache | None = None
        self._first_layer: int | None = None  # the layer whose K/V set the geometry
        self._clear()

    def _clear(self) -> None:
        self.rows: list[int] = []  # vpaged sequence of each batch row, in consecutive slots
        self.length = 0  # tokens every row holds once the current step's layers are all written
        self.written = [0] * len(self.layers)  # tokens written per layer (local index)
        self.layers_left = 0  # layers still to write in the current step
        # During a prefill into an empty cache: row -> earlier row with the same K/V (rows not yet stored).
        self.dup_of: dict[int, int] = {}

    # ------------------------------------------------------------------------------------------ geometry
    @property
    def capacity(self) -> int:
        """Tokens a row's sequence may hold in the VirtualKVCache."""
        return self.max_len

    def _shape_text(self) -> str:
        v = "" if self.v_head_dim == self.head_dim else f" (V head size {self.v_head_dim})"
        return f"{self.num_kv_heads} kv heads x head size {self.head_dim}{v}"

    def check_geometry(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Learn the geometry from the first K/V (checked against explicit values); a later K/V must match."""
        for name, t in (("key", key_states), ("value", value_states)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ShapeError(f"layer {layer}: {name} states must be [batch, kv_heads, tokens, dim], got {shape}")
        kb, kh, kn, kd = key_states.shape
        vb, vh, vn, vd = value_states.shape
        if (kb, kh, kn) != (vb, vh, vn):
            raise ShapeError(
                f"layer {layer}: key states {list(key_states.shape)} and value states {list(value_states.shape)} "
                "differ in batch, heads or tokens"
            )
        if key_states.dtype != value_states.dtype:
            raise DTypeError(f"layer {layer}: K in {key_states.dtype}, V in {value_states.dtype}")
        if self.kv is None and self._first_layer is None:
            given = (self.num_kv_heads, self.head_dim, self.v_head_dim)
            seen = (kh, kd, vd)
            for name, want, got in zip(("num_kv_heads", "head_dim", "v_head_dim"), given, seen):
                if want is not None and want != got:
                    raise ShapeError(
                        f"layer {layer}: the model gives K {list(key_states.shape)} and V {list(value_states.shape)} "
                        f"([batch, kv_heads, tokens, head size]); the cache was built with {name}={want}"
                    )
            if self.dtype is not None and key_states.dtype != self.dtype:
                raise DTypeError(
                    f"layer {layer}: the model gives K/V in {key_states.dtype}; the cache was built for {self.dtype}"
                )
            device = normalize_device(key_states.device)
            if self.device is not None and device != self.device:
                raise InvalidArgumentError(
                    f"layer {layer}: the model gives K/V on {device}; the cache was built for {self.device}"
                )
            return
        if (kh, kd, vd) != (self.num_kv_heads, self.head_dim, self.v_head_dim):
            raise ShapeError(
                f"layer {layer}: K {list(key_states.shape)} and V {list(value_states.shape)} do not match the "
                f"{self._shape_text()} that layer {self._first_layer} gave first (layers of different shapes are "
                "not supported in one cache)"
            )
        if key_states.dtype != self.kv.dtype:
            raise DTypeError(f"layer {layer}: K/V in {key_states.dtype}, the cache holds {self.kv.dtype}")

    # ------------------------------------------------------------------------------------------ opening
    def open(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Create the VirtualKVCache for the batch and geometry of the first K/V."""
        self.check_geometry(layer, key_states, value_states)
        batch = key_states.shape[0]
        max_seqs = self.max_batch_size or batch
        if batch > max_seqs:
            raise SlotsExhaustedError(f"batch of {batch} rows, more than max_batch_size={max_seqs}")
        device = normalize_device(key_states.device)
        pool = self._pool_for(device)
        geometry = KVGeometry(
            len(self.layers), key_states.shape[1], key_states.shape[3], key_states.dtype, value_states.shape[3],
            self.kv_dtype,
        )  # fmt: skip
        kv = VirtualKVCache(
            geometry,
            VirtualCacheConfig(
                max_seqs=max_seqs,
                max_seq_len=self.capacity_for(key_states, value_states, pool),
                device=device,
                layout=self.layout,
                page_size=None if pool is not None else self.page_size,
                kv_scales=self.kv_scales,
            ),
            pool=pool,
        )
        rows = kv.allocate_many(batch)
        self.num_kv_heads, self.head_dim, self.v_head_dim = kv.num_kv_heads, kv.head_dim, kv.v_head_dim
        self.kv, self._first_layer = kv, layer
        self._clear()
        self.rows = rows

    def capacity_for(self, key_states, value_states, pool) -> int:
        return self.max_len

    # ------------------------------------------------------------------------------------------ forward
    def update(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        if self.kv is None:
            self.open(layer, key_states, value_states)
        else:
            self.check_geometry(layer, key_states, value_states)
        batch, _, n, _ = key_states.shape
        if batch != len(self.rows):
            raise ShapeError(
                f"layer {layer}: K/V of {batch} rows for a cache of {len(self.rows)} rows "
                "(reset() it to start a new batch)"
            )
        i = self.local[layer]
        past = self.written[i]
        if self.layers_left == 0:
            self.begin_step(key_states, value_states, n)  # first layer of a new forward: grow every row once
        if past + n != self._step_end:
            raise InvalidArgumentError(
                f"layer {layer} got {n} new tokens after {past}, but this forward grew the cache to "
                f"{self._step_end} tokens: a layer was updated twice, or an earlier forward stopped before its "
                "last layer (reset() the cache then)"
            )
        with torch.no_grad():
            out = self.write(i, past, key_states, value_states)
        self.written[i] = past + n
        self.layers_left -= 1
        if self.layers_left == 0:
            self.end_step()
        return out

    @property
    def _step_end(self) -> int:
        """Tokens each layer has seen once the current step has written it."""
        return self.length

    def begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor, n: int) -> None:
        rows = self.rows
        dup_of = {}
        if self.length == 0 and self.share_prefill and len(rows) > 1 and n > 0:
            # generate() repeats each prompt for beams / return sequences, so duplicates are neighbours:
            # comparing each row with the previous one finds them at the cost of B-1 comparisons.
            for i in range(1, len(rows)):
                src = dup_of.get(i - 1, i - 1)
                if torch.equal(key_states[i], key_states[src]) and torch.equal(value_states[i], value_states[src]):
                    dup_of[i] = src
        self.kv.extend_many([s for i, s in enumerate(rows) if i not in dup_of], n)
        self.dup_of = dup_of
        self.length += n
        self.layers_left = len(self.layers)

    def write(self, i: int, past: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Store layer i's new K/V at tokens past.. of every row; return what the layer attends to."""
        if self.kv.kv_format.quantized:
            return self._write_quantized(i, past, key_states, value_states)
        if self.dup_of:  # only in a prefill, where past == 0
            self._write_rows(i, key_states, value_states)
            return key_states, value_states
        k_all, v_all = self.kv.kv_batch(i, self.rows)
        # One copy into the batched view instead of one write() per row: same bytes, B times fewer calls, and
        # the same views are what this layer reads. It keeps write()'s contract: it writes exactly the tokens
        # this forward's extend_many() added, whose pages extend_many() made private to each row
        # (copy-on-write), never a page another row shares.
        k_all[:, past:].copy_(key_states.transpose(1, 2))
        v_all[:, past:].copy_(value_states.transpose(1, 2))
        if past == 0:
            # Nothing was cached before: the layer's whole K/V is what it was just given.
            return key_states, value_states
        return k_all.transpose(1, 2), v_all.transpose(1, 2)

    def _write_quantized(self, i: int, past: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """write() on a quantized cache: the layer attends over what is stored (dequantized), new tokens too;
        a duplicate prefill row (no tokens until end_step shares its source's pages) reads its source's."""
        if self.dup_of:
            self._write_rows(i, key_states, value_states)
            held = [self.kv.dequantized_kv(i, self.rows[self.dup_of.get(r, r)]) for r in range(len(self.rows))]
            return tuple(torch.stack([kv[j] for kv in held]).transpose(1, 2) for j in (0, 1))
        for row, seq in enumerate(self.rows):
            self.kv.write(i, seq, key_states[row].transpose(0, 1), value_states[row].transpose(0, 1), start=past)
        k, v = self.kv.kv_batch(i, self.rows, past + key_states.shape[2])
        return k.dequantize().transpose(1, 2), v.dequantize().transpose(1, 2)

    def end_step(self) -> None:
        if self.dup_of:
            sources = [self.dup_of.get(i, i) for i in range(len(self.rows))]
            self.dup_of = {}
            self.kv.reorder(self.rows, sources)

    def _write_rows(self, i: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Prefill with duplicate rows: write the rows that hold their own pages; a duplicate whose K/V
        differ in this layer after all (same tokens, different mask) gets its own pages now."""
        kv = self.kv
        for row, src in list(self.dup_of.items()):
            same = torch.equal(key_states[row], key_states[src]) and torch.equal(value_states[row], value_states[src])
            if not same:
                self._materialize(row)
        for row, seq in enumerate(self.rows):
            if row not in self.dup_of:
                kv.write(i, seq, key_states[row].transpose(0, 1), value_states[row].transpose(0, 1))

    def _materialize(self, row: int) -> None:
        """Give a presumed duplicate row its own pages, holding its source's K/V of the layers written so far
        in this step (equal by the checks so far); the caller writes the current layer."""
        src = self.dup_of[row]
        seq, src_seq = self.rows[row], self.rows[src]
        self.kv.extend(seq, self.length)  # may raise (OutOfPagesError): the row stays a duplicate then
        del self.dup_of[row]
        for earlier in range(len(self.layers)):
            if self.written[earlier] == self.length:  # written in this step already
                self.kv.write(earlier, seq, *self.kv.dequantized_kv(earlier, src_seq))
        # Rows that pointed at this one keep pointing at it: it now holds the same data they matched.

    # ------------------------------------------------------------------------------------------ reading
    def seq_length(self, layer: int) -> int:
        """Tokens the layer has seen (what get_seq_length reports)."""
        return self.written[self.local[layer]] if self.kv is not None else 0

    def mask_sizes(self, layer: int, query_length: int) -> tuple[int, int]:
        return self.seq_length(layer) + query_length, 0

    def views(self, layer: int):
        """(K, V) of the layer as [B, H, T, D] views of what it holds (None, None before the first update)."""
        if self.kv is None:
            return None, None
        i = self.local[layer]
        k, v = self.kv.kv_batch(i, self.rows, self.written[i])
        if self.kv.kv_format.quantized:
            k, v = k.dequantize(), v.dequantize()
        return k.transpose(1, 2), v.transpose(1, 2)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------------------------------------ batch edits
    def check_idle(self, what: str) -> None:
        if self.layers_left:
            raise InvalidArgumentError(f"{what}() in the middle of a forward ({self.layers_left} layers to go)")

    def reorder(self, sources: list[int]) -> None:
        """Row i takes the content of row sources[i] (same batch size), by sharing pages."""
        if self.kv is not None and sources != list(range(len(sources))):
            self.kv.reorder(self.rows, sources)

    def resize(self, sources: list[int]) -> None:
        """New row i takes the content of current row sources[i]; the batch becomes len(sources) rows."""
        if self.kv is None:
            return
        kv, rows = self.kv, self.rows
        old, new = len(rows), len(sources)
        if new <= old:
            kv.reorder(rows, sources + list(range(new, old)))
            for seq in rows[new:]:
                kv.free(seq)
            self.rows = rows[:new]
            return
        try:
            extra = kv.allocate_many(new - old)
        except SlotsExhaustedError as e:
            msg = f"{new} rows do not fit a cache of max_batch_size={kv.max_seqs}; build it with a larger one"
            raise SlotsExhaustedError(msg) from e
        if kv.slot(extra[0]) != kv.slot(rows[-1]) + 1:
            # The new rows do not continue ours: move the whole batch to a fresh run of slots.
            for seq in extra:
                kv.free(seq)
            try:
                fresh = kv.allocate_many(new)
            except SlotsExhaustedError as e:
                msg = f"no run of {new} free slots next to the current {old} rows; build the cache with a larger "
                raise SlotsExhaustedError(msg + "max_batch_size") from e
            self._reorder_or_free(rows + fresh, list(range(old)) + sources, fresh)
            for seq in rows:
                kv.free(seq)
            self.rows = fresh
            return
        self._reorder_or_free(rows + extra, sources, extra)
        self.rows = rows + extra

    def _reorder_or_free(self, seqs: list[int], sources: list[int], added: list[int]) -> None:
        """reorder(); if it raises (it then changed nothing), the rows just allocated go back."""
        try:
            self.kv.reorder(seqs, sources)
        except BaseException:
            for seq in added:
                self.kv.free(seq)
            raise

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise (nothing changed) when crop(tokens_to_remove) is impossible."""
        if self.kv is not None and self.length + tokens_to_remove < 0:
            raise InvalidArgumentError(f"cannot remove {-tokens_to_remove} tokens from {self.length}")

    def crop(self, tokens_to_remove: int) -> None:
        if self.kv is None or tokens_to_remove == 0:
            return
        new_len = self.length + tokens_to_remove
        for seq in self.rows:
            self.kv.truncate(seq, new_len)
        self.length = new_len
        self.written = [min(w, new_len) for w in self.written]

    def close(self) -> None:
        if self.kv is not None:
            kv, self.kv = self.kv, None
            kv.close()
        self._first_layer = None
        self._clear()


class WindowGroup(KVGroup):
    """Sliding-window layers whose memory is bounded by the window: each row holds at most
    `window - 1 + slack` tokens (slack: one page of tokens, at least one), the most recent ones.

    A step appends while it fits; when it does not, the last window - 1 tokens move to the front of each row
    (its pages are given back and mapped afresh, so a page shared after beam search is never written) and
    the new tokens follow. What a layer gets back is transformers' DynamicSlidingWindowLayer's: the last
    min(seen, window - 1) tokens, then the new ones (views while they lie in the row, a copy when a prefill
    is longer than the row)."""

    bounded = True

    def __init__(self, layers: list[int], *, window: int, **kwargs):
        super().__init__(layers, **kwargs)
        if self.kv_dtype is not None and self.kv_dtype != self.dtype and self.kv_dtype != "auto":
            raise InvalidArgumentError(
                "kv_dtype: bounded sliding-window layers keep full-precision K/V (they move their window "
                "in place); build the cache with bounded_sliding=False to quantize every layer"
            )
        self.window = window
        self.seen = 0  # tokens the layers have seen per row (cumulative)

    def _clear(self) -> None:
        super()._clear()
        self.seen = 0
        self._mode = None  # how the current step stores its tokens: ("append" | "compact" | "overflow", kept)
        self._old: list = []  # per layer during a compact/overflow step: the kept tokens (K, V), or None

    def capacity_for(self, key_states, value_states, pool) -> int:
        # One page of tokens past the window: appends fill a page before a compaction moves the window back.
        itemsize = key_states.element_size()
        heads = key_states.shape[1]
        row_bytes = heads * max(key_states.shape[3], value_states.shape[3]) * itemsize
        if self.layout == "head_major":
            row_bytes //= heads
        elif self.layout == "interleaved":
            row_bytes = len(self.layers) * heads * (key_states.shape[3] + value_states.shape[3]) * itemsize
        page = (pool if pool is not None else default_pool(normalize_device(key_states.device))).page_size
        slack = max(1, page // row_bytes)
        return min(self.max_len, self.window - 1 + slack)

    @property
    def _step_end(self) -> int:
        return self.seen  # a window layer counts the tokens it has seen, as transformers' sliding layer does

    @property
    def _kept(self) -> int:
        """Tokens of the past a step's queries may attend to: the last window - 1 seen."""
        return min(self.seen, self.window - 1)

    def begin_step(self, key_states, value_states, n: int) -> None:
        kept, held, cap = self._kept, self.length, self.kv.max_seq_len
        kv, rows = self.kv, self.rows
        if held + n <= cap:
            kv.extend_many(rows, n)
            self._mode, self.length = ("append", kept), held + n
        else:
            # The kept tokens move to the front: copied out first (their old place may overlap the new one).
            self._old = [
                tuple(t[:, held - kept : held].clone() for t in kv.kv_batch(i, rows)) if kept else None
                for i in range(len(self.layers))
            ]
            for seq in rows:
                kv.truncate(seq, 0)  # pages go back; the ones mapped afresh are this row's own
            mode, store = ("compact", kept + n) if kept + n <= cap else ("overflow", min(self.window - 1, kept + n))
            try:
                kv.extend_many(rows, store)
            except BaseException:
                self._restore_kept(kept)
                raise
            self._mode, self.length = (mode, kept), store
        self.seen += n
        self.layers_left = len(self.layers)

    def _restore_kept(self, kept: int) -> None:
        """After a compaction that could not map its pages: the rows hold the kept tokens again (all a later
        step attends to), in fewer pages than were just returned, so this extend cannot run short."""
        kv, rows = self.kv, self.rows
        kv.extend_many(rows, kept)
        for i, old in enumerate(self._old):
            if old is not None:
                k_all, v_all = kv.kv_batch(i, rows)
                k_all.copy_(old[0])
                v_all.copy_(old[1])
        self._old, self.length = [], kept

    def write(self, i: int, past: int, key_states: torch.Tensor, value_states: torch.Tensor):
        mode, kept = self._mode
        k_all, v_all = self.kv.kv_batch(i, self.rows)
        new_k, new_v = key_states.transpose(1, 2), value_states.transpose(1, 2)
        n = new_k.shape[1]
        if mode == "append":
            held = self.length
            k_all[:, held - n :].copy_(new_k)
            v_all[:, held - n :].copy_(new_v)
            if kept == 0 and held == n:
                return key_states, value_states
            return k_all[:, held - n - kept :].transpose(1, 2), v_all[:, held - n - kept :].transpose(1, 2)
        old = self._old[i]
        if mode == "compact":
            if old is not None:
                k_all[:, :kept].copy_(old[0])
                v_all[:, :kept].copy_(old[1])
            k_all[:, kept:].copy_(new_k)
            v_all[:, kept:].copy_(new_v)
            self._old[i] = None
            return k_all.transpose(1, 2), v_all.transpose(1, 2)
        # overflow: the layer attends to the kept tokens and all new ones; the row keeps the last window - 1.
        full_k = torch.cat([old[0], new_k], dim=1) if old is not None else new_k
        full_v = torch.cat([old[1], new_v], dim=1) if old is not None else new_v
        store = self.length
        k_all.copy_(full_k[:, -store:])
        v_all.copy_(full_v[:, -store:])
        self._old[i] = None
        if old is None:
            return key_states, value_states
        return full_k.transpose(1, 2), full_v.transpose(1, 2)

    def end_step(self) -> None:
        self._old = []

    def mask_sizes(self, layer: int, query_length: int) -> tuple[int, int]:
        seen = self.seq_length(layer)
        kept = min(seen, self.window - 1)
        return kept + query_length, seen - kept

    def views(self, layer: int):
        """(K, V) of what the layer holds: the row's tokens (at most window - 1 + slack of the latest)."""
        if self.kv is None:
            return None, None
        k, v = self.kv.kv_batch(self.local[layer], self.rows)
        return k.transpose(1, 2), v.transpose(1, 2)

    def check_crop(self, tokens_to_remove: int) -> None:
        if self.kv is None or tokens_to_remove == 0:
            return
        if self.seen > self.length:
            raise InvalidArgumentError(
                "crop(): the bounded sliding-window layers have already dropped tokens behind their window, "
                "so they cannot be rolled back (build the cache with bounded_sliding=False for assisted decoding)"
            )
        super().check_crop(tokens_to_remove)

    def crop(self, tokens_to_remove: int) -> None:
        if self.kv is None or tokens_to_remove == 0:
            return
        super().crop(tokens_to_remove)
        self.seen = self.length
