"""VPagedCache under a tensor-parallel model: two gloo processes load a model with transformers' tp_plan="auto"
and run model.generate with a VPagedCache each. Each rank's cache takes its geometry from the K/V it is handed
(its own KV heads: half of them), and the greedy tokens equal one process's."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [2, 4, 8, 16, 32, 64, 128]]
NEW_TOKENS = 12


def _generate(model, vpaged: bool = True):
    from vpaged.hf import VPagedCache, cache_kwargs

    ids = torch.tensor(PROMPTS)
    kwargs = {}
    cache = None
    if vpaged:
        cache = VPagedCache(model.config, max_cache_len=64, capacity_bytes=1 << 20, page_size=4096)
        kwargs = cache_kwargs(cache)
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    heads = cache.num_kv_heads if cache is not None else None
    mapped = cache.kv.stats().mapped_bytes if cache is not None else None
    return out[:, ids.shape[1] :].tolist(), heads, mapped


def _rank(rank: int, size: int, port: int, path: str, results):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, distributed_config=DistributedConfig(tp_plan="auto", tp_size=size)
        )
        results.put((rank, _generate(model)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_generate_with_vpaged_cache_under_two_ranks_equals_one_process(tmp_path):
    import torch.multiprocessing as mp

    from vpaged.serve import load_model

    torch.set_num_threads(1)
    model, _ = load_model("random:llama-tiny")
    model.save_pretrained(tmp_path)
    expected, heads, mapped = _generate(model)
    assert expected == _generate(model, vpaged=False)[0]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(tmp_path), results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    got = dict(results.get() for _ in range(2))
    for rank in (0, 1):
        tokens, rank_heads, rank_mapped = got[rank]
        assert tokens == expected
        assert rank_heads == heads // 2
        # half the one-process pages, within a page per row and run (K and V of each layer of its one head)
        assert abs(2 * rank_mapped - mapped) <= 2 * 2 * model.config.num_hidden_layers * 4096 * len(PROMPTS)
