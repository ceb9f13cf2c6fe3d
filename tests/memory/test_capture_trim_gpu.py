"""A trim from another thread while a CUDA graph is captured, on a real GPU: announced with
vpaged.memory.graph_capture(), the release of the pool's free pages waits for the capture to end, the capture
stays valid, and the graph replays with the output an eager run gives.

In the default (global) capture mode, a cuMemUnmap or cuMemRelease from any thread of the process invalidates
the capture; a shared budget's give-back thread or the vLLM plugin's idle thread trims from a thread of its
own, which is what this does. Marked gpu: skipped with the reason where torch or vpaged cannot use CUDA, or
where this vpaged has no vpaged.memory.graph_capture (scripts/gpu_check.sh runs it).
"""

import os
import threading

import pytest
import torch

import vpaged
import vpaged._C as C

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda", 0)
PAGES = 16


def cuda_problem() -> str:
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no usable CUDA device"
    return C.cuda_unavailable_reason(0)


@pytest.fixture(scope="module", autouse=True)
def needs_cuda():
    reason = cuda_problem()
    if reason:
        pytest.skip(reason)


class _CudaBytes:
    """Hands torch the mapped bytes of a range (__cuda_array_interface__), on an indexed device."""

    def __init__(self, address: int, nbytes: int, owner):
        self.owner = owner  # the range lives as long as the tensor
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}


def test_trim_from_a_second_thread_inside_a_graph_capture_waits_and_the_graph_replays():
    try:
        from vpaged.memory import graph_capture
    except ImportError:
        pytest.skip("this vpaged has no vpaged.memory.graph_capture")
    page = C.cuda_granularity(0)
    pool = vpaged.PagePool(DEV, capacity_pages=PAGES)
    rng = pool.new_range(PAGES * page)
    kept = list(range(PAGES // 2))
    rng.map_new(list(range(PAGES)))
    rng.unmap(list(range(PAGES // 2, PAGES)))  # half the pages free again, their device memory still held
    assert pool.stats().created_pages == PAGES and pool.stats().free_pages == PAGES // 2
    mapped = torch.as_tensor(_CudaBytes(rng.address, len(kept) * page, rng), device=DEV).view(torch.float32)
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    mapped.copy_(torch.randn(mapped.numel(), device=DEV, generator=gen))
    n = 1 << 16
    x = torch.randn(n, device=DEV, generator=gen)

    def body():  # reads vpaged's mapped pages and a torch tensor
        return x * 2.0 + mapped[:n] - mapped[-n:]

    side = torch.cuda.Stream(DEV)  # warm up off the capture, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream(DEV).wait_stream(side)
    torch.cuda.synchronize(DEV)

    graph = torch.cuda.CUDAGraph()
    trimmed, errors = [], []

    def trim():
        try:
            trimmed.append(pool.trim())
        except Exception as e:  # reported below: a failure on the second thread fails the test
            errors.append(e)

    with graph_capture():
        with torch.cuda.graph(graph):  # the default, global capture mode
            out = body()
            thread = threading.Thread(target=trim, name="trim-during-capture")
            thread.start()
            thread.join(60)
            created_during = pool.stats().created_pages
            pending_during = pool.stats().release_pending
    assert not thread.is_alive() and not errors, errors
    assert len(trimmed) == 1  # the trim returned (it did not wait for the capture)
    assert created_during == PAGES and pending_during, "the release must wait for the capture to end"

    pool.release_deferred()  # done already at the flag's last exit; True when nothing is left pending
    assert pool.stats().created_pages == len(kept) and not pool.stats().release_pending

    for _ in range(3):
        x.copy_(torch.randn(n, device=DEV, generator=gen))
        graph.replay()
        torch.cuda.synchronize(DEV)
        assert torch.equal(out, body()), "the replayed graph differs from an eager run"
    del graph, out
    torch.cuda.synchronize(DEV)
    rng.unmap(kept)
    del rng
    assert pool.trim() == PAGES and pool.stats().created_pages == 0
