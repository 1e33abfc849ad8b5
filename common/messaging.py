"""Message transport over ZeroMQ: one PULL inbox per process, PUSH sockets to peers' inboxes.

Every process binds one inbox and connects a PUSH socket to each peer it talks to, so messages
between two processes keep their order. Sends never block: a peer that is gone or not reading
makes sends fail (return False) once its queue is full, never hangs the sender. With cluster keys
(common.security), every socket speaks CurveZMQ and inboxes admit only cluster members. Sockets
close with linger 0, so a dead peer never holds up shutdown. A socket belongs to the thread (or
event loop) that created it; the gateway's event loop sends through a plain `Outbox` (non-blocking
sends need no asyncio) and receives through an `AsyncInbox`.
"""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from common.protocol import CodecError, Message, decode, encode
from common.security import ClusterKeys, guard_context

log = logging.getLogger(__name__)

SEND_HWM = 10_000  # messages queued per peer before sends fail


def bind_address(host: str, port: int = 0) -> str:
    return f"tcp://{host}:{port}" if port else f"tcp://{host}:*"


def advertised(endpoint: str, advertise_host: str | None) -> str:
    """`tcp://0.0.0.0:PORT` as peers must dial it: `tcp://ADVERTISE_HOST:PORT`."""
    if not advertise_host:
        return endpoint
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://{advertise_host}:{port}"


def _configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, 0)


def _decode_or_log(data: bytes) -> Message | None:
    try:
        return decode(data)
    except CodecError as exc:
        log.warning("dropping undecodable message (%s)", exc)
        return None


class Inbox:
    """A bound PULL socket; `receive` drains what has arrived."""

    def __init__(self, ctx: zmq.Context, host: str, port: int = 0,
                 advertise_host: str | None = None, keys: ClusterKeys | None = None) -> None:
        self.sock = ctx.socket(zmq.PULL)
        _configure(self.sock)
        if keys is not None:
            guard_context(ctx, keys)
            keys.serve(self.sock)
        self.sock.bind(bind_address(host, port))
        self.address = advertised(self.sock.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)

    def receive(self, timeout_s: float) -> list[Message]:
        """Wait up to `timeout_s` for a first message, then take every queued one."""
        messages: list[Message] = []
        if not self.sock.poll(int(timeout_s * 1000)):
            return messages
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            message = _decode_or_log(data)
            if message is not None:
                messages.append(message)

    def close(self) -> None:
        self.sock.close(0)


class Outbox:
    """PUSH sockets to peers, connected on first use."""

    def __init__(self, ctx: zmq.Context, keys: ClusterKeys | None = None) -> None:
        self.ctx = ctx
        self.keys = keys
        self.socks: dict[str, zmq.Socket] = {}

    def _sock(self, address: str) -> zmq.Socket:
        sock = self.socks.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            _configure(sock)
            if self.keys is not None:
                self.keys.connect(sock)
            sock.connect(address)
            self.socks[address] = sock
        return sock

    def send(self, address: str, message: Message) -> bool:
        try:
            self._sock(address).send(encode(message), zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.warning("peer %s is not reading; dropped %s", address, type(message).__name__)
            return False

    def forget(self, address: str) -> None:
        sock = self.socks.pop(address, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        for address in list(self.socks):
            self.forget(address)


class AsyncInbox:
    """The asyncio flavour of `Inbox`, for the gateway's event loop."""

    def __init__(self, ctx: zmq.asyncio.Context, host: str, port: int = 0,
                 advertise_host: str | None = None, keys: ClusterKeys | None = None) -> None:
        self.sock = ctx.socket(zmq.PULL)
        _configure(self.sock)
        if keys is not None:
            guard_context(ctx, keys)
            keys.serve(self.sock)
        self.sock.bind(bind_address(host, port))
        self.address = advertised(self.sock.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)

    async def receive(self) -> Message | None:
        return _decode_or_log(await self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)
