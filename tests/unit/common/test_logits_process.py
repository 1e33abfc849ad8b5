"""Logits processing (common.engine.logits_process) against a plain per-row reference: each
control alone and all together, rows that ask for nothing mixed in (and left untouched), the
min_tokens mask with and without ignore_eos; and the log-probability helpers
(common.engine.logprobs) against log_softmax."""

from __future__ import annotations

import math

import pytest
import torch

from common.engine import logits_process, logprobs
from common.plan import ScheduledChunk
from common.sampling_params import SamplingParams

VOCAB = 50
EOS = (2, 7)


def chunk(sampling: SamplingParams, history: list[int], num_prompt: int,
          seq_id: str = "s") -> ScheduledChunk:
    """A decode chunk sampling after `history` (prompt first), as a scheduler makes it."""
    return ScheduledChunk(seq_id, history[-1:], len(history) - 1, [0], sampling,
                          len(history) - num_prompt,
                          history if sampling.needs_history else None, num_prompt)


def reference(row: torch.Tensor, c: ScheduledChunk) -> torch.Tensor:
    """One row, token by token, the order vLLM documents."""
    s = c.sampling
    out = row.clone().tolist()
    history = list(c.history or [])
    prompt, output = history[:c.num_prompt_tokens], history[c.num_prompt_tokens:]
    if c.num_output_tokens < s.min_tokens:
        for token in set(s.stop_token_ids) | (set() if s.ignore_eos else set(s.eos_token_ids)):
            out[token] = -math.inf
    for token, bias in s.logit_bias:
        out[token] += bias
    for token in set(prompt) | set(output):
        p = s.repetition_penalty
        out[token] = out[token] / p if out[token] > 0 else out[token] * p
    for token in set(output):
        out[token] -= s.frequency_penalty * output.count(token) + s.presence_penalty
    return torch.tensor(out)


def history(seed: int, length: int) -> list[int]:
    # few distinct tokens, so that repeats (counts > 1) are common
    return torch.randint(0, 12, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


CASES = {
    "plain": SamplingParams(),
    "repetition": SamplingParams(repetition_penalty=1.7),
    "repetition_below_one": SamplingParams(repetition_penalty=0.6),
    "frequency": SamplingParams(frequency_penalty=0.9),
    "presence": SamplingParams(presence_penalty=-1.3),
    "bias": SamplingParams(logit_bias=((3, 5.0), (40, -2.5))),
    "min_tokens": SamplingParams(min_tokens=10, eos_token_ids=EOS, stop_token_ids=(11,)),
    "min_tokens_ignore_eos": SamplingParams(min_tokens=10, eos_token_ids=EOS,
                                            stop_token_ids=(11,), ignore_eos=True),
    "min_tokens_reached": SamplingParams(min_tokens=2, eos_token_ids=EOS),
    "all": SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4,
                          logit_bias=((5, 1.5),), min_tokens=10, eos_token_ids=EOS),
}


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_control_matches_the_reference_among_untouched_rows(name):
    plain = SamplingParams()
    chunks = [chunk(plain, history(0, 9), 4, "a"),
              chunk(CASES[name], history(1, 20), 8, "b"),
              chunk(plain, history(2, 5), 5, "c"),
              chunk(CASES[name], history(3, 7), 6, "d")]
    logits = random_logits(len(chunks))
    raw = logits.clone()
    out = logits_process.process(logits, chunks)
    torch.testing.assert_close(logits, raw)  # the raw logits stay for log-probabilities
    for i, c in enumerate(chunks):
        torch.testing.assert_close(out[i], reference(raw[i], c))
    if name == "plain":
        assert out is logits  # nothing to do costs nothing
    else:
        assert not torch.equal(out, raw)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    params = SamplingParams(min_tokens=3, eos_token_ids=EOS, stop_token_ids=(11,))
    for generated, masked in ((0, True), (2, True), (3, False)):
        c = chunk(params, list(range(4 + generated)), 4)
        out = logits_process.process(random_logits(1), [c])
        assert all(out[0, t].item() == -math.inf for t in (2, 7, 11)) is masked
        assert torch.isfinite(out[0, [0, 1, 3]]).all()
    ignoring = SamplingParams(min_tokens=3, eos_token_ids=EOS, stop_token_ids=(11,),
                              ignore_eos=True)
    out = logits_process.process(random_logits(1), [chunk(ignoring, [1, 2], 2)])
    assert out[0, 11].item() == -math.inf and torch.isfinite(out[0, list(EOS)]).all()


