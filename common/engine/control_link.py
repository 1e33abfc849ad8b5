"""How an instance reaches the control plane, apart from token streams (always direct ZeroMQ).

- `GatewayLink` (no store): load reports are pushed to every configured gateway's inbox; the
  cluster monitor's broadcasts and flip commands arrive in the instance's own inbox.
- `StoreLink` (Redis): load reports are heartbeats in the store (they expire, which is how a dead
  instance leaves the registry); broadcasts come from the store's pub/sub channel. While the
  store is unreachable the instance keeps serving and retries at the next report.
"""

from __future__ import annotations

import logging
import queue
import threading

from common.messaging import Outbox
from common.protocol import InstanceStats, Message
from common.store import CLUSTER_VIEW_CHANNEL, FLIP_REPORT_CHANNEL, StoreUnavailable, open_store

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


class GatewayLink(ControlLink):
    def __init__(self, outbox: Outbox, gateways: tuple[str, ...]) -> None:
        self.outbox, self.gateways = outbox, gateways

    def report(self, stats: InstanceStats) -> None:
        for gateway in self.gateways:
            self.outbox.send(gateway, stats)

    def notify(self, message: Message) -> None:
        self.report(message)  # same path: every gateway's inbox


class StoreLink(ControlLink):
    """Heartbeats go through a writer thread holding only the latest report, so a slow or hung
    store never stalls the instance's loop (its sequences keep decoding meanwhile)."""

    def __init__(self, url: str, prefix: str, ttl_s: float) -> None:
        self.store = open_store(url, prefix)
        self.ttl_s = ttl_s
        self.view = self.store.subscribe(CLUSTER_VIEW_CHANNEL)
        self._latest: InstanceStats | None = None
        self._events: queue.Queue[Message] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._warned = False
        self._writer = threading.Thread(target=self._write_loop, name="store-link", daemon=True)
        self._writer.start()

    def report(self, stats: InstanceStats) -> None:
        self._latest = stats
        self._wake.set()

    def notify(self, message: Message) -> None:
        self._events.put(message)
        self._wake.set()

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            stats, self._latest = self._latest, None
            try:
                if stats is not None:
                    self.store.put_instance(stats, self.ttl_s)
                while not self._events.empty():
                    self.store.publish(FLIP_REPORT_CHANNEL, self._events.get_nowait())
                self._warned = False
            except StoreUnavailable as exc:
                if not self._warned:
                    log.warning("control-plane store unreachable, still serving: %s", exc)
                    self._warned = True

    def receive(self) -> list[Message]:
        return self.view.poll(0.0)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._writer.join(timeout=3)
        self.view.close()
        self.store.close()


def make_link(config, outbox: Outbox) -> ControlLink:
    if config.store_url:
        return StoreLink(config.store_url, config.store_prefix, config.heartbeat_ttl_s)
    return GatewayLink(outbox, config.gateways)
