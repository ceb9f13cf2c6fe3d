"""The serving engine against independent references: single-request model.generate for greedy tokens, the
same engine with other batch compositions / budgets / caches for everything that must not change, and the
caches' own stats for memory. Tiny random-weight fp32 models; pages of 32 tokens (4 KiB at 128 B/token)."""

import pytest
import torch

pytest.importorskip("transformers")

from vpaged.errors import InvalidArgumentError, PromptTooLongError, UnknownRequestError  # noqa: E402
from vpaged.serve import LLM, LLMEngine, SamplingParams, load_model  # noqa: E402

PAGE = 4096  # llama-tiny: 2 KV heads x 16 dims x 4 bytes = 128 bytes per token per layer -> 32 tokens a page
TOKENS_PER_PAGE = 32
GREEDY = dict(temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)


def engine(model, **kw):
    kw.setdefault("kv_budget_bytes", 4 << 20)
    kw.setdefault("page_size", PAGE)
    return LLMEngine(model, **kw)


def run_all(eng, max_steps=10_000):
    final = {}
    for _ in range(max_steps):
        if not eng.has_unfinished():
            return final
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("the engine did not finish")


def random_prompt(prng, lo, hi, vocab=512):
    return [prng.randrange(3, vocab) for _ in range(prng.randint(lo, hi))]


def check_greedy_against_generate(reference, prompt, tokens, max_new):
    """tokens must equal model.generate's greedy tokens; where the reference's top-2 logit gap is below 1e-5
    a mismatch is tolerated (returns 1) and the rest is not compared (the continuations differ)."""
    with torch.no_grad():
        ref = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    ref_tokens = ref.sequences[0, len(prompt) :].tolist()
    assert len(tokens) == len(ref_tokens)
    for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
        if a != b:
            top2 = ref.scores[i][0].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-5, f"token {i}: engine {a}, generate {b} ({tokens} vs {ref_tokens})"
            return 1
    return 0