def test_penalties_read_only_the_tokens_before_the_sampled_one():
    """A history list longer than the chunk (shared with a sequence) is cut at the chunk."""
    params = SamplingParams(frequency_penalty=1.0)
    tokens = [1, 2, 3, 4, 4]
    short = ScheduledChunk("s", [4], 3, [0], params, 1, tokens, 3)  # 4 tokens seen, one output
    logits = torch.zeros(1, VOCAB)
    out = logits_process.process(logits, [short])
    assert out[0, 4].item() == -1.0 and out[0, :4].abs().sum().item() == 0


def test_prompt_chunk_penalizes_the_prompt_alone():
    """The sampling chunk at the end of a prompt: no output yet, repetition over the prompt."""
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    prompt = [5, 6, 6]
    c = ScheduledChunk("s", prompt, 0, [0], params, 0, prompt, 3)
    logits = torch.full((1, VOCAB), 4.0)
    out = logits_process.process(logits, [c])
    assert out[0, 5].item() == 2.0 and out[0, 6].item() == 2.0 and out[0, 7].item() == 4.0


def test_token_logprobs_match_log_softmax():
    logits = random_logits(3, seed=5)
    targets = torch.tensor([4, 0, 49])
    found = logprobs.token_logprobs(logits, targets, [3, 0, 5])
    expected = torch.log_softmax(logits, dim=-1)
    for row, (entry, k) in enumerate(zip(found, [3, 0, 5])):
        token = targets[row].item()
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(expected[row, token].item(), abs=1e-6)
        assert entry.rank == 1 + int((expected[row] > expected[row, token]).sum())
        top = expected[row].topk(k) if k else None
        assert entry.top_ids == (top.indices.tolist() if k else [])
        assert entry.top_logprobs == pytest.approx(top.values.tolist() if k else [], abs=1e-6)


def test_of_sampled_skips_rows_not_asking():
    logits = random_logits(3, seed=6)
    chunks = [chunk(SamplingParams(logprobs=2), [1, 2], 2, "a"),
              chunk(SamplingParams(), [1, 2], 2, "b"),
              chunk(SamplingParams(logprobs=0), [1, 2], 2, "c")]
    found = logprobs.of_sampled(logits, [10, 11, 12], chunks)
    assert set(found) == {"a", "c"}
    assert found["a"].token_id == 10 and len(found["a"].top_ids) == 2
    assert found["c"].token_id == 12 and found["c"].top_ids == []
    assert logprobs.of_sampled(logits, [1, 2, 3], chunks[1:2]) == {}


def test_of_prompts_takes_next_tokens_across_chunks_and_blocks(monkeypatch):
    """Rows predicting prompt tokens only (not the last prompt position), the next token of a
    chunk's last row read from the history, results split back per chunk whatever the block."""
    monkeypatch.setattr(logprobs, "BLOCK_ROWS", 3)
    weight = torch.randn(VOCAB, 8, generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(12, 8, generator=torch.Generator().manual_seed(2))
    prompt = list(range(20, 30))  # 10 prompt tokens
    first = ScheduledChunk("a", prompt[:6], 0, [0], None, 0, prompt, 10, prompt_logprobs=1)
    last = ScheduledChunk("b", prompt[6:], 6, [0], SamplingParams(), 0, prompt, 10,
                          prompt_logprobs=2)
    found = logprobs.of_prompts(hidden, [(0, first), (6, last)], lambda h: h @ weight.T)
    assert [e.token_id for e in found["a"]] == prompt[1:7]
    assert [e.token_id for e in found["b"]] == prompt[7:10]  # positions 6..8; 9 is sampled
    expected = torch.log_softmax(hidden @ weight.T, dim=-1)
    for row, entry in enumerate(found["a"] + found["b"]):
        assert entry.logprob == pytest.approx(expected[row, entry.token_id].item(), abs=1e-5)
        k = 1 if row < 6 else 2
        assert entry.top_ids == expected[row].topk(k).indices.tolist()
