"""vpaged.integrations.vllm: the page bookkeeping of the KV backing (no vLLM needed), the switch and the
guards, and vLLM 0.32's CPU engine giving the same greedy tokens with the plugin as without it.

The vLLM tests skip where vllm is not importable (run them with the venv of scripts/test_vllm.sh). The
end-to-end run uses VLLM_ENABLE_V1_MULTIPROCESSING=0 and calls register() itself where vLLM's entry point
would (the entry point needs vpaged installed into that venv)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vpaged.errors import InvalidArgumentError
from vpaged.integrations.vllm import guard
from vpaged.integrations.vllm.backing import BlockGeometry, KVBacking, make_pool

ROOT = Path(__file__).resolve().parents[2]


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


needs_vllm = pytest.mark.skipif(
    not _has_vllm(), reason="vllm is not installed (scripts/test_vllm.sh makes a venv with it)"
)


def _reference_pages(geoms, blocks, page):
    """Pages the held blocks touch, byte by byte from the KVCacheTensor formula."""
    pages = set()
    for g in geoms:
        for b in blocks:
            for layer in range(g.num_layers):
                start = g.offset + layer * g.layer_stride + b * g.block_stride
                pages.update(x // page for x in range(start, start + g.block_bytes, 512))
                pages.add((start + g.block_bytes - 1) // page)
    return pages


@pytest.mark.parametrize("outer", ["layer", "block"])
def test_pages_follow_held_blocks(outer):
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    layers, blocks, block_bytes = rng.randint(1, 4), rng.randint(8, 64), rng.choice([4096, 12288, 65536, 98304])
    if outer == "layer":
        geom = BlockGeometry(0, block_bytes * blocks, block_bytes, block_bytes, layers, blocks)
    else:
        geom = BlockGeometry(0, block_bytes, block_bytes * layers, block_bytes, layers, blocks)
    nbytes = layers * blocks * block_bytes
    backing = KVBacking(nbytes, [geom], make_pool(nbytes))
    page = backing.page_size
    held: dict[int, int] = {}  # block -> the byte it holds in each layer span
    t = backing.tensor
    for _ in range(60):
        if rng.random() < 0.6:
            new = rng.sample(range(blocks), rng.randint(1, 4))
            backing.map_blocks(new)
            for b in new:
                if b not in held:
                    held[b] = rng.randint(1, 100)
                    for start, end in geom.spans(b):
                        t[start:end] = held[b]
        elif held:
            gone = rng.sample(sorted(held), rng.randint(1, len(held)))
            backing.release_blocks(gone)
            for b in gone:
                del held[b]
        want = _reference_pages([geom], held, page)
        assert backing.stats().mapped_bytes == len(want) * page, seed
        for b, value in held.items():
            for start, end in geom.spans(b):
                assert torch.all(t[start:end] == value), seed
    backing.release_blocks(range(blocks))
    assert backing.stats().mapped_bytes == 0
    backing.map_all()  # pages given back and mapped again read as zeros, like vLLM's torch.zeros buffer
    assert int(t.abs().sum()) == 0


def test_bad_block_changes_nothing():
    geom = BlockGeometry(0, 4096 * 32, 4096, 4096, 2, 32)
    backing = KVBacking(2 * 4096 * 32, [geom], make_pool(2 * 4096 * 32))
    backing.map_blocks([3])
    before = backing.stats()
    with pytest.raises(InvalidArgumentError):
        backing.map_blocks([4, 32])
    assert backing.stats() == before and not backing.is_mapped(4)
    with pytest.raises(InvalidArgumentError):
        KVBacking(4096, [geom], make_pool(4096))  # the tensor reaches past the buffer


def test_switch_and_version_guard():
    assert not guard.enabled({}) and not guard.enabled({"VPAGED_VLLM": "0"}) and guard.enabled({"VPAGED_VLLM": "1"})
    assert guard.version_supported("0.32.0") and guard.version_supported("0.32.0+cpu")
    assert not guard.version_supported("0.31.2") and not guard.version_supported("0.33.0")


def test_parallel_workers_are_declined(monkeypatch, caplog):
    """TP or PP > 1: the worker holding the KV is not the process with vLLM's block pool, so the plugin
    keeps vLLM's own buffer (with the reason in one warning) rather than a buffer that only grows."""
    from types import SimpleNamespace

    from vpaged.integrations.vllm import patches

    class FullAttentionSpec:  # the plain spec's name is what the guard matches
        page_size_bytes = 4096

    tensor = SimpleNamespace(size=1 << 20, layers=["a"], offset=0, layer_stride=1 << 19, block_stride=4096)
    config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=["a"])],
        kv_cache_tensors=[tensor],
    )
    calls = []
    allocate = patches.make_allocate_kv_cache(lambda *a: calls.append(a) or "vllm's own")
    monkeypatch.setattr(guard, "_warned", set())
    for tp, pp in [(2, 1), (1, 2), (4, 2)]:
        assert guard.parallel_refusal(tp, pp) is not None
        monkeypatch.setattr(patches, "_parallel_sizes", lambda tp=tp, pp=pp: (tp, pp))
        with caplog.at_level("WARNING", logger="vpaged.integrations.vllm"):
            assert allocate(config, torch.device("cpu"), None) == "vllm's own"
    assert len(calls) == 3 and patches.STATE.backing is None
    assert any("never give a page back" in r.getMessage() for r in caplog.records)
    assert guard.parallel_refusal(1, 1) is None


