"""The caches' planning probes the serving scheduler relies on: pages_needed() predicts exactly what
extend_many() then takes (copy-on-write copies and swap-in included), and VirtualKVCache.kv_layers() is the
same memory as kv() of every layer."""

import pytest
import torch

from vpaged import KVGeometry, PagedCacheConfig, PagedKVCache, VirtualCacheConfig, VirtualKVCache
from vpaged.errors import OutOfPagesError, SequenceTooLongError

PAGE = 4096


def squeeze_pool_to(cache: VirtualKVCache, filler: VirtualKVCache, holder: int, free: int) -> None:
    """Grow or shrink the filler sequence (one page per 32 tokens) until exactly `free` pool pages are free."""
    cache.reclaim()  # nothing reclaimable may hide behind the free count
    assert cache.pages_available() == cache.pool.free_pages()
    pages = filler.seq_len(holder) // 32 + cache.pool.free_pages() - free
    assert pages >= 0
    if pages * 32 < filler.seq_len(holder):
        filler.truncate(holder, pages * 32)
    else:
        filler.extend(holder, pages * 32 - filler.seq_len(holder))
    assert cache.pool.free_pages() == free


def grow(cache: VirtualKVCache, group, n) -> None:
    for s in group:
        if cache.is_swapped(s):
            cache.swap_in(s)
    cache.extend_many(group, n)


@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "head_major"])
def test_virtual_pages_needed_is_exactly_what_extend_takes(prng, layout):
    """With one page fewer than pages_needed() free, growing fails (OutOfPagesError); with exactly that many
    it succeeds: the probe is the pool's real requirement, copy-on-write copies and swap-ins included."""
    # 2 layers x 2 heads x 16 dims x 4 bytes: 32 tokens per page (per_layer), 8 (interleaved), 64 (head_major).
    cache = VirtualKVCache(
        KVGeometry(2, 2, 16, torch.float32),
        VirtualCacheConfig(
            max_seqs=16, max_seq_len=512, capacity_bytes=8 << 20, page_size=PAGE, layout=layout, swap_bytes=4 << 20
        ),
    )
    # One layer, one head, interleaved: 128 bytes a token, so 32 tokens take exactly one page.
    filler = VirtualKVCache(
        KVGeometry(1, 1, 16, torch.float32),
        VirtualCacheConfig(max_seqs=1, max_seq_len=1 << 17, layout="interleaved"),
        pool=cache.pool,
    )
    holder = filler.allocate()
    seqs = []
    for _ in range(40):
        op = prng.random()
        live = [s for s in seqs if not cache.is_swapped(s)]
        if (op < 0.2 or not live) and len(seqs) < 14:
            tokens = [prng.randrange(4) for _ in range(prng.randint(0, 200))]
            seqs.append(cache.allocate(tokens=tokens) if tokens else cache.allocate())
        elif op < 0.35 and len(seqs) < 12:
            seqs.append(cache.fork(prng.choice(live)))
        elif op < 0.45:
            seq = prng.choice(live)
            cache.cache_prefix(seq, [prng.randrange(4) for _ in range(cache.seq_len(seq))])
        elif op < 0.5:
            seq = prng.choice(live)
            cache.truncate(seq, prng.randint(0, cache.seq_len(seq)))
        elif op < 0.6:
            cache.swap_out(prng.choice(live))
        elif op < 0.65 and len(seqs) > 2:
            seq = prng.choice(seqs)
            cache.free(seq)
            seqs.remove(seq)
        group = prng.sample(seqs, prng.randint(1, len(seqs)))
        n = prng.choice([0, 1, 1, 3, 40])
        if any(cache.seq_len(s) + n > 512 for s in group):
            with pytest.raises(SequenceTooLongError):
                cache.pages_needed(group, n)
            continue
        predicted = cache.pages_needed(group, n)
        lens = [cache.seq_len(s) for s in group]
        if predicted:
            squeeze_pool_to(cache, filler, holder, predicted - 1)
            with pytest.raises(OutOfPagesError):
                grow(cache, group, n)
            assert [cache.seq_len(s) for s in group] == lens  # a failed extend changed nothing
        squeeze_pool_to(cache, filler, holder, cache.pages_needed(group, n))
        grow(cache, group, n)
        assert [cache.seq_len(s) for s in group] == [x + n for x in lens]
    filler.close()
    for s in seqs:
        cache.free(s)
    cache.close()


