"""The shared budget across processes on the host backend: an idle member gives back within 2 s and its RSS
falls; a member killed with SIGKILL frees its share within 1 s; min_bytes holds; a wrong page size is
refused; every member's data stays intact. Members are tests/budget_worker.py processes driven on stdin."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from process_helpers import wait_until

from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache
from vpaged.errors import OutOfPagesError
from vpaged.memory import SharedBudget

PAGE = 64 * 1024
WORKER = Path(__file__).resolve().parents[1] / "budget_worker.py"


class Member:
    """A worker process; each call sends one command and reads its answer (bounded in time)."""

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=str(WORKER.parent.parent))
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.pid = self.proc.pid

    def __call__(self, *words):
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"worker {self.pid} died"
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def budget_name():
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    SharedBudget.remove(name, force=True)


@pytest.fixture
def members():
    made = []
    yield lambda: made.append(Member()) or made[-1]
    for m in made:
        m.close()


def rss_shmem_kib(pid: int) -> int:
    """Resident shared memory of a process where its pool's memfd pages show, less the budget's own segment
    (its ledger, mapped shared too: the pages of it a member touches move with the table buffers in use)."""
    with open(f"/proc/{pid}/status") as f:
        shmem = next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))
    ledger, in_ledger = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: address range, ..., [path]
                in_ledger = len(head) >= 6 and head[5].startswith("/dev/shm/vpaged-budget.")
            elif in_ledger and head[0] == "Rss:":
                ledger += int(head[1])
    return shmem - ledger


def my_cache(name, **kw):
    return VirtualKVCache(
        KVGeometry(2, 2, 64, torch.float32), VirtualCacheConfig(max_seqs=32, max_seq_len=4096, shared_budget=name, **kw)
    )


def fill(cache, seqs, tokens, rng):
    data = {}
    for _ in range(seqs):
        s = cache.allocate()
        cache.extend(s, tokens)
        data[s] = [torch.randn(2, tokens, 2, 64, generator=rng) for _ in range(2)]
        for layer, kv in enumerate(data[s]):
            cache.write(layer, s, kv[0], kv[1], start=0)
    return data


def intact(cache, data):
    return all(
        torch.equal(cache.kv(layer, s)[0], kv[0]) and torch.equal(cache.kv(layer, s)[1], kv[1])
        for s, layers in data.items()
        for layer, kv in enumerate(layers)
    )


def test_idle_member_gives_back_within_2s_and_its_rss_falls(budget_name, members, rng):
    budget = SharedBudget.create(budget_name, capacity_bytes=96 * PAGE)
    a = members()
    assert a("join", budget_name)["ok"]
    assert a("fill", 10, 256, 7)["ok"]  # 10 sequences x 8 pages: 80 pages, written
    assert a("free", 9)["ok"]  # one stays live (8 pages); 72 pages dormant, still resident
    rss_before = rss_shmem_kib(a.pid)
    assert rss_before >= 80 * PAGE // 1024
    cache = my_cache(budget_name)
    t0 = time.monotonic()
    mine = fill(cache, 10, 256, rng)  # 80 pages: only a's dormant pages make room; a is idle in readline()
    took = time.monotonic() - t0
    assert took < 2.0, f"an idle member took {took:.2f} s to give back"
    assert wait_until(lambda: rss_shmem_kib(a.pid) <= rss_before - 64 * PAGE // 1024, 2.0)
    assert a("check") == {"ok": True, "seqs": 1} and intact(cache, mine)
    state = budget.state()
    assert state.granted_bytes <= state.capacity_bytes
    with pytest.raises(OutOfPagesError):  # 16 more pages: only a's live sequence (8 pages) could give them
        fill(cache, 2, 256, rng)
    assert a("check") == {"ok": True, "seqs": 1} and intact(cache, mine)


def test_sigkill_member_share_usable_within_1s(budget_name, members, rng):
    SharedBudget.create(budget_name, capacity_bytes=64 * PAGE)
    a = members()
    assert a("join", budget_name)["ok"]
    assert a("fill", 8, 256, 3)["ok"]  # all 64 pages, live
    cache = my_cache(budget_name)
    a.proc.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    mine = fill(cache, 8, 256, rng)  # the whole budget: only a's death frees it
    took = time.monotonic() - t0
    assert took < 1.0, f"a killed member's share took {took:.2f} s to come back"
    assert intact(cache, mine)


def test_min_bytes_is_honoured_and_a_wrong_page_size_refused(budget_name, members, rng):
    SharedBudget.create(budget_name, capacity_bytes=64 * PAGE)
    a = members()
    assert a("join", budget_name, 32 * PAGE)["ok"]  # guaranteed 32 pages
    assert a("fill", 1, 256, 5)["ok"]  # uses 8 of them
    cache = my_cache(budget_name)
    mine = fill(cache, 4, 256, rng)  # 32 pages: all that is not a's minimum
    with pytest.raises(OutOfPagesError):
        fill(cache, 1, 256, rng)
    t0 = time.monotonic()
    assert a("fill", 3, 256, 6)["ok"]  # a grows into its minimum at once, nobody waits
    assert time.monotonic() - t0 < 1.0
    assert a("check") == {"ok": True, "seqs": 4} and intact(cache, mine)
    b = members()
    refused = b("join", budget_name, 0, 2 * PAGE)
    assert refused["error"] == "BudgetMismatchError" and "pages of 65536 bytes" in refused["message"]
    greedy = members()
    refused = greedy("join", budget_name, 40 * PAGE)
    assert refused["error"] == "BudgetMismatchError" and "cannot guarantee" in refused["message"]
