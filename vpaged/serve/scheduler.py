"""Scheduler: which sequences compute which tokens in the next step, within a token budget.

Order of each step (continuous batching with chunked prefill):
  1. running sequences that decode (one token each), oldest first;
  2. running sequences still in their prompt, a chunk each, oldest first;
  3. swapped-out sequences, in admission order (they resume before anything new is admitted);
  4. waiting requests in the admission queue's order (first come first served by default; or by priority),
     while the token budget, max_num_seqs and pages allow.
A step never takes more than max_num_batched_tokens tokens.

Pages are planned, not caught: before every extension the scheduler asks the store how many pages it would
take (the caches' pages_needed probe, copy-on-write copies included) and whether they are available. When
running sequences cannot grow, it preempts the victim its preemption policy picks (the newest running
sequence by default): swap out while swap space lasts, otherwise free it and recompute it later (it goes back
ahead of later arrivals in the queue, its generated tokens kept). New requests never preempt running ones, so
under the default policies the oldest always progress: no starvation. The two policies are injected
strategies (policies.py), chosen by EngineConfig.scheduling_policy and preemption_policy. In a machine-wide
shared budget the store's pages_available counts what the budget would grant, and within_share() stops
admissions above this engine's fair share while another engine is starved (memory/budget/policy.py).

Admission uses prefix caching: allocating with the prompt's tokens maps the cached full pages, and only the
rest is computed. The scheduler changes the store as it decides (allocate, extend, swap, free), the way
nano-vllm's block manager does; the runner then fills the K/V of exactly what was scheduled.

After the step, postprocess() applies everything the step did to its sequences (tokens computed, prompt
pages offered to the prefix cache, sampled tokens appended, forks of n > 1 requests, finishing and freeing),
the way nano-vllm's Scheduler.postprocess does: the scheduler is the one place a sequence's state changes
(abort() and requeue() are the two other ways out of a step).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import OutOfPagesError
from .policies import admission_queue, preemption_policy
from .sequence import Request, Sequence, Status

if TYPE_CHECKING:
    from .config import EngineConfig
    from .stores import KVStore

# One sampled token and the generator that drew it (None for greedy requests).
Draw = tuple[int, torch.Generator | None]


@dataclass
class StepPlan:
    decodes: list[Sequence] = field(default_factory=list)  # one token each
    prefills: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (sequence, start, tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, _, n in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


@dataclass
class StepUpdate:
    """What postprocess() did to the step's requests (the engine builds outputs and counts from it)."""

    changed: list[Request] = field(default_factory=list)  # new tokens or finished, in sampling order, once each
    finished: list[Request] = field(default_factory=list)  # every completion done: the request is over
    prompt_tokens: int = 0  # prompt tokens computed in this step (recomputation included)
    generated_tokens: int = 0  # tokens appended


