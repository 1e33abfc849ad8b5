"""Several sequences for one HTTP request (`n`, `best_of`, a list of prompts), run as one stream.

Each sequence is its own request in the cluster. Those sharing a prompt share its KV blocks
through the prefix cache's reference counts: the first goes out at once, the others once it has
produced its first token (its prompt's full blocks are then cached at the instance that
prefilled it) and to that instance, where they compute only the prompt's last partial block.
Prompts shorter than `SHARE_MIN_TOKENS` have little to share, so their sequences all go out at
once. A choice's seed is the request's seed plus its index among the prompt's choices (vLLM's
rule), so every run gives the same choices whatever the batching.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from common.sampling_params import SamplingParams
from control_plane.gateway import Gateway, RequestHandle, StreamEvent

SHARE_MIN_TOKENS = 32


@dataclass
class Job:
    """One sequence of the request."""

    prompt_index: int
    candidate: int  # among the prompt's sequences
    prompt_ids: list[int]
    params: SamplingParams
    handle: RequestHandle | None = None
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    last: StreamEvent | None = None

    def absorb(self, event: StreamEvent) -> None:
        self.texts.append(event.text)
        self.last = event
        if event.logprobs:
            self.token_ids.extend(event.token_ids)
            self.logprobs.extend(event.logprobs)
        if event.prompt_logprobs:
            self.prompt_logprobs = list(event.prompt_logprobs)

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry.logprob for entry in self.logprobs)


def make_jobs(prompts: list[list[int]], params: list[SamplingParams], count: int) -> list[Job]:
    """`count` sequences per prompt, seeded per choice when the request has a seed."""
    jobs = []
    for k, (prompt_ids, base) in enumerate(zip(prompts, params)):
        for j in range(count):
            seeded = base if base.seed is None else msgspec.structs.replace(base,
                                                                            seed=base.seed + j)
            jobs.append(Job(k, j, prompt_ids, seeded))
    return jobs


class FanOut:
    """Submits the jobs and merges their events, in arrival order, as (job, event) pairs."""

    def __init__(self, gateway: Gateway, jobs: list[Job]) -> None:
        self.gateway = gateway
        self.jobs = jobs
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Submit the first job of each prompt (raises NoInstanceError with nowhere to go)."""
        leaders: dict[int, Job] = {}
        for job in self.jobs:
            share = len(job.prompt_ids) >= SHARE_MIN_TOKENS
            if job.prompt_index in leaders and share:
                continue  # submitted when its leader's prompt is cached
            job.handle = self.gateway.submit(job.prompt_ids, job.params)
            leaders.setdefault(job.prompt_index, job)
            self._pump(job, leaders[job.prompt_index] is job and share)

    def _pump(self, job: Job, leads: bool) -> None:
        self._tasks.append(asyncio.create_task(self._run(job, leads)))

    async def _run(self, job: Job, leads: bool) -> None:
        released = not leads
        try:
            async for event in self.gateway.events(job.handle):
                if not released:
                    released = True
                    self._release(job)
                await self._queue.put((job, event))
        finally:
            if not released:
                self._release(job)
            await self._queue.put((job, None))

    def _release(self, leader: Job) -> None:
        """The leader's prompt is cached (or it failed): its followers go out."""
        prefer = leader.handle.prefill_instance if leader.handle else ""
        for job in self.jobs:
            if job.prompt_index == leader.prompt_index and job.handle is None:
                try:
                    job.handle = self.gateway.submit(job.prompt_ids, job.params, prefer)
                except Exception as exc:  # noqa: BLE001 - reported as the job's error event
                    self._queue.put_nowait((job, StreamEvent(finish_reason="error",
                                                             error=str(exc))))
                    self._queue.put_nowait((job, None))
                    continue
                self._pump(job, False)

    async def events(self) -> AsyncIterator[tuple[Job, StreamEvent]]:
        remaining = len(self.jobs)
        while remaining:
            job, event = await self._queue.get()
            if event is None:
                remaining -= 1
                continue
            job.absorb(event)
            yield job, event

    def close(self) -> None:
        """Forget every job; those unfinished (the client left) are aborted everywhere."""
        for task in self._tasks:
            task.cancel()
        for job in self.jobs:
            if job.handle is not None:
                self.gateway.close(job.handle)
