"""Token sampling: greedy, temperature, top-k, top-p, and per-request seeds.

Random rows draw by the exponential race (argmax of p / q with q ~ Exp(1)), which samples exactly
from p. A seeded row draws its noise from a generator seeded with (seed, index of the token being
generated), so its text does not depend on batching, scheduling, or which instance samples it
(the prefill instance samples the first token, a decode instance the rest).
"""

from __future__ import annotations

import torch

from common.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


def token_seed(seed: int, token_index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + token_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64


def _filter_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    if bool((ks == vocab).all()):
        return logits
    kth = logits.topk(int(ks.max()), dim=-1).values.gather(-1, (ks - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _filter_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_ps):
        return logits
    ps = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    # Drop a token once the mass before it already reaches p; the top token always stays (a
    # tiny p may round to 0 in float32).
    drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= ps[:, None]
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 token_indices: list[int]) -> list[int]:
        """logits: [N, vocab] float32, one row per sampled sequence. Returns N token ids."""
        tokens = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            drawn = self._sample(logits[random_rows], [params[i] for i in random_rows],
                                 [token_indices[i] for i in random_rows])
            for row, token in zip(random_rows, drawn):
                tokens[row] = token
        return tokens

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                token_indices: list[int]) -> list[int]:
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temps[:, None]
        logits = _filter_top_k(logits, [p.top_k for p in params])
        logits = _filter_top_p(logits, [p.top_p for p in params])
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for row, (p, index) in enumerate(zip(params, token_indices)):
            generator = self.generator
            if p.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(
                    token_seed(p.seed, index))
            noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1).tolist()
