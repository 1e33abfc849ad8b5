"""One request alone: its TTFT and JCT are the cost model's terms, added up by hand."""

from __future__ import annotations

import pytest

from simulator.cluster import SimCluster
from simulator.run import Slo, simulate, simulation_section
from simulator.workload import SimRequest

from unit.simulator.sim_fixtures import BANDWIDTH, COSTS, LATENCY, coupled, layout

ARRIVAL = 0.05  # after the monitor's first view (t = 0) has told the prefill of the decode


def base(tokens: int) -> float:
    return 0.010 + 0.0001 * (tokens - 1)


def decode_steps(prompt: int, output: int) -> float:
    """Output tokens 2..n, one per decode step of a batch of one, each attending to the prompt
    and the tokens before it (row 1 ms, 1 us per cached token, 10 ns per pair)."""
    return sum(base(1) + 0.001 + (prompt + k) * (1e-6 + 1e-8) for k in range(output - 1))


def one(prompt: int, output: int) -> list[SimRequest]:
    return [SimRequest("r0", ARRIVAL, prompt, output, output)]


def trace_of(lay, requests):
    cluster = SimCluster(lay, COSTS, requests)
    cluster.run()
    return cluster.traces["r0"]


def test_disaggregated_ttft_is_the_prefill_chunks_and_jct_adds_the_transfer_and_decodes():
    trace = trace_of(layout(), one(100, 5))
    # ChunkSize 64: a chunk of 64 fresh tokens, then 36 attending to those 64, sampling
    prefill = base(64) + base(36) + 0.001 + 64 * 1e-6 + 64 * 36 * 1e-8
    assert trace.token_times[0] - ARRIVAL == pytest.approx(prefill)
    transfer = LATENCY + 100 * 1000 / BANDWIDTH  # the prompt's KV over the link
    assert trace.finish - ARRIVAL == pytest.approx(prefill + transfer + decode_steps(100, 5))
    assert len(trace.token_times) == 5 and trace.error is None


def test_co_located_jct_is_the_prefill_and_the_decodes_without_a_transfer():
    trace = trace_of(coupled("sarathi"), one(100, 5))
    prefill = base(100) + 0.001  # within the token budget: one forward
    assert trace.token_times[0] - ARRIVAL == pytest.approx(prefill)
    assert trace.finish - ARRIVAL == pytest.approx(prefill + decode_steps(100, 5))


def test_a_request_that_ends_with_its_first_token_never_reaches_a_decode_instance():
    report = simulate(layout(), COSTS, one(10, 1))
    assert report["num_ok"] == 1 and report["total_output_tokens"] == 1
    assert report["ttft_s"]["mean"] == pytest.approx(base(10) + 0.001)
    assert report["simulation"]["transfers"]["count"] == 0


def test_the_report_carries_the_bench_metrics_of_that_request():
    report = simulate(layout(), COSTS, one(100, 5))
    ttft = report["ttft_s"]["mean"]
    jct = report["jct_s"]["mean"]
    assert report["tpot_s"]["mean"] == pytest.approx((jct - ttft) / 4)
    assert report["duration_s"] == pytest.approx(jct)
    assert report["throughput"]["output_tokens_per_s"] == pytest.approx(5 / jct)
    # the first gap holds the 102 ms transfer: over a 100 ms TBT SLO, within 200 ms
    assert report["goodput"]["num_met"] == 0
    relaxed = simulate(layout(), COSTS, one(100, 5), slo=Slo(tbt_s=0.2))
    assert relaxed["goodput"]["num_met"] == 1 and relaxed["goodput"]["fraction"] == 1.0


@pytest.mark.parametrize("make", [layout, lambda: coupled("vllm")])
def test_the_request_latency_delays_every_token_of_a_lone_request_by_itself(make):
    """Layout.request_latency_s (simulator.request_path): the stack's own latency per request
    shifts a lone request's TTFT and JCT by exactly that much and nothing else."""
    from dataclasses import replace
    plain = trace_of(make(), one(100, 5))
    delayed = trace_of(replace(make(), request_latency_s=0.025), one(100, 5))
    assert [t - 0.025 for t in delayed.token_times] == pytest.approx(plain.token_times)
    assert delayed.finish - 0.025 == pytest.approx(plain.finish)


