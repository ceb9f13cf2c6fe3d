"""StepAttention: one packed step's attention, planned once and run per layer, shared by every store.

Each step the runner asks its store for a StepAttention: the per-step metadata (slots, lengths, block
tables, views of the tokens to write) is built once, and every layer's attention call reads it. A store
supplies how new K/V are written, how decode rows attend (its kernel) and where a prefill chunk's K/V are;
the packing of the batch and the prefill attention (SDPA) are the same for all of them. Views of the cache
live only for one step: a view pins pages, and pinned pages cannot be swapped out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F


class StepAttention(ABC):
    """One step's attention for the packed batch: rows 0..num_decodes-1 are decode tokens (one per
    sequence), then the prefill chunks. attend() is called once per layer by the attention function."""

    def __init__(
        self,
        num_decodes: int,
        prefills: list[tuple[int, int, int]],
        num_tokens: int,
        device=None,
        kernel_chunks: int = 0,
    ):
        """kernel_chunks: how many leading prefill chunks the store's decode kernel attends, one row per query
        token (see kernel_chunks()); their rows follow the decode rows, and decode() gets them all in one call."""
        self.num_decodes = num_decodes
        self.prefills = prefills  # (row offset, start position, tokens) per prefill chunk
        self.num_tokens = num_tokens
        self.kernel_chunks = kernel_chunks
        self.kernel_rows = num_decodes + sum(n for _, _, n in prefills[:kernel_chunks])
        on_cpu = device is None or torch.device(device).type == "cpu"
        self.split_chunks = on_cpu and FLASH_CPU is not None
        # A chunk after a cached prefix needs a mask, unless it is split (prefix_then_causal).
        self.causal_masks = [None if self.split_chunks else chunk_mask(start, n, None) for _, start, n in prefills]
        if not on_cpu:
            self.causal_masks = [m if m is None else m.to(device) for m in self.causal_masks]

    def attend(self, layer: int, query, key, value, scale) -> torch.Tensor:
        """transformers' call: query [1, H, T, D], key / value [1, KVH, T, D] -> [1, T, H, D]."""
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        return self.attend_rows(layer, q, k, v, scale).unsqueeze(0)

    def attend_rows(self, layer: int, qt, k, v, scale) -> torch.Tensor:
        """The packed rows' attention: qt [T, H, D], k / v [T, KVH, D] (any row strides) -> [T, H, D], after
        writing k and v into the cache (vpaged.serve.direct_forward calls this directly)."""
        self.write(layer, k, v)
        out = torch.empty(qt.shape, dtype=qt.dtype, device=qt.device)
        rows = self.kernel_rows
        if rows:
            self.decode(layer, qt[:rows], scale, out[:rows])
        for i in range(self.kernel_chunks, len(self.prefills)):
            row, start, n = self.prefills[i]
            k, v = self.prefill_kv(layer, i)  # [start + n, KVH, D]
            q = qt[row : row + n].transpose(0, 1).unsqueeze(0)
            if start and self.split_chunks:
                o = prefix_then_causal(q, k, v, start, scale)
            else:
                mask = self.causal_masks[i]
                o = F.scaled_dot_product_attention(
                    q,
                    heads_first(k, qt.shape[1]),
                    heads_first(v, qt.shape[1]),
                    attn_mask=mask,
                    is_causal=mask is None and n > 1,
                    scale=scale,
                )
            out[row : row + n] = o[0].transpose(0, 1)
        return out

    @abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new K and V ([T, KVH, D], packed rows) of one layer in the cache."""

    @abstractmethod
    def decode(self, layer: int, q: torch.Tensor, scale, out: torch.Tensor) -> None:
        """Attention of the kernel's rows q ([kernel_rows, H, D]: the decode rows, then the query tokens of the
        first kernel_chunks prefill chunks) over their sequences, into out."""

    @abstractmethod
    def prefill_kv(self, layer: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ([start + n, KVH, D]) that prefill chunk i attends over, its own tokens included."""


# A prefill chunk whose sequence's K/V (its prefix and itself) take at most this many bytes in a layer is attended
# by the decode kernel, one row per query token, each over the tokens up to its own (causal by length): the kernel
# then reads that K/V once per query token, from the caches. Past it SDPA's blocked kernel, which reads it once per
# block of queries, is faster. Measured on a 2-core Zen 4 (bf16, 9 query heads over 3 of 64: 768 bytes a token),
# the kernel's time over SDPA's: 0.80x at 128 tokens, 0.66x at 512, 0.65x at 2,048 (eight 256-token prompts in one
# call: 0.49x), 1.13x at 4,096, 1.09x for 256 after 2,048 cached, 1.25x for 512 after 8,192 (benchmarks/NOTES.md,
# "Prompt chunks on the decode kernel").
KERNEL_CHUNK_KV_BYTES = 2 << 20


