"""`splitserve generate`: offline batch generation over the engine.

Prompts are raw text by default (as /v1/completions treats them) or chat messages with `chat`.
Results come back in input order; progress goes to stderr.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine, check_fits
from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateOptions:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    chat: bool = False


def read_prompts(prompts: list[str], prompts_file: str | None) -> list[str]:
    """Prompts from the command line, then from a JSONL file of {"prompt": ...} lines."""
    collected = list(prompts)
    if prompts_file:
        path = Path(prompts_file)
        if not path.exists():
            raise InvalidRequestError(f"prompts file not found: {path}")
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                collected.append(str(record["prompt"]) if isinstance(record, dict) else "")
            except (json.JSONDecodeError, KeyError):
                raise InvalidRequestError(
                    f"{path}:{number}: expected a JSON object with a \"prompt\" field") from None
    if not collected:
        raise InvalidRequestError("no prompts: give --prompt TEXT or --prompts-file FILE")
    return collected


def sampling_fields(options: GenerateOptions) -> dict:
    return {"max_tokens": options.max_tokens, "temperature": options.temperature,
            "top_p": options.top_p, "top_k": options.top_k, "seed": options.seed,
            "ignore_eos": options.ignore_eos, "stop": options.stop}


def run_generate(config: EngineConfig, prompts: list[str], options: GenerateOptions,
                 as_json: bool) -> list[dict]:
    fields = sampling_fields(options)
    SamplingParams(**fields).validate()  # a bad flag fails before the model loads
    engine = LLMEngine(config)
    try:
        tokenizer = engine.tokenizer
        encode = ((lambda p: tokenizer.encode_chat([{"role": "user", "content": p}]))
                  if options.chat else tokenizer.encode)
        token_lists = [encode(p) for p in prompts]
        params = engine.default_params(**fields)
        for index, tokens in enumerate(token_lists):
            try:
                check_fits(len(tokens), params.validate(), engine.max_model_len, engine.kv)
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"prompt {index + 1}: {exc}") from None
        with tqdm(total=len(prompts), desc="generate", unit="prompt", file=sys.stderr,
                  disable=None) as progress:
            results = engine.generate(token_lists, [params] * len(prompts),
                                      on_finish=lambda _: progress.update(1))
    finally:
        engine.close()
    records = [{"prompt": prompt, "text": r.text, "token_ids": r.token_ids,
                "prompt_token_ids": r.prompt_token_ids, "finish_reason": r.finish_reason}
               for prompt, r in zip(prompts, results)]
    for record in records:
        print(json.dumps(record, ensure_ascii=False) if as_json else record["text"], flush=True)
    return records
