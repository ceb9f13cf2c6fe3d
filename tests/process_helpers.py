"""What tests ask of this process and its host: polling for a condition, open descriptors, mappings (from
/proc). A plain module on the tests' path (pyproject's pythonpath), so any area imports it by name."""

import os
import time


def wait_until(cond, timeout: float) -> bool:
    """Poll cond every 20 ms until it holds or timeout seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def mapping_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def address_is_mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False
