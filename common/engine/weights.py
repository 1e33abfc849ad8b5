"""Reading a checkpoint's tensors (safetensors) for the model loader."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from common.errors import ModelLoadError


def safetensors_files(hf_dir: Path) -> list[Path]:
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {hf_dir}")
    return files


def iter_weights(hf_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, tensor) for every tensor of the checkpoint."""
    from safetensors import safe_open

    for file in safetensors_files(hf_dir):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises SafetensorError/OSError on corrupt files
            raise ModelLoadError(f"cannot read weights from {file}: {exc}") from None
