"""Running the control plane: `splitserve gateway`, and `splitserve up` (gateway + instances).

`up` resolves the model once, starts N prefill and M decode instance processes (each told to die
with its parent, each handed its whole InstanceConfig as JSON: `splitserve instance
--config-json`), serves the gateway in this process, prints the URL once the cluster is ready, and
stops every instance on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import uvicorn

from common.config import ConfigError, GatewayConfig, InstanceConfig
from common.config_json import config_to_json
from common.errors import SplitserveError
from common.model_files import resolve_model
from common.process import die_with_parent
from common.tokenizer import TextTokenizer
from control_plane.app import create_app
from control_plane.gateway import Gateway

log = logging.getLogger(__name__)


def build_gateway(config: GatewayConfig) -> tuple[Gateway, set[str]]:
    resolved = resolve_model(config.model, Path(config.cache_dir).expanduser(), in_subprocess=True)
    tokenizer = TextTokenizer(resolved.hf_dir, config.chat_template)
    served = config.served_name or resolved.name
    aliases = {served, resolved.name, str(resolved.source), str(resolved.hf_dir)}
    if config.model:
        aliases.add(config.model)
    return Gateway(config, tokenizer, served), aliases


def http_config(app, config: GatewayConfig) -> uvicorn.Config:
    """The gateway's HTTP server: quiet logs, its shutdown grace and keep-alive from the config."""
    return uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                          access_log=False, timeout_graceful_shutdown=config.graceful_shutdown_s,
                          timeout_keep_alive=config.keep_alive_s)


def serve_gateway(gateway: Gateway, aliases: set[str], on_ready=None,
                  startup_failure=None, expected_instances: int = 0) -> None:
    """Run the HTTP server until SIGINT/SIGTERM; `on_ready(url)` once the cluster serves and
    at least `expected_instances` instances have reported ready. `startup_failure()` is polled
    until then: a message from it stops the server and raises."""
    server = uvicorn.Server(http_config(create_app(gateway, aliases), gateway.config))
    failure: list[str] = []
    if on_ready is not None or startup_failure is not None:
        threading.Thread(target=_announce, daemon=True,
                         args=(server, gateway, on_ready, startup_failure, failure,
                               expected_instances)).start()
    server.run()
    if failure:
        raise SplitserveError(failure[0])


def _num_ready(gateway: Gateway) -> int:
    return sum(len(gateway.registry.ready(role)) for role in ("prefill", "decode", "coupled"))


def _announce(server: uvicorn.Server, gateway: Gateway, on_ready, startup_failure,
              failure: list[str], expected_instances: int) -> None:
    # "Ready" once every instance we started serves: a caller that asked for two decode
    # instances may address either right away.
    while not server.should_exit:
        if server.started and gateway.is_serving() and _num_ready(gateway) >= expected_instances:
            if on_ready is not None:
                on_ready(f"http://{gateway.config.host}:{gateway.config.port}")
            return
        message = startup_failure() if startup_failure is not None else None
        if message:
            failure.append(message)
            server.should_exit = True
            return
        time.sleep(0.2)


@dataclass
class InstanceProcess:
    role: str
    process: subprocess.Popen


def spawn_instance(config: InstanceConfig, log_dir: Path | None) -> InstanceProcess:
    command = [sys.executable, "-m", "control_plane.cli", "instance",
               "--config-json", config_to_json(config)]
    output = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        output = open(log_dir / f"{config.instance_id}.log", "w")
    process = subprocess.Popen(command, stdout=output, stderr=output or None,
                               preexec_fn=die_with_parent)
    return InstanceProcess(config.role, process)


def instance_of(shared: InstanceConfig, role: str, index: int, gateway_inbox: str,
                num_threads: int | None = None) -> InstanceConfig:
    """One instance of `up`: it reports to this gateway and binds its metrics port wherever it
    can (-1), reporting the URL it got, so nothing races for a port picked in advance."""
    engine = shared.engine if num_threads is None else shared.engine.with_model(
        num_threads=num_threads)
    return replace(shared, role=role, instance_id=f"{role}-{index}", gateways=(gateway_inbox,),
                   metrics_port=-1, engine=engine)


def stop_instances(instances: list[InstanceProcess], grace_s: float = 5.0) -> None:
    for inst in instances:
        if inst.process.poll() is None:
            inst.process.terminate()
    deadline = time.monotonic() + grace_s
    for inst in instances:
        try:
            inst.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            inst.process.kill()
            inst.process.wait()


def run_up(config: GatewayConfig, counts: dict[str, int], shared: InstanceConfig,
           log_dir: Path | None = None, threads: dict[str, int] | None = None) -> None:
    """Serve the gateway here with `counts` instances per role (prefill, decode, coupled), each
    configured as `shared` plus its own role and identity (and `threads[role]` torch threads,
    where given)."""
    if not (counts.get("coupled") or (counts.get("prefill") and counts.get("decode"))):
        raise ConfigError("need at least one prefill and one decode instance, or a coupled one")
    gateway, aliases = build_gateway(config)  # resolves (and converts) the model once
    inbox = f"tcp://{config.host}:{config.inbox_port}"
    configs = [instance_of(shared, role, i, inbox, (threads or {}).get(role))
               for role, count in counts.items() for i in range(count)]
    # not serving, and no placement, until every one has reported (a partial view at start-up
    # would put the first requests on the decode instances that came up first)
    gateway.registry.expect(one.instance_id for one in configs)
    instances = [spawn_instance(one, log_dir) for one in configs]
    summary = " + ".join(f"{n} {role}" for role, n in counts.items() if n)
    print(f"splitserve: starting {summary} instances (model {gateway.served_name}); gateway at "
          f"http://{config.host}:{config.port}", flush=True)
    try:
        serve_gateway(gateway, aliases,
                      on_ready=lambda url: print(f"splitserve: ready at {url} "
                                                 f"(Ctrl-C to stop)", flush=True),
                      startup_failure=lambda: _exited_instance(instances, log_dir),
                      expected_instances=len(instances))
    finally:
        stop_instances(instances)


def _exited_instance(instances: list[InstanceProcess], log_dir: Path | None) -> str | None:
    """Names an instance that exited before the cluster became ready (its log says why)."""
    for inst in instances:
        status = inst.process.poll()
        if status is not None:
            where = f"; see {log_dir}" if log_dir is not None else ""
            return (f"a {inst.role} instance exited during start-up (status {status}), "
                    f"stopping the cluster{where}")
    return None
