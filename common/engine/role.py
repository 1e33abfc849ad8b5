"""The role contract of an instance, and what every role does the same way.

A role (prefill, decode, coupled) is the part of an instance that changes on a flip: it reacts to
messages, drives one scheduler over the instance's block tables, and streams tokens to gateways.
`RoleContext` is what it may use; `Role` is the base every role extends. Written once here:
- a Sequence made from a GenerateRequest (a recovered request resumes its output);
- failing a request: one error event to its gateway (`recoverable` when no output was lost);
- dropping the sequences past their deadline;
- guided decoding: a constrained sequence is held (`compiling`) until its grammar has compiled
  in the background (common.engine.guided), then gets its matcher, which first takes the output
  the sequence already has (a recovered request's, the first token a prefill instance sampled),
  and joins the scheduler; a spec that does not compile fails the request;
- streaming a forward's results: each scheduler `SequenceUpdate` becomes the `TokenUpdate` its
  gateway reads.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.block_pool import KVCacheManager
from common.config import InstanceConfig
from common.engine.metrics import InstanceMetrics
from common.errors import InvalidRequestError
from common.messaging import Outbox
from common.plan import BatchPlan, ModelOutput
from common.protocol import GenerateRequest, KVTransferDone, KVTransferOffer, Message, TokenUpdate
from common.schedulers.base import Scheduler, SequenceUpdate
from common.sequence import Sequence, SequenceMeta
from common.transfer import KVTransferBackend

if TYPE_CHECKING:  # the runner and the grammar engine bring torch; only types are needed here
    from concurrent.futures import Future

    from common.engine.guided import GrammarCompiler
    from common.engine.model_runner import ModelRunner

IDLE_WAIT_S = 0.02


@dataclass
class RoleContext:
    """What a role may use: the engine, the block tables, transfer, and message sending."""

    instance_id: str
    config: InstanceConfig
    runner: ModelRunner
    kv: KVCacheManager
    transfer: KVTransferBackend
    outbox: Outbox
    inbox_address: str
    metrics: InstanceMetrics | None = None
    pending_tokens: dict[str, list[TokenUpdate]] = field(default_factory=lambda: defaultdict(list))
    # Made on the first constrained request; kept across flips with the runner it compiles for.
    grammar: GrammarCompiler | None = None

    def count(self, name: str, amount: float = 1.0, **labels) -> None:
        """Bump an instance counter (e.g. leases_expired); a no-op without metrics."""
        if self.metrics is not None:
            self.metrics.count(name, amount, **labels)

    def send(self, address: str, message: Message) -> bool:
        return self.outbox.send(address, message)

    def emit(self, reply_to: str, update: TokenUpdate) -> None:
        """Queue a token update for `reply_to`; the worker flushes once per loop turn."""
        self.pending_tokens[reply_to].append(update)


class Role(ABC):
    """The active role of an instance. Subclasses register in `splitserve.roles` and set
    `self.scheduler`, the scheduler that plans their forwards."""

    name = "?"
    scheduler: Scheduler

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.draining = False
        # Constrained sequences whose grammar is compiling: seq id -> (sequence, how it joins
        # the scheduler, the compile's future). Not scheduled yet; a decode's hold their KV.
        self.compiling: dict[str, tuple[Sequence, Callable[[Sequence], None], Future]] = {}

    @abstractmethod
    def handle(self, message: Message) -> None:
        """React to one message from the gateway or a peer instance."""

    @abstractmethod
    def poll(self) -> None:
        """Advance background work: transfers, dispatch, timeouts."""

    def schedule(self) -> BatchPlan:
        """The next forward (empty when nothing can run)."""
        return self.scheduler.schedule()

    @abstractmethod
    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> None:
        """Absorb a forward's result and emit what it produced."""

    @abstractmethod
    def load(self) -> dict:
        """num_waiting, num_running, num_transferring, num_queued_tokens for InstanceStats."""

    def live_seq_ids(self) -> set[str]:
        """Sequences that may own KV blocks right now (for the integrity check)."""
        return self.scheduler.seq_ids() | set(self.compiling)

    @property
    def has_work(self) -> bool:
        """True while a forward could run without a new message."""
        return self.scheduler.has_work

    @property
    def wait_s(self) -> float:
        """How long the loop may block on the inbox when there is no forward to run."""
        return IDLE_WAIT_S

    # Sequences a drain handed back to their gateways instead of finishing (the decode role's
    # --flip-drain migrate); the FlipReport carries it.
    num_migrated = 0

    def begin_drain(self) -> None:
        """A flip is coming: finish what is held, take no new work that can go elsewhere."""
        self.draining = True

    def close(self) -> None:
        """Release what the role started (threads, files); the instance is stopping."""

    @property
    @abstractmethod
    def is_drained(self) -> bool:
        """True once nothing is held: no sequence, queue, lease or transfer."""

    # -- requests in, errors out -----------------------------------------------------------------
    def sequence_for(self, request: GenerateRequest) -> Sequence:
        """The request as a sequence; a recovered request resumes with the tokens it had already
        generated counted as output."""
        num_prompt = len(request.prompt_token_ids) - request.num_generated
        seq = Sequence(request.request_id, request.prompt_token_ids[:num_prompt],
                       request.sampling, self.ctx.runner.max_model_len,
                       meta=SequenceMeta(request.reply_to, request.deadline,
                                         request.arrival_time,
                                         decode_cached=dict(request.decode_cached_tokens)))
        seq.token_ids = list(request.prompt_token_ids)
        return seq

    def fits_or_fail(self, seq: Sequence) -> bool:
        """Whether the sequence (and its next token) fits in this instance's KV cache at all;
        fails it when it does not."""
        if self.ctx.kv.num_blocks_for(seq.num_tokens + 1) <= self.ctx.kv.num_blocks:
            return True
        self.fail(seq, "the prompt needs more KV blocks than this instance has")
        return False

    def fail(self, seq: Sequence, error: str, recoverable: bool = False,
             bad_request: bool = False) -> None:
        """End the sequence's request with an error event to its gateway (`bad_request`: the
        request's own fault, a 400 for the client)."""
        self.fail_request(seq.meta.reply_to, seq.seq_id, error, recoverable=recoverable,
                          num_prompt_tokens=seq.num_prompt_tokens,
                          num_output_tokens=seq.num_output_tokens, bad_request=bad_request)

    def fail_request(self, reply_to: str, request_id: str, error: str, *,
                     recoverable: bool = False, num_prompt_tokens: int = 0,
                     num_output_tokens: int = 0, bad_request: bool = False) -> None:
        """End a request this role holds no sequence for (yet) with an error event."""
        self.ctx.emit(reply_to, TokenUpdate(
            request_id, finish_reason="error", error=error, instance_id=self.ctx.instance_id,
            num_prompt_tokens=num_prompt_tokens, num_output_tokens=num_output_tokens,
            recoverable=recoverable, bad_request=bad_request))

    def refuse_offer(self, offer: KVTransferOffer) -> None:
        """A KV offer reached an instance that does not decode (it flipped): the prefill
        instance offers the blocks elsewhere."""
        self.ctx.send(offer.source_inbox, KVTransferDone.rejected(
            offer.request_id, "not a decode instance"))

    # -- deadlines -------------------------------------------------------------------------------
    def expire_deadlines(self, error: str = "request deadline exceeded") -> None:
        """Drop and fail every sequence of the scheduler that is past its deadline."""
        now = time.time()
        for seq in self.scheduler.past_deadline(now):
            self.discard(seq.seq_id, "deadline")
            self.fail(seq, error)
        for seq, _, _ in list(self.compiling.values()):
            if seq.meta.is_past_deadline(now):
                self._fail_held(seq, error)

    def discard(self, seq_id: str, reason: str) -> None:
        """Forget a sequence nobody waits for any more and free its blocks."""
        self.scheduler.abort(seq_id)
        self.drop_compiling(seq_id)

    # -- guided decoding -------------------------------------------------------------------------
    def grammar_compiler(self) -> GrammarCompiler:
        if self.ctx.grammar is None:
            from common.engine import guided  # torch and xgrammar: only once a request asks

            self.ctx.grammar = guided.compiler_for_runner(self.ctx.runner)
        return self.ctx.grammar

    def prepare_guided(self, sampling) -> None:
        """Start compiling a request's grammar early (e.g. while its KV is being read)."""
        if sampling.guided is not None:
            self.grammar_compiler().submit(sampling.guided)

    def admit_guided(self, seq: Sequence, admit: Callable[[Sequence], None]) -> None:
        """`admit(seq)` (into the scheduler) now, or for a constrained sequence once its
        grammar has compiled: held in `compiling` meanwhile, never scheduled."""
        if seq.sampling.guided is None:
            admit(seq)
            return
        future = self.grammar_compiler().submit(seq.sampling.guided)
        self.compiling[seq.seq_id] = (seq, admit, future)
        if future.done():  # compiled for an earlier request: no need to wait for the loop
            self.admit_compiled()

    def admit_compiled(self) -> None:
        """Each loop turn: the held sequences whose grammar is ready join their scheduler,
        matcher attached; those whose spec did not compile fail."""
        for seq, admit, future in [h for h in self.compiling.values() if h[2].done()]:
            error = self._attach_guide(seq, future)
            if error:
                # the spec's own error (InvalidRequestError) is the client's: a 400
                self._fail_held(seq, error, isinstance(future.exception(), InvalidRequestError))
            else:
                del self.compiling[seq.seq_id]
                admit(seq)

    @staticmethod
    def _attach_guide(seq: Sequence, future: Future) -> str:
        """Give the sequence its matcher, past the output it has; the error, or ""."""
        error = future.exception()
        if error is not None:  # the spec's own error says so; anything else is ours
            return str(error) if isinstance(error, InvalidRequestError) else \
                f"guided decoding unavailable: {error}"
        seq.guide = future.result().matcher(seq.sampling)
        if not seq.guide.accept_all(seq.output_token_ids):
            return "guided decoding: the request's generated tokens do not match its grammar"
        return ""

    def _fail_held(self, seq: Sequence, error: str, bad_request: bool = False) -> None:
        self.drop_compiling(seq.seq_id)
        self.discard(seq.seq_id, "guided decoding")  # the role's own bookkeeping (routes, ...)
        self.fail(seq, error, bad_request=bad_request)

    def drop_compiling(self, seq_id: str) -> None:
        """Forget a held sequence (aborted, expired, failed) and free the KV it holds."""
        if self.compiling.pop(seq_id, None) is not None:
            self.ctx.kv.free(seq_id)

    # -- streaming -------------------------------------------------------------------------------
    def token_update(self, update: SequenceUpdate) -> TokenUpdate:
        return TokenUpdate(update.seq_id, update.new_token_ids, update.finish_reason,
                           update.num_prompt_tokens, update.num_output_tokens,
                           self.ctx.instance_id, logprobs=update.logprobs,
                           prompt_logprobs=update.prompt_logprobs)

    def stream(self, plan: BatchPlan, output: ModelOutput) -> list[tuple[Sequence, SequenceUpdate]]:
        """Absorb a forward into the scheduler and send each sequence's new tokens to its
        gateway. Returns the (sequence, update) pairs, finished sequences included."""
        held = self.scheduler.sequences_in(plan)
        updates = self.scheduler.update_from_output(plan, output)
        for u in updates:
            self.ctx.emit(held[u.seq_id].meta.reply_to, self.token_update(u))
        return [(held[u.seq_id], u) for u in updates]
