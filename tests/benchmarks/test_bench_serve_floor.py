"""benchmarks/bench_serve_floor.py counts the work of a serving workload; the counts are checked here against
torch's own FLOP counter on real forwards of a small model and against K/V read by a cache that decodes."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from vpaged import KVGeometry, VirtualCacheConfig  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def floor():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_serve_floor", BENCH / "bench_serve_floor.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def model():
    from vpaged.serve import load_model

    return load_model("random:llama-tiny", dtype=torch.float32)[0]


def counted_flops(model, ids: torch.Tensor) -> tuple[int, int]:
    """(linear-layer flops, attention flops) torch counts in a forward of ids (logits of the last row)."""
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids, logits_to_keep=1)
    by_op = {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}
    # eager attention: Q K^T and P V are the batched products (bmm); the linear layers are mm.
    return by_op.get("mm", 0) + by_op.get("addmm", 0), by_op.get("bmm", 0)


def test_product_and_attention_flops_match_torch_counter(floor):
    from vpaged.serve import load_model

    model = load_model("random:llama-tiny", dtype=torch.float32, attn_implementation="eager")[0]
    rng = random.Random()
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(3, 40))] for _ in range(rng.randint(2, 5))]
    max_tokens = rng.randint(2, 6)
    counts = floor.workload_counts(model, prompts, max_tokens)
    products = square = 0
    for p in prompts:
        got = counted_flops(model, torch.tensor([p]))
        products += got[0]
        square += got[1]
    assert counts["prompt_product_flops"] == products
    # Eager attention computes the whole [p, p] score square and masks it; the floor counts only what
    # causality needs, row i of the square up to column i: p (p + 1) / 2 of its p^2 entries.
    assert counts["prompt_attention_flops"] == sum(
        square_p * (len(p) + 1) // (2 * len(p))
        for square_p, p in ((counted_flops(model, torch.tensor([p]))[1], p) for p in prompts)
    )
    assert square > 0
    # One decode token: the layers and the LM head on one row.
    one, _ = counted_flops(model, torch.tensor([[11]]))
    assert counts["decode_product_flops"] == one * len(prompts) * (max_tokens - 1)
    assert counts["decode_tokens"] == len(prompts) * (max_tokens - 1)


def test_decode_kv_bytes_match_a_cache_that_decodes(floor, model):
    from vpaged import VirtualKVCache

    rng = random.Random()
    prompts = [[11] * rng.randint(1, 30) for _ in range(rng.randint(1, 4))]
    max_tokens = rng.randint(2, 7)
    counts = floor.workload_counts(model, prompts, max_tokens)
    cfg = model.config
    cache = VirtualKVCache(
        KVGeometry(cfg.num_hidden_layers, cfg.num_key_value_heads, 16, torch.float32),
        VirtualCacheConfig(max_seqs=len(prompts), max_seq_len=64, capacity_bytes=8 << 20),
    )
    read = 0
    try:
        for p in prompts:
            s = cache.allocate()
            cache.extend(s, len(p) + 1)  # the prompt and the first output token's K/V
            for _ in range(max_tokens - 1):  # each later output token attends to all K/V so far
                read += sum(
                    k.nbytes + v.nbytes for k, v in (cache.kv(layer, s) for layer in range(cfg.num_hidden_layers))
                )
                cache.extend(s, 1)
    finally:
        cache.close()
    assert counts["decode_kv_bytes"] == read
    assert counts["kv_bytes_per_token"] == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 16 * 4


def test_compare_reads_bench_serve_rows(floor, tmp_path):
    rows = [{"kv": "vpaged", "seconds": 30.0}, {"kv": "generate_batch", "seconds": 240.0}]
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"throughput": {"rows": rows}}))
    got = floor.compare(20.0, 25.0, path)
    assert got["rows"]["vpaged"] == {"seconds": 30.0, "x_floor": 1.5, "x_estimate": 1.2}
    assert got["six_x_generate_batch"] == {"seconds": 40.0, "x_floor": 2.0, "x_estimate": 1.6}


def test_compare_takes_each_kv_at_the_median_of_its_rounds(floor, tmp_path):
    rows = [{"kv": "vpaged", "seconds": s} for s in (30.0, 50.0, 34.0)] + [{"kv": "vllm", "seconds": 60.0}]
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"throughput": {"rows": rows}}))
    got = floor.compare(20.0, 25.0, path)["rows"]
    assert got["vpaged"]["seconds"] == 34.0 and got["vpaged"]["rounds_seconds"] == [30.0, 50.0, 34.0]
    assert got["vpaged"]["rounds_x_floor"] == [1.5, 2.5, 1.7]
    assert got["vllm"] == {"seconds": 60.0, "x_floor": 3.0, "x_estimate": 2.4}
