"""TetriInfer's five workload classes (§5.1) drawn from ShareGPT: LPLD, LPHD, HPLD, HPHD, Mixed.

Only the `bench` range of the project's ShareGPT split (`common.sharegpt`) is used: first turns
and later rounds of its conversations alike.

A request is heavy-prefill (HP) when its prompt has more than `heavy_prompt_tokens` (512) tokens,
light (LP) otherwise; heavy-decode (HD) when its output has more than `heavy_output_tokens` (128),
light (LD) otherwise. Token counts use the served model's tokenizer. The output length of each
request is fixed: its ShareGPT reference reply's length, capped at `max_output_tokens`, and runs
must send it with ignore-EOS so that every replay generates exactly the same number of tokens.
Mixed is an equal share of the four classes (remainder to LPLD first), in seeded random order.
PhaseShift (E16, static layout against flips) is a decode-heavy phase then a prefill-heavy one:
the first half LPHD requests, the second half HPLD, in that order, so that a Poisson replay
shifts the load from decode to prefill halfway.

Filling heavy-prefill classes: first turns of ShareGPT rarely exceed 512 tokens with a short
reply, so when first turns run out, later rounds of a conversation are used with their history:
the prompt is every earlier turn joined as "User: ...\\n\\nAssistant: ...\\n\\n" text ending with
the human turn, the reference reply is the gpt turn that answered it (what a chat frontend sends
for round k, and how Sarathi-Serve counts each round as a request). Such requests carry
`from_history=True`. Candidates of both kinds are visited in seeded order, and tokenizing stops
as soon as every class has its quota.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.workload import BenchRequest, Tokenizer, history_pairs
from common.config import ConfigError
from common.sharegpt import first_turns, load_split

CLASSES = ("LPLD", "LPHD", "HPLD", "HPHD")
WORKLOADS = CLASSES + ("Mixed",)
PHASES = {"PhaseShift": ("LPHD", "HPLD")}  # a workload of classes in turn, half each


@dataclass(frozen=True)
class WorkloadRequest(BenchRequest):
    workload_class: str = ""  # LPLD, LPHD, HPLD or HPHD
    from_history: bool = False  # the prompt joins earlier turns of its conversation


@dataclass(frozen=True)
class ClassThresholds:
    """TetriInfer's evaluation thresholds (§5.1) and the length caps of a run."""

    heavy_prompt_tokens: int = 512  # prompt > this: heavy prefill
    heavy_output_tokens: int = 128  # output > this: heavy decode (ShareGPT's median reply)
    max_prompt_tokens: int = 2048  # longer prompts are skipped (context and time limits)
    max_output_tokens: int = 512  # reference lengths are capped here
    min_prompt_tokens: int = 4

    def __post_init__(self) -> None:
        if not (1 <= self.min_prompt_tokens <= self.heavy_prompt_tokens < self.max_prompt_tokens
                and 1 <= self.heavy_output_tokens < self.max_output_tokens):
            raise ConfigError(f"inconsistent workload thresholds: {self}")

    def classify(self, num_prompt_tokens: int, num_output_tokens: int) -> str:
        prefill = "HP" if num_prompt_tokens > self.heavy_prompt_tokens else "LP"
        decode = "HD" if num_output_tokens > self.heavy_output_tokens else "LD"
        return prefill + decode


def class_quotas(workload: str, num_requests: int) -> dict[str, int]:
    """How many requests of each class the workload holds."""
    if workload not in WORKLOADS:
        raise ConfigError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if num_requests < 1:
        raise ConfigError(f"num_requests must be >= 1, got {num_requests}")
    if workload != "Mixed":
        return {workload: num_requests}
    base, extra = divmod(num_requests, len(CLASSES))
    return {cls: base + (i < extra) for i, cls in enumerate(CLASSES)}


