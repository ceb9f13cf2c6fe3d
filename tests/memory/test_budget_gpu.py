"""A shared budget on a real GPU: two member processes on one device pass device memory to each other.

Each member is this file run as a script (`python test_budget_gpu.py member`), driven line by line on stdin:
a VirtualKVCache on cuda:0 in its own pool, joined to one SharedBudget; K/V written and checked through torch
on the device. Between commands a member blocks in readline() (idle, not calling into vpaged): what it gives
back it gives from its budget thread. tests/memory/test_cuda_budget_fake.py checks the same two members in one
process under the fake driver; tests/memory/test_shared_budget_procs.py the host backend in processes.

Marked gpu: skipped with the reason where torch or vpaged cannot use CUDA (scripts/gpu_check.sh runs it).
"""

import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import vpaged._C as C

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
LAYERS, HEADS, DIM, DTYPE = 1, 8, 128, torch.bfloat16  # 2 KiB per token for K and for V
TOKENS = 2048  # one full sequence: 8 MiB of K/V, 4 pages of 2 MiB
ANSWER_S = 120.0  # a member's answer to one command: CUDA's start in a fresh process, a wait for the other


def cuda_problem() -> str:
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no usable CUDA device"
    return C.cuda_unavailable_reason(0)


@pytest.fixture(scope="module", autouse=True)
def needs_cuda():
    reason = cuda_problem()
    if reason:
        pytest.skip(reason)


class Member:
    """A member process; each call sends one command and returns its JSON answer (bounded in time)."""

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "member"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()

    def __call__(self, *words) -> dict:
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()
        try:
            line = self.lines.get(timeout=ANSWER_S)
        except queue.Empty:
            raise AssertionError(f"member {self.proc.pid} gave no answer to {words} in {ANSWER_S:.0f} s") from None
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self("quit")
            except (AssertionError, BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


@pytest.fixture
def budget_name():
    from vpaged.memory import SharedBudget

    name = f"test-gpu-{uuid.uuid4().hex[:12]}"
    yield name
    SharedBudget.remove(name, force=True)


@pytest.fixture
def members():
    made = []
    yield lambda: made.append(Member()) or made[-1]
    for m in made:
        m.close()


def test_two_member_processes_pass_device_memory_through_one_budget(budget_name, members):
    """A fills the whole budget with K/V on the GPU, frees all but one sequence and goes idle; B's sequences
    need A's pages and get them (A's budget thread gives its free and dormant pages back and releases their
    device memory); both members' live K/V read back exactly; A's live sequence is never taken."""
    from vpaged.memory import SharedBudget

    page = C.cuda_granularity(0)
    seq_pages = -(-2 * LAYERS * TOKENS * HEADS * DIM * DTYPE.itemsize // page)  # K and V of one full sequence
    budget_pages = 4 * seq_pages
    budget = SharedBudget.create(budget_name, capacity_bytes=budget_pages * page, page_size=page)
    a, b = members(), members()  # both start at once: their imports and CUDA's start overlap
    assert a("join", budget_name)["ok"] and b("join", budget_name)["ok"]
    assert a("fill", 4, 11) == {"ok": True}
    assert a("stats")["used"] == budget_pages
    assert a("free", 3) == {"ok": True}  # dormant: mapped, A's until the budget asks for them

    assert b("fill", 3, 22) == {"ok": True}  # only A's pages make room
    a_stats = a("stats")
    assert a_stats["used"] == seq_pages, a_stats
    deadline = time.monotonic() + 30  # A's device memory: released by its budget thread as it gave back
    while a_stats["created"] > seq_pages and time.monotonic() < deadline:
        time.sleep(0.1)
        a_stats = a("stats")
    assert a_stats["created"] == seq_pages, a_stats
    assert a("check") == {"ok": True, "seqs": 1}
    assert b("check") == {"ok": True, "seqs": 3}
    state = budget.state()
    assert state.granted_bytes <= state.capacity_bytes

    answer = b("fill", 1, 33)  # a fourth sequence would need A's live one
    assert answer["ok"] is False and answer["error"] == "OutOfPagesError", answer
    assert a("check") == {"ok": True, "seqs": 1} and b("check") == {"ok": True, "seqs": 3}
    assert a("stats")["used"] == seq_pages


# ---- the member process ----


def _member() -> None:
    from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache
    from vpaged.errors import VPagedError

    dev = torch.device("cuda", 0)
    cache, data = None, {}
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "join":
                config = VirtualCacheConfig(max_seqs=4, max_seq_len=TOKENS, device=dev, shared_budget=args[0])
                cache = VirtualKVCache(KVGeometry(LAYERS, HEADS, DIM, DTYPE), config)
                out = {"ok": True, "pid": os.getpid()}
            elif cmd == "fill":
                seqs, seed = int(args[0]), int(args[1])
                gen = torch.Generator(device=dev).manual_seed(seed)
                for _ in range(seqs):
                    s = cache.allocate()
                    cache.extend(s, TOKENS)
                    kv = [
                        [torch.randn(TOKENS, HEADS, DIM, device=dev, dtype=DTYPE, generator=gen) for _ in range(2)]
                        for _ in range(LAYERS)
                    ]
                    for layer, (k, v) in enumerate(kv):
                        cache.write(layer, s, k, v, start=0)
                    data[s] = kv
                torch.cuda.synchronize(dev)
                out = {"ok": True}
            elif cmd == "free":
                for s in sorted(data)[: int(args[0])]:
                    cache.free(s)
                    del data[s]
                out = {"ok": True}
            elif cmd == "check":
                good = all(
                    torch.equal(cache.kv(layer, s)[0], k) and torch.equal(cache.kv(layer, s)[1], v)
                    for s, layers in data.items()
                    for layer, (k, v) in enumerate(layers)
                )
                out = {"ok": good, "seqs": len(data)}
            elif cmd == "stats":
                s = cache.pool.stats()
                out = {"ok": True, "used": s.used_pages, "created": s.created_pages}
            elif cmd == "quit":
                out = {"ok": True}
            else:
                out = {"ok": False, "error": f"unknown command {cmd}"}
        except VPagedError as e:
            out = {"ok": False, "error": type(e).__name__, "message": str(e)}
        print(json.dumps(out), flush=True)
        if cmd == "quit":
            break
    if cache is not None:
        cache.close()
        cache.pool.leave_budget()


if __name__ == "__main__":
    if sys.argv[1:] == ["member"]:
        _member()
