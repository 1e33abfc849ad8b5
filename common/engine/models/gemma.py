"""Gemma 2 and Gemma 3 (text-only checkpoints) over a paged KV cache.

What differs from the Llama family (llama.py, whose attention and gated MLP these reuse):
- embeddings times sqrt(hidden_size), that factor first rounded to the weights' dtype as the
  checkpoints were trained with;
- RMSNorm scales by (1 + weight), in float32 before the cast back, and each layer has four:
  before and after attention, before and after the MLP (no fused add + norm: the residual adds
  the post-norm's output);
- a GELU (tanh) gated MLP; attention scaled by query_pre_attn_scalar^-0.5;
- a sliding window on the layers the config marks (`layer_types`, else the family's pattern:
  Gemma 2 every other layer from the first, Gemma 3 five in six);
- Gemma 2: attention-logit and final-logit soft-capping (tanh), also honoured for Gemma 3
  where a config sets them;
- Gemma 3: each head's queries and keys normalized (Gemma RMSNorm) before the rotation; sliding
  layers rotate with their own base (`rope_local_base_freq`), global ones with the rope scaling.

Windows and soft-caps are computed by torch attention only (common.engine.attention_masked).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from common.engine.models.base import MODEL_REGISTRY, CausalLM, LayerAttention, ModelShape
from common.engine.models.llama import (
    LlamaAttention,
    LlamaMLP,
    fused_projections,
    llama_shape,
    load_checkpoint,
)
from common.engine.models.rope import RotaryEmbedding, rope_config
from common.errors import ModelLoadError


class GemmaRMSNorm(nn.Module):
    """RMSNorm whose checkpoint weight is an offset from 1; the product is taken in float32
    and cast once (Llama's RMSNorm casts before the multiply)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, cfg: dict, spec: LayerAttention, qk_norm) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        bias = cfg.get("attention_bias", False)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        self.self_attn = LlamaAttention(shape, bias, bias, spec, qk_norm, eps)
        self.mlp = LlamaMLP(shape.hidden_size, cfg["intermediate_size"], act, False)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(shape.hidden_size, eps))

    def forward(self, x, positions, rope, ops, attention, layer_idx):
        h = self.self_attn(self.input_layernorm(x), positions, rope, ops, attention, layer_idx)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), ops)
        return x + self.post_feedforward_layernorm(h)


def sliding_layers(cfg: dict, default_pattern: int) -> list[bool]:
    """Which layers attend within the sliding window: `layer_types` where the config lists
    them, else every `pattern`-th layer is global (1-based), the others sliding."""
    if cfg.get("layer_types"):
        return [kind == "sliding_attention" for kind in cfg["layer_types"]]
    pattern = (cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
               or default_pattern)
    return [(i + 1) % pattern != 0 for i in range(cfg["num_hidden_layers"])]


class GemmaForCausalLM(CausalLM):
    """What Gemma 2 and 3 share; the subclasses say which layers slide and how they rotate."""

    qk_norm = None
    default_pattern = 2

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        if cfg.get("use_bidirectional_attention"):
            raise ModelLoadError("bidirectional Gemma (an embedding model) is not a causal LM")
        self.shape = shape = llama_shape(cfg)
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.embed_scale = shape.hidden_size ** 0.5
        self.sliding = sliding_layers(cfg, self.default_pattern)
        scale = cfg.get("query_pre_attn_scalar", shape.head_dim) ** -0.5
        softcap = cfg.get("attn_logit_softcapping")
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(shape, cfg, LayerAttention(
                scale, cfg.get("sliding_window") if sliding else None, softcap), self.qk_norm)
            for sliding in self.sliding)
        self.norm = GemmaRMSNorm(shape.hidden_size, cfg.get("rms_norm_eps", 1e-6))
        self.final_softcap = cfg.get("final_logit_softcapping")
        self.tie_word_embeddings = cfg.get("tie_word_embeddings", True)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.rope, self.local_rope = self.build_ropes(cfg)

    def build_ropes(self, cfg: dict) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
        """(the global layers' rotary embedding, the sliding layers' one or None: the same)."""
        theta, scaling = rope_config(cfg)
        return self._rope(theta, scaling), None

    def _rope(self, theta: float, scaling: dict | None) -> RotaryEmbedding:
        return RotaryEmbedding(self.shape.head_dim, self.shape.max_position_embeddings, theta,
                               scaling)

    def forward(self, input_ids, positions, attention, taps=None):
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype)
        if taps is not None:
            taps.record(0, x)
        for i, (layer, sliding) in enumerate(zip(self.layers, self.sliding)):
            rope = self.local_rope if sliding and self.local_rope is not None else self.rope
            x = layer(x, positions, rope, self.ops, attention, i)
            if taps is not None:
                taps.record(i + 1, x)
        return self.norm(x)

    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights,
                        *fused_projections(self.shape, self.layers[0].mlp.intermediate))


@MODEL_REGISTRY.register("Gemma2ForCausalLM")
class Gemma2ForCausalLM(GemmaForCausalLM):
    pass


@MODEL_REGISTRY.register("Gemma3ForCausalLM")
class Gemma3ForCausalLM(GemmaForCausalLM):
    qk_norm = GemmaRMSNorm
    default_pattern = 6

    def build_ropes(self, cfg: dict) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
        # transformers 5 nests the two settings by layer type; older configs keep the global
        # ones in rope_theta / rope_scaling and the local base in rope_local_base_freq.
        params = cfg.get("rope_parameters") or {}
        nested = "full_attention" in params or "sliding_attention" in params
        global_theta, scaling = rope_config(cfg, params.get("full_attention") or {}, 1e6,
                                            legacy_scaling=not nested)
        local_theta, local_scaling = rope_config(
            cfg, params.get("sliding_attention") or {}, 1e4,
            legacy_theta="rope_local_base_freq", legacy_scaling=False)
        return self._rope(global_theta, scaling), self._rope(local_theta, local_scaling)