def kernel_chunks(prefills, kv_bytes_per_token: int) -> int:
    """How many leading chunks of prefills ((sequence, start, tokens) each) the decode kernel attends: those up to
    the first whose sequence's K/V in a layer would pass KERNEL_CHUNK_KV_BYTES."""
    taken = 0
    for _, start, n in prefills:
        if (start + n) * kv_bytes_per_token > KERNEL_CHUNK_KV_BYTES:
            break
        taken += 1
    return taken


def decodes_as_prefills(decodes, prefills, row_offsets: list[int]):
    """The same step with every decode row as a one-token prefill chunk (SDPA over the sequence's view):
    for a cache whose geometry the decode kernel does not take on its device (ops.support). Decode rows are
    the packed batch's first rows, in order."""
    chunks = [(seq, seq.num_computed, 1) for seq in decodes]
    return [], chunks + list(prefills), list(range(len(decodes))) + list(row_offsets)


def prefill_rows(row_offsets: list[int], prefills) -> list[tuple[int, int, int]]:
    """(row offset, start, tokens) of each prefill chunk, from the plan's (sequence, start, tokens)."""
    return [(r, s, n) for r, (_, s, n) in zip(row_offsets, prefills)]


def heads_first(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """[S, KVH, D] cached K or V as [1, heads, S, D], each KV head repeated for its query-head group.

    SDPA's fused CPU kernel takes only 4D inputs with as many K/V heads as query heads: grouped heads
    (enable_gqa) or 3D inputs fall back to the unfused math path, 2-5x slower on a prefill chunk here. The
    copy costs S x heads x D elements, small next to the chunk's attention."""
    kv = kv.transpose(0, 1)
    group = heads // kv.shape[0]
    if group > 1:
        kv = kv.repeat_interleave(group, dim=0)
    return kv.unsqueeze(0)


# SDPA's fused CPU kernel, called directly for the log-sum-exp of each row it returns beside the output (the public
# call drops it); None where this torch has no such op, and then every chunk goes through the public call, masked.
FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prefix_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale) -> torch.Tensor:
    """Attention of a chunk's queries q [1, H, n, D] at positions start.. over the cached and new k, v
    [start + n, KVH, D] (H a multiple of KVH, query head h on K/V head h // (H / KVH)): the same as SDPA with the
    chunk's bottom-right causal mask, in two unmasked calls of the fused CPU kernel, over the cached prefix (every
    key visible) and over the chunk itself (plain causal), merged by their log-sum-exps (softmax over the union of
    two key sets: each part's output weighted by its share of the total exp-sum).

    Why: given a mask, the kernel computes every (query, key) pair and masks after; here it skips the chunk's
    upper triangle and reads no mask. And since every query sees the whole prefix, the query heads of a K/V head
    go to the prefix's call as one head of group x n queries: the cached K/V are read as they are, not copied
    once per query head, and the kernel's blocks of queries are larger. On one Zen 3 core (fp32, 9 heads over 3
    of 64) a 464-token chunk after 3,036 cached tokens takes 0.83x the masked call's time, 2,000 after 1,000 0.62x,
    64 after 4,000 0.69x (benchmarks/bench_chunk_attention.py)."""
    heads, n, dim = q.shape[1], q.shape[2], q.shape[3]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    grouped = q.reshape(1, kv_heads, group * n, dim)  # heads h = j * group + g, kv-head-major
    prefix_k, prefix_v = k[:start].transpose(0, 1).unsqueeze(0), v[:start].transpose(0, 1).unsqueeze(0)
    o1, lse1 = FLASH_CPU(grouped, prefix_k, prefix_v, scale=scale)[:2]
    o1, lse1 = o1.reshape(1, heads, n, dim), lse1.reshape(1, heads, n)
    own_k, own_v = heads_first(k[start:], heads), heads_first(v[start:], heads)
    o2, lse2 = FLASH_CPU(q, own_k, own_v, is_causal=n > 1, scale=scale)[:2]
    # lse [1, H, n], float32 for every input dtype; the merge runs in float32 and rounds once.
    top = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - top).exp_(), (lse2 - top).exp_()
    total = w1 + w2
    merged = o1.float().mul_((w1 / total).unsqueeze(-1)).add_(o2.float().mul_((w2 / total).unsqueeze(-1)))
    return merged.to(q.dtype)


def chunk_mask(start: int, n: int, device):
    """Causal mask of a chunk of n queries at positions start.. over keys 0..start+n-1 (bottom-right
    aligned); None when the chunk starts at 0 (plain causal)."""
    if start == 0:
        return None
    q = torch.arange(start, start + n, device=device)[:, None]
    return torch.arange(start + n, device=device)[None, :] <= q
