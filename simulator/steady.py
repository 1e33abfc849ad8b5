"""The simulator's fast path: a decode instance's steady batch, stepped without planning it.

Most of a simulated hour is decode forwards of a steady batch, and most of their cost was the
plan, the updates and the events, not the policy: while a decode instance's scheduler holds only
running sequences that are each one token behind (nothing waiting, recomputing or swapped out),
the batch fits the token budget and the pool has a block for every sequence that needs one,
`DecodeScheduler.schedule()` can only plan one decode token per running sequence, in running
order, growing each table as `make_chunk` does, and `update_from_output` can only append each
sampled token, finish what ended and move predictions on. No policy decides anything there, and
until a message reaches the instance nothing else changes its scheduler or its pool.

So a `Leap` plans up to `Layout.leap_steps` such forwards at once: which sequences are in each
(from when each one's output ends), each forward's time from the cost model, and whether the
pool holds every block the leap will grow. It schedules one event at the end instead of one per
forward, and applies the effects of every forward simulated time has passed (when the
instance's load report is read, when the leap ends, or when a message arrives, which also cuts
the leap short after the forward in flight, as the real loop reads its inbox after each forward)
in one pass, `absorb_window`: each sequence's tokens appended at once (the last through
`Sequence.append_token`), its token times as a slice of the leap's timeline, and the block
pool's calls (`cache_computed`, the scheduler's `_finish`, `grow`) made in the order
forward-by-forward absorption makes them, so the pool's free lists come out the same; the per-token
work is a list extension, not a call per token per forward.
Whenever the state is anything else (an admission, a preemption, a recompute, a swap) the real
`schedule()` plans the forward. `Layout(steady_decode=False)` turns all of it off;
tests/unit/simulator/test_steady.py runs whole simulations both ways and requires the same
traces and reports.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from operator import itemgetter
from typing import TYPE_CHECKING

from common.plan import ForwardShape
from common.sequence import Sequence, SequenceStatus
from decode_instance.admission import migrate
from decode_instance.scheduler import DecodeScheduler
from simulator.workload import EOS_TOKEN, FILLER_TOKEN

FINISHED = SequenceStatus.FINISHED_STOPPED  # Sequence.is_finished: status >= this

if TYPE_CHECKING:
    from simulator.instances import SimInstance
    from simulator.roles import SimDecode


def steady_batch(scheduler: DecodeScheduler) -> tuple[list[Sequence], int] | None:
    """When the next plan can only be one decode token for each running sequence (module
    docstring): the running batch in order, its blocks grown as `make_chunk` grows them, and
    the forward's context (the sum of the chunks' cached tokens). Else None, nothing changed."""
    if type(scheduler) is not DecodeScheduler or scheduler.waiting or scheduler.swapped:
        return None
    running = scheduler.running
    if not running or len(running) > scheduler.batch.max_num_batched_tokens:
        return None
    kv = scheduler.kv
    capacity = kv.block_size
    tables = kv._tables
    context, short = 0, []
    for seq in running:
        num_tokens = len(seq.token_ids)
        if num_tokens - seq.num_computed_tokens != 1:
            return None
        context += num_tokens - 1
        if num_tokens > len(tables.get(seq.seq_id, ())) * capacity:
            short.append(seq)
    if sum(kv.num_new_blocks(s.seq_id, len(s.token_ids)) for s in short) > kv.num_free_blocks:
        return None  # some sequence would preempt another: the scheduler decides
    grow_step(scheduler, short)
    return list(running), context


def grow_step(scheduler: DecodeScheduler, batch: list[Sequence]) -> None:
    """`make_chunk`'s growth for each sequence's next decode token, in plan order."""
    kv = scheduler.kv
    capacity = kv.block_size
    tables = kv._tables
    for seq in batch:
        num_tokens = len(seq.token_ids)
        if num_tokens > len(tables.get(seq.seq_id, ())) * capacity:
            kv.grow(seq.seq_id, num_tokens)


def forwards_to_finish(seq: Sequence, length: int) -> int:
    """How many more decode forwards the sequence takes, the finishing one included, when the
    sampler gives a filler token before its `length`-th output token and EOS from there on
    (`SimInstance.sampled`), under `Sequence.append_token`'s stop rules; 0 when a filler token
    could stop it (then the fast path does not predict it)."""
    sampling, done = seq.sampling, seq.num_output_tokens
    if sampling.is_stop_token(FILLER_TOKEN, sampling.max_tokens):
        return 0
    ends = [sampling.max_tokens, seq.max_model_len - seq.num_prompt_tokens]
    eos_at = max(length, sampling.min_tokens, done + 1)
    if sampling.is_stop_token(EOS_TOKEN, eos_at):
        ends.append(eos_at)
    return max(min(ends), done + 1) - done


def absorb_window(leap: Leap, first: int, end: int) -> list[Sequence]:
    """`DecodeScheduler.update_from_output` for forwards `first + 1` .. `end` of the leap (each
    forward j holding the sequences not finished before it), then `SimDecode.absorb`'s reports,
    and `make_chunk`'s growth for the forward after each one: a sequence's tokens are appended
    at once, and the block pool's calls (hashing a block as it fills, freeing a finished
    sequence's blocks, growing a table) are made in the order forward-by-forward absorption
    makes them, so the pool's free lists end up the same. Returns the sequences that finished."""
    role = leap.role
    scheduler = role.scheduler
    kv = scheduler.kv
    if scheduler.swap is not None:
        scheduler.swap.release_deferred()
    calls: list[tuple] = []
    finished = []
    for index, (seq, finish) in enumerate(zip(leap.batch, leap.finish, strict=True)):
        last = min(finish, end) if finish else end
        start = len(seq.token_ids)  # its tokens before forward first + 1 (one of them uncomputed)
        _append_tokens(seq, last - first, leap.inst.cluster.output_lengths[seq.seq_id])
        done = seq.status >= FINISHED
        if finish and done != (finish == last):
            raise AssertionError(f"the leap mispredicted when {seq.seq_id} finishes")
        _pool_calls(calls, kv, seq, index, start, first, last, done, leap.num_steps - 1)
        _trace(leap.inst.cluster, seq, leap.times[first:last], done)
        if done:
            finished.append(seq)
            calls.append((last, 0, index, 1, seq, 0))
    calls.sort(key=itemgetter(0, 1, 2, 3))  # forward, phase, batch position, kind
    for _, _, _, kind, seq, num_tokens in calls:
        if kind == 0:
            kv.cache_computed(seq.seq_id, seq.token_ids, num_tokens)
        elif kind == 1:
            _finished(role, seq)
        else:
            kv.grow(seq.seq_id, num_tokens)
    return finished


