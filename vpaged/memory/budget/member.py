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

Ceilings: a ceiling lowered below what a busy member holds (`vpaged budget limit`) cannot be met at once
(live K/V is never taken). From then on, while its limit is above the ceiling, the member takes no new
grant, admits no new request past the ceiling (admission_cap_pages), lets its running requests finish on
what it holds, and as soon as its live K/V fits under the ceiling frees its reusable pages and lowers its
limit to it: at each of its scheduler's steps (answer_pending) and every POLL_S on its thread, which reads
its ceiling from the ledger every REPORT_S. So it is down to its ceiling within one report period after its
requests finish.

Health (health.py): the thread also looks, every REPORT_S, whether the segment at the budget's path is
still the one it joined. Removed: the member says so (health(), GET /health 503) and keeps what it holds.
Replaced by a budget created again under the same name: it joins the new one with the same name, minimum and
ceiling, has what its pool holds granted there (shrinking to what it uses when the new budget is short), and
leaves the old one. A ledger call that fails with a BudgetError (a damaged or truncated segment) marks the
member "corrupt" and grants nothing; the pool keeps serving from what it holds.

CUDA graph captures (the pool's capture_running(): memory/capture.py): while one runs, a member asked to give
back gives its free pages only (no cache is asked to unmap: any thread's unmap would invalidate the capture;
the asker, still short, asks again), and every lowered limit keeps its device release pending in the pool
until the capture ended.

Lock order: pool.client_lock, then the membership's lock, then the segment's (never the other way round).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from ...errors import BudgetError
from .health import OK, STALL_S, BudgetHealth, verdict
from .segment import segment_path
from .shared import SharedBudget

POLL_S = 0.02  # how often an idle member looks at its ask counter (the issue asks for an answer within 2 s)
REPORT_S = 0.5  # how often it refreshes its figures (0.1 s cost a busy engine 27% here: the figures take its lock)
IDLE_RELEASE_S = 1.0  # granted pages unused this long go back unasked, beyond GRANT_CHUNK_PAGES of slack
GIVE_BACK_WAIT_S = 3.0  # how long a member that is short waits for the others to answer
FIGURES_S = 0.25  # how long figures() (what /metrics exports) may be reused
GRANT_CHUNK_PAGES = 32  # pages asked beyond the need when growing, so a growing engine rarely asks
_FAILED = object()  # what a guarded ledger read gives when it failed


class ClientLock(Protocol):
    """The lock a pool's clients hold around each call that changes their mappings (re-entrant)."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...

    def __enter__(self) -> bool: ...

    def __exit__(self, *exc: object) -> None: ...


class PageCounts(Protocol):
    """A pool's page counts at one moment (memory/pool.py's PoolStats is one)."""

    @property
    def used_pages(self) -> int: ...


@runtime_checkable
class GrantedPool(Protocol):
    """What a membership sees of the pool whose grant it keeps: only what it reads and calls. memory/pool.py's
    PagePool is one; this package never imports it (the pool imports the budget, not the other way round)."""

    @property
    def page_size(self) -> int: ...

    @property
    def capacity_pages(self) -> int: ...

    @property
    def client_lock(self) -> ClientLock: ...

    def stats(self) -> PageCounts: ...

    def reclaimable_pages(self) -> int:
        """Pages the pool's clients keep only for reuse and would give back."""

    def reclaim_clients(self, pages: int) -> int:
        """Have the clients unmap reusable pages until `pages` are freed; returns the pages freed."""

    def trim(self) -> int:
        """Give the memory of the free pages back to the system."""

    def capture_running(self) -> bool:
        """Whether a CUDA graph capture runs (no cache may unmap then; releases wait for its end)."""


@runtime_checkable
class GrantedCore(Protocol):
    """The pool's page allocator (vpaged._C.PagePool): its limit is the member's grant, in pages."""

    @property
    def limit(self) -> int: ...

    def set_limit(self, pages: int) -> int:
        """Set the limit, clamped to [pages in use, capacity]; returns the limit set."""

    def free_pages(self) -> int: ...


