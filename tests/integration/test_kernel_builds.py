"""The C++ kernels built for the other CPU kinds this project meets, run on this machine: the
kernel and sampler tests pass with an AVX2-only build (an AMD EPYC without AVX-512) and, where
this CPU can run it, an AVX512-BF16 build without AMX (a Zen 4 EPYC). -march=native alone would
test only this machine's own code paths."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/integration/test_cpu_kernels.py", "tests/integration/test_sampler_kernel.py"]
BUILDS = {"avx2": ("haswell", {"avx2", "fma"}),
          "avx512-bf16": ("icelake-server -mavx512bf16", {"avx512f", "avx512_bf16"})}


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(BUILDS))
def test_kernels_built_for_another_cpu_kind_pass_their_tests(kind, cache_dir):
    march, needs = BUILDS[kind]
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU cannot run a {kind} build")
    if kind == "avx2" and not {"avx512f", "amx_tile"} & _cpu_flags():
        # The sources choose code paths by __AVX2__, __FMA__, __AVX512F__, __AVX512BF16__ and
        # __AMX_TILE__ only: on a CPU with AVX2 and neither AVX-512 nor AMX, the native build
        # the suite's kernel tests already ran takes exactly the AVX2 build's paths.
        pytest.skip("this CPU's native build is the AVX2-only build the kernel tests ran")
    env = {**os.environ, "SPLITSERVE_KERNEL_MARCH": march}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             *TESTS], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary
