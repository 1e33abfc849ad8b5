"""OpenAI serving: from a parsed completions or chat request to its response or stream.

A plain request (one prompt, one choice, no log-probabilities, echo or tools) takes the lean
path: one cluster request, its text deltas written straight into chunks. Everything else runs
its sequences through `FanOut` (control_plane/fanout.py) and builds choices from them: `n` and
`best_of` (candidates ranked by cumulative log-probability), lists of prompts (choice index =
prompt index x n + choice), `echo` (the prompt's text and log-probabilities first),
log-probabilities in OpenAI's shapes (control_plane/responses.py), and tool calls parsed out of
the text (control_plane/tools.py).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from common.errors import InvalidRequestError
from control_plane.fanout import FanOut, Job, make_jobs
from control_plane.gateway import Gateway, NoInstanceError, RequestHandle
from control_plane.openai_api import ChatCompletionRequest, check_supported, error_body
from control_plane.responses import LogprobsFormatter, ResponseBuilder, usage

DISCONNECT_POLL_S = 0.25
LONG_TEXT_CHARS = 20_000


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


@dataclass
class Prepared:
    """A request after validation: its prompts (token ids) and their sampling parameters."""

    prompts: list[list[int]]
    params: list  # SamplingParams per prompt
    tools: object | None = None  # control_plane.tools' per-request state, for chat with tools

    @property
    def is_plain(self) -> bool:
        p = self.params[0]
        return (len(self.prompts) == 1 and self.tools is None and p.logprobs is None
                and p.prompt_logprobs is None)


class Api:
    """Request handling shared by the completions and chat endpoints."""

    def __init__(self, gateway: Gateway, aliases: set[str]) -> None:
        self.gateway = gateway
        self.aliases = aliases | {gateway.served_name}
        self.formatter = LogprobsFormatter(gateway.tokenizer)

    # -- validation ------------------------------------------------------------------------------
    async def prepare(self, body, chat: bool) -> Prepared:
        if body.model not in self.aliases:
            raise InvalidRequestError(f"the model `{body.model}` does not exist; this server "
                                      f"serves `{self.gateway.served_name}`")
        check_supported(body)
        max_model_len = self.gateway.max_model_len
        if max_model_len is None:
            raise NoInstanceError("no instance has registered yet")
        tools = self._tools(body) if chat else None
        prompts = await self._tokenize(body, chat, tools)
        params = [self._params(body, chat, ids, max_model_len, tools) for ids in prompts]
        return Prepared(prompts, params, tools)

    def _params(self, body, chat: bool, prompt_ids: list[int], max_model_len: int, tools):
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        tokenizer = self.gateway.tokenizer
        remaining = max_model_len - len(prompt_ids)
        default_max = remaining if chat else min(16, remaining)
        cap = self.gateway.config.limits.max_output_tokens
        if cap:
            default_max = min(default_max, cap)
        params = body.sampling_params(max(default_max, 1), tokenizer.eos_token_ids,
                                      tokenizer.vocab_size)
        if tools is not None:
            params = tools.constrain(params)
        if len(prompt_ids) + params.max_tokens > max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {max_model_len} tokens, but "
                f"{len(prompt_ids) + params.max_tokens} were requested ({len(prompt_ids)} in the "
                f"prompt, {params.max_tokens} for the completion)")
        return params

    def _tools(self, body: ChatCompletionRequest):
        if not body.tools and body.tool_choice in (None, "none", "auto"):
            return None
        from control_plane.tool_requests import RequestTools  # only requests with tools pay

        return RequestTools.from_request(body, self.gateway.tokenizer)

    async def _tokenize(self, body, chat: bool, tools) -> list[list[int]]:
        """Prompt token ids per prompt; long texts are tokenized off the event loop so one large
        prompt cannot stall every other stream."""
        tokenizer = self.gateway.tokenizer
        if chat:
            messages = body.template_messages()
            work = lambda: [tokenizer.encode_chat(messages, tools=tools.definitions
                                                  if tools else None)]
            size = sum(len(m.text()) for m in body.messages)
            return await asyncio.to_thread(work) if size > LONG_TEXT_CHARS else work()
        prompts = body.prompts()
        for prompt in prompts:
            if isinstance(prompt, list) and any(
                    not 0 <= t < tokenizer.vocab_size for t in prompt):
                raise InvalidRequestError(f"prompt token ids must be in [0, "
                                          f"{tokenizer.vocab_size})")
        work = lambda: [p if isinstance(p, list) else tokenizer.encode(p) for p in prompts]
        size = sum(len(p) for p in prompts if isinstance(p, str))
        return await asyncio.to_thread(work) if size > LONG_TEXT_CHARS else work()

    # -- one request -----------------------------------------------------------------------------
    async def handle(self, body, chat: bool, request: Request):
        admission = self.gateway.admission
        key = admission.authenticate(request.headers.get("authorization"))
        client = key or (request.client.host if request.client else "?")
        admission.check_room(client)  # before any work: refusing must stay cheap under overload
        admission.acquire(client)
        try:
            prepared = await self.prepare(body, chat)
            for ids, params in zip(prepared.prompts, prepared.params):
                admission.check_sizes(len(ids), params.max_tokens)
            run = self._start(body, prepared)
        except BaseException:
            admission.release(client)
            raise
        builder = ResponseBuilder(chat, self.gateway.served_name)
        if body.stream:
            return StreamingResponse(self._stream(run, builder, body, prepared, client),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            return await self._complete(run, builder, body, prepared, request)
        finally:
            admission.release(client)

    def _start(self, body, prepared: Prepared) -> RequestHandle | FanOut:
        if prepared.is_plain and body.num_candidates == 1 and not getattr(body, "echo", False):
            return self.gateway.submit(prepared.prompts[0], prepared.params[0])
        fanout = FanOut(self.gateway, make_jobs(prepared.prompts, prepared.params,
                                                body.num_candidates))
        try:
            fanout.start()
        except BaseException:
            fanout.close()
            raise
        return fanout

    async def _stream(self, run, builder: ResponseBuilder, body, prepared: Prepared,
                      client: str):
        try:
            if isinstance(run, FanOut):
                from control_plane.stream_many import stream_lines

                lines = stream_lines(self, run, builder, body, prepared)
            else:
                lines = self._stream_lines(run, builder, body.stream_options)
            async for line in lines:
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
                    yield sse(stream_error(event))
                    break
                running = (usage(event.num_prompt_tokens, event.num_output_tokens)
                           if continuous else None)
                yield sse(builder.chunk_json(event.text, event.finish_reason, running))
            if include_usage and last is not None and not last.error:
                yield sse(builder.usage_chunk(usage(last.num_prompt_tokens,
                                                    last.num_output_tokens)))
            yield sse("[DONE]")
        finally:
            self.gateway.close(handle)  # aborts the request everywhere if the client left

    async def _complete(self, run, builder: ResponseBuilder, body, prepared: Prepared,
                        request: Request):
        collect = asyncio.create_task(self._collect(run))
        try:
            while not collect.done():
                await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S)
                if not collect.done() and await request.is_disconnected():
                    collect.cancel()
                    return error_response(499, "client disconnected", "client_closed_request")
            result = collect.result()
        finally:
            if not collect.done():
                collect.cancel()
            run.close() if isinstance(run, FanOut) else self.gateway.close(run)
        if isinstance(run, FanOut):
            from control_plane.stream_many import whole_response

            return whole_response(self, run, builder, body, prepared)
        text, last = result
        if last is None or last.error:
            return failed_response(last)
        return JSONResponse(builder.response(text, last.finish_reason,
                                             usage(last.num_prompt_tokens,
                                                   last.num_output_tokens)))

    async def _collect(self, run):
        if isinstance(run, FanOut):
            async for _ in run.events():
                pass
            return None
        parts, last = [], None
        async for event in self.gateway.events(run):
            parts.append(event.text)
            last = event
        return "".join(parts), last


class ErrorResponse(JSONResponse):
    """Error JSON escaped to ASCII: an error may quote the client's own text back (a model name),
    and a lone surrogate in it cannot be encoded as UTF-8, which would turn a 4xx into a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, kind: str, param: str | None = None
                   ) -> JSONResponse:
    return ErrorResponse(error_body(message, kind, param, status), status_code=status)


def failure(event) -> tuple[int, str, str]:
    """(status, message, error type) of a generation that failed (or gave nothing: `event`
    None): the request's own fault is a 400, anything else the cluster's 500."""
    if event is not None and event.bad_request:
        return 400, event.error, "invalid_request_error"
    return 500, (event.error if event else None) or "no output", "server_error"


def stream_error(event) -> dict:
    """An error event in a stream."""
    status, message, kind = failure(event)
    return error_body(message, kind, None, status)


def failed_response(event) -> ErrorResponse:
    """The error response of a whole (non-streamed) request."""
    status, message, kind = failure(event)
    return error_response(status, message, kind)


def failed_job(jobs: list[Job]) -> Job | None:
    """The first job that failed or gave nothing, or None."""
    return next((job for job in jobs if job.last is None or job.last.error), None)
