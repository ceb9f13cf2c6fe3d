"""`vpaged budget create | show | limit | remove`: the machine-wide shared budget from the shell (what
kvcached's kvctl does for its instances). The ledger itself is vpaged/memory/budget/shared.py.

Every error is one line on stderr (`vpaged budget: ...`) and exit status 1: a bad name, size or page size,
a budget that is missing, damaged, in use (`remove` without --force) or another user's; never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import sys
from dataclasses import asdict

from ..errors import InvalidArgumentError, VPagedError
from ..memory.budget.policy import DEFAULT_SHARE_POLICY, SHARE_POLICIES
from ..memory.budget.segment import check_budget_name as check_name
from ..memory.budget.shared import BudgetState, SharedBudget

_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):  # binary multiples, whichever way they are written
    _UNITS.update({_p: 1024**_i, f"{_p}b": 1024**_i, f"{_p}ib": 1024**_i})
_MAX_BYTES = 1 << 62  # beyond any machine's memory (and the ledger's 64-bit fields)


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '4G', '1.5gib' -> bytes (k, m, g, t are powers of 1024). InvalidArgumentError
    (a ValueError) for anything else: no unit known, not a finite number >= 0, or past 2**62."""
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :]
    try:
        value = float(num) * _UNITS[unit] if num else math.nan
    except (KeyError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0 or value > _MAX_BYTES:
        raise InvalidArgumentError(f"not a size: {text!r} (examples: 1073741824, 512MiB, 4GiB; at most 2**62)")
    return int(value)


def check_page_size(page_size: int) -> int:
    """A members' page size: a positive multiple of the OS page size (what a host pool maps; a CUDA pool's
    2 MiB granularity is one too)."""
    if page_size <= 0 or page_size % mmap.PAGESIZE:
        raise InvalidArgumentError(
            f"--page-size must be a positive multiple of the OS page size ({mmap.PAGESIZE} bytes), got {page_size}"
        )
    return page_size


def mib(n: int) -> str:
    """Bytes as MiB with one decimal (and thousands separators), as the commands print sizes."""
    return f"{n / 2**20:,.1f}"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "budget",
        help="a machine-wide KV memory budget that pools of several processes share",
        description="Create, inspect, limit or remove a shared budget (a segment in /dev/shm, 0600). Pools, "
        "caches and engines join it with shared_budget=NAME (vpaged serve --shared-budget NAME).",
    )
    cmds = p.add_subparsers(dest="budget_command", required=True)
    c = cmds.add_parser("create", help="create a budget of N bytes")
    c.add_argument("name")
    c.add_argument("--bytes", required=True, help="capacity, e.g. 8GiB")
    c.add_argument("--page-size", default="64KiB", help="members' page size: a multiple of the OS page (default 64KiB)")
    c.add_argument("--group", action="store_true", help="mode 0660: the owner's group may join too")
    c.add_argument(
        "--share-policy",
        choices=sorted(SHARE_POLICIES),
        default=DEFAULT_SHARE_POLICY,
        help="under contention: 'greedy' (default) lets whoever asks take what the others do not use live; "
        "'fair' also caps admissions above a member's fair share while another member is starved",
    )
    c.set_defaults(func=cmd_create)
    s = cmds.add_parser("show", help="list the members: pid, name, model, mapped / live / dormant, min, ceiling")
    s.add_argument("name")
    s.add_argument("--json", action="store_true", help="print the state as JSON")
    s.set_defaults(func=cmd_show)
    lim = cmds.add_parser("limit", help="change a member's ceiling at run time")
    lim.add_argument("name")
    which = lim.add_mutually_exclusive_group(required=True)
    which.add_argument("--member", help="the member's name (a name only: never read as an index or pid)")
    which.add_argument("--index", type=int, help="the member's index (the # column of `vpaged budget show`)")
    which.add_argument("--pid", type=int, help="the members of this process id")
    lim.add_argument("--max", required=True, help="the new ceiling, e.g. 2GiB")
    lim.set_defaults(func=cmd_limit)
    r = cmds.add_parser("remove", help="remove the budget's segment (refused while members use it)")
    r.add_argument("name")
    r.add_argument(
        "--force",
        action="store_true",
        help="remove it even while members use it: they report it (/health 503) and rejoin a budget created "
        "again under the name",
    )
    r.set_defaults(func=cmd_remove)


