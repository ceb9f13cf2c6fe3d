"""Member processes of a shared budget's ledger for the fault tests (tests/memory/test_budget_ledger_faults.py) and
benchmarks/stress_budget.py. No pool, no torch: members call the ledger directly, as fast as they can.

  python ledger_worker.py loop NAME SEED [SECONDS]
      join, print "joined INDEX" and loop random grant / give_back / report / state calls; on a typed budget
      error print "error CLASS: message" and exit 0; after SECONDS (default: forever) print "done" and leave.
  python ledger_worker.py zygote NAME
      import everything once, then fork one `loop` child per line "spawn SEED" read on stdin (printing
      "pid PID"), so that thousands of members can be started and killed quickly; children are reaped
      automatically.
  python ledger_worker.py stop-mid-change NAME
      join, grant a page, then set the ledger's test hook so that the next change stops this process
      (SIGSTOP) between writing its table buffer and its compare-and-swap; print "stopping", grant again.
      After SIGCONT it prints "resumed RESULT" and waits for stdin to close.
  python ledger_worker.py hold NAME MEMBER_NAME BYTES
      join as MEMBER_NAME, grant up to BYTES, print "held GRANTED", and stay (renewing its lease) until
      stdin closes; then print the grant once more ("still GRANTED", -1 if gone) and leave.
"""

import os
import random
import signal
import sys
import time

from vpaged.errors import BudgetError
from vpaged.memory.budget import ledger as budget_ledger
from vpaged.memory.budget.shared import SharedBudget

PAGE = 4096


def say(*words) -> None:
    print(*words, flush=True)


def loop(name: str, seed: int, seconds: float | None) -> None:
    rng = random.Random(seed)
    try:
        budget = SharedBudget.open(name)
        index = budget.join(page_size=PAGE, ceiling_bytes=budget.capacity_bytes, name=f"m{os.getpid()}-{seed}")
        say("joined", index)
        end = None if seconds is None else time.monotonic() + seconds
        granted = 0
        while end is None or time.monotonic() < end:
            op = rng.random()
            if op < 0.4:
                got = budget.grant(index, rng.randint(1, 8) * PAGE, prefer=rng.randint(1, 16) * PAGE)
                if got < 0:
                    say("gone")
                    return
                granted += got
            elif op < 0.7:
                granted = rng.randint(0, granted // PAGE) * PAGE
                budget.give_back(index, granted, granted, granted // 2, granted - granted // 2, rng.random() < 0.5)
            elif op < 0.9:
                budget.report(index, granted, granted // 2, granted - granted // 2)
            else:
                state = budget.state()
                assert state.reserved_bytes <= state.capacity_bytes, state
        budget.leave(index)
        say("done")
    except BudgetError as e:
        say("error", f"{type(e).__name__}: {e}")


def zygote(name: str) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed children vanish at once (no zombies to reap)
    SharedBudget.open(name).close()  # imports and the mapping code warm, in the parent only
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd != "spawn":
            continue
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)
            try:
                loop(name, int(args[0]), None)
            finally:
                os._exit(0)
        say("pid", pid)


def stop_mid_change(name: str) -> None:
    budget = SharedBudget.open(name)
    index = budget.join(page_size=PAGE, ceiling_bytes=budget.capacity_bytes, name="stopper")
    budget.grant(index, PAGE)

    def stop_once():
        budget_ledger.before_commit = None  # the retry after SIGCONT runs through
        os.kill(os.getpid(), signal.SIGSTOP)

    budget_ledger.before_commit = stop_once
    say("stopping")
    result = budget.grant(index, PAGE)
    say("resumed", result)
    sys.stdin.read()


def hold(name: str, member_name: str, want: int) -> None:
    budget = SharedBudget.open(name)
    index = budget.join(page_size=PAGE, ceiling_bytes=budget.capacity_bytes, name=member_name)
    got = max(0, budget.grant(index, PAGE, prefer=want))
    while got < want:
        more = budget.grant(index, PAGE)
        if more <= 0:
            break
        got += more
    say("held", got)
    sys.stdin.read()
    me = budget.member(index)
    say("still", -1 if me is None else me.granted_bytes)
    budget.leave(index)


if __name__ == "__main__":
    mode, name, *rest = sys.argv[1:]
    if mode == "loop":
        loop(name, int(rest[0]), float(rest[1]) if len(rest) > 1 else None)
    elif mode == "zygote":
        zygote(name)
    elif mode == "stop-mid-change":
        stop_mid_change(name)
    elif mode == "hold":
        hold(name, rest[0], int(rest[1]))
