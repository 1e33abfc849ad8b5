"""Log-probabilities for the API's `logprobs` and `prompt_logprobs`, computed in the forward that
produces them (no second pass).

Both are of the model's raw distribution: log_softmax in float32 of the logits as the model
gives them, before logits processing (penalties, bias, min_tokens) and temperature, as vLLM
returns by default. Each position gives a `TokenLogprobs`: the chosen token's log-probability
and rank (1 + the tokens strictly likelier) and the k likeliest tokens.

- `of_sampled`: the token sampled for each row that asks (`SamplingParams.logprobs`);
- `of_prompts`: a prompt chunk asking (`ScheduledChunk.prompt_logprobs`) gets one entry per
  row whose next token is a prompt token (position j gives token j + 1's, j + 1 < prompt
  length), from the hidden states the forward already computed; the vocabulary projection runs
  `BLOCK_ROWS` rows at a time so a long chunk never holds [chunk, vocab] logits at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from common.plan import ScheduledChunk
from common.protocol import TokenLogprobs

BLOCK_ROWS = 256


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   counts: Sequence[int]) -> list[TokenLogprobs]:
    """logits [M, vocab], targets [M] int64 on the same device; row i keeps its counts[i]
    likeliest tokens. One transfer to the host per result tensor, whatever M."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    k = max(counts, default=0)
    top_values, top_ids = (logprobs.topk(k, dim=-1) if k else
                           (logprobs[:, :0], logprobs[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprobs(token, value, rank, ids[:n], values[:n])
            for token, value, rank, ids, values, n in zip(
                targets.tolist(), chosen[:, 0].tolist(), ranks, top_ids, top_values, counts)]


def of_sampled(logits: torch.Tensor, tokens: Sequence[int],
               chunks: Sequence[ScheduledChunk]) -> dict[str, TokenLogprobs]:
    """seq_id -> TokenLogprobs of the token sampled from raw `logits` row i (chunks[i]), for the
    rows whose sampling parameters ask; empty (and nothing computed) when none does."""
    rows = [i for i, c in enumerate(chunks) if c.sampling.logprobs is not None]
    if not rows:
        return {}
    device = logits.device
    index = torch.tensor(rows, dtype=torch.long, device=device)
    targets = torch.tensor([tokens[i] for i in rows], dtype=torch.long, device=device)
    found = token_logprobs(logits[index], targets,
                           [chunks[i].sampling.logprobs for i in rows])
    return {chunks[i].seq_id: entry for i, entry in zip(rows, found)}


def prompt_rows(start: int, chunk: ScheduledChunk) -> tuple[range, list[int]]:
    """The batch rows of a prompt chunk (starting at row `start`) whose next token is a prompt
    token, and those tokens. The last row's next token starts the following chunk, hence the
    sequence's `history`."""
    if chunk.history is None:
        raise ValueError(f"prompt_logprobs chunk of {chunk.seq_id} carries no history")
    first = chunk.num_cached
    end = min(first + chunk.num_tokens, chunk.num_prompt_tokens - 1)
    count = max(end - first, 0)
    return range(start, start + count), list(chunk.history[first + 1:first + 1 + count])


def of_prompts(hidden: torch.Tensor, prompt_chunks: Sequence[tuple[int, ScheduledChunk]],
               logits_of: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, list]:
    """seq_id -> [TokenLogprobs] of each (start row, chunk) pair's prompt positions, in order.
    `hidden` is the forward's final hidden states [T, hidden]; `logits_of` projects rows."""
    if not prompt_chunks:
        return {}
    rows: list[int] = []
    targets: list[int] = []
    counts: list[int] = []
    sizes: list[int] = []
    for start, chunk in prompt_chunks:
        chunk_rows, chunk_targets = prompt_rows(start, chunk)
        rows += chunk_rows
        targets += chunk_targets
        counts += [chunk.prompt_logprobs] * len(chunk_rows)
        sizes.append(len(chunk_rows))
    device = hidden.device
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    targets_t = torch.tensor(targets, dtype=torch.long, device=device)
    found: list[TokenLogprobs] = []
    for block in range(0, len(rows), BLOCK_ROWS):
        part = slice(block, block + BLOCK_ROWS)
        found += token_logprobs(logits_of(hidden[rows_t[part]]), targets_t[part], counts[part])
    result, offset = {}, 0
    for (_, chunk), size in zip(prompt_chunks, sizes):
        result[chunk.seq_id] = found[offset:offset + size]
        offset += size
    return result
