"""Fitting the cost model (`simulator.costs.CostModel`) to a `splitserve profile` record.

A record (the cache directory's `profile.json`, or the report `splitserve profile --out` writes)
holds two measured curves: fresh prefills of N tokens, and decode steps of B sequences each
holding `decode_context` tokens (a row may carry its own `context`); newer records also hold
mixed rows, a fresh prompt of N tokens beside a decode step of B, decode steps at other contexts
(`decode_contexts`) and forwards of K fresh prompts of N tokens each (`multi_prompt`,
common.engine.profile_shapes). The fit, in two steps:

1. per_context_pair_s: the prefill curve's quadratic part. A fresh prompt of N tokens computes
   N(N+1)/2 query-key pairs, so above the knee, where the matmuls are saturated, seconds =
   c0 + c1 N + c2 N^2/2 and c2 is the cost of one pair. (0 when fewer than 3 rows are there.)
2. base(T) at the prefill sizes, per_sampled_row_s, per_context_token_s, per_mixed_forward_s
   and per_extra_prompt_s: one weighted linear least-squares problem over every row,
       prefill N:     base(N) + row                                   = measured
       decode B, C:   base(B) + row * B + ctx * B * C                 = measured - pair * B * C
       mixed N, B, C: base(N + B) + row * (B + 1) + ctx * B * C + mix = measured - pair * B * C
       K prompts, N:  base(K N) + row * K + extra * (K - 1)           = measured + pair * X
   where X = KN(KN+1)/2 - K N(N+1)/2, the pairs across prompts that base(KN) counts and nobody
   computes (base between sizes is linear in its two neighbours), each equation divided by its
   measured time so that 1 ms and 1 s rows count alike. A coefficient that comes out negative
   is set to 0 and the rest refitted; base is made non-decreasing. Without mixed rows `mix` is
   0, without multi-prompt rows `extra` is.

What the record cannot tell apart is stated in the model's notes: with decode measured at one
context length, reading the KV and computing over it are one coefficient, and that coefficient
is confounded with the per-row cost; without mixed rows a mixed forward is modelled as the sum
of its terms, never measured; without multi-prompt rows neither is a forward of several prompts.
"""

from __future__ import annotations

import numpy as np

from common.config import ConfigError
from simulator.costs import CostModel

# Shapes of models a profile record may name, to count KV bytes per token: (layers, KV heads,
# head dim, context length). Anything else needs kv_bytes_per_token from the caller.
KNOWN_MODELS = {"SmolLM2-135M-Instruct": (30, 3, 64, 8192), "SmolLM2-135M": (30, 3, 64, 8192)}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_bytes_per_token(model: str, dtype: str) -> int | None:
    shape = KNOWN_MODELS.get(model)
    if shape is None or dtype not in DTYPE_BYTES:
        return None
    layers, kv_heads, head_dim, _ = shape
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def _rows(record: dict) -> tuple[list, list, list, list]:
    """(prefill (N, s), decode (B, s, C), mixed (N, B, s, C), multi-prompt (K, N, s)) rows of a
    record; decode rows include those at other contexts."""
    try:
        prefill = sorted((int(r["tokens"]), float(r["seconds"])) for r in record["prefill"])
        context = int(record.get("decode_context", 256))
        decode = sorted((int(r["batch"]), float(r["step_seconds"]), int(r.get("context", context)))
                        for r in [*record["decode"], *record.get("decode_contexts", [])])
        mixed = sorted((int(r["prefill_tokens"]), int(r["batch"]), float(r["seconds"]),
                        int(r.get("context", context))) for r in record.get("mixed", []))
        multi = sorted((int(r["prompts"]), int(r["tokens"]), float(r["seconds"]))
                       for r in record.get("multi_prompt", []))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"not a splitserve profile record: {exc!r}") from None
    if len(prefill) < 2 or not decode:
        raise ConfigError("a profile needs at least 2 prefill rows and 1 decode row to fit")
    return prefill, decode, mixed, multi


def pair_cost(prefill: list[tuple[int, float]], above: int = 128) -> float:
    """Seconds per query-key pair, from the prefill curve's curvature above `above` tokens."""
    points = [(n, s) for n, s in prefill if n >= above]
    if len(points) < 3:
        return 0.0
    n = np.array([p[0] for p in points], dtype=np.float64)
    s = np.array([p[1] for p in points], dtype=np.float64)
    c2, _, _ = np.polyfit(n, s, 2)  # s = c2 n^2 + c1 n + c0, so one pair costs 2 c2
    return max(2.0 * float(c2), 0.0)


def _knot_weights(knots: list[int], x: int) -> dict[int, float]:
    """base(x) as a combination of the base values at the knots (linear interpolation)."""
    if x <= knots[0]:
        return {0: 1.0}
    i = next((k for k, v in enumerate(knots) if v >= x), len(knots) - 1)
    i = max(i, 1)
    x0, x1 = knots[i - 1], knots[i]
    t = (x - x0) / (x1 - x0)
    return {i - 1: 1.0 - t, i: t}


# after the base knots: per sampled row, per context token, per mixed forward, per extra prompt
COEFFICIENTS = 4


def crossing_pairs(num_prompts: int, num_tokens: int) -> float:
    """Query-key pairs base(K N) counts across K fresh prompts of N tokens: none computes them."""
    total = num_prompts * num_tokens
    return total * (total + 1) / 2 - num_prompts * num_tokens * (num_tokens + 1) / 2


