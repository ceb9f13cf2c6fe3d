"""vpaged.memory.budget: one byte budget for the page pools of several processes on one machine.

shared.py is the budget itself (SharedBudget: join, grant, give back, the members' figures); segment.py its
bytes in /dev/shm, read without a lock and checked; ledger.py how a change lands (compare-and-swap on one
table); liveness.py whether a member is still there (leases, pids); policy.py the share policy under
contention (greedy, fair); member.py a pool's membership (its grant and its give-back thread); health.py
whether the budget a member joined is still there and usable.

A pool joins through member.py, which sees it only as a GrantedPool (the few calls it makes on it): the pool
(memory/pool.py) imports this package, never the reverse.
"""

from .health import BudgetHealth
from .member import BudgetFigures, BudgetMembership, GrantedCore, GrantedPool
from .policy import DEFAULT_SHARE_POLICY, SHARE_POLICIES
from .shared import BudgetMember, BudgetState, SharedBudget, default_member_name

__all__ = [
    "SharedBudget",
    "BudgetMember",
    "BudgetState",
    "BudgetFigures",
    "BudgetHealth",
    "BudgetMembership",
    "GrantedPool",
    "GrantedCore",
    "DEFAULT_SHARE_POLICY",
    "SHARE_POLICIES",
    "default_member_name",
]
