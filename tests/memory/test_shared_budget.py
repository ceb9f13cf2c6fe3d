"""The machine-wide shared budget within one process: the ledger's checks, grants, give-back between two
pools, and its refusals (corrupt, foreign, mismatched). Several processes: test_shared_budget_procs.py."""

import ast
import inspect
import os
import struct
import time

import pytest
import torch
from process_helpers import wait_until

from vpaged import KVGeometry, PagePool, VirtualCacheConfig, VirtualKVCache
from vpaged.errors import (
    BudgetCorruptError,
    BudgetExistsError,
    BudgetMismatchError,
    BudgetNotFoundError,
    BudgetPermissionError,
    InvalidArgumentError,
    OutOfPagesError,
)
from vpaged.memory import SharedBudget
from vpaged.memory.budget.segment import segment_path

PAGE = 64 * 1024


def small_cache(budget, **kw):
    # 2 layers x K/V x 2 heads x 64 fp32 = 512 bytes per token per region: 128 tokens per page
    return VirtualKVCache(
        KVGeometry(2, 2, 64, torch.float32),
        VirtualCacheConfig(max_seqs=16, max_seq_len=4096, shared_budget=budget, **kw),
    )


def fill(cache, seqs, tokens, rng):
    data = {}
    for _ in range(seqs):
        s = cache.allocate()
        cache.extend(s, tokens)
        data[s] = [(torch.randn(tokens, 2, 64, generator=rng), torch.randn(tokens, 2, 64, generator=rng)) for _ in "kv"]
        for layer, (k, v) in enumerate(data[s]):
            cache.write(layer, s, k, v, start=0)
    return data


def intact(cache, data):
    return all(
        torch.equal(cache.kv(layer, s)[0], k) and torch.equal(cache.kv(layer, s)[1], v)
        for s, layers in data.items()
        for layer, (k, v) in enumerate(layers)
    )


def test_create_open_remove(budget_name):
    b = SharedBudget.create(budget_name, capacity_bytes=10 * PAGE + 123)
    assert b.capacity_bytes == 10 * PAGE and b.page_size == PAGE
    assert os.stat(segment_path(budget_name)).st_mode & 0o777 == 0o600
    with pytest.raises(BudgetExistsError, match="vpaged budget remove"):
        SharedBudget.create(budget_name, capacity_bytes=PAGE)
    again = SharedBudget.open(budget_name)
    assert again.capacity_bytes == 10 * PAGE and again.state().members == ()
    assert SharedBudget.remove(budget_name)
    with pytest.raises(BudgetNotFoundError, match="vpaged budget create"):
        SharedBudget.open(budget_name)
    with pytest.raises(InvalidArgumentError):
        SharedBudget.open("../etc/passwd")
    for bad in (budget_name + "\n", "", "x" * 65):  # a trailing newline is no name ("$" let it through)
        with pytest.raises(InvalidArgumentError):
            SharedBudget.create(bad, capacity_bytes=PAGE)
    assert not os.path.exists(segment_path(budget_name) + "\n")


