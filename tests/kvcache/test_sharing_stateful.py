"""A stateful property test: random sequences of every cache operation against a pure-Python model.

The model keeps each sequence's token ids. The K/V of a token is a function of its id and position
(drawn fresh for every run), as in a real model, so a prefix hit must hold exactly the data the model
predicts. After every step: each live sequence's views hold the model's data (no write ever shows in
another sequence) and page accounting matches (each page's reference count = the slots mapping it plus the
prefix index's hold; pool use = distinct pages)."""

import os
from collections import Counter

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import vpaged
from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache

PAGE = 4096
LAYERS, HEADS, DIM = 2, 2, 32  # per run: 256 B per token (per_layer, 16 tokens a page), 1 KiB (interleaved,
# 4 tokens a page), 128 B (head_major, 32 tokens a page per head)
VOCAB = 6  # few ids: prefixes repeat often


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        # Fresh values every run; they never steer control flow, so hypothesis can still replay a case.
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        self.max_len = 96
        # K/V of token id t at position p, layer l: E[l, kv, t] + P[l, kv, p]
        self.E = torch.randn(LAYERS, 2, VOCAB, HEADS, DIM, generator=g)
        self.P = torch.randn(LAYERS, 2, self.max_len, HEADS, DIM, generator=g)
        self.cache = None
        self.tokens: dict[int, list[int]] = {}
        self.swapped: set[int] = set()

    @initialize(layout=st.sampled_from(["per_layer", "interleaved", "head_major"]))
    def make_cache(self, layout):
        self.cache = VirtualKVCache(
            KVGeometry(LAYERS, HEADS, DIM, torch.float32),
            VirtualCacheConfig(
                max_seqs=8,
                max_seq_len=self.max_len,
                capacity_bytes=40 * PAGE,
                page_size=PAGE,
                layout=layout,
                swap_bytes=24 * PAGE,
            ),
        )

    def kv_of(self, layer, kv, ids, start=0):
        pos = torch.arange(start, start + len(ids))
        return self.E[layer, kv, torch.tensor(ids, dtype=torch.long)] + self.P[layer, kv, pos]

    def live(self):
        return [s for s in self.tokens if s not in self.swapped]

    def write_new(self, seq, new_ids):
        start = len(self.tokens[seq])
        self.tokens[seq] = self.tokens[seq] + new_ids
        for layer in range(LAYERS):
            self.cache.write(layer, seq, self.kv_of(layer, 0, new_ids, start), self.kv_of(layer, 1, new_ids, start))

    # ------------------------------------------------------------------------------------------- rules
    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=40), use_prefix=st.booleans())
    def allocate(self, prompt, use_prefix):
        try:
            seq = self.cache.allocate(tokens=prompt if use_prefix else None)
        except vpaged.SlotsExhaustedError:
            return
        hit = self.cache.seq_len(seq)
        assert hit <= len(prompt) if use_prefix else hit == 0
        self.tokens[seq] = list(prompt[:hit])  # the hit's data is checked by the invariant
        rest = prompt[hit:]
        if rest:
            try:
                self.cache.extend(seq, len(rest))
            except vpaged.OutOfPagesError:
                return
            self.write_new(seq, rest)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), n=st.integers(1, 20))
    def extend(self, data, n):
        seq = data.draw(st.sampled_from(self.live()))
        if len(self.tokens[seq]) + n > self.max_len:
            try:
                self.cache.extend(seq, n)
                raise AssertionError("extend past max_seq_len succeeded")
            except vpaged.SequenceTooLongError:
                return
        try:
            self.cache.extend(seq, n)
        except vpaged.OutOfPagesError:
            return
        self.write_new(seq, data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)))

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(self.live()))
        try:
            child = self.cache.fork(seq)
        except vpaged.SlotsExhaustedError:
            return
        self.tokens[child] = list(self.tokens[seq])

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def truncate(self, data):
        seq = data.draw(st.sampled_from(self.live()))
        new_len = data.draw(st.integers(0, len(self.tokens[seq])))
        self.cache.truncate(seq, new_len)
        self.tokens[seq] = self.tokens[seq][:new_len]

    @precondition(lambda self: len(self.live()) >= 2)
    @rule(data=st.data())
    def reorder(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self.live()), min_size=2, max_size=4, unique=True))
        sources = data.draw(st.lists(st.integers(0, len(seqs) - 1), min_size=len(seqs), max_size=len(seqs)))
        self.cache.reorder(seqs, sources)
        old = [self.tokens[s] for s in seqs]
        for s, i in zip(seqs, sources):
            self.tokens[s] = list(old[i])

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def cache_prefix(self, data):
        seq = data.draw(st.sampled_from(self.live()))
        self.cache.cache_prefix(seq, self.tokens[seq])

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self.live()))
        try:
            self.cache.swap_out(seq)
        except vpaged.SwapSpaceFullError:
            return
        self.swapped.add(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        try:
            self.cache.swap_in(seq)
        except vpaged.OutOfPagesError:
            return
        self.swapped.discard(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free(seq)
        del self.tokens[seq]
        self.swapped.discard(seq)

    # ------------------------------------------------------------------------------------------- checks
    @invariant()
    def views_hold_the_models_data(self):
        for seq, ids in self.tokens.items():
            assert self.cache.seq_len(seq) == len(ids)
            if seq in self.swapped:
                continue
            for layer in range(LAYERS):
                k, v = self.cache.kv(layer, seq)
                if ids:
                    assert torch.equal(k, self.kv_of(layer, 0, ids)), (seq, layer)
                    assert torch.equal(v, self.kv_of(layer, 1, ids)), (seq, layer)
                else:
                    assert k.shape[0] == 0

    @invariant()
    def page_accounting_matches(self):
        cache = self.cache
        rng = cache._range
        refs = Counter(p for p in rng.pages_at(list(range(rng.num_pages))) if p >= 0)
        if cache._prefix:
            for block in cache._prefix.blocks():
                refs.update(block.pages)
        pool = cache.pool
        for page, count in refs.items():
            assert pool.refcount(page) == count, (page, count)
        assert cache.pool.stats().used_pages == len(refs)

    def teardown(self):
        if self.cache is None:
            return
        pool = self.cache.pool
        self.cache.close()
        assert pool.stats().used_pages == 0


CacheMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("VPAGED_STATEFUL_EXAMPLES", "60")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
TestCacheMachine = CacheMachine.TestCase