def _could_be(prompt: str, reply: str, needed: set[str], limits: ClassThresholds) -> bool:
    """False when no class still needed can match, judged from byte lengths alone.

    A byte-level BPE token (SmolLM2, Llama 3, GPT-2 style) covers at least one byte, so a text's
    token count is at most its UTF-8 length (plus a few special tokens); this skips most of the
    tokenizing when only heavy classes are still short."""
    slack = 4
    can_be_heavy_prompt = len(prompt.encode()) + slack > limits.heavy_prompt_tokens
    can_be_heavy_output = len(reply.encode()) + slack > limits.heavy_output_tokens
    return any((cls[:2] == "LP" or can_be_heavy_prompt) and (cls[2:] == "LD" or can_be_heavy_output)
               for cls in needed)


def _take(tokenizer: Tokenizer, prompt: str, reply: str, limits: ClassThresholds,
          from_history: bool) -> WorkloadRequest | None:
    num_prompt = len(tokenizer.encode(prompt))
    if not limits.min_prompt_tokens <= num_prompt <= limits.max_prompt_tokens:
        return None
    # The server never generates the special tokens encode() would add around the reply.
    reference = len(tokenizer.encode(reply, add_special_tokens=False))
    num_output = min(max(1, reference), limits.max_output_tokens)
    return WorkloadRequest(prompt, num_prompt, num_output, reference,
                           limits.classify(num_prompt, num_output), from_history)


def sample_workload(tokenizer: Tokenizer, workload: str, num_requests: int, seed: int,
                    limits: ClassThresholds | None = None,
                    conversations: Sequence[list] | None = None) -> list[WorkloadRequest]:
    """`num_requests` requests of `workload` (a class name or "Mixed"), reproducible from `seed`.

    `conversations` replaces the bench range of the ShareGPT split (lists of {"from", "value"}
    turns), for tests and other corpora. Raises ConfigError when the data cannot fill a class,
    saying how many it found."""
    limits = limits or ClassThresholds()
    if workload in PHASES:  # each phase sampled as its class; the classes share no request
        first, second = PHASES[workload]
        half = num_requests // 2
        return (sample_workload(tokenizer, first, num_requests - half, seed, limits,
                                conversations)
                + sample_workload(tokenizer, second, half, seed, limits, conversations))
    quotas = class_quotas(workload, num_requests)
    if conversations is None:
        conversations = load_split()["bench"].conversations
    firsts = first_turns(_AsData(conversations))
    random.Random(seed).shuffle(firsts)
    found: dict[str, list[WorkloadRequest]] = {cls: [] for cls in quotas}
    sources = [((p, r, False) for p, r in firsts),
               ((p, r, True) for p, r in history_pairs(conversations, seed))]
    for source in sources:
        for prompt, reply, from_history in source:
            needed = {cls for cls, got in found.items() if len(got) < quotas[cls]}
            if not needed:
                break
            if not _could_be(prompt, reply, needed, limits):
                continue
            request = _take(tokenizer, prompt, reply, limits, from_history)
            if request is not None and request.workload_class in needed:
                found[request.workload_class].append(request)
    short = {cls: f"{len(got)}/{quotas[cls]}" for cls, got in found.items()
             if len(got) < quotas[cls]}
    if short:
        raise ConfigError(f"not enough {workload} requests in the data (found {short}) "
                          f"with limits {limits}")
    requests = [r for cls in quotas for r in found[cls]]
    random.Random(seed).shuffle(requests)
    return requests


@dataclass(frozen=True)
class _AsData:
    """Adapter so `common.sharegpt.first_turns` reads a plain list of conversations."""

    conversations: Sequence[list]


def describe(requests: Sequence[WorkloadRequest]) -> dict:
    """Per-class counts and mean lengths, for reports."""
    summary: dict[str, dict] = {}
    for cls in CLASSES:
        members = [r for r in requests if r.workload_class == cls]
        if members:
            summary[cls] = {
                "count": len(members),
                "from_history": sum(r.from_history for r in members),
                "mean_prompt_tokens": sum(r.num_prompt_tokens for r in members) / len(members),
                "mean_output_tokens": sum(r.max_tokens for r in members) / len(members)}
    return summary
