"""The reclaimer: what a dead (or fenced) process held in a page store goes back.

Note (when and how). Every open store runs a pass every clients.RENEW_S (its lease thread), at open, and when
a publish finds no slot. A pass reads the client table and, for each other record:

- LIVE and dead for sure (clients.verdict): claim it (LIVE -> RECLAIMING by compare-and-swap, so one
  reclaimer acts), clear its bit in every pin word, give back its slots (WRITING -> FREE: the page was never
  visible; EVICTING -> PUBLISHED: it was, and stays), then free the record. A reclaimer killed midway leaves
  RECLAIMING, which another pass takes over after clients.CLAIM_GRACE_S; every step may be repeated.
- LIVE with its lease run out (stopped, or in a PID namespace where it cannot be seen dead): fence it (LIVE ->
  FENCED) and drop its pins, so its pages can be evicted; keep its WRITING slots, since it may still be
  writing their bytes, until it is seen dead or clients.FENCE_GRACE_S pass.
- JOINING or RECLAIMING older than clients.CLAIM_GRACE_S: a claim cut by a kill; reclaimed as above.

So a reader killed while pinning pages has its pins back within one pass (a fraction of a second) of its
death, as seen by any process with the store open in its PID namespace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..budget.liveness import boottime_ns
from . import clients as cl
from . import index as ix
from .stats import Counters


@dataclass
class ReclaimCounts:
    clients: int = 0  # records freed
    fenced: int = 0  # records fenced
    pins: int = 0  # pin bits cleared
    writing: int = 0  # WRITING slots freed
    evicting: int = 0  # EVICTING slots put back


def reclaim_pass(
    clients: cl.ClientTable, slots: ix.SlotTable, counters: Counters, me: int | None, lease_ns: int
) -> ReclaimCounts:
    out = ReclaimCounts()
    now = boottime_ns()
    for r in clients.records():
        if r.index == me or r.kind == cl.FREE:
            continue
        if r.kind in (cl.JOINING, cl.RECLAIMING):
            claimed = cl.value_of(r.state)
            if claimed > now or now - claimed > cl.CLAIM_GRACE_S * 1e9:
                _reclaim(clients, slots, r, out)
            continue
        verdict = cl.verdict(r, now, clients.pidns, lease_ns)
        if verdict == cl.DEAD:
            _reclaim(clients, slots, r, out)
        elif r.kind == cl.LIVE and verdict == cl.EXPIRED:
            if clients.cas(r.index, r.state, cl.word(cl.FENCED, now)):
                out.fenced += 1
                out.pins += clear_pins(slots, r.index)
        elif r.kind == cl.FENCED and now - cl.value_of(r.state) > cl.FENCE_GRACE_S * 1e9:
            _reclaim(clients, slots, r, out)
    for name, n in (
        ("reclaimed_clients", out.clients), ("fenced_clients", out.fenced), ("reclaimed_pins", out.pins),
        ("reclaimed_writing", out.writing),
    ):  # fmt: skip
        if n:
            counters.add(name, n)
    return out


def _reclaim(clients: cl.ClientTable, slots: ix.SlotTable, r: cl.ClientRecord, out: ReclaimCounts) -> None:
    claim = cl.word(cl.RECLAIMING, boottime_ns())
    if not clients.cas(r.index, r.state, claim):
        return  # another reclaimer (or the process itself) moved it first
    out.pins += clear_pins(slots, r.index)
    writing, evicting = release_slots(slots, r.index)
    out.writing += writing
    out.evicting += evicting
    if clients.cas(r.index, claim, cl.FREE):
        out.clients += 1


def clear_pins(slots: ix.SlotTable, index: int) -> int:
    """Clear client `index`'s bit in every pin word; how many were set."""
    bit = 1 << index
    snap = slots.snapshot()
    cleared = 0
    for slot in np.flatnonzero(snap["pins"] & np.uint64(bit)):
        cleared += slots.clear_pin(int(slot), bit)
    return cleared


def release_slots(slots: ix.SlotTable, index: int) -> tuple[int, int]:
    """Give back the slots client `index` was writing (-> FREE) or evicting (-> PUBLISHED, as it was):
    (written freed, evictions undone)."""
    snap = slots.snapshot()
    states = snap["state"]
    kinds = states & np.uint64(3)
    owners = (states >> np.uint64(2)) & np.uint64(63)
    writing = evicting = 0
    for slot in np.flatnonzero((owners == index) & ((kinds == ix.WRITING) | (kinds == ix.EVICTING))):
        slot = int(slot)
        state = slots.state(slot)  # the snapshot's word may be old; only the owner (dead) moves these
        if ix.owner_of(state) != index:
            continue
        generation = ix.generation_of(state)
        if ix.kind_of(state) == ix.WRITING:
            writing += slots.cas(slot, state, ix.word(ix.FREE, 0, generation + 1))
        elif ix.kind_of(state) == ix.EVICTING:
            evicting += slots.cas(slot, state, ix.word(ix.PUBLISHED, 0, generation))
    return writing, evicting