def test_paged_pages_needed_is_exactly_what_extend_takes(prng):
    """Same for the block cache: one block short fails, exactly enough succeeds (forks sharing a partly filled
    last block each copy it)."""
    cache = PagedKVCache(
        KVGeometry(2, 2, 16, torch.float32),
        PagedCacheConfig(max_seqs=16, max_seq_len=8192, num_blocks=600, block_size=8),
    )
    filler = None  # a sequence holding the blocks that must not be free

    def squeeze_to(free):
        nonlocal filler
        if filler is not None:
            cache.free(filler)
        filler = cache.allocate()
        cache.extend(filler, 8 * (cache.pages_available() - free))
        assert cache.pages_available() == free

    seqs = [cache.allocate()]
    for _ in range(80):
        op = prng.random()
        if op < 0.15 and len(seqs) < 12:
            seqs.append(cache.allocate())
        elif op < 0.3 and len(seqs) < 12:
            seqs.append(cache.fork(prng.choice(seqs)))
        elif op < 0.35 and len(seqs) > 1:
            seq = prng.choice(seqs)
            cache.free(seq)
            seqs.remove(seq)
        group = prng.sample(seqs, prng.randint(1, len(seqs)))
        n = prng.choice([0, 1, 1, 5, 17])
        if any(cache.seq_len(s) + n > 64 for s in group):
            continue
        predicted = cache.pages_needed(group, n)
        lens = [cache.seq_len(s) for s in group]
        if predicted:
            squeeze_to(predicted - 1)
            with pytest.raises(OutOfPagesError):
                cache.extend_many(group, n)
            assert [cache.seq_len(s) for s in group] == lens
        squeeze_to(predicted)
        cache.extend_many(group, n)
        assert [cache.seq_len(s) for s in group] == [x + n for x in lens]
    cache.close()


@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "head_major"])
def test_kv_layers_is_every_layers_kv(rng, layout):
    cache = VirtualKVCache(
        KVGeometry(3, 2, 16, torch.float32),
        VirtualCacheConfig(max_seqs=4, max_seq_len=256, capacity_bytes=8 << 20, page_size=PAGE, layout=layout),
    )
    a, b = cache.allocate(), cache.allocate()
    cache.extend(a, 70)
    cache.extend(b, 5)
    for layer in range(3):
        for seq, n in ((a, 70), (b, 5)):
            cache.write(layer, seq, torch.randn(n, 2, 16, generator=rng), torch.randn(n, 2, 16, generator=rng))
    view = cache.kv_layers(a)
    assert view.shape == (3, 2, 70, 2, 16)
    for layer in range(3):
        k, v = cache.kv(layer, a)
        assert torch.equal(view[layer, 0], k) and torch.equal(view[layer, 1], v)
    part = cache.kv_layers(a, 30, 41)
    assert torch.equal(part, view[:, :, 30:41])
    # Writing the tokens the last extend added through the view lands where kv() reads them.
    cache.extend(b, 3)
    new = torch.randn(3, 2, 3, 2, 16, generator=rng)
    cache.kv_layers(b, 5, 8).copy_(new)
    for layer in range(3):
        k, v = cache.kv(layer, b)
        assert torch.equal(k[5:], new[layer, 0]) and torch.equal(v[5:], new[layer, 1])
    for bad in ((-1, None), (0, 71), (50, 40), (0.5, None)):
        with pytest.raises(Exception):
            cache.kv_layers(a, *bad)
    del view, part
    cache.free(a)
    cache.free(b)
    cache.close()
