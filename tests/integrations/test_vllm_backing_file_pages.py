"""KVBacking with a page store's pages mapped into its blocks (what vpaged's vLLM connector does for a hit on
vpaged memory): the block reads the store's bytes with none copied and none of the pool's pages, the pins are
given back when the block is released or handed out again, and nothing written to the block reaches the store.
No vLLM needed."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from vpaged.errors import InvalidArgumentError
from vpaged.integrations.vllm.backing import BlockGeometry, KVBacking
from vpaged.memory import PagePool
from vpaged.memory.store import PageStore

PAGE = 4096
LAYERS = 2
SPAN = 2 * PAGE  # one layer's page of one block: two pool pages
BLOCKS = 6


@pytest.fixture
def store():
    name = f"backing-fp-{uuid.uuid4().hex[:8]}"
    s = PageStore.open(name, create=True, capacity_pages=16, page_bytes=SPAN)
    yield s
    s.close()
    PageStore.remove(name)


def _backing(block_bytes=SPAN, layer_stride=SPAN * BLOCKS) -> KVBacking:
    geom = BlockGeometry(0, layer_stride, block_bytes, block_bytes, LAYERS, BLOCKS)
    pool = PagePool("cpu", capacity_pages=64, page_size=PAGE, zero_on_reuse=True)
    return KVBacking(layer_stride * LAYERS, [geom], pool)


def _publish(store, n):
    """n random pages in the store; their pins and bytes."""
    pages = []
    for _ in range(n):
        key, data = os.urandom(32), os.urandom(SPAN)
        store.publish(key, data)
        (pin,) = store.pin([key])
        pages.append((pin, data))
    return pages


def _block_bytes(backing, block):
    buf = backing.tensor.numpy().view(np.uint8)
    starts = [layer * SPAN * BLOCKS + block * SPAN for layer in range(LAYERS)]
    return [buf[s : s + SPAN].tobytes() for s in starts]


def _spans(block, pins):
    return [(layer * SPAN * BLOCKS + block * SPAN, pin.offset) for layer, pin in enumerate(pins)]


def test_a_block_maps_store_pages_and_gives_the_pins_back_when_released(store):
    backing = _backing()
    backing.map_blocks([1, 2])
    used = backing.pool.stats().used_pages
    pages = _publish(store, LAYERS)
    released = []
    backing.share_file_pages(1, _spans(1, [p for p, _ in pages]), SPAN, store.data_fd, lambda: released.append(1))
    assert _block_bytes(backing, 1) == [d for _, d in pages]
    # The block's own pages went back to the pool; the store's are not the pool's.
    assert backing.pool.stats().used_pages == used - LAYERS * SPAN // PAGE
    assert backing.stats().file_bytes == LAYERS * SPAN and backing.maps_file_pages(1)
    assert released == []
    backing.release_blocks([1])
    assert released == [1] and not backing.maps_file_pages(1) and backing.stats().file_bytes == 0
    for pin, _ in pages:
        pin.release()
    assert store.stats().pinned_pages == 0


def test_a_block_handed_out_again_gets_zeroed_pages_of_its_own_and_the_store_is_untouched(store):
    backing = _backing()
    backing.map_blocks([3])
    pages = _publish(store, LAYERS)
    released = []
    backing.share_file_pages(3, _spans(3, [p for p, _ in pages]), SPAN, store.data_fd, lambda: released.append(3))
    assert backing.replace_file_pages([3, 4]) == 1 and released == [3]
    assert _block_bytes(backing, 3) == [bytes(SPAN)] * LAYERS
    buf = backing.tensor.numpy().view(np.uint8)
    buf[3 * SPAN : 4 * SPAN] = 7  # vLLM writing other tokens into the block
    for pin, data in pages:
        assert pin.read(verify=True) == data
    assert backing.stats().file_blocks_replaced == 1


def test_a_second_hit_on_a_block_replaces_the_first(store):
    backing = _backing()
    backing.map_blocks([2])
    first, second = _publish(store, LAYERS), _publish(store, LAYERS)
    calls = []
    backing.share_file_pages(2, _spans(2, [p for p, _ in first]), SPAN, store.data_fd, lambda: calls.append("a"))
    backing.share_file_pages(2, _spans(2, [p for p, _ in second]), SPAN, store.data_fd, lambda: calls.append("b"))
    assert calls == ["a"] and _block_bytes(backing, 2) == [d for _, d in second]


def test_spans_that_are_not_the_blocks_own_are_refused_and_change_nothing(store):
    backing = _backing()
    backing.map_blocks([1, 2])
    before = [_block_bytes(backing, b) for b in (1, 2)]
    pins = [p for p, _ in _publish(store, LAYERS)]
    with pytest.raises(InvalidArgumentError, match="not pages of block 1"):
        backing.share_file_pages(1, _spans(2, pins), SPAN, store.data_fd, lambda: None)
    with pytest.raises(InvalidArgumentError, match="not mapped"):
        backing.share_file_pages(5, _spans(5, pins), SPAN, store.data_fd, lambda: None)
    assert [_block_bytes(backing, b) for b in (1, 2)] == before and backing.stats().file_bytes == 0


def test_blocks_that_share_a_page_cannot_map_file_pages():
    # Half-page blocks: two blocks on one page, which a store page could never be mapped into alone.
    backing = _backing(block_bytes=PAGE // 2, layer_stride=PAGE // 2 * BLOCKS)
    assert not backing.can_share_file_pages(PAGE // 2)
    assert _backing().can_share_file_pages(SPAN)
    assert not _backing().can_share_file_pages(SPAN + PAGE // 2)
