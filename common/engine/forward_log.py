"""An instance's forward log: one JSON line per forward with its shape (`common.plan.ForwardShape`),
its measured seconds and its loop turn's, for checking the simulator's cost model against the
forwards a service really ran (`simulator.forward_check`). Off unless `InstanceConfig.
forward_log_dir` is set: a diagnostic, written to `<dir>/<instance id>.jsonl`."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from common.plan import BatchPlan, ForwardShape


WAITED_S = 0.001  # a longer gap before a turn (`gap_s`): the loop had waited for work


class ForwardLog:
    def __init__(self, directory: str, instance_id: str) -> None:
        path = Path(directory).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"{instance_id}.jsonl"
        self._file = self.path.open("a", encoding="utf-8")

    def record(self, plan: BatchPlan, forward_s: float, turn_s: float) -> None:
        """`turn_s`: the loop turn's wall time, the forward included (`time` is when it ended,
        wall clock, so that a reader can cut the lines to a load's window)."""
        line = {"time": time.time(), "forward_s": forward_s, "turn_s": turn_s,
                **asdict(ForwardShape.of(plan))}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read(path: str | Path, start: float = 0.0, end: float = float("inf")) -> list[dict]:
    """The lines of a forward log whose forward ended within [start, end] (wall clock); each
    with its `shape` rebuilt and `gap_s`: the time between the loop's previous forward and this
    turn's start (near zero while it has work; its wait for work otherwise; inf for the first)."""
    lines, previous = [], None
    for text in Path(path).read_text(encoding="utf-8").splitlines():
        line = json.loads(text)
        began = line["time"] - line["turn_s"]
        gap = math.inf if previous is None else began - previous
        previous = line["time"]
        if start <= line["time"] <= end:
            fields = {k: line.pop(k) for k in list(line) if k not in ("time", "forward_s",
                                                                      "turn_s")}
            fields["fresh"] = tuple(fields["fresh"])
            lines.append({**line, "gap_s": gap, "shape": ForwardShape(**fields)})
    return lines
