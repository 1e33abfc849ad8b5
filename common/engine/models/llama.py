"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

The query/key/value projections are fused into one matmul, and gate/up into another, so a forward
runs four large matmuls per layer instead of seven; the checkpoint's separate tensors are loaded
into row ranges of the fused weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from common.engine.models.base import MODEL_REGISTRY, CausalLM, ModelShape
from common.engine.models.layers import RMSNorm, RotaryEmbedding, WeightLoader, activation


class LlamaAttention(nn.Module):
    def __init__(self, shape: ModelShape, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = shape.num_heads, shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(shape.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=o_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ops,
                attention, layer_idx: int) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)  # [T, H + 2 KVH, D]
        # Rotate queries and keys in one call: they are adjacent heads of the fused projection.
        qk = ops.rotary(qkv[:, : self.num_heads + self.num_kv_heads], positions, rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        out = attention(layer_idx, q, k, v)  # [T, num_heads, head_dim]
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
    def __init__(self, shape: ModelShape, cfg: dict, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(shape.hidden_size, eps)
        self.self_attn = LlamaAttention(shape, qkv_bias, o_bias)
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


def _rope_scaling(cfg: dict) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default"
                                          else None)
    return theta, scaling


@MODEL_REGISTRY.register("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.shape = llama_shape(cfg)
        is_qwen2 = cfg.get("model_type") == "qwen2"
        qkv_bias = is_qwen2 or cfg.get("attention_bias", False)
        o_bias = (not is_qwen2) and cfg.get("attention_bias", False)
        self.embed_tokens = nn.Embedding(self.shape.vocab_size, self.shape.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(self.shape, cfg, qkv_bias, o_bias)
                                    for _ in range(self.shape.num_layers))
        self.norm = RMSNorm(self.shape.hidden_size, cfg.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = cfg.get("tie_word_embeddings", False)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(self.shape.hidden_size, self.shape.vocab_size, bias=False)
        theta, scaling = _rope_scaling(cfg)
        self.rope = RotaryEmbedding(self.shape.head_dim, self.shape.max_position_embeddings,
                                    theta, scaling)

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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        q_size = self.shape.num_heads * self.shape.head_dim
        kv_size = self.shape.num_kv_heads * self.shape.head_dim
        inter = self.layers[0].mlp.intermediate
        fused = {"q_proj.weight": ("qkv_proj.weight", 0), "k_proj.weight": ("qkv_proj.weight", 1),
                 "v_proj.weight": ("qkv_proj.weight", 2), "q_proj.bias": ("qkv_proj.bias", 0),
                 "k_proj.bias": ("qkv_proj.bias", 1), "v_proj.bias": ("qkv_proj.bias", 2),
                 "gate_proj.weight": ("gate_up_proj.weight", 0),
                 "up_proj.weight": ("gate_up_proj.weight", 1),
                 "gate_proj.bias": ("gate_up_proj.bias", 0),
                 "up_proj.bias": ("gate_up_proj.bias", 1)}
        sizes = {"qkv_proj.weight": [q_size, kv_size, kv_size],
                 "qkv_proj.bias": [q_size, kv_size, kv_size],
                 "gate_up_proj.weight": [inter, inter], "gate_up_proj.bias": [inter, inter]}
        loader = WeightLoader(self, fused, sizes, ignore=("rotary_emb.inv_freq",))
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            loader.load(name, tensor)
        loader.check_complete()