def _append_tokens(seq: Sequence, count: int, length: int) -> None:
    """`count` decode tokens as `SimInstance.sampled` gives them (a filler token before the
    request's `length`-th output token, EOS from there on); the last through
    `Sequence.append_token`, which applies the stop rules (the leap has predicted that no earlier
    one stops it)."""
    token_ids = seq.token_ids
    first_output = len(token_ids) - seq.num_prompt_tokens
    fillers = min(count, max(0, length - 1 - first_output))
    tokens = [FILLER_TOKEN] * fillers + [EOS_TOKEN] * (count - fillers)
    token_ids.extend(tokens[:-1])
    seq.num_computed_tokens = len(token_ids)
    seq.append_token(tokens[-1])


def _pool_calls(calls: list, kv, seq: Sequence, index: int, start: int, first: int, last: int,
                done: bool, grow_until: int) -> None:
    """The block pool's calls for one sequence over forwards first + 1 .. last, keyed (forward,
    phase, batch position, kind): in forward j the sequence has start + j - first - 1 computed
    tokens; a block it fills is hashed (phase 0, as `update_from_output` does), and after
    forward j <= grow_until its next token may need a new block (phase 1, `make_chunk`)."""
    size = kv.block_size
    if kv.prefix_caching:
        held = len(kv._hashes.get(seq.seq_id, ()))
        computed = start
        while computed < start + last - first:
            if held < computed // size:
                calls.append((computed - start + first + 1, 0, index, 0, seq, computed))
                held = computed // size
            computed = (computed // size + 1) * size
    covered = len(kv._tables.get(seq.seq_id, ())) * size
    end = start + min(last if not done else last - 1, grow_until) - first
    for computed in range(max(covered, start), end, size):
        calls.append((computed - start + first + 1, 1, index, 2, seq, computed + 1))


def _trace(cluster, seq: Sequence, times: list[float], done: bool) -> None:
    """`SimCluster.on_token_at` for each of the sequence's tokens."""
    trace = cluster.traces[seq.seq_id]
    if not trace.token_times:
        cluster.recent_ttfts.append(times[0] - trace.request.arrival_s)
    trace.token_times.extend(times)
    if done:
        trace.finish = times[-1]
        cluster.outstanding -= 1


def _finished(role: SimDecode, seq: Sequence) -> None:
    role.scheduler._finish(seq)
    if seq.finish_reason in ("stop", "length"):
        heavy = role.prediction.is_heavy(seq.meta.first_prediction)
        role.finished["heavy" if heavy else "light"] += 1


def move_predictions(scheduler: DecodeScheduler) -> None:
    """The end of `DecodeScheduler.update_from_output`; moving a prediction twice is moving it
    once to the later length, so it runs once per catch-up, not per forward."""
    for seq in scheduler.running:
        meta = seq.meta
        if meta.prediction is not None:
            meta.prediction = migrate(meta.prediction, seq.num_output_tokens)


class Leap:
    """Up to `max_steps` decode forwards of a steady batch (module docstring); the first one's
    blocks were grown by `steady_batch`."""

    def __init__(self, inst: SimInstance, batch: list[Sequence], context: int,
                 max_steps: int, wake_s: float = 0.0) -> None:
        self.inst, self.role = inst, inst.role
        self.batch = batch
        lengths = inst.cluster.output_lengths
        finish = [forwards_to_finish(seq, lengths[seq.seq_id]) for seq in batch]
        predicted = min(finish) > 0
        # An offer waiting for admission is retried after every forward (SimDecode.poll)
        steps = min(max_steps, max(finish)) if predicted and not self.role.pending else 1
        # the forward (from 1) each sequence finishes in; 0 when not predicted (one forward)
        self.finish = finish if predicted else [0] * len(batch)
        self.num_steps = self._fits(batch, finish, steps)
        self.times, self.seconds, self.contexts, self.actives = self._timeline(
            batch, self.finish, context, inst.loop.now, wake_s)
        self.done = 0  # forwards absorbed so far
        self.ticket = 0  # which scheduled end event is the live one

    def _fits(self, batch: list[Sequence], finish: list[int], steps: int) -> int:
        """The most forwards, up to `steps`, whose block growth the free pool covers without
        counting the blocks finishing sequences give back (so none would preempt another)."""
        kv = self.inst.kv
        size, free = kv.block_size, kv.num_free_blocks
        held = [len(kv.table(seq.seq_id)) for seq in batch]
        while steps > 1:
            need = sum(max(0, -(-(len(seq.token_ids) + min(steps, f) - 1) // size) - h)
                       for seq, f, h in zip(batch, finish, held, strict=True))
            if need <= free:
                break
            steps //= 2
        return max(steps, 1)

    def _timeline(self, batch, finish, context: int, now: float,
                  wake_s: float) -> tuple[list, ...]:
        """Each forward's end time, seconds, context and batch size: forward j (from 1) holds
        the sequences not finished before it, each after its tokens so far; the first takes
        `wake_s` more (`SimInstance._wake_s`). Between two finishes the batch is constant and
        its context grows by the batch each forward; the arithmetic is `CostModel.decode_s`'s
        and the loop clock's, term by term in the same order (so the same floats as forward by
        forward)."""
        leaving: dict[int, list[int]] = {}  # forward -> (sequences, tokens) it finishes
        for seq, f in zip(batch, finish, strict=True):
            if f:
                entry = leaving.setdefault(f, [0, 0])
                entry[0] += 1
                entry[1] += len(seq.token_ids)
        costs = self.inst.costs
        per_token, per_pair = costs.per_context_token_s, costs.per_context_pair_s
        seconds, contexts, actives = [], [], []
        active, tokens, step = len(batch), context + len(batch), 1  # tokens: sum of num_tokens
        for stop in sorted([f for f in leaving if f < self.num_steps]) + [self.num_steps]:
            rows = costs.decode_s(active, 0)
            first = tokens - active + (step - 1) * active
            span = range(first, first + (stop - step + 1) * active, active)
            contexts.extend(span)
            seconds.extend([rows + per_token * c + per_pair * c for c in span])
            actives.extend([active] * len(span))
            gone = leaving.get(stop)
            if gone:
                active, tokens = active - gone[0], tokens - gone[1]
            step = stop + 1
        if wake_s:
            seconds[0] += wake_s
        overhead = self.inst.cluster.layout.turn_overhead_s  # the loop's own work per forward
        times = list(accumulate([dt + overhead for dt in seconds], initial=now))[1:]
        return times, seconds, contexts, actives

    @property
    def end(self) -> float:
        return self.times[self.num_steps - 1]

    def catch_up(self, now: float) -> None:
        """Absorb every forward that has ended by `now`, and grow the blocks of the next one
        (planned when the one before it ended)."""
        first = self.done
        if first >= self.num_steps or self.times[first] > now:
            return
        end = bisect_right(self.times, now, first, self.num_steps)
        inst = self.inst
        busy = inst.busy_seconds
        for seconds in self.seconds[first:end]:  # summed forward by forward, as the loop does
            busy += seconds
        inst.busy_seconds = busy
        inst.computed_tokens += sum(self.actives[first:end])
        inst.num_forwards += end - first
        if inst.forwards is not None:
            inst.forwards.extend((ForwardShape.decode_step(self.actives[j], self.contexts[j]),
                                  self.seconds[j]) for j in range(first, end))
        finished = absorb_window(self, first, end)
        self.done = end
        if finished:
            keep = [not s.is_finished for s in self.batch]
            self.batch = [s for s, k in zip(self.batch, keep, strict=True) if k]
            self.finish = [f for f, k in zip(self.finish, keep, strict=True) if k]
        move_predictions(self.role.scheduler)

    def cut(self, now: float) -> None:
        """A message arrived: the forward in flight is the last one."""
        self.catch_up(now)
        self.num_steps = min(self.num_steps, self.done + 1)
