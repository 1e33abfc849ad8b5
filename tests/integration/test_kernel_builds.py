"""The C++ kernels built for the other CPU kinds this project meets, run on this machine: the
kernel and sampler tests pass with an AVX2-only build (an AMD EPYC without AVX-512) and, where
this CPU can run it, an AVX512-BF16 build without AMX (a Zen 4 EPYC). -march=native alone would
test only this machine's own code paths. A build whose instruction-set macros (those the kernels'
sources test) equal the native build's compiles the same code paths the other kernel tests
already ran (the AVX2 build on an AVX2-only EPYC): it is skipped, saying so."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/integration/test_cpu_kernels.py", "tests/integration/test_sampler_kernel.py"]
BUILDS = {"avx2": ("haswell", {"avx2", "fma"}),
          "avx512-bf16": ("icelake-server -mavx512bf16", {"avx512f", "avx512_bf16"})}


def _isa_macros(march: str) -> set[str]:
    """The kernels' instruction-set macros (`defined(__X__)` in csrc) the compiler defines for
    `-march=MARCH`; the compiler torch's extension build uses (CXX, else c++)."""
    tested = set()
    for path in (ROOT / "common/engine/csrc").iterdir():
        tested |= set(re.findall(r"defined\((__[A-Z0-9_]+__)\)", path.read_text()))
    output = subprocess.run([os.environ.get("CXX", "c++"), *f"-march={march}".split(), "-dM",
                             "-E", "-x", "c++", "-"], input="", capture_output=True, text=True,
                            check=True).stdout
    return {line.split()[1] for line in output.splitlines() if line.startswith("#define")} & tested


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
    macros = _isa_macros(march)
    if macros == _isa_macros("native"):
        pytest.skip(f"the {kind} build's code paths are this CPU's native build's "
                    f"({' '.join(sorted(macros))}), which the kernel tests ran")
    env = {**os.environ, "SPLITSERVE_KERNEL_MARCH": march}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             *TESTS], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary
