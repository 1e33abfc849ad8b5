"""bench/machine.py: the CPU kind a benchmark JSON records, read from /proc/cpuinfo text."""

from __future__ import annotations

from bench.machine import cpu_kind

ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu sse avx2 avx512f avx512bw avx512_bf16 avx512_vnni

processor\t: 1
model name\t: something else entirely
"""

XEON_AMX = """vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""


def test_an_amd_vm_is_named_by_family_and_its_widest_bf16_extension():
    kind = cpu_kind(ZEN5)
    assert kind["kind"] == "AMD EPYC, family 26 (Zen 5), AVX512-BF16"
    assert (kind["vendor"], kind["family"], kind["model"]) == ("AuthenticAMD", 26, 2)
    assert kind["isa"] == ["AVX2", "AVX-512", "AVX512-BF16"]
    assert kind["model_name"] == "AMD EPYC"  # the first processor's block, not the second's


def test_intel_families_get_no_amd_generation_and_amx_is_named():
    kind = cpu_kind(XEON_AMX)
    assert kind["kind"] == "Intel(R) Xeon(R) Processor, family 6, AMX"
    assert "AMX" in kind["isa"]


def test_unreadable_cpuinfo_still_gives_one_line():
    kind = cpu_kind("")
    assert kind["kind"] == "unknown CPU" and kind["isa"] == [] and kind["family"] is None


def test_this_machine_is_described():
    assert cpu_kind()["kind"]  # whatever the host, a non-empty line for the JSON
