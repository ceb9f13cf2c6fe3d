"""Stress of the shared budget's ledger: many member processes granting and giving back at random while they
are SIGKILLed, SIGSTOPped and SIGCONTed at random (vpaged/memory/budget/ledger.py).

    python benchmarks/stress_budget.py [--members 64] [--seconds 600] [--lease 2] [--out FILE]

The monitor (this process) forks the members (no pools, no torch: they call the ledger directly), and
checks at every turn that the ledger reads (never BudgetCorruptError) and that the members' reserved bytes
never exceed the capacity. Each member checks after each of its calls that its own record holds exactly
the grant it tracked itself (its data intact), and exits with a code saying what went wrong otherwise. One
probe member, never signalled, measures how long a grant + give-back takes while the others are stopped and
killed (the issue's bound: 3 s). A member dropped while stopped (its lease ran out: --lease) finds itself
gone and rejoins. The result (counts, worst latencies, failures: all must be 0) goes to
benchmarks/results/stress_budget-<time>.json; the exit status is 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vpaged.errors import BudgetContentionError, BudgetCorruptError, BudgetError  # noqa: E402
from vpaged.memory.budget.shared import SharedBudget  # noqa: E402

PAGE = 4096
CAPACITY_PAGES = 256
EXIT_GONE, EXIT_CONTENTION, EXIT_CORRUPT, EXIT_MISMATCH, EXIT_OTHER = 10, 11, 20, 30, 40


def member(name: str, seed: int) -> int:
    """A member's life: join, random calls, check its own record after each; returns its exit code."""
    rng = random.Random(seed)
    try:
        budget = SharedBudget.open(name)
        index = budget.join(page_size=PAGE, ceiling_bytes=budget.capacity_bytes, name=f"m{os.getpid()}")
        granted = 0
        while True:
            op = rng.random()
            if op < 0.45:
                got = budget.grant(index, rng.randint(1, 4) * PAGE, prefer=rng.randint(1, 12) * PAGE)
                if got < 0:
                    return EXIT_GONE
                granted += got
            elif op < 0.8:
                granted = rng.randint(0, granted // PAGE) * PAGE
                budget.give_back(index, granted, granted, granted // 2, granted - granted // 2, rng.random() < 0.5)
            else:
                budget.report(index, granted, granted // 2, granted - granted // 2)
            me = budget.member(index)
            if me is None:
                return EXIT_GONE
            if me.granted_bytes != granted:
                print(f"member {os.getpid()}: ledger says {me.granted_bytes}, it holds {granted}", file=sys.stderr)
                return EXIT_MISMATCH
            time.sleep(rng.uniform(0, 0.01))
    except BudgetContentionError:
        return EXIT_CONTENTION
    except BudgetCorruptError as e:
        print(f"member {os.getpid()}: {e}", file=sys.stderr)
        return EXIT_CORRUPT
    except BudgetError as e:
        print(f"member {os.getpid()}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_OTHER


def probe(name: str, seconds: float, fd: int) -> int:
    """Grant and give back every 50 ms; write the worst latency and the count of slow (> 3 s) rounds."""
    budget = SharedBudget.open(name)
    index = budget.join(page_size=PAGE, ceiling_bytes=budget.capacity_bytes, name="probe")
    worst, slow, rounds = 0.0, 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        got = budget.grant(index, PAGE)
        budget.give_back(index, 0, 0, 0, 0)
        took = time.monotonic() - t0
        worst, slow, rounds = max(worst, took), slow + (took > 3.0), rounds + 1
        if got < 0:
            break
        time.sleep(0.05)
    os.write(fd, json.dumps({"probe_worst_s": worst, "probe_slow": slow, "probe_rounds": rounds}).encode())
    return 0


def fork(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:
        code = EXIT_OTHER
        try:
            code = fn(*args)
        finally:
            os._exit(code)
    return pid


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--lease", type=float, default=2.0, help="the budget's lease (s); stops run up to 1.5x it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    name = f"stress-{uuid.uuid4().hex[:10]}"
    budget = SharedBudget.create(name, CAPACITY_PAGES * PAGE, page_size=PAGE, lease_s=args.lease)
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    counts = dict.fromkeys(
        ["kills", "stops", "conts", "spawns", "reads", "gone", "contention", "corrupt", "mismatch", "other",
         "over_capacity", "unreadable"], 0,
    )  # fmt: skip
    exits = {EXIT_GONE: "gone", EXIT_CONTENTION: "contention", EXIT_CORRUPT: "corrupt", EXIT_MISMATCH: "mismatch"}
    worst_read, max_members, peak_reserved = 0.0, 0, 0
    r, w = os.pipe()
    probe_pid = fork(probe, name, args.seconds, w)
    os.close(w)
    alive: dict[int, float | None] = {}  # pid -> when to SIGCONT it (None: running)
    t_end = time.monotonic() + args.seconds
    try:
        while time.monotonic() < t_end:
            while len(alive) < args.members - 1:
                alive[fork(member, name, rng.randrange(1 << 30))] = None
                counts["spawns"] += 1
            now = time.monotonic()
            for pid, until in list(alive.items()):
                if until is not None and now >= until:
                    os.kill(pid, signal.SIGCONT)
                    alive[pid] = None
                    counts["conts"] += 1
            x = rng.random()
            running = [p for p, u in alive.items() if u is None]
            if x < 0.05 and alive:
                victim = rng.choice(list(alive))
                os.kill(victim, signal.SIGKILL)
                counts["kills"] += 1
            elif x < 0.08 and running:
                victim = rng.choice(running)
                os.kill(victim, signal.SIGSTOP)
                alive[victim] = now + rng.uniform(0.01, 1.5 * args.lease)
                counts["stops"] += 1
            while True:  # reap the ended
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid == probe_pid:
                    continue
                alive.pop(pid, None)
                if os.WIFEXITED(status):
                    counts[exits.get(os.WEXITSTATUS(status), "other")] += 1
            t0 = time.monotonic()
            try:
                state = budget.state()
            except BudgetCorruptError as e:
                counts["unreadable"] += 1
                print("unreadable:", e, file=sys.stderr)
                continue
            worst_read = max(worst_read, time.monotonic() - t0)
            counts["reads"] += 1
            max_members = max(max_members, len(state.members))
            peak_reserved = max(peak_reserved, state.reserved_bytes)
            if state.reserved_bytes > state.capacity_bytes:
                counts["over_capacity"] += 1
            time.sleep(0.005)
    finally:
        for pid in alive:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        probe_result = json.loads(os.read(r, 4096) or b"{}")
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
        SharedBudget.remove(name, force=True)
    failures = sum(counts[k] for k in ("corrupt", "mismatch", "other", "over_capacity", "unreadable"))
    failures += probe_result.get("probe_slow", 1)
    result = {
        "members": args.members, "seconds": args.seconds, "lease_s": args.lease, "capacity_bytes": CAPACITY_PAGES * PAGE,
        **counts, "max_members_listed": max_members, "peak_reserved_bytes": peak_reserved,
        "worst_state_read_s": round(worst_read, 4), **probe_result, "failures": failures,
        "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"stress_budget-{int(time.time())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
