"""simulator.speed_probe: the machine's forward speed around each real load, and the held-out
calibration moved by its drift."""

from __future__ import annotations

import pytest

from common.plan import BatchPlan, ForwardShape, ScheduledChunk
from common.sampling_params import SamplingParams
from simulator import speed_probe
from simulator.speed_probe import probe_requests, speeds, tracked

from unit.simulator.test_forward_check import COSTS


def prompt_shape(n: int) -> ForwardShape:
    return BatchPlan([ScheduledChunk("p", list(range(n)), 0, [0], SamplingParams())]).shape()


def line(time: float, shape: ForwardShape, k: float, gap: float = 0.0) -> dict:
    return {"time": time, "shape": shape, "forward_s": k * COSTS.shape_s(shape), "gap_s": gap}


def test_the_probes_are_two_distinct_long_prompts_and_one_decode_run():
    from bench.workload import BenchRequest
    requests = probe_requests(BenchRequest("a load prompt", 3, 64, None))
    assert [r.max_tokens for r in requests] == [1, 1, speed_probe.DECODE_STEPS]
    assert requests[0].prompt != requests[1].prompt  # the second finds nothing cached
    assert len(requests[0].prompt) > 800 and "a load prompt" not in requests[0].prompt
    after = probe_requests(BenchRequest("a load prompt", 3, 64, None), "after")
    # the probes after a load differ from those before it in their first tokens: no cached
    # block is shared
    assert all(a.prompt[:40] != b.prompt[:40] for a, b in zip(requests, after))


def test_speeds_price_the_probes_forwards_per_kind_and_nothing_else():
    step, prompt = ForwardShape.decode_step(1, 30), prompt_shape(128)
    probes = [{"window": [10.0, 12.0]}, {"window": [50.0, 52.0]}]
    lines = [line(10.5, prompt, 1.4), line(11.0, step, 1.1), line(50.5, step, 1.3),
             line(51.0, prompt, 1.4),
             line(11.5, step, 9.0, gap=3.0),  # woke up for: its wake-up is not the speed
             line(30.0, step, 5.0), line(30.1, prompt, 5.0)]  # the load's, between the probes
    measured = speeds(probes, lines, COSTS)
    assert measured["prompt"] == pytest.approx(1.4)
    assert measured["decode"] == pytest.approx(1.2)  # 1.1 and 1.3 at the same price
    assert speeds(probes, lines[:1], COSTS) is None  # no decode step in the windows
    assert speeds([], lines, COSTS) is None


def test_the_held_out_factors_move_by_the_drift_between_the_two_runs_probes():
    calibration = {"factor": 1.1, "prompt_factor": 1.3, "turn_overhead_s": 0.002}
    moved = tracked(calibration, {"decode": 1.2, "prompt": 0.9}, {"decode": 1.0, "prompt": 1.0})
    assert moved["factor"] == pytest.approx(1.32) and moved["prompt_factor"] == pytest.approx(1.17)
    assert moved["turn_overhead_s"] == 0.002  # the other charges stay the held-out run's
    assert moved["drift"] == {"decode": pytest.approx(1.2), "prompt": pytest.approx(0.9)}
    no_prompt_factor = tracked({"factor": 1.1}, {"decode": 1.0, "prompt": 2.0},
                               {"decode": 1.0, "prompt": 1.0})
    assert no_prompt_factor["prompt_factor"] == pytest.approx(2.2)
    assert tracked(calibration, None, {"decode": 1.0, "prompt": 1.0}) is None
    assert tracked(calibration, {"decode": 1.0, "prompt": 1.0}, None) is None
    assert tracked({}, {"decode": 1.0, "prompt": 1.0}, {"decode": 1.0, "prompt": 1.0}) is None


def test_a_case_is_simulated_again_at_the_moved_factors(monkeypatch):
    import simulator.validate as v
    step, prompt = ForwardShape.decode_step(1, 30), prompt_shape(128)
    real = {"summary": {"ttft_s": {"mean": 1.0}},
            "speed_probes": [{"window": [0.0, 1.0]}]}
    logs = {"decode-0": [line(0.5, step, 1.5)], "prefill-0": [line(0.6, prompt, 1.0)]}
    calibration = {"factor": 1.0, "prompt_factor": 1.0, "wake_s": 0.01,
                   "probe_speeds": {"decode": 1.0, "prompt": 1.0}}
    seen = {}

    def simulated(case, requests, arrivals, costs, cache_dir, charges=None):
        seen.update(costs=costs, charges=charges)
        return {"summary": {"ttft_s": {"mean": 1.1}}}

    monkeypatch.setattr(v, "simulated_run", simulated)
    result = speed_probe.speed_tracked(v.Case("1P1D", "HPLD", "low", 0), [], [], real, logs,
                                       COSTS, calibration, "cache", 0.003)
    assert seen["costs"].shape_s(step) == pytest.approx(1.5 * COSTS.shape_s(step))
    assert seen["costs"].shape_s(prompt) == pytest.approx(COSTS.shape_s(prompt))
    assert seen["charges"]["wake_s"] == 0.01 and seen["charges"]["turn_overhead_s"] == 0.003
    assert result["errors"]["ttft_mean"]["relative_error"] == pytest.approx(0.1)
    assert speed_probe.speed_tracked(v.Case("1P1D", "HPLD", "low", 0), [], [], real, logs,
                                     COSTS, None, "cache", 0.0) is None  # no calibration


def test_the_probes_bracket_the_load_and_stay_out_of_its_loop_counters(monkeypatch):
    """The speed probe runs before the load and after the loop counters were read."""
    import simulator.validate as v
    from bench import client
    from bench.workload import BenchRequest
    events = []

    class Cluster:
        url = "http://127.0.0.1:1"

        def model(self):
            return "m"

        def cluster(self):
            events.append("counters")
            return {}

    async def run_load(url, model, requests, arrivals, **kwargs):
        events.append(f"load {len(requests)}")
        return []

    monkeypatch.setattr(client, "run_load", run_load)
    monkeypatch.setattr(v, "loop_counters", lambda cluster: {})
    monkeypatch.setattr(v.request_path, "probe", lambda *a: events.append("path") or {})
    monkeypatch.setattr(v.speed_probe, "probe", lambda *a: events.append("speed") or {})
    monkeypatch.setattr(v.time, "sleep", lambda s: None)
    result, _ = v._load(Cluster(), [BenchRequest("p", 1, 4, None)] * 5, [0.0] * 5, {})
    assert events == ["load 2", "path", "speed", "counters", "load 5", "counters", "speed"]
    assert len(result["speed_probes"]) == 2


def test_the_table_shows_the_moved_calibration_between_held_out_and_own_speed(tmp_path):
    import json

    from simulator.validate import errors
    from simulator.validation_table import table

    def jct(value: float) -> dict:
        return errors({"jct_s": {"mean": 1.0}}, {"jct_s": {"mean": value}})

    result = {"rate": 0.5, "turn_overhead_s": 0.0, "errors": jct(0.8),
              "calibration": {"factor": 1.1, "errors_uncalibrated": jct(0.7)},
              "speed_tracked": {"factor": 1.2, "prompt_factor": 1.3,
                                "drift": {"decode": 1.09, "prompt": 1.18}, "errors": jct(0.96)},
              "own_speed": {"factor": 1.25, "prompt_factor": 1.3, "errors": jct(1.01)}}
    (tmp_path / "1P1D-LPLD-high-s0.json").write_text(json.dumps(result))
    lines = table([tmp_path]).splitlines()[2:]
    assert [line.split(",")[1].split()[0] for line in lines] == ["profile", "held-out",
                                                                "held-out", "own"]
    assert "moved by the probes' drift x1.09/1.18" in lines[2] and "-4.0% |" in lines[2]
