"""The Helm chart (deploy/helm/splitserve), rendered by Helm's real engine (helm-python-sdk):
every manifest validates against the Kubernetes schemas, wrong values fail with the key's path,
and what the pods run matches the `splitserve` command line, its ports and its health endpoints.
"""

from __future__ import annotations

import re
from unittest import mock

import pytest
import yaml
from deploy_support import CHART, NAMESPACE, RELEASE, VALUES_FILES, values_of

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed; it is in the dev extra")

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the one Helm's SDK
# renders for by default.
KUBE_VERSIONS = ("1.28.0", "1.36.0")
# Custom resources that kubernetes-validate has no schema for: parsed and checked for their
# identity fields only.
CRD_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1"}
FULLNAME = f"{RELEASE}-splitserve"
INSTANCE_ROLES = ("prefill", "decode")

# The instance HTTP endpoints the chart probes (served on --metrics-port).
INSTANCE_LIVENESS_PATH = "/health"
INSTANCE_READINESS_PATH = "/ready"

# Flags the chart passes that the CLI is getting for Kubernetes (issue 9). A flag here that the
# parser does not know yet is set aside before parsing; once the parser knows it, it is parsed
# like any other flag. Each takes one value.
PENDING_FLAGS = {
    "gateway": {"--advertise-host"},
    "instance": {"--advertise-host", "--inbox-port", "--kv-port", "--metrics-port"},
}
# Gateway routes the chart relies on that are being added (the ServiceMonitor scrapes /metrics).
PENDING_GATEWAY_ROUTES = {"/metrics"}


# ---------------------------------------------------------------------------------------------
# helpers

def deployment(rendered, component: str) -> dict:
    return rendered.get("Deployment", f"{FULLNAME}-{component}")


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def flag_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def container_port(c: dict, port) -> int:
    """A probe's or Service's port (a name or a number) as the container's port number."""
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in c["ports"]], f"port {port} not declared"
        return port
    for declared in c["ports"]:
        if declared["name"] == port:
            return declared["containerPort"]
    raise AssertionError(f"container {c['name']} has no port named {port!r}")


def pod_environment(rendered, workload: dict) -> dict[str, str]:
    """The environment the kubelet gives the container: ConfigMap keys (envFrom), then env, with
    downward-API and Secret values stood in by plausible ones."""
    c = container(workload)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env.update(rendered.get("ConfigMap", name)["data"])
    stand_ins = {"status.podIP": "10.1.2.3", "metadata.name": "pod-abc"}
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = stand_ins[var["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in var["valueFrom"]:
            env[var["name"]] = "rediss://:secret@redis.example:6380/0"
        else:
            raise AssertionError(f"unexpected env source {var}")
    return env


def expanded_args(rendered, workload: dict) -> list[str]:
    """The container's arguments after the kubelet's $(VAR) expansion. A reference the
    environment cannot resolve would reach splitserve literally, so it fails here."""
    env = pod_environment(rendered, workload)
    out = []
    for arg in container(workload)["args"]:
        for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
            assert ref in env, f"$({ref}) in {arg!r} is not in the container's environment"
        out.append(re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], arg))
    return out


def parse_cli(args: list[str]):
    """Parse a container's arguments with the real `splitserve` parser."""
    from control_plane.cli import build_parser

    parser = build_parser()
    command = args[0]
    namespace, unknown = parser.parse_known_args(args)
    pending = PENDING_FLAGS.get(command, set())
    leftover = list(unknown)
    while leftover:
        flag = leftover.pop(0)
        assert flag in pending, (
            f"`splitserve {command}` does not know {flag!r} (unknown: {unknown})")
        assert leftover, f"{flag} has no value"
        leftover.pop(0)
    return namespace


def effective_values(chart, case: str) -> dict:
    return chart.merge_values(values_of(case))


# ---------------------------------------------------------------------------------------------
# rendering and schema validation

@pytest.mark.parametrize("case", list(VALUES_FILES))
def test_every_manifest_validates_against_kubernetes_schemas(rendered, case):
    docs = rendered[case].docs
    assert docs, f"{case}: the chart rendered nothing"
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), doc
        assert doc["metadata"].get("name"), doc
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == CRD_KINDS[doc["kind"]]
            assert isinstance(doc.get("spec"), dict)
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{case}: {doc['kind']}/{doc['metadata']['name']} is invalid for "
                            f"Kubernetes {version} at {path}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                pytest.fail(f"{case}: {exc.message}")


@pytest.mark.parametrize("case", list(VALUES_FILES))
def test_objects_are_unique_and_expected(chart, rendered, case):
    docs = rendered[case].docs
    keys = [(doc["kind"], doc["metadata"]["name"]) for doc in docs]
    assert len(keys) == len(set(keys)), keys
    kinds = {kind for kind, _ in keys}
    assert {"ConfigMap", "Deployment", "Service"} <= kinds
    for component in ("gateway", *INSTANCE_ROLES):
        deployment(rendered[case], component)
    bundled = effective_values(chart, case)["redis"]["mode"] == "bundled"
    assert (f"{FULLNAME}-redis" in {name for kind, name in keys if kind == "Deployment"}) is bundled