# ------------------------------------------------------------------------------------------ correctness
@pytest.mark.parametrize("kv", ["vpaged", "paged", "static"])
def test_greedy_equals_generate_with_staggered_arrivals_and_chunked_prefill(model, reference, prng, kv):
    eng = engine(model, kv=kv, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = [random_prompt(prng, 1, 70) for _ in range(7)]
    max_new = [prng.randint(1, 12) for _ in prompts]
    ids, final = [], {}
    for i, (prompt, n) in enumerate(zip(prompts, max_new)):
        ids.append(eng.add_request(prompt, SamplingParams(max_tokens=n, **GREEDY)))
        for _ in range(prng.randint(0, 3)):  # arrivals between steps
            for out in eng.step():
                if out.finished:
                    final[out.request_id] = out
    final.update(run_all(eng))
    tolerated = sum(
        check_greedy_against_generate(reference, p, final[i].token_ids, n) for i, p, n in zip(ids, prompts, max_new)
    )
    assert tolerated <= 1
    assert all(final[i].finish_reason == "length" for i in ids)
    assert eng.stats().live_kv_tokens == 0 and eng.stats().running == 0


@pytest.mark.parametrize("name", ["qwen2-tiny", "qwen3-tiny", "mistral-tiny", "phi3-tiny"])
def test_greedy_equals_generate_for_each_model_class(name, prng):
    model = load_model(f"random:{name}")[0]
    ref = load_model(f"random:{name}")[0]
    eng = LLMEngine(model, kv_budget_bytes=8 << 20, max_num_batched_tokens=24)
    prompts = [random_prompt(prng, 2, 40) for _ in range(3)]
    ids = [eng.add_request(p, SamplingParams(max_tokens=6, **GREEDY)) for p in prompts]
    final = run_all(eng)
    assert sum(check_greedy_against_generate(ref, p, final[i].token_ids, 6) for i, p in zip(ids, prompts)) <= 1


@pytest.mark.parametrize("budget", [16, 64, 4096])
def test_same_tokens_alone_and_among_fifteen_others(model, prng, budget):
    target = random_prompt(prng, 20, 90)
    params = SamplingParams(max_tokens=10, **GREEDY)
    alone = (
        LLM(model, kv_budget_bytes=4 << 20, page_size=PAGE, max_num_batched_tokens=budget)
        .generate([target], params)[0]
        .token_ids
    )
    others = [random_prompt(prng, 1, 120) for _ in range(15)]
    batch = others[:7] + [target] + others[7:]
    outs = LLM(model, kv_budget_bytes=4 << 20, page_size=PAGE, max_num_batched_tokens=budget, max_num_seqs=16).generate(
        batch,
        [SamplingParams(max_tokens=prng.randint(1, 14), **GREEDY) for _ in range(7)]
        + [params]
        + [SamplingParams(max_tokens=prng.randint(1, 14), **GREEDY) for _ in range(8)],
    )
    assert outs[7].token_ids == alone


@pytest.mark.parametrize("kv, swap_seqs", [("vpaged", 8), ("vpaged", 1), ("vpaged", 0), ("paged", 0)])
def test_preemption_changes_no_output(model, prng, kv, swap_seqs):
    """Pages for about three of six growing sequences: the newest are preempted, swapped out while the swap
    space (room for swap_seqs sequences) lasts, else recomputed; no output changes, nothing is left over."""
    prompts = [random_prompt(prng, 60, 90) for _ in range(6)]
    params = SamplingParams(max_tokens=40, **GREEDY)
    roomy = LLM(model, kv=kv, kv_budget_bytes=8 << 20, page_size=PAGE).generate(prompts, params)
    seq_bytes = 5 * 4 * PAGE  # up to 130 tokens: 5 pages in each of 4 regions
    tight = LLM(
        model,
        kv=kv,
        kv_budget_bytes=3 * seq_bytes,
        page_size=PAGE,
        swap_bytes=swap_seqs * seq_bytes,
        max_num_batched_tokens=64,
    )
    outs = tight.generate(prompts, params)
    stats = tight.stats()
    assert stats.preemptions_swap + stats.preemptions_recompute > 0
    if swap_seqs == 8:
        assert stats.preemptions_swap > 0 and stats.preemptions_recompute == 0
    if swap_seqs == 0:
        assert stats.preemptions_swap == 0 and stats.preemptions_recompute > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats.preemptions_swap + stats.preemptions_recompute
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert stats.live_kv_tokens == 0 and stats.swapped == 0
    if kv == "vpaged":
        assert tight.engine.store.cache.stats().swapped_bytes == 0
        assert tight.engine.store.cache.stats().sequences == 0


def test_prefix_caching_hits_map_fewer_bytes_same_outputs(model, prng):
    prefix = random_prompt(prng, 2 * TOKENS_PER_PAGE, 2 * TOKENS_PER_PAGE)
    prompts = [prefix + random_prompt(prng, 5, 30) for _ in range(8)]
    params = SamplingParams(max_tokens=8, **GREEDY)
    results = {}
    for caching in (True, False):
        eng = engine(model, enable_prefix_caching=caching, max_num_batched_tokens=256)
        first = eng.add_request(prompts[0], params)
        final = {}
        while first not in final:  # the first request's prompt pages are cached when its prefill is done
            final.update({o.request_id: o for o in eng.step() if o.finished})
        ids = [first] + [eng.add_request(p, params) for p in prompts[1:]]
        final.update(run_all(eng))
        results[caching] = (
            [final[i].token_ids for i in ids],
            [final[i].metrics.prefix_hit_tokens for i in ids],
            eng.stats(),
        )
    (tok_on, hits_on, stats_on), (tok_off, hits_off, stats_off) = results[True], results[False]
    assert tok_on == tok_off
    assert hits_on[0] == 0 and all(h == 2 * TOKENS_PER_PAGE for h in hits_on[1:])
    assert stats_on.prefix_hit_tokens == 7 * 2 * TOKENS_PER_PAGE and stats_off.prefix_hit_tokens == 0
    assert hits_off == [0] * 8
    assert stats_on.kv_high_water_bytes < stats_off.kv_high_water_bytes
    assert stats_on.prompt_tokens_total == stats_off.prompt_tokens_total - 7 * 2 * TOKENS_PER_PAGE


def test_a_prompt_token_computed_as_a_one_token_row_counts_and_offers_the_prefix(model, prng):
    """A chunk budget can leave a prompt one token, which then runs as a one-token (decode) row: it is a
    prompt token (prompt_tokens_total counted 1 fewer, so the caching-on/off comparison above failed for
    some random prompts) and it completes the prompt, whose pages are then offered to the prefix cache."""
    prompt = random_prompt(prng, 2 * TOKENS_PER_PAGE + 1, 2 * TOKENS_PER_PAGE + 1)
    params = SamplingParams(max_tokens=3, **GREEDY)
    eng = engine(model, max_num_batched_tokens=2 * TOKENS_PER_PAGE)  # 64 of the 65 tokens, then 1
    first = eng.add_request(prompt, params)
    done = run_all(eng)
    assert eng.stats().prompt_tokens_total == len(prompt)
    second = eng.add_request(prompt, params)
    final = run_all(eng)
    assert final[second].metrics.prefix_hit_tokens == 2 * TOKENS_PER_PAGE
    assert final[second].token_ids == done[first].token_ids
    assert eng.stats().prompt_tokens_total == len(prompt) + 1


def test_fully_cached_page_aligned_prompt_yields_its_first_token(model, reference, prng):
    prompt = random_prompt(prng, 2 * TOKENS_PER_PAGE, 2 * TOKENS_PER_PAGE)
    llm = LLM(model, kv_budget_bytes=4 << 20, page_size=PAGE)
    params = SamplingParams(max_tokens=5, **GREEDY)
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    assert again.metrics.prefix_hit_tokens == len(prompt) - 1  # the last token is computed for its logits
    assert again.token_ids == first.token_ids
    check_greedy_against_generate(reference, prompt, again.token_ids, 5)
    assert llm.stats().live_kv_tokens == 0


def test_n_completions_share_the_prompt_pages(model, prng):
    prompt = random_prompt(prng, 3 * TOKENS_PER_PAGE, 3 * TOKENS_PER_PAGE + 10)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=prng.randrange(1 << 30), n=4, ignore_eos=True)
    eng = engine(model, enable_prefix_caching=False)
    rid = eng.add_request(prompt, params)
    shared_seen = 0
    final = None
    while eng.has_unfinished():
        for out in eng.step():
            final = out if out.finished else final
        if eng.has_unfinished():
            shared_seen = max(shared_seen, eng.store.cache.stats().shared_pages)
    assert final.request_id == rid and len(final.outputs) == 4
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in final.outputs)
    # The 3 full prompt pages of every layer's K and V (2 layers x 2) are mapped by all 4 completions.
    assert shared_seen >= 3 * 4
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1
    again = LLM(model, kv_budget_bytes=4 << 20, page_size=PAGE, kv="paged").generate([prompt], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in final.outputs]
    assert eng.stats().live_kv_tokens == 0


