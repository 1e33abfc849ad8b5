"""The engine-label journal: makes `build-dataset --labels engine` resumable.

Engine labels cost a full greedy generation per prompt (minutes to hours for thousands of
prompts), so each finished prompt's label is appended to `OUT/engine-labels.jsonl` and flushed
at once. A rerun with the same `--out` reads the journal and generates only what is missing;
an interrupted run (Ctrl-C, a lost machine) loses at most the prompts in flight.

The first line is a header naming what the labels depend on (target model, dtype, generation
cap); a journal written under other settings is refused rather than mixed in, because greedy
lengths change with the dtype. A torn last line (the process died mid-write) is ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from common.errors import InvalidRequestError

JOURNAL_FILE = "engine-labels.jsonl"


class LabelJournal:
    """Labels by ShareGPT pair index, persisted line by line."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path = path
        self.header = header
        self.labels: dict[int, tuple[int, str]] = {}
        has_header = path.is_file() and self._read()
        torn = has_header and not path.read_bytes().endswith(b"\n")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handle: TextIO | None = open(path, "a" if has_header else "w", encoding="utf-8")
        if torn:
            self._handle.write("\n")  # new records must not glue onto a torn line
        if not has_header:
            self._write({"header": header})

    def _read(self) -> bool:
        """Load the records; False when not even the header was written."""
        lines = self.path.read_text(encoding="utf-8").split("\n")
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the empty tail, or a line torn by a crash
        if not records:
            return False
        if records[0].get("header") != self.header:
            raise InvalidRequestError(
                f"{self.path} holds labels made with {records[0].get('header')}, not "
                f"{self.header}: use another --out, or delete the file to start over")
        for record in records[1:]:
            self.labels[int(record["id"])] = (int(record["num_output_tokens"]),
                                              str(record["finish_reason"]))
        return True

    def _write(self, record: dict) -> None:
        assert self._handle is not None
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()

    def __len__(self) -> int:
        return len(self.labels)

    def get(self, pair_id: int) -> tuple[int, str] | None:
        return self.labels.get(pair_id)

    def record(self, pair_id: int, num_output_tokens: int, finish_reason: str) -> None:
        self.labels[pair_id] = (num_output_tokens, finish_reason)
        self._write({"id": pair_id, "num_output_tokens": num_output_tokens,
                     "finish_reason": finish_reason})

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
