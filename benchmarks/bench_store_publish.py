"""The page store's publish cost: PageStore.publish of each page against PageStore.publish_many of batches, side by
side in one run, on stores of several capacities.

A publish reads the store's whole slot table (capacity x 64 bytes) twice: once to find a free slot and settle a
key already there, once to look for a racing publisher of its key. publish_many reads it twice per batch. The
workload is what a cache publishes for one prompt: PAGES pages of PAGE_BYTES (default 1,860 of 64 KiB: a
2,700-token prompt of SmolLM2-135M in fp32, 30 layers x K and V of 3 heads x 64 dims, 60 pages a block), into a
store that already holds FILL of its capacity, so that later publishes evict as in service. Arms: one publish per
page; publish_many of one block (60 pages); publish_many of 32 MiB (what StoreLink stages). Reported: median ms
per page over REPEATS fresh stores, and each arm's ratio to the one-by-one arm.

    .venv/bin/python benchmarks/bench_store_publish.py [--capacities 4096,24576,65536] [--pages 1860] [--repeats 5]

Writes benchmarks/results/OUTPUT (default store-publish.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, write_json  # noqa: E402

from vpaged.memory.store import PUBLISHED, PageStore  # noqa: E402


def one_by_one(store: PageStore, pages: list[tuple[bytes, bytes]]) -> list[str]:
    return [store.publish(key, data) for key, data in pages]


def batched(per_batch: int):
    def publish(store: PageStore, pages: list[tuple[bytes, bytes]]) -> list[str]:
        out: list[str] = []
        for at in range(0, len(pages), per_batch):
            out += store.publish_many(pages[at : at + per_batch])
        return out

    return publish


def seconds_per_page(arm, capacity: int, page_bytes: int, n: int, fill: float) -> float:
    """One fresh store, FILL of it published beforehand (not timed), then n new pages through `arm`."""
    name = f"bench-publish-{uuid.uuid4().hex[:10]}"
    try:
        with PageStore.open(name, create=True, capacity_pages=capacity, page_bytes=page_bytes) as store:
            filler = os.urandom(page_bytes)
            store.publish_many([(os.urandom(32), filler) for _ in range(int(capacity * fill))])
            pages = [(os.urandom(32), os.urandom(page_bytes)) for _ in range(n)]
            t0 = time.perf_counter()
            outcomes = arm(store, pages)
            elapsed = time.perf_counter() - t0
            assert outcomes == [PUBLISHED] * n, "every page of the workload is new"
            return elapsed / n
    finally:
        PageStore.remove(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capacities", default="4096,24576,65536")
    ap.add_argument("--pages", type=int, default=1860)
    ap.add_argument("--page-bytes", type=int, default=64 << 10)
    ap.add_argument("--block-pages", type=int, default=60, help="pages of one block (runs of a slot)")
    ap.add_argument("--fill", type=float, default=0.9, help="share of the store published before the timed run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", default="store-publish.json", help="results file name under benchmarks/results/")
    args = ap.parse_args()
    per_32mib = max(args.block_pages, (32 << 20) // args.page_bytes // args.block_pages * args.block_pages)
    arms = {
        "publish each page": one_by_one,
        f"publish_many, {args.block_pages} pages": batched(args.block_pages),
        f"publish_many, {per_32mib} pages": batched(per_32mib),
    }
    cells, table = [], []
    for capacity in map(int, args.capacities.split(",")):
        samples: dict[str, list[float]] = {a: [] for a in arms}
        for _ in range(args.repeats):  # arms alternated, a fresh store each
            for name, arm in arms.items():
                samples[name].append(seconds_per_page(arm, capacity, args.page_bytes, args.pages, args.fill))
        base = statistics.median(samples["publish each page"])
        for name in arms:
            ms = 1e3 * statistics.median(samples[name])
            cells.append(dict(capacity=capacity, arm=name, ms_per_page=ms, ratio=ms / (1e3 * base)))
            table.append([capacity, name, f"{ms:.3f}", f"{ms / (1e3 * base):.2f}"])
    print_table(["capacity pages", "arm", "ms / page", "vs one by one"], table)
    path = write_json(args.output, dict(machine=machine(), args=vars(args), cells=cells))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
