"""bench.client against an httpx.MockTransport test double that streams OpenAI-style SSE."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from bench.client import RequestRecord, run_load, send_completion, served_model
from bench.workload import BenchRequest
from common.errors import SplitserveError

URL = "http://127.0.0.1:8000"
REQUEST = BenchRequest(prompt="Hello", num_prompt_tokens=2, max_tokens=4,
                       reference_output_tokens=4)


def _chunk(text: str, finish_reason: str | None = None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}], "usage": None}


def _usage(prompt: int, completion: int) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion}}


def _event(obj: dict | str) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj)
    return f"data: {payload}\n\n".encode()


NORMAL_STREAM = [_event(_chunk(" Hi")), b": keep-alive\n\n", _event(_chunk("")),
                 _event(_chunk(" there")), _event(_chunk(" you", finish_reason="length")),
                 _event(_usage(2, 4)), _event("[DONE]")]


class SlowStream(httpx.AsyncByteStream):
    """Yields SSE pieces with a pause before each, optionally failing at the end."""

    def __init__(self, pieces: list[bytes], delay_s: float = 0.0,
                 fail: Exception | None = None) -> None:
        self.pieces, self.delay_s, self.fail = pieces, delay_s, fail

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            await asyncio.sleep(self.delay_s)
            yield piece
        if self.fail is not None:
            raise self.fail


def _sse(pieces: list[bytes], **stream_args) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"},
                          stream=SlowStream(pieces, **stream_args))


def _send(handler: Callable[[httpx.Request], httpx.Response], **kwargs) -> RequestRecord:
    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_completion(client, URL, "m", REQUEST, ignore_eos=True,
                                         temperature=0.0, start=time.perf_counter(), **kwargs)
    return asyncio.run(go())


def test_streamed_completion_is_timed_and_counted():
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        seen.append(json.loads(request.content))
        return _sse(NORMAL_STREAM, delay_s=0.02)

    record = _send(handler, index=7)
    assert seen == [{"model": "m", "prompt": "Hello", "max_tokens": 4, "temperature": 0.0,
                     "stream": True, "stream_options": {"include_usage": True},
                     "ignore_eos": True}]
    assert record.error is None and record.http_status == 200 and record.index == 7
    assert len(record.token_times) == 4  # the empty-text chunk is a token's (a special token)
    assert record.token_times == sorted(record.token_times)
    assert record.ttft == pytest.approx(record.token_times[0] - record.send_time)
    assert record.ttft >= 0.02
    assert record.jct >= record.ttft
    # counts come from the usage chunk, not from the number of chunks
    assert (record.prompt_tokens, record.output_tokens) == (2, 4)
    assert record.finish_reason == "length"


def test_a_first_token_without_text_sets_the_ttft_as_vllms_benchmark_counts_it():
    # the model's end of turn first, under ignore_eos: no text, but the first token's arrival
    pieces = [_event(_chunk("")), _event(_chunk("\n")), _event(_chunk("", "length")),
              _event(_usage(2, 3)), _event("[DONE]")]
    record = _send(lambda request: _sse(pieces, delay_s=0.01))
    # two arrivals, the empty first chunk's and the newline's; the last token's chunk closes
    # the stream with empty text: not another arrival
    assert len(record.token_times) == 2 and record.output_tokens == 3
    assert record.ttft == pytest.approx(record.token_times[0] - record.send_time)
    lone = [_event(_chunk("", "length")), _event(_usage(2, 1)), _event("[DONE]")]
    record = _send(lambda request: _sse(lone))  # one special token, max_tokens 1
    assert record.ttft is not None and len(record.token_times) == 1


def test_error_status_is_recorded():
    body = {"error": {"message": "prompt too long", "type": "invalid_request_error"}}
    record = _send(lambda request: httpx.Response(400, json=body))
    assert record.http_status == 400
    assert record.error == "HTTP 400: prompt too long"
    assert record.ttft is None and record.token_times == []
    assert record.jct is not None


def test_non_json_error_body_is_kept():
    record = _send(lambda request: httpx.Response(503, text="overloaded"))
    assert record.error == "HTTP 503: overloaded"


def test_error_event_mid_stream_ends_the_request():
    pieces = [_event(_chunk(" Hi")),
              _event({"error": {"message": "KV cache exhausted", "code": 500}}),
              _event(_chunk(" never")), _event("[DONE]")]
    record = _send(lambda request: _sse(pieces))
    assert record.error == "error event: KV cache exhausted"
    assert len(record.token_times) == 1 and record.ttft is not None


def test_stream_without_done_is_an_error():
    record = _send(lambda request: _sse([_event(_chunk(" Hi"))]))
    assert record.error == "stream ended without [DONE]"


def test_malformed_event_is_an_error():
    record = _send(lambda request: _sse([b"data: {not json\n\n", _event("[DONE]")]))
    assert record.error.startswith("malformed event")


def test_connection_failure_is_recorded_not_raised():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    record = _send(handler)
    assert record.error == "ConnectError: connection refused"
    assert record.http_status is None


def test_read_failure_mid_stream_is_recorded_not_raised():
    failure = httpx.ReadError("connection reset")
    record = _send(lambda request: _sse([_event(_chunk(" Hi"))], fail=failure))
    assert record.error == "ReadError: connection reset"
    assert len(record.token_times) == 1


def test_missing_usage_falls_back_to_chunk_count():
    pieces = [_event(_chunk(" a")), _event(_chunk(" b", "stop")), _event("[DONE]")]
    record = _send(lambda request: _sse(pieces))
    assert record.error is None and record.output_tokens == 2 and record.prompt_tokens is None


def _server(request: httpx.Request) -> httpx.Response:
    """A fake server: lists model "served", fails prompts that say "fail"."""
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list",
                                         "data": [{"id": "served", "object": "model"}]})
    body = json.loads(request.content)
    assert body["model"] == "served"
    if body["prompt"] == "fail":
        return httpx.Response(500, json={"error": {"message": "boom"}})
    return _sse(NORMAL_STREAM)


def test_run_load_paces_requests_and_survives_failures():
    prompts = ["a", "fail", "b"]
    requests = [BenchRequest(p, 1, 4, 4) for p in prompts]
    arrivals = [0.0, 0.05, 0.1]
    records = asyncio.run(run_load(URL, None, requests, arrivals, progress=False,
                                   transport=httpx.MockTransport(_server)))
    assert [r.index for r in records] == [0, 1, 2]
    for record, arrival in zip(records, arrivals):
        assert record.send_time >= arrival
    assert [r.error for r in records] == [None, "HTTP 500: boom", None]
    assert records[0].output_tokens == 4


def test_served_model_failure_is_a_one_line_error():
    transport = httpx.MockTransport(lambda request: httpx.Response(404, text="nope"))
    with pytest.raises(SplitserveError, match="/v1/models"):
        asyncio.run(served_model(URL, transport=transport))
