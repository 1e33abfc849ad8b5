"""The multi-turn workload: ShareGPT conversations replayed turn by turn as streamed chat
completions, each turn's prompt holding the answers the server itself gave to the earlier turns.

Owns: picking and planning conversations, replaying them, and the per-turn report.

- Conversations: records of the bench range of the ShareGPT split (`common.sharegpt`) that open
  with a user turn and alternate user / assistant, cut before the first user message the bench
  range does not own (a text that opens or occurs earlier in a train or eval conversation, such
  as "continue": the predictor may have seen it), in seeded order; each keeps its first
  `max_turns` user messages, up to the first one longer than `max_message_tokens`, and one left
  with fewer than `min_turns` (2) is skipped. On the packaged file 1,694 qualify.
- Turn k is one POST /v1/chat/completions (streamed, usage included) whose messages are the
  earlier user messages, each followed by the text the server streamed back for it (never the
  recorded ShareGPT answer), then user message k; the server's chat template renders them, so
  any OpenAI-compatible server works. The history is capped: the oldest (user, answer) pairs
  are left out until the estimate (user tokens counted with the served model's tokenizer,
  answer tokens from the server's usage, plus the template's tokens) is within
  `max_history_tokens`.
- Timing: conversations start at Poisson (or any given) offsets; turn k+1 is sent only after
  turn k's stream has ended plus a think time (exponential with mean `think_time_s`, or
  constant; seeded). A failed turn ends its conversation: there is no answer to go on from.
- Output budget: the recorded reply's length capped at `max_tokens`, or `max_tokens` each.
- Report: every turn is a `TurnRecord` (a `bench.client.RequestRecord` plus conversation, turn
  index, think time, prompt estimate, turns left out); the summary is `bench.metrics.summarize`
  over all turns plus the same latencies by turn index (`by_turn`: "1", "2", ..., "later" = 2+).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import aiohttp
import numpy as np
from tqdm import tqdm

from bench.client import POOLED_IDLE_S, RequestRecord, post_stream_aiohttp
from bench.metrics import run_duration, summarize
from bench.workload import Tokenizer
from common.config import ConfigError
from common.sharegpt import load_split, normalize_prompt

THINK_TIMES = ("exponential", "constant")
# Token estimate of a chat prompt: a fixed part (a default system prompt, the assistant header)
# and a per-message part (role markers). SmolLM2's template costs 25 and 5 to 6: rounded up, so
# the cap errs on the short side for it.
TEMPLATE_TOKENS = 32
MESSAGE_TOKENS = 6


@dataclass(frozen=True)
class MultiTurnOptions:
    """How conversations are picked, capped and paced."""

    max_turns: int = 4
    min_turns: int = 2
    think_time_s: float = 1.0  # mean think time between a turn's answer and the next turn
    think_time: str = "exponential"
    max_history_tokens: int = 1500  # the prompt estimate's cap: oldest turns are left out
    max_message_tokens: int = 512  # a longer user message ends its conversation before it
    max_tokens: int = 128
    use_reference_lengths: bool = True

    def __post_init__(self) -> None:
        fits = self.max_message_tokens + TEMPLATE_TOKENS + MESSAGE_TOKENS
        checks = [
            (1 <= self.min_turns <= self.max_turns,
             f"need 1 <= min_turns <= max_turns, got {self.min_turns} and {self.max_turns}"),
            (self.think_time_s >= 0, f"think time must be >= 0 s, got {self.think_time_s}"),
            (self.think_time in THINK_TIMES, f"think time must be one of {THINK_TIMES}"),
            (self.max_message_tokens >= 1 and fits <= self.max_history_tokens,
             f"max_history_tokens ({self.max_history_tokens}) must hold a whole message "
             f"of max_message_tokens ({self.max_message_tokens}) and the template"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


@dataclass(frozen=True)
class Turn:
    message: str
    num_message_tokens: int
    max_tokens: int
    think_before_s: float  # wait after the previous turn's answer; 0 for the first turn


@dataclass(frozen=True)
class Conversation:
    index: int
    turns: tuple[Turn, ...]


@dataclass
class TurnRecord(RequestRecord):
    """One turn's request: what `RequestRecord` holds, and where it sits in its conversation."""

    conversation: int = 0
    turn: int = 0  # 1 = the conversation's first request
    think_time_s: float = 0.0
    num_prompt_tokens: int = 0  # the client's estimate of the messages sent
    num_history_turns: int = 0  # earlier turns in the prompt
    num_dropped_turns: int = 0  # earlier turns left out by the history cap


