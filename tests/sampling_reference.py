"""The sampler's definition written plainly (float64, sorting), and a chi-square check, for the
sampler tests of both implementations (tests/unit/common, tests/integration)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from common.sampling_params import SamplingParams


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] float64: the distribution a sampled row draws from (filters as sampler.py says)."""
    x = logits.double() / params.temperature
    e = (x - x.max()).exp()
    cut = params.min_p
    if 0 < params.top_k < e.numel():
        cut = max(cut, float(e.sort(descending=True).values[params.top_k - 1]))
    e = torch.where(e >= cut, e, torch.zeros_like(e))
    if params.top_p < 1:
        values = e.sort(descending=True).values
        before = values.cumsum(0) - values
        kept = int((before < params.top_p * e.sum()).sum())
        e = torch.where(e >= values[max(kept, 1) - 1], e, torch.zeros_like(e))
    return e / e.sum()


def chi_square_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of the observed token counts under `probs` (tokens outside its support fail)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts[~support]}"
    expected = probs[support] * tokens.numel()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         statistic / 2.0))


# One row per filter, on a vocabulary of 12 whose probabilities sit away from every cut.
LOGITS = torch.tensor([2.0, 1.1, 0.3, -0.4, 1.6, -1.5, 0.9, -3.0, 0.0, -0.9, 2.4, -2.2])
FILTERS = {
    "temperature": SamplingParams(temperature=0.7),
    "hot": SamplingParams(temperature=1.9),
    "top_k": SamplingParams(temperature=1.0, top_k=4),
    "top_p": SamplingParams(temperature=0.8, top_p=0.8),
    "min_p": SamplingParams(temperature=1.0, min_p=0.2),
    "top_k_top_p": SamplingParams(temperature=1.2, top_k=6, top_p=0.7),
    "all": SamplingParams(temperature=0.9, top_k=7, top_p=0.9, min_p=0.05),
    "tiny_top_p": SamplingParams(temperature=1.0, top_p=1e-6),
}


rows_strategy = st.lists(st.tuples(
    st.one_of(st.none(), st.integers(0, 2**40)),  # seed
    st.sampled_from([0.0, 0.5, 1.0, 1.7]),  # temperature
    st.sampled_from([0, 1, 3, 50]),  # top_k
    st.sampled_from([1.0, 0.9, 0.3]),  # top_p
    st.sampled_from([0.0, 0.1]),  # min_p
    st.integers(0, 500),  # token index
), min_size=1, max_size=12)


def seeded_rows_match_alone(sampler_factory, batch, data_seed):
    """Every seeded row draws the same token in the batch as alone, whatever its neighbours,
    its position and the sampler's own seed."""
    gen = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(len(batch), 300, generator=gen) * 2
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=s)
              for s, t, k, p, m, _ in batch]
    indices = [i for *_, i in batch]
    together = sampler_factory(1)(logits, params, indices)
    for row, p in enumerate(params):
        if p.seed is None and not p.is_greedy:
            continue
        alone = sampler_factory(2)(logits[row:row + 1], [p], [indices[row]])
        assert alone[0] == together[row]
