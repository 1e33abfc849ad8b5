"""The gateway's core: send requests to prefill instances, gather their tokens, recover failures.

Tasks on the gateway's event loop: `receive` drains the inbox (InstanceStats and FlipReports to
the monitor, TokenBatch items to each request's queue) and `monitor` runs the ClusterMonitor
(control_plane/monitor.py).

A request's life here: `submit` (pick the least-loaded prefill instance, record, send) ->
`events` (text deltas as tokens arrive; each wait bounded by the token timeout and the request
deadline) -> `close` (if unfinished, AbortRequest to every instance that may hold it).

Recovery: when an instance holding a request dies (or a KV transfer fails without losing
output), the request runs again as a new attempt on another prefill instance, with the tokens
already streamed appended to its prompt as generated output, so the stream simply continues.
After `max_recoveries` attempts, or with nowhere to run, the stream ends with an error event.
Only the gateway tokenizes and detokenizes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from common.config import GatewayConfig
from common.detokenizer import TextStream
from common.errors import SplitserveError
from common.messaging import AsyncInbox, Outbox
from common.protocol import (
    AbortRequest,
    FlipReport,
    GenerateRequest,
    InstanceStats,
    KVCacheEvents,
    TokenBatch,
    TokenUpdate,
)
from common.sampling_params import SamplingParams
from common.security import load_keys, stop_guard
from common.store import ControlStore, open_store
from common.tokenizer import TextTokenizer
from control_plane.admission import Admission
from control_plane.cluster import InstanceRegistry
from control_plane.metrics import GatewayMetrics
from control_plane.monitor import ClusterMonitor
from control_plane.request_table import Phase, RequestRecord, RequestTable
from control_plane.routing import make_router
from control_plane.transition import make_watcher

log = logging.getLogger(__name__)


class NoInstanceError(SplitserveError):
    """No prefill or decode instance is ready (HTTP 503)."""


@dataclass
class StreamEvent:
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    bad_request: bool = False  # the error is the request's own fault (HTTP 400)
    # Only for requests that asked: the TokenLogprobs of the tokens behind this delta, and (once,
    # with the first) of the prompt's tokens after its first
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class UpdateQueue:
    """One request's token updates, in order, for the one coroutine that streams them.

    `get(timeout_s)` waits with one future and one timer: asyncio.wait_for would wrap every wait
    in a new task, and the gateway waits once per generated token of every stream."""

    def __init__(self) -> None:
        self._items: deque[TokenUpdate] = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, update: TokenUpdate) -> None:
        self._items.append(update)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def qsize(self) -> int:
        return len(self._items)

    async def get(self, timeout_s: float) -> TokenUpdate | None:
        """The next update; None if none arrives within `timeout_s`."""
        if not self._items:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout_s, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self._items:
                return None
        return self._items.popleft()


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass
class RequestHandle:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float  # time.monotonic()
    prefill_instance: str
    submitted_at: float = field(default_factory=time.monotonic)
    attempt_id: str = ""  # id of the current attempt; instances only ever see attempt ids
    queue: UpdateQueue = field(default_factory=UpdateQueue)
    decode_instance: str = ""
    phase: Phase = Phase.QUEUED  # of the current attempt, as last written to the request table
    output_token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    recoveries: int = 0
    finished: bool = False
    stopped_by_string: bool = False  # instances may still be generating: abort them on close

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: TextTokenizer, served_name: str,
                 store: ControlStore | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.served_name = served_name
        self.gateway_id = config.gateway_id or f"gateway-{uuid.uuid4().hex[:6]}"
        self.store = store or open_store(config.store_url, config.store_prefix)
        self.registry = InstanceRegistry(config.instance_timeout_s)
        self.table = RequestTable(self.store)
        self.handles: dict[str, RequestHandle] = {}  # attempt id -> handle
        self.metrics = GatewayMetrics()
        self.admission = Admission(config.limits, self.registry)
        self.router = make_router(self.registry, config)
        self._tasks: list[asyncio.Task] = []
        self.inbox_address = ""
        self.monitor: ClusterMonitor | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._actx = zmq.asyncio.Context()
        self._ctx = zmq.Context()
        keys = load_keys(self.config.cluster_secret_file)
        self.inbox = AsyncInbox(self._actx, self.config.host, self.config.inbox_port,
                                self.config.advertise_host, keys)
        self.inbox_address = self.registry.address = self.inbox.address
        self.outbox = Outbox(self._ctx, keys)
        self.monitor = ClusterMonitor(self.registry, self.store, self.outbox, self.gateway_id,
                                      self.config.broadcast_interval_s,
                                      make_watcher(self.config.flip_policy,
                                                   **dict(self.config.flip_options)),
                                      self._on_instances_removed,
                                      on_kv_events=self.router.index.apply)
        self.monitor.on_flip = lambda r: self.metrics.flips.labels(
            direction=f"{r.from_role}_to_{r.to_role}").inc()
        self._tasks = [asyncio.create_task(self._receive_loop(), name="gateway-receive"),
                       asyncio.create_task(self.monitor.run(), name="gateway-monitor"),
                       asyncio.create_task(self._sweep_loop(), name="gateway-sweep")]
        log.info("gateway %s inbox at %s", self.gateway_id, self.inbox_address)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.monitor.close()
        self.inbox.close()
        self.outbox.close()
        stop_guard(self._actx)
        self._actx.term()
        self._ctx.term()
        self.store.close()

    async def _receive_loop(self) -> None:
        while True:
            message = await self.inbox.receive()
            if isinstance(message, TokenBatch):
                for update in message.items:
                    handle = self.handles.get(update.request_id)
                    if handle is not None:
                        handle.queue.put_nowait(update)
                    elif update.finish_reason is None:
                        self._stop_orphan(update)
            elif isinstance(message, InstanceStats):
                self.monitor.on_stats(message)
            elif isinstance(message, FlipReport):
                self.monitor.on_flip_report(message)
            elif isinstance(message, KVCacheEvents):
                self.router.index.apply(message)

    def _stop_orphan(self, update: TokenUpdate) -> None:
        """Tokens for an attempt nobody waits for (abandoned, recovered elsewhere, or its
        instance was thought dead and came back): tell the instance to stop."""
        state = self.registry.get(update.instance_id)
        if state is not None:
            self.outbox.send(state.stats.inbox, AbortRequest(update.request_id, "orphaned"))

    async def _sweep_loop(self) -> None:
        """Close requests past their deadline whose stream never started (no reader left)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for handle in [h for h in self.handles.values() if now > h.deadline + 1.0]:
                self.close(handle)

    # -- cluster facts ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int | None:
        lengths = [s.stats.max_model_len for s in self.registry.instances.values()]
        return min(lengths) if lengths else None

    def is_serving(self) -> bool:
        return self.registry.is_serving()

    # -- requests ------------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams, prefer: str = ""
               ) -> RequestHandle:
        """Send a request where the router says (NoInstanceError if nowhere), or to instance
        `prefer` while it can take it (a request's further choices go where the first one's
        prompt is cached)."""
        if not self.registry.is_serving():
            raise NoInstanceError("no prefill and decode instances are ready yet")
        request_id = uuid.uuid4().hex
        handle = RequestHandle(request_id, list(prompt_token_ids), params,
                               time.monotonic() + self.config.request_timeout_s, "")
        self.table.create(RequestRecord(request_id, time.time(), len(prompt_token_ids)))
        self._send_attempt(handle, prefer=prefer)
        return handle

    def _send_attempt(self, handle: RequestHandle, exclude: set[str] = frozenset(),
                      prefer: str = "") -> bool:
        generated = handle.output_token_ids
        route = self.router.choose(handle.prompt_token_ids + generated, exclude, prefer)
        if route is None:
            return False
        target = route.target
        self.handles.pop(handle.attempt_id, None)
        handle.attempt_id = f"{handle.request_id}.{handle.recoveries}"
        handle.prefill_instance, handle.decode_instance = target.stats.instance_id, ""
        handle.phase = Phase.QUEUED
        self.handles[handle.attempt_id] = handle
        remaining_s = max(handle.deadline - time.monotonic(), 0.0)
        self.outbox.send(target.stats.inbox, GenerateRequest(
            handle.attempt_id, handle.prompt_token_ids + generated, handle.params,
            self.inbox_address, time.time(), time.time() + remaining_s, len(generated),
            local_prefill=route.local_prefill,
            decode_cached_tokens=route.decode_cached_tokens))
        self.registry.note_sent(target, handle.num_prompt_tokens + len(generated))
        self.table.advance(handle.request_id, Phase.QUEUED,
                           prefill_instance=target.stats.instance_id)
        return True

    async def events(self, handle: RequestHandle) -> AsyncIterator[StreamEvent]:
        """Text deltas until the request finishes, fails, or times out."""
        text = TextStream(self.tokenizer, handle.params.stop, handle.params.min_tokens)
        while not handle.finished:
            update = await self._next_update(handle)
            if update is None:
                yield self._end(handle, error="timed out waiting for the next token")
                return
            event = self._absorb(handle, update, text)
            if event is not None:
                yield event

    async def _next_update(self, handle: RequestHandle) -> TokenUpdate | None:
        timeout = min(self.config.token_timeout_s, handle.deadline - time.monotonic())
        return await handle.queue.get(max(timeout, 0.0))

    def _absorb(self, handle: RequestHandle, update: TokenUpdate, text: TextStream
                ) -> StreamEvent | None:
        if update.request_id != handle.attempt_id:
            return None  # from an attempt that was abandoned
        if update.next_instance:
            handle.decode_instance = update.next_instance
        if update.error:
            if update.recoverable and self._recover(handle, update.error):
                return None
            event = self._end(handle, error=update.error)
            event.bad_request = update.bad_request
            return event
        self._note_tokens(handle, update.token_ids)
        self._advance_phase(handle, update)
        if not update.token_ids and update.finish_reason is None:
            return None
        finish = update.finish_reason
        delta = text.push(update.token_ids, finish is not None)
        if finish is None and text.stopped:
            finish, handle.stopped_by_string = "stop", True
        event = (self._end(handle, delta, finish) if finish is not None else
                 StreamEvent(delta, None, None, handle.num_prompt_tokens,
                             len(handle.output_token_ids)))
        if update.logprobs or update.prompt_logprobs:
            self._attach_logprobs(handle, update, event)
        return event

    @staticmethod
    def _attach_logprobs(handle: RequestHandle, update: TokenUpdate, event: StreamEvent) -> None:
        event.token_ids, event.logprobs = update.token_ids, update.logprobs
        if update.prompt_logprobs and handle.params.prompt_logprobs is not None:
            event.prompt_logprobs = update.prompt_logprobs
            # delivered: an attempt after a failure need not compute them again
            handle.params = msgspec.structs.replace(handle.params, prompt_logprobs=None)

    def _advance_phase(self, handle: RequestHandle, update: TokenUpdate) -> None:
        """PREFILLED at the attempt's first token, then DECODING once a decode instance holds
        the request. The hand-off comes with the first token (request-level transfer) or before
        it (chunk-level), so DECODING waits for PREFILLED; a request handed on again (its offer
        refused) records the new decode instance."""
        if update.token_ids and handle.phase is Phase.QUEUED:
            handle.phase = Phase.PREFILLED
            self.table.advance(handle.request_id, Phase.PREFILLED)
        handed_on = update.next_instance and handle.phase is Phase.DECODING
        if handed_on or (handle.phase is Phase.PREFILLED and handle.decode_instance):
            handle.phase = Phase.DECODING
            self.table.advance(handle.request_id, Phase.DECODING,
                               decode_instance=handle.decode_instance)

    def _note_tokens(self, handle: RequestHandle, token_ids: list[int]) -> None:
        if not token_ids:
            return
        now = time.monotonic()
        if handle.first_token_time is None:
            handle.first_token_time = now
            ttft = now - handle.submitted_at
            self.metrics.ttft.observe(ttft)
            if self.monitor is not None:
                self.monitor.recent_ttfts.append(ttft)
        else:
            self.metrics.tbt.observe(now - handle.last_token_time)
        handle.last_token_time = now
        handle.output_token_ids.extend(token_ids)

    def _count(self, handle: RequestHandle, status: str) -> None:
        jct = (handle.last_token_time - handle.submitted_at) if handle.last_token_time else None
        self.metrics.finished(status, handle.num_prompt_tokens, len(handle.output_token_ids),
                              jct if status == "ok" else None)

    # -- failures --------------------------------------------------------------------------------
    def _on_instances_removed(self, instance_ids: list[str]) -> None:
        dead = set(instance_ids)
        for instance_id in dead:
            self.router.index.forget(instance_id)
        for handle in list(self.handles.values()):
            holder = handle.decode_instance or handle.prefill_instance
            if not handle.finished and holder in dead:
                handle.queue.put_nowait(TokenUpdate(
                    handle.attempt_id, finish_reason="error", recoverable=True,
                    error=f"instance {holder} failed"))

    def _recover(self, handle: RequestHandle, reason: str) -> bool:
        """Run the request again elsewhere; False when it cannot be (the caller fails it)."""
        if handle.recoveries >= self.config.max_recoveries:
            return False
        if len(handle.output_token_ids) >= handle.params.max_tokens:
            return False
        old = {handle.prefill_instance, handle.decode_instance} - {""}
        self._abort_instances(handle, "recovering elsewhere")
        handle.recoveries += 1
        if not self._send_attempt(handle, exclude=old) and not self._send_attempt(handle):
            handle.recoveries -= 1
            return False
        log.warning("request %s recovered after: %s", handle.request_id, reason)
        return True

    def _end(self, handle: RequestHandle, text: str = "", finish: str | None = None,
             error: str | None = None) -> StreamEvent:
        handle.finished = True
        if error is None and finish not in (None, "abort"):
            self.table.advance(handle.request_id, Phase.FINISHED)
            self._count(handle, "ok")
        else:
            self._abort_instances(handle, error or "aborted")
            self.table.advance(handle.request_id, Phase.FAILED)
            self._count(handle, "error")
        return StreamEvent(text, finish or ("error" if error else None), error,
                           handle.num_prompt_tokens, len(handle.output_token_ids))

    def close(self, handle: RequestHandle) -> None:
        """Forget the request; if it has not finished (client gone), abort it everywhere."""
        if self.handles.pop(handle.attempt_id, None) is None:
            return
        if not handle.finished:
            handle.finished = True
            self._abort_instances(handle, "client disconnected")
            self.table.advance(handle.request_id, Phase.ABORTED)
            self._count(handle, "aborted")
        elif handle.stopped_by_string:
            self._abort_instances(handle, "stop string")

    def _abort_instances(self, handle: RequestHandle, reason: str) -> None:
        for instance_id in {handle.prefill_instance, handle.decode_instance} - {""}:
            state = self.registry.get(instance_id)
            if state is not None:
                self.outbox.send(state.stats.inbox, AbortRequest(handle.attempt_id, reason))
