"""`splitserve bench stack-ceiling`: its options, CPU accounting and report (no cluster)."""

from __future__ import annotations

import pytest

from bench import cpu_share, stack_report
from bench.stack_ceiling import LAYOUTS, StackOptions, engine_settings, parse_args, up_args


def test_defaults_are_the_issue_workload():
    options = parse_args([])
    assert options.layouts == ("1P+1D", "co-located") and options.modes == ("greedy", "sampled")
    assert options.seeds == (0, 1, 2) and options.num_requests == 128
    assert options.concurrency == 32 and options.max_tokens == 64 and options.threads == 1
    # the engine alone decodes at the served concurrency, at a served sequence's mean context
    settings = engine_settings(options)
    assert settings.batch == 32 and settings.context == 310 + 32


def test_flags_and_up_flags_pass_through():
    options = parse_args(["--layouts", "co-located", "--modes", "sampled", "--seeds", "2",
                          "--threads", "2", "--out", "x.json", "--transfer", "shm"])
    assert options.layouts == ("co-located",) and options.modes == ("sampled",)
    assert options.seeds == (0, 1) and options.out == "x.json"
    args = up_args("co-located", "/m", options)
    assert args[:len(LAYOUTS["co-located"])] == LAYOUTS["co-located"]
    assert args[args.index("--threads-per-instance") + 1] == "2"
    assert args[args.index("--model") + 1] == "/m" and args[-2:] == ["--transfer", "shm"]


@pytest.mark.parametrize("argv", [["--layouts", "2P+2D"], ["--modes", "beam"], ["--seeds", "0"],
                                  ["--concurrency", "0"], ["--threads", "0"],
                                  ["--min-prompt-tokens", "400"], ["--chunk-size", "16"]])
def test_bad_options_stop_with_a_message(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_disaggregated_and_co_located_layouts():
    options = StackOptions()
    disagg = up_args("1P+1D", "/m", options)
    assert disagg[disagg.index("--prefill") + 1] == disagg[disagg.index("--decode") + 1] == "1"
    colo = up_args("co-located", "/m", options)
    assert colo[colo.index("--coupled") + 1] == "1" and colo[colo.index("--policy") + 1] == \
        "sarathi"


# -- CPU accounting -------------------------------------------------------------------------------
def test_process_ticks_are_read_after_the_command_name():
    # comm may hold spaces and ')': fields are counted after the last ')'
    stat = "123 (py (worker) 1) S 1 123 123 0 -1 4194560 10 0 0 0 250 75 0 0 20 0 3 0"
    assert cpu_share.parse_cpu_ticks(stat) == 325


def test_machine_ticks_leave_out_idle_and_iowait():
    stat = "cpu  100 5 30 1000 7 1 2 3 0 0\ncpu0 1 1 1 1 1 1 1 1 0 0\n"
    assert cpu_share.parse_machine_ticks(stat) == 100 + 5 + 30 + 1 + 2 + 3


def test_shares_are_cores_over_the_wall_time_and_others_the_rest():
    before = {"machine": 10.0, "client": 1.0, "gateway": 2.0}
    after = {"machine": 13.0, "client": 1.5, "gateway": 3.0}
    shares = cpu_share.cpu_shares(before, after, wall_s=2.0)
    assert shares == {"machine": 1.5, "client": 0.25, "gateway": 0.5, "others": 0.75}


def test_a_process_gone_has_no_share_and_others_is_then_unknown():
    shares = cpu_share.cpu_shares({"machine": 0.0, "x": 1.0}, {"machine": 1.0, "x": None}, 1.0)
    assert shares["x"] is None and shares["others"] is None
    assert cpu_share.cpu_shares({"x": 1.0}, {"x": 2.0}, 0.0) == {"x": None}


def test_this_process_reads_its_own_cpu():
    assert cpu_share.cpu_seconds(__import__("os").getpid()) >= 0.0
    assert cpu_share.cpu_seconds(2**22 + 12345) is None  # beyond pid_max: no such process


# -- report ---------------------------------------------------------------------------------------
def _run(layout: str, mode: str, served: float, alone: float, client: float) -> dict:
    shares = {"machine": 1.5, "client": client, "gateway": 0.3, "others": 0.01}
    return {"layout": layout, "mode": mode, "served_tokens_per_s": served, "num_errors": 0,
            "engine_alone": {"greedy_tokens_per_s": alone, "sampled_tokens_per_s": alone / 2},
            "cpu_share": shares,
            "cpu_us_per_token": stack_report.us_per_token(shares, 2.0, 4000)}


def test_ratio_is_served_over_the_engine_alone():
    assert stack_report.ratio(3000.0, 5000.0) == pytest.approx(0.6)
    assert stack_report.ratio(None, 5000.0) is None and stack_report.ratio(1.0, 0.0) is None


def test_cpu_per_token_is_the_share_times_wall_over_tokens():
    us = stack_report.us_per_token({"client": 0.2, "x": None}, wall_s=2.0, output_tokens=4000)
    assert us["client"] == pytest.approx(100.0) and us["x"] is None
    assert stack_report.us_per_token({"client": 0.2}, 2.0, 0) == {"client": None}


def test_each_cell_is_averaged_over_seeds_against_its_own_engine_measurement():
    runs = [_run("1P+1D", "greedy", 3000, 5000, 0.2), _run("1P+1D", "greedy", 3300, 5500, 0.4),
            _run("co-located", "greedy", 2000, 5000, 0.1)]
    rows = stack_report.aggregate(runs)
    assert [(r["layout"], r["mode"]) for r in rows] == [("1P+1D", "greedy"),
                                                        ("co-located", "greedy")]
    first = rows[0]
    assert first["ratio"]["mean"] == pytest.approx(0.6) and first["ratio"]["std"] == 0.0
    assert first["served_tokens_per_s"]["mean"] == 3150 and first["alone_tokens_per_s"]["min"] \
        == 5000
    assert first["cpu_share"]["client"] == pytest.approx(0.3)
    assert first["cpu_us_per_token"]["client"] == pytest.approx(150.0)
    table = stack_report.table(rows)
    assert "| 1P+1D | greedy | 3150 ± 212 | 5250 ± 354 | 0.60 ± 0.00 |" in table
    assert "client 0.30 (150)" in table and "others 0.01" in table and "machine" not in table
