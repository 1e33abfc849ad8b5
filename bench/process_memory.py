"""Resident memory (RSS) of a set of processes over time, and whether it stays flat.

Owns: reading VmRSS from /proc/<pid>/status, sampling named pids on a background thread,
fitting the growth trend after warm-up (least-squares slope over the last part of the samples),
and drawing RSS over time as a PNG. Used by `bench.soak`; also a small CLI:

    python -m bench.process_memory --pid gateway=1234 --pid decode-0=1240 --seconds 60 \
        --interval 2 --out results/rss
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MIB = 2**20


def read_rss_bytes(pid: int) -> int | None:
    """VmRSS of `pid` in bytes; None when the process is gone (or has no VmRSS: a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


@dataclass
class RssSampler:
    """Samples the RSS of `pids` (name -> pid) every `interval_s` seconds on a thread."""

    pids: dict[str, int]
    interval_s: float = 2.0
    times: list[float] = field(default_factory=list)  # seconds since start()
    rss: dict[str, list[int | None]] = field(default_factory=dict)  # name -> bytes per sample

    def __post_init__(self) -> None:
        self.rss = {name: [] for name in self.pids}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.monotonic()

    def sample(self) -> None:
        self.times.append(time.monotonic() - self._start)
        for name, pid in self.pids.items():
            self.rss[name].append(read_rss_bytes(pid))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> RssSampler:
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()  # one last point at the end

    def to_dict(self) -> dict:
        return {"interval_s": self.interval_s, "pids": self.pids, "times_s": self.times,
                "rss_bytes": self.rss}


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0.0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    if var == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var


def rss_trend(times: list[float], values: list[int | None], warmup_fraction: float = 0.2,
              tolerance_mib: float = 32.0, tolerance_fraction: float = 0.05) -> dict:
    """The RSS trend after warm-up: the slope over the last (1 - warmup_fraction) of the
    samples, the growth it predicts over that window, and `flat` when that growth is at most
    max(tolerance_mib, tolerance_fraction x median RSS). A process that vanished is not flat."""
    points = [(t, v) for t, v in zip(times, values) if v is not None]
    alive = bool(values) and values[-1] is not None
    start = int(len(points) * warmup_fraction)
    window = points[start:]
    if len(window) < 2:
        return {"samples": len(points), "alive": alive, "flat": False,
                "reason": "fewer than two samples after warm-up"}
    xs, ys = [t for t, _ in window], [v / MIB for _, v in window]
    per_s = slope(xs, ys)
    growth = per_s * (xs[-1] - xs[0])
    median = sorted(ys)[len(ys) // 2]
    allowed = max(tolerance_mib, tolerance_fraction * median)
    return {"samples": len(points), "alive": alive, "window_s": xs[-1] - xs[0],
            "first_mib": ys[0], "last_mib": ys[-1], "median_mib": median,
            "max_mib": max(ys), "slope_mib_per_min": per_s * 60.0,
            "growth_over_window_mib": growth, "allowed_growth_mib": allowed,
            "flat": alive and growth <= allowed}


def plot_rss(times: list[float], rss: dict[str, list[int | None]], path: Path,
             title: str, warmup_fraction: float = 0.2) -> None:
    """RSS (MiB) of every process over time (minutes); warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    minutes = [t / 60.0 for t in times]
    for name, values in sorted(rss.items()):
        pts = [(m, v / MIB) for m, v in zip(minutes, values) if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, linewidth=1.2)
    if len(minutes) > 1:
        ax.axvspan(minutes[0], minutes[int(len(minutes) * warmup_fraction)], color="0.9", zorder=0,
                   label="warm-up (not fitted)")
    ax.set_xlabel("minutes since start")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _named_pid(text: str) -> tuple[str, int]:
    name, _, pid = text.rpartition("=")
    return (name or pid), int(pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pid", action="append", type=_named_pid, required=True,
                        help="NAME=PID or PID (repeatable)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--out", default="results/rss")
    args = parser.parse_args(argv)
    sampler = RssSampler(dict(args.pid), args.interval).start()
    time.sleep(args.seconds)
    sampler.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trends = {n: rss_trend(sampler.times, v) for n, v in sampler.rss.items()}
    (out / "rss.json").write_text(json.dumps({**sampler.to_dict(), "trends": trends}, indent=1))
    plot_rss(sampler.times, sampler.rss, out / "rss.png", "RSS over time")
    for name, trend in trends.items():
        print(f"{name}: {trend.get('slope_mib_per_min', 0):+.2f} MiB/min, "
              f"flat={trend['flat']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
