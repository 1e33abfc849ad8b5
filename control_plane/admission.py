"""Admission control at the gateway: who may send, how much, and whether there is room now.

Checked before a request is sent to any instance:
- authentication: with API keys configured, `Authorization: Bearer <key>` (401 otherwise);
- input limits: prompt tokens and max_tokens (400 when over);
- room: requests in flight at this gateway, concurrent requests per client (API key, or the
  client's address without keys), prompt tokens queued over the prefill pool, seconds of prefill
  work queued (tokens / measured tokens per forward-second), sequences waiting over the decode
  pool (429 with Retry-After when full), so overload turns into fast refusals
  instead of growing memory and latency without bound.
The request body size is bounded by `BodyLimit`, an ASGI middleware (413).
"""

from __future__ import annotations

import hmac
import json
from collections import Counter

from common.config import LimitsConfig
from common.errors import InvalidRequestError, SplitserveError
from control_plane.cluster import InstanceRegistry
from control_plane.openai_api import error_body


class TooBusyError(SplitserveError):
    """No room for this request now (HTTP 429, Retry-After)."""


class UnauthorizedError(SplitserveError):
    """Missing or wrong API key (HTTP 401)."""


class Admission:
    def __init__(self, limits: LimitsConfig, registry: InstanceRegistry) -> None:
        self.limits = limits
        self.registry = registry
        self.in_flight = 0
        self.per_client: Counter[str] = Counter()

    def authenticate(self, authorization: str | None) -> str | None:
        """The caller's API key (None when keys are off); UnauthorizedError if it is wrong."""
        if not self.limits.api_keys:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(key.strip(), k)
                                                 for k in self.limits.api_keys):
            raise UnauthorizedError("a valid API key is required (Authorization: Bearer ...)")
        return key.strip()

    def check_sizes(self, num_prompt_tokens: int, max_tokens: int) -> None:
        limits = self.limits
        if limits.max_prompt_tokens and num_prompt_tokens > limits.max_prompt_tokens:
            raise InvalidRequestError(f"the prompt has {num_prompt_tokens} tokens; this server "
                                      f"accepts at most {limits.max_prompt_tokens}")
        if limits.max_output_tokens and max_tokens > limits.max_output_tokens:
            raise InvalidRequestError(f"max_tokens is {max_tokens}; this server allows at most "
                                      f"{limits.max_output_tokens}")

    def check_room(self, client: str) -> None:
        limits = self.limits
        if limits.max_in_flight and self.in_flight >= limits.max_in_flight:
            raise TooBusyError(f"{self.in_flight} requests in flight, the limit; retry shortly")
        if limits.max_streams_per_client and \
                self.per_client[client] >= limits.max_streams_per_client:
            raise TooBusyError(f"at most {limits.max_streams_per_client} concurrent requests per "
                               f"client")
        if self.registry.store_stale:
            return  # queue lengths are frozen while the store is away: do not refuse on them
        if limits.max_prefill_queue_tokens:
            queued = sum(s.stats.num_queued_tokens + s.sent_tokens_since_report
                         for s in self.registry.routable("prefill"))
            if queued >= limits.max_prefill_queue_tokens:
                raise TooBusyError(f"prefill queue is full ({queued} tokens); retry shortly")
        if limits.max_prefill_queue_s:
            self._check_prefill_wait(limits.max_prefill_queue_s)
        if limits.max_decode_waiting:
            waiting = sum(s.stats.num_waiting for s in self.registry.routable("decode"))
            if waiting >= limits.max_decode_waiting:
                raise TooBusyError(f"decode queue is full ({waiting} waiting); retry shortly")

    def _check_prefill_wait(self, bound_s: float) -> None:
        """429 when even the least-loaded prefill instance has `bound_s` of work queued (the
        router sends new prompts there). Instances whose speed is not measured yet don't count;
        with none measured, nothing is refused on this ground."""
        waits = [w for s in self.registry.routable("prefill") if (w := s.queued_seconds)
                 is not None]
        shortest = min(waits, default=None)
        if shortest is not None and shortest >= bound_s:
            raise TooBusyError(f"prefill queue is full (about {shortest:.1f} s of work); "
                               f"retry shortly")

    def acquire(self, client: str) -> None:
        """Count a request as in flight; `release` exactly once when it ends."""
        self.in_flight += 1
        self.per_client[client] += 1

    def release(self, client: str) -> None:
        self.in_flight -= 1
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]


class BodyLimit:
    """ASGI middleware: refuse request bodies over `max_bytes` with 413, without reading them
    whole (a declared Content-Length is checked first, a streamed body as it arrives)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._refuse(send)

    async def _refuse(self, send) -> None:
        body = json.dumps(error_body(f"request body over {self.max_bytes} bytes",
                                     "invalid_request_error", None, 413)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass
