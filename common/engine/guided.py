"""Guided (grammar-constrained) decoding: compiling a request's `GuidedSpec`, one grammar matcher
per sequence, and the token mask each step applies before sampling.

Grammar engine: xgrammar (pinned in pyproject.toml). Measured on this project's default model
(SmolLM2-135M, vocabulary 49,152), a 5-property nested JSON schema, 32 constrained rows, one
thread, on a shared 2-core AMD EPYC VM:

- xgrammar 0.2.8: tokenizer info 0.21 s once; compile 13 ms; filling 32 rows of the batched
  bitmask 0.27 ms a step, accepting 32 tokens 0.17 ms. Its CPU apply kernel took 4.5-6 ms, so
  on CPU the mask is applied here with numpy instead (1.6 ms; xgrammar's kernel on CUDA).
- llguidance 1.9.1: no compile step, but 1.6 ms per matcher made (52 ms for 32), fill 0.8 ms
  (its thread pool) to 1.7 ms; its fast apply is a torch.compile kernel (a compiler and an
  inductor build at run time).
- outlines-core 0.2.14: 134 ms to index the same schema, 0.77 s for the vocabulary, and token
  lists instead of a bitmask (7 ms a step to list 32 rows' allowed tokens).

xgrammar compiles fastest, fills a whole step's bitmask for rows at any indices, and releases
the GIL while compiling (a large schema takes seconds: compiles never run on the forward loop).
In a whole decode step at batch 32 on the same VM (`splitserve bench guided-overhead`, results in
docs/benchmarks/guided_overhead), all rows constrained cost 1.03x (greedy) and 1.05x (sampled)
the unconstrained step: about 3.4 ms of mask and 0.4 ms of matcher updates on a 246 ms step.

Kinds: `json` (a JSON schema) and `json_object` are compiled without free whitespace (a small
model can otherwise emit blank space until max_tokens); `regex`; `choice` (a JSON list of
strings, as an EBNF alternation); `grammar` (xgrammar's EBNF, start rule `root`).

Owns:
- `GrammarCompiler`: a spec -> `CompiledGuide`, compiled on a small thread pool, each distinct
  spec once (a bounded LRU of futures; a spec that does not compile fails with
  `InvalidRequestError`, its one-line reason, and stays cached: it would fail again);
- `Guide`: one sequence's matcher (`Sequence.guide`, carried on `ScheduledChunk.guide`);
- `constrain`: one step's bitmask over the constrained rows, applied to the logits just before
  sampling (other rows untouched; nothing done when no row is constrained); once a grammar is
  complete only its EOS tokens stay allowed, so the sampler ends the sequence;
- `advance`: after sampling, each constrained row's matcher takes its token.

The roles (common.engine.role) hold a constrained sequence until its grammar has compiled.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr

from common.errors import InvalidRequestError
from common.plan import ScheduledChunk
from common.sampling_params import GuidedSpec, SamplingParams

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # distinct specs kept compiled (a JSON schema's grammar is a few hundred KB)
COMPILE_THREADS = 2  # one slow schema does not hold up the others
# xgrammar's errors start with "[time] file.cc:line: Check failed: (...) is false: ".
_ENGINE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
# The bitmask is int32 words read as bytes, bit 0 first: true of little-endian hosts only.
assert sys.byteorder == "little", "guided decoding's CPU mask assumes a little-endian host"


def _reason(exc: BaseException) -> str:
    """The first line of an engine error, without its source location."""
    text = str(exc).strip()
    return _ENGINE_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__


def _choice_grammar(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except ValueError as exc:
        raise InvalidRequestError(f"guided decoding: the choice is not JSON: {exc}") from None
    if not (isinstance(choices, list) and choices
            and all(isinstance(c, str) and c for c in choices)):
        raise InvalidRequestError("guided decoding: the choice must be a non-empty JSON list "
                                  "of non-empty strings")
    # EBNF string literals take JSON's escapes, so each choice is written as its JSON text.
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _compile(compiler: xgr.GrammarCompiler, spec: GuidedSpec) -> xgr.CompiledGrammar:
    # JSON without free whitespace (see the module docstring); separators ", " and ": ", as
    # json.dumps writes them.
    if spec.kind == "json":
        return compiler.compile_json_schema(spec.spec, any_whitespace=False)
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.spec)
    if spec.kind == "choice":
        return compiler.compile_grammar(_choice_grammar(spec.spec))
    if spec.kind == "grammar":  # xgrammar's EBNF (GBNF-like), start rule `root`
        return compiler.compile_grammar(spec.spec)
    raise InvalidRequestError(f"guided decoding: unknown kind {spec.kind!r}")


def tokenizer_info(hf_dir: str | Path, vocab_size: int) -> xgr.TokenizerInfo:
    """The grammar engine's view of the model's tokenizer, `vocab_size` wide: the logits' width,
    which may exceed the tokenizer's (padding rows: never allowed by any grammar)."""
    from transformers import AutoTokenizer  # slow to import: only on a first guided request

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)


