"""BudgetLedger: changes to a shared budget's member table by compare-and-swap, and the members' leases.

Note (how a change lands; the layout is segment.py's). `transact(change, actor)`:
1. read a snapshot (control word, checked table), drop the records of members that are gone for sure and
   fence those whose lease ran out (liveness.py); records this process owned and finds fenced are
   freed (it knows it is no longer writing their slot);
2. run `change(records)` on the live records: it edits them (or appends, removes) and returns the result;
   raising refuses the whole change, nothing written;
3. if the table is unchanged, return (a read costs no write); else write the new table, generation g+1,
   into a buffer this process may write that is not the active one: one of the acting member's two, or a
   scratch buffer claimed for the change (a process that owns no slot: join, `vpaged budget limit`);
4. compare-and-swap the control word (g, active) -> (g+1, that buffer). Failure means another change landed
   first: start again from 1 (after a short random wait), up to TRANSACTION_S, then BudgetContentionError.

Every change is thus computed from one consistent table and lands only if no other landed meanwhile:
changes are serializable, so the invariants SharedBudget keeps (the capacity) hold without a lock. A
process killed at any instruction has at most written a buffer that is not active; one stopped holds
nothing. Within one process, changes and status writes are serialized by a process-wide lock (two threads
must not write the same buffer).

Which buffer a process may write: its slot's buffers for as long as it owns the slot; a slot is owned from
the join that put its record in the table until the change that takes it out. Slots of members that are
gone are reused only when they are gone for sure, or fenced for FENCE_GRACE_S (liveness.py), so no
resumed process writes into a buffer that a new member uses. Scratch claims work the same way: a claim
older than SCRATCH_GRACE_S is taken over (its claimer was killed or stopped inside a change).

The lease: a daemon thread per segment renews the lease of this process's members every RENEW_S by
rewriting their status records (segment.write_status), with the figures they last reported.
"""

from __future__ import annotations

import os
import random
import threading
import time
import weakref
from collections.abc import Callable

from ...errors import BudgetContentionError, BudgetCorruptError
from .liveness import (
    DEAD,
    EXPIRED,
    FENCED,
    FREE_FENCE,
    RENEW_S,
    boottime_ns,
    classify,
    pid_namespace,
    process_start_ticks,
)
from .segment import (
    CLAIMS_OFFSET,
    CONTROL_OFFSET,
    MAX_MEMBERS,
    N_SCRATCH,
    BudgetSegment,
    MemberRecord,
    buffer_offset,
    pack_table,
)

TRANSACTION_S = 2.5  # a change that cannot land this long is refused (the bound for a grant is 3 s)
_MIN_TRIES = 20  # tries before giving up, however long they took (a caller stopped mid-change resumes late)
SCRATCH_GRACE_S = 120.0  # a scratch claim older than this is taken over
_WRITE_LOCK = threading.RLock()  # this process's writers of any ledger (see the Note)


def _after_fork_in_child() -> None:
    # A thread of the parent (its lease renewer) may have held the lock at the fork: the child has no such
    # thread, and it owns none of its parent's members (_Owned clears them).
    global _WRITE_LOCK
    _WRITE_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)

# Test hook: called after a change's buffer is written and before its compare-and-swap (tests stop or kill
# the process there to show that a change cut at that point harms no one). None in production.
before_commit: Callable[[], None] | None = None


class _Owned:
    """The members this process owns, by (segment file, index): their tokens and last figures. Keyed by the
    file so that every SharedBudget object of the process knows them; cleared in a forked child (a child is
    not its parent's member)."""

    def __init__(self):
        self.tokens: dict[tuple[int, int, int], int] = {}
        self.figures: dict[tuple[int, int, int], tuple[int, int, int]] = {}
        self.pid = os.getpid()

    def _fresh(self) -> None:
        if self.pid != os.getpid():
            self.tokens.clear()
            self.figures.clear()
            self.pid = os.getpid()


_OWNED = _Owned()


