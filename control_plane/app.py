"""The HTTP API (FastAPI): OpenAI completions and chat, models, health, cluster.

Every error is OpenAI's error JSON: bad input is a 400 (malformed JSON, wrong types, unknown
model, prompt or max_tokens over the context), no ready instance a 503, a failure inside the
cluster a 500. Streams are server-sent events whose first chunk carries the first generated
text (no role-only chunk ahead of it), with no comment or keep-alive lines; with
`stream_options.include_usage` a last chunk with `choices: []` carries the usage.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.errors import InvalidRequestError
from control_plane.admission import BodyLimit, TooBusyError, UnauthorizedError
from control_plane.gateway import Gateway, NoInstanceError, RequestHandle
from control_plane.monitor import FlipError
from control_plane.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
    check_supported,
    error_body,
    usage,
)

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25
LONG_TEXT_CHARS = 20_000


class FlipBody(BaseModel):
    instance_id: str
    role: str


class ErrorResponse(JSONResponse):
    """Error JSON escaped to ASCII: an error may quote the client's own text back (a model name),
    and a lone surrogate in it cannot be encoded as UTF-8, which would turn a 4xx into a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return ErrorResponse(error_body(message, kind, param, status), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    location = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    return (f"{param}: {message}" if param else message), param


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Api:
    """Request handling shared by the completions and chat endpoints."""

    def __init__(self, gateway: Gateway, aliases: set[str]) -> None:
        self.gateway = gateway
        self.aliases = aliases | {gateway.served_name}

    async def prepare(self, body, chat: bool) -> tuple[list[int], object]:
        if body.model not in self.aliases:
            raise InvalidRequestError(f"the model `{body.model}` does not exist; this server "
                                      f"serves `{self.gateway.served_name}`")
        check_supported(body)
        max_model_len = self.gateway.max_model_len
        if max_model_len is None:
            raise NoInstanceError("no instance has registered yet")
        tokenizer = self.gateway.tokenizer
        prompt_ids = await self._tokenize(body, chat)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        remaining = max_model_len - len(prompt_ids)
        default_max = remaining if chat else min(16, remaining)
        cap = self.gateway.config.limits.max_output_tokens
        if cap:
            default_max = min(default_max, cap)
        params = body.sampling_params(max(default_max, 1), tokenizer.eos_token_ids)
        if len(prompt_ids) + params.max_tokens > max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {max_model_len} tokens, but "
                f"{len(prompt_ids) + params.max_tokens} were requested ({len(prompt_ids)} in the "
                f"prompt, {params.max_tokens} for the completion)")
        return prompt_ids, params

    async def _tokenize(self, body, chat: bool) -> list[int]:
        """Prompt token ids; long texts are tokenized off the event loop so one large prompt
        cannot stall every other stream."""
        tokenizer = self.gateway.tokenizer
        if not chat and isinstance(body.prompt, list):
            prompt_ids = [int(t) for t in body.prompt]
            if any(not 0 <= t < tokenizer.vocab_size for t in prompt_ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, "
                                          f"{tokenizer.vocab_size})")
            return prompt_ids
        work = ((lambda: tokenizer.encode_chat(body.template_messages())) if chat
                else (lambda: tokenizer.encode(body.prompt)))
        size = sum(len(m.text()) for m in body.messages) if chat else len(body.prompt)
        return await asyncio.to_thread(work) if size > LONG_TEXT_CHARS else work()

    async def handle(self, body, chat: bool, request: Request):
        admission = self.gateway.admission
        key = admission.authenticate(request.headers.get("authorization"))
        client = key or (request.client.host if request.client else "?")
        admission.check_room(client)  # before any work: refusing must stay cheap under overload
        admission.acquire(client)
        try:
            prompt_ids, params = await self.prepare(body, chat)
            admission.check_sizes(len(prompt_ids), params.max_tokens)
            handle = self.gateway.submit(prompt_ids, params)
        except BaseException:
            admission.release(client)
            raise
        builder = ResponseBuilder(chat, self.gateway.served_name)
        if body.stream:
            return StreamingResponse(self._stream(handle, builder, body.stream_options, client),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            return await self._complete(handle, builder, request)
        finally:
            admission.release(client)

    async def _stream(self, handle: RequestHandle, builder: ResponseBuilder, options,
                      client: str):
        try:
            async for line in self._stream_lines(handle, builder, options):
                yield line
        finally:
            self.gateway.admission.release(client)

    async def _stream_lines(self, handle: RequestHandle, builder: ResponseBuilder, options):
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        last = None
        try:
            async for event in self.gateway.events(handle):
                last = event
                if event.error:
                    yield _sse(error_body(event.error, "server_error", None, 500))
                    break
                running = (usage(event.num_prompt_tokens, event.num_output_tokens)
                           if continuous else None)
                yield _sse(builder.chunk_json(event.text, event.finish_reason, running))
            if include_usage and last is not None and not last.error:
                yield _sse(builder.usage_chunk(usage(last.num_prompt_tokens,
                                                     last.num_output_tokens)))
            yield _sse("[DONE]")
        finally:
            self.gateway.close(handle)  # aborts the request everywhere if the client left

    async def _complete(self, handle: RequestHandle, builder: ResponseBuilder, request: Request):
        collect = asyncio.create_task(self._collect(handle))
        try:
            while not collect.done():
                await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S)
                if not collect.done() and await request.is_disconnected():
                    collect.cancel()
                    return _error(499, "client disconnected", "client_closed_request")
            text, last = collect.result()
        finally:
            if not collect.done():
                collect.cancel()
            self.gateway.close(handle)
        if last is None or last.error:
            return _error(500, (last.error if last else None) or "no output", "server_error")
        return JSONResponse(builder.response(text, last.finish_reason,
                                             usage(last.num_prompt_tokens,
                                                   last.num_output_tokens)))

    async def _collect(self, handle: RequestHandle):
        parts, last = [], None
        async for event in self.gateway.events(handle):
            parts.append(event.text)
            last = event
        return "".join(parts), last


