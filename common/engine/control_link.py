"""How an instance reaches the control plane, apart from token streams (always direct ZeroMQ).

- `GatewayLink` (no store): load reports are pushed to every configured gateway's inbox; the
  cluster monitor's broadcasts and flip commands arrive in the instance's own inbox.
- `StoreLink` (Redis): load reports are heartbeats in the store (they expire, which is how a dead
  instance leaves the registry); broadcasts come from the store's pub/sub channel. While the
  store is unreachable the instance keeps serving and retries at the next report.

Both deliver from a writer thread (`ReportWriter`) that repeats the last load report every
interval while the instance's loop is inside one forward: the loop reports only between
forwards, and one forward may outlast the monitor's timeout (a 2,000-token prompt on a CPU
core) without the instance being dead. A loop that gave no report for `stall_timeout_s` is
not covered: it goes silent and is declared dead.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from common.messaging import Outbox
from common.protocol import InstanceStats, Message
from common.store import CLUSTER_VIEW_CHANNEL, INSTANCE_EVENTS_CHANNEL, StoreUnavailable, open_store

log = logging.getLogger(__name__)


class ControlLink:
    def report(self, stats: InstanceStats) -> None:
        raise NotImplementedError

    def notify(self, message: Message) -> None:
        """A one-off event for the gateways (e.g. FlipReport)."""
        raise NotImplementedError

    def receive(self) -> list[Message]:
        """Broadcasts that did not come through the inbox."""
        return []

    def close(self) -> None:
        pass


class ReportWriter:
    """A thread delivering reports: the latest load report as soon as it is given and again
    every `interval_s` while the last one is under `stall_s` old; events in order."""

    def __init__(self, send_stats: Callable[[InstanceStats], None],
                 send_event: Callable[[Message], None], interval_s: float, stall_s: float,
                 name: str, on_exit: Callable[[], None] = lambda: None) -> None:
        self.send_stats, self.send_event, self.on_exit = send_stats, send_event, on_exit
        self.interval_s, self.stall_s = interval_s, stall_s
        self._latest: InstanceStats | None = None
        self._given_at = 0.0
        self._events: queue.Queue[Message] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def report(self, stats: InstanceStats) -> None:
        self._latest, self._given_at = stats, time.monotonic()
        self._wake.set()

    def notify(self, message: Message) -> None:
        self._events.put(message)
        self._wake.set()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(self.interval_s)
                self._wake.clear()
                stats = self._latest
                if stats is not None and time.monotonic() - self._given_at <= self.stall_s:
                    self.send_stats(stats)
                while not self._events.empty():
                    self.send_event(self._events.get_nowait())
        finally:
            self.on_exit()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=3)


class GatewayLink(ControlLink):
    """Reports go out on the writer thread's own sockets (ZeroMQ sockets are single-thread)."""

    def __init__(self, outbox: Outbox, gateways: tuple[str, ...], interval_s: float = 0.1,
                 stall_s: float = 120.0) -> None:
        self.gateways = gateways
        self._outbox = Outbox(outbox.ctx, outbox.keys)  # used only on the writer thread
        self.writer = ReportWriter(self._send, self._send, interval_s, stall_s, "gateway-link",
                                   on_exit=self._outbox.close)

    def _send(self, message: Message) -> None:
        for gateway in self.gateways:
            self._outbox.send(gateway, message)

    def report(self, stats: InstanceStats) -> None:
        self.writer.report(stats)

    def notify(self, message: Message) -> None:
        self.writer.notify(message)  # same path: every gateway's inbox

    def close(self) -> None:
        self.writer.close()


class StoreLink(ControlLink):
    """Heartbeats go through the writer thread, so a slow or hung store never stalls the
    instance's loop (its sequences keep decoding meanwhile)."""

    def __init__(self, url: str, prefix: str, ttl_s: float, interval_s: float = 0.1,
                 stall_s: float = 120.0) -> None:
        self.store = open_store(url, prefix)
        self.ttl_s = ttl_s
        self.view = self.store.subscribe(CLUSTER_VIEW_CHANNEL)
        self._warned = False
        self.writer = ReportWriter(self._put, self._publish, interval_s, stall_s, "store-link")

    def _put(self, stats: InstanceStats) -> None:
        self._guarded(self.store.put_instance, stats, self.ttl_s)

    def _publish(self, message: Message) -> None:
        self._guarded(self.store.publish, INSTANCE_EVENTS_CHANNEL, message)

    def _guarded(self, call, *args) -> None:
        try:
            call(*args)
            self._warned = False
        except StoreUnavailable as exc:
            if not self._warned:
                log.warning("control-plane store unreachable, still serving: %s", exc)
                self._warned = True

    def report(self, stats: InstanceStats) -> None:
        self.writer.report(stats)

    def notify(self, message: Message) -> None:
        self.writer.notify(message)

    def receive(self) -> list[Message]:
        return self.view.poll(0.0)

    def close(self) -> None:
        self.writer.close()
        self.view.close()
        self.store.close()


def make_link(config, outbox: Outbox) -> ControlLink:
    timing = (config.report_interval_s, config.stall_timeout_s)
    if config.store_url:
        return StoreLink(config.store_url, config.store_prefix, config.heartbeat_ttl_s, *timing)
    return GatewayLink(outbox, config.gateways, *timing)
