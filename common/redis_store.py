"""The control-plane store on a real Redis server (redis-py). See common.store for the layout.

Every call that cannot reach Redis raises `StoreUnavailable` instead of redis-py's own errors, so
callers keep their last view and retry at their next tick; redis-py reconnects by itself, and a
subscription re-subscribes after Redis comes back.
"""

from __future__ import annotations

import json
import logging
from functools import wraps

import redis

from common.protocol import CodecError, Message, decode, encode
from common.store import (
    FINISHED_REQUEST_TTL_S,
    MAX_FLIPS,
    ControlStore,
    StoreUnavailable,
    Subscription,
    json_fields,
    parse_fields,
)

log = logging.getLogger(__name__)
_RENEW_LEADER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
"""


def _guarded(method):
    @wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise StoreUnavailable(f"redis unreachable: {exc}") from None
    return call


class RedisSubscription(Subscription):
    def __init__(self, client: redis.Redis, channel: str) -> None:
        self.client, self.channel = client, channel
        self.pubsub = None

    def _ensure(self):
        if self.pubsub is None:
            self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            self.pubsub.subscribe(self.channel)
        return self.pubsub

    def poll(self, timeout_s: float = 0.0) -> list[Message]:
        messages: list[Message] = []
        try:
            pubsub = self._ensure()
            item = pubsub.get_message(timeout=timeout_s)
            while item is not None:
                self._decode_into(item, messages)
                item = pubsub.get_message(timeout=0.0)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self._reset()  # subscribe again on the next poll, once Redis is back
        return messages

    @staticmethod
    def _decode_into(item: dict, messages: list[Message]) -> None:
        if item.get("type") != "message":
            return
        try:
            messages.append(decode(item["data"]))
        except CodecError:
            log.warning("dropping undecodable broadcast")

    def _reset(self) -> None:
        if self.pubsub is not None:
            try:
                self.pubsub.close()
            except Exception:  # the connection is already broken
                pass
        self.pubsub = None

    def close(self) -> None:
        self._reset()


class RedisStore(ControlStore):
    def __init__(self, url: str, prefix: str = "splitserve") -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                           health_check_interval=5)
        self.prefix = prefix
        self._renew = self.client.register_script(_RENEW_LEADER)

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    @_guarded
    def put_instance(self, stats, ttl_s):
        pipe = self.client.pipeline()
        pipe.set(self._key("inst", stats.instance_id), encode(stats), px=int(ttl_s * 1000))
        pipe.sadd(self._key("inst-ids"), stats.instance_id)
        pipe.execute()

    @_guarded
    def instances(self):
        ids = sorted(i.decode() for i in self.client.smembers(self._key("inst-ids")))
        if not ids:
            return []
        values = self.client.mget([self._key("inst", i) for i in ids])
        expired = [i for i, v in zip(ids, values) if v is None]
        if expired:
            self.client.srem(self._key("inst-ids"), *expired)
        return [decode(v) for v in values if v is not None]

    @_guarded
    def remove_instance(self, instance_id):
        self.client.delete(self._key("inst", instance_id))
        self.client.srem(self._key("inst-ids"), instance_id)

    @_guarded
    def publish(self, channel, message):
        self.client.publish(self._key("chan", channel), encode(message))

    def subscribe(self, channel):
        return RedisSubscription(self.client, self._key("chan", channel))

    @_guarded
    def put_request(self, request_id, fields):
        pipe = self.client.pipeline()
        pipe.hset(self._key("req", request_id), mapping=json_fields(fields))
        pipe.sadd(self._key("req-active"), request_id)
        pipe.execute()

    @_guarded
    def finish_request(self, request_id, fields):
        pipe = self.client.pipeline()
        pipe.hset(self._key("req", request_id), mapping=json_fields(fields))
        pipe.expire(self._key("req", request_id), FINISHED_REQUEST_TTL_S)
        pipe.srem(self._key("req-active"), request_id)
        pipe.execute()

    @_guarded
    def get_request(self, request_id):
        raw = self.client.hgetall(self._key("req", request_id))
        return parse_fields(raw) if raw else None

    @_guarded
    def in_flight_requests(self):
        return [i.decode() for i in self.client.smembers(self._key("req-active"))]

    @_guarded
    def try_lead(self, owner, ttl_s):
        return bool(self._renew(keys=[self._key("leader")], args=[owner, int(ttl_s * 1000)]))

    @_guarded
    def record_flip(self, record):
        pipe = self.client.pipeline()
        pipe.lpush(self._key("flips"), json.dumps(record))
        pipe.ltrim(self._key("flips"), 0, MAX_FLIPS - 1)
        pipe.execute()

    @_guarded
    def flips(self):
        return [json.loads(r) for r in self.client.lrange(self._key("flips"), 0, -1)]

    def close(self) -> None:
        self.client.close()

    @_guarded
    def clear(self) -> None:
        """Delete every key under the prefix (tests)."""
        for key in self.client.scan_iter(match=self._key("*")):
            self.client.delete(key)
