"""The record `splitserve profile` leaves in the cache directory, and which record fits a served
model.

A record holds the recommended ChunkSize and the measured forward curves, measured with one
model, dtype and torch thread count; a forward's time depends on all three. Readers (the prefill
role's ChunkSize, the co-located roles' cost model, the gateway's local prefill budget) take a
record only when it was measured for the forwards they will run. Each profile writes two files:
`profile.json` (the last one, whatever it measured, for tools that read "the profile") and
`profiles/<model>-<dtype>-t<threads>.json`, so that profiling one thread count does not take
the record of another away from instances that run with it.

Pure Python (no torch): the gateway reads records too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

PROFILE_RECORD = "profile.json"  # the last record
PROFILE_RECORDS = "profiles"  # one record per model, dtype and thread count


@dataclass(frozen=True)
class ProfileIdentity:
    """What a forward's time depends on besides its shape; None matches any value."""

    model: str | None = None
    dtype: str | None = None
    threads: int | None = None

    def matches(self, record: dict) -> bool:
        return all(value is None or record.get(key) == value
                   for key, value in (("model", self.model), ("dtype", self.dtype),
                                      ("threads", self.threads)))

    def file_name(self) -> str | None:
        """The keyed record's file name; None unless all three are known."""
        if self.model is None or self.dtype is None or self.threads is None:
            return None
        return f"{re.sub(r'[^A-Za-z0-9._-]', '_', self.model)}-{self.dtype}-t{self.threads}.json"

    def __str__(self) -> str:
        return f"{self.model or 'any model'} {self.dtype or 'any dtype'} on " \
               f"{self.threads or 'any number of'} threads"


def served_identity(runner) -> ProfileIdentity:
    """The identity of the forwards a model runner runs (None where the runner does not say:
    a role test's runner without a model). On an accelerator the CPU threads do not time the
    forwards: any thread count matches there."""
    device = getattr(getattr(runner, "device", None), "type", "cpu")
    return ProfileIdentity(getattr(getattr(runner, "resolved", None), "name", None),
                           getattr(runner, "dtype_name", None),
                           getattr(runner, "num_threads", None) if device == "cpu" else None)


def record_identity(record: dict) -> ProfileIdentity:
    return ProfileIdentity(record.get("model"), record.get("dtype"), record.get("threads"))


def write_record(cache_dir: str | Path, record: dict) -> Path:
    """Save a record as the last one and as its identity's; returns the last one's path."""
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record)
    name = record_identity(record).file_name()
    if name is not None:
        (root / PROFILE_RECORDS).mkdir(exist_ok=True)
        (root / PROFILE_RECORDS / name).write_text(text)
    (root / PROFILE_RECORD).write_text(text)
    return root / PROFILE_RECORD


def _read(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def find_record(cache_dir: str | Path, identity: ProfileIdentity = ProfileIdentity()
                ) -> tuple[Path, dict] | None:
    """The record measured for `identity` and where it is: the last record when it matches (a
    cache directory made for one record holds only that one), else the one kept for the
    identity; None when neither fits."""
    root = Path(cache_dir).expanduser()
    name = identity.file_name()
    for path in (root / PROFILE_RECORD, *([root / PROFILE_RECORDS / name] if name else [])):
        record = _read(path)
        if record is not None and identity.matches(record):
            return path, record
    return None


def read_record(cache_dir: str | Path, identity: ProfileIdentity = ProfileIdentity()
                ) -> dict | None:
    """The record measured for `identity` (see `find_record`), or None."""
    found = find_record(cache_dir, identity)
    return None if found is None else found[1]
