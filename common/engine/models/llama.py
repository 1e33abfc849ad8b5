"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3) over a paged KV cache.

The query/key/value projections are fused into one matmul, and gate/up into another, so a forward
runs four large matmuls per layer instead of seven; the checkpoint's separate tensors are loaded
into row ranges of the fused weights (Phi-3 checkpoints store them fused already).

Family differences: Qwen2 has q/k/v biases; Qwen3 normalizes each head's queries and keys
(RMSNorm over head_dim) before the rotation; Mistral, Phi-3 and Qwen2/3 (`use_sliding_window`)
may attend within a sliding window (`layer_windows`); Phi-3 may rotate part of each head and use
longrope (`common.engine.models.rope`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from common.engine.models.base import MODEL_REGISTRY, CausalLM, LayerAttention, ModelShape
from common.engine.models.layers import RMSNorm, WeightLoader, activation
from common.engine.models.rope import RotaryEmbedding, partial_rotary_factor, rope_config


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, rotary, paged attention, output projection. `qk_norm` (a norm
    class taking (head_dim, eps), or None) normalizes each head's queries and keys first."""

    def __init__(self, shape: ModelShape, qkv_bias: bool, o_bias: bool,
                 spec: LayerAttention | None = None, qk_norm=None, eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = shape.num_heads, shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(shape.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=o_bias)
        self.q_norm = qk_norm(self.head_dim, eps) if qk_norm is not None else None
        self.k_norm = qk_norm(self.head_dim, eps) if qk_norm is not None else None
        self.attention_spec = spec or LayerAttention()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ops,
                attention, layer_idx: int) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)  # [T, H + 2 KVH, D]
        heads = self.num_heads + self.num_kv_heads
        if self.q_norm is None:
            # Rotate queries and keys in one call: they are adjacent heads of the fused output.
            qk = ops.rotary(qkv[:, :heads], positions, rope)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = ops.rotary(self.q_norm(qkv[:, : self.num_heads]), positions, rope)
            k = ops.rotary(self.k_norm(qkv[:, self.num_heads:heads]), positions, rope)
        out = attention(layer_idx, q, k, qkv[:, heads:], **self.attention_spec.kwargs())
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is torch.nn.functional.silu:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, cfg: dict, qkv_bias: bool, o_bias: bool,
                 spec: LayerAttention, qk_norm=None) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(shape.hidden_size, eps)
        self.self_attn = LlamaAttention(shape, qkv_bias, o_bias, spec, qk_norm, eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps)
        self.mlp = LlamaMLP(shape.hidden_size, cfg["intermediate_size"],
                            cfg.get("hidden_act", "silu"), cfg.get("mlp_bias", False))

    def forward(self, x, residual, positions, rope, ops, attention, layer_idx):
        """Returns (this layer's output, residual stream before it); their sum is the hidden
        state, added by the next norm (fused add + norm)."""
        h, residual = ops.add_rms_norm(x, residual, self.input_layernorm)
        h = self.self_attn(h, positions, rope, ops, attention, layer_idx)
        h, residual = ops.add_rms_norm(h, residual, self.post_attention_layernorm)
        return self.mlp(h, ops), residual


def llama_shape(cfg: dict) -> ModelShape:
    num_heads = cfg["num_attention_heads"]
    return ModelShape(
        num_layers=cfg["num_hidden_layers"], num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048))


def fused_projections(shape: ModelShape, intermediate: int) -> tuple[dict, dict]:
    """How separate checkpoint projections load into the fused ones, for WeightLoader:
    (checkpoint suffix -> (our parameter suffix, shard)), (our suffix -> shard sizes)."""
    q_size = shape.num_heads * shape.head_dim
    kv_size = shape.num_kv_heads * shape.head_dim
    fused = {"q_proj.weight": ("qkv_proj.weight", 0), "k_proj.weight": ("qkv_proj.weight", 1),
             "v_proj.weight": ("qkv_proj.weight", 2), "q_proj.bias": ("qkv_proj.bias", 0),
             "k_proj.bias": ("qkv_proj.bias", 1), "v_proj.bias": ("qkv_proj.bias", 2),
             "gate_proj.weight": ("gate_up_proj.weight", 0),
             "up_proj.weight": ("gate_up_proj.weight", 1),
             "gate_proj.bias": ("gate_up_proj.bias", 0),
             "up_proj.bias": ("gate_up_proj.bias", 1)}
    sizes = {"qkv_proj.weight": [q_size, kv_size, kv_size],
             "qkv_proj.bias": [q_size, kv_size, kv_size],
             "gate_up_proj.weight": [intermediate, intermediate],
             "gate_up_proj.bias": [intermediate, intermediate]}
    return fused, sizes


