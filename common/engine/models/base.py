"""The contract every model family implements, and the registry that maps HF architectures to it.

A model takes a flat batch of tokens from many sequences (prefill chunks and decode tokens
together) with their positions, and an `AttentionContext` that owns the paged KV cache for this
forward. It returns hidden states for every token; logits are computed only for the rows the
caller selects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn

from common.engine.ops import TorchOps
from common.registry import Registry


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache and the runner need to know about a model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int

    def flops_per_token(self, num_params_matmul: int, context_tokens: int = 0) -> float:
        """Forward FLOPs for one token: 2 per matmul weight plus attention over `context_tokens`."""
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * context_tokens
        return 2.0 * num_params_matmul + attention


@dataclass(frozen=True)
class LayerAttention:
    """What one layer asks of the attention beyond causal softmax(q k^T / sqrt(head_dim)) v.

    Attention modules keep theirs as `attention_spec` and pass it as keyword arguments on every
    call (`kwargs`); `CausalLM.fit_context` and the runner read them to pick a backend that
    computes them (see `common.engine.attention`).
    """

    scale: float | None = None  # None: 1 / sqrt(head_dim)
    window: int | None = None  # a query at position p sees keys at p - window < position <= p
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap)

    def kwargs(self) -> dict:
        """The keywords of an attention call; the features only when set, so a backend that
        lacks them is only ever asked for what it computes."""
        extra = {"window": self.window, "softcap": self.softcap}
        return {"scale": self.scale, **{k: v for k, v in extra.items() if v is not None}}

    def features(self) -> set[str]:
        return {name for name, value in (("window", self.window), ("softcap", self.softcap))
                if value is not None}


class LayerTaps:
    """Hidden states of some rows after some layers, collected during a forward.

    Layers are numbered like Hugging Face's `hidden_states`: 0 is the embedding output and k the
    residual stream after k decoder layers. The final normed state (the model's output, index
    `num_layers` in HF) is what the forward returns, so the runner reads it there.
    """

    def __init__(self, layers: Iterable[int], rows: list[int]) -> None:
        self.layers = frozenset(layers)
        self.rows = rows
        self.states: dict[int, torch.Tensor] = {}

    def record(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None = None) -> None:
        """`x (+ residual)` at the rows, when `layer` is wanted; a copy, so later in-place
        updates of the stream do not reach it."""
        if layer in self.layers:
            state = x[self.rows]
            self.states[layer] = state if residual is None else state + residual[self.rows]


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over a paged KV cache.

    `ops` holds the elementwise primitives (common.engine.ops); the runner swaps in the fused
    kernels where they apply.
    """

    shape: ModelShape
    ops = TorchOps()

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: AttentionContext,  # noqa: F821
                taps: LayerTaps | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64. Returns the final hidden states [T, hidden_size];
        `taps` collects intermediate ones (the length predictor's probe reads them)."""

    @abstractmethod
    def output_weight(self) -> torch.Tensor:
        """The [vocab_size, hidden_size] matrix that maps hidden states to logits."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab_size] in float32."""
        packed = getattr(self, "packed_logits", None)
        if packed is not None:
            return packed.forward_float32(hidden)
        return torch.nn.functional.linear(hidden, self.output_weight()).float()

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a Hugging Face checkpoint's tensors (HF names) into the parameters."""

    def num_matmul_params(self) -> int:
        """Weights of the per-token matmuls (not the embedding lookup, not the logits)."""
        skip = {id(getattr(self, "lm_head", None)), id(getattr(self, "packed_logits", None))}
        return sum(m.in_features * m.out_features for m in self.modules()
                   if hasattr(m, "in_features") and hasattr(m, "out_features")
                   and id(m) not in skip)

    def attention_specs(self) -> list[nn.Module]:
        """The modules that hold a `LayerAttention` (one per layer that attends)."""
        return [m for m in self.modules() if isinstance(getattr(m, "attention_spec", None),
                                                         LayerAttention)]

    def fit_context(self, max_context: int) -> frozenset[str]:
        """Drop the sliding windows no sequence of up to `max_context` tokens reaches past (they
        change nothing), and return the attention features some layer still needs."""
        needed: set[str] = set()
        for module in self.attention_specs():
            spec = module.attention_spec
            if spec.window is not None and spec.window >= max_context:
                module.attention_spec = spec = replace(spec, window=None)
            needed |= spec.features()
        return frozenset(needed)

    def pack_for_cpu(self, skinny=None) -> None:
        """Reorder every matmul weight (and the logits matrix) for oneDNN, and for the skinny
        kernel when given; see PackedLinear."""
        from common.engine.models.layers import PackedLinear, pack_linears

        pack_linears(self, skip=("lm_head",), skinny=skinny)  # the logits matrix: below
        self.packed_logits = PackedLinear(self.output_weight(), None, skinny)


MODEL_REGISTRY: Registry[type[CausalLM]] = Registry("model architecture")
