"""The client table of a page store: one record per process that has the store open, with its lease.

Note (why every process has a record). Pins and half-written slots belong to processes, and a process may die
at any instruction. So each process that opens a store takes a client record (one of MAX_CLIENTS) first; its
index is the bit it sets in a slot's pin word and the owner it writes into a slot it is writing (index.py).
When it dies, a reclaimer (reclaim.py) clears its bit in every pin word and frees its half-written slots
before the record can be taken again: the record is what makes a dead process's share findable.

A record's state word (one 64-bit word, moved only by compare-and-swap): kind in the low 3 bits, a value above
them. FREE (0); JOINING (value: boottime ns of the claim) while the joiner writes its pid, start time, PID
namespace and boot; LIVE (value: a random token of that join); FENCED (value: boottime ns) once its lease ran
out and it could not be seen dead: its pins were dropped, its WRITING slots are kept (it may still be writing
their bytes) until it is seen dead or FENCE_GRACE_S pass; RECLAIMING (value: boottime ns) while a reclaimer
clears what it held. A claim (JOINING, RECLAIMING) older than CLAIM_GRACE_S was cut by a kill and may be
taken over.

Liveness is the shared budget's (memory/budget/liveness.py): a process of this PID namespace that is gone (its
pid's start time differs, or it is a zombie) is dead at once; a record of another boot (boot id differs) is
dead; otherwise its lease (renewed every RENEW_S by the owner's thread) must be younger than the store's lease.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass

from ..budget.liveness import boottime_ns, is_gone, pid_namespace, process_start_ticks
from .layout import CLIENT_BYTES, CLIENTS_OFFSET, MAX_CLIENTS, client_offset

FREE, JOINING, LIVE, FENCED, RECLAIMING = 0, 1, 2, 3, 4
KIND_NAMES = {FREE: "free", JOINING: "joining", LIVE: "live", FENCED: "fenced", RECLAIMING: "reclaiming"}
_VALUE_MASK = (1 << 61) - 1

RENEW_S = 0.25  # the owner's thread renews its lease (and runs a reclaim pass) this often
CLAIM_GRACE_S = 120.0  # a JOINING or RECLAIMING claim older than this was cut by a kill
FENCE_GRACE_S = 600.0  # a fenced record's WRITING slots are freed after this long even if it cannot be seen dead

# state, pid, start ticks, pid namespace, boot, lease ns, pinned slots, opened ns
_RECORD = struct.Struct("<QQQQQQQQ")
assert _RECORD.size == CLIENT_BYTES
_LEASE_AT, _PINNED_AT = 40, 48


def word(kind: int, value: int) -> int:
    return ((value & _VALUE_MASK) << 3) | kind


def kind_of(state: int) -> int:
    return state & 7


def value_of(state: int) -> int:
    return state >> 3


_BOOT: int | None = None


def boot_id() -> int:
    """A 63-bit id of this boot of the machine (0 where the kernel does not say): a record of another boot
    is dead, whatever its lease says (CLOCK_BOOTTIME starts again at a reboot)."""
    global _BOOT
    if _BOOT is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", "rb") as f:
                raw = f.read().strip()
            _BOOT = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1
        except OSError:
            _BOOT = 0
    return _BOOT


@dataclass(frozen=True)
class ClientRecord:
    index: int
    state: int
    pid: int
    start_ticks: int
    pidns: int
    boot: int
    lease_ns: int
    pinned: int
    opened_ns: int

    @property
    def kind(self) -> int:
        return kind_of(self.state)

    @classmethod
    def unpack(cls, index: int, raw: bytes, at: int) -> ClientRecord:
        return cls(index, *_RECORD.unpack_from(raw, at))


DEAD, EXPIRED, ALIVE = "dead", "expired", "alive"


def verdict(r: ClientRecord, now_ns: int, my_pidns: int, lease_ns: int) -> str:
    """DEAD (gone for sure), EXPIRED (its lease ran out, it cannot be seen dead) or ALIVE, for a LIVE or FENCED
    record."""
    if r.boot != boot_id() or r.lease_ns > now_ns + lease_ns:
        return DEAD  # written in another boot (or its clock is from one)
    if my_pidns != 0 and r.pidns == my_pidns and is_gone(r.pid, r.start_ticks, fresh=True):
        return DEAD
    if now_ns - r.lease_ns > lease_ns:
        return EXPIRED
    return ALIVE


class ClientTable:
    """The client records of one open store's index mapping."""

    def __init__(self, mapping, lease_ns: int):
        self.map, self.lease_ns = mapping, lease_ns
        self.pidns = pid_namespace()

    def records(self) -> list[ClientRecord]:
        raw = self.map.read(CLIENTS_OFFSET, MAX_CLIENTS * CLIENT_BYTES)
        return [ClientRecord.unpack(i, raw, i * CLIENT_BYTES) for i in range(MAX_CLIENTS)]

    def state(self, index: int) -> int:
        return self.map.load64(client_offset(index))

    def cas(self, index: int, old: int, new: int) -> bool:
        return self.map.cas64(client_offset(index), old, new)

    def join(self) -> tuple[int, int] | None:
        """(index, LIVE state word) of a record claimed for this process, or None when every record is taken."""
        for index in range(MAX_CLIENTS):
            if self.state(index) != FREE:
                continue
            claim = word(JOINING, boottime_ns())
            if not self.cas(index, FREE, claim):
                continue
            now = boottime_ns()
            fields = (claim, os.getpid(), process_start_ticks("self") or 0, self.pidns, boot_id(), now, 0, now)
            self.map.write(client_offset(index) + 8, _RECORD.pack(*fields)[8:])
            live = word(LIVE, int.from_bytes(os.urandom(8), "little") | 1)
            if self.cas(index, claim, live):
                return index, live
        return None

    def renew(self, index: int, live: int) -> bool:
        """Renew this process's lease; False when its record is no longer its own (fenced, reclaimed)."""
        if self.state(index) != live:
            return False
        self.map.store64(client_offset(index) + _LEASE_AT, boottime_ns())
        return self.state(index) == live

    def set_pinned(self, index: int, count: int) -> None:
        self.map.store64(client_offset(index) + _PINNED_AT, count)
