"""Prompt chunks on the decode kernel (stores/attention.py: kernel_chunks): on the CPU a VirtualStore step gives the
query tokens of its short prefill chunks to the decode kernel, one row each over the tokens up to its own, in the
call that runs the decode rows; longer chunks, and every chunk after the first long one, run SDPA.

An engine stepping that way and one with every chunk on SDPA (KERNEL_CHUNK_KV_BYTES 0) step the same requests in
lockstep (chunks after cached prefixes, decode rows beside them, a prompt-logprob request, bf16 and fp32, int8 K/V)
and give the same logits up to the kernels' order of sums; the kernel really took chunks, and with a threshold
between the chunks' sizes, the steps mix both paths."""

import pytest
import torch
from serve_helpers import assert_logits_agree, run_lockstep

from vpaged.serve import LLMEngine, SamplingParams
from vpaged.serve.stores import attention
from vpaged.serve.stores.attention import kernel_chunks

VOCAB = 512


def requests(prng, count: int = 6):
    """Prompts of 1-120 random ids sharing a 40-token prefix (cached pages: chunks that start after a prefix),
    greedy; the second asks for prompt logprobs."""
    prefix = [prng.randrange(3, VOCAB) for _ in range(40)]
    out = []
    for i in range(count):
        prompt = prefix + [prng.randrange(3, VOCAB) for _ in range(prng.randint(1, 80))]
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=1 if i == 1 else None)
        out.append((prompt, params))
    return out


def engine(**options) -> LLMEngine:
    options = dict(dict(kv_budget_bytes=8 << 20, page_size=4096, max_num_batched_tokens=64), **options)
    return LLMEngine("random:qwen2-tiny", **options)


def count_kernel_chunks(eng: LLMEngine) -> list[tuple[int, int]]:
    """(chunks the kernel took, chunks in the step) of each step from now on."""
    seen = []
    store = eng.store
    inner = store.step_attention

    def step_attention(*args):
        step = inner(*args)
        seen.append((step.kernel_chunks, len(step.prefills)))
        return step

    store.step_attention = step_attention
    return seen


def every_chunk_on_sdpa(eng: LLMEngine, monkeypatch) -> None:
    """The engine's steps see a threshold of 0 bytes (every prompt chunk on SDPA); other engines keep theirs."""
    inner = eng.store.step_attention

    def step_attention(*args):
        threshold = attention.KERNEL_CHUNK_KV_BYTES
        monkeypatch.setattr(attention, "KERNEL_CHUNK_KV_BYTES", 0)
        try:
            return inner(*args)
        finally:
            monkeypatch.setattr(attention, "KERNEL_CHUNK_KV_BYTES", threshold)

    eng.store.step_attention = step_attention


@pytest.mark.parametrize(
    "dtype, options",
    [(torch.float32, {}), (torch.bfloat16, {}), (torch.float32, dict(kv_dtype=torch.int8))],
    ids=["fp32", "bf16", "int8"],
)
def test_chunks_on_the_kernel_give_sdpas_logits(monkeypatch, prng, dtype, options):
    on_kernel, on_sdpa = engine(dtype=dtype, **options), engine(dtype=dtype, **options)
    taken = count_kernel_chunks(on_kernel)
    every_chunk_on_sdpa(on_sdpa, monkeypatch)
    assert_logits_agree(*run_lockstep(on_kernel, on_sdpa, requests(prng)), dtype)
    assert sum(k for k, _ in taken) >= 6 and all(k == n for k, n in taken)  # every chunk here is short


def test_a_long_chunk_sends_it_and_the_chunks_after_it_to_sdpa(monkeypatch, prng):
    bytes_per_token = 2 * 2 * 16 * 4  # K and V of 2 kv heads x 16 dims, fp32
    monkeypatch.setattr(attention, "KERNEL_CHUNK_KV_BYTES", 8 * bytes_per_token)  # chunks of sequences <= 8 tokens
    mixed, reference = engine(), engine()
    taken = count_kernel_chunks(mixed)
    every_chunk_on_sdpa(reference, monkeypatch)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    # a 3-token prompt and a 50-token one share the first step: the kernel takes the first chunk, SDPA the second
    first = [([prng.randrange(3, VOCAB) for _ in range(n)], greedy) for n in (3, 50)]
    assert_logits_agree(*run_lockstep(mixed, reference, first + requests(prng, 6)), torch.float32)
    assert taken[0][0] == 1 and taken[0][1] >= 2, taken


def test_kernel_chunks_takes_the_leading_chunks_under_the_threshold():
    limit = attention.KERNEL_CHUNK_KV_BYTES
    per_token = 1024
    fits = limit // per_token
    assert kernel_chunks([], per_token) == 0
    assert kernel_chunks([(None, 0, fits)], per_token) == 1
    assert kernel_chunks([(None, 0, fits + 1)], per_token) == 0
    chunks = [(None, 0, 10), (None, fits - 5, 5), (None, fits, 1), (None, 0, 3)]
    assert kernel_chunks(chunks, per_token) == 2  # the third passes it: it and the fourth go to SDPA
