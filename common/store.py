"""The control-plane store: instance registry, broadcasts, request status table, leadership.

One interface, two implementations with the same contract (tests/unit/common/test_store_contract.py
runs against both):
- `InProcessStore`: dictionaries in this process, for `splitserve up` without Redis (its
  instances then reach the store through the gateway's inbox);
- `RedisStore`: a real Redis server (redis-py), shared by several gateways and every instance.

Redis layout, under a key prefix (default "splitserve"):

    {p}:inst:<id>       encoded InstanceStats, expires after the heartbeat TTL
    {p}:inst-ids        set of instance ids ever registered (pruned when their key expired)
    {p}:chan:<name>     pub/sub channel of encoded messages
    {p}:req:<id>        hash of a request's status fields (JSON values); expires once final
    {p}:req-active      set of in-flight request ids
    {p}:leader          the id of the gateway that runs the monitor and the transition watcher
    {p}:flips           list of flip records (JSON), newest first
"""

from __future__ import annotations

import json
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict, deque

from common.protocol import InstanceStats, Message, decode, encode

FINISHED_REQUEST_TTL_S = 3600
MAX_FLIPS = 1000
MAX_FINISHED_REQUESTS = 10_000  # the in-process store's stand-in for Redis' expiry
CLUSTER_VIEW_CHANNEL = "cluster-view"  # monitor -> prefill instances: decode loads
# instances -> gateways: FlipReports (the leader records them) and KVCacheEvents (every replica
# routes by them)
INSTANCE_EVENTS_CHANNEL = "instance-events"


class StoreUnavailable(RuntimeError):
    """The store cannot be reached right now (callers keep their last view and retry)."""


class Subscription(ABC):
    @abstractmethod
    def poll(self, timeout_s: float = 0.0) -> list[Message]:
        """Messages published since the last poll (waiting up to `timeout_s` for the first)."""

    @abstractmethod
    def close(self) -> None:
        ...


class ControlStore(ABC):
    # False where every call returns at once (no I/O): callers may then call it from an event
    # loop directly instead of handing it to a thread.
    may_block = True

    # -- instance registry -----------------------------------------------------------------------
    @abstractmethod
    def put_instance(self, stats: InstanceStats, ttl_s: float) -> None:
        """Heartbeat: (re)register the instance; it expires `ttl_s` after its last report."""

    @abstractmethod
    def instances(self) -> list[InstanceStats]:
        """Every instance whose heartbeat has not expired."""

    @abstractmethod
    def remove_instance(self, instance_id: str) -> None:
        ...

    # -- broadcasts --------------------------------------------------------------------------------
    @abstractmethod
    def publish(self, channel: str, message: Message) -> None:
        ...

    @abstractmethod
    def subscribe(self, channel: str) -> Subscription:
        ...

    # -- request status table --------------------------------------------------------------------
    @abstractmethod
    def put_request(self, request_id: str, fields: dict) -> None:
        """Create or update a request's fields (JSON-serializable values)."""

    @abstractmethod
    def finish_request(self, request_id: str, fields: dict) -> None:
        """Final update: the request leaves the in-flight set and expires later."""

    @abstractmethod
    def get_request(self, request_id: str) -> dict | None:
        ...

    @abstractmethod
    def in_flight_requests(self) -> list[str]:
        ...

    # -- leadership and flips ----------------------------------------------------------------------
    @abstractmethod
    def try_lead(self, owner: str, ttl_s: float) -> bool:
        """Take or renew leadership for `ttl_s`; True if `owner` leads now."""

    @abstractmethod
    def record_flip(self, record: dict) -> None:
        ...

    @abstractmethod
    def flips(self) -> list[dict]:
        """Flip records, newest first."""

    def close(self) -> None:
        pass


