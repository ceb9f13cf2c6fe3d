"""The share policy of a shared budget (vpaged/memory/budget/policy.py): on random ledgers, the fair policy's
admission cap equals a reference computed here from the rule's words; greedy never caps; the header keeps
the policy; a starved member's ask reaches a member holding more than its fair share even when that member's
last report says all its pages are live."""

import random
import time
import uuid

import pytest

from vpaged.errors import InvalidArgumentError
from vpaged.memory import SharedBudget
from vpaged.memory.budget.policy import STARVED_S, FairShare, Greedy, share_policy
from vpaged.memory.budget.segment import MemberRecord

PAGE = 64 * 1024


def random_ledger(rng: random.Random, now_ns: int):
    capacity = rng.randint(4, 256) * PAGE
    records = []
    for i in range(rng.randint(1, 6)):
        ceiling = rng.randint(1, capacity // PAGE) * PAGE
        min_bytes = rng.choice([0, 0, rng.randint(0, ceiling // PAGE) * PAGE])
        granted = rng.randint(0, ceiling // PAGE) * PAGE
        live = rng.choice([0, rng.randint(0, granted // PAGE + 1) * PAGE])
        asked_ago = rng.choice([None, 0.01, STARVED_S / 2, 2 * STARVED_S, 5.0])
        demand = 0 if asked_ago is None else rng.randint(1, 8) * PAGE
        demand_ns = 0 if asked_ago is None else now_ns - int(asked_ago * 1e9)
        r = MemberRecord(i, 1000 + i, 0, f"m{i}", "", min_bytes, ceiling, granted, live, live, 0)
        r.demand_bytes, r.demand_ns = demand, demand_ns
        records.append(r)
    return capacity, records


def reference_cap(records, mine, capacity, now_ns):
    """The rule as the module's docstring states it, written out again."""

    def asking(r):
        return r.demand_bytes > 0 and (now_ns - r.demand_ns) / 1e9 <= STARVED_S

    active = sum(1 for r in records if r.live_bytes > 0 or asking(r)) or 1

    def fair(r):
        even = (capacity // active) // PAGE * PAGE
        return min(r.ceiling_bytes, max(r.min_bytes, even))

    starved_other = any(asking(r) and max(r.granted_bytes, r.min_bytes) < fair(r) for r in records if r is not mine)
    return fair(mine) if starved_other else None


@pytest.mark.parametrize("seed", [random.randrange(1 << 30) for _ in range(3)])
def test_fair_cap_matches_the_rule_on_random_ledgers(seed):
    rng = random.Random(seed)
    now = time.time_ns()
    capped = 0
    for _ in range(400):
        capacity, records = random_ledger(rng, now)
        for mine in records:
            got = FairShare().admission_cap(records, mine, capacity, PAGE, now)
            assert got == reference_cap(records, mine, capacity, now), (seed, records, mine)
            assert Greedy().admission_cap(records, mine, capacity, PAGE, now) is None
            capped += got is not None
            if got is not None:
                assert got % PAGE == 0 and got <= mine.ceiling_bytes
    assert capped > 0  # the random ledgers did exercise contention


def test_no_cap_without_a_starved_member():
    now = time.time_ns()
    a = MemberRecord(0, 1, 0, "a", "", 0, 64 * PAGE, 64 * PAGE, 64 * PAGE, 64 * PAGE, 0)
    b = MemberRecord(1, 2, 0, "b", "", 0, 64 * PAGE, 0)
    assert FairShare().admission_cap([a, b], a, 64 * PAGE, PAGE, now) is None  # b idle: a may use it all
    b.demand_bytes, b.demand_ns = 4 * PAGE, now - int(2 * STARVED_S * 1e9)
    assert FairShare().admission_cap([a, b], a, 64 * PAGE, PAGE, now) is None  # b's ask is stale
    b.demand_ns = now
    assert FairShare().admission_cap([a, b], a, 64 * PAGE, PAGE, now) == 32 * PAGE  # b starved: half each
    b.granted_bytes = 32 * PAGE
    assert FairShare().admission_cap([a, b], a, 64 * PAGE, PAGE, now) is None  # b holds its share: not starved


def test_policy_is_kept_in_the_header_and_checked():
    name = f"test-{uuid.uuid4().hex[:12]}"
    try:
        b = SharedBudget.create(name, 16 * PAGE, share_policy="greedy")
        assert SharedBudget.open(name).policy.name == "greedy" and b.state().share_policy == "greedy"
    finally:
        SharedBudget.remove(name, force=True)
    with pytest.raises(InvalidArgumentError):
        SharedBudget.create(name, 16 * PAGE, share_policy="loudest")
    assert not SharedBudget.remove(name)  # the refused create left nothing behind
    with pytest.raises(InvalidArgumentError):
        share_policy(99)


def test_starved_ask_reaches_a_member_above_its_share_whatever_it_reported():
    name = f"test-{uuid.uuid4().hex[:12]}"
    budget = SharedBudget.create(name, 64 * PAGE, share_policy="fair")
    try:
        a = budget.join(page_size=PAGE, ceiling_bytes=64 * PAGE, name="a")
        b = budget.join(page_size=PAGE, ceiling_bytes=64 * PAGE, name="b")
        assert budget.grant(a, 64 * PAGE) == 64 * PAGE
        budget.report(a, 64 * PAGE, 64 * PAGE, 0)  # a says: all live (a report older than its finishes)
        assert budget.grant(b, 4 * PAGE) == 0  # nothing free: b asks, and its demand is published
        state = {m.name: m for m in budget.state().members}
        assert state["b"].starved and state["a"].fair_share_bytes == 32 * PAGE
        assert state["a"].asked_bytes == 4 * PAGE  # asked although its report says all live (its excess: 32 pages)
        assert budget.admission_cap(a) == 32 * PAGE and budget.admission_cap(b) is None
    finally:
        SharedBudget.remove(name, force=True)
        budget.close()


def test_members_at_their_shares_do_not_ask_each_other():
    # Three busy members at a third each, their reusable pages beyond their live K/V: one short but not
    # starved asks nobody (each keeps its share); once it is below its share it asks for the others' excess.
    now = time.time_ns()
    cap = 48 * PAGE
    recs = [MemberRecord(i, 1 + i, 0, f"m{i}", "", 0, cap, 16 * PAGE, 16 * PAGE, 12 * PAGE, 4 * PAGE) for i in range(3)]
    for r in recs:
        r.demand_bytes, r.demand_ns = 4 * PAGE, now
    fair = FairShare()
    assert all(v <= 0 for v in fair.spare_bytes(recs, recs[0], cap, PAGE, now).values())
    assert all(v == 4 * PAGE for v in Greedy().spare_bytes(recs, recs[0], cap, PAGE, now).values())
    recs[0].granted_bytes, recs[1].granted_bytes = 12 * PAGE, 20 * PAGE  # 0 starved; 1 above its share
    assert fair.spare_bytes(recs, recs[0], cap, PAGE, now) == {1: 8 * PAGE, 2: 4 * PAGE}
    recs[2].live_bytes = 0  # an idle member keeps nothing beyond its minimum
    recs[2].demand_bytes = 0
    assert fair.spare_bytes(recs, recs[1], cap, PAGE, now)[2] == 16 * PAGE
