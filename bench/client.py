"""The async load client: replays a workload against an OpenAI-compatible /v1/completions.

`run_load` sends each request at its arrival offset whether or not earlier ones have finished
(an open loop, as users behave); `run_closed_loop` keeps a fixed number of streams open. Every
request is streamed over server-sent events and timed on arrival of every chunk that carries
a token, its text possibly empty (a special token such as the model's end of turn under
`ignore_eos`, or a character still incomplete), as vLLM's and SGLang's benchmark clients time
them: TTFT is the first token's arrival, not the first visible text's. One request's failure
(HTTP status, error event, network error, timeout) is recorded on its own record and never
stops the run. `post_stream_aiohttp` streams any endpoint and hands
each text piece to a callback: chat completions (`delta.content`) are read like completions
(`text`), which is how the multi-turn workload (bench.multiturn) gets the model's answers.
Plain http:// servers are spoken to through aiohttp
(its C parser costs a fraction of httpx's CPU per streamed chunk, so the client does not take
the cores of the server it measures); https and injected httpx transports (tests) use httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import httpx
from tqdm import tqdm

from bench.workload import BenchRequest
from common.errors import SplitserveError

_ERROR_BODY_CHARS = 500
# How long an idle connection stays in the client's pool: under the 5 s keep-alive that
# uvicorn-based servers (vLLM's, SGLang's, ours before 2026-11-28) close idle ones after
POOLED_IDLE_S = 4.0


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds; offsets are from the start of the run."""

    index: int
    send_time: float
    ttft: float | None = None  # first token's chunk minus send_time; None if none arrived
    token_times: list[float] = field(default_factory=list)  # offset of each token's chunk
    jct: float | None = None  # from send to the end of the stream (or to the failure)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    http_status: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _error_message(error: object) -> str:
    """The message of an OpenAI error object ({"message": ...}) or the value as text."""
    if isinstance(error, dict) and error.get("message"):
        error = error["message"]
    return str(error)[:_ERROR_BODY_CHARS]


