"""A member process of a shared budget, driven line by line on stdin (tests/memory/test_shared_budget_procs.py).

Commands (one per line; each answers one JSON line on stdout):
  join NAME [MIN_BYTES] [PAGE_SIZE]   a VirtualKVCache on a private pool in budget NAME
  fill SEQS TOKENS SEED               SEQS sequences of TOKENS tokens each, K/V random from SEED
  free K                              free the first K sequences (their pages stay mapped: dormant)
  check                               the live sequences' K/V equal what was written
  stats                               pool figures
  quit
Between commands the process blocks in readline(): alive, idle, not calling into vpaged.
"""

import json
import os
import sys

import torch

from vpaged import KVGeometry, VirtualCacheConfig, VirtualKVCache
from vpaged.errors import VPagedError

LAYERS, HEADS, DIM = 2, 2, 64  # 512 bytes per token per layer and K/V: 128 tokens per 64 KiB page


def rss_shmem_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    cache, data = None, {}
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "join":
                page_size = int(args[2]) if len(args) > 2 else None
                cache = VirtualKVCache(
                    KVGeometry(LAYERS, HEADS, DIM, torch.float32),
                    VirtualCacheConfig(
                        max_seqs=32,
                        max_seq_len=4096,
                        shared_budget=args[0],
                        min_bytes=int(args[1]) if len(args) > 1 else 0,
                        page_size=page_size,
                    ),
                )
                out = {"ok": True, "pid": os.getpid()}
            elif cmd == "fill":
                seqs, tokens, seed = (int(a) for a in args)
                g = torch.Generator().manual_seed(seed)
                for _ in range(seqs):
                    s = cache.allocate()
                    cache.extend(s, tokens)
                    data[s] = [torch.randn(2, tokens, HEADS, DIM, generator=g) for _ in range(LAYERS)]
                    for layer, kv in enumerate(data[s]):
                        cache.write(layer, s, kv[0], kv[1], start=0)
                out = {"ok": True}
            elif cmd == "free":
                for s in sorted(data)[: int(args[0])]:
                    cache.free(s)
                    del data[s]
                out = {"ok": True}
            elif cmd == "check":
                good = all(
                    torch.equal(cache.kv(layer, s)[0], kv[0]) and torch.equal(cache.kv(layer, s)[1], kv[1])
                    for s, layers in data.items()
                    for layer, kv in enumerate(layers)
                )
                out = {"ok": good, "seqs": len(data)}
            elif cmd == "stats":
                s = cache.pool.stats()
                out = {"ok": True, "used": s.used_pages, "limit": s.free_pages + s.used_pages}
            elif cmd == "quit":
                return
            else:
                out = {"ok": False, "error": f"unknown command {cmd}"}
        except VPagedError as e:
            out = {"ok": False, "error": type(e).__name__, "message": str(e)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
