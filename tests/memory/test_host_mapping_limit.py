"""The host backend right at vm.max_map_count.

The kernel lets a process reach vm.max_map_count + 1 mappings; there every mmap is refused (even one that would
lower the count) and munmap of part of a mapping keeps the count where it is. Unmapping a shared page used to
munmap its part of a mapping and then fail to map the home page back ("mmap(home after unmap)"), leaving a hole
in the range and the range's page table out of step with the pool. Now: unmap always succeeds (an index whose
home cannot be put back keeps showing its old page), mapping fails only with MappingLimitError and changes
nothing, and once mappings are returned everything works again with the data intact.

Runs in a child process that eats the mapping headroom with small mappings of its own (4 KiB, anonymous, shared:
they never merge), so the limit is reached in well under a second whatever vm.max_map_count is.
"""

import subprocess
import sys
import textwrap

# The prelude of both child scripts: fill() eats the process's mapping headroom with 4 KiB anonymous shared
# mappings (they never merge), unfill(n) gives n of them back.
FILLER = textwrap.dedent("""
    import ctypes, mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    FAILED = ctypes.c_void_p(-1).value
    FLAGS = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS

    with open("/proc/sys/vm/max_map_count") as f:
        LIMIT = int(f.read())
    fillers = [0] * (LIMIT + 16)
    held = 0

    def fill():
        # Up to the kernel's refusal: the process then holds vm.max_map_count + 1 mappings.
        global held
        while True:
            p = libc.mmap(None, 4096, mmap.PROT_READ, FLAGS, -1, 0)
            if p is None or p == FAILED:
                return
            fillers[held] = p
            held += 1

    def unfill(n):
        global held
        for _ in range(min(n, held)):
            held -= 1
            libc.munmap(fillers[held], 4096)
""")

CHILD = FILLER + textwrap.dedent("""
    import gc, os, random, sys
    import torch
    import vpaged
    from vpaged import _C

    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    PAGE = 4096
    N = 64  # page indices of the range
    pool = _C.PagePool(_C.host_backend(PAGE, 256))
    r = _C.VirtualRange(pool, N * PAGE)
    ref = {}  # page id -> its data (float32 x 1024)

    def view(i):
        return torch.from_dlpack(r.view(i * PAGE, [PAGE // 4], [1], 2, 32))

    def write_new(indices):
        for i, p in zip(indices, r.map_new(indices)):
            data = torch.randn(PAGE // 4, generator=gen)
            view(i).copy_(data)
            ref[p] = data

    def state():
        table = r.pages_at(list(range(N)))
        refs = {p: pool.refcount(p) for p in set(table) if p >= 0}
        return table, refs, pool.stats().used_pages, r.mapped_pages

    def check():
        # The page table, the pool's counts and the memory agree; every mapped index shows its page's data.
        table, refs, used, mapped = state()
        assert mapped == sum(p >= 0 for p in table)
        assert used == len(refs), (used, refs)
        for p, n in refs.items():
            assert n == table.count(p), (p, n, table.count(p))
        for i, p in enumerate(table):
            if p >= 0:
                assert torch.equal(view(i), ref[p]), (i, p)

    # A parent at indices 0..7 (home pages: no mapping), children sharing its pages at 16..23, 32..39, 48..55
    # (one mapping each), with their own pages here and there.
    write_new(list(range(8)))
    parent = r.pages_at(list(range(8)))
    for start in (16, 32, 48):
        r.map_shared(list(range(start, start + 8)), parent)
    write_new([10, 11, 40])
    check()

    errors = {"ok": 0, "limit": 0}
    remaps = {"assign ok": 0, "assign limit": 0, "cow ok": 0, "cow limit": 0}
    unmapped_at_limit = 0
    for step in range(300):
        fill()
        unfill(rng.choice([0, 0, 0, 1, 2, 3]))  # right at the limit, or a mapping or three below it
        table = r.pages_at(list(range(N)))
        mapped = [i for i, p in enumerate(table) if p >= 0]
        free = [i for i, p in enumerate(table) if p < 0]
        op = rng.choice(["unmap", "unmap", "share", "new", "assign", "cow"])
        before = state()
        try:
            if op == "unmap" and mapped:
                # A single index or a short run, often the edge or the middle of a shared mapping.
                i = rng.choice(mapped)
                run = [j for j in range(i, min(i + rng.choice([1, 1, 2, 3]), N)) if table[j] >= 0]
                r.unmap(run)
                unmapped_at_limit += len(run)
            elif op == "share" and free and mapped:
                i = rng.choice(free)
                run = [j for j in range(i, min(i + rng.choice([1, 2, 4]), N)) if table[j] < 0]
                src = rng.choice(mapped)
                src_run = [table[j] for j in range(src, min(src + len(run), N)) if table[j] >= 0]
                r.map_shared(run, [src_run[k % len(src_run)] for k in range(len(run))])
            elif op == "new" and free:
                i = rng.choice(free)
                run = [j for j in range(i, min(i + rng.choice([1, 2, 3]), N)) if table[j] < 0]
                pages = r.map_new(run)
                for p in pages:
                    ref[p] = torch.zeros(PAGE // 4)  # fresh pages read as zeros (punched holes)
            elif op == "assign" and mapped:
                # Reordering: a few indices take pages other indices show (or are unmapped), in one call.
                at = rng.sample(range(N), rng.randint(1, 4))
                r.assign(at, [rng.choice([table[j] for j in mapped] + [-1]) for _ in at])
            elif op == "cow" and mapped:
                # Copy-on-write of a few indices (the shared ones get a private copy), or of one.
                at = rng.sample(mapped, min(len(mapped), rng.randint(1, 4)))
                if len(at) == 1:
                    r.copy_on_write(at[0])
                else:
                    r.make_private(at)
                for j in at:
                    if r.page_at(j) != table[j]:
                        ref[r.page_at(j)] = ref[table[j]]  # a copy holds its original's data
            else:
                continue
            errors["ok"] += 1
            if op in ("assign", "cow"):
                remaps[op + " ok"] += 1
        except vpaged.MappingLimitError as e:
            assert "max_map_count" in str(e), e
            unfill(16)
            assert state() == before, op  # nothing changed
            errors["limit"] += 1
            if op in ("assign", "cow"):
                remaps[op + " limit"] += 1
        # Checked with a little room: views need no mapping, but torch's own allocations might.
        unfill(16)
        check()
    unfill(held)

    # Everything returned: the whole range is usable again, and unmapping it all leaves one mapping.
    r.unmap([i for i, p in enumerate(r.pages_at(list(range(N)))) if p >= 0])
    write_new(list(range(N)))
    check()
    r.unmap(list(range(N)))
    assert pool.stats().used_pages == 0
    lo, hi = r.address, r.address + r.bytes
    inside = 0
    with open("/proc/self/maps") as f:
        for line in f:
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            inside += a < hi and b > lo
    assert inside == 1, inside
    print("OK", seed, errors["ok"], errors["limit"], unmapped_at_limit, *remaps.values())
""")


