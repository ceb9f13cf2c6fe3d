"""SharedBudget: one byte budget for the pools of several processes on one machine (the ledger).

Pools join a budget by name (`PagePool(..., shared_budget=NAME)`); each member's own capacity becomes its
ceiling, and what it may have in use at once (its *grant*, the pool's limit) is charged to the budget. A
member may hold a guaranteed minimum (`min_bytes`) that the others cannot take. When a member needs more
than the budget has free, it asks the others to give back what they can spare (member.py): their
free granted pages, then pages kept only for reuse (freed slots, cached prefixes), never live K/V.

Invariants, kept by changes that land by compare-and-swap on one consistent table (ledger.py), so no
lock exists that a stopped member could hold:
- sum over members of max(granted, min) <= capacity, except while a member that just joined waits for the
  others to give back down to their minimums (its minimum was checked to fit: sum of minimums <= capacity);
- a member's granted bytes are a whole number of pages, never above its ceiling;
- a member whose process is gone (same PID namespace) is dropped by the next change, returning its grant at
  once; one whose lease ran out (stopped, or in another namespace and gone) is dropped likewise
  (liveness.py); readers leave both out at once;
- two live members never share a non-empty name; names are kept whole (up to 64 bytes of UTF-8).

Under contention a share policy (policy.py, chosen when the budget is created) says whom a short member
asks and, with "fair" (not the default), caps what a member holding more than its fair share may admit while
another member is starved.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

from ...errors import (
    BudgetCorruptError,
    BudgetInUseError,
    BudgetMismatchError,
    BudgetPermissionError,
    InvalidArgumentError,
)
from .ledger import BudgetLedger
from .liveness import LEASE_S, boottime_ns
from .policy import (
    DEFAULT_SHARE_POLICY,
    active_count,
    fair_share_bytes,
    is_asking,
    is_starved,
    policy_code,
    share_policy,
)
from .segment import NAME_BYTES, BudgetSegment, MemberRecord, SegmentStatus


@dataclass(frozen=True)
class BudgetMember:
    """A member as `vpaged budget show` lists it (bytes)."""

    index: int
    pid: int
    name: str
    model: str
    min_bytes: int
    ceiling_bytes: int
    granted_bytes: int
    mapped_bytes: int
    live_bytes: int
    dormant_bytes: int
    asked_bytes: int
    fair_share_bytes: int = 0  # max(min, capacity / active members), at most the ceiling (policy.py)
    starved: bool = False  # asking for pages while holding less than its fair share
    lease_age_s: float = 0.0  # since its process last renewed its lease (stopped or stalled when it grows)
    pid_namespace: int = 0  # the inode of its /proc/self/ns/pid: its pid means something only there
    answered: bool = True  # no ask on it is pending (asked_bytes may stay until it answers)


@dataclass(frozen=True)
class BudgetState:
    name: str
    capacity_bytes: int
    page_size: int
    granted_bytes: int  # the members' grants
    reserved_bytes: int  # what others cannot take: sum of max(granted, min)
    members: tuple[BudgetMember, ...]
    share_policy: str = DEFAULT_SHARE_POLICY
    active_members: int = 0  # members holding live K/V or asking for pages
    lease_s: float = LEASE_S  # a member whose lease is older than this is dropped

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.reserved_bytes)


class SharedBudget:
    """A named machine-wide budget. create() makes it, open() opens one that exists; join() is what a pool
    calls (see PagePool's shared_budget); state() and set_ceiling() are what `vpaged budget` shows and
    changes; check() says whether the open budget is still the one of its name and readable."""

    def __init__(self, segment: BudgetSegment):
        self.segment = segment
        self.ledger = BudgetLedger(segment)
        self.name = segment.name
        self.policy = share_policy(segment.policy_code)

    @classmethod
    def create(
        cls,
        name: str,
        capacity_bytes: int,
        page_size: int = 64 * 1024,
        mode: int = 0o600,
        share_policy: str = DEFAULT_SHARE_POLICY,
        lease_s: float = LEASE_S,
    ) -> SharedBudget:
        """A new budget of capacity_bytes (rounded down to whole pages of page_size; every member must use
        that page size). mode: 0o600 (this user only, the default) or 0o660 (also its group). share_policy:
        "greedy" (default) or "fair", what a member may admit while another is starved (policy.py).
        lease_s: a member whose process has not renewed its lease this long is dropped (liveness.py)."""
        code = policy_code(share_policy)
        capacity_bytes, page_size = int(capacity_bytes), int(page_size)
        if page_size <= 0 or capacity_bytes < page_size:
            raise InvalidArgumentError(
                f"a budget needs at least one page: capacity_bytes={capacity_bytes}, page_size={page_size}"
            )
        capacity_bytes -= capacity_bytes % page_size
        return cls(BudgetSegment.create(name, capacity_bytes, page_size, mode, code, lease_s))

    @classmethod
    def open(cls, name: str) -> SharedBudget:
        return cls(BudgetSegment.open(name))

    @staticmethod
    def remove(name: str, force: bool = False) -> bool:
        """Remove the budget's segment; returns whether there was one. Refused (BudgetInUseError) while live
        members use it, unless force (they then go on counting on their copy: check() tells them). A damaged
        segment is removed without asking (that is its fix). BudgetPermissionError: not this user's to
        remove."""
        if not force:
            try:
                budget = SharedBudget.open(name)
            except (BudgetCorruptError, BudgetPermissionError):  # unreadable here: the unlink decides
                budget = None
            except FileNotFoundError:
                return False
            if budget is not None:
                try:
                    members = budget.state().members
                except BudgetCorruptError:
                    members = ()
                finally:
                    budget.close()
                if members:
                    names = ", ".join(f"{m.index} ({m.name or 'unnamed'}, pid {m.pid})" for m in members)
                    raise BudgetInUseError(
                        f"budget {name!r} has {len(members)} live member(s): {names}; stop them first, or remove "
                        "it anyway with force (`vpaged budget remove --force`): they keep counting on the removed "
                        "copy until they rejoin"
                    )
        return BudgetSegment.remove(name)

    def check(self) -> SegmentStatus:
        """Whether this open budget is still the budget of its name and readable: state "ok", "removed",
        "replaced" (removed and created again: rejoin the new one) or "corrupt", with a message."""
        return self.segment.status()

    @property
    def capacity_bytes(self) -> int:
        return self.segment.capacity_bytes

    @property
    def page_size(self) -> int:
        return self.segment.page_size

    @property
    def lease_s(self) -> float:
        return self.segment.lease_ns / 1e9

    def close(self) -> None:
        self.ledger.stop()
        self.segment.close()

    # ------------------------------------------------------------------------------------------ members
    def join(self, *, page_size: int, ceiling_bytes: int, min_bytes: int = 0, name: str = "", model: str = "") -> int:
        """Add a member of this process; returns its index. Refused up front (nothing changed): with
        InvalidArgumentError when the name is longer than 64 bytes of UTF-8; with BudgetMismatchError when the
        page size differs, when min_bytes exceeds the ceiling, when the members' minimums would exceed the
        capacity, when a live member has the same (non-empty) name, or when no slot is free."""
        ps = self.page_size
        name, model = str(name), _cut(str(model))
        if len(name.encode()) > NAME_BYTES:
            raise InvalidArgumentError(f"a member's name is at most {NAME_BYTES} bytes of UTF-8, got {name!r}")
        if page_size != ps:
            raise BudgetMismatchError(
                f"budget {self.name!r} counts pages of {ps} bytes; this pool's are {page_size} bytes: give the "
                f"pool page_size={ps} or use a budget made for {page_size}-byte pages"
            )
        min_bytes = -(-int(min_bytes) // ps) * ps
        ceiling_bytes = min(int(ceiling_bytes) // ps * ps, self.capacity_bytes)
        if min_bytes < 0 or min_bytes > ceiling_bytes:
            raise BudgetMismatchError(
                f"min_bytes={min_bytes} cannot be guaranteed within the member's ceiling of {ceiling_bytes} bytes"
            )

        def change(records: list[MemberRecord]) -> MemberRecord:
            taken = sum(r.min_bytes for r in records)
            if taken + min_bytes > self.capacity_bytes:
                raise BudgetMismatchError(
                    f"budget {self.name!r} cannot guarantee min_bytes={min_bytes}: its members already hold "
                    f"minimums of {taken} of {self.capacity_bytes} bytes"
                )
            twin = next((r for r in records if name and r.name == name), None)
            if twin is not None:
                raise BudgetMismatchError(
                    f"budget {self.name!r} already has a live member named {name!r} (index {twin.index}, pid "
                    f"{twin.pid}): give this pool another member_name"
                )
            index = self.ledger.free_index()
            if index is None:
                raise BudgetMismatchError(f"budget {self.name!r} has no free member slot ({len(records)} members)")
            record = self.ledger.new_record(
                index, name=name, model=model, min_bytes=min_bytes, ceiling_bytes=ceiling_bytes
            )
            records.append(record)
            self._ask_others(records, record, max(0, min_bytes - self._headroom(records, record)), for_minimum=True)
            return record

        record = self.ledger.transact(change)
        self.ledger.adopt(record)
        return record.index

    def leave(self, index: int) -> bool:
        """Drop this process's member `index`; its grant returns to the budget. Returns whether it was there
        (False also when the segment is damaged: there is nothing left to leave)."""
        if self.ledger.token_of(index) is None:
            return False

        def change(records):
            mine = self._mine(records, index)
            if mine is not None:
                records.remove(mine)
            return mine is not None

        try:
            return self.ledger.transact(change, actor=index)
        except BudgetCorruptError:
            return False

    def grant(self, index: int, need: int, prefer: int = 0) -> int:
        """Raise member `index`'s grant by `prefer` bytes if that fits, else by `need`, else not at all (then
        the others are asked to give back the difference, and the member's demand is published for the share
        policy). Returns the bytes added (0 or a whole number of pages), or -1 when the member is gone (its
        record was removed: its process was taken for dead or its lease ran out)."""
        ps = self.page_size
        need, prefer = -(-need // ps) * ps, -(-max(prefer, need) // ps) * ps

        def change(records):
            mine = self._mine(records, index)
            if mine is None:
                return -1
            room = self._headroom(records, mine)
            add = prefer if prefer <= room else need if need <= room else 0
            if add:
                mine.granted_bytes += add
                mine.demand_bytes = 0
            elif need:  # asking for the chunk too, so that a growing member comes back rarely
                mine.demand_bytes, mine.demand_ns = need, _now_ns()
                self._ask_others(records, mine, prefer - max(0, room))
            return add

        return self.ledger.transact(change, actor=index)

    def give_back(
        self, index: int, granted_bytes: int, mapped: int, live: int, dormant: int, answer: bool = True
    ) -> None:
        """Member `index` now holds `granted_bytes` (at most what it held) and, with answer, answers every ask
        so far (answer=False: it gave back unasked, and asks still pending stay pending)."""

        def change(records):
            mine = self._mine(records, index)
            if mine is None:
                return
            mine.granted_bytes = min(mine.granted_bytes, granted_bytes)
            if answer:
                mine.asked_bytes = 0  # it gave what it could; an asker still short asks again
                mine.answered_seq = mine.ask_seq

        # Figures first: a member asked to give back is judged by them once its answer lands.
        self.ledger.report(index, mapped, live, dormant)
        self.ledger.transact(change, actor=index)

    def report(self, index: int, mapped: int, live: int, dormant: int) -> None:
        """Update the figures `vpaged budget show` lists for member `index` (changes no grant; writes only the
        member's own status record, so it never waits for anyone)."""
        self.ledger.report(index, mapped, live, dormant)

    def label(self, index: int, model: str) -> None:
        """Set the model member `index` serves, as `vpaged budget show` lists it (64 bytes of UTF-8 kept)."""
        model = _cut(str(model))

        def change(records):
            mine = self._mine(records, index)
            if mine is not None:
                mine.model = model

        self.ledger.transact(change, actor=index)

    def member(self, index: int) -> BudgetMember | None:
        records = self.ledger.records()
        mine = self._mine(records, index)
        if mine is None:
            return None
        now = _now_ns()
        return self._public(mine, active_count(records, now), now)

    def headroom(self, index: int) -> int:
        """Bytes member `index` could be granted now without anyone giving back (0 when gone)."""
        records = self.ledger.records()
        mine = self._mine(records, index)
        return 0 if mine is None else max(0, self._headroom(records, mine))

    def admission_cap(self, index: int) -> int | None:
        """Live bytes member `index` may hold when it admits new work, by the budget's share policy (None: no
        cap, e.g. nobody else is starved)."""
        records = self.ledger.records()
        mine = self._mine(records, index)
        if mine is None:
            return None
        return self.policy.admission_cap(records, mine, self.capacity_bytes, self.page_size, _now_ns())

    def pending_asks(self, index: int) -> bool:
        """Whether a member asked by `index` has not answered yet (so waiting for it may still help)."""
        return any(r.asked_bytes and r.answered_seq < r.ask_seq for r in self.ledger.records() if r.index != index)

    # -------------------------------------------------------------------------------------- control
    def state(self) -> BudgetState:
        records = self.ledger.records()
        now, cap, ps = _now_ns(), self.capacity_bytes, self.page_size
        active = active_count(records, now)
        return BudgetState(
            self.name,
            cap,
            ps,
            sum(r.granted_bytes for r in records),
            sum(r.reserved_bytes() for r in records),
            tuple(self._public(r, active, now) for r in sorted(records, key=lambda r: r.index)),
            self.policy.name,
            sum(1 for r in records if r.live_bytes > 0 or is_asking(r, now)),
            self.lease_s,
        )

    def set_ceiling(
        self,
        member: str | None = None,
        max_bytes: int | None = None,
        *,
        index: int | None = None,
        pid: int | None = None,
    ) -> list[int]:
        """Change the ceiling of the member named `member` (a name only, never read as an index or pid), or
        of the member at `index=`, or of the members of process `pid=` (as this process's PID namespace sees
        it), at run time; a member now above it is asked to give back down to it. Exactly one selector.
        Returns the indices changed; InvalidArgumentError when none matches."""
        if sum(x is not None for x in (member, index, pid)) != 1 or max_bytes is None:
            raise InvalidArgumentError("set_ceiling takes max_bytes and exactly one of a name, index= or pid=")
        ps = self.page_size
        max_bytes = min(int(max_bytes) // ps * ps, self.capacity_bytes)
        pidns = self.ledger.pidns
        what = (
            f"named {member!r}" if member is not None else f"at index {index}" if index is not None else f"of pid {pid}"
        )

        def picked(r: MemberRecord) -> bool:
            if member is not None:
                return r.name == member
            if index is not None:
                return r.index == index
            return r.pid == pid and r.pidns == pidns

        def change(records):
            changed = []
            for r in records:
                if picked(r):
                    if max_bytes < r.min_bytes:
                        raise InvalidArgumentError(
                            f"member {what} is guaranteed min_bytes={r.min_bytes}: a ceiling of {max_bytes} bytes "
                            "is below it"
                        )
                    r.ceiling_bytes = max_bytes
                    if r.granted_bytes > max_bytes:
                        r.asked_bytes = max(r.asked_bytes, r.granted_bytes - max_bytes)
                        r.ask_seq += 1
                    changed.append(r.index)
            return changed

        actor = next(iter(self.ledger.owned()), None)
        changed = self.ledger.transact(change, actor=actor)
        if not changed:
            raise InvalidArgumentError(f"budget {self.name!r} has no member {what} among its live members")
        return changed

    # -------------------------------------------------------------------------------------- helpers
    def _mine(self, records: list[MemberRecord], index: int) -> MemberRecord | None:
        return next((r for r in records if r.index == index and self.ledger.is_mine(r)), None)

    def _headroom(self, records: list[MemberRecord], mine: MemberRecord) -> int:
        """How far `mine` may grow now: up to its ceiling, in what the others do not reserve (its own
        minimum is its to use)."""
        others = sum(r.reserved_bytes() for r in records if r is not mine)
        return min(mine.ceiling_bytes, self.capacity_bytes - others) - mine.granted_bytes

    def _ask_others(self, records: list[MemberRecord], mine: MemberRecord, short: int, for_minimum=False) -> None:
        """Ask the members with spare bytes (the share policy's spare_bytes: by default what they hold beyond
        their live K/V and minimum) for `short` bytes in all, largest spare first; each member's thread sees
        its ask counter move and gives back what it can (never live K/V)."""
        if short <= 0:
            return
        if for_minimum:  # a new member's guaranteed minimum: whatever the others do not use live
            spare = {r.index: r.granted_bytes - max(r.min_bytes, r.live_bytes) for r in records if r is not mine}
        else:
            spare = self.policy.spare_bytes(records, mine, self.capacity_bytes, self.page_size, _now_ns())
        for r in sorted((r for r in records if spare.get(r.index, 0) > 0), key=lambda r: -spare[r.index]):
            r.asked_bytes = max(r.asked_bytes, min(spare[r.index], short))
            r.ask_seq += 1
            short -= min(spare[r.index], short)
            if short <= 0:
                break

    def _public(self, r: MemberRecord, active: int, now: int) -> BudgetMember:
        cap, ps = self.capacity_bytes, self.page_size
        lease_age = max(0, boottime_ns() - max(r.lease_ns, r.joined_ns)) / 1e9
        return BudgetMember(
            r.index, r.pid, r.name, r.model, r.min_bytes, r.ceiling_bytes, r.granted_bytes, r.mapped_bytes,
            r.live_bytes, r.dormant_bytes, r.asked_bytes, fair_share_bytes(r, active, cap, ps),
            is_starved(r, active, cap, ps, now), lease_age, r.pidns, r.answered_seq >= r.ask_seq,
        )  # fmt: skip


_DEFAULT_NAMES = itertools.count()


def default_member_name() -> str:
    """A member name for a pool that gives none: "pool-PID", then "pool-PID-2", ... for further pools of the
    process (two live members may not share a name)."""
    n = next(_DEFAULT_NAMES)
    return f"pool-{os.getpid()}" + (f"-{n + 1}" if n else "")


def _cut(text: str, limit: int = 64) -> str:
    """At most `limit` bytes of UTF-8, cut at a character boundary."""
    return text.encode()[:limit].decode(errors="ignore")


def _now_ns() -> int:
    return time.time_ns()
