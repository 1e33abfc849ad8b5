"""The load client's plain-HTTP path (aiohttp), against a small asyncio server on the loopback
interface (chunked SSE, Content-Length errors, keep-alive, closed connections, cut streams,
timeouts, malformed responses)."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.client import run_closed_loop, run_load
from bench.workload import BenchRequest


def _sse_chunks(texts: list[str]) -> list[bytes]:
    events = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in texts]
    events.append({"choices": [], "usage": {"prompt_tokens": 3,
                                            "completion_tokens": len(texts)}})
    payloads = [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]
    return [f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in payloads] + [b"0\r\n\r\n"]


class Server:
    """Answers each POST by `respond(body) -> list of byte pieces` (written one by one), and
    counts connections; `close_after` closes each connection after that many answers."""

    def __init__(self, respond, close_after: int = 0) -> None:
        self.respond, self.close_after = respond, close_after
        self.connections = 0
        self.bodies: list[dict] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *_exc) -> None:
        self.server.close()

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.bodies.append(json.loads(await reader.readexactly(length)))
                for piece in self.respond(self.bodies[-1]):
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
                answered += 1
                if answered == self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"transfer-encoding: chunked\r\n\r\n")


def _stream(body: dict) -> list[bytes]:
    if body["prompt"] == "fail":
        error = json.dumps({"error": {"message": "no room"}}).encode()
        return [b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(error)}\r\n\r\n".encode() + error]
    return [STREAM_HEAD, *_sse_chunks([" a", " b", " c"])]


REQUESTS = [BenchRequest(p, 3, 3, 3) for p in ("x", "fail", "y", "z")]


def test_closed_loop_streams_times_and_reuses_connections():
    async def go():
        server = Server(_stream)
        async with server as url:
            records = await run_closed_loop(url, "m", REQUESTS, concurrency=2, ignore_eos=True,
                                            temperature=0.7, top_p=0.9)
        return server, records

    server, records = asyncio.run(go())
    assert [r.index for r in records] == [0, 1, 2, 3]
    assert [r.error for r in records] == [None, "HTTP 503: no room", None, None]
    ok = records[0]
    assert ok.output_tokens == 3 and ok.prompt_tokens == 3 and len(ok.token_times) == 3
    assert ok.ttft is not None and ok.jct >= ok.ttft
    assert server.bodies[0]["top_p"] == 0.9 and server.bodies[0]["temperature"] == 0.7
    # two streams at a time: two connections, kept alive across the four requests
    assert server.connections == 2


def test_a_connection_closed_by_the_server_is_replaced():
    async def go():
        server = Server(_stream, close_after=1)
        async with server as url:
            records = await run_load(url, "m", REQUESTS[:1] * 3, [0.0, 0.05, 0.1],
                                     progress=False)
        return server, records

    server, records = asyncio.run(go())
    assert [r.error for r in records] == [None, None, None]
    assert server.connections == 3


def test_a_stream_cut_before_done_and_a_timeout_are_errors():
    def cut(_body):
        return [STREAM_HEAD, *_sse_chunks([" a"])[:1], b"0\r\n\r\n"]

    def stall(_body):
        return [STREAM_HEAD, *_sse_chunks([" a"])[:1]]  # then nothing more

    async def go(respond, timeout_s):
        async with Server(respond) as url:
            records = await run_load(url, "m", REQUESTS[:1], [0.0], timeout_s=timeout_s,
                                     progress=False)
            return records[0]

    assert asyncio.run(go(cut, 5.0)).error == "stream ended without [DONE]"
    stalled = asyncio.run(go(stall, 0.3))
    assert stalled.error.startswith("ReadTimeout") and len(stalled.token_times) == 1


def test_a_malformed_status_line_is_an_error():
    async def go():
        async with Server(lambda _body: [b"garbage\r\n\r\n"]) as url:
            return (await run_load(url, "m", REQUESTS[:1], [0.0], progress=False))[0]

    record = asyncio.run(go())
    assert record.error is not None and not record.ok
