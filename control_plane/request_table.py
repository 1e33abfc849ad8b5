"""The request status table: arrival, SLA, phase changes with timestamps, instances involved.

The table lives in the control-plane store (common.store): in this process by default, in Redis
when gateway replicas share a cluster. A request's phases follow one path, each step stamped:

    QUEUED -> PREFILLED -> DECODING -> FINISHED        (or FAILED / ABORTED from any phase)

QUEUED means sent to a prefill instance; PREFILLED is stamped at the first token (prefill done);
DECODING once a decode instance holds the prefilled request (request-level transfer hands it over
with the first token, chunk-level before it: either way DECODING follows PREFILLED). A request
recovered elsewhere starts again at QUEUED.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from enum import Enum

from common.store import ControlStore, StoreUnavailable

log = logging.getLogger(__name__)
WRITE_QUEUE = 10_000


class Phase(str, Enum):
    QUEUED = "queued"
    PREFILLED = "prefilled"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def is_final(self) -> bool:
        return self in (Phase.FINISHED, Phase.FAILED, Phase.ABORTED)


@dataclass
class RequestRecord:
    request_id: str
    arrival: float  # wall clock
    num_prompt_tokens: int
    sla_ttft_s: float | None = None
    phase: Phase = Phase.QUEUED
    prefill_instance: str = ""
    decode_instance: str = ""
    timestamps: dict[str, float] = field(default_factory=dict)  # phase -> wall clock

    def as_dict(self) -> dict:
        record = asdict(self)
        record["phase"] = self.phase.value
        return record


class RequestTable:
    """The request status table, kept in the control-plane store so every gateway replica
    sees every request. Writes that fail because the store is unreachable are logged and
    dropped: the table informs, it never blocks serving."""

    def __init__(self, store: ControlStore, background: bool | None = None) -> None:
        self.store = store
        self._warned = False
        # Writes to a store that may block (Redis) go through one thread so a slow or hung store
        # never blocks request handling; a full queue drops writes (the table informs, it does
        # not gate serving). An in-process store is written at once: handing each write to a
        # thread cost the gateway's event loop a GIL hand-off per write.
        if background is None:
            background = store.may_block
        self._queue: queue.Queue | None = queue.Queue(maxsize=WRITE_QUEUE) if background else None
        if background:
            threading.Thread(target=self._writer, name="request-table", daemon=True).start()

    def _write(self, call, request_id: str, fields: dict) -> None:
        if self._queue is None:
            self._write_now(call, request_id, fields)
            return
        try:
            self._queue.put_nowait((call, request_id, fields))
        except queue.Full:
            pass

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                self._write_now(*item)
            finally:
                self._queue.task_done()

    def _write_now(self, call, request_id: str, fields: dict) -> None:
        try:
            call(request_id, fields)
            self._warned = False
        except StoreUnavailable as exc:
            if not self._warned:
                log.warning("request table not updated (store unreachable): %s", exc)
                self._warned = True

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until queued writes are done (tests)."""
        deadline = time.monotonic() + timeout_s
        while self._queue is not None and self._queue.unfinished_tasks and \
                time.monotonic() < deadline:
            time.sleep(0.01)

    def create(self, record: RequestRecord) -> None:
        record.timestamps[record.phase.value] = record.arrival
        self._write(self.store.put_request, record.request_id, _fields(record))

    def advance(self, request_id: str, phase: Phase, **instances: str) -> None:
        """Move to `phase` (stamped now), optionally recording instance ids."""
        fields = {"phase": phase.value, f"t_{phase.value}": time.time(), **instances}
        call = self.store.finish_request if phase.is_final else self.store.put_request
        self._write(call, request_id, fields)

    def get(self, request_id: str) -> RequestRecord | None:
        try:
            fields = self.store.get_request(request_id)
        except StoreUnavailable:
            return None
        return None if fields is None else _record(request_id, fields)

    def in_flight(self) -> list[str]:
        try:
            return self.store.in_flight_requests()
        except StoreUnavailable:
            return []


def _fields(record: RequestRecord) -> dict:
    fields = {"arrival": record.arrival, "num_prompt_tokens": record.num_prompt_tokens,
              "sla_ttft_s": record.sla_ttft_s, "phase": record.phase.value,
              "prefill_instance": record.prefill_instance,
              "decode_instance": record.decode_instance}
    fields.update({f"t_{phase}": t for phase, t in record.timestamps.items()})
    return fields


def _record(request_id: str, fields: dict) -> RequestRecord:
    timestamps = {k[2:]: v for k, v in fields.items() if k.startswith("t_")}
    return RequestRecord(request_id, fields.get("arrival", 0.0),
                         fields.get("num_prompt_tokens", 0), fields.get("sla_ttft_s"),
                         Phase(fields.get("phase", "queued")),
                         fields.get("prefill_instance", ""), fields.get("decode_instance", ""),
                         timestamps)