@pytest.mark.parametrize("make", [layout, lambda: coupled("vllm")])
def test_the_wake_up_lengthens_the_forward_an_idle_instance_starts_and_no_other(make):
    """Layout.wake_s: a lone request finds every instance idle, so its first forward on each
    instance takes that much longer (on the prefill instance its first chunk; on the decode
    instance its first step) and the forwards right after them do not."""
    from dataclasses import replace
    plain = trace_of(make(), one(100, 5))
    woken = trace_of(replace(make(), wake_s=0.004), one(100, 5))
    wakes = 1 if make is layout else 0  # the decode instance waits for the KV: it wakes again
    assert woken.token_times[0] - plain.token_times[0] == pytest.approx(0.004)
    gaps = [b - a for a, b in zip(woken.token_times, woken.token_times[1:])]
    plain_gaps = [b - a for a, b in zip(plain.token_times, plain.token_times[1:])]
    assert gaps[0] - plain_gaps[0] == pytest.approx(0.004 * wakes)
    assert gaps[1:] == pytest.approx(plain_gaps[1:])
    # Layout.wake_prompt_s: the prompt's first chunk wakes by that instead; a decode step not
    prompted = trace_of(replace(make(), wake_s=0.004, wake_prompt_s=0.010), one(100, 5))
    assert prompted.token_times[0] - plain.token_times[0] == pytest.approx(0.010)
    assert [b - a for a, b in zip(prompted.token_times, prompted.token_times[1:])] == \
        pytest.approx(gaps)


def test_the_handoff_delays_a_disaggregated_request_after_its_first_token_by_itself():
    """Layout.handoff_s: each transfer takes that much longer; the first token (from the
    prefill instance) does not move, every later one moves by exactly that much."""
    from dataclasses import replace
    plain = trace_of(layout(), one(100, 5))
    handed = trace_of(replace(layout(), handoff_s=0.03), one(100, 5))
    assert handed.token_times[0] == pytest.approx(plain.token_times[0])
    assert [t - 0.03 for t in handed.token_times[1:]] == pytest.approx(plain.token_times[1:])


def test_the_handoff_per_token_delays_a_longer_prompt_more():
    """Layout.handoff_per_token_s: the transfer of a P-token prompt takes P times that longer,
    on top of the fixed part."""
    from dataclasses import replace
    for prompt in (100, 400):
        plain = trace_of(layout(), one(prompt, 5))
        handed = trace_of(replace(layout(), handoff_s=0.01, handoff_per_token_s=1e-4),
                          one(prompt, 5))
        assert handed.token_times[0] == pytest.approx(plain.token_times[0])
        moved = 0.01 + prompt * 1e-4
        assert [t - moved for t in handed.token_times[1:]] == pytest.approx(
            plain.token_times[1:])


def test_a_prompt_holding_an_earlier_one_finds_its_blocks_cached_when_ids_are_known():
    first = tuple(range(100, 200))  # 100 tokens: six full blocks of 16
    second = first + tuple(range(500, 530))  # the next turn of the same conversation
    later = ARRIVAL + 1.0  # the first request is long done

    def second_ttft(ids: bool) -> float:
        requests = [SimRequest("r0", ARRIVAL, 100, 2, 2, prompt_token_ids=first if ids else None),
                    SimRequest("r1", later, 130, 2, 2, prompt_token_ids=second if ids else None)]
        cluster = SimCluster(layout(), COSTS, requests)
        cluster.run()
        cached = simulation_section(cluster, 1.0, 1.0)["prefix_cache"]["hits"]
        # the report sums the hits: the six blocks on the prefill and on the decode instance
        assert cached == (2 * 96 if ids else 0)
        return cluster.traces["r1"].token_times[0] - later

    # made-up ids are unique per request: the whole prompt, in chunks of 64, 64 and 2
    assert second_ttft(False) == pytest.approx(
        2 * base(64) + base(2) + 0.001 + (64 + 128) * 1e-6 + (64 * 64 + 128 * 2) * 1e-8)
    # the real ids: the six blocks the first prompt filled are cached, 34 tokens are new
    assert second_ttft(True) == pytest.approx(base(34) + 0.001 + 96 * 1e-6 + 96 * 34 * 1e-8)


def test_bench_requests_take_their_prompts_token_ids_from_bench_s_tokenizer():
    from bench.workload import BenchRequest
    from common.config import ConfigError
    from simulator.workload import from_bench

    class Words:  # one token per word, as a stand-in for bench's tokenizer
        def encode(self, text: str) -> list[int]:
            return [len(word) for word in text.split()]

    requests = [BenchRequest("a bb ccc", 3, 4, 4), BenchRequest("a bb ccc dddd", 4, 4, 4)]
    made = from_bench(requests, [0.0, 1.0], Words())
    assert [r.prompt_ids(i) for i, r in enumerate(made)] == [[1, 2, 3], [1, 2, 3, 4]]
    assert from_bench(requests, [0.0, 1.0])[1].prompt_ids(1)[0] != made[1].prompt_ids(1)[0]
    with pytest.raises(ConfigError, match="not the tokenizer bench used"):
        from_bench([BenchRequest("a bb", 3, 4, 4)], [0.0], Words())
