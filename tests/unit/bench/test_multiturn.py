"""bench.multiturn: ShareGPT conversations replayed turn by turn against a local chat-completions
double (aiohttp on 127.0.0.1, in its own thread), the history cap, the per-turn summary and the
`splitserve bench` / `bench compare` wiring."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import pytest
from aiohttp import web

from bench.compare import aggregate, table
from bench.multiturn import (
    Conversation,
    MultiTurnOptions,
    Turn,
    TurnRecord,
    _Exchange,
    fit_history,
    plan_conversations,
    run_conversations,
    summarize_turns,
)
from bench.run import BenchOptions, add_bench_args, options_from_args, run_bench
from common.config import ConfigError
from common.sharegpt import load_split, normalize_prompt


class WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(len(text.split())))


class ChatDouble:
    """POST /v1/chat/completions: streams "reply <n> to <first words of the last message>" word by
    word (n numbers the requests), then usage and [DONE]. Keeps each request's messages and the
    perf_counter times it arrived and started its last event; `fail` (a predicate on the body)
    answers HTTP 500 instead."""

    def __init__(self, fail=None, chunk_delay_s: float = 0.0) -> None:
        self.fail, self.chunk_delay_s = fail, chunk_delay_s
        self.requests: list[dict] = []

    def __enter__(self) -> str:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *_exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        entry = {"body": body, "received": time.perf_counter(), "answer": ""}
        self.requests.append(entry)
        if self.fail is not None and self.fail(body):
            return web.json_response({"error": {"message": "boom"}}, status=500)
        last = body["messages"][-1]["content"]
        entry["answer"] = f"reply {len(self.requests)} to {' '.join(last.split()[:3])}"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        # OpenAI's shape: the role first with empty content, then text deltas.
        pieces = [""] + [word + " " for word in entry["answer"].split(" ")]
        pieces[-1] = pieces[-1].rstrip()
        for i, piece in enumerate(pieces):
            delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
            await self._event(response, {"choices": [{"index": 0, "delta": delta,
                                                      "finish_reason": None}]})
            await asyncio.sleep(self.chunk_delay_s)
        entry["finished"] = time.perf_counter()  # before [DONE]: no client can be ahead of it
        await self._event(response, {"choices": [], "usage": {
            "prompt_tokens": 10, "completion_tokens": len(pieces) - 1}})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    async def _event(response: web.StreamResponse, event: dict) -> None:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())


def _plan(count: int, **settings) -> list[Conversation]:
    options = MultiTurnOptions(**{"max_turns": 3, "think_time": "constant",
                                  "think_time_s": 0.0, **settings})
    return plan_conversations(WordTokenizer(), count, options, seed=5)


def _replay(url: str, conversations: list[Conversation], **kwargs) -> list[TurnRecord]:
    arrivals = [0.01 * i for i in range(len(conversations))]
    return asyncio.run(run_conversations(url, "m", conversations, arrivals, progress=False,
                                         **kwargs))


def _requests_of(double: ChatDouble, conversation: Conversation) -> list[dict]:
    first = conversation.turns[0].message
    return [r for r in double.requests if r["body"]["messages"][0]["content"] == first]


def test_each_turn_carries_the_answers_the_server_gave_before_it():
    conversations = _plan(3)
    double = ChatDouble()
    with double as url:
        records = _replay(url, conversations)
    assert len(records) == sum(len(c.turns) for c in conversations) and all(r.ok for r in records)
    for conversation in conversations:
        sent = _requests_of(double, conversation)
        assert len(sent) == len(conversation.turns) >= 2
        for k, request in enumerate(sent):
            messages = request["body"]["messages"]
            assert [m["role"] for m in messages] == ["user", "assistant"] * k + ["user"]
            assert [m["content"] for m in messages[0::2]] == \
                [t.message for t in conversation.turns[:k + 1]]
            # the assistant turns are what the server streamed, not ShareGPT's answers
            assert [m["content"] for m in messages[1::2]] == [r["answer"] for r in sent[:k]]
            assert request["body"]["stream"] and request["body"]["max_tokens"] == \
                conversation.turns[k].max_tokens


def test_turns_are_sequential_and_wait_their_think_time():
    conversations = _plan(3, think_time="exponential", think_time_s=0.03)
    double = ChatDouble(chunk_delay_s=0.002)
    with double as url:
        records = _replay(url, conversations)
    thinks = {t.think_before_s for c in conversations for t in c.turns[1:]}
    assert len(thinks) > 2 and all(t > 0 for t in thinks)  # seeded draws, not a constant
    for conversation in conversations:
        own = [r for r in records if r.conversation == conversation.index]
        assert [r.turn for r in own] == list(range(1, len(conversation.turns) + 1))
        for before, after, turn in zip(own, own[1:], conversation.turns[1:]):
            assert after.think_time_s == turn.think_before_s
            # sent no earlier than the previous answer's end plus its think time
            assert after.send_time >= before.send_time + before.jct + turn.think_before_s - 1e-9
        served = _requests_of(double, conversation)
        for before, after in zip(served, served[1:]):
            assert after["received"] > before["finished"]  # the server saw them one at a time


def test_a_failed_turn_ends_its_conversation_only():
    conversations = _plan(2)
    victim = conversations[0].turns[0].message
    double = ChatDouble(fail=lambda body: len(body["messages"]) == 3
                        and body["messages"][0]["content"] == victim)
    with double as url:
        records = _replay(url, conversations)
    failed = [r for r in records if r.conversation == 0]
    assert [(r.turn, r.ok) for r in failed] == [(1, True), (2, False)]
    assert "HTTP 500: boom" in failed[1].error
    assert [r.ok for r in records if r.conversation == 1] == [True] * len(conversations[1].turns)


def test_conversations_come_from_the_bench_range_in_seeded_order():
    split = load_split()
    bench_firsts = {normalize_prompt(p) for _, p, _ in split["bench"].first_turns}
    bench_owned = {normalize_prompt(p) for _, p, _ in split["bench"].all_turns}
    others = {normalize_prompt(p) for name in ("train", "eval")
              for _, p, _ in split[name].all_turns}
    conversations = _plan(30, max_turns=4)
    assert all(2 <= len(c.turns) <= 4 for c in conversations)
    for conversation in conversations:
        texts = [normalize_prompt(t.message) for t in conversation.turns]
        assert texts[0] in bench_firsts
        assert set(texts) <= bench_owned and not set(texts) & others
    assert _plan(30, max_turns=4) == conversations
    other_seed = plan_conversations(WordTokenizer(), 30, MultiTurnOptions(), seed=6)
    assert [c.turns[0].message for c in other_seed] != [c.turns[0].message
                                                        for c in conversations]


def test_long_messages_end_a_conversation_and_budgets_follow_the_reference():
    chat = [{"from": "human", "value": "a b"}, {"from": "gpt", "value": "x " * 50},
            {"from": "human", "value": "c d e"}, {"from": "gpt", "value": "y"},
            {"from": "human", "value": "w " * 40}, {"from": "gpt", "value": "z"}]
    options = MultiTurnOptions(max_message_tokens=10, max_history_tokens=100, max_tokens=20,
                               think_time="constant", think_time_s=0.5)
    (plan,) = plan_conversations(WordTokenizer(), 1, options, seed=0, conversations=[chat])
    assert [t.message for t in plan.turns] == ["a b", "c d e"]
    assert [t.max_tokens for t in plan.turns] == [20, 1]  # the replies' lengths, capped
    assert [t.think_before_s for t in plan.turns] == [0.0, 0.5]
    with pytest.raises(ConfigError, match="only 0 of 1"):
        plan_conversations(WordTokenizer(), 1, MultiTurnOptions(min_turns=3), seed=0,
                           conversations=[chat[:4]])


def test_the_history_cap_leaves_out_the_oldest_turns():
    history = [_Exchange(f"u{i}", 100, f"a{i}", 50) for i in range(3)]
    turn = Turn("now", 10, 16, 0.0)
    messages, estimate, dropped = fit_history(history, turn, max_history_tokens=10_000)
    assert dropped == 0 and len(messages) == 7
    # the fixed part with the new message (48) leaves room for one exchange (162) in 300
    messages, estimate, dropped = fit_history(history, turn, max_history_tokens=300)
    assert dropped == 2 and estimate <= 300
    assert [m["content"] for m in messages] == ["u2", "a2", "now"]
    with pytest.raises(ConfigError):
        MultiTurnOptions(max_message_tokens=1490, max_history_tokens=1500)


def _record(conversation: int, turn: int, ttft: float) -> TurnRecord:
    return TurnRecord(index=0, send_time=float(turn), ttft=ttft, jct=ttft + 0.5,
                      token_times=[turn + ttft, turn + ttft + 0.5], output_tokens=2,
                      conversation=conversation, turn=turn)


def test_the_summary_reports_ttft_by_turn_index():
    records = [_record(c, t, ttft) for c, t, ttft in
               [(0, 1, 0.1), (0, 2, 0.4), (1, 1, 0.3), (1, 2, 0.6), (1, 3, 0.8)]]
    summary = summarize_turns(records)
    by_turn = summary["by_turn"]
    assert list(by_turn) == ["1", "2", "3", "later"]
    assert by_turn["1"]["ttft_s"]["p50"] == pytest.approx(0.2)
    assert by_turn["later"]["num_ok"] == 3 and by_turn["later"]["ttft_s"]["p50"] == 0.6
    assert summary["num_ok"] == 5 and summary["num_conversations"] == 2
    result = aggregate([summary, summary])
    assert result["TTFT p50 turn 1"]["mean"] == pytest.approx(200.0)
    assert "TTFT p99 later turns" in table({"sys": result}).splitlines()[0]
    plain = aggregate([{"ttft_s": {"mean": 0.1}, "num_errors": 0}])
    assert "TTFT p50 turn 1" not in plain and "turn 1" not in table({"s": plain})


def test_splitserve_bench_runs_the_multiturn_workload(tmp_path, default_model):
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--workload", "multiturn", "--num-requests", "2", "--rate",
                              "inf", "--max-turns", "2", "--think-time", "0.01",
                              "--max-history-tokens", "1000", "--tokenizer",
                              str(default_model.hf_dir), "--out", str(out)])
    options = options_from_args(args)
    assert (options.workload, options.max_turns, options.think_time_s,
            options.max_history_tokens) == ("multiturn", 2, 0.01, 1000)
    double = ChatDouble()
    with double as url:
        report = run_bench(BenchOptions(**{**options.__dict__, "url": url, "model": "m"}))
    assert json.loads(out.read_text())["summary"] == report["summary"]
    assert [(r["conversation"], r["turn"]) for r in report["requests"]] == \
        [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert report["summary"]["by_turn"]["2"]["num_ok"] == 2 and len(double.requests) == 4
    with pytest.raises(ConfigError):
        BenchOptions(workload="multiturn", max_turns=0)


def test_bench_compare_replays_multiturn_conversations(default_model):
    from bench import compare

    options = compare.CompareOptions(workload="multiturn", num_requests=2, max_turns=2,
                                     think_time_s=0.0, rate=10.0)
    conversations, ignore_eos = compare.workload(options, seed=0)
    assert [len(c.turns) for c in conversations] == [2, 2] and not ignore_eos
    double = ChatDouble()
    with double as url:
        asyncio.run(compare._warm_up(url, "m", conversations, options))
        assert len(double.requests) == 2  # the first turns only
        summary = compare._one_run(url, "m", conversations, ignore_eos, 0, options, None)
    assert summary["num_ok"] == 4 and summary["by_turn"]["later"]["num_ok"] == 2
    assert summary["slowest_ttft"][0]["prompt_tokens"] > 0
    assert aggregate([summary])["TTFT p99 later turns"]["mean"] > 0