@pytest.mark.parametrize("where", ["magic", "version", "capacity", "lease", "table", "record"])
def test_corrupt_segment_refused_naming_the_fix(budget_name, where):
    budget = SharedBudget.create(budget_name, capacity_bytes=8 * PAGE)
    budget.join(page_size=PAGE, ceiling_bytes=8 * PAGE, name="someone")
    table = budget.segment.active_table_offset()
    offset = {"magic": 0, "version": 8, "capacity": 24, "lease": 60, "table": table + 8, "record": table + 16 + 40}[
        where
    ]
    with open(segment_path(budget_name), "r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(bytes([old[0] ^ 0x5A]))
    with pytest.raises(BudgetCorruptError, match=f"vpaged budget remove {budget_name}"):
        SharedBudget.open(budget_name).state()


def test_truncated_segment_refused(budget_name):
    SharedBudget.create(budget_name, capacity_bytes=8 * PAGE)
    os.truncate(segment_path(budget_name), 100)
    with pytest.raises(BudgetCorruptError, match="remove"):
        SharedBudget.open(budget_name)


def test_world_readable_or_foreign_segment_refused(budget_name):
    SharedBudget.create(budget_name, capacity_bytes=8 * PAGE)
    path = segment_path(budget_name)
    os.chmod(path, 0o644)
    with pytest.raises(BudgetPermissionError, match="other users"):
        SharedBudget.open(budget_name)
    os.chmod(path, 0o600)
    if os.geteuid() == 0:  # root opens any file: the owner check is what refuses it
        os.chown(path, 65534, -1)
        with pytest.raises(BudgetPermissionError, match="belongs to uid 65534"):
            SharedBudget.open(budget_name)


def as_nobody(attempt) -> bytes:
    """attempt() run in a forked child that became uid/gid 65534: the one-byte code it returns (b"?" when it
    raised something else)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = b"?"
        try:
            os.setgid(65534)
            os.setuid(65534)
            code = attempt()
        finally:
            os.write(w, code)
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    return got


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another uid")
def test_other_user_cannot_open_or_read(budget_name):
    SharedBudget.create(budget_name, capacity_bytes=8 * PAGE)

    def join_then_read() -> bytes:
        try:
            SharedBudget.open(budget_name)
            return b"O"
        except BudgetPermissionError:
            try:
                open(segment_path(budget_name), "rb").read(1)
                return b"R"
            except PermissionError:
                return b"P"

    assert as_nobody(join_then_read) == b"P"  # refused with the typed error, and the bytes cannot be read either


def test_join_refusals_change_nothing(budget_name):
    b = SharedBudget.create(budget_name, capacity_bytes=16 * PAGE)
    with pytest.raises(BudgetMismatchError, match="pages of 65536 bytes"):
        PagePool("cpu", capacity_bytes=16 * 2 * PAGE, page_size=2 * PAGE, shared_budget=budget_name)
    keep = PagePool("cpu", capacity_bytes=16 * PAGE, shared_budget=budget_name, min_bytes=10 * PAGE)
    with pytest.raises(BudgetMismatchError, match="cannot guarantee"):
        PagePool("cpu", capacity_bytes=16 * PAGE, shared_budget=budget_name, min_bytes=7 * PAGE)
    with pytest.raises(BudgetMismatchError, match="ceiling"):
        SharedBudget.open(budget_name).join(page_size=PAGE, ceiling_bytes=2 * PAGE, min_bytes=3 * PAGE)
    with pytest.raises(InvalidArgumentError, match="shared_budget"):
        PagePool("cpu", capacity_bytes=16 * PAGE, min_bytes=PAGE)
    state = b.state()
    assert [m.min_bytes for m in state.members] == [10 * PAGE] and state.members[0].granted_bytes == 10 * PAGE
    del keep


def test_pool_limit_follows_the_grant(budget_name):
    SharedBudget.create(budget_name, capacity_bytes=40 * PAGE)
    pool = PagePool("cpu", capacity_bytes=100 * PAGE, shared_budget=budget_name)
    assert pool.free_pages() == 0 and pool.available_pages() == 40  # the ceiling is 100, the budget 40
    assert pool.ensure_free(5)
    granted = pool.budget.budget.member(pool.budget.index).granted_bytes
    assert granted == (pool.free_pages() + pool.stats().used_pages) * PAGE and granted >= 5 * PAGE
    assert not pool.ensure_free(41)  # more than the whole budget: refused at once, nothing taken
    assert pool.budget.budget.member(pool.budget.index).granted_bytes == granted


def test_second_pool_takes_dormant_pages_of_the_first(budget_name, rng):
    SharedBudget.create(budget_name, capacity_bytes=48 * PAGE)
    a, b = small_cache(budget_name), small_cache(budget_name)
    data_a = fill(a, 4, 256, rng)  # 256 tokens: 2 pages in each of 4 regions (2 layers x K/V): 8 pages
    used_a = a.pool.stats().used_pages
    assert used_a == 32
    keep = {s: data_a[s] for s in list(data_a)[:1]}
    for s in list(data_a)[1:]:
        a.free(s)  # dormant: still mapped, charged to a's grant
    assert a.pool.stats().used_pages == used_a
    # An asker asks for what the others' last reports show spare (live K/V is never asked for): wait for a's
    # thread to report its frees (every REPORT_S), or a report from before them (all 32 pages live) would
    # leave nothing to ask a for.
    budget, index = SharedBudget.open(budget_name), a.pool.budget.index
    wait_until(lambda: next(m for m in budget.state().members if m.index == index).live_bytes <= 8 * PAGE, 3.0)
    t0 = time.monotonic()
    data_b = fill(b, 3, 256, rng)  # 24 pages: a's free grant and then its dormant slots give them back
    assert time.monotonic() - t0 < 2.0 + 1.0  # answered by a's thread (a is in this process, not waiting)
    assert a.pool.stats().used_pages < used_a
    assert intact(a, keep) and intact(b, data_b)
    state = SharedBudget.open(budget_name).state()
    assert state.granted_bytes <= state.capacity_bytes
    with pytest.raises(OutOfPagesError):  # a's live sequence is never taken
        fill(b, 4, 256, rng)
    assert intact(a, keep) and intact(b, data_b)


def test_set_ceiling_shrinks_an_idle_member(budget_name, rng):
    budget = SharedBudget.create(budget_name, capacity_bytes=64 * PAGE)
    a = small_cache(budget_name)
    data = fill(a, 2, 256, rng)  # 8 pages each
    for s in list(data)[1:]:
        a.free(s)
    live = 8
    budget.set_ceiling(a.pool.budget.budget.member(a.pool.budget.index).name, live * PAGE)
    wait_until(lambda: budget.state().members[0].granted_bytes <= live * PAGE, 3.0)
    m = budget.state().members[0]
    assert m.granted_bytes <= live * PAGE and m.ceiling_bytes == live * PAGE
    assert intact(a, {s: data[s] for s in list(data)[:1]})
    with pytest.raises(InvalidArgumentError, match="no member"):
        budget.set_ceiling("nobody", PAGE)


def test_dead_member_is_reaped(budget_name):
    budget = SharedBudget.create(budget_name, capacity_bytes=8 * PAGE)
    index = budget.join(page_size=PAGE, ceiling_bytes=8 * PAGE, name="ghost")
    assert budget.grant(index, 8 * PAGE) == 8 * PAGE
    # Make the record claim a process that is gone: a pid that exists with another start time.
    budget.ledger.transact(lambda records: setattr(records[0], "start_ticks", records[0].start_ticks + 1))
    assert budget.state().members == ()  # reaped by the next locked call
    assert budget.headroom(index) == 0 and budget.grant(index, PAGE) == -1


def test_closing_a_cache_leaves_the_budget_at_once(budget_name, rng):
    budget = SharedBudget.create(budget_name, capacity_bytes=8 * PAGE)
    cache = small_cache(budget_name, page_size=PAGE, member_name="closing")
    fill(cache, 1, 100, rng)
    assert [m.name for m in budget.state().members] == ["closing"]
    cache.close()  # no reference dropped: the cache object stays alive
    assert not budget.state().members
    SharedBudget.remove(budget_name)  # no live member left: no force needed
    # A build that fails after joining leaves too: a layout this cache cannot take.
    budget = SharedBudget.create(budget_name, capacity_bytes=8 * PAGE)
    with pytest.raises(InvalidArgumentError):
        small_cache(budget_name, page_size=PAGE, layout="no-such-layout")
    assert not budget.state().members


def test_segment_holds_counts_not_kv(budget_name, rng):
    SharedBudget.create(budget_name, capacity_bytes=32 * PAGE)
    cache = small_cache(budget_name)
    s = cache.allocate()
    cache.extend(s, 256)
    k = torch.full((256, 2, 64), 1234.5678, dtype=torch.float32)
    cache.write(0, s, k, k, start=0)
    raw = open(segment_path(budget_name), "rb").read()
    assert len(raw) < 4 << 20  # a header, status records and the member table buffers
    assert struct.pack("<f", 1234.5678) not in raw


def test_names_are_kept_whole_and_never_shared(budget_name):
    budget = SharedBudget.create(budget_name, capacity_bytes=8 * PAGE)
    long_a, long_b = "model-" + "a" * 50 + "-one", "model-" + "a" * 50 + "-two"  # alike but for the end
    ia = budget.join(page_size=PAGE, ceiling_bytes=8 * PAGE, name=long_a)
    ib = budget.join(page_size=PAGE, ceiling_bytes=8 * PAGE, name=long_b)
    assert [m.name for m in budget.state().members] == [long_a, long_b]
    before = budget.segment.snapshot()
    with pytest.raises(BudgetMismatchError, match="already has a live member named"):
        budget.join(page_size=PAGE, ceiling_bytes=8 * PAGE, name=long_a)
    with pytest.raises(InvalidArgumentError, match="at most 64 bytes"):
        budget.join(page_size=PAGE, ceiling_bytes=8 * PAGE, name="é" * 33)  # 66 bytes of UTF-8
    after = budget.segment.snapshot()
    assert (after.generation, after.body) == (before.generation, before.body)  # refusals wrote nothing
    budget.leave(ia)
    assert budget.join(page_size=PAGE, ceiling_bytes=8 * PAGE, name=long_a) == ia  # free again once it left
    assert ib == 1


def test_set_ceiling_selectors_are_unambiguous(budget_name):
    budget = SharedBudget.create(budget_name, capacity_bytes=16 * PAGE)
    i0 = budget.join(page_size=PAGE, ceiling_bytes=16 * PAGE, name="1")  # a name that looks like an index
    i1 = budget.join(page_size=PAGE, ceiling_bytes=16 * PAGE, name="other")
    assert budget.set_ceiling("1", 4 * PAGE) == [i0]  # the name "1", not the member at index 1
    assert budget.set_ceiling(index=1, max_bytes=6 * PAGE) == [i1]
    ceilings = {m.index: m.ceiling_bytes for m in budget.state().members}
    assert ceilings == {i0: 4 * PAGE, i1: 6 * PAGE}
    assert budget.set_ceiling(pid=os.getpid(), max_bytes=8 * PAGE) == [i0, i1]
    with pytest.raises(InvalidArgumentError, match="no member named '0'"):
        budget.set_ceiling("0", PAGE)  # an index given as a name matches no name
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        budget.set_ceiling("1", PAGE, index=0)
    assert {m.ceiling_bytes for m in budget.state().members} == {8 * PAGE}


def test_remove_refuses_live_members_unless_forced(budget_name):
    from vpaged.errors import BudgetInUseError

    budget = SharedBudget.create(budget_name, capacity_bytes=8 * PAGE)
    index = budget.join(page_size=PAGE, ceiling_bytes=8 * PAGE, name="busy")
    with pytest.raises(BudgetInUseError, match="busy"):
        SharedBudget.remove(budget_name)
    assert budget.check().state == "ok"
    budget.leave(index)
    assert SharedBudget.remove(budget_name)
    assert budget.check().state == "removed"
    SharedBudget.create(budget_name, capacity_bytes=8 * PAGE)
    assert budget.check().state == "replaced"  # a re-created budget: the member side rejoins it
    again = SharedBudget.open(budget_name)
    again.join(page_size=PAGE, ceiling_bytes=8 * PAGE, name="x")
    assert SharedBudget.remove(budget_name, force=True)


def test_a_damaged_segment_reads_as_corrupt_and_is_removable(budget_name):
    budget = SharedBudget.create(budget_name, capacity_bytes=8 * PAGE)
    budget.join(page_size=PAGE, ceiling_bytes=8 * PAGE, name="m")
    with open(segment_path(budget_name), "r+b") as f:
        f.seek(budget.segment.active_table_offset() + 20)
        f.write(b"\xff")
    status = budget.check()
    assert status.state == "corrupt" and "checksum" in status.message
    assert not budget.leave(0)  # nothing to leave, and no error at exit
    assert SharedBudget.remove(budget_name)  # the fix the message names works without --force


def test_an_old_format_segment_is_refused_with_the_fix(budget_name):
    path = segment_path(budget_name)
    with open(path, "wb") as f:  # a version-2 segment (the flock ledger) of its own size
        f.write(b"VPBUDGET" + struct.pack("<I", 2) + bytes(9000))
    os.chmod(path, 0o600)
    with pytest.raises(BudgetCorruptError, match=f"format version 2, this vpaged reads 3.*remove {budget_name}"):
        SharedBudget.open(budget_name)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another uid")
def test_another_users_remove_is_a_typed_error(budget_name):
    SharedBudget.create(budget_name, capacity_bytes=8 * PAGE)

    def remove() -> bytes:
        try:
            SharedBudget.remove(budget_name, force=True)
            return b"R"
        except BudgetPermissionError:
            return b"P"

    assert as_nobody(remove) == b"P" and os.path.exists(segment_path(budget_name))


def _protocol_members(protocol) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")}


def _names_used_on(tree: ast.AST, holder) -> set[str]:
    """Attributes read on `holder` (a name, or self.<attr> given as ("self", attr)) anywhere in the tree."""
    used = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if isinstance(holder, str) and isinstance(base, ast.Name) and base.id == holder:
            used.add(node.attr)
        elif (
            isinstance(holder, tuple)
            and isinstance(base, ast.Attribute)
            and isinstance(base.value, ast.Name)
            and (base.value.id, base.attr) == holder
        ):
            used.add(node.attr)
    return used


def test_a_membership_sees_its_pool_only_through_the_granted_pool_protocol():
    """budget/member.py never imports the pool: what it reads and calls on it is GrantedPool (and on the pool's
    C++ core GrantedCore), exactly, and a PagePool (and its core) provide all of it with the same signatures."""
    from vpaged import _C
    from vpaged.memory.budget import member
    from vpaged.memory.budget.member import GrantedCore, GrantedPool

    tree = ast.parse(inspect.getsource(member))
    assert _names_used_on(tree, "pool") == _protocol_members(GrantedPool)
    assert _names_used_on(tree, ("self", "_core")) == _protocol_members(GrantedCore)
    pool = PagePool("cpu", capacity_pages=4, accounting_only=True)
    assert isinstance(pool, GrantedPool)
    for name in _protocol_members(GrantedPool):
        declared = getattr(GrantedPool, name)
        if callable(declared):
            assert list(inspect.signature(getattr(PagePool, name)).parameters) == list(
                inspect.signature(declared).parameters
            ), name
    for name in _protocol_members(GrantedCore):
        assert hasattr(_C.PagePool, name), name
