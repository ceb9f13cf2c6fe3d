"""The bytes of a page store: its index file (header, counters, client table, slot table) and its data file.

Note (why two files). The data file holds only page bytes, page `i` at offset `i * page_bytes`, with
`page_bytes` a multiple of the OS page: so a later mapping call can place any published page read-only into
a process's KV range with one mmap(MAP_FIXED, PROT_READ) of the data file at that offset, and nothing else
lies in those pages. After the last page comes a trailer (one OS page) naming the store it belongs to. The
index file is small and holds every word that changes; it is read and written only through a
vpaged._C.LedgerMapping (bounds-checked, 64-bit atomics, a SIGBUS guard against truncation).

Index file:

    0      header (HEADER_BYTES): magic, version, crc32 of the header, page bytes, capacity in pages, client
           slots, slot record bytes, lease ms, owner uid, created ns, store id (16 random bytes), data bytes
    128    counters: one 64-bit word each (COUNTERS), moved by compare-and-swap
    256    client table: MAX_CLIENTS records of CLIENT_BYTES (clients.py)
    ...    slot table: capacity records of SLOT_BYTES (index.py), slot i describes data page i

Nothing read from either file is trusted before its checksum passed (the header's at open, a slot's record
crc before its key counts, a page's crc when a reader verifies it).
"""

from __future__ import annotations

import mmap
import struct
import zlib
from dataclasses import dataclass

from ...errors import InvalidArgumentError

INDEX_MAGIC = b"VPKVSTOR"
DATA_MAGIC = b"VPKVDATA"
VERSION = 1
OS_PAGE = mmap.PAGESIZE

MAX_CLIENTS = 64  # one bit each in a slot's pin word
CLIENT_BYTES = 64
SLOT_BYTES = 64
KEY_BYTES = 32

HEADER_BYTES = 128
# magic, version, crc, page bytes, capacity, max clients, slot bytes, lease ms, owner uid, created ns, store id,
# data bytes
_HEADER = struct.Struct("<8sIIQQIIIIQ16sQ")
COUNTERS_OFFSET = 128
COUNTERS = (
    "clock",  # the logical clock of last use (LRU order)
    "publish_seq",  # bumped after every publish: a process's key cache is complete while it has not moved
    "hits",
    "misses",
    "published",
    "duplicates",
    "evictions",
    "reclaimed_writing",  # slots a dead publisher left WRITING, freed
    "reclaimed_pins",  # pins a dead (or fenced) reader held, dropped
    "reclaimed_clients",  # client records of dead processes freed
    "fenced_clients",  # clients whose lease ran out while they could not be seen dead
)
CLIENTS_OFFSET = 256
SLOTS_OFFSET = CLIENTS_OFFSET + MAX_CLIENTS * CLIENT_BYTES

# The data file's trailer, at data offset capacity * page_bytes: magic, version, crc, page bytes, capacity, id
_TRAILER = struct.Struct("<8sIIQQ16s")
TRAILER_BYTES = OS_PAGE

MAX_PAGE_BYTES = 1 << 30
MAX_CAPACITY = 1 << 24


def counter_offset(name: str) -> int:
    return COUNTERS_OFFSET + 8 * COUNTERS.index(name)


def slot_offset(slot: int) -> int:
    return SLOTS_OFFSET + slot * SLOT_BYTES


def client_offset(index: int) -> int:
    return CLIENTS_OFFSET + index * CLIENT_BYTES


