"""BudgetHealth: whether a member's shared budget is still the one it joined, and usable.

A member keeps its segment open for as long as it is a member, so that a budget removed under it (`vpaged
budget remove NAME --force`), or removed and created again under the same name, goes on working on the old
file: its counts no longer agree with anyone who joined the new one. And a segment damaged (written outside
vpaged, truncated) refuses every ledger call with BudgetCorruptError. The member's give-back thread looks
every REPORT_S (member.py) and keeps the verdict here, where a server reads it without any lock
(GET /health, /metrics, and the routes that refuse new requests while the budget is unusable):

- "ok": the path names the segment the member has open (BudgetSegment.status()), and the last ledger call
  succeeded;
- "removed": no segment at the path any more (nobody else counts with this member: 503 until one is made);
- "replaced": another segment at the path, which the member could not join yet (it joins it as soon as it
  can, with the same name, minimum and ceiling, and is then "ok" again);
- "corrupt": a ledger call failed with BudgetCorruptError (or the segment was truncated);
- "waiting": the member has been short of pages for longer than STALL_S while members it asked have not
  answered (a stopped process, say); the message names them. Its requests wait; none is refused for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

STALL_S = 1.0  # short this long while an asked member has not answered: /health names that member
KINDS = ("ok", "removed", "replaced", "corrupt", "waiting")


@dataclass(frozen=True)
class BudgetHealth:
    kind: str  # one of KINDS
    message: str = ""  # the cause, naming the budget (and the members waited for); "" when ok
    since: float = 0.0  # time.monotonic() when it began

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def serves(self) -> bool:
        """Whether new requests may be admitted: the budget is usable ("waiting" only delays them)."""
        return self.kind in ("ok", "waiting")


OK = BudgetHealth("ok")


def verdict(kind: str, name: str, detail: str = "", previous: BudgetHealth = OK) -> BudgetHealth:
    """The health of `kind` with its cause in words; keeps `since` while the kind does not change."""
    if kind == "ok":
        return OK
    messages = {
        "removed": f"shared budget {name!r} was removed while this member was in it: nothing counts its pages "
        f"against the others' any more; create it again (`vpaged budget create {name} --bytes N`) and this member "
        "rejoins it",
        "replaced": f"shared budget {name!r} was removed and created again; this member could not join the new one yet",
        "corrupt": f"shared budget {name!r} cannot be read",
        "waiting": f"shared budget {name!r}: short of pages",
    }
    message = messages[kind] + (f": {detail}" if detail else "")
    since = previous.since if previous.kind == kind else time.monotonic()
    return BudgetHealth(kind, message, since)