@dataclass(frozen=True)
class _Exchange:
    user: str
    user_tokens: int
    answer: str
    answer_tokens: int


def user_turns(conversation: Sequence) -> list[tuple[str, str]]:
    """(user message, recorded reply) from the start while turns alternate user / assistant."""
    found = []
    for position in range(0, len(conversation) - 1, 2):
        user, reply = conversation[position], conversation[position + 1]
        if not (isinstance(user, dict) and isinstance(reply, dict)
                and user.get("from") == "human" and reply.get("from") == "gpt"):
            break
        texts = user.get("value"), reply.get("value")
        if not all(isinstance(text, str) and text.strip() for text in texts):
            break
        found.append(texts)
    return found


def bench_dialogues(min_turns: int = 2) -> list[list[tuple[str, str]]]:
    """`user_turns` of the split's bench range, each cut before its first user message the
    range does not own, those with at least `min_turns` left, in file order."""
    bench = load_split()["bench"]
    owned = {normalize_prompt(prompt) for _, prompt, _ in bench.all_turns}
    dialogues = []
    for conversation in bench.conversations:
        turns = user_turns(conversation)
        kept = next((i for i, (message, _) in enumerate(turns)
                     if normalize_prompt(message) not in owned), len(turns))
        if kept >= min_turns:
            dialogues.append(turns[:kept])
    return dialogues


def _think_times(count: int, options: MultiTurnOptions, rng: np.random.Generator) -> list[float]:
    if options.think_time == "constant" or options.think_time_s == 0:
        return [options.think_time_s] * count
    return rng.exponential(options.think_time_s, size=count).tolist()


def _plan_one(tokenizer: Tokenizer, index: int, dialogue: Sequence[tuple[str, str]],
              options: MultiTurnOptions, rng: np.random.Generator) -> Conversation | None:
    turns: list[Turn] = []
    for message, reply in dialogue[:options.max_turns]:
        num_tokens = len(tokenizer.encode(message, add_special_tokens=False))
        if num_tokens > options.max_message_tokens:
            break
        reference = len(tokenizer.encode(reply, add_special_tokens=False))
        budget = (min(options.max_tokens, max(1, reference)) if options.use_reference_lengths
                  else options.max_tokens)
        turns.append(Turn(message, num_tokens, budget, 0.0))
    if len(turns) < options.min_turns:
        return None
    thinks = [0.0] + _think_times(len(turns) - 1, options, rng)
    return Conversation(index, tuple(Turn(t.message, t.num_message_tokens, t.max_tokens, think)
                                     for t, think in zip(turns, thinks)))


def plan_conversations(tokenizer: Tokenizer, num_conversations: int, options: MultiTurnOptions,
                       seed: int, conversations: Sequence[list] | None = None
                       ) -> list[Conversation]:
    """`num_conversations` conversations in seeded order, with their turns and think times.
    `conversations` (lists of {"from", "value"} turns) replace the bench range's (tests, other
    corpora). Raises ConfigError when too few qualify."""
    if num_conversations < 1:
        raise ConfigError(f"need at least one conversation, got {num_conversations}")
    candidates = (bench_dialogues(options.min_turns) if conversations is None
                  else [user_turns(conversation) for conversation in conversations])
    random.Random(seed).shuffle(candidates)
    # Its own stream: drawn from the arrivals' seed alone, think times would mirror the gaps.
    rng = np.random.default_rng((seed, 1))
    planned: list[Conversation] = []
    for dialogue in candidates:
        plan = _plan_one(tokenizer, len(planned), dialogue, options, rng)
        if plan is not None:
            planned.append(plan)
            if len(planned) == num_conversations:
                return planned
    raise ConfigError(f"only {len(planned)} of {len(candidates)} conversations have "
                      f"{options.min_turns}+ user turns within {options.max_message_tokens} "
                      f"tokens each; {num_conversations} were asked for")


