"""The KVCache protocol (vpaged/kvcache/base.py) is what every cache of vpaged offers, member by member and
signature by signature: ops, the serving stores and the simulator rely on nothing else. Every cache class is
checked against it, as tests/serve/test_serve_stores.py checks the stores against KVStore."""

import inspect
import typing

import pytest
import torch

import vpaged  # noqa: F401  (imports every cache class)
from vpaged import KVGeometry, PagedCacheConfig, VirtualCacheConfig
from vpaged.kvcache import KVCache, KVCacheBase, PagedKVCache, VirtualKVCache

# The protocol's members by kind, read from the protocol itself.
KVCACHE_ATTRIBUTES = tuple(KVCache.__annotations__)
KVCACHE_PROPERTIES = tuple(name for name, member in vars(KVCache).items() if isinstance(member, property))
KVCACHE_METHODS = tuple(name for name, member in vars(KVCache).items() if callable(member) and not name.startswith("_"))


def cache_classes() -> list[type]:
    """Every class of vpaged built on KVCacheBase (subclasses of subclasses too)."""
    found, todo = [], list(KVCacheBase.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("vpaged.") and cls not in found:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.__qualname__)


def shape(sig: inspect.Signature) -> list[tuple]:
    """What a caller relies on in a signature: each parameter's name, kind and default (not annotations)."""
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def contract_breaks(cls: type) -> list[str]:
    """How cls departs from KVCache: a member missing, of the wrong kind, or with another signature."""
    breaks = []
    for name in KVCACHE_METHODS:
        member = inspect.getattr_static(cls, name, None)
        if not callable(member) or isinstance(member, property):
            breaks.append(f"{name}: not a method")
            continue
        want, have = inspect.signature(getattr(KVCache, name)), inspect.signature(getattr(cls, name))
        if shape(have) != shape(want):
            breaks.append(f"{name}{have} != {name}{want}")
    for name in KVCACHE_PROPERTIES:
        if not isinstance(inspect.getattr_static(cls, name, None), property):
            breaks.append(f"{name}: not a property")
    return breaks + annotation_breaks(cls)


def function_of(owner: type, name: str):
    member = inspect.getattr_static(owner, name, None)
    return member.fget if isinstance(member, property) else member


def annotation_breaks(cls: type) -> list[str]:
    """Where cls's annotations depart from the protocol's, resolved (typing.get_type_hints, so spelling does
    not count): every parameter must be annotated as the protocol's is; the return type must be the
    protocol's, or one side of it when the protocol's is a union (a cache gives its own kind of record)."""
    breaks = []
    for name in KVCACHE_METHODS + KVCACHE_PROPERTIES:
        mine = function_of(cls, name)
        if not callable(mine):
            continue  # reported above
        want, have = typing.get_type_hints(function_of(KVCache, name)), typing.get_type_hints(mine)
        for param, hint in want.items():
            got = have.get(param, inspect.Parameter.empty)
            if param == "return" and got != hint and got in typing.get_args(hint):
                continue
            if got != hint:
                breaks.append(f"{name}: {param} is annotated {got}, the protocol says {hint}")
    return breaks


def small_caches():
    geometry, seqs = KVGeometry(2, 2, 8, torch.float32), dict(max_seqs=2, max_seq_len=64)
    return [
        VirtualKVCache(geometry, VirtualCacheConfig(**seqs, capacity_bytes=1 << 20, page_size=1 << 16)),
        PagedKVCache(geometry, PagedCacheConfig(**seqs, capacity_bytes=1 << 20, block_size=16)),
    ]


def test_both_caches_are_found():
    assert {VirtualKVCache, PagedKVCache} <= set(cache_classes())


@pytest.mark.parametrize("cls", cache_classes(), ids=lambda c: c.__name__)
def test_every_cache_class_has_every_member_with_the_protocols_signature(cls):
    assert contract_breaks(cls) == []


