"""Token sampling: greedy, temperature, top-k, top-p, min-p and per-request seeds, in one
batched pass per step.

A sampled row keeps the tokens that pass its filters (min-p and top-k as thresholds on the
temperature-scaled probabilities, then top-p over the survivors; tokens tied at a cut all stay)
and draws among them by inverse CDF in vocabulary order (the first kept token whose running
mass exceeds u times the kept mass): exact for u uniform in [0, 1), with one random number per
draw instead of noise over the whole vocabulary. Each row carries a 64-bit key and its uniforms
are a hash of (key, draw number):

- unseeded rows take their keys from the sampler's generator, one call for all of them;
- a seeded row's key is a function of (seed, index of the token being generated) alone, so its
  text does not depend on batching, scheduling, or which instance samples it (the prefill
  instance samples the first token, a decode instance the rest).

Two implementations: the C++ kernel on CPU (`csrc/sampling.h`: greedy rows too, one call a
step; top-p by rejection against a rising pivot, no sort of the vocabulary) and batched torch
ops elsewhere (CUDA, or a CPU where the kernels did not build: top-p by its sorted cut, looking
at the top 256 tokens first). Both sample the same distribution exactly; for the same key they
may pick different tokens when a top-p row's first proposal is rejected by the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# Top-p in torch first looks for its cut among this many top tokens, sorting the whole row
# only where they hold too little mass (flat distributions).
_TOP_P_FIRST_LOOK = 256


def token_seed(seed: int, token_index: int) -> int:
    """The key of a seeded row: a function of (seed, token index) alone."""
    return (seed * _GOLDEN + token_index * 0xBF58476D1CE4E5B9 + 1) & _MASK63


def uniform(key: int, draw: int = 0) -> float:
    """The uniform in [0, 1) of draw `draw` of a row with this key: splitmix64's finalizer, top
    53 bits (what csrc/sampling.h computes)."""
    z = (key + draw * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


@dataclass
class RowParams:
    """The rows of one step as tensors, what both implementations take."""

    rows: torch.Tensor  # int64 [R]: rows of the logits matrix
    inv_temp: torch.Tensor  # float32 [R]; 0 = greedy
    top_k: torch.Tensor  # int64 [R], 0 = off
    top_p: torch.Tensor  # float32 [R], 1 = off
    min_p: torch.Tensor  # float32 [R], 0 = off
    keys: torch.Tensor  # int64 [R]: the bit patterns of 64-bit keys

    @classmethod
    def build(cls, rows: list[int], params: list[SamplingParams], token_indices: list[int],
              generator: torch.Generator) -> RowParams:
        """Two tensor constructions for the whole step (one per dtype), split into rows."""
        count = len(params)
        ints = torch.tensor(rows + [p.top_k for p in params]
                            + [token_seed(p.seed, i) if p.seed is not None else 0
                               for p, i in zip(params, token_indices)], dtype=torch.long)
        floats = torch.tensor([0.0 if p.is_greedy else 1.0 / p.temperature for p in params]
                              + [p.top_p for p in params] + [p.min_p for p in params],
                              dtype=torch.float32)
        rows_t, top_k, keys = ints.split(count)
        unseeded = [j for j, p in enumerate(params) if p.seed is None and not p.is_greedy]
        if unseeded:
            keys[unseeded] = torch.randint(-2**63, 2**63 - 1, (len(unseeded),),
                                           dtype=torch.long, generator=generator)
        inv_temp, top_p, min_p = floats.split(count)
        return cls(rows_t, inv_temp, top_k, top_p, min_p, keys)

    def uniforms(self) -> torch.Tensor:
        """float64 [R]: each row's first uniform."""
        return torch.tensor([uniform(k & _MASK64) for k in self.keys.tolist()],
                            dtype=torch.float64)

    def to(self, device: torch.device) -> RowParams:
        return RowParams(*(t.to(device) for t in (self.rows, self.inv_temp, self.top_k,
                                                  self.top_p, self.min_p, self.keys)))


def sample_torch(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """The batched torch implementation for sampled rows (inv_temp > 0): int64 [R] token ids."""
    u = rows.uniforms().to(logits.device)
    rows = rows.to(logits.device)
    x = logits[rows.rows].float() * rows.inv_temp[:, None]
    e = (x - x.max(dim=-1, keepdim=True).values).exp()  # -inf logits give 0
    cut = rows.min_p[:, None].clone()
    vocab = e.shape[-1]
    top_k = torch.where((rows.top_k > 0) & (rows.top_k < vocab), rows.top_k, 0)
    if bool((top_k > 0).any()):
        kth = e.topk(int(top_k.max()), dim=-1).values.gather(-1, (top_k - 1).clamp(min=0)[:, None])
        cut = torch.where(top_k[:, None] > 0, torch.maximum(cut, kth), cut)
    e = e.masked_fill(e < cut, 0.0)
    if bool((rows.top_p < 1).any()):
        e = e.masked_fill(e < _top_p_cut(e, rows.top_p), 0.0)
    cdf = e.double().cumsum(dim=-1)
    goal = u[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, goal, right=True).squeeze(1).clamp(max=vocab - 1)


def _top_p_cut(e: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, 1]: the value at which each row's top-p set ends (0 for rows without top-p)."""
    target = (top_p.double() * e.double().sum(dim=-1))[:, None]
    look = min(_TOP_P_FIRST_LOOK, e.shape[-1])
    values = e.topk(look, dim=-1).values
    cum = values.double().cumsum(dim=-1)
    if look < e.shape[-1] and not bool((cum[:, -1:] >= target).all()):
        values = e.sort(dim=-1, descending=True).values
        cum = values.double().cumsum(dim=-1)
    # Kept: the tokens whose mass before them is still below the target.
    count = ((cum - values.double()) < target).sum(dim=-1, keepdim=True).clamp(min=1)
    cut = values.gather(-1, count - 1)
    return torch.where(top_p[:, None] < 1, cut, torch.zeros_like(cut))


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, kernels=None) -> None:
        """`kernels`: the CPU kernels module (common.engine.cpu_kernels), used on CPU."""
        self.device = device
        # Keys for unseeded rows are drawn on the CPU whatever the device: one small tensor.
        self.generator = torch.Generator().manual_seed(seed)
        self.kernels = kernels if device.type == "cpu" else None

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 token_indices: list[int]) -> list[int]:
        """logits: [N, vocab] float32, one row per sequence. Returns N token ids."""
        if self._kernel_takes(logits):
            rows = RowParams.build(list(range(len(params))), params, token_indices,
                                   self.generator)
            return self.kernels.sample_rows(logits, rows.rows, rows.inv_temp, rows.top_k,
                                            rows.top_p, rows.min_p, rows.keys).tolist()
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        tokens = logits.argmax(dim=-1).tolist() if len(sampled) < len(params) else \
            [0] * len(params)
        if sampled:
            rows = RowParams.build(sampled, [params[i] for i in sampled],
                                   [token_indices[i] for i in sampled], self.generator)
            for row, token in zip(sampled, sample_torch(logits, rows).tolist()):
                tokens[row] = token
        return tokens

    def _kernel_takes(self, logits: torch.Tensor) -> bool:
        return (self.kernels is not None and logits.dtype == torch.float32
                and logits.dim() == 2 and logits.stride(-1) == 1)
