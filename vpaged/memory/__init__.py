"""vpaged.memory: physical pages and what limits them.

A PagePool owns one device's pages (over the C++ backend: host memfd or CUDA VMM); device.py picks the
backend and page size, limits.py checks a host pool against what the machine can back, buildinfo.py says how
the extension was built, allocator.py plugs a pool into torch's allocator, and capture.py raises the
process-wide CUDA graph capture flag that defers releases while a graph is captured. budget/ is the machine-wide
shared budget that pools of several processes join (budget/shared.py the budget, segment.py its bytes in
/dev/shm, ledger.py its lock-free changes, liveness.py the members' leases, member.py a pool's grant and
give-back thread, policy.py the share rule under contention, health.py whether it is still usable); a pool
imports it, and it sees a pool only through a small protocol (budget.member.GrantedPool). Nothing here knows
about tokens or caches.
"""

from .allocator import AllocatorStats, TorchAllocator, empty, torch_allocator
from .budget import BudgetFigures, BudgetMember, BudgetState, SharedBudget
from .buildinfo import build_info
from .capture import capture_active, graph_capture
from .device import BackendInfo, backends
from .pool import PagePool, PoolStats, Reclaimable, default_pool, resolve_pool, set_default_pool

__all__ = [
    "PagePool",
    "PoolStats",
    "Reclaimable",
    "SharedBudget",
    "BudgetMember",
    "BudgetState",
    "BudgetFigures",
    "default_pool",
    "set_default_pool",
    "resolve_pool",
    "backends",
    "BackendInfo",
    "build_info",
    "torch_allocator",
    "TorchAllocator",
    "AllocatorStats",
    "empty",
    "graph_capture",
    "capture_active",
]
