"""Reading a checkpoint's tensors (safetensors, one file or sharded) for the model loader.

A sharded checkpoint names its shards in `model.safetensors.index.json` (`weight_map`: tensor ->
file); only those files are read, so other .safetensors files beside them (Mistral repositories
ship a `consolidated.safetensors` with other tensor names) are left alone, and a missing shard is
an error before any tensor is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from common.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def _indexed_files(hf_dir: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read the shard index {index}: {exc}") from None
    files = [hf_dir / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{index.name} lists shards missing from {hf_dir}: "
                             f"{', '.join(missing)}")
    return files


def safetensors_files(hf_dir: Path) -> list[Path]:
    """The checkpoint's weight files: the index's shards when there is an index, else every
    *.safetensors file of the directory."""
    index = hf_dir / INDEX_FILE
    if index.exists():
        return _indexed_files(hf_dir, index)
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
