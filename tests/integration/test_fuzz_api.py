"""Hostile input against a real gateway: thousands of generated requests, no 5xx, no hang, no leak.

Two generators feed one async sender (16 requests in flight, each bounded by a timeout):
- schema-driven: schemathesis reads the gateway's own `GET /openapi.json` and generates positive
  (schema-valid) and negative (schema-violating, including non-JSON bytes) cases for every
  operation except `POST /cluster/flip` (an admin action that changes the cluster by design);
  three of four positive JSON bodies get the served model name, so they reach the instances;
- hostile bodies (hypothesis) for /v1/completions and /v1/chat/completions: a valid request with
  fields overwritten by huge, negative, NaN/Infinity, wrong-typed, nested, empty or very long
  values, lone surrogates and extra fields, streaming and not; plus raw bodies: invalid UTF-8,
  deeply nested JSON (up to 200,000 levels), NaN literals, 5,000-digit numbers, truncated JSON,
  a 5 MiB body (over the default limit: 413).

The cluster runs the tiny random-weight Llama with a 64-token context, so a request that passes
validation costs at most 64 tokens of work. Generation is seeded (SPLITSERVE_FUZZ_SEED, default
0) so a failure reproduces; set another seed to explore. Measured on the 2-core VM: see
docs/reliability.md (the count reached is printed with -s).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.parse
from dataclasses import dataclass, field

import httpx
import pytest
from cluster_fixture import Cluster

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

try:  # the dev extra; without it only the schema-driven half is skipped
    import schemathesis
except ImportError:
    schemathesis = None

SEED = int(os.environ.get("SPLITSERVE_FUZZ_SEED", "0"))
TIME_BUDGET_S = 70.0  # generation + sending stop starting new batches after this
MIN_REQUESTS = 1500  # fewer means the fuzzer did not run as designed
REQUEST_TIMEOUT_S = 60.0  # a request still open after this is hung
CONCURRENCY = 16
VOCAB = 49152  # the tiny models share SmolLM2's tokenizer
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "stop", "stop_token_ids", "seed", "n", "best_of", "stream",
          "stream_options", "ignore_eos", "presence_penalty", "frequency_penalty", "logprobs",
          "top_logprobs", "echo", "suffix", "user"]
# FastAPI answers bodies it cannot parse (invalid UTF-8, recursion) with its own shape; see
# docs/reliability.md (open issues). Any other error body must be OpenAI's.
KNOWN_NON_OPENAI_ERROR = {"detail": "There was an error parsing the body"}


@dataclass(frozen=True)
class FuzzRequest:
    method: str
    path: str  # with its query string
    content: bytes | None
    content_type: str = "application/json"
    origin: str = ""  # which generator made it


@dataclass
class Outcome:
    request: FuzzRequest
    status: int | None = None
    seconds: float = 0.0
    failure: str = ""  # hang, transport error, 5xx, error event, bad error body
    events: int = 0


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.failure]

    def by_status(self) -> dict:
        counts: dict = {}
        for o in self.outcomes:
            counts[o.status] = counts.get(o.status, 0) + 1
        return counts


# -- generation ---------------------------------------------------------------------------------
def collect(strategy, n: int, seed_offset: int) -> list:
    """Up to `n` examples of `strategy` (none when it is unsatisfiable), seeded."""
    found: list = []

    @hypothesis.seed(SEED + seed_offset)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def gather(value):
        found.append(value)

    try:
        gather()
    except Unsatisfiable:
        pass
    return found


def _query(params: dict | None) -> str:
    def scalar(value):
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (dict, list)):
            return json.dumps(value)
        return "" if value is None else str(value)

    pairs = [(str(k), scalar(x)) for k, v in (params or {}).items()
             for x in (v if isinstance(v, list) else [v])]
    return ("?" + urllib.parse.urlencode(pairs)) if pairs else ""


def _from_case(kwargs: dict, served: str, index: int, origin: str) -> FuzzRequest:
    path = urllib.parse.urlsplit(kwargs["url"]).path + _query(kwargs.get("params"))
    content_type = next((v for k, v in (kwargs.get("headers") or {}).items()
                         if k.lower() == "content-type"), "application/json")
    if "json" in kwargs:
        body = kwargs["json"]
        if isinstance(body, dict) and "positive" in origin and index % 4:
            body = {**body, "model": served}
        content = json.dumps(body).encode("utf-8", "surrogatepass")
    else:
        content = kwargs.get("data")
        if isinstance(content, str):
            content = content.encode("utf-8", "surrogatepass")
        elif content is not None and not isinstance(content, bytes):
            content = json.dumps(content).encode("utf-8", "surrogatepass")
    return FuzzRequest(kwargs["method"], path, content, content_type, origin)


def schema_requests(url: str, served: str, per_post_op: int, seed_offset: int
                    ) -> list[FuzzRequest]:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    requests: list[FuzzRequest] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path == "/cluster/flip":
            continue
        n = per_post_op if operation.method.upper() == "POST" else 20
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            origin = f"schema:{mode.value}:{operation.method.upper()} {operation.path}"
            cases = collect(operation.as_strategy(generation_mode=mode), n, seed_offset)
            requests += [_from_case(c.as_transport_kwargs(base_url=url), served, i, origin)
                         for i, c in enumerate(cases)]
    return requests


def _hostile_values():
    huge = st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30,
                            -10**30, 10**400, -1, 0])
    floats = st.floats(allow_nan=True, allow_infinity=True)
    surrogates = st.sampled_from(["\ud800", "a\udfffb", "\udbff\udc00\ud800"])
    long_text = st.integers(1_000, 300_000).map(lambda n: ("lorem ipsum " * (n // 12 + 1))[:n])
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), huge, floats,
                        st.text(max_size=30), surrogates)
    nested = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                          | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=10)
    token_ids = st.lists(st.one_of(st.integers(-5, VOCAB + 5), huge), min_size=0, max_size=6)
    return st.one_of(scalars, nested, long_text, token_ids, st.just({}), st.just([]),
                     st.just(""), st.just({"include_usage": "yes"}))


def _valid_body(served: str, chat: bool):
    text = st.text(min_size=1, max_size=40)
    common = {"stream": st.booleans(), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
              "top_k": st.integers(-1, 100), "seed": st.integers(-2**63, 2**63 - 1),
              "stop": st.one_of(st.none(), text, st.lists(text, max_size=3)),
              "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
              "ignore_eos": st.booleans(), "user": text}
    if chat:
        message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                         "content": text})
        required = {"model": st.just(served), "messages": st.lists(message, min_size=1, max_size=3),
                    "max_completion_tokens": st.integers(1, 8)}
    else:
        prompt = st.one_of(text, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
        required = {"model": st.just(served), "prompt": prompt, "max_tokens": st.integers(1, 8)}
    return st.fixed_dictionaries(required, optional=common)


def _mutated_body(served: str, chat: bool):
    keys = st.one_of(st.sampled_from(FIELDS), st.text(max_size=12))
    overrides = st.dictionaries(keys, _hostile_values(), max_size=3)
    return st.tuples(_valid_body(served, chat), overrides).map(lambda t: {**t[0], **t[1]})


def _raw_bodies(served: str):
    head = f'{{"model": "{served}", "prompt": '.encode()
    deep = st.integers(10, 200_000).map(lambda d: head + b"[" * d + b"]" * d + b"}")
    bad_utf8 = st.binary(min_size=1, max_size=8).map(
        lambda b: head + b'"x' + b"\xff\xfe" + b + b'"}')
    literals = st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"9" * 5000,
                                b"-0", b"true", b"null", b"{}"]).map(
        lambda v: head + b'"hi", "max_tokens": ' + v + b', "temperature": ' + v + b"}")
    truncated = st.integers(0, 40).map(lambda k: (head + b'"hello", "max_tokens": 3}')[:k])
    return st.one_of(st.binary(max_size=300), deep, bad_utf8, literals, truncated,
                     st.just(b""), st.just(b"[]" * 1000))


def hostile_requests(served: str, n: int, seed_offset: int) -> list[FuzzRequest]:
    paths = {False: "/v1/completions", True: "/v1/chat/completions"}
    requests = []
    for chat in (False, True):
        bodies = collect(_mutated_body(served, chat), n // 3, seed_offset)
        requests += [FuzzRequest("POST", paths[chat],
                                 json.dumps(b).encode("utf-8", "surrogatepass"),
                                 origin=f"hostile:{paths[chat]}") for b in bodies]
        raw = collect(_raw_bodies(served), n // 6, seed_offset + 7)
        requests += [FuzzRequest("POST", paths[chat], b, origin="hostile:raw") for b in raw]
        oversize = b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}'  # over the 4 MiB default: 413
        requests.append(FuzzRequest("POST", paths[chat], oversize, origin="hostile:oversize"))
    return requests


# -- sending ------------------------------------------------------------------------------------
def _check_error_body(outcome: Outcome, body: bytes) -> None:
    try:
        parsed = json.loads(body)
    except ValueError:
        outcome.failure = f"non-JSON error body: {body[:200]!r}"
        return
    ok = isinstance(parsed, dict) and isinstance(parsed.get("error"), dict) and \
        isinstance(parsed["error"].get("message"), str)
    if not ok and parsed != KNOWN_NON_OPENAI_ERROR:
        outcome.failure = f"error body not in OpenAI's shape: {body[:200]!r}"


async def _exchange(client: httpx.AsyncClient, base: str, request: FuzzRequest,
                    outcome: Outcome) -> None:
    headers = {"content-type": request.content_type} if request.content is not None else {}
    async with client.stream(request.method, base + request.path, content=request.content,
                             headers=headers) as response:
        outcome.status = response.status_code
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
    for line in bytes(body).split(b"\n"):  # SSE lines end with \n only (not U+0085 etc.)
        if line.startswith(b"data: {"):
            outcome.events += 1
            if "error" in json.loads(line[6:]):
                outcome.failure = f"error event in a 200 stream: {line[:200]!r}"
    if outcome.status >= 500:
        outcome.failure = f"HTTP {outcome.status}: {bytes(body[:300])!r}"
    elif outcome.status >= 400 and not outcome.failure:
        _check_error_body(outcome, bytes(body))


async def _send_one(client, base, request, gate) -> Outcome:
    outcome = Outcome(request)
    async with gate:
        started = time.monotonic()
        try:
            await asyncio.wait_for(_exchange(client, base, request, outcome), REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            outcome.failure = f"hung: no complete answer within {REQUEST_TIMEOUT_S:.0f} s"
        except httpx.HTTPError as exc:
            outcome.failure = f"transport error {type(exc).__name__}: {exc}"
        outcome.seconds = time.monotonic() - started
    return outcome


async def send_all(base: str, requests: list[FuzzRequest]) -> list[Outcome]:
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits,
                                 trust_env=False) as client:
        return await asyncio.gather(*(_send_one(client, base, r, gate) for r in requests))


# -- cluster checks -----------------------------------------------------------------------------
def wait_idle(cluster: Cluster, timeout: float = 30.0) -> list:
    """Instances still holding KV blocks or sequences after `timeout` (empty when idle)."""
    deadline = time.monotonic() + timeout
    held: list = []
    while time.monotonic() < deadline:
        view = cluster.cluster()
        held = [(i["instance_id"], i["kv_blocks"]["used"], i["queue"])
                for i in view["instances"]
                if i["kv_blocks"]["used"] or any(i["queue"][k] for k in
                                                  ("waiting", "running", "transferring"))]
        if not held and view["gateway"]["requests_in_flight"] == 0:
            return []
        time.sleep(0.3)
    return held or [("gateway requests_in_flight", cluster.cluster()["gateway"])]


def integrity_violations(instances: list[dict]) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for inst in instances:
        text = httpx.get(inst["metrics_url"] + "/metrics", timeout=10).text
        total += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "splitserve_kv_integrity_violations_total")
    return total


def _pids_alive(instances: list[dict]) -> bool:
    return all(os.path.exists(f"/proc/{i['pid']}") for i in instances)


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory, tiny_models):
    cluster = Cluster("--model", str(tiny_models["llama"]), "--kv-memory-gib", "0.1",
                      "--max-model-len", "64", log_dir=tmp_path_factory.mktemp("fuzz"))
    cluster.served = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    yield cluster
    cluster.stop()


def _run_batches(cluster: Cluster) -> Tally:
    tally, started, batch = Tally(), time.monotonic(), 0
    while time.monotonic() - started < TIME_BUDGET_S:
        requests = schema_requests(cluster.url, cluster.served, 50, batch) + \
            hostile_requests(cluster.served, 240, batch)
        tally.outcomes += asyncio.run(send_all(cluster.url, requests))
        batch += 1
    return tally


def test_fuzzed_requests_never_get_5xx_hang_or_leak(fuzz_cluster):
    if schemathesis is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    before = fuzz_cluster.cluster()["instances"]
    started = time.monotonic()
    tally = _run_batches(fuzz_cluster)
    elapsed = time.monotonic() - started
    count = len(tally.outcomes)
    slowest = max(o.seconds for o in tally.outcomes)
    print(f"\nfuzz: {count} requests in {elapsed:.0f} s ({count / elapsed:.0f}/s), statuses "
          f"{tally.by_status()}, slowest {slowest:.2f} s, "
          f"{sum(o.events for o in tally.outcomes)} stream events")
    failures = tally.failures()
    assert not failures, "\n".join(f"{f.failure} <- {f.request.origin} {f.request.method} "
                                   f"{f.request.path} {(f.request.content or b'')[:200]!r}"
                                   for f in failures[:20])
    assert count >= MIN_REQUESTS, f"only {count} requests in the time budget"
    assert tally.by_status().get(200, 0) > 100, "too few requests reached the instances"
    assert httpx.get(fuzz_cluster.url + "/health", timeout=10).status_code == 200
    after = fuzz_cluster.cluster()["instances"]
    assert [(i["instance_id"], i["pid"]) for i in after] == \
        [(i["instance_id"], i["pid"]) for i in before], "an instance died or was replaced"
    assert _pids_alive(after)
    assert wait_idle(fuzz_cluster) == [], "KV blocks or requests held after the fuzzing"
    assert integrity_violations(after) == 0
    check = httpx.post(fuzz_cluster.url + "/v1/completions", timeout=60, json={
        "model": fuzz_cluster.served, "prompt": "still alive?", "max_tokens": 5,
        "ignore_eos": True})
    assert check.status_code == 200 and check.json()["usage"]["completion_tokens"] == 5


# -- API keys -----------------------------------------------------------------------------------
KEY = "fuzz-key-5c1e07b2d9"
PROTECTED = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("GET", "/v1/models"), ("GET", "/cluster"), ("GET", "/cluster/timeline"),
             ("POST", "/cluster/flip")]


def _authenticates(header: str) -> bool:
    scheme, _, key = header.partition(" ")  # what control_plane/admission.py accepts
    return scheme.lower() == "bearer" and key.strip() == KEY


def _bad_authorization():
    printable = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
    header = st.one_of(st.none(), printable, printable.map(lambda s: "Bearer " + s),
                       st.just(KEY), st.just("Basic " + KEY), st.just("Bearer"),
                       st.just(f"Bearer {KEY}x"), st.just(f"Bearer {KEY[:-1]}"),
                       st.just("Bearer " + KEY.upper()), st.just(f"Token {KEY}"))
    return header.map(lambda h: h if h is None else h.strip()).filter(
        lambda h: h is None or not _authenticates(h))


def _unauthenticated_requests(served: str, n: int) -> list[tuple]:
    body = st.one_of(_mutated_body(served, False), _mutated_body(served, True),
                     st.dictionaries(st.text(max_size=8), st.integers(), max_size=3))
    cases = st.tuples(st.sampled_from(PROTECTED), _bad_authorization(), body)
    return collect(cases, n, 99)


async def _send_unauthenticated(base: str, cases: list[tuple]) -> list[tuple]:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        async def one(case):
            (method, path), authorization, body = case
            headers = {"content-type": "application/json"}
            if authorization is not None:
                headers["authorization"] = authorization
            content = json.dumps(body).encode("utf-8", "surrogatepass") if method == "POST" \
                else None
            response = await client.request(method, base + path, content=content,
                                            headers=headers)
            return case, response.status_code, response.content
        return await asyncio.gather(*(one(c) for c in cases))


def test_every_protected_route_answers_401_without_a_valid_key(tmp_path, tiny_models):
    cluster = Cluster("--model", str(tiny_models["llama"]), "--kv-memory-gib", "0.05",
                      "--max-model-len", "64", "--api-key", KEY, log_dir=tmp_path)
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        served = httpx.get(cluster.url + "/v1/models", headers=auth).json()["data"][0]["id"]
        cases = _unauthenticated_requests(served, 400)
        results = asyncio.run(_send_unauthenticated(cluster.url, cases))
        wrong = [(c, s, b[:120]) for c, s, b in results
                 if s != 401 or json.loads(b)["error"]["type"] != "authentication_error"]
        print(f"\nauth fuzz: {len(results)} unauthenticated requests, all 401: {not wrong}")
        assert not wrong, wrong[:10]
        assert {c[0] for c in cases} == set(PROTECTED), "every protected route was tried"
        ok = httpx.post(cluster.url + "/v1/completions", headers=auth, timeout=60,
                        json={"model": served, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        for method, path in PROTECTED[2:5]:
            assert httpx.request(method, cluster.url + path, headers=auth).status_code == 200
        assert httpx.get(cluster.url + "/health").status_code == 200  # probes need no key
    finally:
        cluster.stop()
