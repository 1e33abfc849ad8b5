"""`splitserve bench compare`: the systems' flags per layout, and the seed aggregation."""

from __future__ import annotations

import pytest

from bench.compare import CompareOptions, aggregate, system_args, table


def threads_and_count(args: list[str]) -> tuple[str, str]:
    return args[args.index("--coupled") + 1], args[args.index("--threads-per-instance") + 1]


@pytest.mark.parametrize("layout, expected", [
    ("equal", ("1", "2")), ("replicas", ("2", "1")), ("paper", ("1", "1"))])
def test_coupled_layouts_share_the_cores_as_documented(layout, expected):
    args = system_args("sarathi", CompareOptions(layout=layout))
    assert threads_and_count(args) == expected
    assert args[args.index("--policy") + 1] == "sarathi"


def test_the_disaggregated_cluster_gets_one_core_per_instance_in_every_layout():
    for layout in ("equal", "replicas", "paper"):
        args = system_args("disagg", CompareOptions(layout=layout))
        assert args[args.index("--prefill") + 1] == args[args.index("--decode") + 1] == "1"
        assert args[args.index("--threads-per-instance") + 1] == "1"


def test_naive_fastserve_is_fastserve_without_skip_join():
    args = system_args("fastserve-naive", CompareOptions())
    assert args[args.index("--policy") + 1] == "fastserve"
    assert "skip_join=0" in args


def test_custom_systems_override_and_vllm_cpu_is_external():
    options = CompareOptions(custom=("fcfs=--prefill-policy fcfs --prefill 2",))
    assert system_args("fcfs", options) == ["--prefill-policy", "fcfs", "--prefill", "2"]
    assert system_args("vllm-cpu", options) is None
    with pytest.raises(ValueError, match="unknown system 'nope'"):
        system_args("nope", options)


def run(ttft_mean: float, tokens_per_s: float, errors: int = 0) -> dict:
    return {"ttft_s": {"mean": ttft_mean, "p50": ttft_mean, "p99": 2 * ttft_mean},
            "throughput": {"output_tokens_per_s": tokens_per_s}, "num_errors": errors}


def test_aggregate_reports_mean_and_spread_over_seeds_in_display_units():
    result = aggregate([run(0.1, 100.0), run(0.3, 110.0, errors=1)])
    assert result["TTFT mean"]["mean"] == pytest.approx(200.0)  # seconds shown as ms
    assert result["TTFT mean"]["std"] == pytest.approx(141.42, rel=1e-3)
    assert result["output tok/s"]["mean"] == pytest.approx(105.0)
    assert result["TPOT p50"] == {"mean": None, "std": 0.0}  # absent in every run
    assert result["errors"] == 1
    row = table({"sys": result}).splitlines()[2]
    assert row.startswith("| sys | 200.0 ± 141.4 |") and row.endswith("| 1 |")


def test_a_seed_where_every_request_failed_still_prints_a_line():
    from bench.compare import _line

    line = _line({"num_ok": 0, "num_errors": 3, "errors": {"HTTP 503": 3},
                  "ttft_s": {"p50": None, "p99": None}})
    assert line.startswith("no request succeeded; 3 errors")


def test_the_ttft_tail_names_its_requests_and_their_prompt_lengths():
    from bench.client import RequestRecord
    from bench.compare import slowest_ttft
    from bench.workload import BenchRequest

    requests = [BenchRequest(f"p{i}", tokens, 16, 16)
                for i, tokens in enumerate([10, 900, 40, 300])]
    records = [RequestRecord(0, 0.0, ttft=0.05), RequestRecord(1, 1.0, ttft=2.5),
               RequestRecord(2, 1.1, ttft=None, error="boom"), RequestRecord(3, 1.2, ttft=0.9)]
    tail = slowest_ttft(records, requests, count=2)
    assert [t["index"] for t in tail] == [1, 3]
    assert [t["prompt_tokens"] for t in tail] == [900, 300]
    assert tail[0]["longest_prompt_tokens"] == 900 and tail[0]["ttft_s"] == 2.5


def test_prefix_report_counts_the_run_only_and_sums_instances():
    from bench.compare import _prefix_line, prefix_report

    def view(p_query, p_hit, d_skipped, d_local):
        return {"instances": [
            {"instance_id": "prefill-0", "prefix_cache": {"query_tokens": p_query,
                                                          "hit_tokens": p_hit}},
            {"instance_id": "decode-0", "prefix_cache": {
                "query_tokens": 0, "hit_tokens": 0, "blocks_read": 10,
                "blocks_skipped": d_skipped, "local_prefills": d_local}}]}

    report = prefix_report(view(100, 20, 2, 1), view(500, 220, 6, 4))
    assert report["instances"]["prefill-0"]["hit_tokens"] == 200
    assert report["total"] == {"query_tokens": 400, "hit_tokens": 200, "blocks_read": 0,
                               "blocks_skipped": 4, "local_prefills": 3, "hit_rate": 0.5}
    assert "hit rate 50.0%, 3 local prefills, 4 of 4 blocks not read" in _prefix_line(
        {"prefix_cache": report})


def test_flips_during_a_run_are_those_cluster_lists_only_after_it():
    from bench.compare import flips_during

    old = {"flip_id": "a", "to_role": "decode"}
    new = {"flip_id": "b", "to_role": "prefill"}
    assert flips_during({"flips": [old]}, {"flips": [old, new]}) == [new]
    assert flips_during({"flips": None}, {"flips": [old]}) == [old]
    assert flips_during({}, {}) == []


def test_policy_counters_over_a_run_name_only_what_moved():
    from bench.compare import _policy_line, counters_during

    def view(preemptions, swap_outs, entered_q1):
        return {"instances": [
            {"instance_id": "coupled-0", "policy": {"preemptions": preemptions,
                                                   "swap_outs": swap_outs,
                                                   "entered_q1": entered_q1}},
            {"instance_id": "coupled-1", "policy": {"preemptions": 1, "swap_outs": 0,
                                                   "entered_q1": entered_q1}}]}

    report = counters_during(view(2, 1, 5), view(5, 1, 9), "policy")
    assert report["instances"]["coupled-0"] == {"preemptions": 3, "swap_outs": 0,
                                                "entered_q1": 4}
    assert report["total"] == {"entered_q1": 8, "preemptions": 3, "swap_outs": 0}
    assert _policy_line({"policy": report}) == "; policy entered_q1 8, preemptions 3"
    assert _policy_line({"policy": counters_during(view(2, 1, 5), view(2, 1, 5), "policy")}) == ""
    # an instance that came up during the run counts from zero; one without counters adds none
    late = {"instances": [*view(2, 1, 5)["instances"], {"instance_id": "prefill-0"}]}
    assert counters_during({"instances": []}, late, "policy")["total"]["preemptions"] == 3