def _system(prefill, decode, mixed, multi, pair: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the weighted least-squares problem: unknowns = base at each prefill size, then
    per_sampled_row_s, per_context_token_s, per_mixed_forward_s and per_extra_prompt_s."""
    knots = [n for n, _ in prefill]
    rows, targets = [], []

    def add(tokens: int, sampled: int, context: int, is_mixed: bool, seconds: float,
            extra_prompts: int = 0, crossing: float = 0.0) -> None:
        row = np.zeros(len(knots) + COEFFICIENTS)
        for k, w in _knot_weights(knots, tokens).items():
            row[k] += w
        row[-COEFFICIENTS:] = sampled, context, float(is_mixed), extra_prompts
        rows.append(row / seconds)
        targets.append((seconds - pair * context + pair * crossing) / seconds)

    for n, seconds in prefill:
        add(n, 1, 0, False, seconds)
    for batch, seconds, context in decode:
        add(batch, batch, batch * context, False, seconds)
    for n, batch, seconds, context in mixed:
        add(n + batch, batch + 1, batch * context, True, seconds)
    for k, n, seconds in multi:
        add(k * n, k, 0, False, seconds, k - 1, crossing_pairs(k, n))
    return np.array(rows), np.array(targets)


def _solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with the coefficients after the knots kept >= 0."""
    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        x[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        negative = [i for i in range(a.shape[1] - COEFFICIENTS, a.shape[1])
                    if i in active and x[i] < 0]
        if not negative:
            return x
        active.remove(negative[0])


def _monotone(values) -> list[float]:
    result, floor = [], 1e-9  # a forward of more tokens never takes less time
    for v in values:
        floor = max(floor, float(v))
        result.append(floor)
    return result


def fit_profile(record: dict, *, kv_bytes: int | None = None, max_model_len: int | None = None,
                source: str = "profile") -> CostModel:
    """A cost model fitted to a `splitserve profile` record (see the module docstring)."""
    prefill, decode, mixed, multi = _rows(record)
    model_name, dtype = record.get("model", "?"), record.get("dtype", "?")
    kv_bytes = kv_bytes or kv_bytes_per_token(model_name, dtype)
    if not kv_bytes:
        raise ConfigError(f"KV bytes per token of {model_name} ({dtype}) are not known here: "
                          "give them (--kv-bytes-per-token)")
    shape = KNOWN_MODELS.get(model_name)
    pair = pair_cost(prefill)
    x = _solve(*_system(prefill, decode, mixed, multi, pair))
    base = tuple(zip([n for n, _ in prefill], _monotone(x[:-COEFFICIENTS])))
    contexts = sorted({c for _, _, c in decode})
    model = CostModel(
        base=base, per_sampled_row_s=float(x[-4]), per_context_token_s=float(x[-3]),
        per_context_pair_s=pair, per_mixed_forward_s=float(x[-2]),
        per_extra_prompt_s=float(x[-1]), kv_bytes_per_token=kv_bytes,
        max_model_len=max_model_len or (shape[3] if shape else 4096),
        chunk_size=record.get("recommended_chunk_size"),
        decode_context=int(record.get("decode_context", 256)), default_link="ideal",
        source=f"fitted to {source}: {model_name} {dtype}, {record.get('threads', '?')} threads,"
               f" {record.get('cpu', 'device not recorded')}",
        notes=("least-squares fit of measured curves (simulator/fit.py)",
               (f"decode measured at contexts {contexts}: KV read and attention compute over"
                " the context are one coefficient (per_context_token_s)" +
                ("" if len(contexts) > 1 else ", confounded with the per-row cost")),
               (f"mixed forwards measured ({len(mixed)} rows): the sum of their parts plus "
                "per_mixed_forward_s" if mixed else
                "mixed forwards (prefill chunks beside decodes) are modelled, not measured"),
               (f"forwards of several fresh prompts measured ({len(multi)} rows): "
                "per_extra_prompt_s per prompt after the first, less the pairs across prompts"
                if multi else "forwards of several fresh prompts are modelled, not measured"),
               "KV capacity comes from the instances' CacheConfig (memory_gib or num_blocks)"))
    return _with_errors(model, prefill, decode, mixed, multi)


def _with_errors(model: CostModel, prefill, decode, mixed, multi) -> CostModel:
    """The model with its fit report: every measured row, its prediction, the relative error."""
    rows = [{"kind": "prefill", "tokens": n, "measured_s": s, "model_s": model.prefill_s(n)}
            for n, s in prefill]
    rows += [{"kind": "decode", "batch": b, "context": c, "measured_s": s,
              "model_s": model.decode_step_s(b, c)} for b, s, c in decode]
    rows += [{"kind": "mixed", "tokens": n, "batch": b, "context": c, "measured_s": s,
              "model_s": model.mixed_s(n, b, c)} for n, b, s, c in mixed]
    rows += [{"kind": "multi_prompt", "prompts": k, "tokens": n, "measured_s": s,
              "model_s": model.multi_prompt_s(k, n)} for k, n, s in multi]
    for row in rows:
        row["relative_error"] = row["model_s"] / row["measured_s"] - 1.0
    worst = {kind: max(abs(r["relative_error"]) for r in rows if r["kind"] == kind)
             for kind in ("prefill", "decode", "mixed", "multi_prompt")
             if any(r["kind"] == kind for r in rows)}
    from dataclasses import replace

    return replace(model, fit={"rows": rows, "max_abs_relative_error": worst})