def _error_text(body: bytes) -> str:
    """The server's error message if the body is an OpenAI error response, else the raw body."""
    text = body.decode("utf-8", errors="replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        return text[:_ERROR_BODY_CHARS]
    has_error = isinstance(parsed, dict) and parsed.get("error") is not None
    return _error_message(parsed["error"] if has_error else text)


OnText = Callable[[str], None]


def _chunk_text(choice: dict) -> str | None:
    """The text a streamed choice carries: a completion's `text` or a chat's `delta.content`."""
    if choice.get("text"):
        return choice["text"]
    delta = choice.get("delta")
    return delta.get("content") if isinstance(delta, dict) else None


def _absorb_chunk(record: RequestRecord, chunk: dict, now: float,
                  on_text: OnText | None = None) -> None:
    """Fold one streamed completion chunk (content or final usage) into the record."""
    choices = chunk.get("choices") or []
    if choices:
        choice = choices[0]
        text = _chunk_text(choice)
        # A chunk with empty text is still a token's (a special token; until 2026-12-02 it was
        # not counted, and a request whose first token was the model's end of turn got its TTFT
        # one decode step or more late), unless it only closes a stream that had tokens.
        if text or choice.get("finish_reason") is None or not record.token_times:
            if not record.token_times:
                record.ttft = now - record.send_time
            record.token_times.append(now)
        if text and on_text is not None:
            on_text(text)
        if choice.get("finish_reason") is not None:
            record.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens")


def _parse_event(payload: bytes) -> dict | None:
    try:
        event = json.loads(payload)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


_DONE = "done"
_FAILED = "failed"


def _absorb_line(record: RequestRecord, line: bytes, now: float,
                 on_text: OnText | None = None) -> str | None:
    """Fold one SSE line into the record: _DONE at [DONE], _FAILED (record.error set) at an
    error or malformed event, else None."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None  # blank separators, ": keep-alive" comments, event:/id: fields
    payload = line[len(b"data:"):].strip()
    if payload == b"[DONE]":
        return _DONE
    event = _parse_event(payload)
    if event is None:
        text = payload.decode("utf-8", errors="replace")
        record.error = f"malformed event: {text[:_ERROR_BODY_CHARS]}"
        return _FAILED
    if "error" in event:
        record.error = f"error event: {_error_message(event['error'])}"
        return _FAILED
    _absorb_chunk(record, event, now, on_text)
    return None


async def _read_events(body: AsyncIterator[bytes], record: RequestRecord, start: float,
                       on_text: OnText | None = None) -> None:
    """Consume the SSE stream until [DONE], recording chunks; sets record.error on failure.

    Lines are split from the body's bytes here (not with aiter_lines, whose text decoding and
    line splitting layers cost more than the rest of the client per token), and the body is
    read to its end after [DONE] (the chunked terminator), so the connection goes back to the
    pool instead of being closed and opened anew."""
    done, pending = False, b""
    async for data in body:
        if done:
            continue
        # Stamped on receipt, before parsing, so the client's own work does not count as latency.
        now = time.perf_counter() - start
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            outcome = _absorb_line(record, line, now, on_text)
            if outcome == _FAILED:
                return
            if outcome == _DONE:
                done = True
                break
    if not done and pending:  # a last line without its newline
        outcome = _absorb_line(record, pending, time.perf_counter() - start, on_text)
        if outcome == _FAILED:
            return
        done = outcome == _DONE
    if not done:
        # A stream that stops without [DONE] was cut (server crash, proxy timeout): a failure.
        record.error = "stream ended without [DONE]"


def completion_payload(model: str, request: BenchRequest, ignore_eos: bool,
                       temperature: float, top_p: float | None = None) -> dict:
    """The JSON body of one streamed /v1/completions request (top_p: the server's default
    when None)."""
    payload = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens,
               "temperature": temperature, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if top_p is not None:
        payload["top_p"] = top_p
    return payload


async def send_completion(client: httpx.AsyncClient, url: str, model: str,
                          request: BenchRequest, ignore_eos: bool, temperature: float,
                          start: float, index: int = 0, top_p: float | None = None
                          ) -> RequestRecord:
    """Send one streamed completion and time it; `start` is the run's perf_counter origin."""
    record = RequestRecord(index=index, send_time=time.perf_counter() - start)
    payload = completion_payload(model, request, ignore_eos, temperature, top_p)
    try:
        async with client.stream("POST", f"{url.rstrip('/')}/v1/completions",
                                 json=payload) as response:
            record.http_status = response.status_code
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {_error_text(await response.aread())}"
            else:
                await _read_events(response.aiter_bytes(), record, start)
    # A run of thousands of requests must report a failure, not abort on it; the exception's
    # type is kept because timeouts and resets often have empty messages.
    except Exception as exc:  # noqa: BLE001
        record.error = f"{type(exc).__name__}: {exc}"
    return _finish(record, start)


def _finish(record: RequestRecord, start: float) -> RequestRecord:
    record.jct = time.perf_counter() - start - record.send_time
    if record.ok and record.output_tokens is None:
        # Servers without include_usage support: our gateway and vLLM send one token per chunk.
        record.output_tokens = len(record.token_times)
    return record


async def send_completion_aiohttp(session: aiohttp.ClientSession, url: str, model: str,
                                  request: BenchRequest, ignore_eos: bool, temperature: float,
                                  start: float, index: int = 0, top_p: float | None = None
                                  ) -> RequestRecord:
    """`send_completion` over aiohttp (its C HTTP parser: a fraction of httpx's CPU per
    streamed chunk)."""
    record = RequestRecord(index=index, send_time=time.perf_counter() - start)
    payload = completion_payload(model, request, ignore_eos, temperature, top_p)
    return await post_stream_aiohttp(session, f"{url.rstrip('/')}/v1/completions", payload,
                                     record, start)


async def post_stream_aiohttp(session: aiohttp.ClientSession, endpoint: str, payload: dict,
                              record: RequestRecord, start: float,
                              on_text: OnText | None = None) -> RequestRecord:
    """POST a streamed request to `endpoint` and fold its events into `record` (its send_time
    set by the caller, as an offset from `start`); `on_text` gets each text piece in order."""
    try:
        async with session.post(endpoint, json=payload) as response:
            record.http_status = response.status
            if response.status != 200:
                record.error = f"HTTP {response.status}: {_error_text(await response.read())}"
            else:
                await _read_events(response.content.iter_any(), record, start, on_text)
    except asyncio.TimeoutError:
        record.error = "ReadTimeout: no complete answer within the client's timeout"
    except Exception as exc:  # noqa: BLE001 (as in send_completion)
        record.error = f"{type(exc).__name__}: {exc}"
    return _finish(record, start)


Send = Callable[..., Awaitable[RequestRecord]]


@contextlib.asynccontextmanager
async def _sender(url: str, model: str, ignore_eos: bool, temperature: float,
                  top_p: float | None, timeout_s: float,
                  transport: httpx.AsyncBaseTransport | None) -> AsyncIterator[Send]:
    """`send(request, start, index)` for a run: over aiohttp for plain http:// URLs, else
    (https, or an httpx transport given: tests) over httpx."""
    if transport is None and url.startswith("http://"):
        # No connection limit (a capped pool would queue requests in the client and inflate
        # their TTFT); idle pooled connections dropped before uvicorn-based servers close them
        # (their default keep-alive is 5 s: reusing one as it closes fails the request with
        # "Server disconnected"); trust_env off: no proxy from the environment between us and
        # the server.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=POOLED_IDLE_S)
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                         trust_env=False) as session:
            yield lambda request, start, index: send_completion_aiohttp(
                session, url, model, request, ignore_eos, temperature, start, index, top_p)
        return
    # No pool limit: a capped pool would queue requests in the client and inflate their TTFT.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: a proxy from the environment must not sit between us and the server.
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits,
                                 transport=transport, trust_env=False) as client:
        yield lambda request, start, index: send_completion(
            client, url, model, request, ignore_eos, temperature, start, index, top_p)


async def served_model(url: str, timeout_s: float = 30.0,
                       transport: httpx.AsyncBaseTransport | None = None) -> str:
    """The first model id listed by the server's /v1/models."""
    async with httpx.AsyncClient(timeout=timeout_s, transport=transport,
                                 trust_env=False) as client:
        try:
            response = await client.get(f"{url.rstrip('/')}/v1/models")
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise SplitserveError(f"cannot read the model name from {url}/v1/models "
                                  f"({type(exc).__name__}: {exc}); pass --model") from exc


async def run_load(url: str, model: str | None, requests: Sequence[BenchRequest],
                   arrivals: Sequence[float], ignore_eos: bool = False, temperature: float = 0.0,
                   timeout_s: float = 600, progress: bool = True,
                   transport: httpx.AsyncBaseTransport | None = None,
                   top_p: float | None = None) -> list[RequestRecord]:
    """Send request i at offset arrivals[i] (open loop); records come back in request order."""
    if len(requests) != len(arrivals):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    if model is None:
        model = await served_model(url, transport=transport)
    async with _sender(url, model, ignore_eos, temperature, top_p, timeout_s,
                       transport) as send:
        with tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr,
                  disable=not progress) as bar:
            start = time.perf_counter()

            async def fire(index: int) -> RequestRecord:
                await asyncio.sleep(max(0.0, arrivals[index] - (time.perf_counter() - start)))
                record = await send(requests[index], start, index)
                bar.update(1)
                return record

            return list(await asyncio.gather(*(fire(i) for i in range(len(requests)))))


async def run_closed_loop(url: str, model: str, requests: Sequence[BenchRequest],
                          concurrency: int, ignore_eos: bool = False, temperature: float = 0.0,
                          top_p: float | None = None, timeout_s: float = 600,
                          transport: httpx.AsyncBaseTransport | None = None
                          ) -> list[RequestRecord]:
    """Keep `concurrency` streams open: each of that many senders takes the next request as soon
    as its last one ends (a closed loop, to load a server at a fixed concurrency). Records come
    back in request order; send times are offsets from the start of the run."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    records: list[RequestRecord | None] = [None] * len(requests)
    next_index = iter(range(len(requests)))
    async with _sender(url, model, ignore_eos, temperature, top_p, timeout_s,
                       transport) as send:
        start = time.perf_counter()

        async def sender() -> None:
            for index in next_index:  # one shared iterator: each request is taken once
                records[index] = await send(requests[index], start, index)

        await asyncio.gather(*(sender() for _ in range(min(concurrency, len(requests)))))
    return [r for r in records if r is not None]