def test_the_check_finds_a_drifted_signature_a_missing_property_and_a_wrong_annotation():
    class Drifted(VirtualKVCache):
        def extend_many(self, growth) -> None:  # the protocol's old, wrong form
            pass

        def sequences(self) -> list[int]:  # a method where the caches have a property
            return []

        def allocate(self) -> int:  # no tokens
            return 0

    class Untyped(VirtualKVCache):
        def pages_needed(self, seqs, n: int = 1) -> int:  # the right shape, seqs not annotated
            return 0

        def stats(self) -> dict:  # neither side of the protocol's union
            return {}

    untyped = annotation_breaks(Untyped)
    assert any(b.startswith("pages_needed: seqs") for b in untyped), untyped
    assert any(b.startswith("stats: return") for b in untyped), untyped
    assert len(untyped) == 2, untyped
    breaks = contract_breaks(Drifted)
    assert any(b.startswith("extend_many") for b in breaks)
    assert "sequences: not a property" in breaks
    assert any(b.startswith("allocate") for b in breaks)
    assert contract_breaks(VirtualKVCache) == []


def test_instances_satisfy_the_runtime_protocol_and_hold_its_attributes():
    for cache in small_caches():
        with cache:
            assert isinstance(cache, KVCache)
            for name in KVCACHE_ATTRIBUTES:
                assert hasattr(cache, name), (type(cache).__name__, name)
            assert cache.sequences == []
            seq = cache.allocate(tokens=[1, 2, 3])  # both take a prompt; neither has a cached prefix yet
            assert cache.seq_len(seq) == 0
            need = cache.pages_needed([seq], 5)
            cache.extend_many([seq], 5)
            assert cache.seq_len(seq) == 5 and need >= 1
            assert cache.sequences == [seq]
    assert not isinstance(object(), KVCache)


def test_paged_pages_needed_reads_the_extend_plan():
    """PagedKVCache plans an extend once: pages_needed() is what extend_many() then takes, shared last block
    (copy-on-write) included."""
    gen = torch.Generator().manual_seed(7)
    cache = PagedKVCache(
        KVGeometry(2, 2, 8, torch.float32),
        PagedCacheConfig(max_seqs=8, max_seq_len=256, capacity_bytes=1 << 20, block_size=16),
    )
    seqs = [cache.allocate() for _ in range(3)]
    for _ in range(20):
        n = int(torch.randint(0, 40, (1,), generator=gen))
        pick = [s for s in seqs if torch.rand(1, generator=gen) < 0.7]
        if torch.rand(1, generator=gen) < 0.3 and len(seqs) < 8:
            seqs.append(cache.fork(seqs[int(torch.randint(0, len(seqs), (1,), generator=gen))]))
        if any(cache.seq_len(s) + n > 256 for s in pick):
            continue
        need, before = cache.pages_needed(pick, n), cache.pages_available()
        cache.extend_many(pick, n)
        assert before - cache.pages_available() == need
    cache.close()


def test_ops_takes_any_kvcache_not_only_the_base_class():
    """vpaged.ops checks the protocol, not the class: a cache that only delegates every member (no vpaged
    base class) decodes like the cache it wraps, and an object that is no cache is refused."""
    from vpaged import ops
    from vpaged.errors import InvalidArgumentError

    class Delegating:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

    gen = torch.Generator().manual_seed(3)
    inner = VirtualKVCache(
        KVGeometry(2, 2, 8, torch.float32), VirtualCacheConfig(max_seqs=4, max_seq_len=64, capacity_bytes=1 << 20)
    )
    seqs = inner.allocate_many(3)
    for seq, n in zip(seqs, (5, 17, 1)):
        inner.extend(seq, n)
        for layer in range(2):
            inner.write(layer, seq, torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, 8, generator=gen))
    wrapped = Delegating(inner)
    assert not isinstance(wrapped, KVCacheBase) and isinstance(wrapped, KVCache)
    q = torch.randn(3, 4, 8, generator=gen)
    got = ops.decode_attention(q, wrapped, seqs, 1)
    torch.testing.assert_close(got, ops.decode_attention_reference(q, inner, seqs, 1), rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidArgumentError, match="KVCache"):
        ops.decode_attention(q, object(), seqs, 1)
    inner.close()