class Guide:
    """One sequence's matcher: which tokens may come next, and the tokens it took. Past the
    grammar's end (its EOS accepted, or a token it rejected) only EOS is allowed."""

    __slots__ = ("eos_ids", "error", "matcher", "vocab_size")

    def __init__(self, matcher: xgr.GrammarMatcher, eos_ids: tuple[int, ...],
                 vocab_size: int) -> None:
        self.matcher = matcher
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self.error = ""

    @property
    def is_ended(self) -> bool:
        return bool(self.error) or self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        if self.is_ended:
            return token in self.eos_ids
        if self.matcher.accept_token(token):
            return True
        self.error = f"token {token} does not continue the grammar"
        return False

    def accept_all(self, tokens: Iterable[int]) -> bool:
        return all(self.accept(t) for t in tokens)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this sequence's allowed tokens into `bitmask[row]`."""
        if self.is_ended:
            words = bitmask[row].numpy().view(np.uint32)
            words[:] = 0
            for token in self.eos_ids:
                words[token // 32] |= np.uint32(1 << (token % 32))
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)


class CompiledGuide:
    """A compiled grammar, from which each sequence gets its own matcher."""

    def __init__(self, grammar: xgr.CompiledGrammar, info: xgr.TokenizerInfo) -> None:
        self.grammar = grammar
        self.vocab_size = info.vocab_size
        self.stop_ids = tuple(info.stop_token_ids)

    def matcher(self, sampling: SamplingParams) -> Guide:
        """A fresh matcher ended by the request's EOS ids (the tokenizer's when it names none)."""
        eos = tuple(t for t in sampling.eos_token_ids if 0 <= t < self.vocab_size)
        eos = eos or self.stop_ids
        return Guide(xgr.GrammarMatcher(self.grammar, override_stop_tokens=list(eos)), eos,
                     self.vocab_size)


