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
forward, and applies each forward's effects (`grow_step`, `absorb_step`: the same calls on the
same objects, the scheduler's sequences, its `KVCacheManager`, its `_finish`,
`Sequence.append_token`, `migrate`) in order once simulated time has passed it: when the
instance's load report is read, when the leap ends, or when a message arrives, which also cuts
the leap short after the forward in flight, as the real loop reads its inbox after each forward.
Whenever the state is anything else (an admission, a preemption, a recompute, a swap) the real
`schedule()` plans the forward. `Layout(steady_decode=False)` turns all of it off;
tests/unit/simulator/test_steady.py runs whole simulations both ways and requires the same
traces and reports.
"""

from __future__ import annotations

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


def absorb_step(role: SimDecode, batch: list[Sequence], when: float
                ) -> tuple[list[Sequence], bool]:
    """`DecodeScheduler.update_from_output` for one decode forward of `batch` ending at `when`,
    then `SimDecode.absorb`'s reports; returns the sequences that finished, and whether some
    sequence's next token may start a block (`grow_step` is due). Predictions are moved on by
    `move_predictions`."""
    scheduler, cluster = role.scheduler, role.cluster
    kv = scheduler.kv
    if scheduler.swap is not None:
        scheduler.swap.release_deferred()
    lengths, on_token = cluster.output_lengths, cluster.on_token_at
    hashes = kv._hashes if kv.prefix_caching else None
    capacity = kv.block_size
    finished, grows = [], False
    for seq in batch:
        token_ids = seq.token_ids
        num_computed = len(token_ids)
        seq.num_computed_tokens = num_computed
        # cache_computed acts only when a full block has no hash yet; skip the call otherwise
        if hashes is not None and len(hashes.get(seq.seq_id, ())) < num_computed // capacity:
            kv.cache_computed(seq.seq_id, token_ids, num_computed)
        if num_computed % capacity == 0:  # its next token starts a block (grow_step checks)
            grows = True
        num_output = num_computed - seq.num_prompt_tokens
        seq.append_token(EOS_TOKEN if num_output + 1 >= lengths[seq.seq_id] else FILLER_TOKEN)
        if seq.status >= FINISHED:
            reason = seq.finish_reason
            on_token(seq.seq_id, reason, when)
            finished.append(seq)
            scheduler._finish(seq)
            if reason in ("stop", "length"):
                heavy = role.prediction.is_heavy(seq.meta.first_prediction)
                role.finished["heavy" if heavy else "light"] += 1
        else:
            on_token(seq.seq_id, None, when)
    return finished, grows


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
                 max_steps: int) -> None:
        self.inst, self.role = inst, inst.role
        self.batch = batch
        lengths = inst.cluster.output_lengths
        finish = [forwards_to_finish(seq, lengths[seq.seq_id]) for seq in batch]
        predicted = min(finish) > 0
        # An offer waiting for admission is retried after every forward (SimDecode.poll)
        steps = min(max_steps, max(finish)) if predicted and not self.role.pending else 1
        self.ends: dict[int, list[str]] = {}  # forward -> the sequences it finishes, in order
        for seq, f in zip(batch, finish, strict=True):
            if predicted:
                self.ends.setdefault(f, []).append(seq.seq_id)
        self.num_steps = self._fits(batch, finish, steps)
        self.times, self.seconds, self.contexts = self._timeline(batch, finish, context,
                                                                 inst.loop.now)
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

    def _timeline(self, batch, finish, context: int, now: float) -> tuple[list, list]:
        """Each forward's end time and seconds: forward j (from 1) holds the sequences not
        finished before it, each after its tokens so far."""
        ending: dict[int, int] = {}
        for seq, f in zip(batch, finish, strict=True):
            ending[f] = ending.get(f, 0) + len(seq.token_ids)
        counts: dict[int, int] = {}
        for f in finish:
            counts[f] = counts.get(f, 0) + 1
        active, tokens = len(batch), context + len(batch)  # tokens: sum of num_tokens
        times, seconds, contexts, clock = [], [], [], now
        overhead = self.inst.cluster.layout.turn_overhead_s  # the loop's own work per forward
        for j in range(1, self.num_steps + 1):
            contexts.append(tokens - active + (j - 1) * active)
            dt = self.inst.costs.decode_s(active, contexts[-1])
            clock += dt + overhead
            times.append(clock)
            seconds.append(dt)
            active -= counts.get(j, 0)
            tokens -= ending.get(j, 0)
        return times, seconds, contexts

    @property
    def end(self) -> float:
        return self.times[self.num_steps - 1]

    def catch_up(self, now: float) -> None:
        """Absorb every forward that has ended by `now`, and grow the blocks of the next one
        (planned when the one before it ended)."""
        if self.done >= self.num_steps or self.times[self.done] > now:
            return
        inst, scheduler = self.inst, self.role.scheduler
        while self.done < self.num_steps and self.times[self.done] <= now:
            step = self.done
            inst.busy_seconds += self.seconds[step]
            inst.computed_tokens += len(self.batch)
            inst.num_forwards += 1
            if inst.forwards is not None:
                inst.forwards.append((ForwardShape.decode_step(len(self.batch),
                                                               self.contexts[step]),
                                      self.seconds[step]))
            finished, grows = absorb_step(self.role, self.batch, self.times[step])
            self.done += 1
            if self.ends and [s.seq_id for s in finished] != self.ends.get(self.done, []):
                raise AssertionError(f"the leap mispredicted which sequences forward "
                                     f"{self.done} finishes")
            if finished:
                self.batch = [s for s in self.batch if not s.is_finished]
            if self.done < self.num_steps and grows:
                grow_step(scheduler, self.batch)
        move_predictions(scheduler)

    def cut(self, now: float) -> None:
        """A message arrived: the forward in flight is the last one."""
        self.catch_up(now)
        self.num_steps = min(self.num_steps, self.done + 1)
