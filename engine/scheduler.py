"""Token-budget continuous batching.

No prefill or decode phases: each step, every running request's computed-token count catches up with its
token count, as far as the step's token budget allows, so one step can mix decode tokens and prefill chunks.
Running requests are served first, in admission order; when pages run out the most recently admitted one is
preempted (its pages freed, it is recomputed later from its tokens). Waiting requests are admitted while the
budget, ``max_num_seqs`` and the pool allow, after reusing whatever prefix the cache manager can match.
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.contract.cache import CacheManager
from engine.request import FinishReason, Request, RequestStatus


@dataclass(slots=True)
class StepPlan:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(
        self, cache: CacheManager, max_num_batched_tokens: int, max_num_seqs: int,
        on_preempt: Callable[[Request], None] | None = None,
        reclaim: Callable[[int], bool] | None = None,
        park: Callable[[Request], bool] | None = None,
        unpark: Callable[[Request, bool], bool] | None = None,
    ):
        self.cache = cache
        self.on_preempt = on_preempt
        self.reclaim = reclaim  # frees idle retained state (chains) for n pages; True if it freed any
        # a queued turn's held KV moved down under pressure instead of freed (True if it was), and back when the
        # turn is admitted (False: no room yet; the bool: nothing else runs, so recompute rather than wait)
        self.park, self.unpark = park, unpark
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # told of every step that ran prompt tokens: (those tokens, seconds from the plan to its update, i.e. the
        # step's prepare and execute); the chain tiers' prefill rate (``ChainMemory.observe_prefill``)
        self.step_observers: list[Callable[[int, float], None]] = []
        self._planned_at: float | None = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req.num_computed_tokens, req.num_tokens, budget)
            assert n > 0
            while not self._allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            else:
                plan.requests.append(req)
                plan.num_new_tokens.append(n)
                budget -= n
                i += 1
        if plan.preempted:
            self._planned_at = time.perf_counter()
            return plan  # memory is short: do not admit anyone this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.parked and not self.unpark(req, not (self.running or plan.requests)):
                break
            attached = self.cache.holds(req)  # a chain turn arrives with its KV attached
            cached = req.num_computed_tokens if attached else self.cache.match_prefix(req)
            n = self._chunk(cached, req.num_tokens, budget)
            if not self._allocate(req, n):
                if not attached:
                    self.cache.free(req)
                assert self.running or plan.requests, "an idle pool cannot admit a request that add() accepted"
                break
            self.waiting.popleft()
            req.num_computed_tokens = cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.requests.append(req)
            plan.num_new_tokens.append(n)
            budget -= n
        self._planned_at = time.perf_counter()
        return plan

    def _chunk(self, start: int, end: int, budget: int) -> int:
        """Tokens of ``[start, end)`` to run this step: as many as the budget allows; a chunk that stops short of
        ``end`` ends on the cache's prefill alignment when it can (``CacheManager.prefill_alignment``)."""
        n = min(end - start, budget)
        align = self.cache.prefill_alignment
        if n < end - start and align > 1 and (start + n) % align < n:
            n -= (start + n) % align
        return n

    def _allocate(self, req: Request, n: int) -> bool:
        while not self.cache.allocate(req, n):
            if self.reclaim is not None and self.reclaim(self.cache.pages_needed(req, n)):
                continue
            if not self._drop_waiting_holdings(req):
                return False
        return True

    def _drop_waiting_holdings(self, keep: Request) -> bool:
        """Queued chain turns hold their chains' KV; when memory is short, the ones queued furthest back
        give it up: to a chain tier when there is one (``park``), else freed (they will recompute). True if any
        did."""
        for req in reversed(self.waiting):
            if req is not keep and self.cache.holds(req):
                if self.park is not None and self.park(req):
                    return True
                self.cache.free(req)
                req.num_computed_tokens = 0
                if self.on_preempt is not None:
                    self.on_preempt(req)
                return True
        return False

    def _preempt(self, req: Request) -> None:
        self.cache.free(req)
        if self.on_preempt is not None:
            self.on_preempt(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update(self, plan: StepPlan) -> None:
        """Advance computed counts for what the step ran; publish full pages."""
        prefilled = 0
        for req, n in zip(plan.requests, plan.num_new_tokens):
            start = req.num_computed_tokens
            prompt = max(0, min(start + n, req.num_prompt_tokens) - start)
            req.num_prefilled_tokens += prompt
            prefilled += prompt
            req.num_computed_tokens += n
            self.cache.commit(req, n)
        if prefilled and self._planned_at is not None:
            seconds = time.perf_counter() - self._planned_at
            for observe in self.step_observers:
                observe(prefilled, seconds)
        self._planned_at = None

    def finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.cache.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
