"""Idle client connections: the gateway's HTTP server keeps them open longer than clients pool
them, and bench's client drops them before uvicorn-based servers close theirs.

The failure this guards: a 1P1D validation run at 0.08 req/s (2026-11-28, Zen 3) lost one
request of 40 to "ServerDisconnectedError: Server disconnected" after 0.8 ms: aiohttp kept the
idle connection pooled for 15 s, uvicorn closed it after its default 5 s, and the request went
out on it as it closed.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI

from bench.client import POOLED_IDLE_S
from common.config import ConfigError, GatewayConfig
from control_plane.cli_args import gateway_config
from control_plane.launcher import http_config

AIOHTTP_POOLED_IDLE_S = 15.0  # aiohttp.TCPConnector's default keepalive_timeout


def _request(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n")
    reply = b""
    while b"pong" not in reply:
        chunk = sock.recv(4096)
        if not chunk:
            return reply  # the server closed the connection
        reply += chunk
    return reply


def test_the_gateway_keeps_an_idle_connection_past_uvicorns_default():
    app = FastAPI()
    app.get("/ping")(lambda: "pong")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    config = http_config(app, GatewayConfig(port=listener.getsockname()[1]))
    assert config.timeout_keep_alive > AIOHTTP_POOLED_IDLE_S
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        with socket.create_connection(listener.getsockname(), timeout=10) as sock:
            assert b"200 OK" in _request(sock)
            time.sleep(uvicorn.Config(app).timeout_keep_alive + 1.0)  # past the old default
            assert b"200 OK" in _request(sock), "the idle connection was closed"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()


def test_bench_drops_idle_connections_before_uvicorn_servers_close_them():
    assert POOLED_IDLE_S < uvicorn.Config(app=None).timeout_keep_alive


def test_keep_alive_reaches_the_config_and_must_be_positive():
    from control_plane.cli import build_parser
    args = build_parser().parse_args(["up", "--keep-alive", "30"])
    assert gateway_config(args, 0).keep_alive_s == 30.0
    with pytest.raises(ConfigError, match="keep_alive_s"):
        GatewayConfig(keep_alive_s=0)
