"""The dependency rules of DESIGN.md §3, checked on the source and in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["common", "control_plane", "prefill_instance", "decode_instance", "coupled_instance",
            "kv_transfer", "length_predictor", "bench", "simulator"]
ROLE_PACKAGES = {"prefill_instance", "decode_instance", "coupled_instance"}
# package -> project packages it must never import (module level or inside functions)
FORBIDDEN = {
    "common": set(PACKAGES) - {"common"},
    # a role package imports no other role package and not the control plane
    **{role: ROLE_PACKAGES - {role} | {"control_plane", "simulator"} for role in ROLE_PACKAGES},
    "kv_transfer": set(PACKAGES) - {"common", "kv_transfer"},
    "control_plane": ROLE_PACKAGES,
    # bench starts clusters as `splitserve` subprocesses; what it shares with `up` (process and
    # port helpers) is in common. With the rule below, the two never import each other.
    "bench": {"control_plane", "simulator"},
    "length_predictor": {"simulator"},
    # The simulator drives the serving code's policy objects (prefill_instance, decode_instance,
    # control_plane's routing and flips, common's schedulers) and reads bench's workloads; never
    # the real KV backends, a trained predictor, or the coupled role (its module loads torch:
    # the simulator builds the same co-located schedulers through common.schedulers).
    "simulator": {"coupled_instance", "kv_transfer", "length_predictor"},
}
# Only the CLI may import heavy packages, the experiments behind `splitserve bench` and the
# simulator, and only inside its command handlers: no other control_plane module imports them.
LAZY_ONLY = {"control_plane": {"torch", "common.engine", "bench", "simulator"}}


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


def fresh_interpreter(code: str) -> list[str]:
    """The lines `code` prints, run in a new interpreter (nothing imported yet)."""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()


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


def test_the_simulator_loads_no_torch():
    """A simulation runs the policies in pure Python: none of its modules brings torch in."""
    modules = [module_name(p) for p in python_files("simulator")]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n"
            "print('torch' in sys.modules)")
    assert fresh_interpreter(code) == ["False"], "a simulator module imported torch"


# Roles see KV transfer only through its contract in common (common.transfer): backends are found
# by name from the entry points, so no role package imports kv_transfer.
TRANSFER_CONTRACT_ONLY = tuple(sorted(ROLE_PACKAGES))


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
    loaded, names = fresh_interpreter(code)
    assert loaded == "[]", f"importing the transfer contract loaded {loaded}"
    assert "tcp" in names and "shm" in names, names


def module_name(path: Path) -> str:
    return path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".") \
        .removesuffix(".__init__")


def module_level_import_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports when it is itself imported (imports at
    module level; `from package import module` counts the module)."""
    modules = {module_name(p): p for package in PACKAGES for p in python_files(package)}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        found = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = found & set(modules) - {name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module that imports itself back, through the path that leads there."""
    circles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circles.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return circles


def test_no_module_imports_itself_back():
    """No import circles at module level: e.g. co-located policies once registered through an
    import at the bottom of common/schedulers/coupled.py, which baselines.py and fastserve.py
    imported back. Plug-ins register through entry points instead (common.plugins)."""
    circles = import_circles(module_level_import_graph())
    assert not circles, "\n".join(" -> ".join(circle) for circle in circles)


def test_import_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c", "a"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_plug_in_names_load_neither_torch_nor_a_plug_in():
    """Every registry lists its names from the entry points alone, so the CLI can check a name
    without importing the implementations (nor the role packages control_plane must not
    import)."""
    homes = ("torch", "common.schedulers", "kv_transfer", "control_plane", "length_predictor",
             *sorted(ROLE_PACKAGES))
    code = ("import sys, common.plugins\n"
            "names = {k: r.names() for k, r in common.plugins.REGISTRIES.items()}\n"
            f"print(sorted(m for m in sys.modules if m.startswith({homes!r})))\n"
            "print(all(names.values()))")
    loaded, every_kind_named = fresh_interpreter(code)
    assert loaded == "[]", f"listing plug-in names imported {loaded}"
    assert every_kind_named == "True", "a plug-in kind has no names: reinstall the project"
