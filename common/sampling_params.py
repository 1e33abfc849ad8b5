"""Per-request sampling and stopping parameters (a wire value: it travels inside messages)."""

from __future__ import annotations

import msgspec

from common.errors import InvalidRequestError

_INT64 = (-2**63, 2**63 - 1)  # what msgpack carries between processes


GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs

# The kinds of guided (grammar-constrained) decoding `GuidedSpec.kind` names.
GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class GuidedSpec(msgspec.Struct, frozen=True):
    """What a constrained request's output must match, as text (so it travels and hashes):
    `json` a JSON schema (serialized), `json_object` any JSON object (spec ""), `regex` a
    regular expression, `choice` a JSON list of allowed strings, `grammar` an EBNF grammar.
    Instances compile it with the grammar engine (common.engine.guided), once per distinct spec."""

    kind: str
    spec: str = ""


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
    # -- logits processing, in the order applied (vLLM's semantics) -------------------------
    # Penalties over the tokens generated so far (presence, frequency: OpenAI's, subtracted
    # from the logits) and over prompt + generated tokens (repetition: divides positive logits,
    # multiplies negative ones; 1 = off).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many are generated
    guided: GuidedSpec | None = None
    # -- what comes back besides tokens -----------------------------------------------------
    # Log-probabilities (of the model's raw distribution, before any processing): None = off;
    # k >= 0 = the sampled token's and the k likeliest tokens'. prompt_logprobs likewise for
    # every prompt token after the first, computed in the prefill forward.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

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
        for name, value in (("presence_penalty", self.presence_penalty),
                            ("frequency_penalty", self.frequency_penalty)):
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name, count in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if count is not None and not 0 <= count <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {count}")
        if self.guided is not None and self.guided.kind not in GUIDED_KINDS:
            raise InvalidRequestError(f"unknown guided decoding kind {self.guided.kind!r}")
        for name, values in (("seed", (self.seed or 0,)), ("top_k", (self.top_k,)),
                             ("stop_token_ids", self.stop_token_ids)):
            if any(not _INT64[0] <= v <= _INT64[1] for v in values):
                raise InvalidRequestError(f"{name} must fit in a signed 64-bit integer")
        return self

    @property
    def needs_history(self) -> bool:
        """Whether logits processing reads the sequence's earlier tokens (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def is_stop_token(self, token_id: int, num_output_tokens: int | None = None) -> bool:
        """`num_output_tokens`: how many tokens there are with this one; below min_tokens
        nothing stops (the sampler masks EOS there; a stop string is not checked either)."""
        if num_output_tokens is not None and num_output_tokens < self.min_tokens:
            return False
        if token_id in self.stop_token_ids:
            return True
        return not self.ignore_eos and token_id in self.eos_token_ids
