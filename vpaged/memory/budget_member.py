"""BudgetMembership: a PagePool's place in a SharedBudget — its grant, and giving back while idle.

The pool's C++ limit (`_C.PagePool.set_limit`) is the member's grant in pages: acquire() never goes past it,
so charging happens once per grant change, not per page, and the hot path stays in C++. The ledger is
touched only when the pool needs more than it was granted (grant(), in chunks, so a growing engine asks
rarely) or when another member asks for pages back.

Giving back: each membership runs one daemon thread that polls its record's ask counter in the shared
segment every POLL_S (a read of 8 bytes, no lock) and, when it moves, takes the pool's client_lock (so no
cache call is half done), frees what was asked — free granted pages first, then the pool's Reclaimable
clients' pages (freed slots, evictable prefix blocks; never live K/V) — and lowers the pool's limit and its
grant together. Pages a cache unmaps go back to the pool, whose host backend punches their holes at once,
so the process's RSS falls. A member that is idle (not calling into vpaged) answers within POLL_S plus the
reclaim itself; a busy one answers when its current cache call returns.

Lock order: pool.client_lock, then the membership's lock, then the segment's (never the other way round).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .shared_budget import SharedBudget

if TYPE_CHECKING:
    from .pool import PagePool

POLL_S = 0.02  # how often an idle member looks at its ask counter (the issue asks for an answer within 2 s)
REPORT_S = 0.5  # how often it refreshes its figures (0.1 s cost a busy engine 27% here: the figures take its lock)
IDLE_RELEASE_S = 1.0  # granted pages unused this long go back unasked, beyond GRANT_CHUNK_PAGES of slack
GIVE_BACK_WAIT_S = 3.0  # how long a member that is short waits for the others to answer
FIGURES_S = 0.25  # how long figures() (what /metrics exports) may be reused
GRANT_CHUNK_PAGES = 32  # pages asked beyond the need when growing, so a growing engine rarely asks


@dataclass(frozen=True)
class BudgetFigures:
    """A member's budget at one moment, as a server's /metrics exports it (bytes): the budget's totals, then
    this member's own figures (mapped / live / dormant counted now, the rest as the ledger holds them)."""

    name: str
    share_policy: str
    capacity_bytes: int
    granted_bytes: int  # all members' grants
    reserved_bytes: int  # sum of max(granted, min): what no new grant can take
    members: int
    active_members: int  # holding live K/V or asking for pages (fair_share.py)
    member_index: int
    member_granted_bytes: int
    member_mapped_bytes: int
    member_live_bytes: int
    member_dormant_bytes: int
    member_min_bytes: int
    member_ceiling_bytes: int
    member_fair_share_bytes: int
    member_starved: int  # 1 while asking for pages below its fair share