def fit_history(history: Sequence[_Exchange], turn: Turn, max_history_tokens: int
                ) -> tuple[list[dict], int, int]:
    """(messages, token estimate, earlier turns left out): the latest earlier exchanges that
    fit the cap, in order, then the turn's user message."""
    estimate = TEMPLATE_TOKENS + MESSAGE_TOKENS + turn.num_message_tokens
    kept = 0
    for exchange in reversed(history):
        more = 2 * MESSAGE_TOKENS + exchange.user_tokens + exchange.answer_tokens
        if estimate + more > max_history_tokens:
            break
        estimate, kept = estimate + more, kept + 1
    messages = []
    for exchange in history[len(history) - kept:]:
        messages += [{"role": "user", "content": exchange.user},
                     {"role": "assistant", "content": exchange.answer}]
    messages.append({"role": "user", "content": turn.message})
    return messages, estimate, len(history) - kept


def chat_payload(model: str, messages: list[dict], max_tokens: int, ignore_eos: bool,
                 temperature: float, top_p: float | None = None) -> dict:
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens,
               "temperature": temperature, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if top_p is not None:
        payload["top_p"] = top_p
    return payload


async def _sleep_until(start: float, offset: float) -> None:
    # A loop, not one sleep: the event loop may wake a timer up to its clock resolution early,
    # and a turn must never leave before its think time is over.
    while (left := offset - (time.perf_counter() - start)) > 0:
        await asyncio.sleep(left)


@dataclass(frozen=True)
class _Replay:
    session: aiohttp.ClientSession
    endpoint: str
    model: str
    start: float
    sampling: dict  # ignore_eos, temperature, top_p
    max_history_tokens: int
    bar: tqdm


async def _send_turn(replay: _Replay, conversation: Conversation, number: int,
                     history: list[_Exchange]) -> tuple[TurnRecord, str]:
    turn = conversation.turns[number - 1]
    messages, estimate, dropped = fit_history(history, turn, replay.max_history_tokens)
    record = TurnRecord(index=0, send_time=time.perf_counter() - replay.start,
                        conversation=conversation.index, turn=number,
                        think_time_s=turn.think_before_s, num_prompt_tokens=estimate,
                        num_history_turns=len(history) - dropped, num_dropped_turns=dropped)
    pieces: list[str] = []
    payload = chat_payload(replay.model, messages, turn.max_tokens, **replay.sampling)
    await post_stream_aiohttp(replay.session, replay.endpoint, payload, record, replay.start,
                              pieces.append)
    replay.bar.update(1)
    return record, "".join(pieces)


async def _converse(replay: _Replay, conversation: Conversation,
                    arrival: float) -> list[TurnRecord]:
    """Send the conversation's turns one after another; stop at the first failed one."""
    await _sleep_until(replay.start, arrival)
    history: list[_Exchange] = []
    records: list[TurnRecord] = []
    for number, turn in enumerate(conversation.turns, start=1):
        if records:
            previous = records[-1]
            await _sleep_until(replay.start, previous.send_time + previous.jct
                               + turn.think_before_s)
        record, answer = await _send_turn(replay, conversation, number, history)
        records.append(record)
        if not record.ok:
            break
        history.append(_Exchange(turn.message, turn.num_message_tokens, answer,
                                 record.output_tokens or 0))
    return records