@needs_vllm
def test_off_by_default_changes_nothing(monkeypatch):
    from vllm.v1.worker import gpu_model_runner

    import vpaged.integrations.vllm as plugin

    monkeypatch.delenv("VPAGED_VLLM", raising=False)
    before = gpu_model_runner.allocate_kv_cache
    assert plugin.register() is plugin.installed()
    if not plugin.installed():
        assert gpu_model_runner.allocate_kv_cache is before
        assert not hasattr(before, "_vpaged_original")


@needs_vllm
def test_unsupported_version_declines_with_a_warning(monkeypatch, caplog):
    import vllm
    from vllm.v1.worker import gpu_model_runner

    import vpaged.integrations.vllm as plugin

    if plugin.installed():
        pytest.skip("the hooks are already in this process")
    monkeypatch.setenv("VPAGED_VLLM", "1")
    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    monkeypatch.setattr(guard, "_warned", set())
    before = gpu_model_runner.allocate_kv_cache
    with caplog.at_level("WARNING", logger="vpaged.integrations.vllm"):
        assert plugin.register() is False
    assert gpu_model_runner.allocate_kv_cache is before
    assert any("0.31.9 is not a supported version" in r.getMessage() for r in caplog.records)


@needs_vllm
def test_layouts_it_cannot_map_are_refused():
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, SlidingWindowSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64)
    tensor = KVCacheTensor(size=1 << 20, layers=["a"], layer_stride=1 << 19, block_stride=full.page_size_bytes)

    def config(*specs):
        groups = [SimpleNamespace(kv_cache_spec=s, layer_names=["a"]) for s in specs]
        return SimpleNamespace(kv_cache_groups=groups, kv_cache_tensors=[tensor])

    assert guard.layout_refusal(config(full)) is None
    assert "SlidingWindowSpec" in guard.layout_refusal(config(window))
    assert "hybrid" in guard.layout_refusal(config(full, window))


def _run_engine(model_dir: Path, workload: str, plugin: bool, blocks: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env["VPAGED_VLLM"] = "1" if plugin else "0"
    cmd = [sys.executable, __file__, "engine", str(model_dir), workload, str(blocks)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_llama")
    proc = subprocess.run([sys.executable, __file__, "model", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@needs_vllm
@pytest.mark.parametrize("workload", ["random", "prefix"])
def test_greedy_tokens_identical_with_the_plugin(tiny_llama, workload):
    # Few blocks (640 of 16 tokens for 64 requests of up to 640 tokens) so vLLM preempts and reuses blocks:
    # pages are given back and mapped again while requests run.
    off = _run_engine(tiny_llama, workload, plugin=False, blocks=640)
    on = _run_engine(tiny_llama, workload, plugin=True, blocks=640)
    assert off["plugin"] is None and on["plugin"] is not None
    assert on["tokens"] == off["tokens"]
    assert on["plugin"]["mapped_bytes"] < on["plugin"]["reserved_bytes"]


# ---- subprocess entry points (the engine must start in a fresh process) ----


def _make_model(out: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(3)} | {f"t{i}": i + 3 for i in range(509)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", bos_token="<1>", eos_token="<2>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)


def workload_prompts(kind: str, n: int = 64, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    if kind == "random":
        return [[rng.randrange(3, 512) for _ in range(rng.randint(64, 512))] for _ in range(n)]
    prefixes = [[rng.randrange(3, 512) for _ in range(rng.choice([128, 256]))] for _ in range(4)]
    return [rng.choice(prefixes) + [rng.randrange(3, 512) for _ in range(rng.randint(8, 200))] for _ in range(n)]


def _engine(model: str, workload: str, blocks: int) -> None:
    import vpaged.integrations.vllm as plugin

    plugin.register()  # where vLLM's entry point would call it
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
        num_gpu_blocks_override=blocks,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in workload_prompts(workload)], params)
    s = plugin.stats()
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "plugin": s and s.__dict__}))


if __name__ == "__main__":
    if sys.argv[1] == "model":
        _make_model(sys.argv[2])
    else:
        _engine(sys.argv[2], sys.argv[3], int(sys.argv[4]))
