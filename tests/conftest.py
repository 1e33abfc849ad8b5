"""Fixtures shared by every test tier: the default model's directory and tiny random models."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CACHE_DIR = os.environ.get("SPLITSERVE_CACHE", "~/.cache/splitserve")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# Without a GPU, Triton kernels (common.engine.attention_triton) run under Triton's interpreter
# on CPU tensors. Set before anything imports triton: a kernel reads the flag when it is defined.
# With CUDA the compiled kernels run, unless the caller set the flag.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One C++ kernel build for the whole run (common/engine/cpu_kernels.py): tests that give a
# command a fresh --cache-dir would otherwise compile the kernels again (~45 s each on 2 cores).
os.environ.setdefault("SPLITSERVE_KERNEL_DIR", str(Path(CACHE_DIR).expanduser() / "kernels"))


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cache_dir() -> str:
    return CACHE_DIR


@pytest.fixture(scope="session")
def default_model(cache_dir):
    """The default model, converted once into the shared cache."""
    from common.model_files import resolve_model

    return resolve_model(None, Path(cache_dir).expanduser())


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, default_model) -> dict[str, Path]:
    """Tiny random-weight checkpoints sharing the default model's tokenizer."""
    from helpers import save_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    vocab = 49152
    return {kind: save_tiny_model(kind, root / kind, default_model.hf_dir, vocab)
            for kind in ("llama", "qwen2", "opt")}
