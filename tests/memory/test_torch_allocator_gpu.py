"""The torch allocator hook on a real GPU: torch tensors in vpaged pages, one budget with the KV cache.

Every test is marked `gpu` and skips with the reason where torch or vpaged cannot use CUDA. Each test
makes its own pool and hook and closes the hook at the end (one hook per device at a time).

cuBLAS keeps a workspace per handle and stream, allocated on first use through torch's allocator; the
module fixture warms it up outside any scope, so that no scope ever holds it (a scope's pages then all go
back on exit). Kernels on side streams here are elementwise for the same reason.
"""

import gc

import pytest
import torch

import vpaged
import vpaged._C as C
from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda", 0)


def cuda_problem() -> str:
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no usable CUDA device"
    return C.cuda_unavailable_reason(0)


@pytest.fixture(scope="module", autouse=True)
def warm_cuda():
    reason = cuda_problem()
    if reason:
        pytest.skip(reason)
    a = torch.randn(64, 64, device=DEV)
    lin = torch.nn.Linear(64, 64, device=DEV)
    lin(a).sum().backward()
    (a @ a).sum().item()
    torch.cuda.synchronize()
    yield


@pytest.fixture
def make_hook():
    made = []

    def make(capacity_bytes=4 << 30, max_bytes=None):
        pool = vpaged.PagePool(DEV, capacity_bytes=capacity_bytes)
        hook = vpaged.torch_allocator(pool, DEV, max_bytes=max_bytes)
        made.append(hook)
        return pool, hook

    yield make
    for hook in made:
        hook.close()
    gc.collect()
    torch.cuda.synchronize()


def test_model_forward_backward_in_scope_equals_default_allocator(make_hook):
    pool, hook = make_hook()
    torch.manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(DEV)
    x = torch.randn(64, 256, device=DEV)
    out_ref = model(x)
    out_ref.square().mean().backward()
    grads_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

    with hook.scope():
        h = model[0](x)
        out = model[2](model[1](h))
        assert hook.contains(h) and hook.contains(out), "tensors made in a scope lie inside the hook's ranges"
        assert not hook.contains(x)
        assert pool.stats().allocator_pages > 0
        out.square().mean().backward()
        torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)
        for p, g in zip(model.parameters(), grads_ref):
            torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-6)
        del h, out
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    assert hook.stats().segments == 0 and pool.stats().allocator_pages == 0


def test_pool_pages_match_torch_reserved_bytes_and_scope_exit_returns_every_page(make_hook):
    pool, hook = make_hook()
    page = pool.page_size
    torch.cuda.synchronize()
    # Nothing cached in the default pool first: if ~MemPool does not empty its own cache, the scope's
    # fallback torch.cuda.empty_cache() also frees the default pool's cached blocks, which would lower
    # memory_reserved below this baseline on one torch and not on another.
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved(DEV)
    gen = torch.Generator().manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    sizes = [int(s) for s in torch.randint(1 << 10, 40 << 20, (24,), generator=gen)]
    with hook.scope():
        tensors = [torch.empty(s, dtype=torch.uint8, device=DEV).fill_(i % 251) for i, s in enumerate(sizes)]
        torch.cuda.synchronize()
        s = hook.stats()
        reserved = torch.cuda.memory_reserved(DEV) - reserved_before
        assert reserved == s.bytes, (reserved, s)
        assert s.mapped_bytes == pool.stats().allocator_pages * page
        assert s.mapped_bytes - s.bytes < page * s.segments  # at most one partial page per segment
        assert all(hook.contains(t) for t in tensors)
        for i, t in enumerate(tensors):  # every tensor still holds its own bytes: nothing overlaps
            assert int(t.min()) == int(t.max()) == i % 251
        del tensors, t
    torch.cuda.synchronize()
    s = hook.stats()
    assert (s.segments, s.bytes, s.mapped_bytes) == (0, 0, 0) and s.frees == s.mallocs > 0
    assert pool.stats().allocator_pages == 0
    assert torch.cuda.memory_reserved(DEV) == reserved_before

    # A tensor that outlives its scope keeps its segment until it dies and torch empties its cache.
    with hook.scope():
        kept = torch.ones(3 << 20, device=DEV)
    assert pool.stats().allocator_pages > 0 and hook.contains(kept)
    assert float(kept.sum()) == 3 << 20
    del kept
    torch.cuda.empty_cache()
    assert pool.stats().allocator_pages == 0 and hook.stats().segments == 0


def test_kernel_on_a_side_stream_at_scope_exit_is_waited_for(make_hook):
    pool, hook = make_hook()
    side = torch.cuda.Stream(DEV)
    with hook.scope():
        x = torch.zeros(32 << 20, device=DEV)  # 128 MiB in the hook
        side.wait_stream(torch.cuda.current_stream(DEV))
        with torch.cuda.stream(side):
            torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time before the write below
            x.add_(1.0)
        # No record_stream: the side stream still writes x when its segment is freed at scope exit. cudaFree
        # waits for the device in that case; vpaged's free must too, or the write hits unmapped memory.
        del x
    assert side.query(), "scope exit returned while a kernel on a side stream still used the memory"
    torch.cuda.synchronize()  # raises if the kernel faulted (illegal address)
    assert pool.stats().allocator_pages == 0
    assert float(torch.ones(4, device=DEV).sum()) == 4.0  # the context is healthy


def test_cuda_graph_captured_into_the_mempool_replays_equal_to_eager(make_hook):
    pool, hook = make_hook()

    def fn(v):
        return torch.sin(v * 2.0 + 1.0) * v - v.square()

    static_in = torch.randn(1 << 20, device=DEV)
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))
    # Warm up on the capture stream in the same pool, as torch's graph docs advise: capture then reuses
    # the pool's cached blocks of that stream.
    with torch.cuda.stream(side), torch.cuda.use_mem_pool(hook.mempool, DEV):
        for _ in range(2):
            fn(static_in)
    torch.cuda.current_stream(DEV).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=hook.mempool.id, stream=side):
        static_out = fn(static_in)
    assert hook.contains(static_out), "the graph's output lies in the pool"
    for _ in range(3):
        static_in.copy_(torch.randn(1 << 20, device=DEV))
        graph.replay()
        assert torch.equal(static_out, fn(static_in))
    assert pool.stats().allocator_pages > 0
    del graph, static_out
    torch.cuda.synchronize()


def test_pool_filled_by_kv_gives_torch_out_of_memory_until_the_kv_is_freed(make_hook):
    pool, hook = make_hook(capacity_bytes=64 << 20)  # 32 pages of 2 MiB
    page = pool.page_size
    assert pool.capacity_pages == (64 << 20) // page
    # bf16, 8 heads x 128: 2 KiB per token and layer; 1024 tokens fill a 2 MiB page of each of 2 layers' K
    # and V: 4 pages per sequence of 1024 tokens (with 2 MiB pages).
    cache = VirtualKVCache(
        KVGeometry(2, 8, 128, torch.bfloat16), VirtualCacheConfig(max_seqs=64, max_seq_len=4096, device=DEV), pool=pool
    )
    seqs = []
    while pool.free_pages() > 0:
        seq = cache.allocate()
        cache.extend(seq, page // (8 * 128 * 2))
        seqs.append(seq)
    assert pool.stats().kv_pages == pool.capacity_pages and pool.stats().allocator_pages == 0
    with hook.scope():
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(8 << 20, dtype=torch.uint8, device=DEV)
        assert hook.stats().failures >= 1
        for seq in seqs:
            cache.free(seq)  # dormant: still mapped for reuse ...
        assert pool.ensure_free(pool.capacity_pages // 2)  # ... until the pool reclaims them
        t = torch.empty(8 << 20, dtype=torch.uint8, device=DEV).fill_(3)
        assert hook.contains(t) and int(t.sum()) == 3 * (8 << 20)
        assert pool.stats().allocator_pages >= 4
        del t
    assert pool.stats().allocator_pages == 0
    cache.close()
    assert pool.stats().used_pages == 0


def test_cap_gives_torch_out_of_memory(make_hook):
    pool, hook = make_hook(max_bytes=32 << 20)
    with hook.scope():
        a = torch.empty(20 << 20, dtype=torch.uint8, device=DEV)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(20 << 20, dtype=torch.uint8, device=DEV)
        assert hook.stats().bytes <= 32 << 20
        del a
    assert pool.stats().allocator_pages == 0


def test_free_on_the_capturing_stream_inside_torch_cuda_graph_is_deferred_then_completed(make_hook):
    """The entry points torch calls (vpaged_torch_malloc / vpaged_torch_free, through ctypes here: torch's
    caching allocator only frees a segment inside a capture when it runs short) inside a real
    torch.cuda.graph capture: the free on the capturing stream is deferred (no device-wide wait, which would
    invalidate the capture), its pages stay mapped; the first call after the capture completes it, and the
    captured graph replays."""
    import ctypes

    pool, hook = make_hook()
    lib = ctypes.CDLL(vpaged.memory.allocator.library_path())
    lib.vpaged_torch_malloc.restype = ctypes.c_void_p
    lib.vpaged_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.vpaged_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    x = torch.randn(1 << 16, device=DEV)
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))
    size = 3 * pool.page_size + 12345
    graph = torch.cuda.CUDAGraph()
    before = hook.stats()
    with torch.cuda.graph(graph, stream=side):
        y = torch.sin(x) + 1.0
        ptr = lib.vpaged_torch_malloc(size, DEV.index, ctypes.c_void_p(side.cuda_stream))
        assert ptr, "an allocation during the capture must work"
        lib.vpaged_torch_free(ptr, size, DEV.index, ctypes.c_void_p(side.cuda_stream))
        assert hook.flush() == 1, "the free must wait for the capture's end"
        during = hook._allocator.stats()
    assert during.deferred_frees == 1 and during.mapped_bytes >= before.mapped_bytes + 4 * pool.page_size
    s = hook.stats()  # the first call after the capture completes the free
    assert s.deferred_frees == 0 and s.frees == before.frees + 1 and s.mapped_bytes == before.mapped_bytes
    x.copy_(torch.randn(1 << 16, device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, torch.sin(x) + 1.0)