class GrammarCompiler:
    """Specs compiled in the background, each distinct one once (a bounded LRU)."""

    def __init__(self, load_info: Callable[[], xgr.TokenizerInfo], cache_size: int = CACHE_SIZE,
                 threads: int = COMPILE_THREADS) -> None:
        self._load_info = load_info  # called once, in a compile thread
        self._engine: xgr.GrammarCompiler | None = None
        self._info: xgr.TokenizerInfo | None = None
        self._engine_lock = threading.Lock()
        # Reentrant: a done callback may run inline, in the thread that holds it.
        self._lock = threading.RLock()
        self._cache: OrderedDict[GuidedSpec, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self.cache_size = cache_size
        self.num_compiles = 0  # compilations started: cache misses

    def submit(self, spec: GuidedSpec) -> Future:
        """A future of the spec's `CompiledGuide` (already done when it is cached)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            self.num_compiles += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_failure(spec, f))
        return future

    def _forget_failure(self, spec: GuidedSpec, future: Future) -> None:
        """A failure that is not the spec's (the tokenizer did not load) is not kept."""
        exc = future.exception()
        if exc is not None and not isinstance(exc, InvalidRequestError):
            with self._lock:
                if self._cache.get(spec) is future:
                    del self._cache[spec]

    def _compile(self, spec: GuidedSpec) -> CompiledGuide:
        engine = self._engine_ready()
        try:
            grammar = _compile(engine, spec)
        except InvalidRequestError:
            raise
        except Exception as exc:  # the engine's RuntimeError: the spec is not valid
            raise InvalidRequestError(
                f"guided decoding: the {spec.kind} spec does not compile: {_reason(exc)}"
            ) from None
        return CompiledGuide(grammar, self._info)

    def _engine_ready(self) -> xgr.GrammarCompiler:
        with self._engine_lock:
            if self._engine is None:
                self._info = self._load_info()
                # Our LRU is the cache; one thread per compile, the pool runs two at a time.
                self._engine = xgr.GrammarCompiler(self._info, max_threads=1,
                                                   cache_enabled=False)
            return self._engine

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def compiler_for_runner(runner) -> GrammarCompiler:
    """A compiler for the runner's model: its HF tokenizer, as wide as its logits."""
    hf_dir, vocab_size = runner.resolved.hf_dir, runner.model.shape.vocab_size
    return GrammarCompiler(lambda: tokenizer_info(hf_dir, vocab_size))


# -- per step ------------------------------------------------------------------------------------
def constrain(logits: torch.Tensor, chunks: Sequence[ScheduledChunk], raw: torch.Tensor,
              keep_raw: bool = False) -> torch.Tensor:
    """logits [R, vocab], row i sampled for chunks[i]: masks the rows whose chunk has a guide
    (the others untouched) and returns what to sample from. In place, unless `logits` is `raw`
    and the raw logits are still read (`keep_raw`, or a row asking for log-probabilities of
    the model's raw distribution): then a masked copy."""
    rows = [i for i, chunk in enumerate(chunks) if chunk.guide is not None]
    if not rows:
        return logits
    if logits is raw and (keep_raw or any(c.sampling.logprobs is not None for c in chunks)):
        logits = logits.clone()
    vocab_size = chunks[rows[0]].guide.vocab_size  # one tokenizer per process
    bitmask = xgr.allocate_token_bitmask(len(chunks), vocab_size)
    for row in rows:
        chunks[row].guide.fill(bitmask, row)
    apply_bitmask(logits, bitmask, rows, vocab_size)
    return logits


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                  vocab_size: int) -> None:
    """-inf in `logits[rows]` wherever `bitmask[rows]` has a 0 bit, and in every column from
    `vocab_size` on (padding rows of the vocabulary)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        _apply_cpu(logits.numpy(), bitmask[rows].numpy(), rows, vocab_size)
        return
    width = min(vocab_size, logits.shape[-1])
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=width, indices=rows)
    if logits.shape[-1] > width:
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[index, width:] = float("-inf")


def _apply_cpu(logits: np.ndarray, words: np.ndarray, rows: list[int], vocab_size: int) -> None:
    """numpy's bit unpacking and masked copy: a few times faster than xgrammar's CPU kernel."""
    # One byte per token, 1 = allowed; columns past the bitmask unpack as 0 (masked).
    allowed = np.unpackbits(words.view(np.uint8), axis=-1, count=logits.shape[-1],
                            bitorder="little")
    allowed[:, vocab_size:] = 0
    banned = np.logical_not(allowed, out=allowed).view(np.bool_)  # in place: no second array
    if len(rows) == logits.shape[0]:
        np.copyto(logits, -np.inf, where=banned)
        return
    for k, row in enumerate(rows):
        np.copyto(logits[row], -np.inf, where=banned[k])


def advance(chunks: Sequence[ScheduledChunk], tokens: Sequence[int]) -> None:
    """After sampling: each constrained row's matcher takes the token sampled for it."""
    for chunk, token in zip(chunks, tokens):
        if chunk.guide is not None and not chunk.guide.accept(token):
            log.warning("guided decoding: %s sampled token %d outside its grammar (%s); only "
                        "EOS from now on", chunk.seq_id, token, chunk.guide.error or "ended")
