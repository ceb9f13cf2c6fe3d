"""CUDA graph capture and vpaged's releases: a process-wide capture flag.

While a CUDA graph is captured in the default (global) capture mode, a cuMemUnmap, cuMemRelease, cuMemCreate,
cuMemMap or cuMemSetAccess made by ANY thread of the process invalidates the capture. vpaged releases device
memory from threads other than the capturing one (a shared budget's give-back thread lowers a pool's limit,
the vLLM idle thread trims), and it cannot see every capture by itself: torch.cuda.graph and vLLM capture on a
stream of their own, which no vpaged range has registered. So a capture is announced:

    with vpaged.memory.graph_capture():
        with torch.cuda.graph(graph):
            ...

While the flag is up (counted: nested or concurrent captures each raise it), on a CUDA pool:
  * PagePool.trim() and a lowered limit (set_limit: a budget giving back, releasing unused grant) keep their
    release pending: the limit is set at once, so nothing more is handed out, and the free pages' memory goes
    back at the first chance after the capture ended (the flag's last exit, or the pool's next call);
  * a range (a cache) destroyed during the capture keeps its pages mapped and referenced and its address range
    reserved; the pool unmaps them after the capture, having waited for the device first;
  * unmapping or remapping a range's pages is refused (BackendError, nothing changed), as it is already when
    one of the range's registered streams captures; caches skip reclaiming then;
  * a budget member answers asks with its free pages only (no cache is asked to unmap).
The C++ core also defers where the driver says the legacy stream may not be used now (a global-mode capture
on a blocking stream), and capture_active() asks torch about the calling thread's current stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .. import _C


@contextlib.contextmanager
def graph_capture() -> Iterator[None]:
    """Raise the process-wide capture flag for the body (wrap torch.cuda.graph, or vLLM's graph_capture, in
    it: enter it before the capture begins, leave it after the capture ended). Thread-safe and re-entrant. On
    the last exit, the releases and range teardowns every pool deferred meanwhile are done (a pool that still
    cannot, because another capture runs, does them at its next call)."""
    _C.begin_capture()
    try:
        yield
    finally:
        _C.end_capture()


def capture_active() -> bool:
    """Whether a CUDA graph capture is known to run now: the capture flag is up (graph_capture), or torch's
    current stream on the calling thread is capturing (torch.cuda.is_current_stream_capturing, where torch
    has initialised CUDA). A pure query: it never disturbs a capture."""
    if _C.capture_flagged():
        return True
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return False
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError):  # a torch without a usable CUDA runtime answers by raising
        return False
