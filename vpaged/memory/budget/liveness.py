"""Whether a shared budget's member is still there: a lease its own process renews, and a fast path by pid.

Note (why a lease). A member record names a process, but a pid means something only inside one PID namespace:
two containers sharing /dev/shm (a Kubernetes pod without shareProcessNamespace) see different /proc trees,
and the same pid may be two processes there. So each member's own thread renews a lease (a CLOCK_BOOTTIME
timestamp in its status record, segment.py; the clock is the machine's, the same in every namespace)
every RENEW_S, and a member whose lease is older than the budget's lease length (LEASE_S by default, kept in
the segment's header so that every member uses the same one) is dropped. 10 s: long enough that a member
whose renewing thread waits for a busy interpreter or a loaded machine is not dropped by mistake (its thread
needs the GIL for a few microseconds every 0.5 s), short enough that a stopped member's grant returns to the
others within seconds rather than never.

The fast path: a reader in the member's own PID namespace (recorded at join, the inode of /proc/self/ns/pid)
checks the pid's start time in /proc, so a member killed with SIGKILL returns its share at once, and a reused
pid is not mistaken for it. A reader in another namespace never judges by pid: only the lease counts there.

A member dropped while alive (its lease ran out: stopped, or its thread could not run) is *fenced*, not
freed: its record stays, holding nothing and listed nowhere, so that no new member takes its slot (and the
slot's table buffers) while the old process might still write there when it resumes. The slot is freed when
that process resumes and sees its record fenced, when a reader in its namespace sees it dead, or after
FENCE_GRACE_S.
"""

from __future__ import annotations

import os
import time

LEASE_S = 10.0  # default lease of a new budget (SharedBudget.create(lease_s=...))
RENEW_S = 0.5  # how often a member's thread renews its lease
FENCE_GRACE_S = 600.0  # a fenced slot whose process cannot be seen is reused after this long

USED, FENCED = 1, 2  # a record's state (0: no record)
LIVE, DEAD, EXPIRED, FREE_FENCE = "live", "dead", "expired", "free"


def boottime_ns() -> int:
    """Nanoseconds since boot, counting suspend; the same clock in every PID namespace of the machine."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def pid_namespace() -> int:
    """An id of this process's PID namespace (the inode of /proc/self/ns/pid; 0 where it cannot be read)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_start_ticks(pid: int | str) -> int | None:
    """The start time of `pid` (clock ticks since boot), or None when it is gone or a zombie. "self": this
    process's, right even where /proc is another PID namespace's (a container given the host's /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(b")") + 2 :].split()  # the command name may hold spaces and parentheses
    if fields[0] in (b"Z", b"X"):  # killed but not yet waited for: its memory is already gone
        return None
    return int(fields[19])


# How long a reader believes "that process is alive" (reading /proc/PID/stat cost 0.6 ms on a loaded box, 24 us
# on an idle one). Only readers (state(), headroom, /metrics) use it: a change judges afresh, or a member short
# of pages right after another was killed would be refused on the stale "alive" and stop asking (its grow loop
# gives up once nobody asked is pending, well within 0.1 s).
ALIVE_CACHE_S = 0.1
_alive_seen: dict[tuple[int, int], float] = {}


def is_gone(pid: int, start_ticks: int, fresh: bool = False) -> bool:
    """Whether the process (pid, start time) of this PID namespace is gone. "Gone" is final; "alive" is
    re-checked after ALIVE_CACHE_S, or at once with fresh (what a change uses)."""
    key, now = (pid, start_ticks), time.monotonic()
    seen = _alive_seen.get(key)
    if not fresh and seen is not None and now - seen < ALIVE_CACHE_S:
        return False
    if process_start_ticks(pid) != start_ticks:
        _alive_seen.pop(key, None)
        return True
    if len(_alive_seen) > 4096:
        _alive_seen.clear()
    _alive_seen[key] = now
    return False


def classify(record, now_ns: int, my_pidns: int, lease_ns: int, fresh: bool = False) -> str:
    """LIVE, DEAD (gone for sure: its slot may be reused), EXPIRED (lease ran out: fence it) for a used record;
    for a fenced one FREE_FENCE (its slot may be reused now) or LIVE (keep the fence)."""
    same_namespace = my_pidns != 0 and record.pidns == my_pidns
    gone = same_namespace and is_gone(record.pid, record.start_ticks, fresh)
    if record.state == FENCED:
        return FREE_FENCE if gone or now_ns - record.fenced_ns > int(FENCE_GRACE_S * 1e9) else LIVE
    if gone:
        return DEAD
    if now_ns - max(record.lease_ns, record.joined_ns) > lease_ns:
        return EXPIRED
    return LIVE
