"""vLLM's CPU engine with vpaged's KV connector: greedy tokens identical with and without it, on a random Llama
and on SmolLM2; a second engine process (a restart) fills its prompts' prefixes from the store; a store page
damaged between two runs is computed again with the same tokens (kv_load_failure_policy "recompute").

Each engine runs in a fresh process (VLLM_ENABLE_V1_MULTIPROCESSING=0: scheduler and worker in it). Skips
where vllm is not importable (scripts/test_vllm.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "benchmarks"))

from test_vllm_plugin import _has_vllm, workload_prompts  # noqa: E402

needs_vllm = pytest.mark.skipif(
    not _has_vllm(), reason="vllm is not installed (scripts/test_vllm.sh makes a venv with it)"
)


def _run(model: Path, store: str | None, prompts: str, plugin: bool = False, blocks: int = 64) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env["VPAGED_VLLM"] = "1" if plugin else "0"
    cmd = [sys.executable, __file__, str(model), store or "-", prompts, str(blocks)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def store_name():
    from vpaged.memory.store import PageStore

    name = f"conn-engine-{uuid.uuid4().hex[:8]}"
    yield name
    PageStore.remove(name)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("conn_llama")
    proc = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
         f"from test_vllm_plugin import _make_model; _make_model({str(out)!r})"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@needs_vllm
def test_random_llama_same_tokens_and_a_restart_hits(tiny_llama, store_name):
    reference = _run(tiny_llama, None, "prefix")
    first = _run(tiny_llama, store_name, "prefix")
    assert first["tokens"] == reference["tokens"]
    assert first["stats"]["published_pages"] > 0
    restarted = _run(tiny_llama, store_name, "prefix")
    assert restarted["tokens"] == reference["tokens"]
    # Every prompt of the restart was served in the run before: each starts with its full blocks from the store
    # (all but the last token's block), where vLLM's own cache of this new process had nothing.
    assert restarted["stats"]["loaded_tokens"] > 0 and restarted["stats"]["load_failures"] == 0
    assert sum(restarted["cached"]) > sum(first["cached"])


@needs_vllm
def test_a_damaged_store_page_is_computed_again(tiny_llama, store_name):
    from vpaged.memory.store import PageStore

    reference = _run(tiny_llama, None, "prefix")
    _run(tiny_llama, store_name, "prefix")
    with PageStore.open(store_name) as store:
        path, page, published = store.data_path, store.page_bytes, store.stats().published_pages
    assert published > 0
    with open(path, "r+b") as f:  # the first bytes of every second page: some prompts' hits fail their crc32
        for slot in range(0, published, 2):
            f.seek(slot * page)
            f.write(os.urandom(32))
    again = _run(tiny_llama, store_name, "prefix")
    assert again["tokens"] == reference["tokens"]
    assert again["stats"]["load_failures"] > 0 and again["stats"]["faults"] > 0


@needs_vllm
def test_on_vpaged_memory_too(tiny_llama, store_name):
    # 24 blocks of 128 tokens for 24 prompts of up to 4 blocks and their answers: vLLM hands blocks out again
    # for other tokens, among them blocks that mapped store pages.
    reference = _run(tiny_llama, None, "prefix", blocks=24)
    _run(tiny_llama, store_name, "prefix", plugin=True, blocks=24)
    again = _run(tiny_llama, store_name, "prefix", plugin=True, blocks=24)
    assert again["tokens"] == reference["tokens"] and again["stats"]["loaded_tokens"] > 0
    # On vpaged memory every hit maps the store's pages into vLLM's blocks: not one byte copied.
    assert again["stats"]["mapped_bytes"] > 0 and again["stats"]["copied_bytes"] == 0
    # Those blocks got pages of their own before vLLM wrote into them (the tokens above stay identical).
    assert again["plugin"]["file_blocks_replaced"] > 0


def _smollm2() -> Path | None:
    try:
        import real_model
    except ImportError:
        return None
    return None if real_model.why_unavailable() else real_model.model_dir()


@needs_vllm
def test_smollm2_same_tokens_with_the_store(store_name):
    model = _smollm2()
    if model is None:
        pytest.skip("SmolLM2-135M-Instruct is not available here (benchmarks/real_model.py)")
    reference = _run(model, None, "prose")
    _run(model, store_name, "prose")
    again = _run(model, store_name, "prose")
    assert again["tokens"] == reference["tokens"] and again["stats"]["loaded_tokens"] > 0


@needs_vllm
def test_a_prefill_instance_hands_its_prompts_to_a_decode_instance(tiny_llama, store_name, tmp_path):
    """vLLM's kv_transfer_params protocol, as a proxy drives it: each prompt to the producer with max_tokens 1
    and {"do_remote_decode": true}, then with the params it returns to the consumer (on vpaged memory), which
    computes one token of each prompt and generates what one instance alone generates."""
    reference = _run(tiny_llama, None, "prefix")
    params = tmp_path / "params.json"
    produced = _run(tiny_llama, store_name, f"produce:{params}")
    assert produced["sched"]["handoffs_out"] == 24
    consumed = _run(tiny_llama, store_name, f"consume:{params}", plugin=True)
    assert consumed["tokens"] == reference["tokens"]
    # Every decode request found its whole prompt but the last token (vLLM's own cache supplied some blocks:
    # prompts share prefixes), so the consumer computed one token of each.
    assert consumed["sched"]["handoffs_in"] == 24
    lengths = [len(p) for p in workload_prompts("prefix", n=24)]
    assert consumed["sched"]["handoff_computed_tokens"] == 24 and sum(lengths) > 24 * 100
    # The full blocks are mapped; only each prompt's last block, which decoding writes into, is copied.
    assert consumed["stats"]["mapped_bytes"] > 0 and consumed["stats"]["load_failures"] == 0


# ---- the engine process ----


def _prose_prompts(model: str, n: int = 12) -> list[list[int]]:
    import random

    import real_model
    from transformers import AutoTokenizer

    ids = real_model.prose_ids(AutoTokenizer.from_pretrained(model), 2000)
    rng = random.Random(11)
    heads = [ids[i * 300 : (i + 1) * 300] for i in range(3)]  # three shared openings of 300 tokens
    return [rng.choice(heads) + ids[1000 + 60 * k : 1000 + 60 * k + rng.randint(10, 120)] for k in range(n)]


def _engine(model: str, store: str, prompts: str, blocks: int) -> None:
    if os.environ.get("VPAGED_VLLM") == "1":
        import vpaged.integrations.vllm as plugin

        plugin.register()
    from vllm import LLM, SamplingParams

    kwargs = {}
    mode, _, params_path = prompts.partition(":")
    role = {"produce": "kv_producer", "consume": "kv_consumer"}.get(mode, "kv_both")
    if store != "-":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "VPagedConnector",
            "kv_connector_module_path": "vpaged.integrations.vllm.connector",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": store, "store_bytes": 512 << 20},
        }
    llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
              num_gpu_blocks_override=blocks, enable_prefix_caching=True, **kwargs)  # fmt: skip
    batch = _prose_prompts(model) if prompts == "prose" else workload_prompts("prefix", n=24)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    if mode == "produce":
        handoff = {"kv_transfer_params": {"do_remote_decode": True}}
        params = [SamplingParams(temperature=0, max_tokens=1, extra_args=handoff) for _ in batch]
    elif mode == "consume":
        handed = json.loads(Path(params_path).read_text())
        params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, extra_args={"kv_transfer_params": h})
                  for h in handed]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    if mode == "produce":
        Path(params_path).write_text(json.dumps([o.kv_transfer_params for o in outs]))
    stats = sched = None
    if store != "-":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        stats = dict(get_kv_transfer_group().worker_side.stats.__dict__)
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side.stats.__dict__
    plugin_stats = None
    if os.environ.get("VPAGED_VLLM") == "1":
        import vpaged.integrations.vllm as plugin

        s = plugin.stats()
        plugin_stats = s and s.__dict__
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    cached = [o.num_cached_tokens for o in outs]
    print(json.dumps({"tokens": tokens, "cached": cached, "stats": stats, "sched": sched, "plugin": plugin_stats}))


if __name__ == "__main__":
    _engine(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
