"""PageStore.publish_many: a batch of pages gives, page by page, what publish() of each in turn would (checked
against a model of the store's contents), settles keys given twice, fills what room there is and says FULL for
the rest, races other processes' batches of the same keys with one winner per key, and, cut by a SIGKILL at any
step of any of its pages, leaves the pages before the cut whole and nothing else behind. The single-page path
(publish) runs on the same code: test_page_store.py and test_page_store_faults.py."""

import os
import random
import signal

import pytest
from process_helpers import wait_until
from test_page_store import PAGE, Child, page_for, page_is_whole, race, store_name  # noqa: F401
from test_page_store_faults import no_slot_leaked

from vpaged.errors import InvalidArgumentError, StoreFullError
from vpaged.memory.store import FULL, PRESENT, PUBLISHED, RACED, PageStore
from vpaged.memory.store import store as store_module


def published_keys(store: PageStore) -> list[bytes]:
    snap = store.slots.snapshot()
    return sorted(bytes(k) for k in snap[(snap["state"] & 3) == 2]["key"])


def test_a_batch_publishes_new_keys_and_finds_old_ones(store_name, prng):  # noqa: F811
    rng = prng
    with PageStore.open(store_name, create=True, capacity_pages=64, page_bytes=PAGE) as store:
        model: dict[bytes, bytes] = {}  # key -> the bytes its page must hold
        for _ in range(6):
            old = rng.sample(sorted(model), min(len(model), rng.randrange(4)))
            new = [os.urandom(32) for _ in range(rng.randrange(1, 8))]
            keys = old + new
            keys += rng.sample(keys, min(len(keys), rng.randrange(3)))  # some keys twice
            rng.shuffle(keys)
            pages = [(k, page_for(k, rng)) for k in keys]
            outcomes = store.publish_many(pages)
            seen = set()
            for (key, data), outcome in zip(pages, outcomes):
                if key in model or key in seen:
                    assert outcome == PRESENT, f"{key.hex()[:8]} was there already, got {outcome}"
                else:
                    assert outcome == PUBLISHED
                    model[key] = data  # the first place of a key is the one published
                seen.add(key)
        assert published_keys(store) == sorted(model)  # one slot per key
        handles = store.pin(list(model))
        assert [h.read() for h in handles] == list(model.values())
        for h in handles:
            h.release()
        s = store.stats()
        assert (s.published_pages, s.writing_pages, s.published) == (len(model), 0, len(model))


def test_a_batch_larger_than_the_room_left_says_full_for_the_rest(store_name, prng):  # noqa: F811
    rng = prng
    with PageStore.open(store_name, create=True, capacity_pages=8, page_bytes=PAGE) as store:
        pinned = [os.urandom(32) for _ in range(5)]
        assert store.publish_many([(k, page_for(k, rng)) for k in pinned]) == [PUBLISHED] * 5
        handles = store.pin(pinned)  # no page of these may be evicted: 3 slots left
        batch = [os.urandom(32) for _ in range(6)]
        outcomes = store.publish_many([(k, page_for(k, rng)) for k in batch])
        assert outcomes == [PUBLISHED] * 3 + [FULL] * 3
        assert store.match(batch) == 3 and published_keys(store) == sorted(pinned + batch[:3])
        assert store.stats().writing_pages == 0  # nothing reserved was left behind
        handles += store.pin(batch[:3])
        with pytest.raises(StoreFullError):  # and one page alone: the error publish() always raised
            store.publish(os.urandom(32), bytes(PAGE))
        assert store.stats().writing_pages == 0
        for h in handles:
            h.release()
        # Unpinned, the least recently used go: the batch evicts what it needs, no more.
        more = [os.urandom(32) for _ in range(4)]
        assert store.publish_many([(k, page_for(k, rng)) for k in more]) == [PUBLISHED] * 4
        assert store.stats().published_pages == 8 and store.match(more) == 4


def test_bad_input_in_a_batch_publishes_nothing(store_name):  # noqa: F811
    with PageStore.open(store_name, create=True, capacity_pages=8, page_bytes=PAGE) as store:
        good = (os.urandom(32), bytes(PAGE))
        for bad in [(b"short", bytes(PAGE)), (os.urandom(32), bytes(PAGE - 1)), (os.urandom(32), b"")]:
            with pytest.raises(InvalidArgumentError):
                store.publish_many([good, bad])
            assert store.stats().used_pages == 0
        assert store.publish_many([]) == []


def _publish_batches(say, name, keys, seed):
    """Publish all keys in shuffled batches of 1-40, again while some race; report the places won."""
    rng = random.Random(seed)
    order = list(range(len(keys)))
    rng.shuffle(order)
    won = []
    with PageStore.open(name) as store:
        say("ready")
        while order:
            n = rng.randrange(1, 40)
            batch, order = order[:n], order[n:]
            for _ in range(50):
                outcomes = store.publish_many([(keys[i], page_for(keys[i], rng)) for i in batch])
                won += [i for i, o in zip(batch, outcomes) if o == PUBLISHED]
                batch = [i for i, o in zip(batch, outcomes) if o == RACED]
                if not batch:
                    break
            assert not batch, "a key stayed raced through 50 tries"
    say("won", *won)


def test_batches_of_the_same_keys_race_and_one_process_wins_each(store_name, prng):  # noqa: F811
    keys = [os.urandom(32) for _ in range(300)]
    with PageStore.open(store_name, create=True, capacity_pages=512, page_bytes=PAGE) as store:
        race(store, _publish_batches, keys, prng)


def _publish_a_batch_and_die(say, name, keys, seed, step, at):
    """Publish keys in one batch, SIGKILLed at the at-th time the batch reaches `step` (publish_hook)."""
    rng = random.Random(seed)
    seen = [0]

    def hook(where):
        if where == step:
            seen[0] += 1
            if seen[0] == at:
                os.kill(os.getpid(), signal.SIGKILL)

    store_module.publish_hook = hook
    with PageStore.open(name) as store:
        say("ready")
        store.publish_many([(k, page_for(k, rng)) for k in keys])


@pytest.mark.parametrize("step", ["reserved", "written", "signed"])
def test_a_batch_cut_by_a_kill_shows_only_whole_pages_and_leaks_nothing(store_name, step, prng):  # noqa: F811
    keys = [os.urandom(32) for _ in range(6)]
    at = prng.randrange(1, len(keys) + 1)
    with PageStore.open(store_name, create=True, capacity_pages=16, page_bytes=PAGE) as store:
        child = Child(_publish_a_batch_and_die, store_name, keys, prng.randrange(1 << 30), step, at)
        assert child.readline() == "ready"
        assert child.wait() == -signal.SIGKILL
        # The pages before the cut are published whole (in the batch's order); the one cut and those after are not.
        assert store.match(keys) == at - 1 and published_keys(store) == sorted(keys[: at - 1])
        for h in store.pin(keys[: at - 1]):
            assert page_is_whole(h.key, h.read())
            h.release()
        assert wait_until(lambda: no_slot_leaked(store), 10.0), store.stats()  # its reserved slots come back
        assert store.publish_many([(k, page_for(k, prng)) for k in keys]) == [PRESENT] * (at - 1) + [PUBLISHED] * (
            len(keys) - at + 1
        )
