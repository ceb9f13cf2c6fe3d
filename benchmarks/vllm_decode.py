"""vllm_runner.py's `decode` job: time vLLM's CPU paged-attention decode op on K/V given by the caller.

The op is the one vLLM's CPU attention backend (vllm/v1/attention/backends/cpu_attn.py, CPUAttentionBackendImpl)
calls for every attention layer: `vllm._custom_ops.cpu_attention_with_kv_cache` (torch.ops._C), with the
scheduler metadata its metadata builder makes (`cpu_attn_get_scheduler_metadata`, KV split as
VLLM_CPU_ATTN_SPLIT_KV says) and the ISA its `_get_attn_isa` picks. Its cache is laid out as the backend lays
it (filled by its own `cpu_attn_reshape_and_cache`): one [num_blocks, kv_heads, block_size, 2 * head_dim] tensor viewed as [num_blocks, kv_heads,
2 * block_size, head_dim] and split in two along dim 2 (keys, then values, of each block). The block sizes are
the job's (default 128, vLLM's CPU default): each is timed, since the ISA `_get_attn_isa` picks depends on it (its
AMX kernel wants blocks of 32), and the fastest is what the op is judged by ("vLLM's best kernel").

Job: tensors (a torch.save file of {"q": [B, H, D], "k": [B, T, KV, D], "v": the same} per case name),
out (where to torch.save the outputs of each case's fastest block size), repeats, threads, flush_bytes,
block_sizes. Each call is timed after reading a buffer of flush_bytes (larger than the last-level cache), as
bench_decode.py's Timer does.
"""

from __future__ import annotations

import statistics
import time

BLOCK_SIZES = (128,)


def decode(job: dict) -> dict:
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch.set_num_threads(int(job.get("threads", torch.get_num_threads())))
    # Linux hands a process the AMX tile state only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM); without it
    # the first tile instruction is SIGILL. vLLM's kernel does not ask: in its worker oneDNN has asked already,
    # on the model's first bf16 product. This job runs no product, so it asks the way oneDNN does (torch's own
    # call, a no-op returning False on a CPU without AMX).
    amx_granted = bool(getattr(torch._C._cpu, "_init_amx", lambda: False)())
    data = torch.load(job["tensors"])
    flush = torch.ones(int(job.get("flush_bytes", 256 << 20)) // 4, dtype=torch.int32)
    repeats = int(job.get("repeats", 9))
    split = bool(job.get("enable_kv_split", True))
    results, outputs = {}, {}
    for name, t in data.items():
        by_block = {}
        for block_size in job.get("block_sizes", BLOCK_SIZES):
            try:
                by_block[block_size], out = _time_op(ops, _get_attn_isa, t, int(block_size), repeats, split, flush)
            except Exception as e:  # noqa: BLE001 - a block size this build does not take: reported, not fatal
                by_block[block_size] = {"error": f"{type(e).__name__}: {e}"}
                continue
            best = results.get(name)
            if best is None or by_block[block_size]["median_ms"] < best["median_ms"]:
                results[name] = dict(by_block[block_size])
                outputs[name] = out
        if name not in results:
            raise RuntimeError(f"{name}: no block size ran: {by_block}")
        results[name]["by_block"] = {str(bs): r for bs, r in by_block.items()}
    torch.save(outputs, job["out"])
    import vllm

    return {
        "vllm_version": getattr(vllm, "__version__", "?"),
        "threads": torch.get_num_threads(),
        "amx_granted": amx_granted,
        "ops": results,
    }


def _time_op(ops, get_isa, t: dict, block_size: int, repeats: int, split: bool, flush) -> tuple[dict, object]:
    """The op on one case's K/V laid out in blocks of block_size: its timing and its output."""
    import torch

    q, k, v = t["q"], t["k"], t["v"]
    batch, heads, dim = q.shape
    ctx, kv_heads = k.shape[1], k.shape[2]
    dtype = q.dtype
    per_seq = -(-ctx // block_size)
    num_blocks = batch * per_seq
    kv = torch.zeros(num_blocks, kv_heads, block_size, 2 * dim, dtype=dtype)
    key_cache, value_cache = kv.view(num_blocks, kv_heads, 2 * block_size, dim).chunk(2, dim=2)
    isa = get_isa(dtype, block_size, dim)
    # sequence b owns blocks b*per_seq ..; token t of it goes to slot (b*per_seq + t // bs) * bs + t % bs,
    # written by the backend's own op (its block interior depends on the ISA)
    for b in range(batch):
        slots = (b * per_seq * block_size + torch.arange(ctx)).to(torch.int64)
        ops.cpu_attn_reshape_and_cache(k[b].contiguous(), v[b].contiguous(), key_cache, value_cache, slots, isa)
    block_table = torch.arange(num_blocks, dtype=torch.int32).view(batch, per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=split,
    )
    out = torch.empty_like(q)
    scale = dim**-0.5

    def call():
        ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            scale=scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=block_table,
            softcap=0.0,
            scheduler_metadata=meta,
            s_aux=None,
        )

    call()  # warm-up
    samples = []
    for _ in range(repeats):
        flush.max()
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    timing = {
        "median_ms": statistics.median(samples) * 1e3,
        "samples_ms": [s * 1e3 for s in samples],
        "isa": isa,
        "block_size": block_size,
        "enable_kv_split": split,
    }
    return timing, out.clone()
