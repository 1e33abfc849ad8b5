"""Model families, found by the `architectures` entry of a checkpoint's config.json."""

from __future__ import annotations

import torch

from common.engine.models import gemma, llama, opt  # noqa: F401  (registration)
from common.engine.models.base import MODEL_REGISTRY, CausalLM, ModelShape
from common.errors import ModelLoadError

__all__ = ["MODEL_REGISTRY", "CausalLM", "ModelShape", "build_model"]


def model_class(hf_config: dict) -> type[CausalLM]:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY.get(name)
    raise ModelLoadError(f"unsupported architecture {names or hf_config.get('model_type')}; "
                         f"supported: {', '.join(MODEL_REGISTRY.names())}")


def _reset_buffers(model: torch.nn.Module) -> None:
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if reset is not None:
            reset()


def build_model(hf_config: dict, weights, dtype: torch.dtype, device: str) -> CausalLM:
    """Construct the model without initializing it, then load `weights` (name, tensor) pairs."""
    cls = model_class(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(hf_config)
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks {exc} needed by {cls.__name__}") from None
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    _reset_buffers(model)
    with torch.no_grad():
        model.load_weights(weights)
    return model.eval().requires_grad_(False)