def test_range_stays_consistent_right_at_the_mapping_limit():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    words = out.stdout.split()
    assert words[0] == "OK", out.stdout
    ok, limited, unmapped, assign_ok, assign_limit, cow_ok, cow_limit = map(int, words[2:9])
    # Both outcomes were exercised: calls that worked at the limit and calls refused with MappingLimitError,
    # and pages were unmapped right at the limit (where the old code failed); reordering (assign) and
    # copy-on-write, which change what mapped indices show, both completed and were refused there.
    assert ok > 25 and limited > 5 and unmapped > 25, words
    assert assign_ok > 0 and assign_limit > 5 and cow_ok > 5 and cow_limit > 0, words


# Reordering and copy-on-write change what several page indices show at once; at the limit a half-done change
# used to be undone by mapping the old pages back, which the kernel refused: a page a sequence still counted
# was left unmapped. Now the backend holds a few mappings in reserve for undoing (host_backend.cpp, remap) and
# every operation of the cache completes or raises MappingLimitError with nothing changed.
CACHE_CHILD = FILLER + textwrap.dedent("""
    import os, random, sys, warnings
    import torch
    import vpaged

    layout = sys.argv[1]
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    LAYERS, HEADS, DIM, MAX_LEN, PAGE = 2, 2, 32, 96, 4096
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vpaged.MappingLimitWarning)
        geometry = vpaged.KVGeometry(LAYERS, HEADS, DIM, torch.float32)
        config = vpaged.VirtualCacheConfig(max_seqs=8, max_seq_len=MAX_LEN, capacity_bytes=256 * PAGE, page_size=PAGE,
                                           layout=layout)
        cache = vpaged.VirtualKVCache(geometry, config)
    r = cache._page_map.range
    pool = cache.pool._pool
    # K/V of token id t at position p, layer l: E[l, kv, t] + P[l, kv, p] (as in test_sharing_stateful.py)
    E = torch.randn(LAYERS, 2, 8, HEADS, DIM, generator=gen)
    P = torch.randn(LAYERS, 2, MAX_LEN, HEADS, DIM, generator=gen)
    tokens = {}  # live sequence -> its token ids

    def kv_of(layer, kv, ids, start):
        return E[layer, kv, torch.tensor(ids, dtype=torch.long)] + P[layer, kv, torch.arange(start, start + len(ids))]

    def write_new(seq, ids):
        start = len(tokens[seq])
        tokens[seq] = tokens[seq] + ids
        for layer in range(LAYERS):
            cache.write(layer, seq, kv_of(layer, 0, ids, start), kv_of(layer, 1, ids, start))

    def state():
        # Everything an operation may change: the page table, each page's references, the pool's use, the
        # sequences and their lengths.
        table = r.pages_at(list(range(r.num_pages)))
        refs = {p: pool.refcount(p) for p in set(table) if p >= 0}
        seqs = {s: cache.seq_len(s) for s in cache.sequences}
        return table, refs, pool.stats().used_pages, r.mapped_pages, seqs

    def check():
        table, refs, used, mapped, seqs = state()
        assert mapped == sum(p >= 0 for p in table)
        assert used == len(refs), (used, len(refs))
        for p, n in refs.items():
            assert n == table.count(p), (p, n, table.count(p))  # each reference is an index showing the page
        assert seqs == {s: len(t) for s, t in tokens.items()}
        for s, ids in tokens.items():
            if not ids:
                continue
            for layer in range(LAYERS):
                k, v = cache.kv(layer, s)
                assert torch.equal(k, kv_of(layer, 0, ids, 0)), (s, layer)
                assert torch.equal(v, kv_of(layer, 1, ids, 0)), (s, layer)
                del k, v

    first = cache.allocate()
    tokens[first] = []
    cache.extend(first, 40)
    write_new(first, [rng.randrange(8) for _ in range(40)])
    check()

    counts = {}
    for step in range(300):
        fill()
        unfill(rng.choice([0, 0, 1, 2, 3, 4, 5, 6, 8]))  # at the limit, or a few mappings below it
        live = list(tokens)
        op = rng.choice(["reorder", "reorder", "extend", "extend", "fork", "fork", "truncate", "free", "allocate"])
        before = state()
        try:
            if op == "reorder" and len(live) >= 2:
                seqs = rng.sample(live, rng.randint(2, min(4, len(live))))
                if rng.random() < 0.5:  # beams trading places: a sequence's home pages end up in another one
                    sources = rng.sample(range(len(seqs)), len(seqs))
                else:
                    sources = [rng.randrange(len(seqs)) for _ in seqs]
                cache.reorder(seqs, sources)
                old = [tokens[s] for s in seqs]
                for s, i in zip(seqs, sources):
                    tokens[s] = list(old[i])
            elif op == "extend" and live:
                s = rng.choice(live)
                n = rng.randint(1, min(12, MAX_LEN - len(tokens[s]))) if len(tokens[s]) < MAX_LEN else 0
                if n:
                    if cache._page_map.plan_extend([s], [cache.slot(s)], n).copies:
                        op = "copy-on-write"  # the new tokens land in a page shared with another sequence
                    cache.extend(s, n)
                    write_new(s, [rng.randrange(8) for _ in range(n)])
            elif op == "fork" and live and len(live) < 8:
                s = rng.choice(live)
                tokens[cache.fork(s)] = list(tokens[s])
            elif op == "truncate" and live:
                s = rng.choice(live)
                n = rng.randint(0, len(tokens[s]))
                cache.truncate(s, n)
                tokens[s] = tokens[s][:n]
            elif op == "free" and len(live) > 1:
                s = rng.choice(live)
                cache.free(s)
                cache.reclaim()  # no dormant pages: a fork refused at the limit may have reclaimed them already
                del tokens[s]
            elif op == "allocate" and len(live) < 8:
                tokens[cache.allocate()] = []
            else:
                continue
            counts[op, "ok"] = counts.get((op, "ok"), 0) + 1
        except vpaged.OutOfPagesError:
            assert state() == before, op
            counts[op, "pages"] = counts.get((op, "pages"), 0) + 1
        except vpaged.MappingLimitError as e:
            assert "max_map_count" in str(e), e
            unfill(16)
            assert state() == before, op  # nothing changed: no reference leaked, no counted page unmapped
            counts[op, "limit"] = counts.get((op, "limit"), 0) + 1
        unfill(16)  # views need no mapping, but torch's own allocations might
        check()
    unfill(held)
    for s in list(tokens):
        cache.free(s)
    cache.reclaim()
    assert pool.stats().used_pages == 0
    print("OK", seed, layout, " ".join(f"{op}:{what}={n}" for (op, what), n in sorted(counts.items())))
""")


def test_reorder_and_copy_on_write_complete_or_change_nothing_at_the_mapping_limit():
    outs = []
    for layout in ("per_layer", "interleaved", "head_major"):
        out = subprocess.run([sys.executable, "-c", CACHE_CHILD, layout], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.startswith("OK"), out.stdout
        outs.append(out.stdout)
    counts = {}
    for line in outs:
        for word in line.split()[3:]:
            key, n = word.split("=")
            counts[key] = counts.get(key, 0) + int(n)
    # Reorders completed at the limit and were refused there; extends that copy-on-write completed there (the
    # copy takes the index's home page where free: it usually needs no mapping; refusals of copy-on-write
    # are driven directly in the range test above).
    assert counts.get("reorder:ok", 0) > 10 and counts.get("reorder:limit", 0) > 3, outs
    assert counts.get("copy-on-write:ok", 0) > 0, outs