async def run_conversations(url: str, model: str, conversations: Sequence[Conversation],
                            arrivals: Sequence[float], max_history_tokens: int = 1500,
                            ignore_eos: bool = False, temperature: float = 0.0,
                            top_p: float | None = None, timeout_s: float = 600,
                            progress: bool = True) -> list[TurnRecord]:
    """Replay every conversation from its arrival offset; records in conversation then turn
    order, `index` numbering them so."""
    if len(conversations) != len(arrivals):
        raise ValueError(f"{len(conversations)} conversations but {len(arrivals)} arrivals")
    # As bench.client: no connection cap (it would queue turns in the client), no proxies.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=POOLED_IDLE_S)
    async with aiohttp.ClientSession(connector=connector, trust_env=False,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        with tqdm(total=sum(len(c.turns) for c in conversations), desc="turns", unit="req",
                  file=sys.stderr, disable=not progress) as bar:
            replay = _Replay(session, f"{url.rstrip('/')}/v1/chat/completions", model,
                             time.perf_counter(), {"ignore_eos": ignore_eos,
                                                   "temperature": temperature, "top_p": top_p},
                             max_history_tokens, bar)
            per_conversation = await asyncio.gather(
                *(_converse(replay, c, a) for c, a in zip(conversations, arrivals)))
    records = [record for group in per_conversation for record in group]
    for index, record in enumerate(records):
        record.index = index
    return records


def _turn_summary(records: Sequence[TurnRecord]) -> dict:
    summary = summarize(records, run_duration(records))
    return {key: summary[key] for key in ("num_requests", "num_ok", "ttft_s", "tpot_s", "jct_s")}


def summarize_turns(records: Sequence[TurnRecord]) -> dict:
    """`bench.metrics.summarize` over every turn, plus `by_turn`: the latencies of each turn
    index and of all later turns together ("later": turn 2 on)."""
    summary = summarize(records, run_duration(records))
    by_turn = {str(n): _turn_summary([r for r in records if r.turn == n])
               for n in sorted({r.turn for r in records})}
    by_turn["later"] = _turn_summary([r for r in records if r.turn >= 2])
    summary["by_turn"] = by_turn
    summary["num_conversations"] = len({r.conversation for r in records})
    summary["num_dropped_history_turns"] = sum(r.num_dropped_turns for r in records)
    return summary


def format_by_turn(summary: dict) -> str:
    """TTFT p50 / p99 (ms) and count per turn index."""
    lines = [f"{'turn':<6}{'n':>6}{'TTFT p50':>10}{'TTFT p99':>10}"]
    for name, row in summary["by_turn"].items():
        p50, p99 = row["ttft_s"]["p50"], row["ttft_s"]["p99"]
        cells = ["-" if v is None else f"{v * 1000:.1f}" for v in (p50, p99)]
        lines.append(f"{name:<6}{row['num_ok']:>6}{cells[0]:>10}{cells[1]:>10}")
    return "\n".join(lines)


def build_report(options: dict, model: str, conversations: Sequence[Conversation],
                 arrivals: Sequence[float], records: Sequence[TurnRecord]) -> dict:
    """The JSON report: options, summary (with `by_turn`), each conversation's plan (without
    text) and one entry per turn."""
    plans = [{"conversation": c.index, "arrival": arrival, "num_turns": len(c.turns),
              "think_times_s": [t.think_before_s for t in c.turns[1:]],
              "message_tokens": [t.num_message_tokens for t in c.turns],
              "max_tokens": [t.max_tokens for t in c.turns]}
             for c, arrival in zip(conversations, arrivals)]
    return {"options": options, "model": model, "summary": summarize_turns(records),
            "conversations": plans, "requests": [asdict(r) for r in records]}


def settings_of(options) -> MultiTurnOptions:
    """The multi-turn settings carried by a `bench.run.BenchOptions` or a
    `bench.compare.CompareOptions` (max_turns, think_time_s, think_time_dist,
    max_history_tokens, max_tokens and, where present, use_reference_lengths)."""
    return MultiTurnOptions(max_turns=options.max_turns, think_time_s=options.think_time_s,
                            think_time=options.think_time_dist,
                            max_history_tokens=options.max_history_tokens,
                            max_tokens=options.max_tokens,
                            use_reference_lengths=getattr(options, "use_reference_lengths", True))


async def warm_up(url: str, model: str, conversations: Sequence[Conversation],
                  temperature: float = 0.0, top_p: float | None = None) -> None:
    """The first turn of the first two conversations, at once (loads the server's code paths
    before a measured run)."""
    firsts = [Conversation(c.index, c.turns[:1]) for c in conversations[:2]]
    await run_conversations(url, model, firsts, [0.0] * len(firsts), temperature=temperature,
                            top_p=top_p, progress=False)
