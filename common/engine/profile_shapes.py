"""The profile rows only the simulator's cost model reads (simulator/fit.py): forwards of shapes
the prefill and decode curves cannot price.

- Decode steps at other contexts than `decode_context`: with every decode row at one context,
  reading a sequence's KV and the rest of its decode step are one coefficient to the fit, so a
  decode at 2,000 tokens of context is priced as at 256.
- Several fresh prompts in one forward (what a co-located vllm or orca instance admits together):
  k prompts of n tokens compute the matmuls of one prompt of k x n tokens but k small attention
  triangles instead of one large one, and carry k sequences' bookkeeping; the prefill curve
  alone prices them as one prompt.

Each shape is skipped where it does not fit the profile's limits (largest decode batch, largest
prompt, the model's context length).
"""

from __future__ import annotations

# (batch, context): short, long and longer contexts than the decode curve's 256.
DECODE_CONTEXT_ROWS = ((1, 64), (8, 64), (32, 64), (1, 1024), (8, 1024), (32, 1024),
                       (1, 2048), (8, 2048))
# (prompts, tokens each): a few short prompts and fewer longer ones, at most 1,024 tokens.
MULTI_PROMPT_ROWS = ((2, 16), (4, 16), (8, 16), (2, 64), (4, 64), (8, 64), (2, 256), (4, 256))


def context_rows(max_batch: int, max_len: int) -> list[tuple[int, int]]:
    return [(b, c) for b, c in DECODE_CONTEXT_ROWS if b <= max_batch and c < max_len]


def multi_rows(max_prompt_tokens: int) -> list[tuple[int, int]]:
    return [(k, n) for k, n in MULTI_PROMPT_ROWS if k * n <= max_prompt_tokens]


def pool_tokens(max_batch: int, max_len: int, max_prompt_tokens: int, block_size: int) -> int:
    """KV blocks the rows need at once (one shape at a time), in tokens."""
    blocks = lambda n: -(-n // block_size)
    decode = [b * blocks(c + 1) for b, c in context_rows(max_batch, max_len)]
    multi = [k * blocks(n) for k, n in multi_rows(max_prompt_tokens)]
    return max([0, *decode, *multi]) * block_size


def profile_contexts(bench, max_batch: int, max_len: int, repeats: int, progress) -> list[dict]:
    """Greedy decode steps at the contexts of DECODE_CONTEXT_ROWS."""
    rows = []
    for batch, context in context_rows(max_batch, max_len):
        seconds, _ = bench.decode_seconds(batch, context, repeats)
        rows.append({"batch": batch, "context": context, "step_seconds": seconds})
        progress(f"decode batch {batch:3d} at context {context:5d}: {seconds * 1e3:.1f} ms/step")
    return rows


def profile_multi_prompt(bench, max_prompt_tokens: int, repeats: int, progress) -> list[dict]:
    """Forwards of k fresh prompts of n tokens each, every prompt sampling its first token."""
    rows = []
    for k, n in multi_rows(max_prompt_tokens):
        seconds = bench.multi_prompt_seconds(k, n, repeats)
        rows.append({"prompts": k, "tokens": n, "seconds": seconds})
        progress(f"{k} prompts of {n:4d} tokens in one forward: {seconds * 1e3:.1f} ms")
    return rows
