"""The contract every model family implements, and the registry that maps HF architectures to it.

A model takes a flat batch of tokens from many sequences (prefill chunks and decode tokens
together) with their positions, and an `AttentionContext` that owns the paged KV cache for this
forward. It returns hidden states for every token; logits are computed only for the rows the
caller selects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

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


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over a paged KV cache."""

    shape: ModelShape

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: "AttentionContext") -> torch.Tensor:  # noqa: F821
        """input_ids, positions: [T] int64. Returns hidden states [T, hidden_size]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab_size] in float32."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a Hugging Face checkpoint's tensors (HF names) into the parameters."""

    def num_matmul_params(self) -> int:
        """Weights used by per-token matmuls (excludes embeddings looked up, not multiplied)."""
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear)
                   and m is not getattr(self, "lm_head", None))


MODEL_REGISTRY: Registry[type[CausalLM]] = Registry("model architecture")
