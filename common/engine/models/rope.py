"""Rotary position embeddings: reading a config's rope settings, the scaling variants, the tables.

Every variant ends as one float32 cos/sin table indexed by position, so the torch path and the
C++ `rotary_neox` kernel read the same rows whatever the variant:

- default, linear (frequencies / factor), llama3 (low frequencies scaled, high ones kept, a
  smooth ramp between), yarn (interpolated and extrapolated frequencies blended per dimension,
  cos/sin times an attention factor);
- longrope (Phi-3): short factors for positions below `original_max_position_embeddings`, long
  factors from there on, cos/sin times an attention factor. transformers switches a whole
  sequence to the long factors once it grows past that length (keys already cached keep the
  short ones); here the choice is per position, so both agree below that length and a sequence
  past it sees a slightly different early-token rotation than transformers.

`dynamic` (NTK by current length) is refused: its frequencies depend on the batch, not on the
position. Numerics follow transformers where exact float32 agreement depends on it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from common.errors import ModelLoadError

SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope")


def rope_kind(scaling: dict | None) -> str:
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_config(cfg: dict, params: dict | None = None, default_theta: float = 10000.0,
                legacy_theta: str = "rope_theta", legacy_scaling: bool = True,
                aliases: dict[str, str] | None = None) -> tuple[float, dict | None]:
    """(theta, scaling) from a config: `params` (transformers 5's `rope_parameters`, or one
    layer type's entry of it) first, else the older top-level keys (`legacy_theta`, and
    `rope_scaling` where `legacy_scaling`). Scaling gets the defaults transformers fills from the
    config (original context, factor), and its type renamed by `aliases`; None for plain rope."""
    params = (cfg.get("rope_parameters") or {}) if params is None else params
    theta = params.get("rope_theta", cfg.get(legacy_theta, default_theta))
    legacy = cfg.get("rope_scaling") if legacy_scaling else None
    scaling = dict(legacy or (params if rope_kind(params) != "default" else {}))
    kind = (aliases or {}).get(rope_kind(scaling), rope_kind(scaling))
    if not scaling or kind == "default":
        return theta, None
    scaling["rope_type"] = kind
    if kind in ("llama3", "yarn", "longrope"):
        # transformers prefers the top-level value where a config has one (Phi-3)
        original = cfg.get("original_max_position_embeddings") or scaling.get(
            "original_max_position_embeddings") or cfg.get("max_position_embeddings")
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None and kind != "llama3":
            scaling["factor"] = cfg.get("max_position_embeddings", original) / original
    return theta, scaling


def check_supported(scaling: dict | None) -> None:
    if rope_kind(scaling) not in SUPPORTED:
        raise ModelLoadError(f"unsupported rope scaling type {rope_kind(scaling)!r} (supported: "
                             f"{', '.join(SUPPORTED)})")


def partial_rotary_factor(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))


def _base_exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    old_context = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    # The dimension whose wavelength fits `rotations` times in the original context.
    boundary = lambda rotations: (dim * math.log(old_context / (rotations * 2 * math.pi))
                                  / (2 * math.log(theta)))
    low, high = boundary(scaling.get("beta_fast") or 32), boundary(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    powers = theta ** _base_exponents(dim)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    inv_freq = (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep
    return inv_freq, attention_factor


def _longrope_factor(scaling: dict) -> float:
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_context))


def rope_angles(max_positions: int, dim: int, theta: float, scaling: dict | None
                ) -> tuple[torch.Tensor, float]:
    """Rotation angles [max_positions, dim / 2] (float32) and the factor cos/sin are scaled by."""
    kind = rope_kind(scaling)
    positions = torch.arange(max_positions).float()[:, None]
    if kind == "longrope":
        powers = theta ** _base_exponents(dim)
        short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * powers)
        long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * powers)
        is_long = positions >= scaling["original_max_position_embeddings"]
        return positions * torch.where(is_long, long, short), _longrope_factor(scaling)
    if kind == "yarn":
        inv_freq, factor = _yarn(dim, theta, scaling)
        return positions * inv_freq[None, :], factor
    inv_freq = 1.0 / (theta ** _base_exponents(dim))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    check_supported(scaling)
    return positions * inv_freq[None, :], 1.0


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed cos/sin table indexed by position.

    With `rotary_dim` < head_dim (partial rotary, Phi-4-mini) only the first `rotary_dim`
    dimensions of each head rotate; the rest pass through.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None = None, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.rotary_dim = rotary_dim or head_dim
        self.theta, self.scaling = theta, scaling
        self.half = self.rotary_dim // 2
        check_supported(scaling)  # at build time, not when the tables are filled
        self.register_buffer("cos", torch.empty(max_positions, self.half, dtype=torch.float32),
                             persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, self.half, dtype=torch.float32),
                             persistent=False)
        if self.cos.device.type != "meta":
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the float32 tables; models are built on the meta device, then filled."""
        angles, factor = rope_angles(self.max_positions, self.rotary_dim, self.theta,
                                     self.scaling)
        angles = angles.to(self.cos.device)
        self.cos.copy_(angles.cos() * factor if factor != 1.0 else angles.cos())
        self.sin.copy_(angles.sin() * factor if factor != 1.0 else angles.sin())

    def table(self, positions: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions`, shaped [T, 1, rotary_dim / 2] to broadcast over heads."""
        return (self.cos[positions].to(dtype).unsqueeze(1),
                self.sin[positions].to(dtype).unsqueeze(1))

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, num_heads, head_dim]; (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        x1, x2 = x[..., :self.half], x[..., self.half:self.rotary_dim]
        rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        if self.rotary_dim == x.shape[-1]:
            return torch.cat(rotated, dim=-1)
        return torch.cat((*rotated, x[..., self.rotary_dim:]), dim=-1)