def layer_windows(cfg: dict) -> list[int | None]:
    """Each layer's sliding window, where transformers applies one: the layers `layer_types`
    marks sliding; else every layer of Mistral and Phi-3, and Qwen2/3's layers from
    `max_window_layers` on when `use_sliding_window`."""
    num_layers, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    model_type = cfg.get("model_type")
    is_qwen = model_type in ("qwen2", "qwen3")
    if not window or (is_qwen and not cfg.get("use_sliding_window", False)):
        return [None] * num_layers
    if cfg.get("layer_types"):
        return [window if kind == "sliding_attention" else None for kind in cfg["layer_types"]]
    if is_qwen:
        first = cfg.get("max_window_layers", num_layers)
        return [window if i >= first else None for i in range(num_layers)]
    return [window if model_type in ("mistral", "phi3") else None] * num_layers


@MODEL_REGISTRY.register("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
class LlamaForCausalLM(CausalLM):
    qk_norm = None  # Qwen3 sets RMSNorm
    rope_aliases: ClassVar[dict[str, str]] = {}  # a family's names for our rope types

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.shape = llama_shape(cfg)
        is_qwen2 = cfg.get("model_type") == "qwen2"
        qkv_bias = is_qwen2 or cfg.get("attention_bias", False)
        o_bias = (not is_qwen2) and cfg.get("attention_bias", False)
        self.embed_tokens = nn.Embedding(self.shape.vocab_size, self.shape.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(self.shape, cfg, qkv_bias, o_bias, LayerAttention(window=window),
                              self.qk_norm)
            for window in layer_windows(cfg))
        self.norm = RMSNorm(self.shape.hidden_size, cfg.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = cfg.get("tie_word_embeddings", False)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(self.shape.hidden_size, self.shape.vocab_size, bias=False)
        theta, scaling = rope_config(cfg, aliases=self.rope_aliases)
        rotary_dim = int(self.shape.head_dim * partial_rotary_factor(cfg))
        self.rope = RotaryEmbedding(self.shape.head_dim, self.shape.max_position_embeddings,
                                    theta, scaling, rotary_dim)

    def forward(self, input_ids, positions, attention, taps=None):
        x, residual = self.embed_tokens(input_ids), None
        if taps is not None:
            taps.record(0, x)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rope, self.ops, attention, i)
            if taps is not None:
                taps.record(i + 1, x, residual)
        return self.ops.add_rms_norm(x, residual, self.norm)[0]

    def output_weight(self) -> torch.Tensor:
        if self.tie_word_embeddings:
            return self.embed_tokens.weight
        return self.lm_head.weight

    def fused_names(self) -> tuple[dict, dict]:
        return fused_projections(self.shape, self.layers[0].mlp.intermediate)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights, *self.fused_names())


def load_checkpoint(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]],
                    fused: dict, sizes: dict) -> None:
    """A Hugging Face checkpoint of the Llama layout (the `model.` prefix dropped, a tied
    lm_head skipped) into `model`, every parameter required."""
    loader = WeightLoader(model, fused, sizes, ignore=("rotary_emb.inv_freq",))
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if model.tie_word_embeddings and name == "lm_head.weight":
            continue
        loader.load(name, tensor)
    loader.check_complete()


@MODEL_REGISTRY.register("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): the Llama layout, head_dim from the config, no q/k/v bias, and an RMSNorm
    over each head's queries and keys before the rotation."""

    qk_norm = RMSNorm


@MODEL_REGISTRY.register("Phi3ForCausalLM")
class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5 and Phi-4-mini: checkpoints store `qkv_proj` and `gate_up_proj` fused, in
    the row order of ours, so they load as they are. Older configs name longrope "su"."""

    rope_aliases: ClassVar[dict[str, str]] = {"su": "longrope", "yarn": "longrope"}

    def fused_names(self) -> tuple[dict, dict]:
        return {}, {}
