"""Per-request sampling and stopping parameters (a wire value: it travels inside messages)."""

from __future__ import annotations

import msgspec

from common.errors import InvalidRequestError

_INT64 = (-2**63, 2**63 - 1)  # what msgpack carries between processes


GREEDY_EPSILON = 1e-5


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    # Drop tokens less likely than min_p times the likeliest one (after temperature); 0 = off.
    min_p: float = 0.0
    # Sampling with a seed is a pure function of (seed, index of the generated token), so a
    # request gives the same text whichever instances and batches it passes through.
    seed: int | None = None
    # Stop strings need text, so they are checked where text exists (gateway, offline engine).
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        # Below 1e-5 a temperature overflows the logits; it means greedy (vLLM does the same).
        return self.temperature < GREEDY_EPSILON or self.top_k == 1

    def validate(self) -> SamplingParams:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        for name, values in (("seed", (self.seed or 0,)), ("top_k", (self.top_k,)),
                             ("stop_token_ids", self.stop_token_ids)):
            if any(not _INT64[0] <= v <= _INT64[1] for v in values):
                raise InvalidRequestError(f"{name} must fit in a signed 64-bit integer")
        return self

    def is_stop_token(self, token_id: int) -> bool:
        if token_id in self.stop_token_ids:
            return True
        return not self.ignore_eos and token_id in self.eos_token_ids
