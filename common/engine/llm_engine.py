"""The offline engine behind `splitserve generate`: one model, a coupled scheduler, text in/out.

Requests are validated against the context and the KV pool before they are queued, so nothing
is accepted that could never run. Stop strings are matched on the incrementally detokenized text;
a sequence that hits one is finished early and its text ends before the stop string. A
constrained request (guided decoding, common.engine.guided) is queued once its grammar compiled.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from common.block_pool import KVCacheManager
from common.config import EngineConfig
from common.detokenizer import TextStream
from common.engine.model_runner import ModelRunner
from common.errors import InvalidRequestError
from common.plugins import COUPLED_POLICIES
from common.sampling_params import SamplingParams
from common.schedulers.base import SequenceUpdate
from common.sequence import Sequence
from common.tokenizer import TextTokenizer


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    # TokenLogprobs per output token, and of prompt tokens 1.., when the parameters ask
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)


def check_fits(prompt_len: int, params: SamplingParams, max_model_len: int,
               kv: KVCacheManager) -> None:
    """Raise InvalidRequestError for a request that could never run."""
    if prompt_len == 0:
        raise InvalidRequestError("the prompt is empty")
    if prompt_len + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{prompt_len + params.max_tokens} were requested ({prompt_len} in the prompt, "
            f"{params.max_tokens} for the completion)")
    if kv.num_blocks_for(prompt_len + 1) > kv.num_blocks:
        raise InvalidRequestError(f"the prompt needs more KV blocks than this instance has "
                                  f"({kv.num_blocks})")


class LLMEngine:
    def __init__(self, config: EngineConfig, policy: str = "sarathi") -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = TextTokenizer(self.runner.resolved.hf_dir)
        layout = self.runner.kv_layout
        self.kv = KVCacheManager(layout.num_blocks, layout.block_size,
                                 config.cache.prefix_caching)
        self.scheduler = COUPLED_POLICIES.get(policy)(config.batch, self.kv)
        self.max_model_len = self.runner.max_model_len
        self._grammar = None

    def default_params(self, **overrides) -> SamplingParams:
        return SamplingParams(eos_token_ids=self.tokenizer.eos_token_ids, **overrides)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        params.validate()
        check_fits(len(prompt_token_ids), params, self.max_model_len, self.kv)
        request_id = request_id or uuid.uuid4().hex
        seq = Sequence(request_id, prompt_token_ids, params, self.max_model_len)
        if params.guided is not None:  # offline, nothing else to run: wait for the compile
            seq.guide = self.grammar().submit(params.guided).result().matcher(params)
        self.scheduler.add(seq)
        return request_id

    def grammar(self):
        """The guided-decoding compiler (common.engine.guided), made on first use."""
        if self._grammar is None:
            from common.engine import guided

            self._grammar = guided.compiler_for_runner(self.runner)
        return self._grammar

    def step(self) -> list[SequenceUpdate]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if self.scheduler.has_work:
                raise RuntimeError("scheduler has work but planned nothing (KV pool too small?)")
            return []
        output = self.runner.execute(plan)
        return self.scheduler.update_from_output(plan, output)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 on_finish: Callable[[GenerationResult], None] | None = None,
                 request_ids: list[str] | None = None) -> list[GenerationResult]:
        """Run every prompt to completion; results in input order."""
        results, texts = {}, {}
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            request_id = self.add_request(prompt, p, request_ids[index] if request_ids else None)
            results[request_id] = GenerationResult(request_id, list(prompt))
            texts[request_id] = TextStream(self.tokenizer, p.stop, p.min_tokens)
        while self.scheduler.has_work:
            for update in self.step():
                self._absorb(update, results[update.seq_id], texts[update.seq_id], on_finish)
        return list(results.values())

    def _absorb(self, update: SequenceUpdate, result: GenerationResult, text: TextStream,
                on_finish) -> None:
        result.token_ids.extend(update.new_token_ids)
        result.logprobs.extend(update.logprobs)
        result.prompt_logprobs.extend(update.prompt_logprobs)
        result.text += text.push(update.new_token_ids, update.finish_reason is not None)
        finish_reason = update.finish_reason
        if finish_reason is None and text.stopped:
            self.scheduler.abort(update.seq_id)
            finish_reason = "stop"
        if finish_reason is not None:
            result.finish_reason = finish_reason
            if on_finish:
                on_finish(result)

    def close(self) -> None:
        if self._grammar is not None:
            self._grammar.close()
        self.runner.close()
