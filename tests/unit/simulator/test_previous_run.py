"""simulator.previous_run: each validation case calibrated on the real run just before it."""

from __future__ import annotations

import json

from simulator.previous_run import chain, measurements, sets
from simulator.validation_table import counts


def own(k: float, **more) -> dict:
    return {"factor": k, "prompt_factor": k + 0.5, "turn_overhead_s": 0.001, "wake_s": 0.01,
            "errors": {"ttft_mean": {}}, **more}


def test_measurements_keep_what_a_run_measured_and_name_it():
    got = measurements("1P1D-LPLD-high-s0", own(1.2, forwards=300, measured_s=4.0))
    assert got == {"source": "1P1D-LPLD-high-s0", "factor": 1.2, "prompt_factor": 1.7,
                   "turn_overhead_s": 0.001, "wake_s": 0.01}
    assert measurements("x", None) is None and measurements("x", {"errors": {}}) is None


def test_each_case_takes_the_run_before_it_the_first_the_held_out_one():
    calibration = {"case_name": "1P1D-LPLD-high-s9", "factor": 1.3, "prompt_factor": 1.6}
    cases = [{"case_name": f"1P1D-LPLD-high-s{i}", "own_speed": own(1.0 + i / 10)}
             for i in range(3)]
    paired = chain(calibration, cases)
    assert [case["case_name"] for case, _ in paired] == [c["case_name"] for c in cases]
    assert [(p["source"], p["factor"]) for _, p in paired] == [
        ("1P1D-LPLD-high-s9", 1.3), ("1P1D-LPLD-high-s0", 1.0), ("1P1D-LPLD-high-s1", 1.1)]
    # no case's own run feeds its own simulation
    assert all(p["source"] != case["case_name"] for case, p in paired)


def test_a_run_without_a_forward_log_passes_the_last_measurements_on():
    cases = [{"case_name": "a", "own_speed": own(1.1)}, {"case_name": "b", "own_speed": None},
             {"case_name": "c", "own_speed": own(1.4)}]
    assert [p and p["source"] for _, p in chain(None, cases)] == [None, "a", "a"]


def case_file(tmp_path, name: str, started: float, layout="1P1D", sampled=False) -> None:
    seed = int(name.split("-s")[1][0])
    case = {"layout": layout, "workload": "LPLD", "rate": "high", "seed": seed,
            "sampled": sampled}
    errors = {m: {"relative_error": 0.01 * started, "within_target": started < 3}
              for m in ("ttft_mean", "ttft_p99", "tpot_mean", "jct_mean", "throughput_tokens")}
    (tmp_path / f"{name}.json").write_text(json.dumps({
        "case": case, "rate": 0.5, "errors": errors, "own_speed": {**own(1.0), "errors": errors},
        "real": {"load_window": [started, started + 1], "summary": {}}}))


def test_sets_group_a_directory_by_layout_workload_rate_and_sampling_in_run_order(tmp_path):
    case_file(tmp_path, "1P1D-LPLD-high-s0", 5.0)  # ran last (a set run again, say)
    case_file(tmp_path, "1P1D-LPLD-high-s1", 1.0)
    case_file(tmp_path, "1P2D-LPLD-high-s0", 2.0, layout="1P2D")
    case_file(tmp_path, "1P1D-LPLD-high-s0-sampled", 3.0, sampled=True)
    for sampled, factor in ((False, 1.5), (True, 1.7)):  # the sampled one's name sorts first
        case = {"layout": "1P1D", "workload": "LPLD", "rate": "high", "seed": 9,
                "sampled": sampled}
        (tmp_path / f"calibration-1P1D-LPLD-high-s9{'-sampled' * sampled}.json").write_text(
            json.dumps({"case": case, "factor": factor}))
    found = sets(tmp_path)
    assert set(found) == {("1P1D", "LPLD", "high", False), ("1P2D", "LPLD", "high", False),
                          ("1P1D", "LPLD", "high", True)}
    calibration, cases = found[("1P1D", "LPLD", "high", False)]
    assert calibration["case_name"] == "1P1D-LPLD-high-s9" and calibration["factor"] == 1.5
    assert found[("1P1D", "LPLD", "high", True)][0]["factor"] == 1.7
    assert [c["case_name"] for c in cases] == ["1P1D-LPLD-high-s1", "1P1D-LPLD-high-s0"]
    assert found[("1P2D", "LPLD", "high", False)][0] is None


def test_counts_read_the_run_before_from_previous_run_json(tmp_path):
    case_file(tmp_path, "1P1D-LPLD-high-s0", 1.0)
    case_file(tmp_path, "1P1D-LPLD-high-s1", 4.0)
    missed = {m: {"relative_error": 0.2, "within_target": False}
              for m in ("ttft_mean", "ttft_p99", "tpot_mean", "jct_mean", "throughput_tokens")}
    (tmp_path / "previous-run.json").write_text(json.dumps({
        "1P1D-LPLD-high-s1": {"run_before": {"source": "1P1D-LPLD-high-s0", "factor": 1.0,
                                              "errors": missed}}}))
    text = counts([tmp_path])
    assert "| held out | 2 | 1 | 1 | 2.5% |" in text
    assert "| run before | 1 | 0 | 0 | 20.0% |" in text
    assert text.splitlines()[3].startswith("| 1P1D-LPLD-high-s1 | 0.50 | k 0.00/0.00: +4.0% * / ")


def test_the_validation_passes_each_case_the_run_before_it(monkeypatch, tmp_path):
    import simulator.validate as v
    import simulator.validation_table as table
    from unit.simulator.test_cli import RECORD

    monkeypatch.setattr(v, "calibrate_case", lambda case, *rest: {"factor": 1.5,
                                                                  "turn_overhead_s": 0.0})
    passed = []

    def run_case(case, *args):
        passed.append((case.name, args[-1] and args[-1]["source"]))
        return {"own_speed": own(1.0 + case.seed / 10) if case.seed != 1 else None}

    monkeypatch.setattr(v, "run_case", run_case)
    monkeypatch.setattr(table, "format_errors", lambda *args: "")  # main's printout
    v.main(["--cases", "1P1D:LPLD:high:*,vllm:LPLD:low:0", "--calibration-seed", "9",
            "--profile", str(RECORD), "--out", str(tmp_path)])
    assert passed == [("1P1D-LPLD-high-s0", "1P1D-LPLD-high-s9"),
                      ("1P1D-LPLD-high-s1", "1P1D-LPLD-high-s0"),
                      ("1P1D-LPLD-high-s2", "1P1D-LPLD-high-s0"),  # s1 ran without a log
                      ("vllm-LPLD-low-s0", "vllm-LPLD-low-s9")]
