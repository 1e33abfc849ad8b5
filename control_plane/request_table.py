"""The request status table: arrival, SLA, phase changes with timestamps, instances involved.

`RequestTable` is the store interface; `InMemoryRequestTable` keeps it in this process (the
`splitserve up` default). A request's phases follow one path, each step stamped:

    QUEUED -> PREFILLED -> DECODING -> FINISHED        (or FAILED / ABORTED from any phase)

QUEUED means sent to a prefill instance; PREFILLED is stamped at the first token (prefill done);
DECODING at the hand-off to a decode instance.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from enum import Enum


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


class RequestTable(ABC):
    @abstractmethod
    def create(self, record: RequestRecord) -> None:
        ...

    @abstractmethod
    def advance(self, request_id: str, phase: Phase, **instances: str) -> None:
        """Move to `phase` (stamped now), optionally recording instance ids."""

    @abstractmethod
    def get(self, request_id: str) -> RequestRecord | None:
        ...

    @abstractmethod
    def in_flight(self) -> list[RequestRecord]:
        ...


class InMemoryRequestTable(RequestTable):
    """Keeps every in-flight request and the last `keep_finished` finished ones."""

    def __init__(self, keep_finished: int = 10_000) -> None:
        self.active: dict[str, RequestRecord] = {}
        self.finished: OrderedDict[str, RequestRecord] = OrderedDict()
        self.keep_finished = keep_finished

    def create(self, record: RequestRecord) -> None:
        record.timestamps[record.phase.value] = record.arrival
        self.active[record.request_id] = record

    def advance(self, request_id: str, phase: Phase, **instances: str) -> None:
        record = self.active.get(request_id)
        if record is None:
            return
        record.phase = phase
        record.timestamps[phase.value] = time.time()
        for key, value in instances.items():
            setattr(record, key, value)
        if phase.is_final:
            self.finished[request_id] = self.active.pop(request_id)
            while len(self.finished) > self.keep_finished:
                self.finished.popitem(last=False)

    def get(self, request_id: str) -> RequestRecord | None:
        return self.active.get(request_id) or self.finished.get(request_id)

    def in_flight(self) -> list[RequestRecord]:
        return list(self.active.values())
