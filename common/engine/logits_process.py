"""Logits processing before sampling: min_tokens, logit_bias and the repetition, frequency and
presence penalties, batched over one step's sampled rows.

Applied in vLLM's order and with its semantics:

1. min_tokens: while fewer than `min_tokens` tokens have been generated, the EOS ids (unless
   `ignore_eos`) and `stop_token_ids` get -inf, so nothing can end the sequence early;
2. logit_bias: each (token, bias) adds `bias` to that token's logit;
3. repetition penalty over every token the sequence holds (prompt and output): a positive logit
   is divided by the penalty, a negative one multiplied (both push it down when penalty > 1);
4. frequency and presence penalties over the output tokens alone:
   `logit -= frequency * count + presence * (count > 0)`.

`process` takes the raw logits and returns what the sampler draws from: the same tensor when no
row asks for anything (the common path pays one pass over the chunks' parameters), else a
processed copy, so that the raw logits stay for log-probabilities and `return_logits`. Every
step builds its index tensors once and touches the logits with a few batched scatters and
gathers; rows that ask for nothing are never read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.plan import ScheduledChunk


def _stop_ids(chunk: ScheduledChunk) -> tuple[int, ...]:
    """The ids min_tokens masks for this chunk now; empty once enough tokens exist."""
    sampling = chunk.sampling
    if chunk.num_output_tokens >= sampling.min_tokens:
        return ()
    eos = () if sampling.ignore_eos else sampling.eos_token_ids
    return tuple(sampling.stop_token_ids) + tuple(eos)


def _is_penalized(chunk: ScheduledChunk) -> bool:
    return chunk.history is not None and chunk.sampling.needs_history


def process(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
    """logits: [R, vocab] float32, row i sampled with chunks[i].sampling. Returns the logits to
    sample from (`logits` itself when no row is processed)."""
    vocab = logits.shape[-1]
    masked: list[tuple[int, int]] = []  # (row, token) pairs set to -inf
    biased: list[tuple[int, int, float]] = []  # (row, token, bias)
    penalized: list[int] = []
    for row, chunk in enumerate(chunks):
        sampling = chunk.sampling
        if sampling.min_tokens:
            masked.extend((row, t) for t in _stop_ids(chunk) if 0 <= t < vocab)
        if sampling.logit_bias:
            # a dict, as the API's JSON map is: one bias per token, the last one given
            biased.extend((row, t, b) for t, b in dict(sampling.logit_bias).items()
                          if 0 <= t < vocab)
        if _is_penalized(chunk):
            penalized.append(row)
    if not (masked or biased or penalized):
        return logits
    out = logits.clone()
    as_long = lambda values: torch.tensor(values, dtype=torch.long, device=logits.device)
    if masked:
        rows, tokens = zip(*masked)
        out[as_long(rows), as_long(tokens)] = float("-inf")
    if biased:
        rows, tokens, bias = zip(*biased)
        out.index_put_((as_long(rows), as_long(tokens)),
                       torch.tensor(bias, dtype=out.dtype, device=out.device), accumulate=True)
    if penalized:
        apply_penalties(out, penalized, [chunks[row] for row in penalized])
    return out


def _token_counts(chunks: Sequence[ScheduledChunk], vocab: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, vocab] float32 counts of each row's output tokens, and [P, vocab] bool of the tokens
    its prompt holds (only for rows with a repetition penalty: the others never read it)."""
    prompt_ids: list[int] = []
    output_ids: list[int] = []
    prompt_lengths, output_lengths = [], []
    for chunk in chunks:
        # The tokens before the one sampled now (the shared history may not be longer, but the
        # chunk says exactly how many there are).
        seen = chunk.num_cached + chunk.num_tokens
        num_prompt = min(chunk.num_prompt_tokens, seen)
        prompt = chunk.history[:num_prompt] if chunk.sampling.repetition_penalty != 1.0 else []
        prompt_ids += prompt
        prompt_lengths.append(len(prompt))
        output_ids += chunk.history[num_prompt:seen]
        output_lengths.append(seen - num_prompt)
    rows = torch.arange(len(chunks), device=device)

    def scatter(ids: list[int], lengths: list[int], dtype: torch.dtype) -> torch.Tensor:
        table = torch.zeros(len(chunks), vocab, dtype=dtype, device=device)
        if ids:
            index = (rows.repeat_interleave(torch.tensor(lengths, device=device)),
                     torch.tensor(ids, dtype=torch.long, device=device))
            table.index_put_(index, torch.ones(len(ids), dtype=dtype, device=device),
                             accumulate=dtype != torch.bool)
        return table

    return (scatter(output_ids, output_lengths, torch.float32),
            scatter(prompt_ids, prompt_lengths, torch.bool))


def apply_penalties(logits: torch.Tensor, rows: list[int],
                    chunks: Sequence[ScheduledChunk]) -> None:
    """Repetition, frequency and presence penalties on `logits[rows]`, in place; chunks[i] (with
    its history) is the chunk of rows[i]."""
    device = logits.device
    counts, in_prompt = _token_counts(chunks, logits.shape[-1], device)
    params = torch.tensor([[c.sampling.repetition_penalty, c.sampling.frequency_penalty,
                            c.sampling.presence_penalty] for c in chunks],
                          dtype=torch.float32, device=device)
    repetition, frequency, presence = (params[:, i:i + 1] for i in range(3))
    index = torch.tensor(rows, dtype=torch.long, device=device)
    x = logits[index].float()
    in_output = counts > 0
    penalized = torch.where(x > 0, x / repetition, x * repetition)
    x = torch.where(in_prompt | in_output, penalized, x)
    x = x - frequency * counts - presence * in_output.float()
    logits[index] = x.to(logits.dtype)
