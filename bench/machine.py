"""The CPU kind a benchmark ran on, as recorded in its JSON.

This module owns that description. Results on this project's machines span several CPU kinds
(Intel Xeon with AMX, AVX2-only EPYC, Zen 4, Zen 5) whose numbers differ by more than most
effects measured, so a committed result names its kind. A VM's "model name" is often only
"AMD EPYC" or "Intel(R) Xeon(R) Processor", so the family/model numbers and the ISA extensions
that change which kernels run (AVX2, AVX-512, AVX512-BF16, AMX) are recorded beside it.
"""

from __future__ import annotations

from pathlib import Path

# AMD's CPU family numbers (lscpu's "CPU family") and the core generation they mean.
_AMD_FAMILIES = {23: "Zen/Zen 2", 25: "Zen 3/Zen 4", 26: "Zen 5"}
# /proc/cpuinfo flag -> the name used in docs, widest last (the kind names the widest).
_ISA_FLAGS = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"),
              ("amx_tile", "AMX"))


def _cpuinfo(text: str) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block ends at a blank line
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_kind(cpuinfo_text: str | None = None) -> dict:
    """{"model_name", "vendor", "family", "model", "isa", "kind"} of this machine's CPU; `kind` is
    one line such as "AMD EPYC, family 26 (Zen 5), AVX512-BF16"."""
    if cpuinfo_text is None:
        try:
            cpuinfo_text = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo_text = ""
    fields = _cpuinfo(cpuinfo_text)
    flags = set(fields.get("flags", "").split())
    isa = [name for flag, name in _ISA_FLAGS if flag in flags]
    family = int(fields["cpu family"]) if fields.get("cpu family", "").isdigit() else None
    model = int(fields["model"]) if fields.get("model", "").isdigit() else None
    vendor = fields.get("vendor_id", "unknown")
    kind = fields.get("model name", "unknown CPU")
    if family is not None:
        generation = _AMD_FAMILIES.get(family) if vendor == "AuthenticAMD" else None
        kind += f", family {family}" + (f" ({generation})" if generation else "")
    if isa:
        kind += f", {isa[-1]}"
    return {"model_name": fields.get("model name"), "vendor": vendor, "family": family,
            "model": model, "isa": isa, "kind": kind}
