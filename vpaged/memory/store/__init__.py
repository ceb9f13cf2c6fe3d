"""vpaged.memory.store: a content-addressed KV page store that processes share through files they own.

fingerprint.py names what a page's bytes depend on and chains page keys from it; layout.py is the file format
(an index file of shared words, a data file of page-aligned pages); location.py where the files are and who
may use them; clients.py the per-process records and their leases; index.py the slot state machine that
makes a page visible atomically; reclaim.py gives back what dead processes held; stats.py the counters;
store.py the PageStore. docs/kv-store.md says what it guarantees and what is not wired yet.
"""

from .fingerprint import StoreFingerprint, chain_keys, page_key, tail_key
from .reclaim import ReclaimCounts
from .stats import StoreStats
from .store import FULL, PRESENT, PUBLISHED, RACED, PageStore, PinnedPage

__all__ = [
    "PageStore",
    "PinnedPage",
    "StoreFingerprint",
    "StoreStats",
    "ReclaimCounts",
    "chain_keys",
    "page_key",
    "tail_key",
    "PUBLISHED",
    "PRESENT",
    "RACED",
    "FULL",
]