def create_app(gateway: Gateway, aliases: set[str] | None = None, manage_gateway: bool = True
               ) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        if manage_gateway:
            await gateway.start()
        yield
        if manage_gateway:
            await gateway.stop()

    app = FastAPI(title="splitserve gateway", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=gateway.config.limits.max_body_bytes)
    api = Api(gateway, aliases or set())
    _add_error_handlers(app, gateway)
    _add_routes(app, api, gateway)
    return app


def _add_error_handlers(app: FastAPI, gateway: Gateway) -> None:
    rejected = gateway.metrics.requests.labels(status="rejected")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        rejected.inc()
        message, param = _validation_message(exc)
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(InvalidRequestError)
    async def _bad(_request, exc: InvalidRequestError):
        rejected.inc()
        return _error(400, str(exc), "invalid_request_error")

    retry_after = str(gateway.config.limits.retry_after_s)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(NoInstanceError)
    async def _unavailable(_request, exc: NoInstanceError):
        rejected.inc()
        response = _error(503, str(exc), "service_unavailable")
        response.headers["Retry-After"] = retry_after
        return response

    @app.exception_handler(TooBusyError)
    async def _busy(_request, exc: TooBusyError):
        rejected.inc()
        response = _error(429, str(exc), "rate_limit_exceeded")
        response.headers["Retry-After"] = retry_after
        return response

    @app.exception_handler(UnauthorizedError)
    async def _unauthorized(_request, exc: UnauthorizedError):
        rejected.inc()
        return _error(401, str(exc), "authentication_error")


def _add_routes(app: FastAPI, api: Api, gateway: Gateway) -> None:
    async def admin(request: Request) -> None:
        # async: FastAPI runs a plain `def` dependency on a worker thread, a thread hop (and GIL
        # hand-off) per request for a check that never blocks.
        gateway.admission.authenticate(request.headers.get("authorization"))

    @app.post("/v1/completions", dependencies=[Depends(admin)])  # 401 before body errors
    async def completions(body: CompletionRequest, request: Request):
        return await api.handle(body, False, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(admin)])  # 401 before body errors
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api.handle(body, True, request)

    @app.get("/v1/models", dependencies=[Depends(admin)])
    async def models():
        return {"object": "list", "data": [{
            "id": gateway.served_name, "object": "model", "created": 0, "owned_by": "splitserve",
            "max_model_len": gateway.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        counts: dict[str, int] = {}
        for state in gateway.registry.instances.values():
            if gateway.registry.is_ready(state):
                counts[state.stats.role] = counts.get(state.stats.role, 0) + 1
        return Response(gateway.metrics.exposition(counts), media_type=CONTENT_TYPE_LATEST)

    @app.get("/live")
    async def live():
        """Liveness: the gateway process serves HTTP (whatever the instances do)."""
        return {"status": "alive"}

    @app.get("/health")
    async def health():
        if gateway.is_serving():
            return {"status": "ok"}
        return _error(503, "waiting for a prefill and a decode instance", "service_unavailable")

    @app.get("/cluster", dependencies=[Depends(admin)])
    async def cluster():
        monitor = gateway.monitor
        try:  # off the event loop: the store may be slow or hung
            flips = (await asyncio.wait_for(asyncio.to_thread(gateway.store.flips), 2.0))[:50]
        except Exception:  # store unreachable: the rest of the view is still useful
            flips = None
        return {"gateway": {"id": gateway.gateway_id, "inbox": gateway.inbox_address,
                            "leader": bool(monitor and monitor.is_leader),
                            "store_reachable": not gateway.registry.store_stale,
                            "requests_in_flight": len(gateway.handles),
                            # what this gateway routes by: block hashes it knows per instance
                            "prefix_index": {instance: len(hashes) for instance, hashes
                                             in gateway.router.index.hashes.items()}},
                "instances": gateway.registry.describe(), "flips": flips}

    @app.post("/cluster/flip", dependencies=[Depends(admin)])
    async def flip(body: FlipBody):
        try:
            flip_id = gateway.monitor.flip(body.instance_id, body.role)
        except FlipError as exc:
            raise InvalidRequestError(str(exc)) from None
        return {"flip_id": flip_id, "instance_id": body.instance_id, "role": body.role}

    @app.get("/cluster/timeline", dependencies=[Depends(admin)])
    async def timeline(since: float = 0.0):
        return {"samples": [s for s in list(gateway.monitor.timeline) if s["time"] >= since]}