def test_seeded_sampling_does_not_depend_on_the_batch(model, prng):
    target = random_prompt(prng, 10, 60)
    params = SamplingParams(
        max_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=prng.randrange(1 << 30), ignore_eos=True
    )
    alone = LLM(model, kv_budget_bytes=4 << 20, page_size=PAGE).generate([target], params)[0].token_ids
    crowd = [random_prompt(prng, 1, 80) for _ in range(10)]
    crowd_params = [
        SamplingParams(
            max_tokens=prng.randint(1, 15),
            temperature=prng.choice([0.0, 0.7, 1.3]),
            top_k=prng.choice([-1, 5]),
            ignore_eos=True,
        )
        for _ in crowd
    ]
    outs = LLM(model, kv_budget_bytes=4 << 20, page_size=PAGE, max_num_batched_tokens=32).generate(
        crowd[:4] + [target] + crowd[4:], crowd_params[:4] + [params] + crowd_params[4:]
    )
    assert outs[4].token_ids == alone
    unseeded = LLM(model, kv_budget_bytes=4 << 20, page_size=PAGE).generate(
        [target], SamplingParams(max_tokens=12, temperature=0.9, ignore_eos=True)
    )[0]
    assert len(unseeded.token_ids) == 12


def test_sampling_respects_top_k_and_top_p(model, prng):
    """top_k=1 and a tiny top_p both reduce sampling to the argmax."""
    prompt = random_prompt(prng, 5, 40)
    greedy = (
        LLM(model, kv_budget_bytes=4 << 20, page_size=PAGE)
        .generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
        .token_ids
    )
    for p in (
        SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.5, top_p=1e-6, seed=2, ignore_eos=True),
    ):
        assert LLM(model, kv_budget_bytes=4 << 20, page_size=PAGE).generate([prompt], p)[0].token_ids == greedy


