"""CPU used by named processes over a measured interval, and by everything else on the machine.

Owns: reading utime + stime from /proc/<pid>/stat and the machine's busy time from /proc/stat,
turning two readings into shares of the interval's wall time (1.0 = one core busy throughout),
and waiting for a quiet machine before a measurement. On a shared machine "others" (the busy
time no named process accounts for) says whether a measurement was disturbed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

MACHINE = "machine"
OTHERS = "others"


def parse_cpu_ticks(stat: str) -> int:
    """utime + stime (clock ticks, every thread) from the text of /proc/<pid>/stat. The command
    name in field 2 may hold spaces and parentheses, so fields are counted after its last ')'."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)


def parse_machine_ticks(stat: str) -> int:
    """Busy clock ticks of all CPUs (all but idle and iowait) from the text of /proc/stat."""
    fields = [int(v) for v in stat.splitlines()[0].split()[1:9]]
    return sum(fields) - fields[3] - fields[4]  # user nice system [idle iowait] irq softirq steal


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds `pid` has used so far; None once it is gone."""
    try:
        return parse_cpu_ticks(Path(f"/proc/{pid}/stat").read_text()) / os.sysconf("SC_CLK_TCK")
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def machine_cpu_seconds() -> float:
    return parse_machine_ticks(Path("/proc/stat").read_text()) / os.sysconf("SC_CLK_TCK")


def reading(pids: Mapping[str, int]) -> dict[str, float | None]:
    """CPU seconds so far of the machine and of each named process."""
    return {MACHINE: machine_cpu_seconds(), **{name: cpu_seconds(pid) for name, pid in
                                               pids.items()}}


def cpu_shares(before: Mapping[str, float | None], after: Mapping[str, float | None],
               wall_s: float) -> dict[str, float | None]:
    """Each entry's CPU between two readings as a fraction of `wall_s`; None where a reading is
    missing. With a "machine" entry, "others" is the machine's busy time that no named process
    accounts for: load from elsewhere, which a clean measurement keeps near zero."""
    shares: dict[str, float | None] = {}
    for name, start in before.items():
        end = after.get(name)
        ok = start is not None and end is not None and wall_s > 0
        shares[name] = (end - start) / wall_s if ok else None
    if shares.get(MACHINE) is not None:
        ours = [v for n, v in shares.items() if n != MACHINE]
        shares[OTHERS] = None if None in ours else max(shares[MACHINE] - sum(ours), 0.0)
    return shares


def others_share(pids: Mapping[str, int], seconds: float = 1.0) -> float:
    """Cores busy over the next `seconds` besides the named processes."""
    before, started = reading(pids), time.perf_counter()
    time.sleep(seconds)
    return cpu_shares(before, reading(pids), time.perf_counter() - started)[OTHERS] or 0.0


def wait_for_quiet(pids: Mapping[str, int], max_others: float, timeout_s: float,
                   say: Callable[[str], None] = print) -> float:
    """Wait (up to `timeout_s`) until other load stays under `max_others` cores for a second;
    returns the last probe. A measurement taken while others run would time them, not us."""
    deadline = time.monotonic() + timeout_s
    others = others_share(pids)
    if others > max_others:
        say(f"waiting for other load ({others:.2f} cores) to drop under {max_others} cores")
    while others > max_others and time.monotonic() < deadline:
        others = others_share(pids)
    return others
