"""The shared budget's ledger under faults, in real processes (tests/ledger_worker.py): SIGKILLs inside
report / grant / give_back leave it readable; a member stopped anywhere (also between writing its table and
landing it) stalls nobody; a truncated segment gives every member a typed error and kills none; members in
separate PID namespaces both stay listed and the capacity holds; a stopped member's lease runs out.

VPAGED_LEDGER_KILLS sets the number of kills (default 400 here; the issue's 2,000 is recorded in
benchmarks/NOTES.md, run with VPAGED_LEDGER_KILLS=2000)."""

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from vpaged.errors import BudgetCorruptError
from vpaged.memory.budget.segment import segment_bytes, segment_path
from vpaged.memory.budget.shared import SharedBudget

PAGE = 4096
WORKER = Path(__file__).resolve().parents[1] / "ledger_worker.py"
# A PYTHONPATH given stays first: scripts/sanitize.sh puts its instrumented build there, which the workers
# must load too (the checkout, with the normal build, comes after it).
ENV = dict(
    os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(WORKER.parent.parent)]))
)


@pytest.fixture
def budget_name():
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    SharedBudget.remove(name, force=True)


def start(*args, stdin=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, args)], stdin=stdin, stdout=subprocess.PIPE, text=True, env=ENV
    )


def readline(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """One line of the worker's output, failing (not hanging) when it takes longer than timeout."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    assert sel.select(timeout), f"worker {proc.pid} said nothing in {timeout} s"
    line = proc.stdout.readline()
    assert line, f"worker {proc.pid} ended (rc {proc.poll()})"
    return line.strip()


def check_ledger(budget: SharedBudget) -> None:
    state = budget.state()  # raises BudgetCorruptError on an unreadable ledger
    assert state.reserved_bytes <= state.capacity_bytes
    for m in state.members:
        assert m.granted_bytes % PAGE == 0 and m.granted_bytes <= m.ceiling_bytes


def test_sigkills_inside_changes_leave_the_ledger_readable(budget_name):
    kills = int(os.environ.get("VPAGED_LEDGER_KILLS", "400"))
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    budget = SharedBudget.create(budget_name, capacity_bytes=64 * PAGE, page_size=PAGE)
    zygote = start("zygote", budget_name)
    try:
        running = []
        for i in range(kills):
            while len(running) < 4:  # four members busy at once: the kills land among their changes
                zygote.stdin.write(f"spawn {rng.randrange(1 << 30)}\n")
                zygote.stdin.flush()
                running.append(int(readline(zygote).split()[1]))
            time.sleep(rng.uniform(0, 0.005))
            victim = running.pop(rng.randrange(len(running)))
            os.kill(victim, signal.SIGKILL)
            check_ledger(budget)
        for pid in running:
            os.kill(pid, signal.SIGKILL)
        # Every killed member's share comes back: nobody is left once the dead are seen gone.
        deadline = time.monotonic() + 10
        while budget.state().members and time.monotonic() < deadline:
            time.sleep(0.05)
        state = budget.state()
        assert state.members == () and state.reserved_bytes == 0
    finally:
        zygote.kill()
        zygote.wait(timeout=30)


def test_member_stopped_between_its_write_and_its_swap_stalls_nobody(budget_name):
    budget = SharedBudget.create(budget_name, capacity_bytes=16 * PAGE, page_size=PAGE)
    stopper = start("stop-mid-change", budget_name)
    try:
        assert readline(stopper) == "stopping"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until it is stopped at the hook (state T)
            with open(f"/proc/{stopper.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    break
            time.sleep(0.01)
        me = budget.join(page_size=PAGE, ceiling_bytes=16 * PAGE, name="other")
        t0 = time.monotonic()
        got = budget.grant(me, 4 * PAGE)
        assert time.monotonic() - t0 < 3.0 and got == 4 * PAGE
        check_ledger(budget)
        # Its change was computed from a table that is no longer current: when it resumes, its swap fails
        # and it tries again on the new table.
        os.kill(stopper.pid, signal.SIGCONT)
        assert readline(stopper) == f"resumed {PAGE}"
        state = budget.state()
        assert sorted(m.granted_bytes for m in state.members) == [2 * PAGE, 4 * PAGE]
    finally:
        stopper.kill()
        stopper.wait(timeout=30)


def test_members_stopped_at_random_points_stall_nobody(budget_name):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    budget = SharedBudget.create(budget_name, capacity_bytes=64 * PAGE, page_size=PAGE)
    workers = [start("loop", budget_name, rng.randrange(1 << 30), 120) for _ in range(3)]
    try:
        for w in workers:
            assert readline(w).startswith("joined")
        me = budget.join(page_size=PAGE, ceiling_bytes=64 * PAGE, name="asker")
        worst = 0.0
        for _ in range(40):
            victim = rng.choice(workers)
            time.sleep(rng.uniform(0, 0.02))
            os.kill(victim.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            assert budget.grant(me, PAGE) >= 0
            budget.give_back(me, 0, 0, 0, 0)
            check_ledger(budget)
            worst = max(worst, time.monotonic() - t0)
            os.kill(victim.pid, signal.SIGCONT)
        assert worst < 3.0, worst
    finally:
        for w in workers:
            if w.poll() is None:
                os.kill(w.pid, signal.SIGCONT)
            w.kill()
            w.wait(timeout=30)


def test_a_stopped_members_lease_runs_out_and_it_finds_itself_gone(budget_name):
    budget = SharedBudget.create(budget_name, capacity_bytes=8 * PAGE, page_size=PAGE, lease_s=1.0)
    holder = start("hold", budget_name, "sleeper", 8 * PAGE)
    try:
        assert readline(holder) == f"held {8 * PAGE}"
        me = budget.join(page_size=PAGE, ceiling_bytes=8 * PAGE, name="waiter")
        time.sleep(1.5)  # it renews every 0.5 s: still listed while it runs
        assert [m.name for m in budget.state().members] == ["sleeper", "waiter"]
        assert budget.grant(me, PAGE) == 0
        os.kill(holder.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while budget.grant(me, PAGE) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        state = budget.state()
        assert [m.name for m in state.members] == ["waiter"] and state.members[0].granted_bytes == PAGE
        os.kill(holder.pid, signal.SIGCONT)
        holder.stdin.close()
        assert readline(holder) == "still -1"  # its record is gone: it knows it is no member
        assert holder.wait(timeout=30) == 0
        # Its fenced slot was freed by its own process once it saw itself gone.
        assert {r.index for r in budget.segment.snapshot().records} == {me}
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait(timeout=30)


def test_truncation_gives_every_member_a_typed_error_and_kills_none(budget_name):
    budget = SharedBudget.create(budget_name, capacity_bytes=64 * PAGE, page_size=PAGE)
    workers = [start("loop", budget_name, seed, 120) for seed in range(4)]
    try:
        for w in workers:
            assert readline(w).startswith("joined")
        time.sleep(0.3)
        os.truncate(segment_path(budget_name), 100)
        for w in workers:
            line = readline(w, timeout=30)
            assert line.startswith("error BudgetCorruptError") and "truncated" in line, line
            assert w.wait(timeout=30) == 0  # exited by itself: no signal
        with pytest.raises(BudgetCorruptError, match="truncated"):
            budget.state()
    finally:
        for w in workers:
            w.kill()
            w.wait(timeout=30)


def test_a_fault_past_the_end_of_a_truncated_mapping_is_caught(budget_name):
    budget = SharedBudget.create(budget_name, capacity_bytes=8 * PAGE, page_size=PAGE)
    os.truncate(segment_path(budget_name), 4096)
    m = budget.segment.map
    assert not m.damaged
    assert m.read(segment_bytes() - 64, 64) == bytes(64)  # past the file's end: SIGBUS, caught, zeros
    assert m.damaged
    m.store64(segment_bytes() - 8, 7)  # a store there lands on the private zero page
    with pytest.raises(BudgetCorruptError, match="truncated"):
        budget.state()
    with pytest.raises(IndexError):
        m.read(segment_bytes() - 4, 8)  # beyond the mapping itself: refused before any access


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for PID namespaces")
def test_members_in_separate_pid_namespaces_both_stay_listed(budget_name):
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        pytest.skip("unshare --pid --fork --mount-proc is not permitted here (needs CAP_SYS_ADMIN)")
    budget = SharedBudget.create(budget_name, capacity_bytes=8 * PAGE, page_size=PAGE, lease_s=1.0)
    cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, str(WORKER), "hold"]
    procs, held = [], []
    try:
        for i in range(2):  # one after the other: the first takes the whole budget, the second gets nothing
            procs.append(
                subprocess.Popen(
                    cmd + [budget_name, f"ns-{i}", str(8 * PAGE)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=ENV,
                )  # fmt: skip
            )
            held.append(int(readline(procs[-1]).split()[1]))
        assert held == [8 * PAGE, 0]
        time.sleep(3.0)  # three leases: each one's own thread renews it, so neither drops the other
        state = budget.state()
        assert sorted(m.name for m in state.members) == ["ns-0", "ns-1"]
        assert {m.pid for m in state.members} == {1}  # both are pid 1 in their namespaces
        assert len({m.pid_namespace for m in state.members}) == 2
        assert state.granted_bytes == sum(held) <= state.capacity_bytes
        for p in procs:
            p.stdin.close()
            assert readline(p) == f"still {held[procs.index(p)]}"
            assert p.wait(timeout=30) == 0
        assert budget.state().members == ()
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
