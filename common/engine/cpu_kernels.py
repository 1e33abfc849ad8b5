"""Loads the engine's C++ CPU kernels (csrc/cpu_ops.cpp), compiling them on first use.

The build goes to the cache directory under a key made of the source, the flags, the torch
version and this CPU's instruction-set flags (the code is compiled with -march=native, so a
build from another CPU generation must not be reused). A finished build is imported directly,
without ninja or a compiler; only a missing build is compiled (about 30 seconds on 2 cores, once
per machine; concurrent processes wait for one build). Without a compiler the engine runs on
torch ops alone, slower, after one warning line.

Builds live under CACHE_DIR/kernels, or under SPLITSERVE_KERNEL_DIR when set (as
TORCH_EXTENSIONS_DIR does for torch): runs that each use their own --cache-dir (profiles per
thread count, validation cases, the tests' fresh caches) then share one build per machine.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # included by SOURCE
MODULE_NAME = "splitserve_cpu_ops"
# SPLITSERVE_KERNEL_MARCH (default native) builds for another CPU generation, e.g. `haswell`
# (AVX2 only) or `icelake-server -mavx512bf16` (AVX512-BF16 without AMX): how this machine's
# tests also run the kernels' code paths for the CPU kinds it is not (it must still run them).
MARCH = os.environ.get("SPLITSERVE_KERNEL_MARCH", "native").split()
CFLAGS = ["-O3", f"-march={MARCH[0]}", *MARCH[1:], "-fopenmp", "-fno-math-errno",
          "-fno-trapping-math"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_dir(cache_dir: Path) -> Path:
    root = os.environ.get("SPLITSERVE_KERNEL_DIR")
    root = Path(root).expanduser() if root else cache_dir / "kernels"
    sources = b"".join(path.read_bytes() for path in [SOURCE, *HEADERS])
    key = sources + " ".join(CFLAGS).encode() + _cpu_flags().encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return root / f"torch{torch.__version__.replace('+', '_')}-{digest}"


def _import_built(directory: Path):
    """Import a finished build directly (no ninja run), or None if there is none."""
    built = directory / f"{MODULE_NAME}.so"
    if not built.exists() or (directory / "lock").exists():
        return None  # none yet, or another process is still building (its baton is "lock")
    spec = importlib.util.spec_from_file_location(MODULE_NAME, built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def load(cache_dir: str):
    """The compiled module, or None when it cannot be built here."""
    directory = build_dir(Path(cache_dir).expanduser())
    try:
        module = _import_built(directory)
        if module is not None:
            return module
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name=MODULE_NAME, sources=[str(SOURCE)], build_directory=str(directory),
            extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, headers missing: run without kernels
        log.warning("CPU kernels unavailable (%s); using torch ops", str(exc).splitlines()[0])
        return None