@dataclass(frozen=True)
class BudgetFigures:
    """A member's budget at one moment, as a server's /metrics exports it (bytes): the budget's totals, then
    this member's own figures (mapped / live / dormant counted now, the rest as the ledger holds them). ok is
    0 while the budget is unusable or the member waits on others (problem says why; the other figures are
    then the last ones read)."""

    name: str
    share_policy: str
    capacity_bytes: int
    granted_bytes: int  # all members' grants
    reserved_bytes: int  # sum of max(granted, min): what no new grant can take
    members: int
    active_members: int  # holding live K/V or asking for pages (policy.py)
    member_index: int
    member_granted_bytes: int
    member_mapped_bytes: int
    member_live_bytes: int
    member_dormant_bytes: int
    member_min_bytes: int
    member_ceiling_bytes: int
    member_fair_share_bytes: int
    member_starved: int  # 1 while asking for pages below its fair share
    ok: int = 1  # 1 while the budget is the one joined and readable, and no wait on another member lasts
    problem_kind: str = "ok"  # health.KINDS
    problem: str = ""  # the cause, in words


class BudgetMembership:
    def __init__(
        self, pool: GrantedPool, core: GrantedCore, budget: str | SharedBudget, min_bytes: int, name: str, model: str
    ):
        """pool: the pool joining (a PagePool); core: its C++ pool (thread-safe), whose limit the membership sets."""
        self.budget = budget if isinstance(budget, SharedBudget) else SharedBudget.open(budget)
        self.page_size = pool.page_size
        self._core = core
        self._lock = threading.Lock()
        self.member_name, self.model = name, model  # kept to join a budget created again under the same name
        self._ceiling_bytes = pool.capacity_pages * pool.page_size  # as asked at join; then as the ledger holds it
        self.index = self.budget.join(
            page_size=pool.page_size, ceiling_bytes=self._ceiling_bytes, min_bytes=min_bytes, name=name, model=model
        )
        self._core.set_limit(0)
        self.min_bytes = -(-int(min_bytes) // self.page_size) * self.page_size
        if self.min_bytes:  # a guaranteed minimum is granted at once where the others have not taken it
            self._add(self.budget.grant(self.index, 0, prefer=min(self.min_bytes, self.budget.headroom(self.index))))
        self._last_ask = 0.0
        self._figures_cache: tuple[float, BudgetFigures | None] | None = None
        self._last_figures: BudgetFigures | None = None
        self._seen_ask = -1  # the last ask counter answered (by the thread or by answer_pending)
        self._cap_at, self._cap = -1.0, None  # the share policy's admission cap, read at most every POLL_S
        self._health: BudgetHealth = OK
        self._over_ceiling = False  # the limit is above the ledger's ceiling: lowered as pages free
        self._short_since: float | None = None  # since when grants are refused (cleared by a grant)
        self._short_at = 0.0  # the last refused grant
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(weakref.ref(pool),), name=f"vpaged-budget-{self.index}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------------------------- health
    def health(self) -> BudgetHealth:
        """Whether the budget is the one joined and usable (health.py); read without a lock."""
        return self._health

    def _set_health(self, kind: str, detail: str = "") -> None:
        self._health = verdict(kind, self.budget.name, detail, self._health)

    def _guarded(self, default, fn, *args, **kwargs):
        """fn(*args) on the ledger; a damaged or vanished segment marks the member "corrupt" and gives
        `default` (a member never fails its pool's callers for the ledger's sake)."""
        try:
            return fn(*args, **kwargs)
        except (BudgetError, OSError, ValueError) as e:  # ValueError: a closed or cut mapping
            self._set_health("corrupt", f"{type(e).__name__}: {e}")
            return default

    def _peek_ask(self) -> int:
        try:
            return self.budget.segment.peek_ask_seq(self.index)
        except (BudgetError, OSError, ValueError, IndexError):
            return self._seen_ask

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
            if not self._guarded(False, self.budget.pending_asks, self.index):
                # Everyone asked has answered: one more ask covers what they freed since, then stop.
                added = self._grant(pages, ask=True)
                if added or not self._guarded(False, self.budget.pending_asks, self.index):
                    return added
        return 0

    def headroom_pages(self) -> int:
        """Pages the budget would grant now without anyone giving back."""
        if self._over_ceiling or not self._health.serves:
            return 0
        return self._guarded(0, self.budget.headroom, self.index) // self.page_size

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
        policy.py), and at most its ceiling while its limit is above it (running requests keep what they
        hold; nothing new is admitted past the ceiling); None: no cap. Read from the ledger at most every
        POLL_S (a scheduler asks each step)."""
        if self._over_ceiling:
            return self._ceiling_bytes // self.page_size
        if not self.budget.policy.caps_admissions:
            return None
        now = time.monotonic()
        if now - self._cap_at >= POLL_S:
            cap = self._guarded(None, self.budget.admission_cap, self.index)
            self._cap = None if cap is None else cap // self.page_size
            self._cap_at = now
        return self._cap

    def _grant(self, pages: int, ask: bool) -> int:
        ps = self.page_size
        with self._lock:
            short = pages - self._core.free_pages()
            if short <= 0:
                self._short_since = None
                return 0
            if self._over_ceiling or not self._health.serves:  # above its ceiling, or no usable budget
                return 0
            if ask:
                got = self._guarded(0, self.budget.grant, self.index, short * ps, max(short, GRANT_CHUNK_PAGES) * ps)
            else:
                room = self._guarded(0, self.budget.headroom, self.index) // ps
                got = 0
                if room >= short:
                    prefer = min(room, max(short, GRANT_CHUNK_PAGES)) * ps
                    got = self._guarded(0, self.budget.grant, self.index, short * ps, prefer)
            if got > 0:
                self._short_since = None
            else:
                self._short_at = time.monotonic()
                self._short_since = self._short_since or self._short_at
            return self._add(got)

    def _add(self, got: int) -> int:
        if got <= 0:
            return 0
        self._core.set_limit(self._core.limit + got // self.page_size)
        return got // self.page_size

    def label(self, model: str) -> None:
        """Name the model this member serves, as `vpaged budget show` lists it (kept for a rejoin too)."""
        self.model = str(model)
        self._guarded(None, self.budget.label, self.index, self.model)

    def figures(self, pool: GrantedPool) -> BudgetFigures | None:
        """The budget's totals and this member's figures (None when its record is gone and the budget is
        well), at most FIGURES_S old: engine.stats() carries them, and a benchmark that reads stats() at every
        step paid a locked ledger read and a count of reclaimable pages each time (0.65x the steps per second
        of an engine without a budget). While the budget is unusable: the last figures read, ok=0 and why."""
        now = time.monotonic()
        if self._figures_cache is None or now - self._figures_cache[0] >= FIGURES_S:
            figures = self._guarded(None, self._read_figures, pool) if self._health.serves else None
            self._last_figures = figures or self._last_figures
            self._figures_cache = (now, figures)
        figures, health = self._figures_cache[1], self._health
        if health.ok:
            return figures
        base = figures or self._last_figures or self._empty_figures()
        return replace(base, ok=0, problem_kind=health.kind, problem=health.message)

    def _empty_figures(self) -> BudgetFigures:
        ceiling, ps = self._ceiling_bytes, self.page_size
        return BudgetFigures(
            self.budget.name, self.budget.policy.name, 0, 0, 0, 0, 0, self.index, self._core.limit * ps, 0, 0, 0,
            self.min_bytes, ceiling, 0, 0,
        )  # fmt: skip

    def _read_figures(self, pool: GrantedPool) -> BudgetFigures | None:
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
    def answer_pending(self, pool: GrantedPool) -> int:
        """Answer an ask that this member's thread has not handled yet, now, from the caller's thread (a
        scheduler calls this between steps, where no cache call is under way), and lower the limit towards
        the ceiling while it is above it; returns the pages given back. A busy engine's main thread re-takes
        the pool's client lock between cache calls at once, so the thread alone may wait for it for many
        steps (measured: a starved engine sat 11 s below its fair share while the other engine's dormant
        pages went unclaimed)."""
        given = 0
        seq = self._peek_ask()
        if seq != self._seen_ask:
            self._seen_ask = seq
            given = self.give_back(pool)
        if self._over_ceiling:
            given += self._shrink_to_ceiling(pool)
        return given

    def _serve(self, pool_ref) -> None:
        last_report, last_check, slack_since = 0.0, 0.0, None
        while not self._stop.wait(POLL_S):
            pool = pool_ref()
            if pool is None:
                return
            try:
                now = time.monotonic()
                if now - last_check >= REPORT_S:
                    last_check = now
                    self._check(pool)
                if self._peek_ask() != self._seen_ask:
                    self.answer_pending(pool)
                    last_report = now
                elif self._over_ceiling:
                    self._shrink_to_ceiling(pool, blocking=False)  # a busy pool: answer_pending does it
                elif now - last_report > REPORT_S and self._health.serves:
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
            except Exception:  # noqa: BLE001 - whatever happens, the thread keeps watching the budget
                if self._stop.is_set():
                    return
                time.sleep(REPORT_S)
            finally:
                del pool

    def give_back(self, pool: GrantedPool) -> int:
        """Answer the asks on this member: free up to the bytes asked (and down to the ceiling), lower the
        grant; returns the pages given back."""
        ps = self.page_size
        with pool.client_lock, self._lock:
            me = self._guarded(None, self.budget.member, self.index)
            if me is None:
                return 0
            self._ceiling_bytes = me.ceiling_bytes
            limit, ceiling = self._core.limit, me.ceiling_bytes // ps
            want = max(-(-me.asked_bytes // ps), limit - ceiling)  # asked, or over the ceiling
            if limit > ceiling and self._live_pages(pool) > ceiling:
                want = 0  # its running requests keep what they hold (the ask is the ceiling's): see the module
            if want > self._core.free_pages() and not pool.capture_running():  # during a capture: free pages only
                pool.reclaim_clients(want - self._core.free_pages())
            pool.trim()
            new_limit = self._core.set_limit(max(0, limit - want))  # clamped to the pages in use
            self._over_ceiling = new_limit > ceiling  # busy: lowered as its requests finish
            mapped, live, dormant = self._figures(pool)
            self._guarded(None, self.budget.give_back, self.index, new_limit * ps, mapped, live, dormant)
            return limit - new_limit

    def _shrink_to_ceiling(self, pool: GrantedPool, blocking: bool = True) -> int:
        """Lower the limit towards the ceiling by what is free now (the clients' reusable pages first freed),
        and the grant with it; returns the pages given back."""
        if not pool.client_lock.acquire(blocking=blocking):
            return 0
        try:
            with self._lock:
                ps, limit = self.page_size, self._core.limit
                ceiling = self._ceiling_bytes // ps
                if limit <= ceiling:
                    self._over_ceiling = False
                    return 0
                if self._live_pages(pool) > ceiling:  # its running requests keep what they hold meanwhile
                    return 0
                if self._core.free_pages() < limit - ceiling and not pool.capture_running():
                    pool.reclaim_clients(limit - ceiling - self._core.free_pages())
                new_limit = self._core.set_limit(ceiling)  # clamped to the pages in use
                self._over_ceiling = new_limit > ceiling
                if new_limit == limit:
                    return 0
                pool.trim()
                mapped, live, dormant = self._figures(pool)
                self._guarded(
                    None, self.budget.give_back, self.index, new_limit * ps, mapped, live, dormant, answer=False
                )
                return limit - new_limit
        finally:
            pool.client_lock.release()

    @staticmethod
    def _live_pages(pool: GrantedPool) -> int:
        return pool.stats().used_pages - pool.reclaimable_pages()

    def _release_unused(self, pool: GrantedPool) -> None:
        # Only the limit changes here (no cache is touched); during a CUDA graph capture the pool keeps the
        # release of the pages beyond it pending until the capture ended (memory/capture.py).
        with self._lock:
            used = self._core.limit - self._core.free_pages()
            new_limit = self._core.set_limit(used + GRANT_CHUNK_PAGES)
            figures = self._figures(pool, lock=False)
            self._guarded(None, self.budget.give_back, self.index, new_limit * self.page_size, *figures, answer=False)

    def _report(self, pool: GrantedPool) -> None:
        if pool.client_lock.acquire(blocking=False):  # a busy member reports at its next quiet moment
            try:
                self._guarded(None, self.budget.report, self.index, *self._figures(pool))
            finally:
                pool.client_lock.release()

    def _figures(self, pool: GrantedPool, lock: bool = True) -> tuple[int, int, int]:
        """(mapped, live, dormant) bytes; lock=False: without the client lock, dormant as last reported."""
        ps = self.page_size
        mapped = pool.stats().used_pages * ps
        if not lock:
            me = self._guarded(None, self.budget.member, self.index)
            dormant = min(mapped, me.dormant_bytes if me else 0)
        else:
            dormant = min(mapped, pool.reclaimable_pages() * ps)
        return mapped, mapped - dormant, dormant

    # ------------------------------------------------------------------------------------- watching the budget
    def _check(self, pool: GrantedPool) -> None:
        """Every REPORT_S, on the thread: is the segment at the path the one joined, is this member's record in
        it, what is its ceiling, and does a wait on other members last (health() tells)."""
        status = self._guarded(None, self.budget.check)  # the open file against the path, header and table
        if status is None:
            return  # the check itself failed: health() says why
        if status.state == "removed":
            self._set_health("removed")
            return
        if status.state == "replaced":
            self._rejoin(pool, same_file=False)
            return
        if status.state == "corrupt":
            self._set_health("corrupt", status.message)
            return
        me = self._guarded(_FAILED, self.budget.member, self.index)
        if me is _FAILED:
            return  # the ledger cannot be read: health() says why
        if me is None:  # dropped from a budget that is well (e.g. stopped past its lease): join it again
            self._rejoin(pool, same_file=True)
            return
        self._ceiling_bytes = me.ceiling_bytes
        self._over_ceiling = self._core.limit > me.ceiling_bytes // self.page_size
        now = time.monotonic()
        stalled = self._short_since is not None and now - self._short_since >= STALL_S
        if stalled and now - self._short_at < 2 * REPORT_S:
            state = self._guarded(None, self.budget.state)
            waited = [m for m in (state.members if state else ()) if m.index != self.index and m.asked_bytes > 0]
            if waited:
                names = ", ".join(f"member {m.index} (pid {m.pid}, name {m.name!r})" for m in waited)
                self._set_health("waiting", f"for {now - self._short_since:.1f} s, asked {names} to give back")
                return
        self._set_health("ok")

    def _rejoin(self, pool: GrantedPool, same_file: bool) -> None:
        """Join the budget now at the path (created again, or one that dropped this member's record) with the
        same name, minimum and ceiling; have what the pool holds granted there (shrunk to the pages in use
        when it is short), then leave the old one. Until it can: health() says "replaced"."""
        name, ps = self.budget.name, self.page_size
        try:
            new = SharedBudget.open(name)
        except BudgetError as e:
            self._set_health("removed" if not os.path.exists(segment_path(name)) else "replaced", str(e))
            return
        with pool.client_lock, self._lock:
            try:
                index = new.join(
                    page_size=ps, ceiling_bytes=self._ceiling_bytes, min_bytes=self.min_bytes,
                    name=self.member_name, model=self.model,
                )  # fmt: skip
                keep = max(self._core.limit * ps, self.min_bytes)
                used = pool.stats().used_pages * ps
                got = new.grant(index, used, prefer=keep)
                if got <= 0 and used:  # the new budget is short: keep only the pages in use, ask again
                    if not pool.capture_running():
                        pool.reclaim_clients(pool.reclaimable_pages())
                    pool.trim()
                    used = pool.stats().used_pages * ps
                    got = new.grant(index, used, prefer=used)
                if got <= 0 and used:
                    new.leave(index)
                    raise BudgetError(f"it cannot grant the {used} bytes this member's pages use (others hold them)")
            except (BudgetError, OSError, ValueError) as e:
                new.close()
                self._set_health("replaced", f"joining it again failed: {e}; retrying every {REPORT_S} s")
                return
            old, old_index = self.budget, self.index
            self.budget, self.index = new, index
            self._core.set_limit(max(0, got) // ps)  # clamped to the pages in use
            self._seen_ask, self._cap_at, self._figures_cache = -1, -1.0, None
            self._over_ceiling = self._core.limit > self._ceiling_bytes // ps
            self._short_since = None
        with contextlib.suppress(Exception):
            if not same_file:  # the old file: nobody else counts with it; its index may be ours again here
                old.leave(old_index)
            old.close()
        self._set_health("ok")

    # ------------------------------------------------------------------------------------- leaving
    def close(self) -> None:
        """Leave the budget (the grant returns to it) and stop the thread."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * POLL_S + 1)
        try:
            self._guarded(None, self.budget.leave, self.index)  # the file it has open (removed or not)
        finally:
            with contextlib.suppress(Exception):
                self.budget.close()
