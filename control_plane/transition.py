"""The transition watcher: when to flip an instance between the prefill and decode pools.

Policies are pure functions of a snapshot of the pools (TetriInfer §3.5):
- `idle`: an instance idle for T seconds (paper: 60) while the other pool has work moves there;
- `load-ratio`: the pools' normalized loads (prefill: queued prompt tokens per instance over
  `prefill_capacity_tokens`; decode: running + waiting sequences per instance over
  `decode_capacity_seqs`) differ by more than the ratio: the least-loaded instance of the light
  pool moves to the heavy one;
- `queue-delay`: recent time to first token above a target moves a decode instance to prefill;
  far below it, with the decode pool loaded, moves a prefill instance to decode.

Hysteresis keeps the cluster from oscillating: a condition must hold for `sustain_ticks`
consecutive checks, no flip starts within `cooldown_s` of the last one or while one is in
flight, and neither pool is ever emptied. Policies are found by name in
`common.plugins.FLIP_POLICIES` (entry points `splitserve.flip_policies`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from common.config import ConfigError
from common.plugins import FLIP_POLICIES
from common.protocol import InstanceStats


@dataclass(frozen=True)
class PoolSnapshot:
    now: float  # time.monotonic()
    instances: list[InstanceStats]  # routable (not draining) instances
    recent_ttft_s: float | None = None  # mean time to first token of recent requests

    def pool(self, role: str) -> list[InstanceStats]:
        return [s for s in self.instances if s.role == role]


@dataclass(frozen=True)
class FlipDecision:
    instance_id: str
    target_role: str
    reason: str


def _is_idle(stats: InstanceStats) -> bool:
    return stats.num_waiting + stats.num_running + stats.num_transferring == 0


def _prefill_load(stats: InstanceStats, capacity_tokens: float) -> float:
    return stats.num_queued_tokens / capacity_tokens


def _decode_load(stats: InstanceStats, capacity_seqs: float) -> float:
    return (stats.num_running + stats.num_waiting) / capacity_seqs


class FlipPolicy(ABC):
    @abstractmethod
    def decide(self, snapshot: PoolSnapshot) -> FlipDecision | None:
        """A flip the snapshot calls for, or None."""


class NeverFlip(FlipPolicy):
    def decide(self, snapshot):
        return None


class IdlePolicy(FlipPolicy):
    def __init__(self, idle_s: float = 60.0) -> None:
        self.idle_s = idle_s
        self.idle_since: dict[str, float] = {}

    def decide(self, snapshot):
        for stats in snapshot.instances:
            if _is_idle(stats):
                self.idle_since.setdefault(stats.instance_id, snapshot.now)
            else:
                self.idle_since.pop(stats.instance_id, None)
        for role, other in (("prefill", "decode"), ("decode", "prefill")):
            busy_other = any(not _is_idle(s) for s in snapshot.pool(other))
            for stats in snapshot.pool(role):
                since = self.idle_since.get(stats.instance_id)
                if busy_other and since is not None and snapshot.now - since >= self.idle_s:
                    return FlipDecision(stats.instance_id, other, f"idle {self.idle_s:.0f} s")
        return None


class LoadRatioPolicy(FlipPolicy):
    def __init__(self, ratio: float = 3.0, prefill_capacity_tokens: float = 2048.0,
                 decode_capacity_seqs: float = 32.0, min_load: float = 0.25) -> None:
        self.ratio, self.min_load = ratio, min_load
        self.prefill_capacity, self.decode_capacity = prefill_capacity_tokens, decode_capacity_seqs

    def decide(self, snapshot):
        prefills, decodes = snapshot.pool("prefill"), snapshot.pool("decode")
        if not prefills or not decodes:
            return None
        p_loads = {s.instance_id: _prefill_load(s, self.prefill_capacity) for s in prefills}
        d_loads = {s.instance_id: _decode_load(s, self.decode_capacity) for s in decodes}
        p_avg = sum(p_loads.values()) / len(p_loads)
        d_avg = sum(d_loads.values()) / len(d_loads)
        if p_avg >= self.min_load and p_avg > self.ratio * d_avg:
            target = min(d_loads, key=d_loads.get)
            return FlipDecision(target, "prefill",
                                f"prefill load {p_avg:.2f} vs decode {d_avg:.2f}")
        if d_avg >= self.min_load and d_avg > self.ratio * p_avg:
            target = min(p_loads, key=p_loads.get)
            return FlipDecision(target, "decode",
                                f"decode load {d_avg:.2f} vs prefill {p_avg:.2f}")
        return None


class QueueDelayPolicy(FlipPolicy):
    def __init__(self, ttft_target_s: float = 1.0, decode_capacity_seqs: float = 32.0) -> None:
        self.target, self.decode_capacity = ttft_target_s, decode_capacity_seqs

    def decide(self, snapshot):
        ttft = snapshot.recent_ttft_s
        prefills, decodes = snapshot.pool("prefill"), snapshot.pool("decode")
        if ttft is None or not prefills or not decodes:
            return None
        if ttft > self.target:
            target = min(decodes, key=lambda s: _decode_load(s, self.decode_capacity))
            return FlipDecision(target.instance_id, "prefill", f"TTFT {ttft:.2f} s > target")
        decode_avg = sum(_decode_load(s, self.decode_capacity) for s in decodes) / len(decodes)
        if ttft < 0.25 * self.target and decode_avg > 1.0:
            target = min(prefills, key=lambda s: s.num_queued_tokens)
            return FlipDecision(target.instance_id, "decode", f"TTFT {ttft:.2f} s, decode busy")
        return None


@dataclass
class TransitionWatcher:
    """Applies a policy with hysteresis; `step` returns the flip to start now, if any."""

    policy: FlipPolicy
    cooldown_s: float = 10.0
    sustain_ticks: int = 3
    _candidate: tuple[str, str] | None = None
    _streak: int = 0
    _last_flip: float = field(default=-1e9)

    def step(self, snapshot: PoolSnapshot, flip_in_flight: bool) -> FlipDecision | None:
        decision = self.policy.decide(snapshot)
        if decision is None or not self._keeps_pools(snapshot, decision):
            self._candidate, self._streak = None, 0
            return None
        key = (decision.instance_id, decision.target_role)
        self._streak = self._streak + 1 if key == self._candidate else 1
        self._candidate = key
        cooling = snapshot.now - self._last_flip < self.cooldown_s
        if flip_in_flight or cooling or self._streak < self.sustain_ticks:
            return None
        self._last_flip, self._candidate, self._streak = snapshot.now, None, 0
        return decision

    @staticmethod
    def _keeps_pools(snapshot: PoolSnapshot, decision: FlipDecision) -> bool:
        source = next((s.role for s in snapshot.instances
                       if s.instance_id == decision.instance_id), None)
        return source is not None and source != decision.target_role and \
            len(snapshot.pool(source)) > 1


def make_watcher(policy: str, **options) -> TransitionWatcher:
    """A watcher for `policy`; `options` mix the policy's knobs and cooldown_s/sustain_ticks."""
    watcher_options = {"cooldown_s": float(options.pop("cooldown_s", 10.0)),
                       "sustain_ticks": int(options.pop("sustain_ticks", 3))}
    try:
        cls = FLIP_POLICIES.get(policy)
        return TransitionWatcher(cls(**options), **watcher_options)
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"flip policy {policy!r}: {exc}") from None


def snapshot_now(instances: list[InstanceStats], recent_ttft_s: float | None) -> PoolSnapshot:
    return PoolSnapshot(time.monotonic(), instances, recent_ttft_s)
