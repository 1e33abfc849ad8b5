"""Forward time as a function of tokens, from a `splitserve profile` result: the cost model that
FastServe's job profiler and Sarathi-Serve's token budget read.

Pure Python (no torch). A profile is two measured curves:
- prefill: seconds of one forward that computes N prompt tokens (N = 1..2048 in a full profile);
- decode: seconds of one decode step of B sequences, each holding `decode_context` tokens.
`IterationCosts` interpolates them. Where they come from (the coupled role asks in this order):
1. the record `splitserve profile` leaves in the cache directory (common.profile_record: the
   last one, or the one kept for the served model, dtype and threads) measured with them;
2. a short measurement at start-up (`common.engine.profile.measure_costs`);
3. else the policy's constants, with a logged warning.

A mixed forward (p prompt tokens beside d decodes, Sarathi-Serve's hybrid batch) is not measured
by the profile; it is modelled as the forward of p + d prompt tokens plus what d decodes cost
beyond d prompt tokens (their logits, sampling and attention over their context):
    mixed(p, d) = forward(p + d) + max(0, decode_step(d) - forward(d))
which is exact at both ends (d = 0: a prefill forward; p = 0: a decode step).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from common.config import ConfigError
from common.profile_record import ProfileIdentity, find_record

Curve = tuple[tuple[int, float], ...]


def _monotone(points) -> Curve:
    """Sorted by x, each y at least the one before: a forward of more tokens (or a larger batch)
    never takes less time, so a dip in the measured medians is noise and is flattened."""
    result, floor = [], 0.0
    for x, y in sorted((int(x), float(y)) for x, y in points):
        if x < 1 or not y > 0:
            raise ConfigError(f"a profile point needs x >= 1 and seconds > 0, got {(x, y)}")
        floor = max(floor, y)
        result.append((x, floor))
    if not result:
        raise ConfigError("a profile curve needs at least one point")
    return tuple(result)


def _interpolate(curve: Curve, x: float) -> float:
    """Piecewise linear; the first value below the first point; beyond the last point the last
    segment's slope carries on (a forward's cost keeps growing with its tokens), or, for a
    one-point curve, the time grows in proportion."""
    xs = [p[0] for p in curve]
    if x <= xs[0] or len(curve) == 1:
        return curve[0][1] if x <= xs[0] else curve[-1][1] * x / xs[-1]
    i = min(bisect_right(xs, x), len(curve) - 1)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class IterationCosts:
    """Measured forward times; `source` says where they came from (for the logs)."""

    prefill: Curve  # (prompt tokens in one forward, seconds)
    decode: Curve  # (decode batch size, seconds per step)
    source: str = "profile"

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", _monotone(self.prefill))
        object.__setattr__(self, "decode", _monotone(self.decode))

    def forward_s(self, num_tokens: int) -> float:
        """One forward computing `num_tokens` prompt tokens."""
        return _interpolate(self.prefill, num_tokens)

    def decode_step_s(self, batch: int) -> float:
        """One decode step of `batch` sequences."""
        return _interpolate(self.decode, batch)

    def mixed_s(self, num_prefill_tokens: int, num_decodes: int) -> float:
        """A hybrid forward (see the module docstring for the model)."""
        extra = 0.0
        if num_decodes > 0:
            extra = max(0.0, self.decode_step_s(num_decodes) - self.forward_s(num_decodes))
        return self.forward_s(num_prefill_tokens + num_decodes) + extra

    @property
    def max_profiled_tokens(self) -> int:
        return self.prefill[-1][0]

    @classmethod
    def from_report(cls, report: dict, source: str = "profile") -> IterationCosts:
        """From `splitserve profile`'s report or record (its "prefill" and "decode" rows)."""
        try:
            prefill = [(r["tokens"], r["seconds"]) for r in report["prefill"]]
            decode = [(r["batch"], r["step_seconds"]) for r in report["decode"]]
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"not a splitserve profile ({source}): missing {exc}") from None
        return cls(tuple(prefill), tuple(decode), source)


def recorded_costs(cache_dir: str, model: str | None = None, dtype: str | None = None,
                   threads: int | None = None) -> IterationCosts | None:
    """The costs `splitserve profile` recorded on this machine, if they fit the given model,
    dtype and thread count (common.profile_record: the last record, else the one kept for
    them; a forward's time depends on all three); None when no record fits or it holds no
    curves (a record from before they were recorded)."""
    found = find_record(cache_dir, ProfileIdentity(model, dtype, threads))
    if found is None:
        return None
    try:
        return IterationCosts.from_report(found[1], source=str(found[0]))
    except ValueError:  # a record from before the curves were recorded
        return None


def token_budget_for_tbt(costs: IterationCosts, tbt_slo_s: float, max_num_seqs: int,
                         max_tokens: int | None = None) -> int:
    """Sarathi-Serve §4.3: the largest token count per forward whose profiled mixed forward
    stays within the TBT SLO. A forward of T tokens is charged its worst mix: any d <=
    min(T, max_num_seqs) of them decodes, the rest prompt tokens. T ranges up to `max_tokens`
    (default: the largest profiled forward, so the budget never rests on extrapolation).
    Raises ConfigError when not even one token fits the SLO."""
    if not tbt_slo_s > 0:
        raise ConfigError(f"the TBT SLO must be > 0 seconds, got {tbt_slo_s}")
    limit = max_tokens or costs.max_profiled_tokens
    # worst_extra[d]: the most any batch of at most d decodes costs beyond as many prompt tokens
    worst_extra = [0.0]
    for d in range(1, min(limit, max_num_seqs) + 1):
        worst_extra.append(max(worst_extra[-1], costs.mixed_s(0, d) - costs.forward_s(d)))
    for tokens in range(limit, 0, -1):
        if costs.forward_s(tokens) + worst_extra[min(tokens, max_num_seqs)] <= tbt_slo_s:
            return tokens
    raise ConfigError(f"TBT SLO {tbt_slo_s * 1e3:.1f} ms is below the profiled time of a "
                      f"one-token forward ({costs.mixed_s(0, 1) * 1e3:.1f} ms, {costs.source})")