def run_command(command: str, fn, args) -> int:
    """fn(args), its errors one line on stderr (`vpaged COMMAND: ...`) and exit status 1, never a traceback:
    how `vpaged budget` and `vpaged store` report bad input, missing or damaged segments and files."""
    try:
        return fn(args)
    except (VPagedError, ValueError, OverflowError) as e:
        print(f"vpaged {command}: {one_line(str(e))}", file=sys.stderr)
    except OSError as e:  # e.g. another user's file in /dev/shm (sticky): not this user's to remove
        where = f" ({e.filename})" if e.filename else ""
        print(f"vpaged {command}: {e.strerror or type(e).__name__}{where}", file=sys.stderr)
    return 1


def _run(fn, args) -> int:
    return run_command("budget", fn, args)


def one_line(text: str) -> str:
    """An error's text on one line: how the commands report it on stderr."""
    return " ".join(text.split())


@contextlib.contextmanager
def _opened(name: str):
    """The budget, closed however the command ends (a damaged one too, without a word at exit)."""
    budget = SharedBudget.open(check_name(name))
    try:
        yield budget
    finally:
        with contextlib.suppress(Exception):
            budget.close()


def cmd_create(args) -> int:
    def go(a):
        mode = 0o660 if a.group else 0o600
        name, capacity, page_size = check_name(a.name), parse_bytes(a.bytes), check_page_size(parse_bytes(a.page_size))
        b = SharedBudget.create(name, capacity, page_size=page_size, mode=mode, share_policy=a.share_policy)
        print(
            f"created budget {a.name!r}: {mib(b.capacity_bytes)} MiB in pages of {b.page_size} bytes, "
            f"share policy {b.policy.name}"
        )
        b.close()
        return 0

    return _run(go, args)


def cmd_show(args) -> int:
    def go(a):
        with _opened(a.name) as b:
            state = b.state()
        if a.json:
            print(json.dumps(asdict(state) | {"free_bytes": state.free_bytes}, indent=2))
        else:
            print_state(state)
        return 0

    return _run(go, args)


def print_state(state: BudgetState) -> None:
    head = (
        f"budget {state.name}: {mib(state.capacity_bytes)} MiB, granted {mib(state.granted_bytes)} MiB, "
        f"free {mib(state.free_bytes)} MiB, pages of {state.page_size} bytes, share policy {state.share_policy}"
    )
    cols = ["#", "pid", "name", "model", "granted", "mapped", "live", "dormant", "min", "ceiling", "fair", "starved"]
    rows = [
        [str(m.index), str(m.pid), m.name, m.model or "-"]
        + [mib(x) for x in (m.granted_bytes, m.mapped_bytes, m.live_bytes, m.dormant_bytes, m.min_bytes)]
        + [mib(m.ceiling_bytes), mib(m.fair_share_bytes), "yes" if m.starved else "-"]
        for m in state.members
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(head + " (MiB below)")
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        for r in [cols, *rows]:
            print("  ".join(x.rjust(w) for x, w in zip(r, widths)))
        return
    table = Table(title=head + " (MiB)")
    for c in cols:
        table.add_column(c, justify="left" if c in ("name", "model") else "right")
    for r in rows:
        table.add_row(*r)
    console = Console()
    Console(width=max(console.width, 160) if not console.is_terminal else None).print(table)  # piped: no wrap


def cmd_limit(args) -> int:
    def go(a):
        max_bytes = parse_bytes(a.max)
        with _opened(a.name) as b:
            if a.member is not None:
                changed = b.set_ceiling(a.member, max_bytes)
            else:
                changed = b.set_ceiling(max_bytes=max_bytes, index=a.index, pid=a.pid)
        print(f"ceiling of member(s) {', '.join(map(str, changed))} set to {mib(max_bytes)} MiB")
        return 0

    return _run(go, args)


def cmd_remove(args) -> int:
    def go(a):
        if SharedBudget.remove(check_name(a.name), force=a.force):
            print(f"removed budget {a.name!r}")
            return 0
        print(f"vpaged budget: no budget named {a.name!r}", file=sys.stderr)
        return 1

    return _run(go, args)
