"""The simulator's cost model: how long a forward of a `BatchPlan` takes, and a KV transfer.

Pure Python. A forward's time is a function of its new tokens, the context its chunks attend to
and how many rows it samples:

    forward_s(plan) = base(T)                         T: tokens computed (padding included)
                      + per_sampled_row_s  * S        S: chunks that sample a token
                      + per_context_token_s * sum_i c_i           c_i: chunk i's cached tokens
                      + per_context_pair_s  * sum_i c_i * n_i     n_i: chunk i's new tokens
                      + per_mixed_forward_s    when prompt chunks and decodes share the forward
                      + per_extra_prompt_s * (P - 1)
                      - per_context_pair_s * (F(F+1)/2 - sum_j f_j(f_j+1)/2)
                                               when P >= 2 fresh prompts (no cached tokens) of
                                               f_j tokens, F in all, share the forward
                      + swapped bytes / swap_bytes_per_s

`base(T)` is the forward of T new tokens of one fresh prompt (no context, no sampled row), a
piecewise-linear curve: flat while the forward is bound by reading the weights, then linear once
the matmuls saturate (a roofline, measured). The context terms are attention over what is
already cached: reading each chunk's KV (decode steps are bound by it) and the new x cached
query-key pairs (later chunks of a long prompt). A mixed forward (a co-located instance's
prompt chunk beside its decodes) may cost more than its parts: a constant fitted from measured
mixed rows where the record has them (0 otherwise). Several fresh prompts in one forward compute
the matmuls of one prompt of their summed length, but each attends only to itself: base(F)
counts F(F+1)/2 query-key pairs where they compute sum f_j(f_j+1)/2, and each extra sequence
costs its own bookkeeping (per_extra_prompt_s, fitted from measured multi-prompt rows; 0 when
the record has none). Forwards with at most one fresh prompt (every decode step and the
steady-decode fast path) have neither term. Where the numbers come from: `simulator.fit`
(least squares over a `splitserve profile` record) or `simulator.hardware` (published figures).

A KV transfer over a `Link` takes `latency_s + bytes / bandwidth`, bytes = tokens x
`kv_bytes_per_token` (the emulation mode of `kv_transfer` paces real transfers the same way).

The model is saved as JSON (`save` / `load`); it keeps the measured rows it was fitted from and
how far the fit is from each, so a reader can judge it.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from common.config import BANDWIDTH_PRESETS, ConfigError
from common.plan import BatchPlan, ForwardShape
from common.schedulers.costs import IterationCosts

KIND = "splitserve-simulator-costs"
# The sizes `splitserve profile` measures (common.engine.profile; not imported: it loads torch).
PREFILL_SIZES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
KNEE_FRACTION = 0.9  # the profile's ChunkSize rule (common.engine.profile.knee)


@dataclass(frozen=True)
class Link:
    """One direction of a link between two instances."""

    bandwidth: float  # bytes per second; math.inf = instantaneous
    latency_s: float = 0.0

    def transfer_s(self, num_bytes: float) -> float:
        return self.latency_s + (0.0 if math.isinf(self.bandwidth) else num_bytes / self.bandwidth)

    @property
    def occupancy_per_byte(self) -> float:
        """Seconds one byte holds the link (latency overlaps the next transfer, bytes do not)."""
        return 0.0 if math.isinf(self.bandwidth) else 1.0 / self.bandwidth


# Bandwidths are kv_transfer's emulation presets (common.config.BANDWIDTH_PRESETS). Latencies are
# ASSUMED (not measured here): a per-transfer setup of a few tens of microseconds, the order of an
# RDMA read posted through UCX or an NCCL/CUDA-IPC copy launch.
LINK_PRESETS = {
    "roce-200g": Link(BANDWIDTH_PRESETS["roce-200g"], 20e-6),
    "nvlink-300g": Link(BANDWIDTH_PRESETS["nvlink-300g"], 10e-6),
    "ideal": Link(math.inf, 0.0),
}


def link_named(name: str) -> Link:
    try:
        return LINK_PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown link preset {name!r}; known: {sorted(LINK_PRESETS)}") from None


def interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys); the first value below xs[0]; the last segment's slope
    beyond the last point (a forward keeps growing with its tokens)."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0] if x <= xs[0] else ys[0] * x / xs[0]
    i = min(bisect_right(xs, x), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class CostModel:
    base: tuple[tuple[int, float], ...]  # (T new tokens, seconds), T increasing
    per_sampled_row_s: float
    per_context_token_s: float
    per_context_pair_s: float
    kv_bytes_per_token: int  # K and V of one token over every layer
    max_model_len: int
    # KV capacity of one instance in tokens; None: CacheConfig.memory_gib decides, as on a CPU
    kv_capacity_tokens: int | None = None
    chunk_size: int | None = None  # the ChunkSize the source recommends (profile knee)
    swap_bytes_per_s: float | None = None  # host swap tier; None: swaps cost nothing
    decode_context: int = 256  # the context of the decode curve handed to co-located policies
    per_mixed_forward_s: float = 0.0  # a forward with prompt chunks and decodes, beyond its parts
    per_extra_prompt_s: float = 0.0  # each fresh prompt after the first in one forward
    # Forwards that carry a prompt chunk (prefill and mixed) this many times as long beside the
    # decode steps (a calibration: in service a prefill instance's compute-bound forwards can
    # slow down more than the decode steps do; 1 from a profile)
    prompt_factor: float = 1.0
    default_link: str = "roce-200g"
    source: str = ""
    notes: tuple[str, ...] = ()
    fit: dict = field(default_factory=dict)  # measured rows, predictions, errors (fitted models)

    def __post_init__(self) -> None:
        xs = [int(x) for x, _ in self.base]
        if not xs or xs != sorted(set(xs)) or xs[0] < 1:
            raise ConfigError("a cost model's base curve needs increasing token counts >= 1")
        if min(self.per_sampled_row_s, self.per_context_token_s, self.per_context_pair_s,
               self.per_mixed_forward_s, self.per_extra_prompt_s) < 0:
            raise ConfigError("cost model coefficients must be >= 0")
        if self.prompt_factor <= 0:
            raise ConfigError("a cost model's prompt factor must be > 0")
        object.__setattr__(self, "_xs", xs)
        object.__setattr__(self, "_ys", [float(y) for _, y in self.base])
        object.__setattr__(self, "_decode_rows", {})  # num_seqs -> base + sampled rows, memo

    # -- time of a forward ---------------------------------------------------------------------
    def base_s(self, num_tokens: int) -> float:
        return interpolate(self._xs, self._ys, num_tokens)

    def forward_s(self, plan: BatchPlan, block_size: int = 16) -> float:
        """The modelled seconds of one forward of `plan` (see the module docstring); swaps
        move whole blocks of `block_size` tokens."""
        return self.shape_s(ForwardShape.of(plan), block_size)

    def shape_s(self, shape: ForwardShape, block_size: int = 16) -> float:
        """`forward_s` of a forward of this shape (what an instance's forward log records)."""
        seconds = (self.base_s(shape.tokens) + self.per_sampled_row_s * shape.rows
                   + self.per_context_token_s * shape.context
                   + self.per_context_pair_s * shape.pairs)
        if shape.prompts and shape.decodes:
            seconds += self.per_mixed_forward_s
        if len(shape.fresh) > 1:
            seconds += self.multi_prompt_extra_s(list(shape.fresh))
        if shape.prompts:
            seconds *= self.prompt_factor
        if shape.swap_blocks and self.swap_bytes_per_s:
            seconds += (shape.swap_blocks * block_size * self.kv_bytes_per_token
                        / self.swap_bytes_per_s)
        return seconds

    def multi_prompt_extra_s(self, fresh: list[int]) -> float:
        """What several fresh prompts in one forward cost beyond base(their sum): the extra
        sequences' bookkeeping, less the query-key pairs across prompts that none computes."""
        total = sum(fresh)
        crossing = total * (total + 1) / 2 - sum(f * (f + 1) / 2 for f in fresh)
        extra = self.per_extra_prompt_s * (len(fresh) - 1) - self.per_context_pair_s * crossing
        # never less than the largest prompt alone (a pair cost fitted high must not drive a
        # forward's time below what its own longest prompt takes)
        return max(extra, self.base_s(max(fresh)) - self.base_s(total))

    def multi_prompt_s(self, num_prompts: int, num_tokens: int) -> float:
        """`forward_s` of `num_prompts` fresh prompts of `num_tokens` each, each sampling."""
        return self.prompt_factor * (
            self.base_s(num_prompts * num_tokens) + self.per_sampled_row_s * num_prompts
            + self.multi_prompt_extra_s([num_tokens] * num_prompts))

    def decode_s(self, num_seqs: int, context: int) -> float:
        """`forward_s` of a plan of `num_seqs` one-token decodes after `context` cached tokens in
        all (the same terms in the same order, so the same float)."""
        rows = self._decode_rows.get(num_seqs)
        if rows is None:
            rows = self._decode_rows[num_seqs] = (self.base_s(num_seqs)
                                                  + self.per_sampled_row_s * num_seqs)
        return rows + self.per_context_token_s * context + self.per_context_pair_s * context

    def mixed_s(self, num_tokens: int, batch: int, context: int) -> float:
        """`forward_s` of one fresh prompt of `num_tokens` (its first token sampled) beside one
        decode step of `batch` sequences holding `context` tokens each."""
        return self.prompt_factor * (
            self.base_s(num_tokens + batch) + self.per_sampled_row_s * (batch + 1)
            + (self.per_context_token_s + self.per_context_pair_s) * batch * context
            + (self.per_mixed_forward_s if batch else 0.0))

    def scaled(self, factor: float, prompt_factor: float | None = None) -> CostModel:
        """Every forward `factor` times as long, or those carrying a prompt chunk
        `prompt_factor` times (simulator.calibrate); transfers unchanged."""
        if factor <= 0 or (prompt_factor is not None and prompt_factor <= 0):
            raise ConfigError("a cost model's scale factor must be > 0")
        relative = self.prompt_factor * (prompt_factor / factor if prompt_factor else 1.0)
        return replace(self, base=tuple((x, y * factor) for x, y in self.base),
                       per_sampled_row_s=self.per_sampled_row_s * factor,
                       per_context_token_s=self.per_context_token_s * factor,
                       per_context_pair_s=self.per_context_pair_s * factor,
                       per_mixed_forward_s=self.per_mixed_forward_s * factor,
                       per_extra_prompt_s=self.per_extra_prompt_s * factor,
                       prompt_factor=relative,
                       notes=(*self.notes, (f"every forward scaled by {factor:.3f}"
                                            + (f", prompt-carrying ones by {prompt_factor:.3f}"
                                               if prompt_factor else "")
                                            + " (calibrated to the serving stack)")))

    def prefill_s(self, num_tokens: int) -> float:
        """One fresh prompt of `num_tokens`, its first token sampled."""
        return (self.base_s(num_tokens) + self.per_sampled_row_s) * self.prompt_factor

    def decode_step_s(self, batch: int, context: int) -> float:
        """One decode step of `batch` sequences holding `context` tokens each."""
        return (self.base_s(batch) + batch * (self.per_sampled_row_s
                + context * (self.per_context_token_s + self.per_context_pair_s)))

    def iteration_costs(self) -> IterationCosts:
        """The curves a co-located policy reads (FastServe's job profiler, the TBT budget), in
        the form `splitserve profile` records them, from this model."""
        return IterationCosts(
            tuple((n, self.prefill_s(n)) for n in PREFILL_SIZES),
            tuple((b, self.decode_step_s(b, self.decode_context)) for b in DECODE_BATCHES),
            source=f"simulator cost model ({self.source})")

    def recommended_chunk_size(self) -> int:
        """The source's ChunkSize, else the profile's knee rule applied to this model."""
        if self.chunk_size:
            return self.chunk_size
        throughputs = [n / self.prefill_s(n) for n in PREFILL_SIZES]
        best = max(range(len(throughputs)), key=throughputs.__getitem__)
        start = best
        while start > 0 and throughputs[start - 1] >= KNEE_FRACTION * throughputs[best]:
            start -= 1
        return PREFILL_SIZES[start]

    def transfer_s(self, link: Link, num_tokens: int) -> float:
        return link.transfer_s(num_tokens * self.kv_bytes_per_token)

    # -- files ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = asdict(self)
        data["base"] = [list(point) for point in self.base]
        data["notes"] = list(self.notes)
        return {"kind": KIND, **data}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        if data.get("kind") != KIND:
            raise ConfigError(f"not a simulator cost model (kind {data.get('kind')!r}); a "
                              "`splitserve profile` record is fitted with --profile")
        fields = {k: v for k, v in data.items() if k != "kind"}
        try:
            fields["base"] = tuple((int(x), float(y)) for x, y in fields["base"])
            fields["notes"] = tuple(fields.get("notes", ()))
            return cls(**fields)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"bad simulator cost model: {exc}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path


def load(path: str | Path) -> CostModel:
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read cost model {path}: {exc}") from None
    return CostModel.from_dict(data)
