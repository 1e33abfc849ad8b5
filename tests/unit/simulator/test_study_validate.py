"""The crossover study's pieces (its layouts, the load anchor, the paired verdicts of its
table) and the validation harness's case selection, profile choice and error arithmetic; no
real cluster is started here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import ConfigError
from simulator.hardware import hardware_costs
from simulator.study import anchor_rate, study_candidates
from simulator.study_plot import crossover_table
from simulator.validate import METRICS, errors, profile_for, select

from unit.simulator.test_cli import RECORD


def test_the_study_compares_three_ratios_a_flipping_split_and_two_policies():
    assert [c.label for c in study_candidates(8)] == [
        "2P:6D", "4P:4D", "6P:2D", "4P:4D+load-ratio", "vllm x8", "sarathi x8"]
    assert all(c.instances == 32 for c in study_candidates(32))


def test_the_load_anchor_falls_as_requests_get_heavier():
    costs = hardware_costs("h100-llama2-7b")
    light = anchor_rate(costs, [(100, 50)] * 4, 128)
    assert anchor_rate(costs, [(1000, 50)] * 4, 128) < light
    assert anchor_rate(costs, [(100, 400)] * 4, 128) < light
    assert anchor_rate(costs, [(100, 50)] * 4, 8) < light  # a smaller decode batch


def row(label: str, coupled: bool, per_seed: list[float], load: float = 10.0) -> dict:
    good = {"mean": sum(per_seed) / len(per_seed), "per_seed": per_seed}
    return {"candidate": label, "layout": {"num_coupled": 8 if coupled else 0},
            "offered_per_instance": load, "goodput_per_instance_by_slo": [good]}


def test_the_table_pairs_seeds_and_names_the_best_of_each_kind(tmp_path):
    rows = [row("4P:4D", False, [9.0, 9.5, 9.9]), row("2P:6D", False, [5.0, 5.0, 5.0]),
            row("sarathi x8", True, [8.0, 9.0, 9.8]), row("vllm x8", True, [1.0, 1.0, 1.0]),
            row("4P:4D", False, [3.0, 3.0, 3.0], 20.0), row("vllm x8", True, [4.0, 2.0, 5.0], 20.0)]
    data = {"workload": "LPLD", "anchor_rate": 10.0, "mean_lengths": [1, 1],
            "slos": [{"tbt_percentile": 99, "tbt_s": 0.1}], "rows": rows}
    (tmp_path / "crossover_LPLD.json").write_text(json.dumps(data))
    low, high = crossover_table(tmp_path)
    assert (low["by_slo"][0]["best_split"], low["by_slo"][0]["best_colocated"]) == \
        ("4P:4D", "sarathi x8")
    assert low["by_slo"][0]["verdict"] == "split wins"  # ahead on every seed, if narrowly
    assert high["by_slo"][0]["verdict"] == "not distinguishable"  # behind on one seed only
    assert high["load_x_anchor"] == 2.0


def test_cases_are_selected_by_pattern_from_the_matrix():
    assert len(select("*")) == 4 * 3 * 2 * 3
    one = select("1P1D:LPLD:low:0")
    assert [c.name for c in one] == ["1P1D-LPLD-low-s0"]
    assert {c.layout for c in select("*:Mixed:high:1")} == {"1P1D", "1P2D", "sarathi", "vllm"}
    assert len(select("1P1D:LPLD:low:0,1P1D:LPLD:*:0")) == 2  # no case twice
    with pytest.raises(ConfigError):
        select("2P2D:LPLD:low:0")


def test_a_sampled_case_runs_its_requests_sampled_and_is_named_apart(monkeypatch, capsys):
    import simulator.validate as v
    seen = []
    monkeypatch.setattr(v, "run_for_real", lambda name, *args: (
        seen.append((name, args[-1])), ({}, []))[1])
    monkeypatch.setattr(v, "record_cache_dir", lambda cache_dir, record: cache_dir)
    v.real_run(v.Case("1P1D", "HPLD", "low", 0, sampled=True), [], [], "cache", Path("logs"),
               "record")
    v.real_run(v.Case("1P1D", "HPLD", "low", 0), [], [], "cache", Path("logs"), "record")
    assert seen == [("1P1D-HPLD-low-s0-sampled", {"temperature": 0.7, "top_p": 0.95}),
                    ("1P1D-HPLD-low-s0", {})]
    v.main(["--cases", "1P1D:LPLD:low:0", "--sampled", "--dry-run", "--profile", str(RECORD)])
    assert capsys.readouterr().out.startswith("1P1D-LPLD-low-s0-sampled: ")


def test_a_case_uses_the_profile_measured_with_its_thread_count():
    record = json.loads(RECORD.read_text())
    one = {**record, "threads": 1}
    _, info = profile_for([("two", record), ("one", one)], threads=1)
    assert info["path"] == "one" and info["threads_match"]
    _, info = profile_for([("two", record)], threads=1)
    assert info["path"] == "two" and not info["threads_match"]  # used, and flagged


def test_errors_are_relative_to_the_real_run_and_checked_against_targets():
    real = {"ttft_s": {"mean": 0.1, "p99": 0.4}, "tpot_s": {"mean": 0.02},
            "jct_s": {"mean": 2.0}, "throughput": {"output_tokens_per_s": 100.0}}
    simulated = {"ttft_s": {"mean": 0.104, "p99": 0.5}, "tpot_s": {"mean": 0.0195},
                 "jct_s": {"mean": None}, "throughput": {"output_tokens_per_s": 90.0}}
    result = errors(real, simulated)
    assert set(result) == set(METRICS)
    assert result["ttft_mean"]["relative_error"] == pytest.approx(0.04)
    assert result["ttft_mean"]["within_target"]
    assert result["ttft_p99"]["relative_error"] == pytest.approx(0.25)
    assert not result["ttft_p99"]["within_target"]  # 25% > 15%
    assert result["tpot_mean"]["within_target"]  # -2.5%
    assert result["jct_mean"]["relative_error"] is None and not result["jct_mean"]["within_target"]
    assert result["throughput_tokens"]["relative_error"] == pytest.approx(-0.1)


def test_a_calibration_seed_must_be_held_out_from_the_cases():
    from simulator.validate import main

    with pytest.raises(ConfigError, match="calibration seed"):
        main(["--cases", "1P1D:LPLD:low:0", "--calibration-seed", "1",
              "--profile", str(RECORD)])


def test_an_earlier_real_run_is_reused_only_for_the_same_rate_and_count(tmp_path):
    from simulator.validate import Case, earlier_real

    case = Case("sarathi", "LPLD", "low", 0)
    assert earlier_real(case, 0.5, 40, tmp_path) is None and earlier_real(case, 0.5, 40, None) \
        is None
    (tmp_path / f"{case.name}.json").write_text(json.dumps(
        {"num_requests": 40, "rate": 0.5, "real": {"summary": {"ttft_s": {"mean": 1.0}}}}))
    assert earlier_real(case, 0.5, 40, tmp_path)["summary"]["ttft_s"]["mean"] == 1.0
    with pytest.raises(ConfigError, match="not 40 at 0.600"):
        earlier_real(case, 0.6, 40, tmp_path)
    from simulator.validate import earlier_rate  # --rate-from-real: the run's own rate

    assert earlier_rate(case, tmp_path) == 0.5 and earlier_rate(case, None) is None
    assert earlier_real(case, earlier_rate(case, tmp_path), 40, tmp_path) is not None


def test_forward_time_compares_the_instances_busy_seconds_and_is_printed():
    from simulator.validate import Case, forward_time, loop_counters
    from simulator.validation_table import format_errors

    view = {"instances": [
        {"instance_id": "prefill-0", "busy_seconds": 1.5, "num_forwards": 10,
         "forward_turn_seconds": 1.6},
        {"instance_id": "decode-0", "busy_seconds": 2.5, "num_forwards": 30,
         "forward_turn_seconds": 2.8}, {"instance_id": "x"}]}
    real = loop_counters(view)
    assert real == pytest.approx({"busy_s": 4.0, "num_forwards": 40, "turn_s": 4.4})
    simulated = {"summary": {"simulation": {"instances": {"busy_instance_s": 3.0},
                                            "forwards": 38}}}
    diagnostic = forward_time(real, simulated)
    assert diagnostic["relative_error"] == pytest.approx(-0.25)
    assert diagnostic["real_overhead_per_forward_s"] == pytest.approx(0.01)  # 0.4 s / 40
    assert (diagnostic["real_forwards"], diagnostic["simulated_forwards"]) == (40, 38)
    earlier = forward_time({}, simulated)  # recorded before the counters
    assert earlier["relative_error"] is None and earlier["real_overhead_per_forward_s"] is None
    result = {"num_requests": 4, "rate": 1.0, "real": {"uptime_before": "up"},
              "errors": errors({"ttft_s": {"mean": 1.0}}, {"ttft_s": {"mean": 1.1}}),
              "forward_time": diagnostic}
    text = format_errors(Case("vllm", "LPLD", "low", 0), result)
    assert "-25.0% (diagnostic)" in text and "10.0 ms per real forward" in text


def test_the_validation_table_marks_misses_and_skips_calibration_files(tmp_path):
    from simulator.validation_table import table

    def case(ttft_sim: float, busy_error):
        return {"rate": 0.64, "errors": errors({"ttft_s": {"mean": 1.0, "p99": 2.0}},
                                               {"ttft_s": {"mean": ttft_sim, "p99": 2.0}}),
                "forward_time": {"relative_error": busy_error}}

    (tmp_path / "vllm-LPLD-low-s0.json").write_text(json.dumps(case(1.02, -0.031)))
    (tmp_path / "vllm-LPLD-low-s1.json").write_text(json.dumps(case(1.5, None)))
    (tmp_path / "calibration-vllm-LPLD-low-s9.json").write_text("{}")
    lines = table([tmp_path]).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| case | req/s | TTFT mean")
    assert lines[2].startswith("| vllm-LPLD-low-s0 | 0.64 | +2.0% | +0.0% | - |")
    assert lines[2].endswith("| -3.1% | - |")
    assert "+50.0% *" in lines[3] and lines[3].endswith("| - | - |")
    failed = {**case(1.02, None), "real": {"summary": {"num_errors": 1}}}
    (tmp_path / "vllm-LPLD-low-s0.json").write_text(json.dumps(failed))
    assert table([tmp_path]).splitlines()[2].startswith(
        "| vllm-LPLD-low-s0 [1 real request failed] | 0.64 |")


def test_a_calibrated_case_shows_the_profile_alone_beside_the_calibration(tmp_path):
    from simulator.validation_table import table

    result = {"rate": 2.5, "turn_overhead_s": 0.0008,
              "errors": errors({"jct_s": {"mean": 1.0}}, {"jct_s": {"mean": 0.97}}),
              "forward_classes": {"all": {"real_over_model": 1.0712}},
              "calibration": {"factor": 1.1, "errors_uncalibrated": errors(
                  {"jct_s": {"mean": 1.0}}, {"jct_s": {"mean": 0.8}})}}
    (tmp_path / "sarathi-LPLD-low-s0.json").write_text(json.dumps(result))
    lines = table([tmp_path]).splitlines()
    assert lines[0].endswith("| forward s | real/model |")
    alone, calibrated = lines[2], lines[3]
    assert alone.startswith("| sarathi-LPLD-low-s0, profile alone |") and "-20.0% *" in alone
    assert calibrated.startswith("| sarathi-LPLD-low-s0, held-out k 1.10, 0.80 ms/forward |")
    assert "-3.0% |" in calibrated and calibrated.endswith("| 1.071 |")
    result["own_speed"] = {"factor": 1.0712, "prompt_factor": 1.3, "turn_overhead_s": 0.0009,
                           "request_latency_s": 0.0047, "errors": errors(
        {"jct_s": {"mean": 1.0}}, {"jct_s": {"mean": 1.01}})}
    (tmp_path / "sarathi-LPLD-low-s0.json").write_text(json.dumps(result))
    own = table([tmp_path]).splitlines()[4]
    assert own.startswith("| sarathi-LPLD-low-s0, own run's k 1.07/1.30, 0.90 ms/forward, "
                          "path 4.7 ms |")
    assert "+1.0% |" in own


def test_a_real_run_reads_the_record_the_simulation_fits_not_the_shared_caches(tmp_path,
                                                                                monkeypatch):
    import simulator.validate as v
    from common.engine.profile import recorded_chunk_size
    from common.protocol import InstanceStats
    from control_plane.routing import LocalPrefillBudget
    from common.config import RoutingConfig

    shared = tmp_path / "cache"
    (shared / "models").mkdir(parents=True)
    (shared / "models" / "weights.gguf").write_text("w")
    record = json.loads(RECORD.read_text())
    slow = [{**row, "seconds": 100.0} for row in record["prefill"]]  # none within the TBT
    (shared / "profile.json").write_text(json.dumps({**record, "threads": 2, "prefill": slow,
                                                     "recommended_chunk_size": 192}))
    one_thread = tmp_path / "profile-threads1.json"
    one_thread.write_text(json.dumps({**record, "threads": 1, "recommended_chunk_size": 64}))
    seen = []
    monkeypatch.setattr(v, "run_for_real", lambda name, flags, threads, requests, arrivals,
                        cache_dir, *rest: (seen.append(cache_dir), ({}, []))[1])
    v.real_run(v.Case("1P1D", "HPLD", "low", 0), [], [], str(shared), tmp_path / "logs",
               str(one_thread))
    own = Path(seen[0])
    assert recorded_chunk_size(str(own)) == 64  # the prefill instance's ChunkSize
    assert recorded_chunk_size(str(shared)) == 192  # the shared cache is left as it was
    routing = RoutingConfig(local_prefill="auto", local_prefill_tbt_s=10.0)
    decode = InstanceStats("d0", "decode", "", "", "", 4096, 100, 100)  # says nothing of itself
    assert LocalPrefillBudget(routing, str(own))(decode) == \
        max(r["tokens"] for r in record["prefill"])
    assert LocalPrefillBudget(routing, str(shared))(decode) == routing.local_prefill_tokens
    assert (own / "models" / "weights.gguf").read_text() == "w"  # models are shared, not copied
    (shared / "kernels").mkdir()  # an entry that appears later is linked on the next run
    v.real_run(v.Case("1P1D", "HPLD", "low", 1), [], [], str(shared), tmp_path / "logs",
               str(one_thread))
    assert seen[1] == seen[0] and (own / "kernels").resolve() == (shared / "kernels").resolve()
