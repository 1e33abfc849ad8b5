"""Loads the engine's C++ CPU kernels (csrc/cpu_ops.cpp), compiling them on first use.

The build goes to the cache directory, keyed by the source's hash and the torch version, so it
happens once per machine (about a minute on 2 cores) and concurrent processes wait for one
build. Without a compiler the engine runs on torch ops alone, slower, after one warning line.
"""

from __future__ import annotations

import hashlib
import logging
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"


CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


def build_dir(cache_dir: Path) -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:12]
    return cache_dir / "kernels" / f"torch{torch.__version__.replace('+', '_')}-{digest}"


@lru_cache(maxsize=None)
def load(cache_dir: str):
    """The compiled module, or None when it cannot be built here."""
    from torch.utils import cpp_extension

    directory = build_dir(Path(cache_dir).expanduser())
    directory.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name="splitserve_cpu_ops", sources=[str(SOURCE)], build_directory=str(directory),
            extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
            verbose=False)
    except Exception as exc:  # no compiler, no ninja, headers missing: run without kernels
        log.warning("CPU kernels unavailable (%s); using torch ops", str(exc).splitlines()[0])
        return None
