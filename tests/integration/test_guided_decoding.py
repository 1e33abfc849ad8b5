"""Guided decoding with the default model: every output follows its grammar.

In one engine (the offline LLMEngine, so through the runner's mask and matchers and the
scheduler's chunks), greedy and sampled (temperature 0.7, top_p 0.95) requests for small JSON
schemas (nested objects, enums, arrays, bounded strings and numbers), a regex and a choice, in
one batch: the JSON parses and validates against its schema, the regex matches in full, the
choice is one of the choices, and each ends by the EOS the finished grammar forces. Then the
disaggregated path in a real cluster (1 prefill + 1 decode instance, no local prefill): the
prefill instance samples the first token, the decode instance's matcher takes it and
constrains the rest, and the output still validates.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import pytest
from cluster_fixture import Cluster

from common.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import GuidedSpec

pytestmark = pytest.mark.slow

MAX_TOKENS = 64  # enough for every schema below: their strings and arrays are bounded
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city", "zip"]}},
        "required": ["name", "address"]},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L"]},
        "in_stock": {"type": "boolean"}},
        "required": ["color", "size", "in_stock"]},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "minItems": 1, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "maxItems": 3}},
        "required": ["tags", "scores"]},
}
REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.95}}


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def cases() -> list[tuple[str, GuidedSpec, str]]:
    """(name, spec, prompt)"""
    found = [(f"json-{name}", GuidedSpec("json", json.dumps(schema)),
              f"Reply with a JSON object following this schema: {json.dumps(schema)}")
             for name, schema in SCHEMAS.items()]
    found.append(("json_object", GuidedSpec("json_object"),
                  'Reply with the JSON object {"answer": 42}.'))  # free keys: a short prompt
    found.append(("regex", GuidedSpec("regex", REGEX), "Give me a phone number."))
    found.append(("choice", GuidedSpec("choice", json.dumps(CHOICES)),
                  "Is 'I love this film' positive, negative or neutral?"))
    return found


def check(name: str, text: str) -> None:
    if name.startswith("json-"):
        jsonschema.validate(json.loads(text), SCHEMAS[name.removeprefix("json-")])
    elif name == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(EngineConfig(model=ModelConfig(dtype="float32"),
                                    cache=CacheConfig(num_blocks=512, block_size=16),
                                    batch=BatchConfig(max_num_seqs=16,
                                                      max_num_batched_tokens=1024)))
    yield engine
    engine.close()


def test_outputs_follow_their_grammars_greedy_and_sampled(engine):
    batch = [(name, mode, spec, prompt) for mode in MODES for name, spec, prompt in cases()]
    prompts = [chat(engine.tokenizer, prompt) for _, _, _, prompt in batch]
    params = [engine.default_params(max_tokens=MAX_TOKENS, guided=spec, seed=i,
                                    **MODES[mode])
              for i, (_, mode, spec, _) in enumerate(batch)]
    results = engine.generate(prompts, params)
    for (name, mode, _, _), result in zip(batch, results):
        assert result.finish_reason == "stop", (name, mode, result.text)
        assert result.token_ids[-1] in engine.tokenizer.eos_token_ids  # forced at the end
        check(name, result.text)
    # the compile cache: one compilation per distinct spec, whatever the number of requests
    assert engine.grammar().num_compiles == len(cases())


def test_a_spec_that_does_not_compile_is_refused(engine):
    from common.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="the regex spec does not compile"):
        engine.add_request([1, 2, 3], engine.default_params(guided=GuidedSpec("regex", "(")))


# -- disaggregated: the prefill instance samples the first token, the decode instance the rest --
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster("--dtype", "float32", "--prefill", "1", "--decode", "1", "--local-prefill",
                "off", log_dir=tmp_path_factory.mktemp("guided-cluster"))
    yield c
    c.stop()


def test_a_constrained_request_split_between_prefill_and_decode_validates(cluster):
    schema = SCHEMAS["nested"]
    for mode, sampling in MODES.items():
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": MAX_TOKENS, "seed": 1,
                "messages": [{"role": "user", "content": "Where does Alice live? As JSON."}],
                "guided_json": schema, **sampling}
        response = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (mode, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    stats = decode_cache_stats(cluster)
    assert stats["local_prefills"] == 0 and stats["blocks_read"] > 0  # the KV came over


def decode_cache_stats(cluster, timeout_s: float = 30.0) -> dict:
    """The decode instance's prefix-cache counters, once a report shows KV it read."""
    deadline = time.monotonic() + timeout_s
    while True:
        decode = next(i for i in cluster.cluster()["instances"] if i["role"] == "decode")
        if decode["prefix_cache"]["blocks_read"] > 0 or time.monotonic() > deadline:
            return decode["prefix_cache"]
        time.sleep(0.2)


def test_200_sampled_json_schema_requests_all_validate(cluster):
    """The issue's check: 200 sampled requests over several schemas (nested objects, enums,
    arrays) through the chat API's response_format, all valid."""
    import asyncio

    names = sorted(SCHEMAS)

    async def one(client, i: int):
        name = names[i % len(names)]
        schema = SCHEMAS[name]
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": MAX_TOKENS, "seed": i,
                "temperature": 0.7, "top_p": 0.95,
                "messages": [{"role": "user", "content": f"Describe item {i} as JSON."}],
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": name, "schema": schema, "strict": True}}}
        response = await client.post(cluster.url + "/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return name, response.json()["choices"][0]

    async def run():
        limit = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=300) as client:
            async def bounded(i):
                async with limit:
                    return await one(client, i)
            return await asyncio.gather(*(bounded(i) for i in range(200)))

    results = asyncio.run(run())
    assert len(results) == 200
    for name, choice in results:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name])
    # sampled: the outputs are not all the same text
    assert len({choice["message"]["content"] for _, choice in results}) > 20


def test_a_spec_only_the_grammar_engine_refuses_is_a_400(cluster):
    """Python's re compiles this regex (a lone `{`), xgrammar does not: the gateway's check
    passes it on, the instance's compile fails, and the client still gets a 400 (found by the
    API fuzzer), streamed or not."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 4,
            "guided_regex": "ab{"}
    response = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "does not compile" in response.json()["error"]["message"]
    with httpx.stream("POST", cluster.url + "/v1/completions", timeout=60,
                      json={**body, "stream": True}) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == 400, events
