"""The plan a scheduler hands the model runner for one forward, and what comes back.

The scheduler decides (which sequences, how many tokens each, which blocks); the runner executes
the plan without deciding anything; the scheduler then absorbs the `ModelOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One sequence's share of a forward."""

    seq_id: str
    token_ids: list[int]  # the tokens computed now (a prompt chunk, or the last sampled token)
    num_cached: int  # tokens already in the KV cache: position of token_ids[0]
    block_ids: list[int]  # the sequence's block table, covering num_cached + len(token_ids)
    # Sample a token after the last one (end of prompt or decode). None = compute KV only.
    sampling: SamplingParams | None = None
    num_output_tokens: int = 0  # tokens generated so far: the index of the one sampled now
    # For logits processing that reads earlier tokens (penalties), and for prompt
    # log-probabilities (the token after the chunk's last): the sequence's token ids so far,
    # prompt first (shared with the sequence, not copied), and how many are prompt. None when
    # neither needs them.
    history: list[int] | None = None
    num_prompt_tokens: int = 0
    # The sequence's grammar matcher (common.engine.guided) when its output is constrained.
    guide: object | None = None
    # A prompt chunk of a request asking for prompt log-probabilities: how many top ones.
    prompt_logprobs: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class BatchPlan:
    chunks: list[ScheduledChunk]
    # Zero tokens appended to fill a fixed-size prefill chunk (TetriInfer's padding); computed,
    # never cached or sampled.
    num_padding_tokens: int = 0
    return_logits: bool = False  # keep the sampled rows' logits in the output (tests, analysis)
    # Keep the final hidden state of each sampled row (the last prompt token at the end of a
    # prefill): the length predictor's probe reads it, so prediction costs no extra forward.
    return_hidden: bool = False
    # Which hidden states `return_hidden` keeps, numbered like Hugging Face's `hidden_states`
    # (k = after k decoder layers, the layer count = the final normed state). Empty: the final
    # state alone, `[hidden_size]` per sequence; otherwise `[len(hidden_layers), hidden_size]`.
    hidden_layers: tuple[int, ...] = ()
    # KV copies to the second (host) tier and back, run by the runner before the forward, all
    # swap-outs first (common.engine.swap): (device block, host block) and (host block, device
    # block) pairs. The scheduler has already moved the blocks' ownership
    # (common.schedulers.swapping).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks) + self.num_padding_tokens

    @property
    def has_swaps(self) -> bool:
        return bool(self.swap_out or self.swap_in)

    def shape(self) -> ForwardShape:
        return ForwardShape.of(self)

    @property
    def is_empty(self) -> bool:
        # A plan of swaps alone still has work for the runner: skipping it would leave the
        # scheduler's block ownership out of step with the cache's contents.
        return not self.chunks and not self.has_swaps


@dataclass(frozen=True)
class ForwardShape:
    """What a forward's cost depends on, without the token ids or block tables: the simulator's
    cost model prices it (simulator.costs), and an instance's forward log records it beside the
    measured seconds, so the model can be checked against the forwards the service really ran."""

    tokens: int  # computed, padding included
    rows: int  # chunks that sample a token
    context: int  # sum of the chunks' cached tokens
    pairs: int  # sum of cached x new tokens over the chunks
    fresh: tuple[int, ...]  # token counts of the chunks with nothing cached (fresh prompts)
    decodes: int  # one-token chunks after cached tokens
    prompts: int  # every other chunk (a prompt chunk, fresh or continued)
    swap_blocks: int = 0

    @classmethod
    def of(cls, plan: BatchPlan) -> ForwardShape:
        # Plain ifs, not bool arithmetic: the simulator prices every forward through this
        tokens, rows, context, pairs, decodes = plan.num_padding_tokens, 0, 0, 0, 0
        fresh = []
        for chunk in plan.chunks:
            n = len(chunk.token_ids)
            tokens += n
            if chunk.sampling is not None:
                rows += 1
            cached = chunk.num_cached
            if cached:
                context += cached
                pairs += cached * n
                if n == 1:
                    decodes += 1
            else:
                fresh.append(n)
        return cls(tokens, rows, context, pairs, tuple(fresh), decodes,
                   len(plan.chunks) - decodes, len(plan.swap_out) + len(plan.swap_in))

    @classmethod
    def decode_step(cls, batch: int, context: int) -> ForwardShape:
        """One decode step of `batch` sequences holding `context` cached tokens in all."""
        return cls(batch, batch, context, context, (), batch, 0)

    @property
    def kind(self) -> str:
        """decode (one-token steps only), prefill (prompt chunks only) or mixed."""
        if not self.prompts:
            return "decode"
        return "mixed" if self.decodes else "prefill"


@dataclass
class ModelOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logits: dict = field(default_factory=dict)  # seq_id -> [vocab] float32, when asked for
    # seq_id -> float32 [hidden_size] (or [len(plan.hidden_layers), hidden_size]), when asked for
    hidden: dict = field(default_factory=dict)
    # seq_id -> TokenLogprobs of the sampled token (SamplingParams.logprobs)
    logprobs: dict = field(default_factory=dict)
    # seq_id -> [TokenLogprobs] of the chunk's prompt tokens that have a known next token
    prompt_logprobs: dict = field(default_factory=dict)
    forward_seconds: float = 0.0