class BudgetMembership:
    def __init__(self, pool: PagePool, core, budget: str | SharedBudget, min_bytes: int, name: str, model: str):
        """pool: the PagePool joining; core: its C++ pool (thread-safe), whose limit the membership sets."""
        self.budget = budget if isinstance(budget, SharedBudget) else SharedBudget.open(budget)
        self.page_size = pool.page_size
        self._core = core
        self._lock = threading.Lock()
        ceiling = pool.capacity_pages * pool.page_size
        self.index = self.budget.join(
            page_size=pool.page_size, ceiling_bytes=ceiling, min_bytes=min_bytes, name=name, model=model
        )
        self._core.set_limit(0)
        self.min_bytes = -(-int(min_bytes) // self.page_size) * self.page_size
        if self.min_bytes:  # a guaranteed minimum is granted at once where the others have not taken it
            self._add(self.budget.grant(self.index, 0, prefer=min(self.min_bytes, self.budget.headroom(self.index))))
        self._last_ask = 0.0
        self._figures_cache: tuple[float, BudgetFigures | None] | None = None
        self._seen_ask = -1  # the last ask counter answered (by the thread or by answer_pending)
        self._cap_at, self._cap = -1.0, None  # the share policy's admission cap, read at most every POLL_S
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(weakref.ref(pool),), name=f"vpaged-budget-{self.index}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------------------------- growing
    def grow(self, pages: int, wait_s: float = 0.0) -> int:
        """Raise the grant so that `pages` more pages may be taken; returns the pages added. With wait_s, asks
        the others to give back and waits up to that long for them (while any asked member has not
        answered). Takes nothing when it cannot take enough."""
        added = self._grant(pages, ask=wait_s > 0)
        if added or wait_s <= 0:
            return added
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(0.01)
            added = self._grant(pages, ask=False)
            if added:
                return added
            if not self.budget.pending_asks(self.index):
                # Everyone asked has answered: one more ask covers what they freed since, then stop.
                added = self._grant(pages, ask=True)
                if added or not self.budget.pending_asks(self.index):
                    return added
        return 0

    def headroom_pages(self) -> int:
        """Pages the budget would grant now without anyone giving back."""
        return self.budget.headroom(self.index) // self.page_size

    def ask(self, pages: int) -> None:
        """Ask the others to give back `pages` pages (not waiting); grants them at once if they are free. A
        scheduler calls this at every step while short: asks closer than POLL_S apart are one ask."""
        now = time.monotonic()
        if now - self._last_ask < POLL_S:
            self._grant(pages, ask=False)
            return
        self._last_ask = now
        self._grant(pages, ask=True)

    def admission_cap_pages(self) -> int | None:
        """Pages of live K/V this member may hold when it admits new work (the budget's share policy,
        fair_share.py); None: no cap. Read from the ledger at most every POLL_S (a scheduler asks each step)."""
        if not self.budget.policy.caps_admissions:
            return None
        now = time.monotonic()
        if now - self._cap_at >= POLL_S:
            cap = self.budget.admission_cap(self.index)
            self._cap = None if cap is None else cap // self.page_size
            self._cap_at = now
        return self._cap

    def _grant(self, pages: int, ask: bool) -> int:
        ps = self.page_size
        with self._lock:
            short = pages - self._core.free_pages()
            if short <= 0:
                return 0
            if ask:
                got = self.budget.grant(self.index, short * ps, prefer=max(short, GRANT_CHUNK_PAGES) * ps)
            else:
                room = self.budget.headroom(self.index) // ps
                if room < short:
                    return 0
                got = self.budget.grant(self.index, short * ps, prefer=min(room, max(short, GRANT_CHUNK_PAGES)) * ps)
            return self._add(got)

    def _add(self, got: int) -> int:
        if got <= 0:
            return 0
        self._core.set_limit(self._core.limit + got // self.page_size)
        return got // self.page_size

    def figures(self, pool: PagePool) -> BudgetFigures | None:
        """The budget's totals and this member's figures (None when its record is gone), at most FIGURES_S
        old: engine.stats() carries them, and a benchmark that reads stats() at every step paid a locked
        ledger read and a count of reclaimable pages each time (0.65x the steps per second of an engine
        without a budget)."""
        now = time.monotonic()
        if self._figures_cache is not None and now - self._figures_cache[0] < FIGURES_S:
            return self._figures_cache[1]
        figures = self._read_figures(pool)
        self._figures_cache = (now, figures)
        return figures

    def _read_figures(self, pool: PagePool) -> BudgetFigures | None:
        state = self.budget.state()
        me = next((m for m in state.members if m.index == self.index and m.pid == os.getpid()), None)
        if me is None:
            return None
        mapped, live, dormant = self._figures(pool)
        return BudgetFigures(
            state.name, state.share_policy, state.capacity_bytes, state.granted_bytes, state.reserved_bytes,
            len(state.members), state.active_members, self.index, me.granted_bytes, mapped, live, dormant,
            me.min_bytes, me.ceiling_bytes, me.fair_share_bytes, int(me.starved),
        )  # fmt: skip

    # ------------------------------------------------------------------------------------- giving back
    def answer_pending(self, pool: PagePool) -> int:
        """Answer an ask that this member's thread has not handled yet, now, from the caller's thread (a
        scheduler calls this between steps, where no cache call is under way); returns the pages given back.
        A busy engine's main thread re-takes the pool's client lock between cache calls at once, so the
        thread alone may wait for it for many steps (measured: a starved engine sat 11 s below its fair
        share while the other engine's dormant pages went unclaimed)."""
        seq = self.budget.segment.peek_ask_seq(self.index)
        if seq == self._seen_ask:
            return 0
        self._seen_ask = seq
        return self.give_back(pool)

    def _serve(self, pool_ref) -> None:
        last_report, slack_since = 0.0, None
        while not self._stop.wait(POLL_S):
            pool = pool_ref()
            if pool is None:
                return
            try:
                now = time.monotonic()
                if self.budget.segment.peek_ask_seq(self.index) != self._seen_ask:
                    self.answer_pending(pool)
                    last_report = now
                elif now - last_report > REPORT_S:
                    # Granted pages nobody uses go back unasked after a while (no cache is touched: only the
                    # pool's limit), so that a member that grows finds them free without asking anyone.
                    slack = self._core.free_pages() > GRANT_CHUNK_PAGES
                    slack_since = (slack_since or now) if slack else None
                    if slack_since is not None and now - slack_since >= IDLE_RELEASE_S:
                        self._release_unused(pool)
                        slack_since = None
                    else:
                        self._report(pool)
                    last_report = now
            except Exception:  # a closed or removed segment: the member keeps its pool and stops serving
                if self._stop.is_set():
                    return
                time.sleep(REPORT_S)
            finally:
                del pool

    def give_back(self, pool: PagePool) -> int:
        """Answer the asks on this member: free up to the bytes asked (and down to the ceiling), lower the
        grant; returns the pages given back."""
        ps = self.page_size
        with pool.client_lock, self._lock:
            me = self.budget.member(self.index)
            if me is None:
                return 0
            limit = self._core.limit
            want = max(-(-me.asked_bytes // ps), limit - me.ceiling_bytes // ps)  # asked, or over the ceiling
            if want > self._core.free_pages():
                pool.reclaim_clients(want - self._core.free_pages())
            pool.trim()
            new_limit = self._core.set_limit(max(0, limit - want))  # clamped to the pages in use
            mapped, live, dormant = self._figures(pool)
            self.budget.give_back(self.index, new_limit * ps, mapped, live, dormant)
            return limit - new_limit

    def _release_unused(self, pool: PagePool) -> None:
        with self._lock:
            used = self._core.limit - self._core.free_pages()
            new_limit = self._core.set_limit(used + GRANT_CHUNK_PAGES)
            figures = self._figures(pool, lock=False)
            self.budget.give_back(self.index, new_limit * self.page_size, *figures, answer=False)

    def _report(self, pool: PagePool) -> None:
        if pool.client_lock.acquire(blocking=False):  # a busy member reports at its next quiet moment
            try:
                self.budget.report(self.index, *self._figures(pool))
            finally:
                pool.client_lock.release()

    def _figures(self, pool: PagePool, lock: bool = True) -> tuple[int, int, int]:
        """(mapped, live, dormant) bytes; lock=False: without the client lock, dormant as last reported."""
        ps = self.page_size
        mapped = pool.stats().used_pages * ps
        if not lock:
            me = self.budget.member(self.index)
            dormant = min(mapped, me.dormant_bytes if me else 0)
        else:
            dormant = min(mapped, pool.reclaimable_pages() * ps)
        return mapped, mapped - dormant, dormant

    # ------------------------------------------------------------------------------------- leaving
    def close(self) -> None:
        """Leave the budget (the grant returns to it) and stop the thread."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * POLL_S + 1)
        try:
            self.budget.leave(self.index)
        finally:
            self.budget.close()
