"""The dependency rules of DESIGN.md §3, checked on the source and in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["common", "control_plane", "prefill_instance", "decode_instance", "kv_transfer",
            "length_predictor", "bench"]
# package -> project packages it must never import (module level or inside functions)
FORBIDDEN = {
    "common": set(PACKAGES) - {"common"},
    "prefill_instance": {"decode_instance", "control_plane"},
    "decode_instance": {"prefill_instance", "control_plane"},
    "kv_transfer": set(PACKAGES) - {"common", "kv_transfer"},
    "control_plane": {"prefill_instance", "decode_instance"},
    # bench starts clusters as `splitserve` subprocesses; what it shares with `up` (process and
    # port helpers) is in common. With the rule below, the two never import each other.
    "bench": {"control_plane"},
}
# Only the CLI may import heavy packages, and the experiments behind `splitserve bench`, and only
# inside its command handlers: no other control_plane module ever imports them.
LAZY_ONLY = {"control_plane": {"torch", "common.engine", "bench"}}


def imported_modules(path: Path) -> list[tuple[str, bool]]:
    """(module, at_module_level) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, id(node) in top_level))
    return found


def python_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_forbidden_package_edges():
    violations = []
    for package, forbidden in FORBIDDEN.items():
        for path in python_files(package):
            for module, _ in imported_modules(path):
                if module.split(".")[0] in forbidden:
                    violations.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not violations, "\n".join(violations)


def test_heavy_imports_are_lazy_in_control_plane():
    violations = []
    for package, heavy in LAZY_ONLY.items():
        for path in python_files(package):
            for module, top in imported_modules(path):
                is_heavy = any(module == h or module.startswith(h + ".") for h in heavy)
                lazy_allowed = path.name == "cli.py"
                if is_heavy and (top or not lazy_allowed):
                    violations.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not violations, "\n".join(violations)


def test_control_plane_and_light_common_modules_do_not_load_torch():
    modules = [p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
               for p in python_files("control_plane")]
    modules += ["common.config", "common.protocol", "common.sequence", "common.block_pool",
                "common.plan", "common.tokenizer", "common.detokenizer", "common.registry",
                "common.schedulers.coupled", "common.messaging", "common.sharegpt",
                "common.model_files", "bench.run"]
    modules = [m.removesuffix(".__init__") for m in modules
               if (ROOT / (m.replace(".", "/") + ".py")).exists()
               or (ROOT / m.replace(".", "/")).is_dir()]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n"
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "a light module imported torch"


# Roles see KV transfer only through its contract in common (common.transfer): backends are found
# by name from the entry points, so no role package imports kv_transfer.
TRANSFER_CONTRACT_ONLY = ("prefill_instance", "decode_instance")


def test_roles_use_the_transfer_contract_not_the_backends():
    violations = [f"{path.relative_to(ROOT)} imports {module}"
                  for package in TRANSFER_CONTRACT_ONLY for path in python_files(package)
                  for module, _ in imported_modules(path) if module.split(".")[0] == "kv_transfer"]
    assert not violations, "\n".join(violations)


def test_transfer_contract_and_backend_names_load_neither_torch_nor_a_backend():
    code = ("import sys, common.transfer, kv_transfer\n"
            "names = common.transfer.BACKENDS.names()\n"
            "loaded = [m for m in sys.modules if m == 'torch' or m.startswith('kv_transfer.')]\n"
            "print(sorted(loaded))\nprint(names)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded, names = result.stdout.strip().splitlines()
    assert loaded == "[]", f"importing the transfer contract loaded {loaded}"
    assert "tcp" in names and "shm" in names, names