class BudgetLedger:
    """The changes and leases of one open segment (see the module's Note)."""

    def __init__(self, segment: BudgetSegment):
        self.segment = segment
        self._file = segment.file_id()
        self.pidns = pid_namespace()
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()
        self._occupied: set[int] = set()

    # ---------------------------------------------------------------------------------------- ownership
    def token_of(self, index: int) -> int | None:
        """This process's token for member `index`, None when it does not own it."""
        _OWNED._fresh()
        return _OWNED.tokens.get((*self._file, index))

    def owned(self) -> list[int]:
        _OWNED._fresh()
        return [k[2] for k in _OWNED.tokens if k[:2] == self._file]

    def is_mine(self, r: MemberRecord) -> bool:
        return r.token != 0 and self.token_of(r.index) == r.token

    def new_record(self, index: int, **fields) -> MemberRecord:
        """A record for a member of this process joining at `index` (its token made here)."""
        me = os.getpid()
        token = int.from_bytes(os.urandom(8), "little") | 1
        now = boottime_ns()
        return MemberRecord(
            index, me, process_start_ticks("self") or 0, pidns=self.pidns, token=token, joined_ns=now, lease_ns=now,
            **fields,
        )  # fmt: skip

    def adopt(self, record: MemberRecord) -> None:
        """Record that this process owns `record` (its join landed) and start renewing its lease."""
        _OWNED._fresh()
        with _WRITE_LOCK:
            _OWNED.tokens[(*self._file, record.index)] = record.token
            _OWNED.figures[(*self._file, record.index)] = (0, 0, 0)
            self.segment.write_status(record.index, record.token, boottime_ns(), 0, 0, 0)
        self._start_renewer()

    def _disown(self, index: int) -> None:
        _OWNED.tokens.pop((*self._file, index), None)
        _OWNED.figures.pop((*self._file, index), None)

    # ---------------------------------------------------------------------------------------- reading
    def view(self, fresh: bool = False) -> tuple[object, list[MemberRecord], list[MemberRecord]]:
        """(snapshot, live records, kept fenced records); records gone for sure are left out of both. fresh:
        judge every process's liveness now, not from liveness.py's short cache (what a change does)."""
        snap = self.segment.snapshot()
        now, lease = boottime_ns(), self.segment.lease_ns
        live, fenced = [], []
        for r in snap.records:
            verdict = classify(r, now, self.pidns, lease, fresh)
            if r.state == FENCED:
                if verdict != FREE_FENCE and not self.is_mine(r):
                    fenced.append(r)
            elif verdict == DEAD:
                continue
            elif verdict == EXPIRED and not self.is_mine(r):  # running here, so alive: its thread renews it
                r.state, r.fenced_ns, r.granted_bytes, r.min_bytes, r.asked_bytes = FENCED, now, 0, 0, 0
                r.demand_bytes = 0
                fenced.append(r)
            else:
                live.append(r)
        return snap, live, fenced

    def free_index(self) -> int | None:
        """Inside a change: a slot no record holds (fenced ones hold theirs), or None."""
        return next((i for i in range(MAX_MEMBERS) if i not in self._occupied), None)

    def records(self) -> list[MemberRecord]:
        """The live members, as of now (lock-free; nothing written)."""
        return self.view()[1]

    # ---------------------------------------------------------------------------------------- changing
    def transact(self, change: Callable[[list[MemberRecord]], object], actor: int | None = None):
        """Apply `change` to the live records and land it (see the Note); returns what `change` returned.
        actor: a member index this process owns, whose buffers the change may use (else a scratch buffer)."""
        deadline = time.monotonic() + TRANSACTION_S
        claim: tuple[int, int] | None = None
        with _WRITE_LOCK:
            try:
                for attempt in range(1_000_000):
                    snap, live, fenced = self.view(fresh=True)
                    self._occupied = {r.index for r in live + fenced}
                    result = change(live)
                    table = live + fenced
                    payload = pack_table(table, snap.generation + 1)
                    if payload[16:] == snap.body:
                        return result  # nothing to write
                    active = snap.control & 0xFF
                    if actor is not None and self.token_of(actor) is not None:
                        target = 2 * actor + (1 if active == 2 * actor else 0)
                    else:
                        if claim is None:
                            claim = self._claim_scratch(active, deadline)
                        if claim[0] == active:  # it became active by our own earlier landing: take another
                            self._release(claim)
                            claim = self._claim_scratch(active, deadline)
                        target = claim[0]
                    self.segment.check_readable()
                    self.segment.map.write(buffer_offset(target), payload)
                    if before_commit is not None:
                        before_commit()
                    if self.segment.map.cas64(CONTROL_OFFSET, snap.control, ((snap.generation + 1) << 8) | target):
                        self._after_landing(snap.records, table)
                        return result
                    if time.monotonic() > deadline and attempt >= _MIN_TRIES:
                        break
                    time.sleep(random.uniform(0, min(0.02, 0.0002 * 2 ** min(attempt, 7))))
            finally:
                if claim is not None:
                    self._release(claim)
        raise BudgetContentionError(
            f"budget {self.segment.name!r}: a change could not land within {TRANSACTION_S} s (every try found "
            "another change landed first); try again"
        )

    def _after_landing(self, before: list[MemberRecord], after: list[MemberRecord]) -> None:
        kept = {(r.index, r.token) for r in after}
        for r in before:
            if (r.index, r.token) not in kept and self.is_mine(r):
                self._disown(r.index)

    def _claim_scratch(self, active: int, deadline: float) -> tuple[int, int]:
        """(buffer, claim value) of a scratch buffer claimed for one change, not the active one."""
        m = self.segment.map
        while True:
            for k in range(N_SCRATCH):
                buffer = 2 * MAX_MEMBERS + k
                if buffer == active:
                    continue
                offset = CLAIMS_OFFSET + 8 * k
                old, now = m.load64(offset), boottime_ns()
                if (old == 0 or now - old > SCRATCH_GRACE_S * 1e9) and m.cas64(offset, old, now):
                    # Only its claimer makes a scratch buffer active: check it is not active now.
                    if m.load64(CONTROL_OFFSET) & 0xFF != buffer:
                        return buffer, now
                    m.cas64(offset, now, 0)
            if time.monotonic() > deadline:
                raise BudgetContentionError(
                    f"budget {self.segment.name!r}: its {N_SCRATCH} scratch buffers stayed claimed (that many joins "
                    "or limits at once); try again"
                )
            time.sleep(0.001)

    def _release(self, claim: tuple[int, int]) -> None:
        try:
            self.segment.map.cas64(CLAIMS_OFFSET + 8 * (claim[0] - 2 * MAX_MEMBERS), claim[1], 0)
        except Exception:  # a closed mapping: nothing to release
            pass

    # ---------------------------------------------------------------------------------------- status
    def report(self, index: int, mapped: int, live: int, dormant: int) -> bool:
        """Publish member `index`'s figures (and renew its lease); False when this process does not own it."""
        token = self.token_of(index)
        if token is None:
            return False
        with _WRITE_LOCK:
            _OWNED.figures[(*self._file, index)] = (mapped, live, dormant)
            self.segment.write_status(index, token, boottime_ns(), mapped, live, dormant)
        return True

    def renew(self) -> None:
        """Renew the lease of every member this process owns here (the renewing thread calls this)."""
        with _WRITE_LOCK:
            for index in self.owned():
                token = self.token_of(index)
                figures = _OWNED.figures.get((*self._file, index), (0, 0, 0))
                if token is not None:
                    self.segment.write_status(index, token, boottime_ns(), *figures)

    def _start_renewer(self) -> None:
        if self._renewer is not None and self._renewer.is_alive():
            return
        self._stop.clear()
        self._renewer = threading.Thread(
            target=_renew_loop, args=(weakref.ref(self), self._stop), name="vpaged-budget-lease", daemon=True
        )
        self._renewer.start()

    def stop(self) -> None:
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=2 * RENEW_S + 1)


def _renew_loop(ledger_ref, stop: threading.Event) -> None:
    while not stop.wait(RENEW_S):
        ledger = ledger_ref()
        if ledger is None or ledger.segment.closed:
            return
        try:
            if not ledger.owned():
                return
            ledger.renew()
        except BudgetCorruptError:  # a damaged segment: nothing to renew; the calls say so
            return
        finally:
            del ledger
