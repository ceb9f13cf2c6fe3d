"""The cache kinds the simulator compares (how KV memory is held), each over the real cache code where one
exists. (Earlier releases called them "policies"; the policies of vpaged are the eviction and scheduling
strategies of kvcache/eviction.py and serve/policies.py.)

- StaticSlots: every sequence reserves max_seq_len tokens when admitted (static batching, no sharing).
- BlockTables: vpaged.PagedKVCache (vLLM-style blocks of 8/16/32 tokens) on its accounting-only mode.
- VirtualMemory: vpaged.VirtualKVCache on an accounting-only PagePool, any layout and page size.
With `share`, a request's n samples fork its prompt (pages or blocks shared) and prompts that start with
the same prefix reuse its cached full pages/blocks; without it, every sample holds its own copy.

A kind admits a request (maps its prompt) or says it does not fit now, grows every running sequence by
one token per decode step (raising OutOfPagesError when the step cannot get its pages), releases finished
requests and reports where its memory goes (vpaged.accounting.MemoryBreakdown).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import OutOfPagesError, SlotsExhaustedError
from ..kvcache import VirtualCacheConfig, VirtualKVCache
from ..kvcache.accounting import MemoryBreakdown, breakdown_of, page_fill
from ..kvcache.paged import PagedCacheConfig, PagedKVCache
from ..memory.pool import PagePool
from .shapes import ModelShape
from .traces import SimRequest


@dataclass
class Running:
    """One admitted request: its sequences (n samples) and their common length."""

    request: SimRequest
    seqs: list[int]
    length: int
    generated: int = 0
    preemptions: int = 0
    extra: dict = field(default_factory=dict)


class CacheKind:
    name: str
    budget_bytes: int

    def admit(self, req: SimRequest, prompt_len: int) -> Running | None:
        raise NotImplementedError

    def step(self, running: list[Running]) -> None:
        raise NotImplementedError

    def release(self, run: Running) -> None:
        raise NotImplementedError

    def breakdown(self) -> MemoryBreakdown:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _TokenIds:
    """Token ids for simulated prompts: a shared prefix gets the same ids every time, the rest never repeats."""

    def __init__(self):
        self._next = 1 << 40

    def prompt(self, req: SimRequest, prompt_len: int) -> list[int]:
        shared = min(req.prefix_len, prompt_len) if req.prefix_id is not None else 0
        ids = [(req.prefix_id << 24) + i for i in range(shared)]
        rest = prompt_len - shared
        ids += range(self._next, self._next + rest)
        self._next += rest
        return ids


class StaticSlots(CacheKind):
    def __init__(self, shape: ModelShape, budget_bytes: int, max_seq_len: int):
        self.name = "static"
        self.budget_bytes = budget_bytes
        self.slot_bytes = max_seq_len * shape.bytes_per_token
        self.bpt = shape.bytes_per_token
        self.slots = budget_bytes // self.slot_bytes
        self._live: set[int] = set()
        self._next = 0
        self._runs: dict[int, Running] = {}

    def admit(self, req, prompt_len):
        if len(self._live) + req.n > self.slots:
            return None
        seqs = list(range(self._next, self._next + req.n))
        self._next += req.n
        self._live.update(seqs)
        run = Running(req, seqs, prompt_len)
        self._runs[seqs[0]] = run
        return run

    def step(self, running):
        pass  # the slots were reserved at admission

    def release(self, run):
        self._live.difference_update(run.seqs)
        del self._runs[run.seqs[0]]

    def breakdown(self):
        stored = sum(r.length * len(r.seqs) for r in self._runs.values()) * self.bpt
        return MemoryBreakdown(stored, 0, len(self._live) * self.slot_bytes - stored, 0)


class BlockTables(CacheKind):
    def __init__(
        self, shape: ModelShape, budget_bytes: int, max_seq_len: int, block_size: int, share: bool, max_seqs: int
    ):
        self.name = f"block {block_size}" + (" +share" if share else "")
        self.budget_bytes = budget_bytes
        self.share = share
        self.cache = PagedKVCache(
            shape.geometry,
            PagedCacheConfig(
                max_seqs=max_seqs,
                max_seq_len=max_seq_len,
                capacity_bytes=budget_bytes,
                block_size=block_size,
                accounting_only=True,
            ),
        )
        self._templates: dict[int, int] = {}  # prefix id -> a sequence holding the prefix's full blocks
        self._template_use: dict[int, int] = {}  # prefix id -> running requests forked from it

    def _template(self, req: SimRequest) -> int | None:
        if not self.share or req.prefix_id is None:
            return None
        bs = self.cache.block_size
        full = req.prefix_len // bs * bs
        if full == 0:
            return None
        if req.prefix_id not in self._templates:
            seq = self.cache.allocate()
            try:
                self.cache.extend(seq, full)
            except OutOfPagesError:
                self.cache.free(seq)
                raise
            self._templates[req.prefix_id] = seq
            self._template_use[req.prefix_id] = 0
        return self._templates[req.prefix_id]

    def admit(self, req, prompt_len):
        for attempt in range(2):
            try:
                return self._admit(req, prompt_len)
            except (OutOfPagesError, SlotsExhaustedError):
                if attempt or not self._drop_unused_templates():
                    return None
        return None

    def _admit(self, req, prompt_len):
        c = self.cache
        template = self._template(req)
        seqs: list[int] = []
        try:
            if template is not None:
                first = c.fork(template)
                seqs.append(first)
                c.extend(first, prompt_len - c.seq_len(template))
            else:
                first = c.allocate()
                seqs.append(first)
                c.extend(first, prompt_len)
            for _ in range(req.n - 1):
                if self.share:
                    seqs.append(c.fork(first))
                else:
                    seqs.append(c.allocate())
                    c.extend(seqs[-1], prompt_len)
        except (OutOfPagesError, SlotsExhaustedError):
            for s in seqs:
                c.free(s)
            raise
        if template is not None:
            self._template_use[req.prefix_id] += 1
        return Running(req, seqs, prompt_len, extra={"template": template is not None})

    def _drop_unused_templates(self) -> bool:
        unused = [p for p, n in self._template_use.items() if n == 0]
        for p in unused:
            self.cache.free(self._templates.pop(p))
            del self._template_use[p]
        return bool(unused)

    def step(self, running):
        self.cache.extend_many([s for r in running for s in r.seqs], 1)

    def release(self, run):
        for s in run.seqs:
            self.cache.free(s)
        if run.extra.get("template"):
            self._template_use[run.request.prefix_id] -= 1

    def breakdown(self):
        c, bs = self.cache, self.cache.block_size
        template_seqs = set(self._templates.values())
        blocks, fill = [], []
        for seq in c.sequences:
            if seq in template_seqs:
                continue
            table, n = c.blocks(seq), c.seq_len(seq)
            blocks += table
            fill += [min(bs, n - i * bs) for i in range(len(table))]
        used = page_fill(blocks, fill)
        stored_rows = sum(used.values())
        kept = {b for s in template_seqs for b in c.blocks(s)} - used.keys()
        row = c.bytes_per_token
        return MemoryBreakdown(stored_rows * row, (len(used) * bs - stored_rows) * row, 0, len(kept) * bs * row)

    def close(self):
        self.cache.close()


class VirtualMemory(CacheKind):
    def __init__(
        self,
        shape: ModelShape,
        budget_bytes: int,
        max_seq_len: int,
        layout: str,
        page_size: int,
        share: bool,
        max_seqs: int,
    ):
        size = f"{page_size >> 20} MiB" if page_size >= 1 << 20 else f"{page_size >> 10} KiB"
        self.name = f"vpaged {layout} {size}" + (" +share" if share else "")
        self.budget_bytes = budget_bytes
        self.share = share
        self.pool = PagePool("cpu", capacity_bytes=budget_bytes, page_size=page_size, accounting_only=True)
        self.cache = VirtualKVCache(
            shape.geometry,
            VirtualCacheConfig(max_seqs=max_seqs, max_seq_len=max_seq_len, layout=layout),
            pool=self.pool,
        )
        self._prefix = share  # prefix blocks are pages, whole tokens or not (kvcache/virtual/prefix.py)
        self._ids = _TokenIds()

    def admit(self, req, prompt_len):
        c = self.cache
        seqs: list[int] = []
        try:
            tokens = self._ids.prompt(req, prompt_len) if self._prefix and req.prefix_id is not None else None
            first = c.allocate(tokens=tokens) if tokens is not None else c.allocate()
            seqs.append(first)
            c.extend(first, prompt_len - c.seq_len(first))
            if tokens is not None:
                c.cache_prefix(first, tokens[: req.prefix_len])
            if req.n > 1:
                if self.share:
                    seqs += c.fork_many(first, req.n - 1)
                else:
                    for _ in range(req.n - 1):
                        seqs.append(c.allocate())
                        c.extend(seqs[-1], prompt_len)
        except (OutOfPagesError, SlotsExhaustedError):
            for s in seqs:
                c.free(s)
            return None
        return Running(req, seqs, prompt_len)

    def step(self, running):
        self.cache.extend_many([s for r in running for s in r.seqs], 1)

    def release(self, run):
        for s in run.seqs:
            self.cache.free(s)

    def breakdown(self):
        return breakdown_of(self.cache.stats())

    def close(self):
        self.cache.close()