def index_bytes(capacity: int) -> int:
    raw = SLOTS_OFFSET + capacity * SLOT_BYTES
    return -(-raw // OS_PAGE) * OS_PAGE


def data_bytes(capacity: int, page_bytes: int) -> int:
    return capacity * page_bytes + TRAILER_BYTES


def check_geometry(capacity_pages: object, page_bytes: object) -> tuple[int, int]:
    """(capacity, page bytes) when they make a store, else InvalidArgumentError."""
    if (
        not isinstance(capacity_pages, int)
        or isinstance(capacity_pages, bool)
        or not 1 <= capacity_pages <= MAX_CAPACITY
    ):
        raise InvalidArgumentError(f"a store's capacity_pages is an int of 1 to {MAX_CAPACITY}, got {capacity_pages!r}")
    if (
        not isinstance(page_bytes, int)
        or isinstance(page_bytes, bool)
        or not OS_PAGE <= page_bytes <= MAX_PAGE_BYTES
        or page_bytes % OS_PAGE
    ):
        raise InvalidArgumentError(
            f"a store's page_bytes is a multiple of the OS page ({OS_PAGE}) up to {MAX_PAGE_BYTES}, got {page_bytes!r}"
            " (each page must lie at a page-aligned offset of the data file, to be mapped)"
        )
    return capacity_pages, page_bytes


@dataclass(frozen=True)
class Header:
    page_bytes: int
    capacity: int
    lease_ms: int
    owner_uid: int
    created_ns: int
    store_id: bytes
    data_bytes: int

    def pack(self) -> bytes:
        raw = _HEADER.pack(
            INDEX_MAGIC, VERSION, 0, self.page_bytes, self.capacity, MAX_CLIENTS, SLOT_BYTES, self.lease_ms,
            self.owner_uid, self.created_ns, self.store_id, self.data_bytes,
        ).ljust(HEADER_BYTES, b"\0")  # fmt: skip
        return _with_crc(raw)


def _with_crc(raw: bytes) -> bytes:
    return raw[:12] + struct.pack("<I", _crc_without_field(raw)) + raw[16:]


def _crc_without_field(raw: bytes) -> int:
    return zlib.crc32(raw[:12] + b"\0\0\0\0" + raw[16:])


def header_magic_version(raw: bytes) -> tuple[bytes, int]:
    return struct.unpack_from("<8sI", raw)


def unpack_header(raw: bytes) -> Header | str:
    """The header, or a sentence saying why these bytes are not one (the caller names the file and the error)."""
    if len(raw) < HEADER_BYTES:
        return f"has {len(raw)} header bytes, not {HEADER_BYTES}"
    magic, version, crc, page_bytes, capacity, clients, slot_bytes, lease_ms, uid, created, store_id, dbytes = (
        _HEADER.unpack_from(raw)
    )
    if magic != INDEX_MAGIC:
        return "is not a vpaged KV store index (bad magic)"
    if version != VERSION:
        return f"has format version {version}, this vpaged reads {VERSION}"
    if crc != _crc_without_field(raw[:HEADER_BYTES]):
        return "fails its header checksum"
    if clients != MAX_CLIENTS or slot_bytes != SLOT_BYTES:
        return f"has {clients} client slots of {slot_bytes} bytes, not {MAX_CLIENTS} of {SLOT_BYTES}"
    try:
        check_geometry(capacity, page_bytes)
    except InvalidArgumentError:
        return f"names an impossible geometry ({capacity} pages of {page_bytes} bytes)"
    if dbytes != data_bytes(capacity, page_bytes):
        return f"names a data file of {dbytes} bytes, not {data_bytes(capacity, page_bytes)}"
    return Header(page_bytes, capacity, lease_ms, uid, created, store_id, dbytes)


def pack_trailer(header: Header) -> bytes:
    raw = _TRAILER.pack(DATA_MAGIC, VERSION, 0, header.page_bytes, header.capacity, header.store_id)
    return _with_crc(raw.ljust(TRAILER_BYTES, b"\0"))


def trailer_problem(raw: bytes, header: Header) -> tuple[str, str] | None:
    """None when `raw` is the trailer of the store `header` describes; else (kind, sentence), kind "corrupt"
    (not a trailer) or "mismatch" (the data file of another store)."""
    magic, version, crc, page_bytes, capacity, store_id = _TRAILER.unpack_from(raw)
    if magic != DATA_MAGIC or crc != _crc_without_field(raw[:TRAILER_BYTES]):
        return "corrupt", "has no valid data trailer (bad magic or checksum)"
    if version != VERSION or (page_bytes, capacity, store_id) != (header.page_bytes, header.capacity, header.store_id):
        return "mismatch", "belongs to another store (its trailer names another store id or geometry)"
    return None
