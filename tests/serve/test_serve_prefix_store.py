"""The engine on a shared prefix store (prefix_store=NAME): a second engine, in this process after the first
closed or in another process, takes a prompt's full blocks from the store, computes only the rest, and gives
the same greedy tokens; /metrics-facing stats count what the store supplied."""

import subprocess
import sys
import textwrap
import uuid

import pytest

pytest.importorskip("transformers")

from vpaged.errors import InvalidArgumentError  # noqa: E402
from vpaged.memory.store import PageStore  # noqa: E402
from vpaged.serve import LLM, SamplingParams  # noqa: E402

PAGE = 4096  # llama-tiny: 128 bytes per token per layer -> 32 tokens a page
GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=8)

pytestmark = pytest.mark.serving


@pytest.fixture
def store_name():
    name = f"test-serve-{uuid.uuid4().hex[:12]}"
    yield name
    PageStore.remove(name)


def engine(model, store, **kw):
    return LLM(model, kv_budget_bytes=8 << 20, page_size=PAGE, prefix_store=store, prefix_store_pages=512, **kw)


@pytest.mark.parametrize("length", ["random", 160], ids=["random-length", "whole-pages"])
def test_a_second_engine_takes_the_prefix_from_the_store(model, prng, store_name, length):
    n = prng.randint(140, 200) if length == "random" else length
    prompt = [prng.randrange(3, 512) for _ in range(n)]
    plain = LLM(model, kv_budget_bytes=8 << 20, page_size=PAGE).generate([prompt], SamplingParams(**GREEDY))[0]
    first = engine(model, store_name)
    a = first.generate([prompt], SamplingParams(**GREEDY))[0]
    sa = first.stats()
    assert sa.prefix_store_hit_tokens_total == 0 and sa.prefix_store_published_pages_total > 0
    first.engine.close()
    full = (len(prompt) // 32) * 32  # the whole pages the store holds
    used = min(full, len(prompt) - 1)  # a prompt of whole pages still computes its last token (its logits)
    hit_bytes = sa.prefix_store_published_pages_total * PAGE
    for mapped in (True, False):
        second = engine(model, store_name, prefix_store_map=mapped)
        b = second.generate([prompt], SamplingParams(**GREEDY))[0]
        sb = second.stats()
        assert sb.prefix_store_hit_tokens_total == full and sb.prefix_hit_tokens == used  # the rest computed
        assert sb.prompt_tokens_total == len(prompt) - used
        # Mapped: the store's pages themselves in the second engine's ranges, no byte copied. Else one copy each.
        assert sb.prefix_store_mapped_bytes_total == (hit_bytes if mapped else 0)
        assert sb.prefix_store_copied_bytes_total == (0 if mapped else hit_bytes)
        assert a.token_ids == b.token_ids == plain.token_ids
        second.engine.close()


def test_other_weights_never_hit(model, reference, prng, store_name):
    """`reference` loads the same random weights: it hits. Changing one weight makes other keys."""
    import torch

    prompt = [prng.randrange(3, 512) for _ in range(100)]
    first = engine(model, store_name)
    first.generate([prompt], SamplingParams(**GREEDY))
    first.engine.close()
    with torch.no_grad():
        next(reference.parameters()).view(-1)[0] += 1.0
    other = engine(reference, store_name)
    other.generate([prompt], SamplingParams(**GREEDY))
    assert other.stats().prefix_store_hit_tokens_total == 0
    other.engine.close()


def test_prefix_store_needs_prefix_caching():
    with pytest.raises(InvalidArgumentError, match="enable_prefix_caching"):
        from vpaged.serve.config import VirtualStoreConfig

        VirtualStoreConfig(kv_budget_bytes=1 << 20, prefix_store="x", enable_prefix_caching=False)


WARM = textwrap.dedent(
    """
    import json, sys
    from vpaged.serve import LLM, SamplingParams, load_model
    store, prompt = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(load_model("random:llama-tiny")[0], kv_budget_bytes=8 << 20, page_size=4096, prefix_store=store,
              prefix_store_pages=512)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8))[0]
    s = llm.stats()
    print(json.dumps([out.token_ids, s.prefix_store_hit_tokens_total, s.prompt_tokens_total]))
    """
)


def test_a_restarted_process_hits_a_dir_store(tmp_path, prng):
    import json

    store = f"dir:{tmp_path / 'kv'}"
    prompt = [prng.randrange(3, 512) for _ in range(300)]
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", WARM, store, json.dumps(prompt)], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    (tokens_cold, hits_cold, computed_cold), (tokens_warm, hits_warm, computed_warm) = runs
    assert hits_cold == 0 and computed_cold == 300
    assert hits_warm == 288 and computed_warm == 12
    assert tokens_cold == tokens_warm