class _QueueSubscription(Subscription):
    def __init__(self, store: InProcessStore, channel: str) -> None:
        self.store, self.channel = store, channel
        self.queue: queue.Queue[Message] = queue.Queue()

    def poll(self, timeout_s: float = 0.0) -> list[Message]:
        messages = []
        try:
            messages.append(self.queue.get(timeout=timeout_s) if timeout_s > 0
                            else self.queue.get_nowait())
            while True:
                messages.append(self.queue.get_nowait())
        except queue.Empty:
            return messages

    def close(self) -> None:
        self.store._unsubscribe(self)


class InProcessStore(ControlStore):
    """Thread-safe dictionaries with the Redis implementation's semantics."""

    may_block = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._instances: dict[str, tuple[InstanceStats, float]] = {}
        self._subscribers: dict[str, list[_QueueSubscription]] = defaultdict(list)
        self._requests: dict[str, dict] = {}
        self._active: set[str] = set()
        self._finished: deque[str] = deque()  # bounded, as Redis expires finished requests
        self._leader: tuple[str, float] | None = None
        self._flips: list[dict] = []

    def put_instance(self, stats, ttl_s):
        with self._lock:
            self._instances[stats.instance_id] = (stats, time.monotonic() + ttl_s)

    def instances(self):
        now = time.monotonic()
        with self._lock:
            for instance_id in [k for k, (_, exp) in self._instances.items() if exp < now]:
                del self._instances[instance_id]
            return [stats for stats, _ in self._instances.values()]

    def remove_instance(self, instance_id):
        with self._lock:
            self._instances.pop(instance_id, None)

    def publish(self, channel, message):
        with self._lock:
            subscribers = list(self._subscribers[channel])
        for sub in subscribers:
            sub.queue.put(message)

    def subscribe(self, channel):
        sub = _QueueSubscription(self, channel)
        with self._lock:
            self._subscribers[channel].append(sub)
        return sub

    def _unsubscribe(self, sub: _QueueSubscription) -> None:
        with self._lock:
            if sub in self._subscribers[sub.channel]:
                self._subscribers[sub.channel].remove(sub)

    def put_request(self, request_id, fields):
        with self._lock:
            self._requests.setdefault(request_id, {}).update(fields)
            self._active.add(request_id)

    def finish_request(self, request_id, fields):
        with self._lock:
            self._requests.setdefault(request_id, {}).update(fields)
            self._active.discard(request_id)
            self._finished.append(request_id)
            while len(self._finished) > MAX_FINISHED_REQUESTS:
                self._requests.pop(self._finished.popleft(), None)

    def get_request(self, request_id):
        with self._lock:
            record = self._requests.get(request_id)
            return dict(record) if record is not None else None

    def in_flight_requests(self):
        with self._lock:
            return list(self._active)

    def try_lead(self, owner, ttl_s):
        now = time.monotonic()
        with self._lock:
            if self._leader is None or self._leader[0] == owner or self._leader[1] < now:
                self._leader = (owner, now + ttl_s)
            return self._leader[0] == owner

    def record_flip(self, record):
        with self._lock:
            self._flips.insert(0, dict(record))
            del self._flips[MAX_FLIPS:]

    def flips(self):
        with self._lock:
            return [dict(r) for r in self._flips]


def open_store(url: str | None, prefix: str = "splitserve") -> ControlStore:
    """`redis://...` / `rediss://...` -> RedisStore; None or "memory" -> InProcessStore."""
    if url in (None, "", "memory"):
        return InProcessStore()
    from common.redis_store import RedisStore

    return RedisStore(url, prefix)


def json_fields(fields: dict) -> dict[str, str]:
    return {k: json.dumps(v) for k, v in fields.items()}


def parse_fields(raw: dict) -> dict:
    return {(k.decode() if isinstance(k, bytes) else k): json.loads(v) for k, v in raw.items()}


__all__ = [
    "ControlStore",
    "InProcessStore",
    "StoreUnavailable",
    "Subscription",
    "decode",
    "encode",
    "open_store",
]
