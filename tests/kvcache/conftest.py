"""Tests of VirtualKVCache, PagedKVCache, their records, eviction and the KVCache protocol (vpaged/kvcache/)."""
