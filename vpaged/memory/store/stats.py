"""A page store's counters (shared words in its index, moved by compare-and-swap) and its figures."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .layout import COUNTERS, COUNTERS_OFFSET, counter_offset


class Counters:
    """The store-wide counters: every process adds to the same words, so the figures are the store's."""

    def __init__(self, mapping):
        self.map = mapping

    def add(self, name: str, n: int = 1) -> int:
        """Add n to counter `name`; the new value."""
        at = counter_offset(name)
        while True:
            old = self.map.load64(at)
            new = (old + n) & 0xFFFFFFFFFFFFFFFF
            if self.map.cas64(at, old, new):
                return new

    def get(self, name: str) -> int:
        return self.map.load64(counter_offset(name))

    def all(self) -> dict[str, int]:
        raw = self.map.read(COUNTERS_OFFSET, 8 * len(COUNTERS))
        return dict(zip(COUNTERS, struct.unpack(f"<{len(COUNTERS)}Q", raw)))


@dataclass(frozen=True)
class StoreStats:
    """Figures of a store as of one read. Pages: capacity, used (not free), published (visible; also those an
    evictor is checking), writing (being published, or left by a publisher not yet reclaimed), pinned (published
    pages some process pins). Since the store was created, by every process: hits / misses (pages asked by
    pin()), published, duplicates (publishes that found the key present), evictions, reclaimed_writing (slots
    a dead publisher left half-written, freed), reclaimed_pins (pins of dead or fenced readers, dropped),
    reclaimed_clients (records of dead processes freed), fenced_clients. clients: processes with it open."""

    capacity_pages: int
    page_bytes: int
    used_pages: int
    published_pages: int
    writing_pages: int
    pinned_pages: int
    clients: int
    hits: int
    misses: int
    published: int
    duplicates: int
    evictions: int
    reclaimed_writing: int
    reclaimed_pins: int
    reclaimed_clients: int
    fenced_clients: int
