"""OPT (the TetriInfer and FastServe papers' models) over a paged KV cache.

Learned absolute positions (offset by 2, as in the checkpoints), LayerNorm, ReLU MLP, biases
everywhere; pre- or post-norm by `do_layer_norm_before`; optional project_in/out when the word
embedding width differs from the hidden size (OPT-350m).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from common.engine.models.base import MODEL_REGISTRY, CausalLM, ModelShape
from common.engine.models.layers import WeightLoader, activation

_POSITION_OFFSET = 2  # OPT checkpoints reserve the first two position rows


class OPTAttention(nn.Module):
    def __init__(self, shape: ModelShape, bias: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = shape.num_heads, shape.head_dim
        self.scaling = self.head_dim ** -0.5
        width = self.num_heads * self.head_dim
        self.qkv_proj = nn.Linear(shape.hidden_size, 3 * width, bias=bias)
        self.out_proj = nn.Linear(width, shape.hidden_size, bias=bias)

    def forward(self, x, attention, layer_idx):
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        # transformers scales the query before attention and then attends with scale 1.0
        out = attention(layer_idx, q * self.scaling, k, v, scale=1.0)
        return self.out_proj(out.reshape(num_tokens, -1))


class OPTDecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, cfg: dict) -> None:
        super().__init__()
        bias = cfg.get("enable_bias", True)
        affine = cfg.get("layer_norm_elementwise_affine", True)
        self.pre_norm = cfg.get("do_layer_norm_before", True)
        self.self_attn = OPTAttention(shape, bias)
        self.self_attn_layer_norm = nn.LayerNorm(shape.hidden_size, elementwise_affine=affine)
        self.fc1 = nn.Linear(shape.hidden_size, cfg["ffn_dim"], bias=bias)
        self.fc2 = nn.Linear(cfg["ffn_dim"], shape.hidden_size, bias=bias)
        self.final_layer_norm = nn.LayerNorm(shape.hidden_size, elementwise_affine=affine)
        self.act = activation(cfg.get("activation_function", "relu"))

    def forward(self, x, attention, layer_idx):
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, attention, layer_idx)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.fc2(self.act(self.fc1(h)))
        return x if self.pre_norm else self.final_layer_norm(x)


@MODEL_REGISTRY.register("OPTForCausalLM")
class OPTForCausalLM(CausalLM):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.shape = ModelShape(
            num_layers=cfg["num_hidden_layers"], num_heads=num_heads, num_kv_heads=num_heads,
            head_dim=hidden // num_heads, hidden_size=hidden, vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg["max_position_embeddings"])
        proj_dim = cfg.get("word_embed_proj_dim", hidden)
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], proj_dim)
        self.embed_positions = nn.Embedding(cfg["max_position_embeddings"] + _POSITION_OFFSET,
                                            hidden)
        self.project_in = nn.Linear(proj_dim, hidden, bias=False) if proj_dim != hidden else None
        self.project_out = nn.Linear(hidden, proj_dim, bias=False) if proj_dim != hidden else None
        self.layers = nn.ModuleList(OPTDecoderLayer(self.shape, cfg)
                                    for _ in range(self.shape.num_layers))
        keep_final = cfg.get("do_layer_norm_before", True) and not cfg.get(
            "_remove_final_layer_norm", False)
        self.final_layer_norm = (nn.LayerNorm(hidden, elementwise_affine=cfg.get(
            "layer_norm_elementwise_affine", True)) if keep_final else None)

    def forward(self, input_ids, positions, attention, taps=None):
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + _POSITION_OFFSET)
        if taps is not None:
            taps.record(0, x)
        for i, layer in enumerate(self.layers):
            x = layer(x, attention, i)
            if taps is not None:
                taps.record(i + 1, x)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        width = self.shape.num_heads * self.shape.head_dim
        fused = {f"self_attn.{p}_proj.{kind}": (f"self_attn.qkv_proj.{kind}", i)
                 for i, p in enumerate("qkv") for kind in ("weight", "bias")}
        sizes = {"qkv_proj.weight": [width] * 3, "qkv_proj.bias": [width] * 3}
        loader = WeightLoader(self, fused, sizes)
        for name, tensor in weights:
            name = name.removeprefix("model.").removeprefix("decoder.")
            if name == "lm_head.weight":
                continue  # OPT ties the output projection to embed_tokens
            loader.load(name, tensor)
        loader.check_complete()
