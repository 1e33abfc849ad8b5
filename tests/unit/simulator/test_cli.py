"""`splitserve simulate`: `up`'s flags describe the cluster, the report is written as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from control_plane.cli import build_parser, main
from control_plane.cli_args import cluster_instance_config, gateway_config
from simulator.cli import layout_from_args

ROOT = Path(__file__).resolve().parents[3]
RECORD = ROOT / "docs/benchmarks/profile-cpu-zen4-s5/profile.json"


def simulate(tmp_path, *flags) -> dict:
    out = tmp_path / "report.json"
    assert main(["simulate", "--num-requests", "20", "--rate", "5", "--out", str(out),
                 *flags]) == 0
    return json.loads(out.read_text())


def test_a_disaggregated_run_from_published_figures_and_its_saved_cost_model(tmp_path, capsys):
    report = simulate(tmp_path, "--hardware", "h100-llama2-7b", "--prefill", "2", "--decode",
                      "2", "--local-prefill", "off", "--save-costs", str(tmp_path / "c.json"))
    assert report["num_ok"] == 20 and report["simulation"]["transfers"]["count"] == 20
    assert report["simulation"]["cost_model"].startswith("PUBLISHED FIGURES")
    assert "TTFT" in capsys.readouterr().out
    again = simulate(tmp_path, "--costs", str(tmp_path / "c.json"), "--prefill", "2",
                     "--decode", "2", "--local-prefill", "off")
    assert again["ttft_s"] == report["ttft_s"] and again["jct_s"] == report["jct_s"]
    planned = simulate(tmp_path, "--costs", str(tmp_path / "c.json"), "--prefill", "2",
                       "--decode", "2", "--local-prefill", "off", "--plan-every-forward")
    assert planned["tbt_s"] == report["tbt_s"] and planned["jct_s"] == report["jct_s"]
    assert planned["simulation"]["events"] > report["simulation"]["events"]  # no leaps


def test_a_co_located_run_on_a_fitted_cpu_profile(tmp_path):
    report = simulate(tmp_path, "--profile", str(RECORD), "--prefill", "0", "--decode", "0",
                      "--coupled", "2", "--policy", "vllm", "--workload", "synthetic",
                      "--prompt-median", "64", "--output-median", "16")
    assert report["num_ok"] == 20 and report["simulation"]["instances"]["final_roles"] == \
        {"coupled": 2}
    assert report["simulation"]["kv_check"] == {"leaked_blocks": 0, "errors": []}


def test_without_a_cost_model_it_says_how_to_get_one(tmp_path, capsys):
    assert main(["simulate", "--cache-dir", str(tmp_path), "--out",
                 str(tmp_path / "r.json")]) == 2
    assert "run `splitserve profile`" in capsys.readouterr().err


STACK_TIMES = {"--message-latency": "message_latency_s", "--turn-overhead": "turn_overhead_s",
               "--request-latency": "request_latency_s", "--wake": "wake_s",
               "--handoff": "handoff_s", "--handoff-per-token": "handoff_per_token_s"}


def test_each_stack_time_flag_reaches_its_layout_field():
    for i, (flag, field) in enumerate(STACK_TIMES.items()):
        args = build_parser().parse_args(["simulate", flag, f"0.00{i + 1}"])
        layout = layout_from_args(args, cluster_instance_config(args), gateway_config(args, 0))
        assert getattr(layout, field) == pytest.approx((i + 1) / 1000)
        assert all(getattr(layout, other) == 0.0 for other in STACK_TIMES.values()
                   if other != field)


def test_a_negative_stack_time_is_refused_in_one_line(tmp_path, capsys):
    assert main(["simulate", "--hardware", "h100-llama2-7b", "--handoff", "-0.5", "--out",
                 str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("splitserve simulate: error:") and "must be >= 0" in err
    assert "\n" not in err and not (tmp_path / "r.json").exists()


def test_shared_cores_reach_the_layout_and_slow_a_cluster_that_wants_more(tmp_path, capsys):
    args = build_parser().parse_args(["simulate", "--shared-cores", "2", "--core-threads", "1"])
    layout = layout_from_args(args, cluster_instance_config(args), gateway_config(args, 0))
    assert (layout.shared_cores, layout.core_threads) == (2, 1)
    flags = ("--hardware", "h100-llama2-7b", "--prefill", "1", "--decode", "2",
             "--local-prefill", "off")
    alone = simulate(tmp_path, *flags)
    shared = simulate(tmp_path, *flags, "--shared-cores", "1")
    assert shared["num_ok"] == alone["num_ok"] == 20
    assert shared["jct_s"]["mean"] > alone["jct_s"]["mean"]
    assert main(["simulate", "--hardware", "h100-llama2-7b", "--shared-cores", "0", "--out",
                 str(tmp_path / "r.json")]) == 2
    assert "shared_cores and core_threads must be >= 1" in capsys.readouterr().err
