"""vpaged.memory: physical pages and what limits them.

A PagePool owns one device's pages (over the C++ backend: host memfd or CUDA VMM); device.py picks the
backend and page size, limits.py checks a host pool against what the machine can back, buildinfo.py says how
the extension was built, and allocator.py plugs a pool into torch's allocator. shared_budget.py is the
machine-wide ledger that pools of several processes join (budget_segment.py its bytes in /dev/shm,
budget_ledger.py its lock-free changes, budget_liveness.py the members' leases, budget_member.py a pool's
grant and give-back thread, fair_share.py the rule under contention). Nothing
here knows about tokens or caches.
"""

from .allocator import AllocatorStats, TorchAllocator, empty, torch_allocator
from .budget_member import BudgetFigures
from .buildinfo import build_info
from .device import BackendInfo, backends
from .pool import PagePool, PoolStats, Reclaimable, default_pool, resolve_pool, set_default_pool
from .shared_budget import BudgetMember, BudgetState, SharedBudget

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
]