# ------------------------------------------------------------------------------------------ lifecycle
def test_abort_in_prefill_and_in_decode_frees_everything(model, prng):
    eng = engine(model, max_num_batched_tokens=16)
    long_prompt = random_prompt(prng, 100, 120)  # 7+ steps of prefill at 16 tokens a step
    keep = eng.add_request(random_prompt(prng, 5, 10), SamplingParams(max_tokens=30, **GREEDY))
    in_prefill = eng.add_request(long_prompt, SamplingParams(max_tokens=5, **GREEDY))
    in_decode = eng.add_request(random_prompt(prng, 3, 5), SamplingParams(max_tokens=50, **GREEDY))
    final = {}

    def step():
        final.update({out.request_id: out for out in eng.step()})

    step()
    step()
    assert eng.scheduler.running[1].request.request_id == in_prefill  # still computing its prompt
    assert 0 < eng.scheduler.running[1].num_computed < len(long_prompt)
    eng.abort(in_prefill)
    while in_decode not in final or not final[in_decode].token_ids:
        step()
    eng.abort(in_decode)
    with pytest.raises(UnknownRequestError):
        eng.abort(in_decode)
    with pytest.raises(UnknownRequestError):
        eng.abort("no-such-request")
    final.update(run_all(eng))
    assert final[in_prefill].finish_reason == "abort" and final[in_prefill].token_ids == []
    assert final[in_decode].finish_reason == "abort" and 0 < len(final[in_decode].token_ids) < 50
    assert final[keep].finish_reason == "length" and len(final[keep].token_ids) == 30
    stats = eng.stats()
    assert stats.requests_aborted == 2 and stats.requests_finished == 1
    assert stats.live_kv_tokens == 0 and eng.store.cache.stats().live_tokens == 0
    assert eng.store.cache.stats().sequences == 0


def test_stop_tokens_max_tokens_and_eos(model, prng):
    prompt = random_prompt(prng, 5, 30)
    llm = LLM(model, kv_budget_bytes=4 << 20, page_size=PAGE)
    free_run = llm.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 12
    stop = free_run.token_ids[4]
    first = free_run.token_ids.index(stop)
    stopped = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop]))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free_run.token_ids[: first + 1]
    short = llm.generate([prompt], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert short.finish_reason == "length" and short.token_ids == free_run.token_ids[:3]
    # The model's EOS ends a request unless ignore_eos.
    eng = llm.engine
    eng.eos_token_ids = frozenset([stop])
    assert (
        llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].token_ids
        == free_run.token_ids[: first + 1]
    )
    assert llm.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0].token_ids == free_run.token_ids
    assert llm.stats().live_kv_tokens == 0


def test_bad_requests_are_refused_alone(model, prng):
    eng = engine(model, max_model_len=128, kv_budget_bytes=4 * 4 * PAGE)  # 4 pages per region: 128 tokens
    good = eng.add_request(random_prompt(prng, 5, 10), SamplingParams(max_tokens=5, **GREEDY))
    with pytest.raises(PromptTooLongError):
        eng.add_request(list(range(3, 131)), SamplingParams(max_tokens=5))  # longer than max_model_len
    small = LLMEngine(model, kv_budget_bytes=2 * 4 * PAGE, page_size=PAGE)  # 2 pages (64 tokens) per region
    with pytest.raises(PromptTooLongError):
        small.add_request(list(range(3, 103)), SamplingParams(max_tokens=5))  # longer than the budget
    with pytest.raises(PromptTooLongError):
        small.add_request(list(range(3, 53)), SamplingParams(max_tokens=20))  # its generation does not fit
    with pytest.raises(InvalidArgumentError):
        eng.add_request([], SamplingParams())
    with pytest.raises(InvalidArgumentError):
        eng.add_request([1, 2, 512], SamplingParams())  # outside the vocabulary
    with pytest.raises(InvalidArgumentError):
        eng.add_request("text needs a tokenizer", SamplingParams())
    with pytest.raises(InvalidArgumentError):
        eng.add_request([1, 2], {"max_tokens": 3})
    with pytest.raises(InvalidArgumentError):
        eng.add_request([1, 2], SamplingParams(), request_id=good)
    for bad in (
        dict(max_tokens=0),
        dict(temperature=-1.0),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(n=0),
        dict(seed=1.5),
        dict(stop_token_ids=[-1]),
        dict(ignore_eos=1),
    ):
        with pytest.raises(InvalidArgumentError):
            SamplingParams(**bad)
    final = run_all(eng)
    assert list(final) == [good] and len(final[good].token_ids) == 5
    assert eng.stats().live_kv_tokens == 0
    # Generation stops at max_model_len.
    capped = eng.add_request(list(range(3, 120)), SamplingParams(max_tokens=50, **GREEDY))
    assert len(run_all(eng)[capped].token_ids) == 128 - 117


