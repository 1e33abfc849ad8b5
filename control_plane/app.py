"""The HTTP API (FastAPI): OpenAI completions and chat, models, health, cluster.

Every error is OpenAI's error JSON: bad input is a 400 (malformed JSON, wrong types, unknown
model, prompt or max_tokens over the context), no ready instance a 503, a failure inside the
cluster a 500. Streams are server-sent events whose first chunk carries the first generated
text (no role-only chunk ahead of it), with no comment or keep-alive lines; with
`stream_options.include_usage` a last chunk with `choices: []` carries the usage.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.errors import InvalidRequestError
from control_plane.admission import BodyLimit, TooBusyError, UnauthorizedError
from control_plane.gateway import Gateway, NoInstanceError
from control_plane.monitor import FlipError
from control_plane.openai_api import ChatCompletionRequest, CompletionRequest, error_body
from control_plane.serving import Api, ErrorResponse

log = logging.getLogger(__name__)


class FlipBody(BaseModel):
    instance_id: str
    role: str


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return ErrorResponse(error_body(message, kind, param, status), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    location = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":  # a field of no schema we implement
        return f"`{param}` is not supported by this server", param
    return (f"{param}: {message}" if param else message), param


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