class Scheduler:
    """Continuous batching over one KVStore, within the config's max_num_seqs and max_num_batched_tokens."""

    def __init__(self, store: KVStore, config: EngineConfig):
        self.store = store
        part = config.scheduler
        self.max_num_seqs = part.max_num_seqs
        self.max_num_batched_tokens = part.max_num_batched_tokens
        self.waiting = admission_queue(part.scheduling_policy)  # AdmissionQueue: the head is admitted next
        self.victims = preemption_policy(part.preemption_policy, part.scheduling_policy)
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.swapped: list[Sequence] = []  # in admission order (the queue's sort_key)
        self.preemptions_swap = 0
        self.preemptions_recompute = 0
        self.prefix_hit_tokens = 0
        self.watermark_pages = part.watermark_pages(store.total_pages())

    # ------------------------------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.push(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds its cache handle (a fork)."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and give its pages back (finish or abort)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.SWAPPED:
            self.swapped.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        if seq.handle is not None:
            self.store.free(seq.handle)
            seq.handle = None
        seq.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ------------------------------------------------------------------------------------------ schedule
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        budget -= self._schedule_decodes(plan, budget)
        scheduled = set(plan.decodes)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq in scheduled or seq.status is not Status.RUNNING:
                continue
            n = min(seq.remaining, budget)
            if not self._make_room(seq, n, scheduled):
                continue
            if not self._try_extend([seq.handle], n):
                self._preempt(seq)
                continue
            plan.prefills.append((seq, seq.num_computed, n))
            scheduled.add(seq)
            budget -= n
        budget = self._resume_swapped(plan, budget)
        if not self.swapped:
            self._admit_waiting(plan, budget)
        return plan

    def _schedule_decodes(self, plan: StepPlan, budget: int) -> int:
        decodes = [s for s in self.running if s.remaining == 1][:budget]
        while decodes:
            if self.store.pages_available(self.store.pages_needed([s.handle for s in decodes], 1)):
                break
            victim = self.victims.victim(self.running)
            self._preempt(victim)
            if victim in decodes:
                decodes.remove(victim)
        while decodes and not self._try_extend([s.handle for s in decodes], 1):
            victim = self.victims.victim(self.running)
            self._preempt(victim)
            if victim in decodes:
                decodes.remove(victim)
        plan.decodes = decodes
        return len(decodes)

    def _try_extend(self, handles: list, n: int) -> bool:
        """extend, or False when the pages were gone by the time it ran (nothing changed). Only in a shared
        budget: pages_available counts what the budget would grant, and another process may take that between
        the check and the extend; in a pool of its own the check is exact."""
        try:
            self.store.extend(handles, n)
        except OutOfPagesError:
            return False
        return True

    def _make_room(self, seq: Sequence, n: int, scheduled: set) -> bool:
        """Pages for seq to compute n more tokens, preempting the victims the preemption policy picks among the
        unscheduled running sequences, seq included (by default the newest: newer ones, or seq itself when it
        is the newest). False when seq was preempted."""
        while not self.store.pages_available(self.store.pages_needed([seq.handle], n)):
            victim = self.victims.victim([s for s in self.running if s not in scheduled])
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _resume_swapped(self, plan: StepPlan, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.remaining, budget)
            if not self.store.pages_available(self.store.pages_needed([seq.handle], n)):
                break
            self.swapped.pop(0)
            self.store.swap_in(seq.handle)
            self.store.extend([seq.handle], n)
            self._to_running(seq)
            if seq.remaining == 1:
                plan.decodes.append(seq)
            else:
                plan.prefills.append((seq, seq.num_computed, n))
            budget -= n
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        store = self.store
        seats = sum(1 if s.request.forked else s.request.seats for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting.head()
            req = seq.request
            need_seats = 1 if req.forked else req.seats
            # can_allocate: slots for the completions, and what the store takes up front (static: a whole
            # reservation per completion).
            if seats + need_seats > self.max_num_seqs or not store.can_allocate(need_seats):
                break
            allocation = store.allocate(seq.tokens, need_seats)
            handle, hit = allocation.handle, allocation.cached_tokens
            if hit and req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.prompt_len:
                # Prompt logprobs need logits at every prompt position: cached K/V would skip them.
                hit = 0
                store.truncate(handle, 0)
            if hit >= len(seq.tokens):
                # Every token is cached, but the last one's logits are still needed: compute it again.
                hit = len(seq.tokens) - 1
                store.truncate(handle, hit)
            n = min(len(seq.tokens) - hit, budget)
            # A little headroom (vLLM's watermark) so that an admission does not force the next decode step
            # to preempt at once; not needed when nothing runs.
            headroom = self.watermark_pages if self.running else 0
            need = store.pages_needed([handle], n)
            # In a shared budget, a store above its fair share admits nothing new while another member is
            # starved (memory/budget/policy.py); with nothing running it may always start one request.
            if not store.pages_available(need + headroom) or (self.running and not store.within_share(need)):
                store.free(handle)
                break
            if not self._try_extend([handle], n):
                store.free(handle)
                break
            self.waiting.pop()
            seq.handle, seq.slot, seq.num_computed = handle, store.slot(handle), hit
            self._to_running(seq)
            if seq.index == 0 and not req.forked:
                req.metrics.prefix_hit_tokens = hit
            self.prefix_hit_tokens += hit
            plan.prefills.append((seq, hit, n))
            seats += need_seats
            budget -= n

    def requeue(self, plan: StepPlan) -> None:
        """Undo a step whose forward failed: its sequences free their pages and wait to be recomputed."""
        seqs = list(plan.decodes) + [seq for seq, _, _ in plan.prefills]
        for seq in reversed(seqs):
            if seq.status is Status.RUNNING:
                self.running.remove(seq)
                self._to_waiting(seq)

    # ------------------------------------------------------------------------------------------ preempt
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.request.metrics.num_preemptions += 1
        if self.store.can_swap_out(seq.handle):
            self.store.swap_out(seq.handle)
            seq.status = Status.SWAPPED
            self.swapped.append(seq)
            self.swapped.sort(key=self.waiting.sort_key)
            self.preemptions_swap += 1
            return
        self._to_waiting(seq)
        self.preemptions_recompute += 1

    # ------------------------------------------------------------------------------------------ moves
    def _to_running(self, seq: Sequence) -> None:
        """An admitted or resumed sequence (it holds its handle) joins the running ones, as the newest."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _to_waiting(self, seq: Sequence) -> None:
        """A sequence out of the running ones gives its pages back and waits, ahead of later arrivals (fcfs: at
        the head), to be recomputed (its tokens kept): preemption by recompute, or a step whose forward failed."""
        self.store.free(seq.handle)
        seq.handle, seq.slot, seq.num_computed = None, -1, 0
        seq.prefix_offered = False
        seq.status = Status.WAITING
        self.waiting.push_preempted(seq)

    # ------------------------------------------------------------------------------------------ after a step
    def postprocess(
        self,
        plan: StepPlan,
        draws: list[tuple[Sequence, list[Draw]]],
        eos_token_ids: Collection[int],
        now: float,
    ) -> StepUpdate:
        """Apply a step that ran: its tokens are computed; each sampling sequence appends its draw (a request
        of n > 1 that just computed its prompt draws n and forks into its completions); sequences that meet a
        stop token or max_tokens finish and free their pages. `draws`: per sequence that sampled, in logits
        order, its draws (one, or n for a request about to fork). eos_token_ids: the model's EOS tokens (the
        engine's, read at each step)."""
        update = StepUpdate()
        for seq in plan.decodes:
            # A one-token row may be a prompt's last token (a chunk budget that left one): a prompt token too.
            update.prompt_tokens += seq.num_computed < seq.prompt_len
            seq.num_computed += 1
        for seq, start, n in plan.prefills:
            seq.num_computed = start + n
            update.prompt_tokens += min(n, max(0, seq.prompt_len - start))
        for seq in itertools.chain(plan.decodes, (seq for seq, _, _ in plan.prefills)):
            if not seq.prefix_offered and seq.num_computed >= seq.prompt_len:  # its prompt is all computed
                self.store.cache_prefix(seq.handle, seq.request.prompt)
                seq.prefix_offered = True
        changed: dict[str, Request] = {}
        for seq, drawn in draws:
            if len(drawn) > 1:
                self._fork(seq, drawn[1:], eos_token_ids, update)
            self._append(seq, drawn[0][0], eos_token_ids, now, update)
            changed[seq.request.request_id] = seq.request
        update.changed = list(changed.values())
        return update

    def _fork(self, parent: Sequence, drawn: list[Draw], eos_token_ids, update: StepUpdate) -> None:
        """n > 1: the other completions share the parent's computed prompt pages (or, static, copy them into
        the reservations made at admission); each appends its own draw."""
        req = parent.request
        handles = self.store.fork(parent.handle, len(drawn), parent.num_computed)
        for k, (handle, (token, generator)) in enumerate(zip(handles, drawn), start=1):
            child = Sequence(
                req,
                k,
                list(parent.tokens),
                generator,
                num_computed=parent.num_computed,
                handle=handle,
                slot=self.store.slot(handle),
                prefix_offered=True,
            )
            child.delta_from = len(child.tokens)
            req.seqs.append(child)
            self.add_running(child)
            self._append(child, token, eos_token_ids, time.time(), update)
        req.forked = True

    def _append(self, seq: Sequence, token: int, eos_token_ids, now: float, update: StepUpdate) -> None:
        req = seq.request
        if token < 0:  # sampler.NO_TOKEN: the request's constraints left no token to draw; nothing is appended
            seq.finish_reason = "error"
        else:
            seq.tokens.append(token)
            update.generated_tokens += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if token in req.params.stop_token_ids or (not req.params.ignore_eos and token in eos_token_ids):
                seq.finish_reason = "stop"
            elif seq.num_generated >= req.max_tokens:
                seq.finish_reason = "length"
            else:
                return
        self.remove(seq)
        if all(s.finish_reason is not None for s in req.seqs) and (req.forked or req.params.n == 1):
            self._finish(req, now)
            update.finished.append(req)

    def abort(self, req: Request, now: float) -> None:
        """End every unfinished sequence of a request now (finish_reason "abort"); their pages go back."""
        for seq in req.seqs:
            if seq.status is not Status.FINISHED:
                self.remove(seq)
                seq.finish_reason = "abort"
        self._finish(req, now)

    @staticmethod
    def _finish(req: Request, now: float) -> None:
        req.finished = True
        req.metrics.finish_time = now
