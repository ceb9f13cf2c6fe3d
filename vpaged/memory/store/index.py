"""The slot table of a page store: one record per data page, whose state word makes a page visible.

Note (the state machine). Slot i's record describes data page i. Its state word (64 bits, moved only by
compare-and-swap) holds a kind in bits 0-1, an owner (a client index, clients.py) in bits 2-7 and a generation
in bits 8-63:

    FREE(g) --reserve--> WRITING(g+1, me) --publish--> PUBLISHED(g+2) --evict--> EVICTING(g+2, me)
       ^                     |  abort, or reclaimed                                 |   pins found: back to
       +---------------------+  (owner dead)                                        |   PUBLISHED(g+2)
                                                   WRITING(g+3, me) <---------------+   no pins

Only the owner of a WRITING slot writes its key, its data page and its checksums, and only while WRITING; a
page becomes visible by the one compare-and-swap WRITING -> PUBLISHED, after its bytes and checksums are
written, so no reader ever finds a half-written page, and a publisher killed before it leaves a WRITING slot
that the reclaimer frees (its owner is dead): nothing visible, nothing leaked. A PUBLISHED page never changes.
EVICTING keeps the published generation, so a reverted eviction gives back the very word readers pinned.

The pin word is a bitmap of the clients that pin the page (a process counts its own pins in its memory). A
reader pins by setting its bit and then re-reading the state word; an evictor moves the state to EVICTING and
then re-reads the pin word. Both use sequentially consistent atomics, so at least one of them sees the other
(the reader then sees EVICTING and lets go, or the evictor sees the bit and reverts): a pinned page is never
evicted. A dead reader's bit is cleared by the reclaimer.

The record: state, pins, last use (the store's logical clock), key (32 bytes), data crc32, and a crc32 of (key,
data crc, the generation of its publication), written while WRITING: a reader trusts the key of a PUBLISHED
slot only when that crc matches the slot's generation.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from .layout import KEY_BYTES, SLOT_BYTES, SLOTS_OFFSET, slot_offset

FREE, WRITING, PUBLISHED, EVICTING = 0, 1, 2, 3
KIND_NAMES = {FREE: "free", WRITING: "writing", PUBLISHED: "published", EVICTING: "evicting"}

SLOT_DTYPE = np.dtype(
    [("state", "<u8"), ("pins", "<u8"), ("last_use", "<u8"), ("key", f"V{KEY_BYTES}"), ("crc", "<u4"), ("mcrc", "<u4")]
)
assert SLOT_DTYPE.itemsize == SLOT_BYTES
_PINS_AT, _LAST_USE_AT, _KEY_AT = 8, 16, 24
KEY_WORD = _KEY_AT // 8  # the record's 64-bit word where its key begins (a vectorized look at the keys)
_META = struct.Struct(f"<{KEY_BYTES}sII")


def word(kind: int, owner: int, generation: int) -> int:
    return (generation << 8) | (owner << 2) | kind


def kind_of(state: int) -> int:
    return state & 3


def owner_of(state: int) -> int:
    return (state >> 2) & 63


def generation_of(state: int) -> int:
    return state >> 8


def meta_crc(key: bytes, data_crc: int, generation: int) -> int:
    return zlib.crc32(key + struct.pack("<IQ", data_crc, generation))


class SlotTable:
    """The slot records of one open store's index mapping."""

    def __init__(self, mapping, capacity: int):
        self.map, self.capacity = mapping, capacity

    def state(self, slot: int) -> int:
        return self.map.load64(slot_offset(slot))

    def cas(self, slot: int, old: int, new: int) -> bool:
        return self.map.cas64(slot_offset(slot), old, new)

    def pins(self, slot: int) -> int:
        return self.map.load64(slot_offset(slot) + _PINS_AT)

    def snapshot(self) -> np.ndarray:
        """Every record, read at once (not atomically: a caller re-checks a record's state word before it acts)."""
        raw = self.map.read(SLOTS_OFFSET, self.capacity * SLOT_BYTES)
        return np.frombuffer(raw, dtype=SLOT_DTYPE)

    def set_pin(self, slot: int, bit: int) -> None:
        at = slot_offset(slot) + _PINS_AT
        while True:
            old = self.map.load64(at)
            if old & bit or self.map.cas64(at, old, old | bit):
                return

    def clear_pin(self, slot: int, bit: int) -> bool:
        """Clear `bit`; whether it was set."""
        at = slot_offset(slot) + _PINS_AT
        while True:
            old = self.map.load64(at)
            if not old & bit:
                return False
            if self.map.cas64(at, old, old & ~bit):
                return True

    def touch(self, slot: int, stamp: int) -> None:
        self.map.store64(slot_offset(slot) + _LAST_USE_AT, stamp)

    def write_key(self, slot: int, key: bytes) -> None:
        """The key of a slot being written, before the page's bytes (what a concurrent publisher of the same
        key looks for), its checksums zeroed until they are known."""
        self.map.write(slot_offset(slot) + _KEY_AT, _META.pack(key, 0, 0))

    def write_meta(self, slot: int, key: bytes, data_crc: int, published_generation: int) -> None:
        self.map.write(
            slot_offset(slot) + _KEY_AT, _META.pack(key, data_crc, meta_crc(key, data_crc, published_generation))
        )

    def read_meta(self, slot: int, generation: int) -> tuple[bytes, int] | None:
        """(key, data crc) of the slot when its record crc matches `generation`, else None."""
        key, crc, mcrc = _META.unpack(self.map.read(slot_offset(slot) + _KEY_AT, _META.size))
        return (key, crc) if mcrc == meta_crc(key, crc, generation) else None