@pytest.mark.parametrize("case", list(VALUES_FILES))
def test_helm_lint_reports_no_warning(helm, case):
    report = helm.lint(str(CHART), values_of(case), strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


def test_values_files_set_what_they_are_for(rendered):
    gpu = rendered["values-gpu"]
    for role in INSTANCE_ROLES:
        c = container(deployment(gpu, role))
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["image"].endswith("-cuda")
    assert "nvidia.com/gpu" not in str(container(deployment(gpu, "gateway"))["resources"])
    assert gpu.configmap_data()["CFG_DEVICE"] == "cuda"
    assert gpu.configmap_data()["CFG_BLOCK_SIZE"] == "256"

    many = rendered["values-many"]
    assert deployment(many, "gateway")["spec"]["replicas"] == 3
    assert deployment(many, "prefill")["spec"]["replicas"] == 4
    assert deployment(many, "decode")["spec"]["replicas"] == 8
    assert not [d for d in many.of_kind("Deployment") if d["metadata"]["name"].endswith("-redis")]
    assert many.of_kind("ServiceMonitor")
    redis_env = {e["name"]: e for e in container(deployment(many, "decode"))["env"]}
    assert redis_env["SPLITSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "splitserve-redis", "key": "url"}


# ---------------------------------------------------------------------------------------------
# wrong values fail, saying where

@pytest.mark.parametrize("values, where, what", [
    ({"prefill": {"replicas": "two"}}, "/prefill/replicas", "got string, want integer"),
    ({"decode": {"replicas": 1.5}}, "/decode/replicas", "want integer"),
    ({"engine": {"kvMemoryGib": "1Gi"}}, "/engine/kvMemoryGib", "got string, want number"),
    ({"engine": {"blockSize": 100}}, "/engine/blockSize", "must be one of"),
    ({"instance": {"transfer": "shm"}}, "/instance/transfer", "must be 'tcp'"),
    ({"gateway": {"port": 70000}}, "/gateway/port", "maximum"),
    ({"image": {"tag": 1.0}}, "/image/tag", "want string"),
    ({"redis": {"mode": "cluster"}}, "/redis/mode", "must be one of"),
    ({"prefil": {"replicas": 2}}, "at ''", "additional properties 'prefil' not allowed"),
    ({"metrics": {"serviceMonitor": {"interval": "15"}}}, "/metrics/serviceMonitor/interval",
     "does not match pattern"),
])
def test_wrong_value_type_fails_rendering_with_the_key(helm, chart, values, where, what):
    with pytest.raises(helm.HelmValuesError) as raised:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    message = str(raised.value)
    assert where in message and what in message, message


@pytest.mark.parametrize("values, message", [
    ({"gateway": {"replicas": 2}, "redis": {"mode": "none"}},
     'gateway.replicas is 2 but redis.mode is "none"'),
    ({"redis": {"mode": "external"}},
     "neither redis.external.url nor redis.external.existingSecret is set"),
    ({"gpu": {"enabled": True}}, 'gpu.enabled is true but engine.device is "cpu"'),
    ({"engine": {"device": "cuda"}}, 'engine.device is "cuda" but gpu.enabled is false'),
    ({"model": {"path": "/models/m.gguf"}}, "model.volume is empty"),
])
def test_impossible_combinations_fail_with_a_message(helm, chart, values, message):
    with pytest.raises(helm.HelmRenderError) as raised:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(raised.value)


# ---------------------------------------------------------------------------------------------
# the command lines, their ports and the probes

@pytest.mark.parametrize("case", list(VALUES_FILES))
def test_gateway_arguments_parse_with_the_cli(chart, rendered, case):
    values = effective_values(chart, case)
    workload = deployment(rendered[case], "gateway")
    args = expanded_args(rendered[case], workload)
    assert args[0] == "gateway"
    ns = parse_cli(args)
    assert ns.host == "0.0.0.0"
    assert ns.port == values["gateway"]["port"]
    assert ns.inbox_port == values["gateway"]["inboxPort"]
    assert ns.cache_dir == values["cache"]["dir"]
    assert ns.request_timeout == values["gateway"]["requestTimeout"]
    assert ns.token_timeout == values["gateway"]["tokenTimeout"]
    assert ns.model == (values["model"]["path"] or None)
    assert ns.instance_timeout == values["gateway"]["instanceTimeout"]
    assert ns.max_recoveries == values["gateway"]["maxRecoveries"]
    assert ns.flip_policy == values["gateway"]["flipPolicy"]
    assert ns.gateway_id == "pod-abc"  # unique per replica
    # The inbox address put in each request must be reachable from other pods.
    assert flag_value(args, "--advertise-host") == "10.1.2.3"
    check_store_flags(ns, values)


def check_store_flags(ns, values: dict) -> None:
    if values["redis"]["mode"] == "none":
        assert ns.redis is None
        return
    assert ns.redis.startswith(("redis://", "rediss://"))
    assert ns.store_prefix == (values["redis"].get("keyPrefix") or FULLNAME)


@pytest.mark.parametrize("case", list(VALUES_FILES))
@pytest.mark.parametrize("role", INSTANCE_ROLES)
def test_instance_arguments_parse_with_the_cli(chart, rendered, case, role):
    values = effective_values(chart, case)
    engine, instance = values["engine"], values["instance"]
    workload = deployment(rendered[case], role)
    args = expanded_args(rendered[case], workload)
    assert args[:3] == ["instance", "--role", role]
    ns = parse_cli(args)
    assert ns.role == role
    assert ns.host == "0.0.0.0"
    assert ns.instance_id == "pod-abc"
    assert ns.cache_dir == values["cache"]["dir"]
    assert ns.model == (values["model"]["path"] or None)
    assert ns.dtype == engine["dtype"] and ns.device == engine["device"]
    assert ns.block_size == engine["blockSize"] and ns.num_blocks == engine.get("numBlocks")
    # Helm drops keys whose value is null: an unset optional setting is absent.
    assert ns.max_model_len == engine.get("maxModelLen")
    assert ns.max_num_seqs == engine["maxNumSeqs"]
    assert ns.max_num_batched_tokens == engine["maxNumBatchedTokens"]
    assert ns.threads == engine["threads"] and ns.seed == engine["seed"]
    assert ns.transfer == instance["transfer"]
    assert ns.transfer_timeout == instance["transferTimeout"]
    assert ns.report_interval == instance["reportInterval"]
    assert ns.lease_timeout == instance["leaseTimeout"]
    assert ns.prefill_policy == instance["prefillPolicy"]
    assert ns.prefill_sched_batch == instance["prefillSchedBatch"]
    assert ns.chunk_size == instance["chunkSize"] and ns.pad_chunks == instance["padChunks"]
    assert ns.heartbeat_ttl == instance["heartbeatTtl"]
    check_store_flags(ns, values)
    overrides = values[role]["extraArgs"]
    if "--kv-memory-gib" in overrides:  # a role's extraArgs come last and win
        assert ns.kv_memory_gib == float(flag_value(overrides, "--kv-memory-gib"))
    else:
        assert ns.kv_memory_gib == engine["kvMemoryGib"]
    assert flag_value(args, "--advertise-host") == "10.1.2.3"
    ports = container(workload)["ports"]
    assert {p["name"]: p["containerPort"] for p in ports} == {
        "inbox": int(flag_value(args, "--inbox-port")),
        "kv": int(flag_value(args, "--kv-port")),
        "metrics": int(flag_value(args, "--metrics-port"))}


@pytest.mark.parametrize("case", list(VALUES_FILES))
def test_instances_reach_the_gateway_inbox(chart, rendered, case):
    """Instances report to a Service that lists gateways before they are ready (a gateway is
    ready only after instances reported): a readiness-gated Service would deadlock startup."""
    r = rendered[case]
    gateway = container(deployment(r, "gateway"))
    inbox = r.get("Service", f"{FULLNAME}-gateway-inbox")
    assert inbox["spec"]["publishNotReadyAddresses"] is True
    (port,) = inbox["spec"]["ports"]
    gateway_args = expanded_args(r, deployment(r, "gateway"))
    assert container_port(gateway, port["targetPort"]) == int(
        flag_value(gateway_args, "--inbox-port"))
    for role in INSTANCE_ROLES:
        args = expanded_args(r, deployment(r, role))
        assert flag_value(args, "--gateway") == (
            f"tcp://{FULLNAME}-gateway-inbox.{NAMESPACE}.svc:{port['port']}")


@pytest.mark.parametrize("case", list(VALUES_FILES))
def test_probes_use_the_health_endpoints(rendered, case):
    from control_plane.app import create_app

    r = rendered[case]
    routes = {route.path for route in create_app(mock.MagicMock(), set(),
                                                 manage_gateway=False).routes
              if "GET" in getattr(route, "methods", set())}

    gateway_workload = deployment(r, "gateway")
    gateway = container(gateway_workload)
    http_port = int(flag_value(expanded_args(r, gateway_workload), "--port"))
    ready, live = gateway["readinessProbe"]["httpGet"], gateway["livenessProbe"]["httpGet"]
    assert ready["path"] == "/health"      # 200 only once a prefill and a decode are ready
    assert live["path"] == "/live"    # answers whenever the server runs, even with API keys
    for probe in (ready, live):
        assert probe["path"] in routes, f"the gateway serves no GET {probe['path']}"
        assert container_port(gateway, probe["port"]) == http_port

    for role in INSTANCE_ROLES:
        workload = deployment(r, role)
        c = container(workload)
        metrics_port = int(flag_value(expanded_args(r, workload), "--metrics-port"))
        expected = {"startupProbe": INSTANCE_LIVENESS_PATH,
                    "livenessProbe": INSTANCE_LIVENESS_PATH,
                    "readinessProbe": INSTANCE_READINESS_PATH}
        for probe, path in expected.items():
            assert c[probe]["httpGet"]["path"] == path
            assert container_port(c, c[probe]["httpGet"]["port"]) == metrics_port


def test_gateway_serves_what_the_servicemonitor_scrapes(rendered):
    from control_plane.app import create_app

    routes = {route.path for route in create_app(mock.MagicMock(), set(),
                                                 manage_gateway=False).routes}
    (monitor,) = rendered["values-many"].of_kind("ServiceMonitor")
    for endpoint in monitor["spec"]["endpoints"]:
        if endpoint["port"] == "http":
            assert endpoint["path"] in routes | PENDING_GATEWAY_ROUTES


@pytest.mark.parametrize("case", list(VALUES_FILES))
def test_drain_settings(chart, rendered, case):
    values = effective_values(chart, case)
    r = rendered[case]
    for component in ("gateway", *INSTANCE_ROLES):
        spec = deployment(r, component)["spec"]["template"]["spec"]
        grace = values[component]["terminationGracePeriodSeconds"]
        assert spec["terminationGracePeriodSeconds"] == grace
    sleep = container(deployment(r, "gateway"))["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == ["sleep", str(values["gateway"]["preStopSleepSeconds"])]
    assert values["gateway"]["terminationGracePeriodSeconds"] > (
        values["gateway"]["preStopSleepSeconds"])


# ---------------------------------------------------------------------------------------------
# Services, the ServiceMonitor, the ConfigMap

def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("case", list(VALUES_FILES))
def test_every_service_selects_one_workload_and_its_ports(rendered, case):
    r = rendered[case]
    for service in r.of_kind("Service"):
        matches = [d for d in r.of_kind("Deployment")
                   if selects(service["spec"]["selector"],
                              d["spec"]["template"]["metadata"]["labels"])]
        assert len(matches) == 1, f"{service['metadata']['name']} selects {len(matches)} workloads"
        c = container(matches[0])
        for port in service["spec"]["ports"]:
            container_port(c, port["targetPort"])


@pytest.mark.parametrize("enabled", [False, True])
def test_servicemonitor_covers_gateways_and_instances(render, enabled):
    r = render({"metrics": {"serviceMonitor": {"enabled": enabled,
                                               "labels": {"release": "prom"}}}})
    monitors = r.of_kind("ServiceMonitor")
    assert len(monitors) == int(enabled)
    if not enabled:
        return
    (monitor,) = monitors
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    scraped = [s for s in r.of_kind("Service")
               if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    names = {s["metadata"]["name"] for s in scraped}
    assert names == {f"{FULLNAME}-gateway", f"{FULLNAME}-prefill", f"{FULLNAME}-decode"}
    endpoint_ports = {e["port"]: e["path"] for e in monitor["spec"]["endpoints"]}
    assert endpoint_ports == {"http": "/metrics", "metrics": "/metrics"}
    for service in scraped:
        assert {p["name"] for p in service["spec"]["ports"]} & endpoint_ports.keys(), service


def test_configmap_change_rolls_the_pods(render):
    before = render(None)
    after = render({"engine": {"dtype": "float32"}})
    for component in ("gateway", *INSTANCE_ROLES):
        old = deployment(before, component)["spec"]["template"]["metadata"]["annotations"]
        new = deployment(after, component)["spec"]["template"]["metadata"]["annotations"]
        assert old["checksum/config"] != new["checksum/config"]
    assert after.configmap_data()["CFG_DTYPE"] == "float32"


def test_flip_policy_and_options_reach_the_gateway(render):
    r = render({"gateway": {"flipPolicy": "idle", "flipOptions": {"idle_s": 60, "ratio": 2.5}},
                "redis": {"keyPrefix": "team-a"}})
    ns = parse_cli(expanded_args(r, deployment(r, "gateway")))
    assert ns.flip_policy == "idle"
    assert sorted(ns.flip_option) == ["idle_s=60", "ratio=2.5"]
    assert ns.store_prefix == "team-a"


def test_optional_engine_settings_appear_only_when_set(render):
    unset = render(None)
    assert "CFG_NUM_BLOCKS" not in unset.configmap_data()
    assert "--num-blocks" not in container(deployment(unset, "decode"))["args"]
    set_ = render({"engine": {"numBlocks": 4096, "maxModelLen": 2048},
                   "instance": {"padChunks": True}})
    args = expanded_args(set_, deployment(set_, "prefill"))
    assert flag_value(args, "--num-blocks") == "4096"
    assert flag_value(args, "--max-model-len") == "2048"
    assert "--pad-chunks" in args


@pytest.mark.parametrize("redis, expect", [
    ({"mode": "bundled"}, f"redis://{FULLNAME}-redis.{NAMESPACE}.svc:6379/0"),
    ({"mode": "external", "external": {"url": "rediss://:pw@redis.example:6380/0"}}, "secret"),
    ({"mode": "external", "external": {"existingSecret": "mine", "existingSecretKey": "u"}},
     "existing"),
    ({"mode": "none"}, None),
])
def test_redis_modes(render, redis, expect):
    r = render({"redis": redis})
    for component in ("gateway", *INSTANCE_ROLES):
        c = container(deployment(r, component))
        env = {e["name"]: e for e in c.get("env", [])}
        if expect is None:
            assert "--redis" not in c["args"] and "SPLITSERVE_REDIS_URL" not in env
            continue
        assert flag_value(c["args"], "--redis") == "$(SPLITSERVE_REDIS_URL)"
        var = env["SPLITSERVE_REDIS_URL"]
        if expect == "secret":
            ref = var["valueFrom"]["secretKeyRef"]
            secret = r.get("Secret", ref["name"])
            assert secret["stringData"][ref["key"]] == redis["external"]["url"]
            assert redis["external"]["url"] not in str(c)  # the password stays in the Secret
        elif expect == "existing":
            assert var["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "u"}
            assert not r.of_kind("Secret")
        else:
            assert var["value"] == expect
            r.get("Service", f"{FULLNAME}-redis")


def test_user_model_is_mounted_and_passed(render):
    r = render({"model": {"path": "/models/qwen.gguf",
                          "volume": {"persistentVolumeClaim": {"claimName": "models"}}}})
    for component in ("gateway", *INSTANCE_ROLES):
        workload = deployment(r, component)
        c = container(workload)
        assert flag_value(c["args"], "--model") == "/models/qwen.gguf"
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "models"}} in (
            workload["spec"]["template"]["spec"]["volumes"])
    assert '"model": "qwen"' in r.notes


# ---------------------------------------------------------------------------------------------
# NOTES.txt and the chart README

@pytest.mark.parametrize("case, served", [("defaults", "SmolLM2-135M-Instruct"),
                                          ("values-many", "smollm2-1.7b")])
def test_notes_tell_how_to_send_a_request(rendered, case, served):
    notes = rendered[case].notes
    assert f"kubectl -n {NAMESPACE} port-forward service/{FULLNAME}-gateway 8000:8000" in notes
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in notes
    assert f'"model": "{served}"' in notes


def _schema_leaves(schema: dict, node: dict, path: str, whole: set[str]):
    """Value paths the README must document: walk the schema's own structure, stopping at
    Kubernetes pass-through objects and at definitions documented as a whole."""
    ref = node.get("$ref", "")
    name = ref.rsplit("/", 1)[-1] if ref else ""
    if name:
        if name in whole:
            yield path
            return
        node = schema["definitions"][name]
    if "properties" in node and node.get("additionalProperties") is False:
        for key, child in node["properties"].items():
            yield from _schema_leaves(schema, child, f"{path}.{key}" if path else key, whole)
    else:
        yield path


def test_readme_documents_every_value(chart):
    readme = (CHART / "README.md").read_text()
    schema = chart.schema
    documented_whole = {"resources", "probeTimings", "strategy"}
    leaves = sorted(_schema_leaves(schema, schema, "", documented_whole))
    missing = [leaf for leaf in leaves if f"`{leaf}`" not in readme]
    assert not missing, f"values missing from the chart README: {missing}"
    # and the README names no value that does not exist
    rows = re.findall(r"^\| `([a-zA-Z.]+)`(?: / `([a-zA-Z.]+)`)? \|", readme, flags=re.MULTILINE)
    named = {name for row in rows for name in row if name}
    assert named and named <= set(leaves), sorted(named - set(leaves))


def test_readme_defaults_match_values_yaml():
    """Where the README's default column is a plain value, it is the one values.yaml holds."""
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    checked = 0
    for keys, defaults in re.findall(r"^\| (`[^|]+`) \| (`[^|]+`) \|", readme, flags=re.MULTILINE):
        names = re.findall(r"`([a-zA-Z.]+)`", keys)
        cells = [c.strip() for c in defaults.split(" / ")]
        if len(cells) != len(names) or not all(re.fullmatch(r"`[^`]*`", c) for c in cells):
            continue
        for name, cell in zip(names, cells):
            node = values
            for part in name.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            assert node == yaml.safe_load(cell.strip("`")), f"README default of {name}: {cell}"
            checked += 1
    assert checked > 50


def test_defaults_in_values_yaml_are_all_in_the_schema(chart):
    """values.yaml itself passes the schema (no key the schema does not describe)."""
    chart.validate_schema(yaml.safe_load((CHART / "values.yaml").read_text()))
