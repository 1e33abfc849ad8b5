"""The gateway's core: send requests to prefill instances, gather their tokens, monitor the cluster.

Tasks on the gateway's event loop:
- receive: drains the gateway inbox: InstanceStats into the registry, TokenBatch items into
  each request's queue;
- monitor: every broadcast interval, the decode instances' loads go to every prefill instance
  (ClusterView), so their dispatchers see the cluster as it is.

A request's life here: `submit` (pick the least-loaded prefill instance, record, send) ->
`events` (text deltas as tokens arrive, each wait bounded by the token timeout and the request
deadline) -> `close` (if unfinished, AbortRequest to every instance that may hold it).
Only the gateway tokenizes and detokenizes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import zmq
import zmq.asyncio

from common.config import GatewayConfig
from common.detokenizer import TextStream
from common.errors import SplitserveError
from common.messaging import AsyncInbox, Outbox
from common.protocol import (AbortRequest, ClusterView, GenerateRequest, InstanceStats,
                             TokenBatch, TokenUpdate)
from common.sampling_params import SamplingParams
from common.tokenizer import TextTokenizer
from control_plane.cluster import InstanceRegistry
from control_plane.request_table import InMemoryRequestTable, Phase, RequestRecord, RequestTable

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


@dataclass
class RequestHandle:
    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    deadline: float  # time.monotonic()
    prefill_instance: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    decode_instance: str = ""
    num_output_tokens: int = 0
    finished: bool = False
    stopped_by_string: bool = False  # instances may still be generating: abort them on close


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: TextTokenizer, served_name: str,
                 table: RequestTable | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.served_name = served_name
        self.registry = InstanceRegistry(config.instance_timeout_s)
        self.table = table or InMemoryRequestTable()
        self.handles: dict[str, RequestHandle] = {}
        self._tasks: list[asyncio.Task] = []
        self.inbox_address = ""

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._actx = zmq.asyncio.Context()
        self._ctx = zmq.Context()
        self.inbox = AsyncInbox(self._actx, self.config.host, self.config.inbox_port)
        self.inbox_address = self.inbox.address
        self.outbox = Outbox(self._ctx)
        self._tasks = [asyncio.create_task(self._receive_loop(), name="gateway-receive"),
                       asyncio.create_task(self._monitor_loop(), name="gateway-monitor")]
        log.info("gateway inbox at %s", self.inbox_address)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.inbox.close()
        self.outbox.close()
        self._actx.term()
        self._ctx.term()

    async def _receive_loop(self) -> None:
        while True:
            message = await self.inbox.receive()
            if isinstance(message, TokenBatch):
                for update in message.items:
                    handle = self.handles.get(update.request_id)
                    if handle is not None:
                        handle.queue.put_nowait(update)
            elif isinstance(message, InstanceStats):
                if self.registry.report(message) and message.role == "decode":
                    self._broadcast()

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.broadcast_interval_s)
            self._broadcast()
            self._sweep_expired()

    def _sweep_expired(self) -> None:
        """Close requests past their deadline whose stream never started (no reader left)."""
        now = time.monotonic()
        for handle in [h for h in self.handles.values() if now > h.deadline + 1.0]:
            self.close(handle)

    def _broadcast(self) -> None:
        view = ClusterView(self.registry.decode_peers(), time.time())
        for state in self.registry.ready("prefill"):
            self.outbox.send(state.stats.inbox, view)

    # -- cluster facts ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int | None:
        lengths = [s.stats.max_model_len for s in self.registry.instances.values()]
        return min(lengths) if lengths else None

    def is_serving(self) -> bool:
        return self.registry.is_serving()

    # -- requests ------------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Send a request to the least-loaded prefill instance (NoInstanceError if none)."""
        if not self.registry.is_serving():
            raise NoInstanceError("no prefill and decode instances are ready yet")
        target = self.registry.least_loaded_prefill()
        request_id = uuid.uuid4().hex
        now_wall, now = time.time(), time.monotonic()
        handle = RequestHandle(request_id, len(prompt_token_ids), params,
                               now + self.config.request_timeout_s, target.stats.instance_id)
        self.handles[request_id] = handle
        self.table.create(RequestRecord(request_id, now_wall, len(prompt_token_ids),
                                        prefill_instance=target.stats.instance_id))
        self.outbox.send(target.stats.inbox, GenerateRequest(
            request_id, prompt_token_ids, params, self.inbox_address, now_wall,
            now_wall + self.config.request_timeout_s))
        self.registry.note_sent(target, len(prompt_token_ids))
        return handle

    async def events(self, handle: RequestHandle) -> AsyncIterator[StreamEvent]:
        """Text deltas until the request finishes, fails, or times out."""
        text = TextStream(self.tokenizer, handle.params.stop)
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
        try:
            return await asyncio.wait_for(handle.queue.get(), max(timeout, 0.0))
        except asyncio.TimeoutError:
            return None

    def _absorb(self, handle: RequestHandle, update: TokenUpdate, text: TextStream
                ) -> StreamEvent | None:
        if update.next_instance:
            handle.decode_instance = update.next_instance
            self.table.advance(handle.request_id, Phase.DECODING,
                               decode_instance=update.next_instance)
        if update.error:
            return self._end(handle, error=update.error)
        if not update.token_ids and update.finish_reason is None:
            return None
        if handle.num_output_tokens == 0 and update.token_ids:
            self.table.advance(handle.request_id, Phase.PREFILLED)
        handle.num_output_tokens = max(handle.num_output_tokens + len(update.token_ids),
                                       update.num_output_tokens)
        finish = update.finish_reason
        delta = text.push(update.token_ids, finish is not None)
        if finish is None and text.stopped:
            finish = "stop"
            handle.stopped_by_string = True
        if finish is not None:
            return self._end(handle, delta, finish)
        return StreamEvent(delta, None, None, handle.num_prompt_tokens, handle.num_output_tokens)

    def _end(self, handle: RequestHandle, text: str = "", finish: str | None = None,
             error: str | None = None) -> StreamEvent:
        handle.finished = error is None and finish not in (None, "abort")
        if handle.finished:
            self.table.advance(handle.request_id, Phase.FINISHED)
        else:
            handle.finished = True
            self._abort_instances(handle, error or "aborted")
            self.table.advance(handle.request_id, Phase.FAILED)
        return StreamEvent(text, finish or ("error" if error else None), error,
                           handle.num_prompt_tokens, handle.num_output_tokens)

    def close(self, handle: RequestHandle) -> None:
        """Forget the request; if it has not finished (client gone), abort it everywhere."""
        if self.handles.pop(handle.request_id, None) is None:
            return
        if not handle.finished:
            handle.finished = True
            self._abort_instances(handle, "client disconnected")
            self.table.advance(handle.request_id, Phase.ABORTED)
        elif handle.stopped_by_string:
            self._abort_instances(handle, "stop string")

    def _abort_instances(self, handle: RequestHandle, reason: str) -> None:
        for instance_id in {handle.prefill_instance, handle.decode_instance} - {""}:
            state = self.registry.get(instance_id)
            if state is not None:
                self.outbox.send(state.stats.inbox, AbortRequest(handle.request_id, reason))