def test_stream_deltas_concatenate_to_the_final_output(model, prng):
    llm = LLM(model, kv_budget_bytes=4 << 20, page_size=PAGE, max_num_batched_tokens=8)
    prompt = random_prompt(prng, 10, 30)
    params = SamplingParams(max_tokens=9, **GREEDY)
    pieces, last = [], None
    for out in llm.stream(prompt, params):
        pieces += out.new_token_ids
        last = out
    assert last.finished and pieces == last.token_ids
    assert last.token_ids == llm.generate([prompt], params)[0].token_ids
    # A consumer that stops early aborts its request.
    stream = llm.stream(prompt, SamplingParams(max_tokens=50, **GREEDY))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished() or not [o for o in llm.engine.step() if not o.finished]
    assert llm.stats().running == 0 and llm.stats().live_kv_tokens == 0


# ------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("layout", ["head_major", "per_layer"])
def test_generate_with_vpaged_cache_and_vpaged_attention(reference, prng, monkeypatch, layout):
    """model.generate(cache=VPagedCache) with attn_implementation="vpaged": decode steps go through the
    contiguous kernel on the cache's views; tokens equal DynamicCache + SDPA (batch of 2 without padding)."""
    from transformers import DynamicCache

    from vpaged.hf import VPagedCache, attention, cache_kwargs

    model = load_model("random:llama-tiny", attn_implementation="vpaged")[0]
    calls = []
    plan = attention.DecodePlan

    class Spy:  # the attention function reaches the kernel through a DecodePlan over the cache's views
        @staticmethod
        def over_tensors(kv, lengths=None):
            calls.append(kv.lengths.tolist())
            return plan.over_tensors(kv, lengths)

    monkeypatch.setattr(attention, "DecodePlan", Spy)
    prompt = torch.tensor([random_prompt(prng, 20, 20), random_prompt(prng, 20, 20)])
    with torch.no_grad():
        expected = reference.generate(
            prompt,
            **cache_kwargs(DynamicCache(config=reference.config)),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        got = model.generate(
            prompt,
            **cache_kwargs(VPagedCache(model.config, max_cache_len=64, capacity_bytes=4 << 20, layout=layout)),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert torch.equal(got, expected)
    # 7 decode steps x 2 layers through the kernel, at lengths 21..27 for both rows.
    assert len(calls) == 7 * 2 and calls[0] == [21, 21] and calls[-1] == [27, 27]


def test_a_failed_forward_leaves_the_engine_consistent(model, prng, monkeypatch):
    """A step whose forward raises gives its sequences' pages back; they are recomputed, outputs unchanged."""
    prompts = [random_prompt(prng, 5, 40) for _ in range(3)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    expected = [o.token_ids for o in LLM(model, kv_budget_bytes=4 << 20, page_size=PAGE).generate(prompts, params)]
    eng = engine(model, max_num_batched_tokens=16)
    ids = [eng.add_request(p, params) for p in prompts]
    eng.step()
    eng.step()
    runner_forward = eng.runner.forward
    monkeypatch.setattr(eng.runner, "forward", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    assert eng.store.cache.stats().sequences == eng.stats().running  # the failed step's sequences hold nothing
    assert eng.stats().waiting >= 1
    monkeypatch.setattr(eng.runner, "forward", runner_forward)
    final = run_all(eng)
    assert [final[i].token_ids for i in ids] == expected
    assert eng.stats().live_kv_tokens == 0


def test_static_reserves_a_slot_of_max_model_len_per_sequence(model, prng):
    # llama-tiny, per_layer layout: a 128-token slot takes 4 pages in each of the 4 (layer, K/V) regions; the
    # requests (at most 38 tokens) would need 2.
    slot_bytes = 4 * 4 * PAGE
    slots = prng.randint(2, 4)
    prompts = [random_prompt(prng, 3, 30) for _ in range(slots + 3)]
    params = SamplingParams(max_tokens=prng.randint(2, 8), **GREEDY)
    eng = engine(model, kv="static", kv_budget_bytes=slots * slot_bytes, max_model_len=128, max_num_seqs=8)
    ids = [eng.add_request(p, params) for p in prompts]
    peak, final = 0, {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        s = eng.stats()
        peak = max(peak, s.running)
        assert s.running * slot_bytes <= s.kv_mapped_bytes <= slots * slot_bytes  # whole slots, freed ones kept
    assert peak == slots  # as many as the budget has slots, although far shorter prompts would fit more
    vp = LLM(model, kv_budget_bytes=slots * slot_bytes, page_size=PAGE, max_model_len=128).generate(prompts, params)
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in vp]
    assert eng.stats().live_kv_tokens == 0
    with pytest.raises(InvalidArgumentError, match="max_model_len=128"):
        engine(model, kv="static", kv_budget_bytes=slot_bytes - PAGE, max_model_len=128)
