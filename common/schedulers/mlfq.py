"""FastServe's skip-join multi-level feedback queue (§4.1, Alg. 1), over job ids and seconds.

Pure bookkeeping, no KV and no sequences: `fastserve.FastServeScheduler` feeds it predicted
iteration times and asks it for the priority order and each job's estimated next scheduled time.

- Queues Q1..Qn (levels 0..n-1 here); quantum of level k = q1 * 2**k; q1 = one decode iteration.
- Skip-join: a job enters the highest queue whose quantum covers its first iteration (prefill)
  time, min{k : quantum(k) >= t_init}, the last queue if none does.
- Each iteration a job runs is charged its predicted iteration time. A job that has used its
  queue's quantum is demoted [interp of "eta levels"] to the first lower queue whose quantum
  covers its next iteration (for a decode, the next queue) and goes to that queue's back.
- Starvation: a job that has not run for `starvation_limit_s` (alpha) moves to the back of Q1 and
  its clock restarts.
- Within a queue, jobs keep FIFO order of entry; a job that ran without using its quantum keeps
  its place.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count


@dataclass
class MLFQJob:
    level: int
    ticket: int  # FIFO position: smaller entered its queue earlier
    last_run: float  # when the job last ran (or arrived); starvation time counts from here
    attained_s: float = 0.0  # service received in its current queue


class SkipJoinMLFQ:
    def __init__(self, first_quantum_s: float, num_queues: int, starvation_limit_s: float) -> None:
        if not first_quantum_s > 0 or num_queues < 1 or not starvation_limit_s > 0:
            raise ValueError("need first_quantum_s > 0, num_queues >= 1, starvation_limit_s > 0")
        self.quanta = [first_quantum_s * 2 ** k for k in range(num_queues)]
        self.starvation_limit_s = starvation_limit_s
        self.jobs: dict[str, MLFQJob] = {}
        self._tickets = count()
        self.num_promotions = 0
        self.num_demotions = 0

    @property
    def num_queues(self) -> int:
        return len(self.quanta)

    def entry_level(self, first_iteration_s: float, lowest: int = 0) -> int:
        """The first level at or below `lowest` whose quantum covers `first_iteration_s`."""
        for level in range(lowest, self.num_queues):
            if self.quanta[level] >= first_iteration_s:
                return level
        return self.num_queues - 1

    def join(self, job_id: str, first_iteration_s: float, now: float,
             skip_join: bool = True) -> int:
        """Skip-join a new job (or, with skip_join=False, naive MLFQ: enter Q1); returns its
        level."""
        level = self.entry_level(first_iteration_s) if skip_join else 0
        self.jobs[job_id] = MLFQJob(level, next(self._tickets), now)
        return level

    def remove(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)

    def level(self, job_id: str) -> int:
        return self.jobs[job_id].level

    def promote_starved(self, now: float) -> list[str]:
        """Move every job below Q1 that waited alpha or longer to the back of Q1; returns their
        ids. (A starving job already in Q1 keeps its place: re-entering would push it back.)"""
        starved = [(job.last_run, job_id) for job_id, job in self.jobs.items()
                   if job.level > 0 and now - job.last_run >= self.starvation_limit_s]
        for _, job_id in sorted(starved):  # longest-starved enters Q1 first
            job = self.jobs[job_id]
            job.level, job.ticket, job.attained_s, job.last_run = 0, next(self._tickets), 0.0, now
            self.num_promotions += 1
        return [job_id for _, job_id in sorted(starved)]

    def order(self) -> list[str]:
        """Job ids, highest priority first: by queue, then by entry into it."""
        return sorted(self.jobs, key=lambda j: (self.jobs[j].level, self.jobs[j].ticket))

    def charge(self, job_id: str, seconds: float, next_iteration_s: float, now: float) -> None:
        """Account one iteration of `seconds` to the job; demote it if its quantum is used."""
        job = self.jobs[job_id]
        job.last_run = now
        job.attained_s += seconds
        # NOTE: the tolerance keeps float sums like 0.1+0.1+0.1 from missing a quantum of 0.3.
        if job.attained_s < self.quanta[job.level] * (1 - 1e-9):
            return
        if job.level < self.num_queues - 1:
            job.level = self.entry_level(next_iteration_s, lowest=job.level + 1)
            self.num_demotions += 1
        job.ticket = next(self._tickets)
        job.attained_s = 0.0

    def enst(self, order: list[str], now: float, batch_size: int) -> dict[str, float]:
        """Estimated next scheduled time (seconds from now) of each job in `order` (priority
        order), FastServe §4.2: ENST(i) = min(T_promote(i), T_execute(i)), where
        T_promote(i) = alpha - (now - last run) and T_execute(i) = (1/B) * sum over jobs j ahead
        of i of quantum(level j) + ... + quantum(level i) [interp: inclusive, as printed]."""
        prefix = [0.0]
        for quantum in self.quanta:
            prefix.append(prefix[-1] + quantum)
        result: dict[str, float] = {}
        num_ahead, prefix_ahead = 0, 0.0  # count of jobs ahead and the sum of prefix[level j]
        for job_id in order:
            job = self.jobs[job_id]
            execute = (num_ahead * prefix[job.level + 1] - prefix_ahead) / batch_size
            promote = max(0.0, self.starvation_limit_s - (now - job.last_run))
            result[job_id] = min(promote, execute)
            num_ahead += 1
            prefix_ahead += prefix[job.level]
        return result
